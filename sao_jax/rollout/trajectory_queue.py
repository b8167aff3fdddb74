"""The bounded queue between actor threads and the learner: staleness filter, whole groups, dynamic sampling.

Actors `put` finished work as *items*: one trajectory for SAO / PPO (single rollouts, taken as they arrive),
or the G trajectories of one prompt for the group baselines (an actor keeps a prompt's rollouts until the
last one finishes, so a group enters the queue whole and a half group can never fill it). The learner takes
`get_batch(rows, learner_version)`: items in arrival order until `rows` trajectories, dropping on the way

  - stale items: staleness = learner_version - the oldest policy version of any turn of any member
    (`Trajectory.policy_version`); an item over `max_staleness` is dropped whole and counted;
  - with `dynamic_sampling` (DAPO), groups whose rewards are all equal (zero group advantage) are dropped and
    counted.

When the queue holds `capacity` trajectories, `put` waits (actors block; nothing is dropped silently).
Actors reserve room BEFORE they generate (`reserve(n)`; `put(..., reserved=True)` then uses the reservation),
so the capacity bounds queued plus in-flight trajectories: with the learner taking B per step, a trajectory
is drawn at most about `capacity / B` versions after its episode started, instead of actors racing ahead
and generating work the staleness filter then throws away.
`close()` wakes every waiter: `put` then raises `QueueClosed`, `get_batch` returns what it has (possibly
fewer rows) once the queue is empty.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np

from sao_jax import structs


class QueueClosed(RuntimeError):
  """The queue was closed (the run is ending); actors stop."""


@dataclasses.dataclass
class QueueStats:
  """Counters since the queue was made (trajectories, not items), and wait times in seconds."""
  put: int = 0
  taken: int = 0
  dropped_stale: int = 0
  dropped_equal_reward: int = 0
  put_wait_s: float = 0.0
  get_wait_s: float = 0.0


@dataclasses.dataclass
class BatchDraw:
  """What one `get_batch` returned: the trajectories, their staleness, and what it dropped on the way."""
  trajectories: list[structs.Trajectory]
  staleness: np.ndarray
  dropped_stale: int
  dropped_equal_reward: int
  wait_s: float

  def metrics(self) -> dict[str, float]:
    lag = self.staleness
    return {
        'staleness/mean': float(lag.mean()) if lag.size else 0.0,
        'staleness/max': float(lag.max()) if lag.size else 0.0,
        'queue/dropped_stale': float(self.dropped_stale),
        'queue/dropped_equal_reward': float(self.dropped_equal_reward),
        'queue/learner_wait_s': self.wait_s,
    }


def staleness(item: Sequence[structs.Trajectory], learner_version: int) -> int:
  """Learner version minus the oldest version that generated any turn of any trajectory of `item`."""
  return int(learner_version) - min(int(t.policy_version) for t in item)


class TrajectoryQueue:
  """Thread-safe bounded queue of items (one trajectory, or one whole group). See the module docstring.

  Args:
    capacity: trajectories held at most (`config.trainer.queue_size`); must hold one item.
    group_size: trajectories per item (`config.algo.group_size`: 1 for SAO/PPO, G for the group baselines).
    max_staleness: items staler than this are dropped at `get_batch` (`config.trainer.max_staleness`).
    dynamic_sampling: drop groups whose rewards are all equal (`config.algo.dynamic_sampling`).
    clock: time source (tests).
  """

  def __init__(self, capacity: int, *, group_size: int = 1, max_staleness: int, dynamic_sampling: bool = False,
               clock=time.monotonic):
    if group_size < 1:
      raise ValueError(f'group_size={group_size} must be >= 1.')
    if capacity < group_size:
      raise ValueError(f'capacity={capacity} cannot hold one group of {group_size} trajectories.')
    self.capacity = int(capacity)
    self.group_size = int(group_size)
    self.max_staleness = int(max_staleness)
    self.dynamic_sampling = bool(dynamic_sampling and group_size > 1)
    self._clock = clock
    self._items: collections.deque[list[structs.Trajectory]] = collections.deque()
    self._size = 0
    self._reserved = 0  # Room promised to episodes being generated.
    self._closed = False
    self._cond = threading.Condition()
    self.stats = QueueStats()

  def __len__(self) -> int:
    """Trajectories held now."""
    with self._cond:
      return self._size

  @property
  def closed(self) -> bool:
    return self._closed

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  def _wait_for_room(self, n: int, deadline: float | None) -> bool:
    """Under the lock: waits until `n` more trajectories fit (queued + reserved); False at the deadline."""
    while not self._closed and self._size + self._reserved + n > self.capacity:
      left = None if deadline is None else deadline - self._clock()
      if left is not None and left <= 0:
        return False
      self._cond.wait(left)
    if self._closed:
      raise QueueClosed('the trajectory queue is closed.')
    return True

  def reserve(self, n: int, timeout: float | None = None) -> bool:
    """Reserves room for `n` trajectories about to be generated, waiting while full; False on timeout.

    Raises:
      QueueClosed: the queue was closed before or while waiting.
    """
    if n > self.capacity:
      raise ValueError(f'cannot reserve {n} trajectories in a queue of capacity {self.capacity}.')
    t0 = self._clock()
    with self._cond:
      if not self._wait_for_room(n, None if timeout is None else t0 + timeout):
        return False
      self._reserved += n
      self.stats.put_wait_s += self._clock() - t0
    return True

  def release(self, n: int) -> None:
    """Gives back `n` reserved trajectories that will not come (a failed batch of episodes)."""
    with self._cond:
      self._reserved = max(0, self._reserved - n)
      self._cond.notify_all()

  def put(self, item: Sequence[structs.Trajectory], timeout: float | None = None, *, reserved: bool = False) -> bool:
    """Adds one item, waiting while the queue is full (unless its room was `reserve`d); False on timeout.

    Raises:
      ValueError: an item that is not `group_size` trajectories of one `group_id` (for groups).
      QueueClosed: the queue was closed before or while waiting.
    """
    item = list(item)
    if len(item) != self.group_size:
      raise ValueError(f'an item must hold group_size={self.group_size} trajectories, got {len(item)}.')
    if self.group_size > 1 and len({t.group_id for t in item}) != 1:
      raise ValueError(f'a group must share one group_id, got {[t.group_id for t in item]}.')
    t0 = self._clock()
    with self._cond:
      if reserved:
        if self._closed:
          raise QueueClosed('the trajectory queue is closed.')
        self._reserved = max(0, self._reserved - len(item))
      elif not self._wait_for_room(len(item), None if timeout is None else t0 + timeout):
        return False
      self._items.append(item)
      self._size += len(item)
      self.stats.put += len(item)
      self.stats.put_wait_s += self._clock() - t0
      self._cond.notify_all()
    return True

  def _rejection(self, item: list[structs.Trajectory], learner_version: int) -> str | None:
    """Why `item` cannot enter a batch ('stale', 'equal_reward') or None."""
    if staleness(item, learner_version) > self.max_staleness:
      return 'stale'
    if self.dynamic_sampling and len({float(t.reward) for t in item}) == 1:
      return 'equal_reward'
    return None

  def get_batch(self, rows: int, learner_version: int, timeout: float | None = None) -> BatchDraw:
    """Takes items in arrival order until `rows` usable trajectories (whole items), waiting for more.

    Returns early with fewer rows only when the queue is closed and empty, or at `timeout` (the caller checks
    `len(draw.trajectories)`; taken trajectories are never put back).

    Raises:
      ValueError: `rows` is not a multiple of `group_size`.
    """
    if rows % self.group_size:
      raise ValueError(f'rows={rows} is not a multiple of group_size={self.group_size}.')
    t0 = self._clock()
    deadline = None if timeout is None else t0 + timeout
    taken: list[list[structs.Trajectory]] = []
    n = 0
    dropped = collections.Counter()
    with self._cond:
      while n < rows:
        while not self._items and not self._closed:
          left = None if deadline is None else deadline - self._clock()
          if left is not None and left <= 0:
            break
          self._cond.wait(left)
        if not self._items:
          break
        item = self._items.popleft()
        self._size -= len(item)
        self._cond.notify_all()
        reason = self._rejection(item, learner_version)
        if reason is None:
          taken.append(item)
          n += len(item)
        else:
          dropped[reason] += len(item)
      wait = self._clock() - t0
      self.stats.taken += n
      self.stats.get_wait_s += wait
      self.stats.dropped_stale += dropped['stale']
      self.stats.dropped_equal_reward += dropped['equal_reward']
      trajectories = [t for item in taken for t in item]
      lag = np.array([staleness([t], learner_version) for t in trajectories], np.int64)
      return BatchDraw(trajectories, lag, dropped['stale'], dropped['equal_reward'], wait)
