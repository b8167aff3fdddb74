"""Math answer checking with `math-verify`, in a pool of worker processes with a hard timeout.

`math_verify` parses LaTeX and plain answers into sympy and compares them (fractions, radicals, intervals,
sets, ...). Sympy can take unbounded time and memory on adversarial input (e.g. `9^{9^{9^9}}`), so every
check runs in a worker process with an address-space limit (`memory_mb`); ONE timeout decides: math-verify's
own signal-based timeouts are off in the workers, and a check that does not answer within the pool's
`timeout_s` gets its worker SIGKILLed and replaced, the episode ending with `info['error']` (no reward); the
same input always meets the same fate. Workers' stderr (math-verify logs whole inputs) comes back through the
parent's log one line at a time, each cut to `MAX_LOG_CHARS`. Workers are started once and reused.

Workers are plain subprocesses (`python -c` running `_worker_loop`), not `multiprocessing`: nothing of the
parent is re-imported (no main-module fix-up, which fails under absl apps run from stdin or notebooks, and
no JAX), and they talk length-prefixed pickles over their stdin / a private copy of their stdout.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging as std_logging
import os
import pickle
import queue
import resource
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from absl import logging

_HEADER = struct.Struct('>I')
MAX_LOG_CHARS = 500  # A worker's stderr line is cut to this in the parent's log.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WorkerTimeout(TimeoutError):
  """A call did not finish within the pool's timeout; its worker was killed."""


class WorkerError(RuntimeError):
  """The worker raised or died; the message carries the cause."""


def _write_frame(f: BinaryIO, obj: Any) -> None:
  data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
  f.write(_HEADER.pack(len(data)) + data)
  f.flush()


def _read_exact(fd: int, n: int) -> bytes:
  buf = bytearray()
  while len(buf) < n:
    chunk = os.read(fd, n - len(buf))
    if not chunk:
      raise EOFError('worker closed its pipe')
    buf += chunk
  return bytes(buf)


def _read_frame(fd: int) -> Any:
  (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
  return pickle.loads(_read_exact(fd, n))


def _resolve(name: str) -> Callable[..., Any]:
  module, _, qualname = name.partition(':')
  obj: Any = importlib.import_module(module)
  for part in qualname.split('.'):
    obj = getattr(obj, part)
  return obj


def _callable_name(fn: Callable[..., Any]) -> str:
  name = f'{fn.__module__}:{fn.__qualname__}'
  if '<' in name or _resolve(name) is not fn:
    raise ValueError(f'{fn!r} must be a module-level function (the worker imports it by name).')
  return name


def _worker_loop() -> None:
  """Worker entry point (`python -c "...; _worker_loop()" FN [INIT]`): frames in on stdin, out on stdout."""
  out = os.fdopen(os.dup(1), 'wb')
  os.dup2(2, 1)  # Anything the function prints goes to stderr, not into the protocol.
  fn = _resolve(sys.argv[1])
  if len(sys.argv) > 2 and sys.argv[2]:
    _resolve(sys.argv[2])()
  _write_frame(out, ('ready', None))
  stdin = sys.stdin.buffer.fileno()
  while True:
    try:
      args = _read_frame(stdin)
    except EOFError:
      return
    if args is None:
      return
    try:
      reply = ('ok', fn(*args))
    except BaseException as e:  # pylint: disable=broad-except
      reply = ('err', f'{type(e).__name__}: {e}')
    _write_frame(out, reply)


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  ready: bool = False


class WorkerPool:
  """`num_workers` processes running `fn(*args)`, each call bounded by `timeout_s`.

  `fn` (and `initializer`) must be module-level functions; args and results must pickle. Thread-safe: up to
  `num_workers` calls run at once, others wait for a free worker. A worker that times out or dies is killed
  and replaced (its replacement's startup does not count against the next call's timeout).
  """

  def __init__(self, fn: Callable[..., Any], *, num_workers: int = 2, timeout_s: float = 5.0,
               initializer: Callable[[], None] | None = None, startup_timeout_s: float = 120.0,
               memory_mb: int | None = None):
    if num_workers < 1:
      raise ValueError(f'num_workers must be >= 1, got {num_workers}.')
    self._memory_mb = memory_mb
    self._argv = [sys.executable, '-c', 'from sao_jax.envs.verifier import _worker_loop; _worker_loop()',
                  _callable_name(fn), _callable_name(initializer) if initializer is not None else '']
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get('PYTHONPATH', '')]))
    self._env = env
    self.timeout_s = timeout_s
    self._startup_timeout_s = startup_timeout_s
    self._idle: queue.Queue[_Worker] = queue.Queue()
    self._lock = threading.Lock()
    self._all: list[_Worker] = []
    self._closed = False
    for _ in range(num_workers):
      self._idle.put(self._spawn())
    atexit.register(self.close)

  @property
  def closed(self) -> bool:
    return self._closed

  def _limit(self) -> None:  # In the worker, before exec.
    if self._memory_mb is not None:
      limit = self._memory_mb << 20
      resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

  def _spawn(self) -> _Worker:
    proc = subprocess.Popen(self._argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=self._env, close_fds=True, preexec_fn=self._limit)
    threading.Thread(target=_forward_log, args=(proc.stderr, proc.pid), daemon=True,
                     name='verifier-log').start()
    w = _Worker(proc)
    with self._lock:
      self._all.append(w)
    return w

  def _retire(self, w: _Worker) -> None:
    w.proc.kill()
    w.proc.wait()
    for f in (w.proc.stdin, w.proc.stdout):  # stderr is closed by its forwarding thread.
      try:
        f.close()
      except OSError:
        pass
    with self._lock:
      if w in self._all:
        self._all.remove(w)

  def _recv(self, w: _Worker, timeout: float) -> Any:
    fd = w.proc.stdout.fileno()
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
      raise TimeoutError
    return _read_frame(fd)

  def call(self, *args: Any) -> Any:
    """`fn(*args)` in a worker. Raises `WorkerTimeout` or `WorkerError`."""
    if self._closed:
      raise RuntimeError('WorkerPool is closed.')
    w = self._idle.get()
    failure: Exception | None = None
    status, value = 'err', None
    try:
      if not w.ready:
        try:
          self._recv(w, self._startup_timeout_s)
        except TimeoutError:
          raise EOFError(f'worker did not start within {self._startup_timeout_s}s') from None
        w.ready = True
      _write_frame(w.proc.stdin, args)
      try:
        status, value = self._recv(w, self.timeout_s)
      except TimeoutError:
        failure = WorkerTimeout(f'no answer within {self.timeout_s}s; worker killed')
    except (EOFError, OSError, pickle.UnpicklingError, struct.error) as e:  # Died or never started.
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
      self._retire(w)


