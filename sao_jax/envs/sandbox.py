"""Sandbox for model-written Python (DESIGN.md, Conventions).

Isolation, strongest available first:
  * 'bwrap' (bubblewrap): `--unshare-all` (user, pid, net, ipc, uts, cgroup namespaces: only a loopback
    device, no route out), `--die-with-parent`, `--new-session`, a read-only root with only `/usr` (and the
    `/lib*`, `/bin` links) bound read-only, a size-capped tmpfs `/tmp` as the empty working directory, a fresh
    `/proc` of its own pid namespace, `--clearenv`, the system interpreter `/usr/bin/python3 -I` (no site,
    no user dirs, no PYTHON* variables). No project file and no secret of the parent is visible.
  * 'unshare' (bwrap missing): `unshare --map-root-user --net --pid --fork --kill-child` + an empty working
    directory and a clean environment; the host filesystem stays visible (read as an unprivileged user).
    A warning says that isolation is weaker.
  * 'rlimits' (neither works): resource limits, the timeout, and a trusted subreaper that kills whatever
    the program leaves behind; no filesystem or network isolation; a warning says so.
In every mode: the program runs as an unprivileged uid when the parent is root: a fresh uid drawn per run
from `UID_RANGE` (no user owns it), so the process-count limit binds and is not shared between concurrent
sandboxes (one program's fork bomb cannot starve another's), with rlimits CPU, AS (address space), FSIZE
(file size) and NPROC set in the child before exec, and a wall-clock timeout that SIGKILLs the whole
process group (and, with a pid namespace, everything in it).
The program is fed on stdin (nothing is written to the host's disk); stdout/stderr are capped.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from absl import logging

_SYSTEM_PYTHON = '/usr/bin/python3'
UID_RANGE = (200_000, 265_536)  # Per-run sandbox uids when the parent is root (above the usual user ranges).
_PROBE_UID = UID_RANGE[0] - 1


class SandboxError(RuntimeError):
  """The sandbox itself could not run (not a failure of the program inside it)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-run limits."""
  timeout_s: float = 10.0  # Wall clock; the whole process group is killed after it.
  cpu_s: int = 5  # RLIMIT_CPU (seconds of CPU time).
  memory_mb: int = 512  # RLIMIT_AS (address space).
  file_size_mb: int = 4  # RLIMIT_FSIZE (largest file the program may write).
  max_procs: int = 32  # RLIMIT_NPROC (processes + threads of the sandbox uid).
  tmpfs_mb: int = 16  # Size of the tmpfs working directory (bwrap mode).
  max_output_bytes: int = 65536  # stdout / stderr kept (the rest is read and dropped).


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  returncode: int | None  # None when killed by the timeout.
  stdout: str
  stderr: str
  timed_out: bool
  isolation: str  # 'bwrap', 'unshare' or 'rlimits'.
  wall_s: float
  uid: int | None = None  # The uid the program ran as (None: the parent's own).


@functools.cache
def _works(argv: tuple[str, ...], as_uid: int | None) -> bool:
  try:
    r = subprocess.run(list(argv), capture_output=True, timeout=20, user=as_uid, group=as_uid,
                       extra_groups=[] if as_uid is not None else None, env={'PATH': '/usr/bin:/bin'},
                       check=False)
    return r.returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def _is_root() -> bool:
  return os.geteuid() == 0


def _system_links() -> list[str]:
  """Read-only views of the system dirs the interpreter needs (symlinks kept as symlinks)."""
  args = ['--ro-bind', '/usr', '/usr']
  for d in ('/lib', '/lib64', '/lib32', '/bin', '/sbin'):
    if os.path.islink(d):
      args += ['--symlink', os.readlink(d), d]
    elif os.path.isdir(d):
      args += ['--ro-bind', d, d]
  return args


@functools.cache
def _bwrap_supports_size() -> bool:
  try:
    out = subprocess.run(['bwrap', '--help'], capture_output=True, text=True, timeout=10, check=False)
    return '--size' in out.stdout + out.stderr
  except (OSError, subprocess.SubprocessError):
    return False


def bwrap_argv(python: str, limits: SandboxLimits) -> list[str]:
  size = ['--size', str(limits.tmpfs_mb << 20)] if _bwrap_supports_size() else []
  return (['bwrap', '--unshare-all', '--die-with-parent', '--new-session', '--hostname', 'sandbox']
          + _system_links()
          + ['--proc', '/proc', '--dev', '/dev'] + size + ['--tmpfs', '/tmp', '--remount-ro', '/',
             '--chdir', '/tmp', '--clearenv', '--setenv', 'PATH', '/usr/bin:/bin', '--setenv', 'HOME', '/tmp',
             '--setenv', 'LANG', 'C.UTF-8', python, '-I', '-'])


_UNSHARE = ('unshare', '--map-root-user', '--net', '--pid', '--fork', '--kill-child')

# 'rlimits' mode has no pid namespace, so orphans of the program would be re-parented to the system's init
# (which, in a container, may never reap them: zombies count against RLIMIT_NPROC). This trusted reaper,
# running as the parent's uid, marks itself a child subreaper, runs the program as the sandbox uid, enforces
# the wall clock, then kills and reaps every remaining descendant. Arguments: uid (-1 = keep), timeout,
# then the program's argv.
_REAPER = r'''
import ctypes, os, signal, sys, time
uid, timeout, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
pid = os.fork()
if pid == 0:
  if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
  os.execv(argv[0], argv)
me, status, deadline = os.getpid(), None, time.monotonic() + timeout
while status is None and time.monotonic() < deadline:
  try:
    p, st = os.waitpid(-1, os.WNOHANG)
  except ChildProcessError:
    break
  if p == pid:
    status = st
  elif p == 0:
    time.sleep(0.01)
timed_out = status is None
while True:
  for q in os.listdir('/proc'):
    try:
      if q.isdigit() and open('/proc/%s/stat' % q).read().rsplit(')', 1)[1].split()[1] == str(me):
        os.kill(int(q), signal.SIGKILL)
    except (OSError, IndexError):
      pass
  try:
    p, st = os.waitpid(-1, 0)
  except ChildProcessError:
    break
  if p == pid and status is None:
    status = st
sys.exit(124 if timed_out else (os.waitstatus_to_exitcode(status) % 256))
'''


def detect_isolation(python: str = _SYSTEM_PYTHON) -> str:
  """The strongest isolation that works on this machine: 'bwrap', 'unshare' or 'rlimits'."""
  uid = _PROBE_UID if _is_root() else None
  if shutil.which('bwrap') and _works(tuple(bwrap_argv(python, SandboxLimits())[:-1] + ['-c', 'pass']), uid):
    return 'bwrap'
  if shutil.which('unshare') and _works(_UNSHARE + (python, '-I', '-c', 'pass'), uid):
    return 'unshare'
  return 'rlimits'


class Sandbox:
  """Runs Python programs in isolation (see module docstring). Thread-safe; `max_concurrent` bounds runs."""

  def __init__(self, limits: SandboxLimits = SandboxLimits(), *, isolation: str = 'auto',
               python: str = _SYSTEM_PYTHON, max_concurrent: int = 4):
    if not os.path.exists(python):
      raise SandboxError(f'Sandbox interpreter {python!r} not found.')
    self.limits = limits
    self.python = python
    self.drops_uid = _is_root()
    self._uids = random.SystemRandom()
    self.isolation = detect_isolation(python) if isolation == 'auto' else isolation
    if self.isolation not in ('bwrap', 'unshare', 'rlimits'):
      raise ValueError(f'isolation={isolation!r}: auto, bwrap, unshare or rlimits.')
    if self.isolation != 'bwrap':
      logging.warning('Sandbox: using %r isolation, WEAKER than bubblewrap (the host '
                      'filesystem is visible%s). Install the Debian package bubblewrap.', self.isolation,
                      '' if self.isolation == 'unshare' else ', and network access is not blocked')
    self._slots = threading.BoundedSemaphore(max_concurrent)

  def _nproc(self) -> int:
    """RLIMIT_NPROC counts every process of the uid: as a non-root user, leave room for the ones it has."""
    if self.drops_uid:
      return self.limits.max_procs
    me, count = os.getuid(), 0
    for pid in os.listdir('/proc'):
      try:
        if pid.isdigit() and os.stat(f'/proc/{pid}').st_uid == me:
          count += 1
      except OSError:
        pass
    return count + self.limits.max_procs

  def _preexec(self):
    lim = self.limits
    mb = 1 << 20
    nproc = self._nproc()

    def fn():
      resource.setrlimit(resource.RLIMIT_CPU, (lim.cpu_s, lim.cpu_s + 1))
      resource.setrlimit(resource.RLIMIT_AS, (lim.memory_mb * mb, lim.memory_mb * mb))
      resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_size_mb * mb, lim.file_size_mb * mb))
      resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return fn

  def _argv(self, uid: int | None) -> list[str]:
    if self.isolation == 'bwrap':
      return bwrap_argv(self.python, self.limits)
    if self.isolation == 'unshare':
      return list(_UNSHARE) + [self.python, '-I', '-']
    return [self.python, '-I', '-c', _REAPER, str(-1 if uid is None else uid), str(self.limits.timeout_s),
            self.python, '-I', '-']

  def run(self, program: str) -> SandboxResult:
    """Runs `program` (Python source) and returns its exit status and capped output.

    Raises:
      SandboxError: the sandbox could not start (e.g. bwrap failed), as opposed to the program failing.
    """
    with self._slots:
      uid = self._uids.randrange(*UID_RANGE) if self.drops_uid else None
      workdir = None
      if self.isolation != 'bwrap':
        workdir = tempfile.mkdtemp(prefix='sao_sandbox_')
        if uid is not None:
          os.chown(workdir, uid, uid)
      try:
        return self._run(program, workdir, uid)
      finally:
        if workdir is not None:
          shutil.rmtree(workdir, ignore_errors=True)

  def _run(self, program: str, workdir: str | None, uid: int | None) -> SandboxResult:
    env = {'PATH': '/usr/bin:/bin', 'LANG': 'C.UTF-8', 'HOME': workdir or '/tmp'}
    run_as = None if self.isolation == 'rlimits' else uid  # The reaper switches uid itself.
    t0 = time.monotonic()
    try:
      proc = subprocess.Popen(
          self._argv(uid), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=workdir,
          env=env, start_new_session=True, user=run_as, group=run_as,
          extra_groups=[] if run_as is not None else None,
          preexec_fn=self._preexec(), close_fds=True)
    except OSError as e:
      raise SandboxError(f'Cannot start the sandbox: {e}') from e
    cap = self.limits.max_output_bytes
    bufs: dict[str, bytearray] = {'out': bytearray(), 'err': bytearray()}

    def drain(stream, buf: bytearray):
      while chunk := stream.read(65536):
        if len(buf) < cap:
          buf += chunk[:cap - len(buf)]
      stream.close()

    def feed(stream, data: bytes):  # In a thread: a child that never reads cannot block us.
      try:
        stream.write(data)
        stream.close()
      except OSError:
        pass  # The program exited (or was killed) before reading all of its source.

    threads = [threading.Thread(target=drain, args=(proc.stdout, bufs['out']), daemon=True),
               threading.Thread(target=drain, args=(proc.stderr, bufs['err']), daemon=True),
               threading.Thread(target=feed, args=(proc.stdin, program.encode()), daemon=True)]
    for t in threads:
      t.start()
    timed_out = False
    try:
      proc.wait(timeout=self.limits.timeout_s + (1.0 if self.isolation == 'rlimits' else 0.0))
    except subprocess.TimeoutExpired:
      timed_out = True
    if self.isolation == 'rlimits' and proc.returncode == 124:
      timed_out = True  # The reaper's own wall clock.
    self._kill_group(proc.pid)
    proc.wait()
    for t in threads:
      t.join(timeout=5)
    stderr = bufs['err'].decode('utf-8', 'replace')
    if self.isolation == 'bwrap' and proc.returncode == 1 and stderr.startswith('bwrap:'):
      raise SandboxError(f'bubblewrap failed: {stderr.strip()[:500]}')
    return SandboxResult(returncode=None if timed_out else proc.returncode,
                         stdout=bufs['out'].decode('utf-8', 'replace'), stderr=stderr, timed_out=timed_out,
                         isolation=self.isolation, wall_s=time.monotonic() - t0, uid=uid)

  @staticmethod
  def _kill_group(pgid: int) -> None:
    try:
      os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
