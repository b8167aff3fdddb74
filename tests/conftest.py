"""Test-wide setup: 8 simulated CPU devices (multi-device tests), before anything imports jax; a private temp dir."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()

# Every temporary file of the suite (tempfile.mkdtemp, absltest's create_tempdir, subprocesses through TMPDIR)
# goes under one directory per test process, removed when the process's session ends: tests leave nothing in
# /tmp, however they make their temporary directories.
_TMP = tempfile.mkdtemp(prefix='sao_tests_')
os.environ['TMPDIR'] = os.environ['TEST_TMPDIR'] = tempfile.tempdir = _TMP
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
