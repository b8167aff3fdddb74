"""Shared by the benchmark scripts (no flags here: each script defines its own)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


def matmul_peak(sizes=(2048, 4096), reps: int = 3) -> tuple[float, dict[int, float]]:
  """Best float32 FLOP/s of jitted jnp.dot(a, b) on n x n matrices (2 n^3 FLOPs), this run, this machine.

  Returns (best over the sizes, {n: best FLOP/s at n}).
  """
  per = {}
  for n in sizes:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float('inf')
    for _ in range(reps):
      t0 = time.perf_counter()
      f(a, b).block_until_ready()
      best = min(best, time.perf_counter() - t0)
    per[n] = 2 * n ** 3 / best
  return max(per.values()), per


def memory_bandwidth(mib: int = 64, reps: int = 5, clock=time.perf_counter) -> float:
  """This machine's memory bandwidth now, GB/s: the median of `reps` jitted, donated `x + 1` over a float32 array of
  `mib` MiB (each reads and writes it in place: 2 x `mib` MiB of traffic), after a first call that compiles.

  A probe for the conditions of a run, not a benchmark: on a shared host other tenants slow the memory bus
  (docs/benchmarks/rollout.md), and a decode step that reads a long KV cache slows with it while a matmul-bound one
  does not, so ratios of such runs move with it.
  """
  x = _add_one(jnp.zeros((mib * 2 ** 20 // 4,), jnp.float32)).block_until_ready()
  nbytes, times = x.nbytes, []
  for _ in range(reps):
    t0 = clock()
    x = _add_one(x).block_until_ready()
    times.append(clock() - t0)
  return 2 * nbytes / statistics.median(times) / 1e9


# `memory_bandwidth`'s kernel, in place (no fresh pages to fault in); one program per array size for the process,
# not one per call (the rollout benchmark probes before every run).
_add_one = jax.jit(lambda a: a + 1, donate_argnums=0)


def timings(fn: Callable[[], object], repeats: int) -> tuple[float, float, float]:
  """(median wall, min wall, median process CPU) seconds of `repeats` calls of `fn` (each waited for).

  On a shared machine the min wall time and the CPU time (all threads of this process) are the figures least
  disturbed by other jobs.
  """
  wall, cpu = [], []
  for _ in range(max(repeats, 1)):
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return statistics.median(wall), min(wall), statistics.median(cpu)
