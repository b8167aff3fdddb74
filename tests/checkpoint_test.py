"""Tests of sao_jax.checkpoint: bit-exact round trips, keep-N, step selection, sharded restore, load_policy, and
the run config's diff on resume."""

import functools
import json
import os
import shutil
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from configs import base
from sao_jax import checkpoint
from sao_jax import config_lib
from sao_jax import parallel
from sao_jax.checkpoint import contents as checkpoint_contents
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder
from tests import multiprocess

_CFG = get_model_config('tiny', num_layers=1, embed_dim=32, mlp_dim=64, vocab_size=128, head_dim=8)


def _leaves_equal(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(la, lb))


_TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@jax.jit
def _arrays(seed):
  """(policy state, AdamW state after one update) of a model initialised from `seed` (jitted: fast)."""
  model = Decoder(_CFG, rngs=nnx.Rngs(jax.random.key(seed)))
  params = nnx.state(model, nnx.Param)
  opt = _TX.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 0.25), params)
  _, opt = _TX.update(grads, opt, params)
  return nnx.state(model), opt


@functools.cache
def _graphdef():
  return nnx.graphdef(nnx.eval_shape(lambda: Decoder(_CFG, rngs=nnx.Rngs(0))))


def _host_policy(seed: int):
  """A Decoder-shaped nnx.State of numpy arrays (no compile: what the 2-process workers save)."""
  abstract = nnx.state(nnx.eval_shape(lambda: Decoder(_CFG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(x.dtype), abstract)


def _model(seed: int = 0) -> Decoder:
  """A Decoder initialised from `seed` (built under jit: eager init is slow)."""
  return nnx.merge(_graphdef(), _arrays(jnp.asarray(seed, jnp.int32))[0])


def _state(step: int, seed: int = 0):
  """A checkpoint state with an optax AdamW state after one update, an iterator state, a model config."""
  policy, opt = _arrays(jnp.asarray(seed, jnp.int32))
  counters = {'step': jnp.asarray(step, jnp.int32), 'skipped': jnp.asarray(1, jnp.int32)}
  return checkpoint.CheckpointState(
      step=step, policy=policy, optimizer={'policy': opt, 'counters': counters},
      data={'kind': 'generated', 'seed': 3, 'index': 17 + step},
      metadata=checkpoint.policy_metadata(_CFG, note='test'))


class CheckpointTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix='ckpt_test_')

  def test_round_trip_bit_exact_typed(self):
    state = _state(5)
    with checkpoint.Checkpointer(self.dir, keep=2) as ckpt:
      self.assertTrue(ckpt.save(state))
      ckpt.wait()
      target = checkpoint.CheckpointState(
          step=0, policy=checkpoint.abstract_target(jax.eval_shape(lambda: state.policy)),
          optimizer=checkpoint.abstract_target(jax.eval_shape(lambda: state.optimizer)))
      got = ckpt.restore(target=target)
    self.assertEqual(got.step, 5)
    self.assertIsInstance(got.policy, nnx.State)
    self.assertEqual(jax.tree.structure(got.optimizer), jax.tree.structure(state.optimizer))
    self.assertIsInstance(got.optimizer['policy'][1][0], optax.ScaleByAdamState)
    self.assertTrue(_leaves_equal(got.policy, state.policy))
    self.assertTrue(_leaves_equal(got.optimizer, state.optimizer))
    self.assertEqual(int(got.optimizer['policy'][1][0].count), 1)
    self.assertEqual(got.data, state.data)
    self.assertEqual(got.metadata, state.metadata)
    self.assertIsNone(got.critic)
    self.assertEqual(checkpoint.model_config_from_json(got.metadata['model_config']), _CFG)

  def test_async_save_survives_deleting_the_arrays(self):
    """After `save` returns, the caller may donate its buffers (the learner does) while the write goes on."""
    state = _state(2)
    host = jax.tree.map(np.asarray, state.policy)
    with checkpoint.Checkpointer(self.dir, async_save=True) as ckpt:
      ckpt.save(state)
      for leaf in jax.tree.leaves(state.policy):
        leaf.delete()
      ckpt.wait()
      target = checkpoint.CheckpointState(step=0, policy=checkpoint.abstract_target(host))
      got = ckpt.restore(target=target, items=('policy',))
    self.assertTrue(_leaves_equal(got.policy, host))

  def test_restore_without_target_gives_raw_arrays(self):
    state = _state(1)
    with checkpoint.Checkpointer(self.dir, async_save=False) as ckpt:
      ckpt.save(state)
      got = ckpt.restore(items=('optimizer', 'data'))
    self.assertIsNone(got.policy)
    self.assertEqual(got.data, state.data)
    np.testing.assert_array_equal(
        sorted(np.asarray(x).sum() for x in jax.tree.leaves(got.optimizer)),
        sorted(np.asarray(x).sum() for x in jax.tree.leaves(state.optimizer)))

  def test_keep_n_and_specific_step(self):
    with checkpoint.Checkpointer(self.dir, keep=2) as ckpt:
      for step in (1, 2, 3, 4):
        ckpt.save(_state(step, seed=step))
      ckpt.wait()
      self.assertEqual(ckpt.all_steps(), [3, 4])
      self.assertEqual(ckpt.latest_step(), 4)
      target = checkpoint.CheckpointState(
          step=0, policy=checkpoint.abstract_target(jax.eval_shape(lambda: _state(0).policy)))
      got = ckpt.restore(3, target=target, items=('policy', 'data'))
      self.assertEqual(got.step, 3)
      self.assertEqual(got.data['index'], 20)
      self.assertTrue(_leaves_equal(got.policy, _state(3, seed=3).policy))
      self.assertFalse(_leaves_equal(got.policy, _state(4, seed=4).policy))
      with self.assertRaisesRegex(FileNotFoundError, r'step 1 .*available: \[3, 4\]'):
        ckpt.restore(1)
      with self.assertRaisesRegex(ValueError, 'already exists'):
        ckpt.save(_state(4))
    # A new manager on the same directory resumes the latest step.
    with checkpoint.Checkpointer(self.dir, keep=2) as ckpt:
      self.assertEqual(ckpt.restore(items=('data',)).step, 4)

  def test_keep_from_config_and_errors(self):
    config = ml_collections.ConfigDict({'workdir': self.dir, 'trainer': {'keep_checkpoints': 1}})
    settings = checkpoint.CheckpointConfig.from_config(config)
    self.assertEqual(settings, checkpoint.CheckpointConfig(os.path.join(self.dir, 'checkpoints'), keep=1))
    with checkpoint.Checkpointer.from_settings(settings, async_save=False) as ckpt:
      self.assertEqual(ckpt.directory, os.path.join(self.dir, 'checkpoints'))
      ckpt.save(_state(1))
      ckpt.save(_state(2))
      self.assertEqual(ckpt.all_steps(), [2])
      with self.assertRaisesRegex(ValueError, 'policy is required'):
        ckpt.save(checkpoint.CheckpointState(step=3, policy=None))
      with self.assertRaisesRegex(ValueError, 'data must be JSON'):
        ckpt.save(checkpoint.CheckpointState(step=3, policy={'w': jnp.ones(2)}, data={'x': object()}))
    config.trainer.keep_checkpoints = 0
    with self.assertRaisesRegex(config_lib.ConfigError, 'config.trainer.keep_checkpoints'):
      checkpoint.CheckpointConfig.from_config(config)
    with self.assertRaisesRegex(FileNotFoundError, 'No checkpoint'):
      checkpoint.Checkpointer(os.path.join(self.dir, 'empty')).restore()

  def test_sharded_restore_on_8_devices(self):
    self.assertEqual(jax.device_count(), 8)
    state = _state(7)
    with checkpoint.Checkpointer(self.dir) as ckpt:
      ckpt.save(state)
      ckpt.wait()
      mesh_cfg = ml_collections.ConfigDict({'data': 1, 'fsdp': 4, 'tensor': 2})
      mesh = parallel.make_mesh(mesh_cfg)
      rules = base.get_config().mesh.rules
      abstract = jax.eval_shape(lambda: state.policy)
      shardings = parallel.tree_shardings(abstract, mesh, rules)
      target = checkpoint.CheckpointState(step=0, policy=checkpoint.abstract_target(abstract, shardings))
      got = ckpt.restore(target=target, items=('policy',))
    self.assertTrue(_leaves_equal(got.policy, state.policy))
    sharded = 0
    for leaf, want in zip(jax.tree.leaves(got.policy), jax.tree.leaves(shardings)):
      self.assertTrue(leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want))
      sharded += int(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated)
    self.assertGreater(sharded, 0)  # The embedding and projections really are split over devices.

  def test_load_policy(self):
    model, older = _model(11), _model(12)
    with checkpoint.Checkpointer(self.dir) as ckpt:
      for step, m in ((4, older), (9, model)):
        ckpt.save(checkpoint.CheckpointState(step=step, policy=nnx.state(m),
                                             metadata=checkpoint.policy_metadata(_CFG)))
    loaded, cfg = checkpoint.load_policy(self.dir)
    self.assertEqual(cfg, _CFG)
    self.assertTrue(_leaves_equal(nnx.state(loaded), nnx.state(model)))
    loaded_old, _ = checkpoint.load_policy(self.dir, step=4)
    self.assertTrue(_leaves_equal(nnx.state(loaded_old), nnx.state(older)))
    bf16, cfg16 = checkpoint.load_policy(self.dir, dtype='bfloat16')
    self.assertEqual(cfg16.dtype, 'bfloat16')
    self.assertTrue(_leaves_equal(nnx.state(bf16), nnx.state(model)))  # Params stay float32.
    tokens = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))
    np.testing.assert_array_equal(np.asarray(forward(loaded, tokens)), np.asarray(forward(model, tokens)))
    with self.assertRaisesRegex(FileNotFoundError, 'does not exist'):
      checkpoint.load_policy(os.path.join(self.dir, 'nope'))

  def test_load_policy_needs_model_config(self):
    with checkpoint.Checkpointer(self.dir, async_save=False) as ckpt:
      ckpt.save(checkpoint.CheckpointState(step=1, policy=nnx.state(_model()), metadata={'other': 1}))
    with self.assertRaisesRegex(ValueError, 'metadata.model_config'):
      checkpoint.load_policy(self.dir)


