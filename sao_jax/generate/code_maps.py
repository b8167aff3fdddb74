"""A guard for XLA:CPU's compiled code: a clear error before the kernel's memory-map limit, instead of a crash.

XLA:CPU maps each compiled kernel's code on its own, and a process past `vm.max_map_count` dies in LLVM while
compiling. `CODE_MAPS.compiling(key)` checks, before a program new to the process runs, that the maps held plus
twice the most one program has added stay under the limit.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Hashable


def memory_maps() -> tuple[int, int] | None:
  """(memory maps this process holds, the kernel's limit `vm.max_map_count`), or None where /proc has neither."""
  try:
    with open('/proc/sys/vm/max_map_count', encoding='ascii') as f:
      limit = int(f.read())
    with open('/proc/self/maps', 'rb') as f:
      used = sum(1 for _ in f)
  except (OSError, ValueError):
    return None
  return used, limit


class CodeMaps:
  """Keeps XLA:CPU's compiled code under the kernel's memory-map limit (module docstring).

  A program that may pass it raises a `RuntimeError` saying what to change, and is not run (the sampler's cache
  is not donated). `read` gives (maps held, limit) or None (no /proc: no check); tests pass a fake one."""

  def __init__(self, read: Callable[[], tuple[int, int] | None] = memory_maps):
    self.read = read
    self.per_program = 0  # The most maps one program has added.
    self._seen: set[Hashable] = set()
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def compiling(self, key: Hashable):
    """Around the call of the program `key` (static settings, shapes, placement): checked at its first call."""
    with self._lock:
      new = key not in self._seen
    counts = self.read() if new else None
    if counts is not None:
      used, limit = counts
      if used + 2 * self.per_program >= limit:
        raise RuntimeError(
            f'SlotSampler: the next slot program may pass the kernel\'s memory-map limit (vm.max_map_count = '
            f'{limit}; this process holds {used} maps and a program added up to {self.per_program}): XLA:CPU maps '
            'each compiled program\'s code, and past the limit it crashes while compiling. Raise the limit '
            '(`sysctl -w vm.max_map_count=262144`) or use fewer slot programs (fewer config.sampler.batch_size '
            'slots, a shorter config.sampler.max_seq_len: fewer row buckets and windows).')
    yield
    if new:
      with self._lock:
        self._seen.add(key)
      after = self.read() if counts is not None else None
      if after is not None:
        self.per_program = max(self.per_program, after[0] - counts[0])


CODE_MAPS = CodeMaps()  # The process's: the programs are the process's (module-level jits).
