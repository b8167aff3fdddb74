"""Episode -> token layout, the reference episode driver, guarded steps and resumable iterators."""

import threading

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from sao_jax import envs
from sao_jax.envs import base
from sao_jax.envs import calculator
from sao_jax.tokenizers import CharTokenizer


def _scripted(tok, texts, *, stop=True, logprob=-0.25):
  """A generator that replays `texts` (each + <|end|> unless it ends with a stop text) and records calls."""
  calls = []
  queue = list(texts)

  def gen(context, budget, stop_ids):
    calls.append((list(context), budget, stop_ids))
    ids = tok.encode(queue.pop(0))
    if stop and ids[-1] not in stop_ids:
      ids.append(tok.eos_id)
    ids = ids[:budget]
    return ids, [logprob] * len(ids)
  return gen, calls


def _calculator_task(mode='inline', max_turns=3):
  cfg = ml_collections.ConfigDict({'name': 'calculator', 'max_turns': max_turns, 'eval_size': 4,
                                   'kwargs': {'observation_mode': mode, 'observation_role': 'tool'}})
  return envs.get_task(cfg)


class EpisodeToTrajectoryTest(absltest.TestCase):

  def test_layout_masks_logprobs_and_reward(self):
    traj = envs.episode_to_trajectory(
        [1, 2, 3], [envs.Turn([4, 5], [-0.1, -0.2], [6, 7, 8]), envs.Turn([9], [-0.3])], 1.5,
        policy_version=7, info={'k': 1})
    np.testing.assert_array_equal(traj.tokens, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(traj.action_mask, [0, 0, 0, 1, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(traj.behavior_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3])
    self.assertEqual(traj.reward, 1.5)
    self.assertEqual(traj.last_action_index, 8)
    self.assertFalse(traj.truncated)
    self.assertEqual(traj.policy_version, 7)
    self.assertEqual(traj.info, {'k': 1})

  def test_truncated_episode_has_no_reward(self):
    traj = envs.episode_to_trajectory([1], [envs.Turn([2], [-1.0])], 1.0, truncated=True)
    self.assertTrue(traj.truncated)
    self.assertEqual(traj.reward, 0.0)

  def test_sampling_logprobs_follow_the_layout(self):
    traj = envs.episode_to_trajectory([1], [envs.Turn([2, 3], [-1.0, -2.0], [4]), envs.Turn([5], [-3.0])],
                                      0.0, sampling_logprobs=[[-0.5, -0.6], [-0.7]])
    np.testing.assert_allclose(traj.sampling_logprobs, [0, -0.5, -0.6, 0, -0.7])

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, 'log-probs for 2 action tokens'):
      envs.episode_to_trajectory([1], [envs.Turn([2, 3], [-1.0])], 0.0)
    with self.assertRaisesRegex(ValueError, 'at least one action token'):
      envs.episode_to_trajectory([1], [envs.Turn([], [])], 0.0)


class TwoTurnCalculatorEpisodeTest(parameterized.TestCase):
  """The issue's layout test: a two-turn calculator episode, masks and reward position exact."""

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def test_inline_observation(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    gen, calls = _scripted(self.tok, [call, final])
    traj = envs.run_episode(task.make_env(ex), self.tok, gen, limits=envs.EpisodeLimits(3, 64, 512))
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
    # The generator saw the observation in its context and was told to stop on </calc> as well as <|end|>.
    self.assertEqual(calls[1][0], prompt + a1 + obs)
    self.assertEqual(set(calls[0][2]), {self.tok.eos_id, self.tok.token_to_id('</calc>')})

  def test_message_observation(self):
    task = _calculator_task('message')
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    gen, _ = _scripted(self.tok, [call, final])
    traj = envs.run_episode(task.make_env(ex), self.tok, gen, limits=envs.EpisodeLimits(3, 64, 512))
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

  def test_observation_after_a_length_cut_turn_carries_the_missing_stop_token(self):
    hist = [{'role': 'user', 'content': 'q'}]
    ids = envs.message_observation_ids(self.tok, hist, 'abc', False, {'role': 'tool', 'content': '1'})
    self.assertEqual(self.tok.decode(ids, skip_special_tokens=False), '<|end|><|tool|>1<|end|><|assistant|>')
    ids = envs.message_observation_ids(self.tok, hist, 'abc', True, {'role': 'tool', 'content': '1'})
    self.assertEqual(self.tok.decode(ids, skip_special_tokens=False), '<|tool|>1<|end|><|assistant|>')


  def test_inconsistent_template_is_refused(self):

    class Shuffling(CharTokenizer):
      """Renders messages in reverse order: longer conversations do not extend shorter ones."""

      def apply_chat_template(self, messages, *, add_generation_prompt):
        return super().apply_chat_template(list(messages)[::-1], add_generation_prompt=add_generation_prompt)

    with self.assertRaisesRegex(ValueError, 'renders conversations inconsistently'):
      envs.message_observation_ids(Shuffling(), [{'role': 'user', 'content': 'q'}], 'a', True,
                                   {'role': 'tool', 'content': '1'})


class RunEpisodeLimitsTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def test_turn_limit_truncates_with_no_reward(self):
    task = _calculator_task('inline', max_turns=2)
    ex = task.eval_set()[0]
    call, _ = calculator.demo_actions(ex)
    gen, _ = _scripted(self.tok, [call, call])
    traj = envs.run_episode(task.make_env(ex), self.tok, gen, limits=envs.EpisodeLimits(2, 64, 512))
    self.assertTrue(traj.truncated)
    self.assertEqual(traj.reward, 0.0)
    self.assertEqual(traj.info['cut_by'], 'max_turns')
    self.assertEqual(traj.info['num_turns'], 2)

  def test_length_cut_turn_truncates(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    gen, calls = _scripted(self.tok, ['<answer>12345678901234567890</answer>'], stop=False)
    traj = envs.run_episode(task.make_env(ex), self.tok, gen, limits=envs.EpisodeLimits(3, 8, 512))
    self.assertEqual(calls[0][1], 8)
    self.assertEqual(traj.num_action_tokens, 8)
    self.assertTrue(traj.truncated)
    self.assertEqual(traj.info['cut_by'], 'max_new_tokens')

  def test_sequence_budget_truncates(self):
    task = _calculator_task('inline')
    ex = task.eval_set()[0]
    call, final = calculator.demo_actions(ex)
    prompt, _ = self.tok.apply_chat_template(ex.messages(), add_generation_prompt=True)
    budget = len(prompt) + len(self.tok.encode(call)) + 3  # The observation does not fit.
    gen, _ = _scripted(self.tok, [call, final])
    traj = envs.run_episode(task.make_env(ex), self.tok, gen, limits=envs.EpisodeLimits(3, 64, budget))
    self.assertTrue(traj.truncated)
    self.assertEqual(traj.info['cut_by'], 'max_seq_len')
    self.assertLessEqual(len(traj.tokens), budget)


class _Raising(base.BaseEnv):

  def _step(self, action_text):
    raise RuntimeError('boom')


class _Hanging(base.BaseEnv):

  def __init__(self, example, release):
    super().__init__(example)
    self.release = release

  def _step(self, action_text):
    self.release.wait()
    return base.StepResult(None, 1.0, True, {})


class GuardedStepTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.ex = envs.Example('u', 'p', 'a')

  def test_exception_ends_the_episode_with_an_error_and_no_reward(self):
    obs, reward, done, info = envs.guarded_step(_Raising(self.ex), 'x')
    self.assertIsNone(obs)
    self.assertEqual(reward, 0.0)
    self.assertTrue(done)
    self.assertIn('RuntimeError: boom', info['error'])

  def test_timeout_ends_the_episode_with_an_error(self):
    release = threading.Event()
    try:
      obs, reward, done, info = envs.guarded_step(_Hanging(self.ex, release), 'x', timeout_s=0.2)
    finally:
      release.set()
    self.assertEqual((obs, reward, done), (None, 0.0, True))
    self.assertIn('timeout', info['error'])

  def test_run_episode_marks_the_trajectory(self):
    tok = CharTokenizer()
    gen, _ = _scripted(tok, ['hi'])
    env = _Raising(self.ex)
    traj = envs.run_episode(env, tok, gen, limits=envs.EpisodeLimits(1, 8, 64))
    self.assertIn('error', traj.info)
    self.assertEqual(traj.reward, 0.0)

  def test_step_after_done_raises(self):
    env = _Raising(self.ex)
    env.done = True
    with self.assertRaisesRegex(RuntimeError, 'finished episode'):
      env.step('x')


class IteratorTest(parameterized.TestCase):

  def _examples(self, n):
    return [envs.Example(f'e{i}', f'p{i}', str(i)) for i in range(n)]

  def test_shuffled_resume_gives_the_same_next_examples(self):
    it = base.ShuffledIterator(self._examples(5), seed=3)
    for _ in range(7):  # Into the second epoch.
      next(it)
    state = it.state()
    want = [next(it).uid for _ in range(9)]
    fresh = base.ShuffledIterator(self._examples(5), seed=99)
    fresh.restore(state)
    self.assertEqual([next(fresh).uid for _ in range(9)], want)

  def test_shuffled_epochs_are_permutations_and_seeds_differ(self):
    it = base.ShuffledIterator(self._examples(6), seed=0)
    first, second = [next(it).uid for _ in range(6)], [next(it).uid for _ in range(6)]
    self.assertCountEqual(first, second)
    self.assertNotEqual(first, second)
    other = base.ShuffledIterator(self._examples(6), seed=1)
    self.assertNotEqual([next(other).uid for _ in range(6)], first)

  def test_restore_rejects_foreign_state(self):
    it = base.ShuffledIterator(self._examples(5), seed=3)
    with self.assertRaisesRegex(ValueError, 'did the data file change'):
      it.restore({**it.state(), 'size': 4})
    with self.assertRaisesRegex(ValueError, "not a 'shuffled' state"):
      it.restore({'kind': 'generated', 'seed': 0, 'index': 0})

  @parameterized.parameters('arith', 'calculator', 'drift')
  def test_generated_task_resume(self, name):
    task = envs.get_task({'name': name, 'max_turns': 2, 'eval_size': 4, 'kwargs': {}})
    it = task.train_iterator(5)
    for _ in range(3):
      next(it)
    state = it.state()
    want = [next(it).uid for _ in range(5)]
    it2 = envs.get_task({'name': name, 'max_turns': 2, 'eval_size': 4, 'kwargs': {}}).train_iterator(0)
    it2.restore(state)
    self.assertEqual([next(it2).uid for _ in range(5)], want)


if __name__ == '__main__':
  absltest.main()
