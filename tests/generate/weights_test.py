"""The weight publish (`sao_jax.generate.weights`) on 8 simulated CPU devices: a copy of the policy per process
sharded over that process's devices (never the whole policy on a learner device), equal to the learner's and laid
out exactly as the actors' mesh expects; and a real 2-process run (tests/generate/publish_worker.py)."""

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from configs import base
from sao_jax import models
from sao_jax import parallel
from sao_jax.generate import weights
from sao_jax.generate.weights import WeightPublisher
from tests import multiprocess

RULES = base.get_config().mesh.rules
TENSOR_NAMES = {'vocab', 'heads', 'kv_heads', 'mlp'}  # The logical names RULES put on `tensor`.


def _config():
  config = base.get_config()
  config.model.name = 'tiny'  # vocab 512, heads 4, kv heads 2, mlp 128, embed 64.
  return config


def _abstract(**overrides):
  model = _config().model
  model.update(overrides)
  return jax.eval_shape(lambda: nnx.split(models.build(model)[0])[1])


def _expected_bytes(local_devices: int, abstract=None) -> int:
  """Per device, a copy sharded over `local_devices` by the rules: from the shapes and logical names alone (a leaf
  with a dim named for `tensor` that `local_devices` divides holds its share, any other leaf all of it)."""
  total = 0
  abstract = _abstract() if abstract is None else abstract
  for x in jax.tree.leaves(abstract, is_leaf=lambda v: isinstance(v, nnx.Variable)):
    value, names = x.get_value(), x.get_metadata().get('out_sharding') or ()
    nbytes = value.size * value.dtype.itemsize
    split = any(n in TENSOR_NAMES and d % local_devices == 0 for n, d in zip(names, value.shape))
    total += nbytes // local_devices if split else nbytes
  return total


def _policy_bytes() -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(_abstract()))


def _build(devices, fsdp):
  mesh = parallel.make_mesh(dict(data=1, fsdp=fsdp, tensor=1), devices)
  return nnx.split(models.build(_config().model, mesh=mesh, rules=RULES, seed=0)[0]), mesh


class PublishLayoutTest(absltest.TestCase):

  def test_the_copy_holds_the_policy_over_a_process_devices_not_the_whole_policy(self):
    abstract = _abstract()
    mesh = parallel.make_mesh(dict(data=1, fsdp=-1, tensor=1))
    learner = parallel.tree_shardings(abstract, mesh, RULES)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    for copies in (1, 2, 4):  # As if 1, 2 or 4 processes shared the 8 devices.
      local = 8 // copies
      rows = [devices[i * local:(i + 1) * local] for i in range(copies)]
      out, temp = weights.publish_bytes(abstract, learner, mesh, RULES, rows=rows)
      pointers = 8 * len(jax.tree.leaves(abstract))  # XLA's output tuple (CPU): one pointer per array.
      self.assertBetween(out - _expected_bytes(local), 0, pointers, f'{copies} copies')
      self.assertLess(out, _policy_bytes())  # The replicated gather held all of it on every device.
      self.assertLessEqual(temp, 2 * out)

  def test_a_tpu_pod_compiles_it(self):
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top  # libtpu: a test requirement.
    chips = topologies.get_topology_desc(topology_name='v5e:4x4', platform='tpu').devices
    self.assertEqual(len({d.process_index for d in chips}), 4)  # 4 hosts of 4 chips, 16 GiB each.
    cache = jax.config.jax_enable_compilation_cache  # Not the suite's CPU cache: no client to load TPU programs.
    jax.config.update('jax_enable_compilation_cache', False)
    self.addCleanup(jax.config.update, 'jax_enable_compilation_cache', cache)
    abstract = _abstract(name='qwen3-8b', param_dtype='bfloat16')  # 15.3 GiB: no chip holds it whole.
    mesh = jax.make_mesh((1, 16, 1), parallel.MESH_AXES, devices=chips)
    out, temp = weights.publish_bytes(abstract, parallel.tree_shardings(abstract, mesh, RULES), mesh, RULES)
    self.assertBetween(out / _expected_bytes(4, abstract), 1, 1.001)
    self.assertLess(temp, out / 2)

  def test_shardings_keep_the_learner_device_order(self):
    devices = jax.devices()
    order = [devices[i] for i in (5, 0, 3, 6, 1, 4, 7, 2)]  # A topology-aware mesh's order is not the ids'.
    mesh = jax.sharding.Mesh(np.asarray(order).reshape(1, 8, 1), parallel.MESH_AXES)
    rows = [sorted(devices, key=lambda d: d.id)[:4], sorted(devices, key=lambda d: d.id)[4:]]
    out = jax.tree.leaves(weights.publish_shardings(_abstract(), mesh, RULES, rows=rows))
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    for s in out:
      self.assertEqual(list(s._device_assignment), order)  # pylint: disable=protected-access
    vocab_split = next(s for s in out if s.spec and s.spec[0] == 'tensor')
    for row in rows:  # Row i of each copy holds block i.
      for i, d in enumerate(row):
        self.assertEqual(vocab_split.devices_indices_map(x.shape)[d][0], slice(128 * i, 128 * (i + 1)))
    with self.assertRaisesRegex(ValueError, 'one size'):
      weights.publish_shardings(_abstract(), mesh, RULES, rows=[devices[:3], devices[3:]])

  def test_the_copies_equal_the_learner_and_carry_the_actor_shardings(self):
    d = sorted(jax.devices(), key=lambda x: x.id)
    cases = {  # name: (learner devices, fsdp, copies' rows, actor devices)
        'actors share the devices (actor_devices=0)': (d, 8, [d[:4], d[4:]], d[:4]),
        'same blocks (2 learner, 2 actor devices)': (d[2:4] + d[6:], 4, [d[2:4], d[6:]], d[:2]),
        'concatenated (2 learner devices, 1 actor)': (d[2:4] + d[6:], 4, [d[2:4], d[6:]], d[:1]),
        'cut (3 learner devices, 2 actors)': (d[2:5] + d[5:], 6, [d[2:5], d[5:]], d[:2]),
    }
    for name, (learner_devices, fsdp, rows, actor_devices) in cases.items():
      with self.subTest(name):
        (_, state), mesh = _build(learner_devices, fsdp)
        arrays, treedef = jax.tree.flatten(state)
        learner = jax.tree.map(lambda x: x.sharding, state)
        for group, lowered in weights.lower_publish(state, learner, mesh, RULES, rows=rows):
          for i, x in zip(group, lowered.compile()([arrays[i] for i in group])):
            arrays[i] = x
        actor_mesh = parallel.make_actor_mesh(actor_devices)
        targets = jax.tree.leaves(parallel.tree_shardings(state, actor_mesh, RULES))
        for x, copy, target in zip(jax.tree.leaves(state), arrays, targets):
          got = weights.local_reshard(copy, target)
          self.assertEqual(got.sharding, target)
          np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
          if actor_devices == rows[0]:  # The copy's own buffers: no further copy.
            here = {s.device: s.data.unsafe_buffer_pointer() for s in copy.addressable_shards}
            for s in got.addressable_shards:
              self.assertEqual(s.data.unsafe_buffer_pointer(), here[s.device])

  def test_local_reshard_between_any_layouts(self):
    mesh = parallel.make_mesh(dict(data=1, fsdp=4, tensor=2))
    value = np.arange(8 * 12 * 6, dtype=np.float32).reshape(8, 12, 6)
    x = jax.device_put(value, NamedSharding(mesh, PartitionSpec('fsdp', None, 'tensor')))
    for devices, spec in (([0, 1, 2], PartitionSpec(None, 'tensor')), ([7], PartitionSpec()),
                          ([4, 5], PartitionSpec('tensor')), ([0, 1], PartitionSpec(None, None, 'tensor'))):
      target = NamedSharding(parallel.make_actor_mesh([jax.devices()[i] for i in devices]), spec)
      got = weights.local_reshard(x, target)
      self.assertEqual(got.sharding, target)
      np.testing.assert_array_equal(np.asarray(got), value)