def _largest_file(directory: str) -> str:
  files = [os.path.join(d, f) for d, _, names in os.walk(directory) for f in names]
  return max(files, key=os.path.getsize)


def _truncate_array_data(step_dir: str) -> None:
  path = _largest_file(os.path.join(step_dir, 'policy'))
  with open(path, 'r+b') as f:
    f.truncate(os.path.getsize(path) // 2)


def _flip_64_bytes(step_dir: str) -> None:
  path = _largest_file(os.path.join(step_dir, 'policy'))
  with open(path, 'r+b') as f:
    data = bytearray(f.read())
    start = len(data) // 2
    for i in range(start, start + 64):
      data[i] ^= 0xFF
    f.seek(0)
    f.write(data)


def _delete_policy(step_dir: str) -> None:
  shutil.rmtree(os.path.join(step_dir, 'policy'))


def _empty_step_dir(step_dir: str) -> None:
  for name in os.listdir(step_dir):
    path = os.path.join(step_dir, name)
    shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)


class ConfigDiffTest(absltest.TestCase):

  def test_a_resume_accepts_knobs_added_since_at_their_default(self):
    """A checkpoint written before a knob existed resumes when the knob is at its `configs/base.py` default
    (which keeps the old behaviour); set to anything else, or a knob that changed or went away, is named."""
    config, defaults = base.get_config(), config_lib.defaults()
    saved = checkpoint.flat_config(config)
    self.assertEqual(checkpoint.config_differences(saved, config, defaults), [])
    older = {k: v for k, v in saved.items() if k != 'sampler.compile_ahead'}  # Written before the knob.
    self.assertEqual(checkpoint.config_differences(older, config, defaults), [])
    config.sampler.compile_ahead = True
    self.assertEqual(checkpoint.config_differences(older, config, defaults), ['sampler.compile_ahead'])
    self.assertEqual(checkpoint.config_differences({**saved, 'sampler.gone': 1}, config, defaults),
                     ['sampler.compile_ahead', 'sampler.gone'])
    config.sampler.compile_ahead = False
    self.assertEqual(checkpoint.config_differences({**older, 'algo.eps_high': 9.0}, config, defaults),
                     ['algo.eps_high'])

  def test_a_resume_ignores_removed_knobs_that_changed_no_token(self):
    """A checkpoint written while `sampler.fuse_admissions` (and the other speed-only knobs) existed resumes at any
    of their values; another field gone from the config is still named."""
    config, defaults = base.get_config(), config_lib.defaults()
    self.assertEmpty(set(checkpoint_contents.REMOVED_KNOBS) & set(checkpoint.flat_config(config)))  # Removed indeed.
    saved = {**checkpoint.flat_config(config), 'sampler.fuse_admissions': True, 'sampler.row_groups': True,
             'sampler.admission_rows': 'padded', 'sampler.device_refill': False, 'sampler.prefix_cache': False}
    self.assertEqual(checkpoint.config_differences(saved, config, defaults), [])
    self.assertEqual(checkpoint.config_differences({**saved, 'sampler.gone': 1}, config, defaults), ['sampler.gone'])

  def test_resumable_changes_are_not_differences(self):
    config = base.get_config()
    saved = checkpoint.flat_config(config)
    config.workdir, config.trainer.num_steps, config.seed = '/elsewhere', 7, 3
    self.assertEqual(checkpoint.config_differences(saved, config, config_lib.defaults()), ['seed'])


