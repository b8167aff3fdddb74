"""Shared by the benchmark scripts (no flags here: each script defines its own)."""

from __future__ import annotations

import time

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
