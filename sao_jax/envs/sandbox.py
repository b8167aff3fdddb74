"""Sandbox for model-written Python (docs/design.md, Security model).

Isolation is chosen by name and never weakens on its own:
  * 'bwrap' (bubblewrap; the default and the only mode that contains a hostile program): `--unshare-all`
    (user, pid, net, ipc, uts, cgroup namespaces: only a loopback device, no route out), `--die-with-parent`,
    `--new-session`, a read-only root with only `/usr` (and the `/lib*`, `/bin` links) bound read-only, a fresh
    `/proc` of its own pid namespace, a read-only `/dev` with the usual devices, and exactly two writable
    mounts, both size-capped tmpfs: `/tmp` (the empty working directory) and `/dev/shm`; `--clearenv` and the
    system interpreter `/usr/bin/python3 -I` (no site, no user dirs, no PYTHON* variables). No project file
    and no secret of the parent is visible. When bwrap is missing or does not work, `Sandbox()` raises
    `SandboxError`: a run never falls back to a weaker mode by itself.
  * 'unshare' and 'rlimits': weaker modes, used only when asked for by name, with a warning at start that
    says what they do not protect (`WEAKER`). 'unshare' (`unshare --map-root-user --net --pid --fork`) cuts
    the network but leaves the host filesystem and process list visible; 'rlimits' has only the limits.
In every mode: the program runs as an unprivileged uid when the parent is root: a fresh uid drawn per run
from `UID_RANGE` (no user owns it), so the process-count limit binds and is not shared between concurrent
sandboxes (one program's fork bomb cannot starve another's), with rlimits CPU, AS (address space), FSIZE
(file size), NPROC and NOFILE set before exec, and a wall-clock timeout. The program is started by a small
trusted reaper (`_REAPER`, the parent's uid, a child subreaper) that enforces the wall clock, then kills and
reaps every process the run left behind (no zombie `bwrap` waits for the system's init), and dies with the
parent. The program is fed on stdin (nothing is written to the host's disk); stdout/stderr are capped.
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
ISOLATIONS = ('bwrap', 'unshare', 'rlimits')
# What each weaker mode does not protect against (stated in the warning at start).
WEAKER = {
    'unshare': ('the host filesystem stays visible: the program can read every world-readable file (the '
                'task data with the expected outputs, the checkout), write files into world-writable host '
                'directories (/tmp, /dev/shm, /var/tmp) that persist after the run, and see every host '
                "process's command line; only the network is cut"),
    'rlimits': ('nothing but resource limits: the program can read every world-readable file (the task data '
                'with the expected outputs, the checkout), write files into world-writable host directories '
                "(/tmp, /dev/shm, /var/tmp) that persist, see every host process's command line, and open "
                'network connections (services on 127.0.0.1 included)'),
}


class SandboxError(RuntimeError):
  """The sandbox itself could not run (not a failure of the program inside it)."""


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  """Per-run limits."""
  timeout_s: float = 10.0  # Wall clock; every process of the run is killed after it.
  cpu_s: int = 5  # RLIMIT_CPU (seconds of CPU time).
  memory_mb: int = 512  # RLIMIT_AS (address space).
  file_size_mb: int = 4  # RLIMIT_FSIZE (largest file the program may write).
  max_procs: int = 32  # RLIMIT_NPROC (processes + threads of the sandbox uid).
  max_open_files: int = 64  # RLIMIT_NOFILE.
  tmpfs_mb: int = 16  # Size of each writable tmpfs (bwrap mode: /tmp and /dev/shm).
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
def _works(argv: tuple[str, ...], as_uid: int | None, python: str = _SYSTEM_PYTHON) -> bool:
  """Whether `argv` exits 0 as `as_uid` (under the reaper, so that a probe leaves no zombie either)."""
  try:
    r = subprocess.run([python, '-I', '-c', _REAPER, str(-1 if as_uid is None else as_uid), '20', *argv],
                       capture_output=True, timeout=30, env={'PATH': '/usr/bin:/bin'}, check=False)
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
def _bwrap_has_options(bwrap: str) -> bool:
  try:
    out = subprocess.run([bwrap, '--help'], capture_output=True, text=True, timeout=10, check=False)
    return '--size' in out.stdout + out.stderr and '--json-status-fd' in out.stdout + out.stderr
  except (OSError, subprocess.SubprocessError):
    return False


def bwrap_argv(python: str, limits: SandboxLimits, *, bwrap: str = 'bwrap', status_fd: int | None = None
               ) -> list[str]:
  """The bwrap command line (module docstring); `status_fd` receives bwrap's JSON status documents."""
  size = ['--size', str(limits.tmpfs_mb << 20)]
  status = [] if status_fd is None else ['--json-status-fd', str(status_fd)]
  return ([bwrap, '--unshare-all', '--die-with-parent', '--new-session', '--hostname', 'sandbox'] + status
          + _system_links()
          + ['--proc', '/proc', '--dev', '/dev'] + size + ['--tmpfs', '/dev/shm', '--remount-ro', '/dev']
          + size + ['--tmpfs', '/tmp', '--remount-ro', '/', '--chdir', '/tmp', '--clearenv',
                    '--setenv', 'PATH', '/usr/bin:/bin', '--setenv', 'HOME', '/tmp', '--setenv', 'LANG', 'C.UTF-8',
                    python, '-I', '-'])