class CorruptCheckpointTest(parameterized.TestCase):
  """A damaged newest step is detected, named in a loud log, and restore falls back to the previous step."""

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix='ckpt_corrupt_')
    with checkpoint.Checkpointer(self.dir, async_save=False) as ckpt:
      for step in (1, 2):
        ckpt.save(checkpoint.CheckpointState(step=step, policy=nnx.state(_model(step)),
                                             data={'index': step}, metadata=checkpoint.policy_metadata(_CFG)))

  def _target(self):
    return checkpoint.CheckpointState(step=0, policy=checkpoint.abstract_target(
        jax.eval_shape(lambda: nnx.state(_model(0)))))

  def test_intact_checkpoint_restores_the_newest_step(self):
    with checkpoint.Checkpointer(self.dir) as ckpt:
      got = ckpt.restore(target=self._target())
    self.assertEqual(got.step, 2)
    self.assertTrue(_leaves_equal(got.policy, nnx.state(_model(2))))

  @parameterized.named_parameters(
      # Each used to: raise a raw TensorStore error / restore silently wrong values (max diff 1e38) /
      # restore policy=None without an error / restore every item as None.
      ('truncated_array_data', _truncate_array_data, r'unreadable|fingerprint mismatch'),
      ('flipped_64_bytes', _flip_64_bytes, r'unreadable|fingerprint mismatch'),
      ('deleted_policy_dir', _delete_policy, r"item\(s\) \['policy'\] saved but missing on disk"),
      ('emptied_step_dir', _empty_step_dir, r'no manifest'),
  )
  def test_damaged_newest_step_falls_back_loudly(self, corrupt, why):
    corrupt(os.path.join(self.dir, '2'))
    with checkpoint.Checkpointer(self.dir) as ckpt:
      with self.assertLogs(level='ERROR') as logs:
        got = ckpt.restore(target=self._target())
      self.assertEqual(got.step, 1)
      self.assertTrue(_leaves_equal(got.policy, nnx.state(_model(1))))
      self.assertEqual(got.data, {'index': 1})
      text = '\n'.join(logs.output)
      self.assertIn('CHECKPOINT STEP 2 IN', text)
      self.assertRegex(text, why)
      with self.assertRaisesRegex(checkpoint.CheckpointCorrupt, why):  # An explicit step is not replaced.
        ckpt.restore(2, target=self._target())
    with self.assertLogs(level='ERROR'):
      model, _ = checkpoint.load_policy(self.dir)  # Eval loading falls back the same way.
    self.assertTrue(_leaves_equal(nnx.state(model), nnx.state(_model(1))))

  def test_no_intact_step_is_an_error_listing_each(self):
    _delete_policy(os.path.join(self.dir, '1'))
    _empty_step_dir(os.path.join(self.dir, '2'))
    with checkpoint.Checkpointer(self.dir) as ckpt:
      with self.assertLogs(level='ERROR'):
        with self.assertRaisesRegex(checkpoint.CheckpointCorrupt, r'No intact checkpoint.*step 2: no manifest.*'
                                    r'step 1: item\(s\) \[.policy.\] saved but missing'):
          ckpt.restore(target=self._target())

  def test_a_corrupt_json_item_is_detected(self):
    path = os.path.join(self.dir, '2', 'data')
    name = [f for f in os.listdir(path) if not f.startswith('commit')][0]
    with open(os.path.join(path, name), 'w') as f:
      json.dump({'index': 7}, f)
    with checkpoint.Checkpointer(self.dir) as ckpt:
      with self.assertLogs(level='ERROR') as logs:
        self.assertEqual(ckpt.restore(items=('data',)).data, {'index': 1})
    self.assertIn('data: differs from what was saved', '\n'.join(logs.output))

  def test_fingerprints_change_with_any_element_and_not_with_sharding(self):
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    base_fp = checkpoint.fingerprints({'x': x})['x']
    for i in range(0, 64, 7):
      y = x.copy()
      y.flat[i] = np.nextafter(y.flat[i], np.float32(1e9))  # The smallest change of one element.
      self.assertNotEqual(checkpoint.fingerprints({'x': y})['x'][:2], base_fp[:2], i)
    self.assertNotEqual(checkpoint.fingerprints({'x': x.T.copy()})['x'][:2], base_fp[:2])  # Order matters.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ('a', 'b'))
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('a', 'b')))
    self.assertEqual(checkpoint.fingerprints({'x': sharded})['x'], base_fp)
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint32):
      fp = checkpoint.fingerprints({'x': jnp.asarray(x).astype(dtype)})['x']
      self.assertEqual(fp[2:], [[8, 8], str(np.dtype(dtype))])

  def test_temp_dirs_of_interrupted_saves_are_removed(self):
    tmp = os.path.join(self.dir, '3.orbax-checkpoint-tmp-1234567')
    os.makedirs(os.path.join(tmp, 'policy'))
    with open(os.path.join(tmp, 'policy', 'blob'), 'wb') as f:
      f.write(b'x' * 100)
    with self.assertLogs(level='WARNING') as logs:
      ckpt = checkpoint.Checkpointer(self.dir)
    with ckpt:
      self.assertFalse(os.path.exists(tmp))
      self.assertIn('left by an interrupted save', '\n'.join(logs.output))
      self.assertEqual(ckpt.all_steps(), [1, 2])
      self.assertEqual(ckpt.restore(items=('data',)).data, {'index': 2})


