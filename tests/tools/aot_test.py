"""The ahead-of-time plan (`sao_jax.tools.aot`): every program of a run compiled for a TPU topology by libtpu's
compiler (installed by `scripts/setup.sh --test`), its figures checked against sizes computed here from shapes and
shardings alone."""

import json
import math
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from configs import arith
from sao_jax import config_lib
from sao_jax.models import llama
from sao_jax.models.build import model_config_of
from sao_jax.structs import BATCH_FIELDS, Batch
from sao_jax.tools import aot_plan
from sao_jax.tools import aot_programs

ROWS, SEQ = 16, 40


def _raw_config():
  c = arith.get_config()
  c.trainer.batch_size = ROWS
  c.trainer.seq_buckets = (SEQ,)
  c.sampler.batch_size = 4
  return c


def _shard_bytes(x, mesh) -> int:
  """One device's bytes of `x` from its spec: each dim divided (rounded up) by its mesh axes' sizes."""
  spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
  n = 1
  for dim, axes in zip(x.shape, spec):
    axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    n *= -(-dim // math.prod(mesh.shape[a] for a in axes))
  return n * np.dtype(x.dtype).itemsize


def _tiled(x) -> int:
  """An upper bound of one TPU device's bytes of `x`: its shard's two minor dims padded to (8, 128) tiles, in
  32-bit words at least."""
  shape = list(x.sharding.shard_shape(x.shape)) or [1]
  shape[-1] = -(-shape[-1] // 128) * 128
  if len(shape) > 1:
    shape[-2] = -(-shape[-2] // 8) * 8
  return math.prod(shape) * max(4, np.dtype(x.dtype).itemsize)


def _update_arguments(learner):
  """The update's arguments: (the state, the batch and the reference policy; the step's scalar numbers, which the
  compiler drops where the algorithm does not read them)."""
  batch = Batch.map_fields(lambda k: jax.ShapeDtypeStruct(
      Batch.field_shape(k, ROWS, SEQ), BATCH_FIELDS[k][1], sharding=getattr(learner._batch_shardings, k)))  # pylint: disable=protected-access
  return jax.tree.leaves((learner.state, batch, learner.ref_state)), jax.tree.leaves(learner.hparams)


class TopologyTest(absltest.TestCase):

  def test_slice_names(self):
    self.assertEqual(aot_plan.chip_grid('v5e', 64), 'v5e:8x8')
    self.assertEqual(aot_plan.chip_grid('v5e', 4), 'v5e:2x2')
    self.assertEqual(aot_plan.chip_grid('v5p', 64), 'v5p:4x4x4')
    self.assertEqual(aot_plan.chip_grid('v5p', 32), 'v5p:2x4x4')
    self.assertEqual(aot_plan.chip_grid('v5p', 4), 'v5p:2x2x1')
    devices, chip, name = aot_plan.topology_devices('v5p-128')  # 128 TensorCores: 64 chips.
    self.assertEqual((len(devices), name, chip.hbm_bytes), (64, 'v5p:4x4x4', 95 << 30))
    with self.assertRaisesRegex(ValueError, 'v5e-64'):
      aot_plan.topology_devices('tpu-64')


class PlanTest(absltest.TestCase):
  """The whole plan of the demo's run on a v5e 2x2 slice."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.plan = aot_plan.plan(_raw_config(), 'v5e:2x2', engines='both')
    cls.by_name = {p.name: p for p in cls.plan.programs}

  def test_every_program_compiles_with_positive_figures(self):
    self.assertEqual(set(self.by_name), {'update (sao)', 'update (grpo)', 'publish', 'slot admit',
                                         'slot decode', 'static prefill', 'static decode'})
    for p in self.plan.programs:
      with self.subTest(p.name):
        self.assertFalse(p.refused)
        self.assertGreater(p.argument_bytes, 0)
        self.assertGreater(p.total_bytes, 0)
        self.assertTrue(self.plan.fits(p))
    for name in ('update (sao)', 'update (grpo)', 'slot decode', 'static prefill'):
      self.assertGreater(self.by_name[name].flops, 0, name)
      self.assertGreater(self.by_name[name].roofline_s(self.plan.chip), 0, name)
    # SAO's update trains the critic K = 2 times besides the policy: more FLOPs than GRPO's.
    self.assertGreater(self.by_name['update (sao)'].flops, 2 * self.by_name['update (grpo)'].flops)
    run = self.plan.run
    for key in ('learner_step_s', 'learner_mfu', 'decode_step_s', 'rollout_tokens_per_s_per_actor_chip'):
      self.assertTrue(math.isfinite(run[key]) and run[key] > 0, (key, run[key]))

  def test_update_arguments_are_the_state_shards_padded_to_tpu_tiles_at_most(self):
    config = config_lib.validate(_raw_config(), log=False)
    devices, _, _ = aot_plan.topology_devices('v5e:2x2')
    mesh = aot_programs.learner_mesh(config.mesh, devices)
    learner = aot_programs._learner(config, model_config_of(config.model), mesh)  # pylint: disable=protected-access
    held, numbers = _update_arguments(learner)
    exact = sum(_shard_bytes(x, mesh) for x in held)
    got = self.by_name['update (sao)'].argument_bytes
    self.assertBetween(got, exact, sum(map(_tiled, held + numbers)))

  def test_json_carries_the_contract_fields(self):
    out = os.path.join(tempfile.mkdtemp(), 'plan.json')
    with open(out, 'w') as f:
      json.dump(self.plan.to_json(), f)
    with open(out) as f:
      programs = json.load(f)['programs']
    for entry in programs:
      self.assertEqual(entry['total_bytes_per_chip'], entry['argument_bytes_per_chip'] + entry[
          'output_bytes_per_chip'] + entry['temp_bytes_per_chip'] - entry['alias_bytes_per_chip'] + entry[
              'resident_bytes_per_chip'])
      self.assertEqual(entry['hbm_bytes_per_chip'], 16 << 30)
    self.assertIn('slot decode', self.plan.table())


class HostDevicesTest(absltest.TestCase):

  def test_update_arguments_equal_the_state_shards_on_host_devices(self):
    # No tile padding on CPU devices: the compiled update's argument bytes are the shards' sum exactly.
    config = config_lib.validate(_raw_config(), log=False)
    devices, chip, _ = aot_plan.topology_devices('cpu:8')
    self.assertIsNone(chip)
    mesh = aot_programs.learner_mesh(config.mesh, devices)
    learner = aot_programs._learner(config, model_config_of(config.model), mesh)  # pylint: disable=protected-access
    program = aot_plan.compile_program('update', lambda: learner.lower_update(ROWS, SEQ), args=learner.state)
    held, numbers = _update_arguments(learner)
    exact = sum(_shard_bytes(x, mesh) for x in held)
    self.assertBetween(program.argument_bytes, exact, exact + sum(_shard_bytes(x, mesh) for x in numbers))

  def test_activations_stay_split_by_rows(self):
    # The decoder's hidden states keep the batch's row split (`llama.rows_split`) rather than the embedding's
    # fsdp-split width, which would put every row on every device.
    config = config_lib.validate(_raw_config(), log=False)
    mesh = aot_programs.learner_mesh(config.mesh, jax.devices()[:8])
    cfg = model_config_of(config.model)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: llama.Decoder(cfg, rngs=nnx.Rngs(0))))
    from sao_jax import parallel  # pylint: disable=g-import-not-at-top
    state_sh = parallel.tree_shardings(state, mesh, config.mesh.rules)
    tokens = jax.ShapeDtypeStruct((ROWS, SEQ), jnp.int32, sharding=NamedSharding(mesh, parallel.batch_spec(2)))

    def hidden(s, t):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return nnx.merge(graphdef, s).hidden(t)
    compiled = jax.jit(hidden, in_shardings=(state_sh, tokens.sharding)).lower(
        jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), state, state_sh),
        tokens).compile()
    rows = compiled.output_shardings.spec[0]
    self.assertIn('fsdp', (rows,) if isinstance(rows, str) else tuple(rows or ()))  # data is 1: left out.


class PublishTest(absltest.TestCase):

  def test_publish_is_a_copy_per_process_never_the_whole_policy_per_chip(self):
    # v5e 4x4: four hosts of four chips; the actors of each host hold the policy split over its four chips. A
    # 26M-parameter model: TPU tiles (8 x 128) would pad the tiny one's arrays more than the layouts differ.
    raw = _raw_config()
    raw.model.name = 'bench-25m'
    config = config_lib.validate(raw, log=False)
    devices, _, _ = aot_plan.topology_devices('v5e:4x4')
    self.assertEqual(len({d.process_index for d in devices}), 4)
    mesh = aot_programs.learner_mesh(config.mesh, devices)
    learner = aot_programs._learner(config, model_config_of(config.model), mesh)  # pylint: disable=protected-access
    program, published = aot_programs._publish(learner, None, config.mesh.rules)  # pylint: disable=protected-access
    state = learner.policy_state()
    whole = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))
    # The actor layout splits heads / MLP / vocab over a host's 4 chips; what does not divide (norms) stays whole.
    bound = sum(_shard_bytes(x, x.sharding.mesh) for x in jax.tree.leaves(published))
    self.assertLess(bound, whole / 2)
    self.assertLessEqual(program.output_bytes, sum(map(_tiled, jax.tree.leaves(published))))
    # The layout before (the whole policy gathered, replicated on every learner chip) is what this catches.
    replicated = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), state)
    gather = jax.jit(lambda s: jax.tree.map(jnp.copy, s), out_shardings=replicated)
    before = aot_plan.compile_program('publish (replicated)', lambda: gather.lower(state), args=state)
    self.assertGreaterEqual(before.output_bytes, whole)
    self.assertGreater(before.output_bytes, sum(map(_tiled, jax.tree.leaves(published))))


class CommandTest(absltest.TestCase):

  def test_command_writes_the_plan(self):
    # --nogrpo: GRPO's update beside SAO's is PlanTest's (its compile and cost compiles are half of this run).
    out = os.path.join(tempfile.mkdtemp(), 'plan.json')
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, '-m', 'sao_jax.tools.aot', '--config=configs/arith.py', '--topology=cpu:4',
         '--config.trainer.batch_size=8', '--config.sampler.batch_size=4', '--nogrpo', f'--json={out}'],
        cwd=root, capture_output=True, text=True, timeout=900, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(out) as f:
      plan = json.load(f)
    self.assertIn('update (sao)', [p['name'] for p in plan['programs']])
    self.assertIn('--topology=cpu:4 --config.trainer.batch_size=8', plan['command'])  # Its settings, recorded.
    self.assertIn('static decode', proc.stdout)  # The demo's engine (sampler.continuous=False).


if __name__ == '__main__':
  absltest.main()