_UNSHARE = ('unshare', '--map-root-user', '--net', '--pid', '--fork', '--kill-child')


def _unshare_argv(python: str, *args: str) -> tuple[str, ...]:
  return (shutil.which('unshare') or 'unshare',) + _UNSHARE[1:] + (python, '-I', *args)

# The trusted reaper every run starts under (as the parent's uid): it marks itself a child subreaper (so
# every orphan of the run, bwrap's own included, is re-parented to it rather than to the system's init, which
# in a container may never reap them: zombies count against RLIMIT_NPROC), dies with the thread that started
# it, runs the program as the sandbox uid, enforces the wall clock, then kills and reaps every remaining
# descendant. Arguments: uid (-1 = keep), timeout, then the program's argv. Exit status: the program's, or 124
# after the wall clock.
_REAPER = r'''
import ctypes, os, signal, sys
uid, timeout, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG = SIGKILL
pid = os.fork()
if pid == 0:
  try:
    if uid >= 0:
      os.setgroups([]); os.setgid(uid); os.setuid(uid)
    os.execv(argv[0], argv)
  finally:
    os._exit(127)
class Deadline(Exception):
  pass
def alarm(signum, frame):
  raise Deadline
signal.signal(signal.SIGALRM, alarm)
status = None
signal.setitimer(signal.ITIMER_REAL, timeout)
try:
  while status is None:
    p, st = os.waitpid(-1, 0)
    if p == pid:
      status = st
except (Deadline, ChildProcessError):
  pass
signal.setitimer(signal.ITIMER_REAL, 0)
me = str(os.getpid())
while True:
  for q in os.listdir('/proc'):
    try:
      if q.isdigit() and open('/proc/%s/stat' % q).read().rsplit(')', 1)[1].split()[1] == me:
        os.kill(int(q), signal.SIGKILL)
    except (OSError, IndexError):
      pass
  try:
    p, st = os.waitpid(-1, 0)
  except ChildProcessError:
    break
sys.exit(124 if status is None else (os.waitstatus_to_exitcode(status) % 256))
'''


def detect_isolation(python: str = _SYSTEM_PYTHON) -> str:
  """The strongest isolation that works on this machine: 'bwrap', 'unshare' or 'rlimits' (diagnostics)."""
  if bwrap_problem(python) is None:
    return 'bwrap'
  uid = _PROBE_UID if _is_root() else None
  if shutil.which('unshare') and _works(_unshare_argv(python, '-c', 'pass'), uid, python):
    return 'unshare'
  return 'rlimits'


def bwrap_problem(python: str = _SYSTEM_PYTHON) -> str | None:
  """Why bubblewrap cannot run the sandbox here, or None when it can."""
  bwrap = shutil.which('bwrap')
  if bwrap is None:
    return 'bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)'
  if not _bwrap_has_options(bwrap):
    return f'{bwrap} is too old (--size and --json-status-fd are needed: bubblewrap >= 0.5)'
  uid = _PROBE_UID if _is_root() else None
  if not _works(tuple(bwrap_argv(python, SandboxLimits(), bwrap=bwrap)[:-1] + ['-c', 'pass']), uid, python):
    return (f'{bwrap} cannot create its namespaces here (unprivileged user namespaces disabled? '
            'e.g. sysctl kernel.unprivileged_userns_clone=1, or a container without CAP_SYS_ADMIN)')
  return None