class PublisherTest(absltest.TestCase):

  def test_publishes_onto_the_actor_mesh(self):
    d = jax.devices()
    for learner_devices, fsdp in ((d[4:], 4), (d[7:], 1)):  # Resharded first; copied only.
      with self.subTest(learner_devices=len(learner_devices)):
        (graphdef, state), _ = _build(learner_devices, fsdp)
        actor_mesh = parallel.make_actor_mesh(d[:2])
        publisher = WeightPublisher(actor_mesh, RULES)
        doubled = jax.jit(lambda s: jax.tree.map(lambda x: 2 * x, s))(state)
        for version, s in ((1, state), (2, doubled)):
          publisher.publish(nnx.merge(graphdef, s), version=version)
          copy, got_version = publisher.latest()
          self.assertEqual(got_version, version)
          targets = jax.tree.leaves(parallel.tree_shardings(s, actor_mesh, RULES))
          for x, got, target in zip(jax.tree.leaves(s), jax.tree.leaves(nnx.state(copy)), targets):
            self.assertEqual(got.sharding, target)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(x))
        self.assertEqual(publisher.computed_version, 2)


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_publish_their_own_copies(self):
    with tempfile.TemporaryDirectory() as out:
      procs = multiprocess.start([sys.executable, '-m', 'tests.generate.publish_worker', out], out,
                                 devices_per_process=4, name='publish')
      multiprocess.wait(self, procs, timeout_s=420)
      seen = []
      for i in range(2):
        with open(os.path.join(out, f'publish{i}.json')) as f:
          seen.append(json.load(f))
    for process, got in enumerate(seen):
      # actor_devices n: the actors' devices and the learner's of each process (n = 0: all 4 shared).
      for n, actors, learners in (('0', 4, 4), ('1', 1, 3), ('2', 2, 2)):
        self.assertEqual(got[n]['actor_processes'], [process] * actors)
        self.assertEqual(set(got[n]['bytes_per_actor_device'].values()), {_expected_bytes(actors)}, (process, n))
        self.assertEqual(got[n]['policy_bytes'], _policy_bytes())
        pointers = 8 * len(jax.tree.leaves(_abstract()))  # XLA's output tuple (CPU): one pointer per array.
        self.assertBetween(got[n]['learner_copy_bytes'] - _expected_bytes(learners), 0, pointers, (process, n))


if __name__ == '__main__':
  absltest.main()