def _forward_log(stream: BinaryIO, pid: int) -> None:
  """A worker's stderr -> the parent's log, line by line, each cut to `MAX_LOG_CHARS` (the rest is dropped)."""
  try:
    while True:
      line = stream.readline(MAX_LOG_CHARS)
      if not line:
        return
      if not line.endswith(b'\n'):  # An over-long line: skip to its end (bounded reads).
        while (rest := stream.readline(65536)) and not rest.endswith(b'\n'):
          pass
        line += b' [...]'
      text = line.decode('utf-8', 'replace').rstrip()
      if text:
        logging.warning('verifier worker %d: %s', pid, text)
  except (OSError, ValueError):
    pass
  finally:
    try:
      stream.close()
    except OSError:
      pass


# ------------------------------------------------------------------------------------------------------------
# math-verify.


class _NoTimeoutNotice(std_logging.Filter):
  """Drops math-verify's notice that its own timeout is off (it is, on purpose: see the module docstring)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return 'Timeout is disabled' not in str(record.msg)


def _import_math_verify() -> None:
  import math_verify  # pylint: disable=g-import-not-at-top,unused-import
  for name in ('math_verify.parser', 'math_verify.grader'):
    std_logging.getLogger(name).addFilter(_NoTimeoutNotice())


def gold_text(answer: str) -> str:
  """Reference answers are often bare LaTeX (`\\frac{1}{2}`): give them math delimiters for the parser."""
  answer = answer.strip()
  if '$' in answer or '\\boxed' in answer or '\\(' in answer or '\\[' in answer:
    return answer
  return f'${answer}$'


def verify_answer(gold: str, response: str) -> bool:
  """True iff `response` (its last boxed / final expression) equals `gold` per math-verify.

  math-verify's own timeouts are off (`parsing_timeout=None`, `timeout_seconds=None`): the caller bounds the
  time (the pool's timeout kills the worker), so exactly one timeout decides.
  """
  from math_verify import parse, verify  # pylint: disable=g-import-not-at-top
  gold_parsed = parse(gold_text(gold), parsing_timeout=None)
  if not gold_parsed:
    raise ValueError(f'cannot parse the reference answer {gold!r}')
  return bool(verify(gold_parsed, parse(response, parsing_timeout=None), timeout_seconds=None))


_NOT_A_NUMBER = {'nan', '+nan', '-nan', 'inf', '+inf', '-inf', 'infinity', '-infinity', 'none', 'null'}


def gold_problem(gold: str, *, max_chars: int = 1000) -> str | None:
  """Why `gold` cannot be a reference answer (None when math-verify reads it as an expression).

  In-process (math-verify is imported on first use; about 10-30 ms per answer). Unusable: NaN / inf / null
  spellings, more than `max_chars` characters, or nothing math-verify can turn into a sympy expression (it then
  falls back to the raw string, e.g. for `\\frac{`).
  """
  text = gold.strip()
  if text.strip('$ ').lower() in _NOT_A_NUMBER:
    return f'the answer {text!r} is not a value'
  if len(text) > max_chars:
    return f'the answer is longer than {max_chars} characters'
  _import_math_verify()
  from math_verify import parse  # pylint: disable=g-import-not-at-top
  try:
    parsed = parse(gold_text(text), parsing_timeout=None)
  except Exception as e:  # pylint: disable=broad-except  (math-verify / sympy raise anything)
    return f'math-verify cannot parse the answer {text[:60]!r}: {type(e).__name__}'
  if not any(not isinstance(p, str) for p in parsed):
    return f'math-verify cannot parse the answer {text[:60]!r}'
  return None


class MathVerifier:
  """`check(gold, response) -> (reward, info)` through a `WorkerPool` of math-verify workers."""

  def __init__(self, *, num_workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 1024):
    self.pool = WorkerPool(verify_answer, num_workers=num_workers, timeout_s=timeout_s,
                           initializer=_import_math_verify, memory_mb=memory_mb)

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


_SHARED: dict[tuple[int, float, int], MathVerifier] = {}
_SHARED_LOCK = threading.Lock()


def shared_verifier(num_workers: int = 2, timeout_s: float = 5.0, memory_mb: int = 1024) -> MathVerifier:
  """One process-wide verifier per (num_workers, timeout, memory): tasks and evals reuse its workers."""
  with _SHARED_LOCK:
    key = (num_workers, float(timeout_s), int(memory_mb))
    v = _SHARED.get(key)
    if v is None or v.pool.closed:
      v = _SHARED[key] = MathVerifier(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb)
    return v
