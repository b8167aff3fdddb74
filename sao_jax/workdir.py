"""One run per workdir, and a workdir a run can write: `check_writable(workdir)`, `WorkdirLock`.

    lock = WorkdirLock.for_run(config.workdir)   # process 0 holds it; every process agrees, or raises RunError
    try: ...  finally: lock.release()

The lock is the file `<workdir>/RUN_LOCK` (JSON: the holder's host, pid, start time, command and a heartbeat), taken
before the run writes anything there. A second run refuses in one line naming the holder (`RunError`); a lock whose
holder is gone is taken over with a warning:
- locally (and on NFS) by `fcntl.flock` on that file: the kernel releases it when the holder exits, kill -9 too, so a
  held flock is a live holder and a free one a gone holder, whatever the file says;
- on an object store (`gs://`), which has no locks, by a lease: the holder rewrites the file's heartbeat every
  `stale_after_s / 4` (a thread), a heartbeat older than `stale_after_s` is a gone holder, and a taker writes its
  own token, waits `settle_s` and reads it back, so of two runs starting together the one whose write landed last
  keeps the lock and the other refuses (GCS reads are strongly consistent).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Any

from absl import logging
import jax

from sao_jax import parallel
from sao_jax import paths
from sao_jax.errors import ConfigError
from sao_jax.errors import RunError

LOCK_FILE = 'RUN_LOCK'
_PROBE = '.write_probe'


def check_writable(workdir: str) -> None:
  """Refuses (`ConfigError`, one line) a workdir the run cannot write, before anything is built: an existing one, or
  any on an object store, must take a new file (a probe, created and deleted: a bucket's permissions show here); a
  missing local one the nearest existing parent directory must allow. Nothing is left behind."""
  field = f'config.workdir={workdir!r}'
  try:
    if paths.isdir(workdir) or not paths.is_local(workdir):
      probe = paths.join(workdir, f'{_PROBE}-{socket.gethostname()}-{os.getpid()}')
      paths.write_text(probe, '')
      paths.remove(probe)
      return
    if paths.exists(workdir):
      raise ConfigError(f'{field} exists and is not a directory.')
    parent = os.path.dirname(os.path.abspath(workdir))
    while not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
      raise ConfigError(f'{field} cannot be created: {parent} is not a writable directory.')
  except OSError as e:
    raise ConfigError(f'{field} is not writable: {e.strerror or e} ({type(e).__name__}).') from e


def _holder(info: dict[str, Any]) -> str:
  return (f"host {info.get('host', '?')}, pid {info.get('pid', '?')}, started {info.get('started', '?')}"
          f"{', command ' + repr(info['command'][:200]) if info.get('command') else ''}")


def _me(token: str) -> dict[str, Any]:
  return {'host': socket.gethostname(), 'pid': os.getpid(),
          'started': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()), 'command': ' '.join(sys.argv),
          'token': token, 'heartbeat': time.time(), 'released': False}


class WorkdirLock:
  """The exclusive lock of one workdir (module docstring). `acquire()` raises `RunError` naming the holder when
  another live run has it; `release()` (idempotent) frees it.

  Args:
    workdir: the run's directory (a local path or a URI).
    stale_after_s: object store only: a heartbeat older than this is a gone holder.
    settle_s: object store only: the wait between writing the lock and reading it back.
  """

  def __init__(self, workdir: str, *, stale_after_s: float = 300.0, settle_s: float = 2.0):
    self.workdir = workdir
    self.path = paths.join(workdir, LOCK_FILE)
    self.stale_after_s = float(stale_after_s)
    self.settle_s = float(settle_s)
    self._token = uuid.uuid4().hex
    self._fd = None
    self._info: dict[str, Any] | None = None
    self._stop = threading.Event()
    self._thread = None

  @classmethod
  def for_run(cls, workdir: str, **kwargs) -> WorkdirLock:
    """Process 0 takes the lock; every process learns whether it did (the coordination service), and all raise
    `RunError` when it did not. Returns the lock (held on process 0 only)."""
    lock = cls(workdir, **kwargs)
    error = None
    if jax.process_index() == 0:
      try:
        lock.acquire()
      except RunError as e:
        error = e
    if jax.process_count() > 1:
      if parallel.process_max('workdir_lock', int(error is not None)) and error is None:
        lock.release()
        error = RunError(f'config.workdir={workdir!r}: process 0 could not take the workdir lock (see its log).')
    if error is not None:
      raise error
    return lock

  @property
  def held(self) -> bool:
    return self._info is not None

  def acquire(self) -> None:
    paths.makedirs(self.workdir)
    if paths.is_local(self.path):
      self._acquire_local()
    else:
      self._acquire_remote()
    logging.info('Workdir lock %s taken (%s).', self.path, _holder(self._info))

  def _acquire_local(self) -> None:
    import fcntl  # pylint: disable=g-import-not-at-top  (POSIX only)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      os.close(fd)
      raise RunError(f'config.workdir={self.workdir!r} is in use by another run ({_holder(self._read())}; lock '
                     f'{self.path}). Stop that run, or use another --workdir.') from None
    previous = self._read()
    if previous and not previous.get('released', True):
      logging.warning('Workdir lock %s: taking over from a run that is gone without releasing it (%s).', self.path,
                      _holder(previous))
    self._fd = fd
    self._info = _me(self._token)
    self._write_local(self._info)

  def _write_local(self, info: dict[str, Any]) -> None:
    data = (json.dumps(info) + '\n').encode()
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, data, 0)
    os.fsync(self._fd)

  def _acquire_remote(self) -> None:
    previous = self._read()
    if previous and not previous.get('released', True):
      age = time.time() - float(previous.get('heartbeat', 0.0))
      if age < self.stale_after_s:
        raise RunError(f'config.workdir={self.workdir!r} is in use by another run ({_holder(previous)}; heartbeat '
                       f'{age:.0f}s ago, lock {self.path}). Stop that run, or use another --workdir.')
      logging.warning('Workdir lock %s: taking over from a run whose heartbeat stopped %.0fs ago (%s).', self.path,
                      age, _holder(previous))
    info = _me(self._token)
    paths.write_text(self.path, json.dumps(info))
    time.sleep(self.settle_s)
    now = self._read()
    if now.get('token') != self._token:
      raise RunError(f'config.workdir={self.workdir!r} was taken by another run starting at the same time '
                     f'({_holder(now)}; lock {self.path}).')
    self._info = info
    self._thread = threading.Thread(target=self._heartbeat, name='workdir-lock-heartbeat', daemon=True)
    self._thread.start()

  def _heartbeat(self) -> None:
    while not self._stop.wait(self.stale_after_s / 4):
      try:
        now = self._read()
        if now.get('token') != self._token:
          logging.error('Workdir lock %s was taken by another run (%s): two runs may now write this workdir.',
                        self.path, _holder(now))
          return
        paths.write_text(self.path, json.dumps({**self._info, 'heartbeat': time.time()}))
      except OSError as e:  # A transient store error: the next beat tries again.
        logging.warning('Workdir lock %s: heartbeat failed: %s', self.path, e)

  def _read(self) -> dict[str, Any]:
    try:
      return json.loads(paths.read_text(self.path) or '{}')
    except (OSError, ValueError):
      return {}

  def release(self) -> None:
    """Frees the lock (marked released in the file, which stays: deleting it would race a new taker's open)."""
    if self._info is None:
      return
    info, self._info = {**self._info, 'released': True}, None
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    try:
      if self._fd is not None:
        self._write_local(info)
      elif self._read().get('token') == self._token:
        paths.write_text(self.path, json.dumps(info))
    except OSError as e:
      logging.warning('Workdir lock %s: could not mark it released: %s', self.path, e)
    finally:
      if self._fd is not None:
        import fcntl  # pylint: disable=g-import-not-at-top
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

  def __enter__(self) -> WorkdirLock:
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
