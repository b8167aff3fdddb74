"""Loops whose every pass the ahead-of-time plan must count.

XLA's cost analysis counts a loop's body once, whatever its trip count. The plan (`sao_jax.tools.aot`) traces the
learner's step inside `unrolled_loops()`, where `scan` unrolls (same values, one more compile); runs never do.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax

_UNROLL: contextvars.ContextVar[bool] = contextvars.ContextVar('unroll_loops', default=False)


@contextlib.contextmanager
def unrolled_loops() -> Iterator[None]:
  """Programs traced inside this block unroll every `scan` of this module."""
  token = _UNROLL.set(True)
  try:
    yield
  finally:
    _UNROLL.reset(token)


def scan(f: Callable[[Any, Any], tuple[Any, Any]], init: Any, xs: Any) -> tuple[Any, Any]:
  """`jax.lax.scan(f, init, xs)`, unrolled inside `unrolled_loops`."""
  return jax.lax.scan(f, init, xs, unroll=_UNROLL.get())


def map(f: Callable[[Any], Any], xs: Any) -> Any:  # pylint: disable=redefined-builtin
  """`jax.lax.map(f, xs)`; inside `unrolled_loops`, `jax.vmap(f)(xs)`: the same values and arithmetic in one pass
  (no loop to count once, nothing to unroll)."""
  if _UNROLL.get():
    return jax.vmap(f)(xs)
  return jax.lax.map(f, xs)
