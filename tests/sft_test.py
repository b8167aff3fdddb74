"""The supervised warm start: solution rows (single- and multi-turn, against hand-built layouts), the loss against a
numpy reference, steps, the learner hand-off."""

from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import jax
import numpy as np
from flax import nnx

from configs import arith
from configs import calculator as calculator_config
from sao_jax import parallel
from sao_jax import rollout
from sao_jax import sft
from sao_jax.envs import registry
from sao_jax.learner import Learner, LearnerConfig
from sao_jax.models import Decoder, get_model_config
from sao_jax.models import lora
from sao_jax.tokenizers import CharTokenizer

MODEL = get_model_config('tiny', vocab_size=128, embed_dim=32, mlp_dim=64, num_heads=4, num_kv_heads=2,
                         head_dim=8, num_layers=2)
BUCKETS = (64, 96)


def _config(steps=8, lr=1e-2):
  c = arith.get_config('1')
  c.task.eval_size = 8
  c.task.kwargs.answer_format = 'plain'
  c.task.kwargs.scratchpad = 'none'  # The reply is the answer alone (the rows test reads it back).
  c.trainer.seq_buckets = BUCKETS
  c.sampler.max_seq_len = 96
  c.sft.steps = steps
  c.sft.batch_size = 8
  c.sft.lr = lr
  c.sft.num_examples = 8  # One batch, repeated: the loss of every step is on the same rows.
  c.sft.log_every = 0
  return c


def _rows(config, n=8, seed=3):
  task = registry.get_task(config.task)
  tok = CharTokenizer()
  it = task.train_iterator(seed)
  examples = [next(it) for _ in range(n)]
  return task, tok, examples, sft.solution_rows(task, tok, examples, seq_buckets=BUCKETS)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


class SftTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.config = _config()
    cls.task, cls.tok, cls.examples, cls.rows = _rows(cls.config)
    cls.mesh = parallel.make_mesh(cls.config.mesh)

  def test_rows_mask_exactly_the_reply_and_its_end_token_and_the_reply_is_correct(self):
    tokens, mask = self.rows['tokens'], self.rows['mask']
    self.assertEqual(tokens.shape, (8, 64))  # The smallest bucket holding the longest row.
    for b, ex in enumerate(self.examples):
      masked = tokens[b][mask[b] > 0].tolist()
      self.assertEqual(masked[-1], self.tok.eos_id)
      reply = self.tok.decode(masked[:-1])
      self.assertEqual(reply, ex.answer)  # 'plain': the answer alone.
      env = self.task.make_env(ex)
      env.reset()
      self.assertEqual(env.step(reply).reward, 1.0)
      # The prompt before the reply is exactly what an episode's sampler sees (generation prompt included).
      prompt, _ = self.tok.apply_chat_template(ex.messages(), add_generation_prompt=True)
      first = int(np.argmax(mask[b]))
      self.assertEqual(tokens[b, :first].tolist(), prompt)
      end = first + len(masked)
      self.assertTrue(np.all(tokens[b, end:] == self.tok.pad_id))

  def test_loss_matches_numpy_reference(self):
    model = Decoder(MODEL, rngs=nnx.Rngs(1))
    tokens, mask = self.rows['tokens'], self.rows['mask']
    objective = sft.sft_objective()

    @nnx.jit
    def run(model, tokens, mask):
      out = objective.forward(model, {'tokens': tokens}, None)
      return objective.loss(out, {'tokens': tokens, 'mask': mask}, lambda agg: 1.0), model(tokens)

    (loss, metrics), logits = run(model, tokens, mask)
    # Reference: -sum_{b,t} m[b,t] log softmax(logits[b, t-1])[tokens[b, t]] / sum m.
    logp = _log_softmax(np.asarray(logits, np.float64))
    total = 0.0
    for b in range(tokens.shape[0]):
      for t in range(1, tokens.shape[1]):
        total += mask[b, t] * logp[b, t - 1, tokens[b, t]]
    want = -total / mask.sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics['nll']), want, rtol=1e-5)
    self.assertEqual(float(metrics['tokens']), mask.sum())

  def test_warm_start_updates_the_policy_and_rebuilds_the_critic_from_it(self):
    config = self.config
    learner = Learner(LearnerConfig.from_config(config), policy=Decoder(MODEL, rngs=nnx.Rngs(0)), mesh=self.mesh,
                      model_config=MODEL)
    before = jax.tree.map(np.asarray, nnx.state(learner.policy_model(), nnx.Param))
    opt_before = jax.tree.map(np.asarray, learner.state.policy.opt_state)
    out = sft.warm_start(learner, self.task, self.tok, sft.SftConfig.from_config(config), evaluate=False)
    self.assertEqual(out['sft/steps'], 8.0)
    self.assertEqual(out['sft/examples'], 64.0)
    self.assertLess(out['sft/loss_last'], 0.7 * out['sft/loss_first'])  # A few steps on the same rows.
    self.assertNotIn('sft/eval_accuracy', out)
    after = jax.tree.map(np.asarray, nnx.state(learner.policy_model(), nnx.Param))
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))]
    self.assertTrue(all(moved))
    # The RL optimizer is untouched (the warm start has its own), and no learner step was taken.
    jax.tree.map(np.testing.assert_array_equal, opt_before, jax.tree.map(np.asarray, learner.state.policy.opt_state))
    self.assertEqual(learner.step, 0)
    # The critic is the warm-started policy's backbone with a zero head.
    policy = dict(nnx.to_flat_state(nnx.state(learner.policy_model())))
    critic = dict(nnx.to_flat_state(nnx.state(learner.critic_model())))
    for path, var in critic.items():
      keys = tuple(getattr(k, 'key', k) for k in path)
      value = np.asarray(var.get_value())
      if keys[0] == 'backbone':
        np.testing.assert_array_equal(value, np.asarray(policy[keys[1:]].get_value()), err_msg=str(keys))
      else:
        np.testing.assert_array_equal(value, 0.0, err_msg=str(keys))

  def test_warm_start_with_lora_trains_the_adapters_over_the_shared_base(self):
    config = self.config.copy_and_resolve_references()
    config.model.lora.rank = 4
    model = MODEL.replace(lora_rank=4, lora_targets=lora.TARGETS)
    learner = Learner(LearnerConfig.from_config(config), policy=Decoder(model, rngs=nnx.Rngs(0)), mesh=self.mesh,
                      model_config=model)
    base = jax.tree.map(np.asarray, learner.base)
    out = sft.warm_start(learner, self.task, self.tok, sft.SftConfig.from_config(config), evaluate=False)
    self.assertLess(out['sft/loss_last'], out['sft/loss_first'])
    jax.tree.map(np.testing.assert_array_equal, base, jax.tree.map(np.asarray, learner.base))
    b = lambda state: np.asarray(state['layers']['mlp']['up_proj_lora']['b'].get_value())
    self.assertGreater(np.abs(b(learner.state.policy.params)).max(), 0.0)  # B starts at 0.
    # The critic: fresh adapters (B = 0) over the shared base, zero head.
    critic = learner.state.critic.params
    self.assertFalse(np.any(np.asarray(critic['backbone']['layers']['mlp']['up_proj_lora']['b'].get_value())))
    self.assertFalse(np.any(np.asarray(critic['head']['kernel'].get_value())))

  def test_optimizer_schedule_warmup_then_constant_or_cosine(self):
    # SGD with gradient 1 on a scalar moves it by exactly lr(s) at step s: the schedule, read back.
    config = _config(steps=10, lr=0.5)
    config.optim.optimizer = 'sgd'
    config.optim.grad_clip = 0.0
    config.sft.warmup_steps = 2

    def lrs():
      tx = sft.sft_optimizer(sft.SftConfig.from_config(config))
      params = np.zeros((), np.float32)
      state, out = tx.init(params), []
      for _ in range(12):
        updates, state = tx.update(np.ones((), np.float32), state, params)
        out.append(-float(updates))
      return np.array(out)

    config.sft.schedule = 'constant'
    np.testing.assert_allclose(lrs(), [0.0, 0.25] + [0.5] * 10, rtol=1e-6)
    config.sft.schedule = 'cosine'
    config.sft.end_lr_factor = 0.1
    s = np.arange(12)
    d = np.minimum(s - 2, 8)  # Decay over steps - warmup = 8 steps, then the floor.
    want = np.where(s < 2, 0.5 * s / 2, 0.5 * (0.1 + 0.9 * (1 + np.cos(np.pi * d / 8)) / 2))
    np.testing.assert_allclose(lrs(), want, rtol=1e-5, atol=1e-7)


