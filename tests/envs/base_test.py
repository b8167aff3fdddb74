"""BaseEnv turn limits, guarded steps and resumable iterators (the token layout is tested in tests/rollout)."""

import threading

from absl.testing import absltest
from absl.testing import parameterized

from sao_jax import envs
from sao_jax.envs import base


class _Echo(base.BaseEnv):

  def _step(self, action_text):
    return base.StepResult(f'<result>{self.turn}</result>', 0.0, False, {})


class BaseEnvTest(absltest.TestCase):

  def test_turn_limit_cuts_and_keeps_the_observation(self):
    env = _Echo(envs.Example('u', 'p', 'a'), max_turns=2)
    env.reset()
    self.assertEqual(env.step('x'), ('<result>1</result>', 0.0, False, {'turn': 1}))
    obs, reward, done, info = env.step('x')
    # Not terminal: truncated, no reward; the observation stays (the rollout keeps it as the row's end).
    self.assertEqual((obs, reward, done), ('<result>2</result>', 0.0, True))
    self.assertEqual(info, {'turn': 2, 'truncated': True, 'cut_by': 'max_turns'})


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
