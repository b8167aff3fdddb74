"""Test-wide setup, before anything imports jax: 8 simulated CPU devices (multi-device tests), a private temp dir,
one compilation cache for all the run's processes."""

import atexit
import os
import shutil
import tempfile

from tests import multiprocess  # No jax: safe before XLA_FLAGS is set.

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# libtpu (a test requirement: the pod plan's tests compile for TPU topologies) locks itself to one process unless
# told otherwise; both pytest workers and their children compile with it.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
# The suite is compile-bound (tiny models, many programs): its processes compile fast (multiprocess.FAST_COMPILE).
os.environ['XLA_FLAGS'] = ' '.join((os.environ['XLA_FLAGS'], *multiprocess.fast_compile_flags()))

# Every temporary file of the suite (tempfile.mkdtemp, absltest's create_tempdir, subprocesses through TMPDIR)
# goes under one directory per test process, removed when the process's session ends: tests leave nothing in
# /tmp, however they make their temporary directories.
_TMP = tempfile.mkdtemp(prefix='sao_tests_')
os.environ['TMPDIR'] = os.environ['TEST_TMPDIR'] = tempfile.tempdir = _TMP
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)

# One persistent compilation cache for the whole run: set here in pytest's first process, before xdist starts
# its workers, so both workers and every child process a test starts (they inherit the environment) read and
# write the same cache, and a tiny program compiled by one is loaded by the others. A size cap turns on the
# cache's file lock, so two processes never read an entry while it is being written.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(_TMP, 'jax_compilation_cache'),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
                    JAX_COMPILATION_CACHE_MAX_SIZE=str(8 << 30))
