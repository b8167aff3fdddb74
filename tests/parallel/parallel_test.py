"""Tests for sao_jax.parallel: mesh sizes, logical rules -> shardings, batch layout, layout errors."""

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import PartitionSpec as P

from configs import base
from sao_jax import parallel
from sao_jax.errors import ConfigError
from tests import multiprocess


class _Toy(nnx.Module):
  """A module whose params carry logical axis names like the real decoder's."""

  def __init__(self, rngs):
    init = nnx.initializers.normal(0.02)
    self.embed = nnx.Param(nnx.with_partitioning(init, ('vocab', 'embed'))(rngs.params(), (64, 32)))
    self.up = nnx.Param(nnx.with_partitioning(init, ('embed', 'mlp'))(rngs.params(), (32, 48)))
    self.heads = nnx.Param(nnx.with_partitioning(init, ('embed', 'heads', 'head_dim'))(rngs.params(), (32, 4, 8)))
    self.odd = nnx.Param(nnx.with_partitioning(init, ('embed', 'mlp'))(rngs.params(), (32, 5)))
    self.scale = nnx.Param(jnp.ones((32,)))


def _toy():
  with nnx.use_eager_sharding(False):
    return _Toy(nnx.Rngs(0))


def _cfg(**mesh):
  c = base.get_config()
  for k, v in mesh.items():
    c.mesh[k] = v
  return c


