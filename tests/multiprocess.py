"""Runs a test worker module as 2 local `jax.distributed` processes (2 simulated CPU devices each)."""

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_two_processes(test, module: str, out_dir: str, *, timeout_s: float, devices_per_process: int = 2) -> None:
  """Starts `python -m MODULE [ARGS...] PORT PROCESS_ID OUT_DIR` twice; fails `test` unless both exit 0.

  Args:
    test: the `absltest.TestCase` to fail (with the worker's log tail) on a non-zero exit or a hang.
    module: the worker module, optionally followed by space-separated leading arguments ('mod worker').
    out_dir: where the workers write their results.
    timeout_s: a hang (e.g. in jax.distributed or a barrier) past this kills both and fails the test.
    devices_per_process: simulated CPU devices of each process.
  """
  cmd, *extra = module.split()
  port = free_port()
  env = dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices_per_process}',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  procs = [subprocess.Popen([sys.executable, '-m', cmd, *extra, str(port), str(i), out_dir], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
           for i in range(2)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout_s)[0].decode()[-3000:])
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    test.fail(f'2-process run of {module} timed out after {timeout_s} s (hang in jax.distributed or a barrier?)')
  for p, log in zip(procs, logs):
    test.assertEqual(p.returncode, 0, log)