class MultiProcessTest(absltest.TestCase):
  """Two processes (2 CPU devices each) save and restore one checkpoint sharded over a global mesh of 4."""

  def test_two_processes_save_and_restore_sharded(self):
    out = tempfile.mkdtemp(prefix='ckpt_mp_')
    multiprocess.run_two_processes(self, 'tests.checkpoint_test worker', out, timeout_s=300)
    reports = []
    for i in range(2):
      with open(os.path.join(out, f'report{i}.json')) as f:
        reports.append(json.load(f))
    for i, r in enumerate(reports):
      self.assertEqual((r['process'], r['processes'], r['devices']), (i, 2, 4))
      self.assertGreater(r['shards_checked'], 0)
      self.assertTrue(r['local_shards_only'])
      self.assertEqual(r['data'], {'kind': 'generated', 'seed': 3, 'index': 18})
    self.assertGreater(reports[0]['split_leaves'], 0)  # Some leaves really are split across the processes.
    # One checkpoint, written by both processes' shards, readable by a single process afterwards.
    with checkpoint.Checkpointer(os.path.join(out, 'ckpt')) as ckpt:
      self.assertEqual(ckpt.all_steps(), [1])
      want = _host_policy(5)
      target = checkpoint.CheckpointState(step=0, policy=checkpoint.abstract_target(want))
      got = ckpt.restore(target=target, items=('policy', 'metadata'))
    self.assertTrue(_leaves_equal(got.policy, want))
    self.assertEqual(checkpoint.model_config_from_json(got.metadata['model_config']), _CFG)


