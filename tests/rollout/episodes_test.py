"""The one episode runner: multi-turn layout (both observation modes), truncation layouts, groups, versions,
timing, out-of-vocabulary ids, batching, and the KV-cache backend against independent references."""

import collections
import threading
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from configs import calculator as calculator_config
from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import base
from sao_jax.envs import calculator
from sao_jax.envs import registry
from sao_jax.generate.sampling import SamplingParams
from sao_jax.tokenizers import CharTokenizer
from tests.rollout import helpers


def _calculator_task(mode='inline', max_turns=3):
  cfg = ml_collections.ConfigDict({'name': 'calculator', 'max_turns': max_turns, 'eval_size': 4,
                                   'kwargs': {'observation_mode': mode, 'observation_role': 'tool'}})
  return envs.get_task(cfg)


class TwoTurnCalculatorEpisodeTest(parameterized.TestCase):
  """A two-turn calculator episode: tokens, masks, log-probs and reward position exact, in both modes."""

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def test_inline_observation(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    gen, calls = helpers.scripted(self.tok, [call, final])
    traj = rollout.run_episode(task.make_env(ex), self.tok, gen, limits=rollout.EpisodeLimits(3, 64, 512),
                               group_id=11, version=3)
    prompt, _ = self.tok.apply_chat_template(ex.messages(), add_generation_prompt=True)
    a1 = self.tok.encode(call)  # Ends with the </calc> stop token: no <|end|>.
    obs = self.tok.encode(f'<result>{ex.answer}</result>')  # The tool computed the expression.
    a2 = self.tok.encode(final) + [self.tok.eos_id]
    np.testing.assert_array_equal(traj.tokens, prompt + a1 + obs + a2)
    want_mask = [0] * len(prompt) + [1] * len(a1) + [0] * len(obs) + [1] * len(a2)
    np.testing.assert_array_equal(traj.action_mask, want_mask)
    np.testing.assert_allclose(traj.behavior_logprobs, np.where(want_mask, -0.25, 0.0))
    self.assertEqual(traj.reward, 1.0)
    self.assertEqual(traj.last_action_index, len(traj.tokens) - 1)  # The reward sits on <|end|> of turn 2.
    self.assertFalse(traj.truncated)
    self.assertEqual(traj.info['tool_calls'], 1)
    self.assertEqual((traj.group_id, traj.turn_versions, traj.policy_version, traj.greedy), (11, (3, 3), 3, False))
    # The generator saw the observation in its context and was told to stop on </calc> as well as <|end|>.
    self.assertEqual(calls[1][0], prompt + a1 + obs)
    self.assertEqual(set(calls[0][2]), {self.tok.eos_id, self.tok.token_to_id('</calc>')})

  def test_message_observation(self):
    task = _calculator_task('message')
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    gen, _ = helpers.scripted(self.tok, [call, final])
    traj = rollout.run_episode(task.make_env(ex), self.tok, gen, limits=rollout.EpisodeLimits(3, 64, 512))
    result = calculator.tool_result(ex.data['expression'], task.opts)
    whole, assistant_mask = self.tok.apply_chat_template(
        ex.messages() + [{'role': 'assistant', 'content': call}, {'role': 'tool', 'content': result},
                         {'role': 'assistant', 'content': final}], add_generation_prompt=False)
    # Same tokens as the template renders the whole conversation, and the same assistant mask.
    np.testing.assert_array_equal(traj.tokens, whole)
    np.testing.assert_array_equal(traj.action_mask, assistant_mask)
    self.assertEqual(traj.reward, 1.0)
    self.assertEqual(traj.last_action_index, len(whole) - 1)
    obs_text = self.tok.decode(traj.tokens[~traj.action_mask][-len(self.tok.encode(result)) - 3:],
                               skip_special_tokens=False)
    self.assertEqual(obs_text, f'<|tool|>{result}<|end|><|assistant|>')


class TruncationLayoutTest(parameterized.TestCase):
  """Each kind of cut ends the row in the state the learner bootstraps from, or marks it for dropping."""

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def _prompt(self, ex):
    return self.tok.apply_chat_template(ex.messages(), add_generation_prompt=True)[0]

  @parameterized.parameters('inline', 'message')
  def test_turn_limit_keeps_the_final_observation(self, mode):
    task = _calculator_task(mode, max_turns=2)
    ex = task.eval_set()[0]
    call, _ = calculator.demo_actions(ex)
    gen, calls = helpers.scripted(self.tok, [call, call])
    traj = rollout.run_episode(task.make_env(ex), self.tok, gen, limits=rollout.EpisodeLimits(2, 64, 512))
    self.assertTrue(traj.truncated)
    self.assertTrue(traj.bootstrappable)
    self.assertEqual(traj.reward, 0.0)
    self.assertEqual((traj.info['cut_by'], traj.info['num_turns']), ('max_turns', 2))
    result = calculator.tool_result(ex.data['expression'], task.opts)
    if mode == 'inline':
      a = self.tok.encode(call)
      o = self.tok.encode(result)
      want = self._prompt(ex) + a + o + a + o
    else:
      msgs = ex.messages() + [{'role': 'assistant', 'content': call}, {'role': 'tool', 'content': result}] * 2
      want, _ = self.tok.apply_chat_template(msgs, add_generation_prompt=True)  # Opens the next turn.
    np.testing.assert_array_equal(traj.tokens, want)
    # The row ends with the final observation (non-action tokens) and the generator was called twice only.
    n_obs = len(self.tok.encode(result)) + (0 if mode == 'inline' else 3)  # <|tool|> ... <|end|><|assistant|>
    self.assertFalse(traj.action_mask[-n_obs:].any())
    self.assertTrue(traj.action_mask[-n_obs - 1])
    self.assertLen(calls, 2)

  def test_length_cut_ends_mid_turn_on_an_action_token(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    gen, calls = helpers.scripted(self.tok, ['<answer>12345678901234567890</answer>'], stop=False)
    traj = rollout.run_episode(task.make_env(ex), self.tok, gen, limits=rollout.EpisodeLimits(3, 8, 512))
    self.assertEqual(calls[0][1], 8)
    self.assertEqual(traj.num_action_tokens, 8)
    self.assertTrue(traj.action_mask[-1])
    self.assertEqual(len(traj.tokens), len(self._prompt(ex)) + 8)
    self.assertTrue(traj.truncated and traj.bootstrappable)
    self.assertEqual(traj.info['cut_by'], 'max_new_tokens')

  @parameterized.parameters(3, 2)
  def test_observation_overflow_is_marked_not_bootstrappable(self, max_turns):
    # max_turns=2: the overflowing observation is also the final one of a turn-limit cut.
    task = _calculator_task('inline', max_turns=max_turns)
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    prompt = self._prompt(ex)
    a1, a2 = self.tok.encode(call), self.tok.encode(call)
    obs = self.tok.encode(calculator.tool_result(ex.data['expression'], task.opts))
    # Turn 1's observation fits; turn 2's does not.
    budget = len(prompt) + len(a1) + len(obs) + len(a2) + 3
    gen, _ = helpers.scripted(self.tok, [call, call, final])
    traj = rollout.run_episode(task.make_env(ex), self.tok, gen, limits=rollout.EpisodeLimits(3, 64, budget))
    np.testing.assert_array_equal(traj.tokens, prompt + a1 + obs + a2)  # Ends on the stop token </calc>.
    self.assertTrue(traj.truncated)
    self.assertFalse(traj.bootstrappable)
    self.assertEqual(traj.info['cut_by'], 'max_seq_len')
    self.assertEqual(traj.reward, 0.0)

  def test_turn_limit_without_a_final_observation_is_not_bootstrappable(self):

    class NoFinalObservation(base.BaseEnv):
      def _step(self, action_text):
        return base.StepResult(None if self.turn >= self.max_turns else 'o', 0.0, False, {})

    ex = envs.Example('u', 'p', 'a')
    gen, _ = helpers.scripted(self.tok, ['x', 'y'])
    traj = rollout.run_episode(NoFinalObservation(ex, max_turns=2), self.tok, gen,
                               limits=rollout.EpisodeLimits(2, 8, 64))
    self.assertTrue(traj.truncated)
    self.assertFalse(traj.bootstrappable)
    self.assertEqual(traj.info['cut_by'], 'max_turns')
    self.assertEqual(traj.tokens[-1], self.tok.eos_id)

  def test_env_error_marks_the_trajectory(self):

    class Raising(base.BaseEnv):
      def _step(self, action_text):
        raise RuntimeError('boom')

    gen, _ = helpers.scripted(self.tok, ['hi'])
    traj = rollout.run_episode(Raising(envs.Example('u', 'p', 'a')), self.tok, gen,
                               limits=rollout.EpisodeLimits(1, 8, 64))
    self.assertIn('RuntimeError: boom', traj.info['error'])
    self.assertEqual(traj.reward, 0.0)
    self.assertFalse(traj.truncated)


class _ThreadClock:
  """A fake clock per thread: `clock[0]` reads / advances the calling thread's time (threads start at 0)."""

  def __init__(self):
    self._t = collections.defaultdict(float)

  def __getitem__(self, i):
    return self._t[threading.get_ident()]

  def __setitem__(self, i, value):
    self._t[threading.get_ident()] = value


class _BarrierEnv(base.BaseEnv):
  """Each step waits at a barrier shared by all rows: steps that ran one after another would break it."""
  observation_mode = 'inline'

  def __init__(self, example, barrier):
    super().__init__(example, max_turns=3)
    self.barrier = barrier

  def _step(self, action_text):
    self.barrier.wait()
    return base.StepResult('<result>1</result>', 0.0, False, {}) if self.turn < 2 else \
        base.StepResult(None, 1.0, True, {})


class RunnerTest(parameterized.TestCase):

  def test_env_steps_of_a_turn_run_concurrently(self):
    """The rows of one turn step their envs at once: a turn waits for its slowest tool call, not the sum."""
    rows = 4
    barrier = threading.Barrier(rows, timeout=10.0)
    example = base.Example(uid='x', prompt='hi', answer='1')
    eos = self.tok.eos_id
    backend = rollout.ContextBackend(lambda c, n, s: ([eos], [0.0]), self.tok.stop_ids)
    got = rollout.run_episodes(backend, self.tok, [_BarrierEnv(example, barrier) for _ in range(rows)],
                               limits=rollout.EpisodeLimits(3, 8, 128), decoding=SamplingParams(),
                               seeds=list(range(rows)))
    self.assertEqual([t.info.get('error') for t in got], [None] * rows)
    self.assertEqual([(t.reward, t.info['num_turns']) for t in got], [(1.0, 2)] * rows)

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  @parameterized.parameters('inline', 'message')
  def test_batching_does_not_change_an_episode(self, mode):
    """All rows together, turn by turn == each episode alone (rows do not leak into each other)."""
    config = calculator_config.get_config('3')
    config.task.eval_size = 10
    config.task.kwargs.observation_mode = mode
    task = registry.get_task(config.task)
    examples = task.eval_set()
    gen = helpers.StatelessCalc(self.tok, helpers.prompt_index(self.tok, examples), helpers.calc_script(examples))
    limits = rollout.EpisodeLimits.from_config(config)
    batch = [task.make_env(ex) for ex in examples]
    group_ids = [100 + i // 2 for i in range(len(examples))]
    backend = rollout.ContextBackend(gen, rollout.stop_ids_for(batch[0], self.tok), version=5)
    got = rollout.run_episodes(backend, self.tok, batch, limits=limits, decoding=SamplingParams(),
                               seeds=list(range(len(batch))), group_ids=group_ids)
    want = [rollout.run_episode(task.make_env(ex), self.tok, gen, limits=limits, group_id=g, version=5)
            for ex, g in zip(examples, group_ids)]
    turns = []
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g.tokens, w.tokens)
      np.testing.assert_array_equal(g.action_mask, w.action_mask)
      np.testing.assert_array_equal(g.behavior_logprobs, w.behavior_logprobs)
      self.assertEqual((g.reward, g.truncated, g.bootstrappable), (w.reward, w.truncated, w.bootstrappable))
      self.assertEqual(g.info, w.info)
      turns.append(g.info['num_turns'])
    self.assertEqual([t.group_id for t in got], group_ids)
    self.assertTrue(all(t.turn_versions == (5,) * t.info['num_turns'] for t in got))
    # The script really produced 1-, 2- and 3-turn episodes, right and wrong, cut and complete.
    self.assertEqual(turns[:5], [1, 2, 3, 1, 2])
    self.assertEqual([t.reward for t in got[:5]], [1.0, 1.0, 0.0, 0.0, 0.0])
    self.assertEqual([t.truncated for t in got[:5]], [False, False, True, True, False])
    self.assertEqual(got[2].info['cut_by'], 'max_turns')
    self.assertEqual(got[3].info['cut_by'], 'max_new_tokens')

  def test_backend_must_stop_on_the_env_stop_texts(self):
    config = calculator_config.get_config()
    config.task.eval_size = 2
    task = registry.get_task(config.task)
    backend = rollout.ContextBackend(lambda c, n, s: ([self.tok.eos_id], [0.0]), self.tok.stop_ids)
    batch = [task.make_env(ex) for ex in task.eval_set()]
    with self.assertRaisesRegex(ValueError, r'does not stop on token\(s\) \[%d\]' % self.tok.token_to_id('</calc>')):
      rollout.run_episodes(backend, self.tok, batch, limits=rollout.EpisodeLimits.from_config(config),
                           decoding=SamplingParams(), seeds=[0, 1])
    with self.assertRaisesRegex(ValueError, '2 seeds and 1 group ids for 2 envs'):
      rollout.run_episodes(rollout.ContextBackend(lambda c, n, s: ([], []), self.tok.stop_ids + (0,)),
                           self.tok, batch, limits=rollout.EpisodeLimits(), decoding=SamplingParams(),
                           seeds=[0, 1], group_ids=[0])

  def test_out_of_vocabulary_ids_are_kept_as_tokens_and_dropped_from_the_text(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    _, final = calculator.demo_actions(ex)
    oov = self.tok.vocab_size + 5  # An untrained model with a larger embedding table emits such ids.
    ids = [oov] + self.tok.encode(final) + [self.tok.eos_id]
    traj = rollout.run_episode(task.make_env(ex), self.tok, lambda c, n, s: (ids, [-1.0] * len(ids)),
                               limits=rollout.EpisodeLimits(3, 64, 512))
    self.assertEqual(traj.reward, 1.0)  # The env saw the decodable text.
    self.assertEqual(traj.num_action_tokens, len(ids))
    self.assertIn(oov, traj.tokens.tolist())

  def test_timing_per_row(self):
    """Generation seconds = the backend calls a row took part in; env seconds = its own steps (fake clock)."""
    clock = _ThreadClock()  # The rows' env steps run in threads of their own: one fake clock per thread.
    task = _calculator_task('inline', max_turns=3)
    examples = task.eval_set()[:2]
    call, _ = calculator.demo_actions(examples[0])
    finals = [calculator.demo_actions(ex)[1] for ex in examples]
    index = helpers.prompt_index(self.tok, examples)

    def gen(context, budget, stop_ids):
      clock[0] += 1.0
      i, n = helpers.problem_of(context, index)
      text = call if (i == 1 and n == len(context)) else finals[i]  # Row 1 calls the tool once.
      ids = self.tok.encode(text)
      ids = ids if ids[-1] in stop_ids else ids + [self.tok.eos_id]
      return ids, [0.0] * len(ids)

    step = base.BaseEnv.step

    def slow_step(env, text):
      clock[0] += 0.25
      return step(env, text)

    backend = rollout.ContextBackend(gen, rollout.stop_ids_for(task.make_env(examples[0]), self.tok))
    with mock.patch.object(rollout.episodes.time, 'perf_counter', lambda: clock[0]), \
         mock.patch.object(base.BaseEnv, 'step', slow_step):
      got = rollout.run_episodes(backend, self.tok, [task.make_env(ex) for ex in examples],
                                 limits=rollout.EpisodeLimits(3, 64, 512), decoding=SamplingParams(), seeds=[0, 1])
    self.assertEqual([t.info['num_turns'] for t in got], [1, 2])
    # Call 1 generates both rows (2 s, both rows took part); call 2 only row 1 (1 s).
    self.assertEqual([t.generate_seconds for t in got], [2.0, 3.0])
    self.assertEqual([t.env_seconds for t in got], [0.25, 0.5])


class SamplerBackendTest(parameterized.TestCase):
  """The KV-cache backend: multi-turn episodes continued from the cache against plain-forward references."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tok = CharTokenizer()
    cls.model = helpers.small_model(cls.tok.vocab_size, seed=3)
    # Nearly every character ends a turn, so episodes really go through several continuations.
    cls.stop_texts = tuple('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-*/=(). ')
    cls.examples = [base.Example(uid=str(i), prompt=p, answer='0') for i, p in
                    enumerate(['12+7=?', 'What is 3*45?', 'x', '99-100', 'hello there'])]
    cls.limits = rollout.EpisodeLimits(max_turns=3, max_new_tokens=6, max_seq_len=128)
    env = helpers.EchoTask(cls.examples, 'inline', cls.stop_texts, 3).make_env(cls.examples[0])
    cls.backend = rollout.SamplerBackend(cls.model, stop_ids=rollout.stop_ids_for(env, cls.tok),
                                         pad_id=cls.tok.pad_id, max_total_len=128, min_rows=8, version=4)
    cls.forward = helpers.PlainForward(cls.model, 128)

  def _play(self, mode, decoding, on_step=None):
    task = helpers.EchoTask(self.examples, mode, self.stop_texts, 3, on_step)
    return rollout.run_episodes(self.backend, self.tok, [task.make_env(ex) for ex in self.examples],
                                limits=self.limits, decoding=decoding, seeds=list(range(len(self.examples))),
                                group_ids=[7] * len(self.examples))

  def test_multi_turn_greedy_matches_plain_forward(self):
    ref = helpers.PlainGreedy(self.model, 128)
    for mode in ('inline', 'message'):  # One backend: same stop ids, programs compiled once.
      with self.subTest(mode):
        task = helpers.EchoTask(self.examples, mode, self.stop_texts, 3)
        got = self._play(mode, SamplingParams(temperature=0.0))
        want = [rollout.run_episode(task.make_env(ex), self.tok, ref, limits=self.limits) for ex in self.examples]
        for g, w in zip(got, want):
          np.testing.assert_array_equal(g.tokens, w.tokens)
          np.testing.assert_array_equal(g.action_mask, w.action_mask)
          # The reference returns temperature-1 log-probs; greedy behaviour log-probs are a point mass's (0).
          np.testing.assert_allclose(g.policy_logprobs, w.behavior_logprobs, atol=2e-4)
          np.testing.assert_array_equal(g.behavior_logprobs, 0.0)
          self.assertTrue(g.greedy)
          self.assertEqual(g.info, w.info)
          self.assertEqual((g.group_id, g.policy_version), (7, 4))
        self.assertGreaterEqual(sum(t.info['num_turns'] >= 2 for t in got), 2, [t.info for t in got])

  def test_behaviour_logprobs_are_the_sampled_distributions(self):
    """At temperature 0.7 and top-k 5: behaviour = log q(a) from the model's logits, computed here."""
    temperature, k = 0.7, 5
    got = self._play('message', SamplingParams(temperature=temperature, top_k=k))
    self.assertGreaterEqual(sum(t.info['num_turns'] >= 2 for t in got), 2)
    checked = 0
    for traj in got:
      logits = self.forward.logits(traj.tokens)
      for t in np.flatnonzero(traj.action_mask):
        z = logits[t - 1]  # The token at t was drawn from the logits at t - 1.
        a = traj.tokens[t]
        zt = z / temperature
        kth = np.sort(zt)[-k]
        kept = zt >= kth
        self.assertTrue(kept[a], 'a token outside the top-k was sampled')
        log_q = zt[a] - np.log(np.exp(zt[kept] - zt.max()).sum()) - zt.max()
        log_pi = z[a] - np.log(np.exp(z - z.max()).sum()) - z.max()
        np.testing.assert_allclose(traj.behavior_logprobs[t], log_q, atol=2e-4)
        np.testing.assert_allclose(traj.policy_logprobs[t], log_pi, atol=2e-4)
        checked += 1
      np.testing.assert_array_equal(traj.behavior_logprobs[~traj.action_mask], 0.0)
    self.assertGreater(checked, 20)
    # The two really differ (a test that confused them would fail).
    diffs = np.concatenate([np.abs(t.behavior_logprobs - t.policy_logprobs) for t in got])
    self.assertGreater(diffs.max(), 0.1)

  def test_each_turn_records_the_version_that_generated_it(self):
    other = helpers.small_model(self.tok.vocab_size, seed=9)
    self.addCleanup(self.backend.update_weights, self.model, version=4)

    def swap(env):  # After the first turn of the first row, new weights are published (as an actor would).
      if self.backend.sampler.version == 4:
        self.backend.update_weights(other, version=5)

    got = self._play('inline', SamplingParams(temperature=0.0), on_step=swap)  # Reuses the greedy programs.
    multi = [t for t in got if t.info['num_turns'] >= 2]
    self.assertNotEmpty(multi)
    for t in got:
      self.assertEqual(t.turn_versions, (4,) + (5,) * (t.info['num_turns'] - 1))
      self.assertEqual(t.policy_version, 4)


if __name__ == '__main__':
  absltest.main()