class MeshTest(parameterized.TestCase):

  def test_eight_devices(self):
    self.assertEqual(jax.device_count(), 8)

  @parameterized.parameters(
      (dict(data=1, fsdp=-1, tensor=1), (1, 8, 1)),
      (dict(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
      (dict(data=-1, fsdp=1, tensor=4), (2, 1, 4)),
      (dict(data=1, fsdp=4, tensor=2), (1, 4, 2)),
  )
  def test_shape(self, sizes, expected):
    self.assertEqual(parallel.mesh_shape(sizes, 8), expected)
    mesh = parallel.make_mesh(sizes)
    self.assertEqual(tuple(mesh.shape.values()), expected)
    self.assertEqual(mesh.axis_names, parallel.MESH_AXES)

  @parameterized.parameters(
      (dict(data=4, fsdp=4, tensor=1), 'needs 16 devices'),
      (dict(data=3, fsdp=-1, tensor=1), 'config.mesh.fsdp=-1'),
      (dict(data=2, fsdp=2, tensor=1), 'covers 4 of the 8'),
      (dict(data=-1, fsdp=-1, tensor=1), 'at most one'),
      (dict(data=0, fsdp=-1, tensor=1), 'config.mesh.data=0'),
  )
  def test_impossible_mesh(self, sizes, message):
    with self.assertRaisesRegex(ConfigError, message):
      parallel.mesh_shape(sizes, 8)

  def test_mesh_on_subset_of_devices(self):
    mesh = parallel.make_mesh(dict(data=1, fsdp=2, tensor=2), devices=jax.devices()[:4])
    self.assertEqual(mesh.devices.size, 4)

  def test_layout_errors_name_fields(self):
    c = _cfg(data=2, fsdp=2, tensor=2)
    mesh = parallel.make_mesh(c.mesh)
    c.trainer.batch_size = 6
    with self.assertRaisesRegex(ConfigError, r'config.trainer.batch_size=6 .*config.mesh.data \* config.mesh.fsdp'):
      parallel.check_layout(c, mesh)
    c.trainer.batch_size = 8
    c.trainer.minibatch_size = 2
    with self.assertRaisesRegex(ConfigError, 'config.trainer.minibatch_size=2'):
      parallel.check_layout(c, mesh)
    c.trainer.minibatch_size = 4

    class M:
      num_heads, num_kv_heads = 4, 1
    with self.assertRaisesRegex(ConfigError, r'num_kv_heads=1 is not divisible by config.mesh.tensor=2'):
      parallel.check_layout(c, mesh, M)
    M.num_kv_heads = 2
    parallel.check_layout(c, mesh, M)
    parallel.check_layout(c, {'data': 2, 'fsdp': 2, 'tensor': 2}, M)  # A shape: a mesh of devices not visible here.
    with self.assertRaisesRegex(ConfigError, 'num_heads=4 is not divisible by config.mesh.tensor=8'):
      parallel.check_layout(c, {'data': 1, 'fsdp': 1, 'tensor': 8}, M)

  def test_impossible_mesh_names_each_axis(self):
    named = r'config\.mesh\.data=1 \* config\.mesh\.fsdp=3 \* config\.mesh\.tensor=1 = 3: covers 3 of the 8'
    with self.assertRaisesRegex(ConfigError, named):
      parallel.make_mesh(dict(data=1, fsdp=3, tensor=1))


class ShardingTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.mesh = parallel.make_mesh(dict(data=1, fsdp=4, tensor=2))
    self.rules = base.get_config().mesh.rules

  def test_logical_to_spec(self):
    spec = parallel.logical_to_spec(('embed', 'mlp'), (32, 48), self.mesh, self.rules)
    self.assertEqual(spec, P('fsdp', 'tensor'))
    # A mesh axis is used once per array; size-1 axes are dropped.
    rules = (('a', 'fsdp'), ('b', ('fsdp', 'tensor')), ('c', 'data'))
    self.assertEqual(parallel.logical_to_spec(('a', 'b', 'c'), (8, 8, 8), self.mesh, rules),
                     P('fsdp', 'tensor', None))
    # Non-divisible dims fall back to replication.
    self.assertEqual(parallel.logical_to_spec(('embed', 'mlp'), (32, 5), self.mesh, self.rules), P('fsdp', None))

  def test_unknown_names_are_errors(self):
    with self.assertRaisesRegex(ConfigError, "no rule for logical axis 'experts'"):
      parallel.logical_to_spec(('experts',), (8,), self.mesh, self.rules)
    with self.assertRaisesRegex(ConfigError, 'unknown mesh axes'):
      parallel.rules_dict((('embed', 'model'),), self.mesh)
    with self.assertRaisesRegex(ConfigError, r"\['model'\]; mesh axes are \['data', 'fsdp', 'tensor'\]"):
      parallel.rules_dict((('embed', 'model'),))  # Without a mesh: the config's axes.
    with self.assertRaisesRegex(ConfigError, "two rules for 'embed'"):
      parallel.rules_dict((('embed', 'fsdp'), ('embed', None)))
    with self.assertRaisesRegex(ConfigError, 'is not a .logical_name, mesh_axes. pair'):
      parallel.rules_dict(('embed',))

  def test_param_and_optimizer_shardings_are_derived(self):
    model = _toy()
    params = nnx.state(model, nnx.Param)
    sh = parallel.tree_shardings(params, self.mesh, self.rules)
    self.assertEqual(sh['embed'].get_value().spec, P('tensor', 'fsdp'))
    self.assertEqual(sh['heads'].get_value().spec, P('fsdp', 'tensor', None))
    self.assertEqual(sh['odd'].get_value().spec, P('fsdp', None))
    self.assertEqual(sh['scale'].get_value().spec, P())
    placed = jax.device_put(params, sh)
    self.assertEqual(placed['up'].get_value().sharding.spec, P('fsdp', 'tensor'))
    # Optimizer state: the same derivation, from an abstract state (nothing allocated).
    tx = optax.adamw(1e-3)
    abstract = jax.eval_shape(tx.init, params)
    osh = parallel.tree_shardings(abstract, self.mesh, self.rules)
    opt = jax.jit(tx.init, out_shardings=osh)(placed)
    adam = opt[0]
    self.assertEqual(adam.mu['up'].get_value().sharding.spec, P('fsdp', 'tensor'))
    self.assertEqual(adam.nu['embed'].get_value().sharding.spec, P('tensor', 'fsdp'))
    self.assertEqual(adam.count.sharding.spec, P())
    # Fully sharded: each device holds 1/8 of `up`.
    self.assertEqual(placed['up'].get_value().addressable_shards[0].data.shape, (8, 24))

  def test_batch_sharding(self):
    mesh = parallel.make_mesh(dict(data=2, fsdp=2, tensor=2))
    x = jax.device_put(np.arange(16 * 3).reshape(16, 3), parallel.batch_sharding(mesh))
    self.assertEqual(x.addressable_shards[0].data.shape, (4, 3))
    self.assertEqual(parallel.local_row_range(16, mesh), (0, 16))
    g = parallel.global_batch({'a': np.arange(16.), 'b': np.ones((16, 2))}, mesh, 16)
    np.testing.assert_array_equal(parallel.to_host(g)['a'], np.arange(16.))
    with self.assertRaisesRegex(ValueError, r'rows \[0, 16\)'):
      parallel.global_batch({'a': np.arange(8.)}, mesh, 16)

  def test_distributed_single_process_is_noop(self):
    self.assertFalse(parallel.initialize(base.get_config().distributed))
    self.assertTrue(parallel.is_main_process())
    c = base.get_config()
    c.distributed.num_processes = 2
    with self.assertRaisesRegex(ConfigError, 'coordinator_address'):
      parallel.initialize(c.distributed)
    c.distributed.process_id = 3
    with self.assertRaisesRegex(ConfigError, 'process_id=3'):
      parallel.initialize(c.distributed)

  def test_handshake_sums_over_every_group_of_the_mesh(self):
    # data 2 x fsdp 4 x tensor 1: the groups of {data} (2 devices), {fsdp} (4) and {data, fsdp} (8); tensor has
    # no group. Each sum of ones counts its group's devices: a missing or wrong collective shows.
    mesh = parallel.make_mesh(dict(data=2, fsdp=4, tensor=1))
    compiled, x = parallel.handshake_program(mesh)
    sums = [np.asarray(parallel.to_host(s)) for s in compiled(x)]
    np.testing.assert_array_equal(np.stack(sums), np.array([[2] * 8, [4] * 8, [8] * 8]))
    self.assertIs(parallel.handshake_program(mesh)[0], compiled)  # Compiled once per mesh.
    self.assertIsNone(parallel.handshake_program(parallel.make_mesh(dict(data=1, fsdp=1, tensor=1),
                                                                    devices=jax.devices()[:1])))
    parallel.sync('one process', meshes=(mesh,))  # One process: returns at once.

  @parameterized.parameters(
      (dict(num_processes=0), 'num_processes=0'),
      (dict(num_processes=2, process_id=2, coordinator_address='h:1'), r'process_id=2: must be in \[0, 2\)|'
       r'process_id=2: must be in \[0, num_processes=2\)'),
      (dict(process_id=-1), 'process_id=-1'),
      (dict(num_processes=2), 'coordinator_address'),
  )
  def test_distributed_check_is_initializes_check(self, fields, message):
    """`check_config` (run by config_lib.validate) refuses what `initialize` refuses, starting nothing."""
    c = base.get_config()
    for k, v in fields.items():
      c.distributed[k] = v
    with self.assertRaisesRegex(ConfigError, message):
      parallel.distributed.check_config(c)
    with self.assertRaisesRegex(ConfigError, message):
      parallel.initialize(c.distributed)


# Each process's values for `process_max`, in call order; the test expects their element-wise maxima.
_VALUES = ([3, 10, 7, 0], [5, 2, 7, 1])


class TwoProcessTest(absltest.TestCase):

  def test_sync_with_handshake_and_process_max(self):
    out = tempfile.mkdtemp()
    multiprocess.run_two_processes(self, 'tests.parallel.parallel_test worker', out, timeout_s=300)
    for pid in range(2):
      with open(os.path.join(out, f'report{pid}.json')) as f:
        self.assertEqual(json.load(f), {'maxima': [5, 10, 7, 1], 'keys_left': [0, 0, 2, 2],
                                         'handshake_sums': [4, 4]})


def _mp_worker(port: str, process_id: str, out: str) -> None:
  pid = int(process_id)
  jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2, process_id=pid, initialization_timeout=120)
  mesh = parallel.make_mesh(dict(data=1, fsdp=-1, tensor=1))  # 2 devices per process: one group of 4.
  parallel.sync('test', meshes=(mesh,))
  compiled, x = parallel.handshake_program(mesh)
  sums = [int(np.asarray(shard.data)[0]) for shard in compiled(x)[0].addressable_shards]  # This process's 2.
  maxima = [parallel.process_max('value', v) for v in _VALUES[pid]]  # The 3rd and 4th delete exchanges 1, 2.
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
  keys = [len(jax_distributed.global_state.client.key_value_dir_get(f'sao_jax/max/{k}')) for k in range(1, 5)]
  with open(os.path.join(out, f'report{pid}.json'), 'w') as f:
    json.dump({'maxima': maxima, 'keys_left': keys, 'handshake_sums': sums}, f)
  jax.distributed.shutdown()


if __name__ == '__main__':
  if len(sys.argv) == 5 and sys.argv[1] == 'worker':
    _mp_worker(*sys.argv[2:5])
  else:
    absltest.main()
