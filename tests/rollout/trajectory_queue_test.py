"""Tests of the bounded trajectory queue: staleness bound, whole groups, dynamic sampling, blocking, closing."""

import threading

from absl.testing import absltest
import numpy as np

from sao_jax import structs
from sao_jax.rollout import trajectory_queue as tq


def traj(version=0, reward=0.0, group_id=-1, n=3):
  return structs.Trajectory(tokens=np.arange(n), action_mask=np.ones(n, bool), behavior_logprobs=np.zeros(n),
                          reward=reward, policy_version=version, group_id=group_id)


class TrajectoryQueueTest(absltest.TestCase):

  def test_takes_in_arrival_order_and_drops_stale(self):
    q = tq.TrajectoryQueue(16, max_staleness=2)
    for v in (5, 1, 4, 2, 6, 3):
      q.put([traj(version=v)])
    draw = q.get_batch(3, learner_version=6)
    # Lag 1, 5 (dropped), 2, 4 (dropped), 0: the bound is inclusive (lag 2 is kept).
    self.assertEqual([t.policy_version for t in draw.trajectories], [5, 4, 6])
    self.assertEqual(draw.staleness.tolist(), [1, 2, 0])
    self.assertEqual(draw.dropped_stale, 2)
    self.assertEqual(len(q), 1)  # Version 3 is still queued.
    self.assertEqual(q.stats.dropped_stale, 2)
    self.assertEqual(draw.metrics()['staleness/max'], 2.0)

  def test_groups_enter_whole_and_a_stale_member_drops_the_group(self):
    q = tq.TrajectoryQueue(16, group_size=2, max_staleness=1)
    q.put([traj(version=3, group_id=0), traj(version=1, group_id=0)])  # Oldest member lags 2: dropped.
    q.put([traj(version=3, group_id=1), traj(version=2, group_id=1)])
    q.put([traj(version=3, group_id=2), traj(version=3, group_id=2)])
    draw = q.get_batch(4, learner_version=3)
    self.assertEqual([t.group_id for t in draw.trajectories], [1, 1, 2, 2])
    self.assertEqual(draw.dropped_stale, 2)
    with self.assertRaisesRegex(ValueError, 'group_size=2'):
      q.put([traj(group_id=3)])
    with self.assertRaisesRegex(ValueError, 'one group_id'):
      q.put([traj(group_id=3), traj(group_id=4)])
    with self.assertRaisesRegex(ValueError, 'multiple of group_size'):
      q.get_batch(3, learner_version=3)

  def test_dynamic_sampling_drops_equal_reward_groups(self):
    q = tq.TrajectoryQueue(16, group_size=2, max_staleness=8, dynamic_sampling=True)
    q.put([traj(reward=1.0, group_id=0), traj(reward=1.0, group_id=0)])
    q.put([traj(reward=0.0, group_id=1), traj(reward=0.0, group_id=1)])
    q.put([traj(reward=1.0, group_id=2), traj(reward=0.0, group_id=2)])
    draw = q.get_batch(2, learner_version=0)
    self.assertEqual([t.group_id for t in draw.trajectories], [2, 2])
    self.assertEqual(draw.dropped_equal_reward, 4)
    # Single rollouts are never "equal-reward groups".
    q1 = tq.TrajectoryQueue(4, max_staleness=8, dynamic_sampling=True)
    q1.put([traj(reward=1.0)])
    self.assertLen(q1.get_batch(1, learner_version=0).trajectories, 1)

  def test_put_waits_while_full_and_resumes_when_the_learner_takes(self):
    q = tq.TrajectoryQueue(2, max_staleness=8)
    q.put([traj()])
    q.put([traj()])
    self.assertFalse(q.put([traj()], timeout=0.01))  # Full: the actor waits (here: times out), nothing lost.
    self.assertEqual(len(q), 2)
    done = threading.Event()

    def actor():
      q.put([traj(version=7)])
      done.set()

    t = threading.Thread(target=actor)
    t.start()
    self.assertFalse(done.wait(0.05))
    self.assertLen(q.get_batch(1, learner_version=0).trajectories, 1)
    t.join(5)
    self.assertTrue(done.is_set())
    self.assertEqual([x.policy_version for x in q.get_batch(2, learner_version=7).trajectories], [0, 7])
    self.assertEqual(q.stats.put, 3)
    self.assertEqual(q.stats.taken, 3)

  def test_get_batch_waits_for_actors(self):
    q = tq.TrajectoryQueue(8, max_staleness=8)
    threads = [threading.Thread(target=q.put, args=([traj(version=i)],)) for i in range(3)]
    for t in threads:
      t.start()
    draw = q.get_batch(3, learner_version=3)
    for t in threads:
      t.join(5)
    self.assertCountEqual([x.policy_version for x in draw.trajectories], [0, 1, 2])

  def test_close_wakes_waiters(self):
    q = tq.TrajectoryQueue(1, max_staleness=8)
    q.put([traj()])
    errors = []

    def actor():
      try:
        q.put([traj()])
      except tq.QueueClosed as e:
        errors.append(e)

    t = threading.Thread(target=actor)
    t.start()
    q.close()
    t.join(5)
    self.assertLen(errors, 1)
    draw = q.get_batch(4, learner_version=0)  # Closed: returns what is left instead of waiting forever.
    self.assertLen(draw.trajectories, 1)
    with self.assertRaises(tq.QueueClosed):
      q.put([traj()])

  def test_get_batch_timeout_returns_partial(self):
    q = tq.TrajectoryQueue(4, max_staleness=8)
    q.put([traj()])
    draw = q.get_batch(2, learner_version=0, timeout=0.01)
    self.assertLen(draw.trajectories, 1)

  def test_reservations_bound_queued_plus_in_flight(self):
    q = tq.TrajectoryQueue(4, max_staleness=8)
    self.assertTrue(q.reserve(3))  # An actor is generating 3 episodes.
    self.assertFalse(q.reserve(2, timeout=0.01))  # A second actor must wait: 3 + 2 > 4.
    self.assertFalse(q.put([traj()], timeout=0.01) and q.put([traj()], timeout=0.01))  # Unreserved puts too.
    self.assertEqual(len(q), 1)
    for _ in range(3):
      q.put([traj()], reserved=True)  # The reserved ones always go in.
    self.assertEqual(len(q), 4)
    q.get_batch(2, learner_version=0)
    self.assertTrue(q.reserve(2, timeout=0.01))  # Room again once the learner took some.
    q.release(2)  # That batch failed: its room comes back.
    self.assertTrue(q.reserve(2, timeout=0.01))
    with self.assertRaisesRegex(ValueError, 'capacity'):
      q.reserve(5)
    q.close()
    with self.assertRaises(tq.QueueClosed):
      q.reserve(1)

  def test_capacity_must_hold_a_group(self):
    with self.assertRaisesRegex(ValueError, 'cannot hold one group'):
      tq.TrajectoryQueue(4, group_size=8, max_staleness=0)


if __name__ == '__main__':
  absltest.main()
