"""Test-wide setup, before anything imports jax: 8 simulated CPU devices (multi-device tests), a private temp dir,
one compilation cache for all the run's processes."""

import atexit
import os
import shutil
import tempfile

import pytest

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
# write the same cache, and a tiny program compiled by one is loaded by the others. No size cap (-1): with one,
# jax's cache takes a file lock and, before every write, lists the whole directory and reads every entry's access
# time to see whether to evict (the suite writes thousands of entries, so its writes cost O(entries) each: 41 s of
# a 178 s run of two model test files went there). Without the lock an entry can be read while another process
# writes it: its zlib stream is then truncated or fails its checksum, jax warns and compiles the program instead;
# nothing half-written is ever loaded.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ.update(JAX_COMPILATION_CACHE_DIR=os.path.join(_TMP, 'jax_compilation_cache'),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0', JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0',
                    JAX_COMPILATION_CACHE_MAX_SIZE='-1')

# The files holding the suite's longest tests (each 30-160 s of one worker on 2 cores: trainer runs in child
# processes, TPU plans, the continuous sampler's warm-ups, the learner's and samplers' equivalence tests' many
# compiles), longest first. They run first: the README's command
# splits the tests with xdist's `--dist worksteal` (a worker out of tests takes half of the other's queue), so
# the run ends on short tests and neither worker waits on the other's last long one (in collection order these
# files came last, and a worker sat idle while the other finished them).
LONG_FIRST = (
    'tests/tools/aot_test.py',
    'tests/trainer_chaos_test.py',
    'tests/trainer_configs_test.py',
    'tests/learner/learner_test.py',
    'tests/generate/static_test.py',
    'tests/experiments_test.py',
    'tests/paths_test.py',
    'tests/learner/memory_test.py',
    'tests/generate/weights_test.py',
    'tests/rollout/continuous_test.py',
    'tests/trainer_multihost_test.py',
    'tests/learner/microbatch_test.py',
    'tests/learner/packing_test.py',
    'tests/learner/lora_test.py',
    'tests/learner/reference_test.py',
    'tests/benchmarks/loop_test.py',
    'tests/trainer_devices_test.py',
    'tests/trainer_faults_test.py',
    'tests/trainer_test.py',
    'tests/trainer_recovery_test.py',
    'tests/trainer_pack_test.py',
)


def pytest_collection_modifyitems(items):
  """`LONG_FIRST`'s files first (in that order), then every other test in collection order; within a file,
  collection order."""
  rank = {path: i for i, path in enumerate(LONG_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split('::')[0], len(rank)))  # Stable: the rest keep order.


@pytest.fixture(autouse=True, scope='session')
def _learner_update_compiles_fast():
  """The learner's update compiles without XLA:CPU's fusion emitters in the suite's processes
  (`learner.CPU_COMPILER_OPTIONS`; trainer children get them off through `tests.multiprocess.NO_FUSION_EMITTERS`):
  the tiny models' updates are compile-bound (one tiny trainer run's update: 19 s of compile -> 7 s; learner_test's
  sharded, compile-ahead and hyperparameter tests 75 s -> 55 s at load 5). Every learner test passes at its
  tolerance so (its updates against the numpy references, one device, 2 processes, packed rows); not under
  SAO_TEST_XLA_FAST=0."""
  if multiprocess.fast_compile_flags():
    from sao_jax.learner import learner as learner_lib  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
    learner_lib.CPU_COMPILER_OPTIONS['xla_cpu_use_fusion_emitters'] = False
  yield
