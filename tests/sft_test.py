"""The supervised warm start: solution rows, the loss against a numpy reference, steps, the learner hand-off."""

from absl.testing import absltest
import jax
import numpy as np
from flax import nnx

from configs import arith
from sao_jax import parallel
from sao_jax import sft
from sao_jax.envs import registry
from sao_jax.learner import Learner
from sao_jax.models import Decoder, get_model_config
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
    learner = Learner(config, policy=Decoder(MODEL, rngs=nnx.Rngs(0)), mesh=self.mesh, model_config=MODEL)
    before = jax.tree.map(np.asarray, nnx.state(learner.policy_model(), nnx.Param))
    opt_before = jax.tree.map(np.asarray, learner.state.policy.opt_state)
    out = sft.warm_start(learner, self.task, self.tok, config, evaluate=False)
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

  def test_optimizer_schedule_warmup_then_constant_or_cosine(self):
    # SGD with gradient 1 on a scalar moves it by exactly lr(s) at step s: the schedule, read back.
    config = _config(steps=10, lr=0.5)
    config.optim.optimizer = 'sgd'
    config.optim.grad_clip = 0.0
    config.sft.warmup_steps = 2

    def lrs():
      tx = sft.sft_optimizer(config)
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


if __name__ == '__main__':
  absltest.main()