def _mp_worker(port: str, process_id: str, out: str) -> None:
  """One process of MultiProcessTest: global mesh fsdp=4 over 2 processes x 2 devices."""
  pid = int(process_id)
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=pid, initialization_timeout=120)
  from sao_jax.learner import state as state_lib  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_mesh(ml_collections.ConfigDict({'data': 1, 'fsdp': 4, 'tensor': 1}))
  rules = base.get_config().mesh.rules
  host = _host_policy(5)  # The same values on both processes.
  abstract = checkpoint.abstract_target(host)
  shardings = parallel.tree_shardings(abstract, mesh, rules)
  policy = state_lib.place(host, shardings)  # Global arrays; each process holds only its shards.
  with checkpoint.Checkpointer(os.path.join(out, 'ckpt')) as ckpt:
    ckpt.save(checkpoint.CheckpointState(step=1, policy=policy, data={'kind': 'generated', 'seed': 3, 'index': 18},
                                         metadata=checkpoint.policy_metadata(_CFG)))
    ckpt.wait()
    got = ckpt.restore(target=checkpoint.CheckpointState(
        step=0, policy=checkpoint.abstract_target(abstract, shardings)))
  checked, local_only, split = 0, True, 0
  for leaf, want in zip(jax.tree.leaves(got.policy), jax.tree.leaves(host)):
    local_only &= not leaf.is_fully_addressable or leaf.sharding.is_fully_replicated
    split += int(not leaf.is_fully_addressable)
    for shard in leaf.addressable_shards:
      np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
      checked += 1
  with open(os.path.join(out, f'report{pid}.json'), 'w') as f:
    json.dump({'process': jax.process_index(), 'processes': jax.process_count(), 'devices': jax.device_count(),
               'shards_checked': checked, 'local_shards_only': bool(local_only), 'split_leaves': split,
               'data': got.data}, f)
  jax.distributed.shutdown()


if __name__ == '__main__':
  if len(sys.argv) == 5 and sys.argv[1] == 'worker':
    _mp_worker(*sys.argv[2:5])
  else:
    absltest.main()
