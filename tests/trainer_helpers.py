"""Shared by the trainer tests: one tiny override for every config (tiny model, short episodes, small batches),
as a dict of `config.<path>` values, so the same shapes (and compiled programs) serve every test and config."""

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from configs import _tiny
from sao_jax import config_lib
from tests import multiprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = _tiny.TINY  # configs/_tiny.py: one tiny override for every config.


def subprocess_env(devices: int = 1) -> dict[str, str]:
  """Environment of a child run: CPU with `devices` simulated devices, compiled without fusion emitters (no test
  compares a child run's floats with another program's: `multiprocess.NO_FUSION_EMITTERS`); it inherits the
  suite's persistent compilation cache (tests/conftest.py), so a program compiled by any process of the run with
  the same flags is loaded, not compiled again."""
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=multiprocess.child_xla_flags(devices, fusion_emitters=False),
              PYTHONPATH=ROOT)


def main_command(config_file: str, workdir: str, overrides: dict[str, Any]) -> list[str]:
  return [sys.executable, '-m', 'sao_jax.main', f'--config={config_file}', f'--workdir={workdir}',
          *config_lib.override_flags(overrides)]


def popen_main(config_file: str, workdir: str, overrides: dict[str, Any], *, env: dict[str, str], log: str
               ) -> subprocess.Popen:
  """Starts `python -m sao_jax.main` with its output (stdout and stderr) to the file `log`."""
  with open(log, 'ab') as f:
    return subprocess.Popen(main_command(config_file, workdir, overrides), cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT)


def checkpoint_fingerprints(workdir: str, step: int) -> dict:
  """The saved fingerprints of every array of checkpoint `step` of a run's workdir (its manifest): equal
  fingerprints, bitwise equal arrays."""
  with open(os.path.join(workdir, 'checkpoints', str(step), 'manifest', 'metadata')) as f:
    return json.load(f)['arrays']


def tmpfs(test, options: str) -> str:
  """A fresh tmpfs mounted with `options` (e.g. 'size=64k', 'size=1m,ro'), unmounted when `test` ends; the test is
  skipped where mounting is not allowed (not root, or a container without the capability)."""
  if os.geteuid() != 0:
    test.skipTest('mounting a tmpfs needs root')
  mount = tempfile.mkdtemp()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', options, 'tmpfs', mount], check=False,
                    capture_output=True).returncode:
    test.skipTest('this machine cannot mount a tmpfs')
  test.addCleanup(subprocess.run, ['umount', mount], check=False)
  return mount
