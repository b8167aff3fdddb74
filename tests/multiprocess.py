"""Local `jax.distributed` runs for tests: N processes of one command on this machine, each with simulated CPU
devices, their output in log files, and a deadline that stops them (SIGTERM; after a grace period SIGABRT, which
makes Python's faulthandler write every thread's stack to the log; then SIGKILL), so a hang in a collective fails
the test, with where each process sat, instead of hanging the suite.

    procs = multiprocess.start(cmd, out_dir, devices_per_process=4)     # SAO_* env vars name each process
    multiprocess.wait(test, procs, timeout_s=300)                      # fails `test` unless all exit 0
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GRACE_S = 20.0  # Between the SIGTERM of a deadline and the SIGABRT (stacks), which is followed by the SIGKILL.
ABORT_S = 5.0  # For the stacks to be written.


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Process:
  """One started process: its `Popen` and the file holding its output (stdout and stderr)."""
  popen: subprocess.Popen
  log: str

  def tail(self, chars: int = 4000) -> str:
    with open(self.log, errors='replace') as f:
      return f.read()[-chars:]


# XLA flags that make CPU compiles cheaper, for programs whose speed does not matter (the suite's tiny models):
# LLVM at -O0 without its expensive passes. The HLO passes are the same, only the machine code is less optimised;
# measured on the tiny SAO learner update (8 x 64 tokens): 10 s of compile -> 5.9 s. Every test process uses them
# (tests/conftest.py) and so do the children tests start (`child_xla_flags`); SAO_TEST_XLA_FAST=0 turns them off.
# Adding --xla_cpu_use_fusion_emitters=false compiles faster still (3.5 s) but changes float32 rounding between
# programs beyond the suite's tolerances (the vmapped GAE scan vs the unbatched one: 1.3e-6 at atol 1e-6): only
# the children below that compare no floats use it (`NO_FUSION_EMITTERS`).
FAST_COMPILE = ('--xla_backend_optimization_level=0', '--xla_llvm_disable_expensive_passes=true')
# For child processes whose floats no test compares with programs compiled otherwise (trainer runs checked by
# their steps, rows, checkpoints and logs): no fusion emitters on top of FAST_COMPILE halves the compile CPU again
# (the configs test's 8 tiny trainer runs: 102 s of XLA compiles -> 52 s).
NO_FUSION_EMITTERS = ('--xla_cpu_use_fusion_emitters=false',)


def fast_compile_flags(fusion_emitters: bool = True) -> tuple[str, ...]:
  """`FAST_COMPILE` (and `NO_FUSION_EMITTERS` unless `fusion_emitters`), or nothing under SAO_TEST_XLA_FAST=0."""
  if os.environ.get('SAO_TEST_XLA_FAST', '1') == '0':
    return ()
  return FAST_COMPILE if fusion_emitters else FAST_COMPILE + NO_FUSION_EMITTERS


def child_xla_flags(devices: int, fusion_emitters: bool = True) -> str:
  """XLA_FLAGS of a child process of a test: `devices` simulated CPU devices, compiled fast (`fast_compile_flags`:
  `fusion_emitters=False` only where no float of the child is compared with another program's)."""
  return ' '.join([f'--xla_force_host_platform_device_count={devices}', *fast_compile_flags(fusion_emitters)])


def env(devices_per_process: int, cache_dir: str | None = None, xla_flags: Sequence[str] = ()) -> dict[str, str]:
  """The children's environment: CPU, `devices_per_process` simulated devices (`child_xla_flags`, and
  `xla_flags`), this checkout on the path; a persistent compilation cache in `cache_dir` (process 0 writes it;
  later launches read it: it serves process 0 only, the others' cache keys differ; a resumed 2-process trainer
  run whose process 0 loaded its sharded update while process 1 compiled it hung, see docs/design.md), else
  none: not the suite's shared one (tests/conftest.py), whose entries written by other tests mid-run could let
  one process load a program the other compiles."""
  out = dict(os.environ, XLA_FLAGS=' '.join([child_xla_flags(devices_per_process), *xla_flags]),
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT, PYTHONFAULTHANDLER='1')
  out.pop('JAX_COMPILATION_CACHE_DIR', None)
  if cache_dir:
    out.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0')
  return out


def _popen(cmd: list[str], env_vars: dict[str, str], log: str) -> Process:
  # No core file from the SIGABRT of `stop` (`exec`: the shell becomes the child, same pid).
  cmd = ['sh', '-c', 'ulimit -c 0; exec "$@"', 'sh', *cmd]
  with open(log, 'ab') as f:  # A file, not a pipe: a child never blocks on a full pipe nobody reads.
    return Process(subprocess.Popen(cmd, cwd=ROOT, env=env_vars, stdout=f, stderr=subprocess.STDOUT), log)


def start(cmd: list[str], out_dir: str, *, num_processes: int = 2, devices_per_process: int = 2,
          cache_dir: str | None = None, xla_flags: Sequence[str] = (), name: str = 'proc') -> list[Process]:
  """Starts `cmd` `num_processes` times as one `jax.distributed` run (`sao_jax.parallel.initialize` reads
  `SAO_COORDINATOR_ADDRESS`, `SAO_NUM_PROCESSES`, `SAO_PROCESS_ID`), output to `out_dir/<name><i>.log`; `env`
  for `cache_dir` and `xla_flags`."""
  port = free_port()
  procs = []
  for i in range(num_processes):
    e = dict(env(devices_per_process, cache_dir, xla_flags), SAO_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
             SAO_NUM_PROCESSES=str(num_processes), SAO_PROCESS_ID=str(i))
    procs.append(_popen(cmd, e, os.path.join(out_dir, f'{name}{i}.log')))
  return procs


def stop(procs: list[Process], grace_s: float = GRACE_S) -> None:
  """SIGTERM to every process still running; `grace_s` later SIGABRT to those still running (their stacks go to
  their logs: `PYTHONFAULTHANDLER`), SIGKILL `ABORT_S` after that."""
  for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGABRT, ABORT_S), (signal.SIGKILL, None)):
    running = [p for p in procs if p.popen.poll() is None]
    for p in running:
      p.popen.send_signal(sig)
    deadline = time.monotonic() + (wait_s or 0.0)
    for p in running:
      try:
        p.popen.wait(timeout=None if wait_s is None else max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        pass


def wait(test, procs: list[Process], *, timeout_s: float, grace_s: float = GRACE_S) -> None:
  """Waits for every process; fails `test` (with the logs' tails) unless all exit 0 by `timeout_s` (then they
  are stopped, see `stop`) or when one fails (the others are stopped the same way)."""
  deadline = time.monotonic() + timeout_s
  while any([p.popen.poll() is None for p in procs]):  # (A list: every process polled.)
    failed = [i for i, p in enumerate(procs) if p.popen.returncode not in (None, 0)]
    if failed or time.monotonic() > deadline:
      stop(procs, grace_s)
      logs = '\n'.join(f'--- process {i} (rc {p.popen.returncode}):\n{p.tail()}' for i, p in enumerate(procs))
      what = f'process {failed[0]} failed' if failed else f'timed out after {timeout_s:.0f} s (a hang?)'
      test.fail(f'{len(procs)}-process run: {what}\n{logs}')
    time.sleep(0.1)
  for i, p in enumerate(procs):
    test.assertEqual(p.popen.returncode, 0, f'process {i}:\n{p.tail()}')


def run_two_processes(test, module: str, out_dir: str, *, timeout_s: float, devices_per_process: int = 2) -> None:
  """Runs `python -m MODULE [ARGS...] PORT PROCESS_ID OUT_DIR` twice as one `jax.distributed` run; fails `test`
  unless both exit 0 by `timeout_s` (then both are stopped, see `wait`).

  Args:
    test: the `absltest.TestCase` to fail (with the workers' log tails).
    module: the worker module, optionally followed by space-separated leading arguments ('mod worker').
    out_dir: where the workers write their results (and their logs, worker<i>.log).
    timeout_s: a hang (e.g. in jax.distributed or a barrier) past this stops both and fails the test.
    devices_per_process: simulated CPU devices of each process.
  """
  cmd, *extra = module.split()
  port = free_port()
  procs = []
  for i in range(2):
    procs.append(_popen([sys.executable, '-m', cmd, *extra, str(port), str(i), out_dir], env(devices_per_process),
                        os.path.join(out_dir, f'worker{i}.log')))
  wait(test, procs, timeout_s=timeout_s)