def _calculator_config(mode):
  c = calculator_config.get_config()
  c.task.eval_size = 4
  c.task.kwargs.observation_mode = mode
  c.task.kwargs.observation_role = 'tool'
  return c


def _hand_built(tok, ex, mode):
  """The reference episode's tokens and loss mask, written out from the text of its pieces (char tokenizer):
  prompt | tool call | observation | answer, the assistant's pieces (with their stop tokens) masked in."""
  expr, value = ex.data['expression'], ex.answer
  if mode == 'inline':  # One assistant turn; the model stops at </calc>, the result is appended in its stream.
    call, obs = f'<calc>{expr}</calc>', f'<result>{value}</result>'
  else:  # The call ends the assistant turn; the observation is a tool message, then the next turn opens.
    call, obs = f'<calc>{expr}</calc><|end|>', f'<|tool|><result>{value}</result><|end|><|assistant|>'
  pieces = [(f'<|user|>{ex.prompt}<|end|><|assistant|>', 0), (call, 1), (obs, 0),
            (f'<answer>{value}</answer><|end|>', 1)]
  tokens, mask = [], []
  for text, m in pieces:
    ids = tok.encode(text)
    tokens += ids
    mask += [m] * len(ids)
  return tokens, mask


def _assert_row(tokens, mask, want_tokens, want_mask, pad_id):
  n = len(want_tokens)
  np.testing.assert_array_equal(tokens[:n], want_tokens)
  np.testing.assert_array_equal(mask[:n], want_mask)
  np.testing.assert_array_equal(tokens[n:], pad_id)
  np.testing.assert_array_equal(mask[n:], 0.0)


