"""Math answer checking with `math-verify`, in a pool of worker processes with a hard timeout.

`math_verify` parses LaTeX and plain answers into sympy and compares them (fractions, radicals, intervals,
sets, ...). Sympy can take unbounded time on adversarial input (e.g. `9^{9^{9^9}}`), so every check runs in
a worker process; a check that does not answer within `timeout_s` gets its worker SIGKILLed and replaced,
and counts as wrong with `info['error']`. Workers are started once and reused (`spawn` start method: safe
in a process that runs JAX threads).
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from typing import Any

from absl import logging


class WorkerTimeout(TimeoutError):
  """A call did not finish within the pool's timeout; its worker was killed."""


class WorkerError(RuntimeError):
  """The worker raised or died; the message carries the cause."""


def _worker_main(conn, fn: Callable[..., Any], initializer: Callable[[], None] | None) -> None:
  if initializer is not None:
    initializer()
  conn.send(('ready', None))
  while True:
    try:
      args = conn.recv()
    except (EOFError, OSError):
      return
    if args is None:
      return
    try:
      conn.send(('ok', fn(*args)))
    except BaseException as e:  # pylint: disable=broad-except
      conn.send(('err', f'{type(e).__name__}: {e}'))


@dataclasses.dataclass
class _Worker:
  proc: Any
  conn: Any
  ready: bool = False


class WorkerPool:
  """`num_workers` processes running `fn(*args)`, each call bounded by `timeout_s`.

  Thread-safe: up to `num_workers` calls run at once, others wait for a free worker. A worker that times out
  or dies is killed and replaced (its startup time does not count against the next call's timeout).
  """

  def __init__(self, fn: Callable[..., Any], *, num_workers: int = 2, timeout_s: float = 5.0,
               initializer: Callable[[], None] | None = None, startup_timeout_s: float = 120.0):
    if num_workers < 1:
      raise ValueError(f'num_workers must be >= 1, got {num_workers}.')
    self._fn = fn
    self._initializer = initializer
    self.timeout_s = timeout_s
    self._startup_timeout_s = startup_timeout_s
    self._ctx = mp.get_context('spawn')
    self._idle: queue.Queue[_Worker] = queue.Queue()
    self._lock = threading.Lock()
    self._all: list[_Worker] = []
    self._closed = False
    for _ in range(num_workers):
      self._idle.put(self._spawn())
    atexit.register(self.close)

  def _spawn(self) -> _Worker:
    parent, child = self._ctx.Pipe()
    proc = self._ctx.Process(target=_worker_main, args=(child, self._fn, self._initializer), daemon=True,
                             name='sao-verifier')
    proc.start()
    child.close()
    w = _Worker(proc, parent)
    with self._lock:
      self._all.append(w)
    return w

  def _retire(self, w: _Worker) -> None:
    try:
      w.proc.kill()
      w.proc.join(5)
    except (OSError, ValueError):
      pass
    w.conn.close()
    with self._lock:
      if w in self._all:
        self._all.remove(w)

  def call(self, *args: Any) -> Any:
    """`fn(*args)` in a worker. Raises `WorkerTimeout` or `WorkerError`."""
    if self._closed:
      raise RuntimeError('WorkerPool is closed.')
    w = self._idle.get()
    failure: Exception | None = None
    status, value = 'err', None
    try:
      if not w.ready:
        if not w.conn.poll(self._startup_timeout_s):
          raise EOFError(f'worker did not start within {self._startup_timeout_s}s')
        w.conn.recv()
        w.ready = True
      w.conn.send(args)
      if w.conn.poll(self.timeout_s):
        status, value = w.conn.recv()
      else:
        failure = WorkerTimeout(f'no answer within {self.timeout_s}s; worker killed')
    except (EOFError, OSError) as e:  # The worker died (or never started).
      failure = WorkerError(f'worker died: {e!r}')
    if failure is not None:
      self._retire(w)
      w = self._spawn()
    if not self._closed:
      self._idle.put(w)
    if failure is not None:
      raise failure
    if status == 'err':
      raise WorkerError(value)
    return value

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    with self._lock:
      workers = list(self._all)
    for w in workers:
      try:
        w.conn.send(None)
      except (OSError, ValueError):
        pass
      self._retire(w)


# ------------------------------------------------------------------------------------------------------------
# math-verify.


def _import_math_verify() -> None:
  import math_verify  # pylint: disable=g-import-not-at-top,unused-import


def gold_text(answer: str) -> str:
  """Reference answers are often bare LaTeX (`\\frac{1}{2}`): give them math delimiters for the parser."""
  answer = answer.strip()
  if '$' in answer or '\\boxed' in answer or '\\(' in answer or '\\[' in answer:
    return answer
  return f'${answer}$'


def verify_answer(gold: str, response: str) -> bool:
  """True iff `response` (its last boxed / final expression) equals `gold` per math-verify. Runs anywhere."""
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  gold_parsed = parse(gold_text(gold))
  if not gold_parsed:
    raise ValueError(f'cannot parse the reference answer {gold!r}')
  return bool(verify(gold_parsed, parse(response)))


class MathVerifier:
  """`check(gold, response) -> (reward, info)` through a `WorkerPool` of math-verify workers."""

  def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0):
    self.pool = WorkerPool(verify_answer, num_workers=num_workers, timeout_s=timeout_s,
                           initializer=_import_math_verify)

  def check(self, gold: str, response: str) -> tuple[float, dict[str, Any]]:
    try:
      ok = bool(self.pool.call(gold, response))
      return float(ok), {'correct': ok}
    except WorkerTimeout as e:
      logging.warning('math-verify timed out on a response of %d chars.', len(response))
      return 0.0, {'correct': False, 'error': f'verifier timeout: {e}'}
    except WorkerError as e:
      return 0.0, {'correct': False, 'error': f'verifier error: {e}'}

  def close(self) -> None:
    self.pool.close()


_SHARED: dict[tuple[int, float], MathVerifier] = {}
_SHARED_LOCK = threading.Lock()


def shared_verifier(num_workers: int = 2, timeout_s: float = 5.0) -> MathVerifier:
  """One process-wide verifier per (num_workers, timeout): tasks and evals reuse its workers."""
  with _SHARED_LOCK:
    key = (num_workers, float(timeout_s))
    v = _SHARED.get(key)
    if v is None or v.pool._closed:  # pylint: disable=protected-access
      v = _SHARED[key] = MathVerifier(num_workers=num_workers, timeout_s=timeout_s)
    return v