class Sandbox:
  """Runs Python programs in isolation (see module docstring). Thread-safe; `max_concurrent` bounds runs.

  Raises:
    SandboxError: the requested isolation does not work on this machine (never a silent fallback).
    ValueError: an unknown isolation name.
  """

  def __init__(self, limits: SandboxLimits = SandboxLimits(), *, isolation: str = 'bwrap',
               python: str = _SYSTEM_PYTHON, max_concurrent: int = 4):
    if isolation not in ISOLATIONS:
      raise ValueError(f'isolation={isolation!r}: one of {ISOLATIONS} (bwrap unless a weaker mode is wanted).')
    if not os.path.exists(python):
      raise SandboxError(f'Sandbox interpreter {python!r} not found.')
    self.limits = limits
    self.python = python
    self.isolation = isolation
    self.drops_uid = _is_root()
    self._uids = random.SystemRandom()
    if isolation == 'bwrap':
      problem = bwrap_problem(python)
      if problem is not None:
        raise SandboxError(f'The code sandbox needs bubblewrap: {problem}. Install it, or ask for a weaker '
                           f'isolation by name (isolation=unshare or rlimits), knowing what it does not '
                           f'protect: {WEAKER["unshare"]}.')
      self._bwrap = shutil.which('bwrap')
    else:
      if isolation == 'unshare' and not (shutil.which('unshare') and _works(
          _unshare_argv(python, '-c', 'pass'), _PROBE_UID if self.drops_uid else None, python)):
        raise SandboxError('isolation=unshare: `unshare` with user namespaces does not work here.')
      logging.warning('Sandbox: isolation=%r as asked, WEAKER than bubblewrap. It does not protect against '
                      'hostile code: %s. Use it only for trusted programs.', isolation, WEAKER[isolation])
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
      resource.setrlimit(resource.RLIMIT_NOFILE, (lim.max_open_files, lim.max_open_files))
      resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return fn

  def _argv(self, uid: int | None, status_fd: int | None) -> list[str]:
    if self.isolation == 'bwrap':
      program = bwrap_argv(self.python, self.limits, bwrap=self._bwrap, status_fd=status_fd)
    elif self.isolation == 'unshare':
      program = list(_unshare_argv(self.python, '-'))
    else:
      program = [self.python, '-I', '-']
    return [self.python, '-I', '-c', _REAPER, str(-1 if uid is None else uid), str(self.limits.timeout_s),
            *program]

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
    status_r, status_w = os.pipe() if self.isolation == 'bwrap' else (None, None)
    t0 = time.monotonic()
    try:
      proc = subprocess.Popen(
          self._argv(uid, status_w), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
          cwd=workdir, env=env, start_new_session=True, preexec_fn=self._preexec(), close_fds=True,
          pass_fds=() if status_w is None else (status_w,))
    except OSError as e:
      if status_r is not None:
        os.close(status_r)
      raise SandboxError(f'Cannot start the sandbox: {e}') from e
    finally:
      if status_w is not None:
        os.close(status_w)
    cap = self.limits.max_output_bytes
    bufs: dict[str, bytearray] = {'out': bytearray(), 'err': bytearray(), 'status': bytearray()}

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
    if status_r is not None:
      threads.append(threading.Thread(target=drain, args=(os.fdopen(status_r, 'rb'), bufs['status']),
                                      daemon=True))
    for t in threads:
      t.start()
    try:  # The reaper enforces the wall clock itself; this is the backstop should it hang.
      proc.wait(timeout=self.limits.timeout_s + 2.0)
    except subprocess.TimeoutExpired:
      pass
    self._kill_group(proc.pid)
    proc.wait()
    for t in threads:
      t.join(timeout=5)
    timed_out = proc.returncode in (124, -signal.SIGKILL)
    stderr = bufs['err'].decode('utf-8', 'replace')
    if self.isolation == 'bwrap' and not _started(bytes(bufs['status'])) and not timed_out:
      raise SandboxError(f'bubblewrap failed to start the program (exit {proc.returncode}): '
                         f'{stderr.strip()[:500]}')
    return SandboxResult(returncode=None if timed_out else proc.returncode,
                         stdout=bufs['out'].decode('utf-8', 'replace'), stderr=stderr, timed_out=timed_out,
                         isolation=self.isolation, wall_s=time.monotonic() - t0, uid=uid)

  @staticmethod
  def _kill_group(pgid: int) -> None:
    try:
      os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass


def _started(status: bytes) -> bool:
  """Whether bwrap's JSON status stream reports the sandboxed child's pid (set-up went through)."""
  return b'"child-pid"' in status