class MultiTurnRowsTest(parameterized.TestCase):
  """Calculator rows: the whole reference episode, the loss on the assistant's tokens only."""

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def _rows(self, config, n=6):
    task = registry.get_task(config.task)
    it = task.train_iterator(5)
    examples = [next(it) for _ in range(n)]
    rows = sft.solution_rows(task, self.tok, examples, seq_buckets=config.trainer.seq_buckets,
                             limits=rollout.EpisodeLimits.from_config(config))
    return task, examples, rows

  @parameterized.parameters('inline', 'message')
  def test_rows_mask_exactly_the_assistant_turns(self, mode):
    _, examples, rows = self._rows(_calculator_config(mode))
    self.assertEqual(rows['tokens'].shape, (6, 80))  # The smaller of configs/calculator.py's two buckets.
    for b, ex in enumerate(examples):
      want_tokens, want_mask = _hand_built(self.tok, ex, mode)
      _assert_row(rows['tokens'][b], rows['mask'][b], want_tokens, want_mask, self.tok.pad_id)
      # The wrong variant, observation tokens in the loss, fails the same check.
      wrong = np.array(want_mask + [0] * (rows['tokens'].shape[1] - len(want_mask)), np.float32)
      wrong[len(self.tok.encode(f'<|user|>{ex.prompt}<|end|><|assistant|>')):len(want_mask)] = 1.0
      with self.assertRaises(AssertionError):
        _assert_row(rows['tokens'][b], wrong, want_tokens, want_mask, self.tok.pad_id)

  def test_inline_rows_are_not_the_single_message_chat_rendering(self):
    # The naive row, the inline episode as one assistant message of the chat template, has the same tokens but
    # puts the tool's result in the loss: the check above rejects it.
    task, examples, _ = self._rows(_calculator_config('inline'), n=1)
    ex = examples[0]
    call, final = task.solution_actions(ex)
    ids, naive = self.tok.apply_chat_template(
        ex.messages() + [{'role': 'assistant', 'content': f'{call}<result>{ex.answer}</result>{final}'}],
        add_generation_prompt=False)
    want_tokens, want_mask = _hand_built(self.tok, ex, 'inline')
    self.assertEqual(ids, want_tokens)
    with self.assertRaises(AssertionError):
      _assert_row(np.array(ids), np.array(naive, np.float32), want_tokens, want_mask, self.tok.pad_id)

  def test_message_rows_are_the_chat_template_rendering_of_the_conversation(self):
    task, examples, rows = self._rows(_calculator_config('message'))
    for b, ex in enumerate(examples):
      call, final = task.solution_actions(ex)
      ids, assistant = self.tok.apply_chat_template(
          ex.messages() + [{'role': 'assistant', 'content': call},
                           {'role': 'tool', 'content': f'<result>{ex.answer}</result>'},
                           {'role': 'assistant', 'content': final}], add_generation_prompt=False)
      _assert_row(rows['tokens'][b], rows['mask'][b], ids, assistant, self.tok.pad_id)

  def test_single_turn_rows_are_the_chat_template_rendering_of_the_reply(self):
    # arith (the demo's scratchpad replies): what the warm start trained on before multi-turn rows existed.
    config = arith.get_config()
    task = registry.get_task(config.task)
    it = task.train_iterator(5)
    examples = [next(it) for _ in range(8)]
    rows = sft.solution_rows(task, self.tok, examples, seq_buckets=config.trainer.seq_buckets,
                             limits=rollout.EpisodeLimits.from_config(config))
    for b, ex in enumerate(examples):
      ids, assistant = self.tok.apply_chat_template(
          ex.messages() + [{'role': 'assistant', 'content': task.solution(ex)}], add_generation_prompt=False)
      _assert_row(rows['tokens'][b], rows['mask'][b], ids, assistant, self.tok.pad_id)

  def test_a_wrong_cut_or_short_reference_is_refused(self):
    config = _calculator_config('inline')
    task = registry.get_task(config.task)
    ex = next(task.train_iterator(5))
    limits = rollout.EpisodeLimits.from_config(config)
    call, _ = task.solution_actions(ex)
    cases = [([call, '<answer>1</answer>'], limits, 'got reward 0.0'),  # A wrong answer.
             ([call], limits, 'wants a turn after the 1 given'),  # The episode needs one more turn.
             ([call, call, call, call, call], limits, 'ended after 4 of the 5'),  # The turn limit came first.
             (task.solution_actions(ex), rollout.EpisodeLimits(4, 8, 128), 'ended after 1 of the 2')]  # Turn budget.
    for actions, lim, error in cases:
      with mock.patch.object(task, 'solution_actions', return_value=actions):
        with self.assertRaisesRegex(ValueError, error):
          sft.solution_rows(task, self.tok, [ex], seq_buckets=(128,), limits=lim)

  def test_the_calculator_config_holds_its_reference_episodes(self):
    # The sampler's budgets and the learner's bucket hold the warm start's rows (the rows raise otherwise).
    config = calculator_config.get_config()
    _, _, rows = self._rows(config, n=256)
    self.assertEqual(rows['tokens'].shape, (256, 80))


if __name__ == '__main__':
  absltest.main()
