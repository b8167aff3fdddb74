"""ActorThread's failure handling, with a fake actor: failures are counted, their queue room is given back,
and the thread stops after `max_consecutive_failures` in a row (a success in between resets the count)."""

from absl.testing import absltest
import numpy as np

from sao_jax import structs
from sao_jax.rollout import actor as actor_lib
from sao_jax.rollout import trajectory_queue


class _FakeActor:
  continuous = False
  prompts_per_call = 2
  group_size = 1

  def __init__(self, outcomes):
    self.outcomes = list(outcomes)  # 'ok' or 'fail', one per play() call; then the thread is stopped.
    self.thread = None

  def play(self):
    outcome = self.outcomes.pop(0) if self.outcomes else 'stop'
    if outcome == 'stop':
      self.thread.stop()
      return []
    if outcome == 'fail':
      raise RuntimeError('env exploded')
    return [[structs.Trajectory(tokens=np.array([1, 2, 3], np.int32), action_mask=np.array([0, 1, 1], bool),
                             behavior_logprobs=np.array([0.0, -1.0, -1.0], np.float32), reward=1.0)]] * 2  # 2 one-row groups


def _run(outcomes, max_failures=3):
  actor = _FakeActor(outcomes)
  queue = trajectory_queue.TrajectoryQueue(8, group_size=1, max_staleness=100)
  thread = actor_lib.ActorThread(actor, queue, max_consecutive_failures=max_failures)
  actor.thread = thread
  thread.start()
  thread.join(timeout=30)
  assert not thread.is_alive()
  return thread, queue


class ActorThreadTest(absltest.TestCase):

  def test_stops_after_consecutive_failures_and_gives_back_the_room(self):
    thread, queue = _run(['fail', 'fail', 'fail', 'ok'])
    self.assertEqual(thread.failures, 3)
    self.assertIsInstance(thread.error, RuntimeError)
    self.assertEqual(len(queue), 0)  # The 4th call never ran: the thread stopped at 3 failures in a row.
    self.assertTrue(queue.reserve(8, timeout=0.0))  # Every reservation of the failed calls was released.

  def test_a_success_resets_the_count(self):
    thread, queue = _run(['fail', 'fail', 'ok', 'fail', 'fail', 'ok'])
    self.assertEqual(thread.failures, 4)
    self.assertEqual(len(queue), 4)  # Both successful calls' trajectories (2 each) arrived.


if __name__ == '__main__':
  absltest.main()
