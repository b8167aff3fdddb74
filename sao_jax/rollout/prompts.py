"""Prompt streams: the task's training examples, as the actors take them.

    stream = task.train_iterator(seed)
    stream = ProcessShard(stream, jax.process_index(), jax.process_count())   # several processes
    prompts = PromptSource(stream)
    numbered = prompts.take(n)      # [(number, example), ...]

`PromptSource` hands out the task's training examples to every actor under a lock, numbered in the order
taken; a prompt's G rollouts share its number as `group_id`, and each episode's sampling seed is
`episode_seed(config.seed, number, j)`, so what a prompt generates does not depend on which actor took it.
Its `state()` (the iterator's position) goes into checkpoints: a resumed run continues with the next prompt
not yet handed out (prompts that were in flight or queued at the save are not replayed).

`ProcessShard` gives each process of a multi-process run its own disjoint share of the stream.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from sao_jax.envs.base import Example, ExampleIterator


class PromptSource:
  """The task's training examples, handed out under a lock and numbered in order (see the module docstring)."""

  def __init__(self, iterator: ExampleIterator):
    self._iterator = iterator
    self._lock = threading.Lock()
    self._taken = 0

  def take(self, n: int) -> list[tuple[int, Example]]:
    with self._lock:
      out = []
      for _ in range(n):
        out.append((self._taken, next(self._iterator)))
        self._taken += 1
      return out

  @property
  def taken(self) -> int:
    return self._taken

  def state(self) -> dict[str, Any]:
    with self._lock:
      return {'iterator': self._iterator.state(), 'taken': self._taken}

  def restore(self, state: Mapping[str, Any]) -> None:
    with self._lock:
      self._iterator.restore(state['iterator'])
      self._taken = int(state['taken'])


class ProcessShard(ExampleIterator):
  """Process `index` of `count` takes examples `index, index + count, ...` of the task's stream: disjoint shares,
  the same seed everywhere. Its state is the inner iterator's (always advanced by whole rounds of `count`)."""

  def __init__(self, inner: ExampleIterator, index: int, count: int):
    self._inner, self._index, self._count = inner, int(index), int(count)

  def __next__(self) -> Example:
    out = None
    for i in range(self._count):
      ex = next(self._inner)
      if i == self._index:
        out = ex
    return out

  def state(self) -> dict[str, Any]:
    return self._inner.state()

  def restore(self, state: Mapping[str, Any]) -> None:
    self._inner.restore(state)
