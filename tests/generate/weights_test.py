"""The weight publish (`sao_jax.generate.weights`) on 8 simulated CPU devices: a copy of the policy in decode layout
and compute dtype per process, sharded over that process's devices (never the whole policy on a learner device),
equal to `decode.decode_weights` of the learner's and laid out exactly as the actors' mesh expects; and a real
2-process run (tests/generate/publish_worker.py)."""

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
from sao_jax.generate.weights import DecodePolicy, WeightPublisher, WeightsSource
from sao_jax.learner import state as state_lib
from sao_jax.models import decode
from sao_jax.models import lora
from sao_jax.models.build import model_config_of
from sao_jax.models.llama import Decoder
from tests import multiprocess

RULES = base.get_config().mesh.rules
TENSOR = ('vocab', 'heads', 'kv_heads', 'mlp')  # The logical names RULES put on `tensor`.


def _config(**overrides):
  config = base.get_config()
  config.model.name = 'tiny'  # vocab 512, heads 4, kv heads 2, head dim 16, mlp 128, embed 64, 2 layers, tied.
  config.model.update(overrides)
  return config


def expected_bytes(local_devices: int, **overrides) -> int:
  """Per device, the decode-layout copy sharded over `local_devices` by the rules, from the model's dimensions
  alone: per layer [(N + 2K) H, D] q|k|v, [D, N H] o, [2F, D] gate|up and [D, F] down in the compute dtype (each
  split over the devices where they divide its heads' or MLP's dim), norms [D, 1] x 2 (and [H] x 2 with qk norm) in
  the parameter dtype whole; [V, D] embedding and lm head in the compute dtype split by vocab; [D, 1] final norm."""
  cfg = model_config_of(_config(**overrides).model)
  d, n, k, h, f, v = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  c, p = np.dtype(cfg.dtype).itemsize, np.dtype(cfg.param_dtype).itemsize
  split = lambda elements, dim: elements * c // (local_devices if dim % local_devices == 0 else 1)
  layer = (split((n + 2 * k) * h * d, (n + 2 * k) * h) + split(d * n * h, n * h) + split(2 * f * d, 2 * f) +
           split(d * f, f) + 2 * d * p + (2 * h * p if cfg.qk_norm else 0))
  return cfg.num_layers * layer + 2 * split(v * d, v) + d * p


def _abstract_model(mesh, **overrides) -> nnx.Module:
  """The policy as `jax.ShapeDtypeStruct`s laid out on `mesh` by RULES."""
  cfg = model_config_of(_config(**overrides).model)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, state_lib.abstract(state, parallel.tree_shardings(state, mesh, RULES)))


def _build(devices, fsdp):
  mesh = parallel.make_mesh(dict(data=1, fsdp=fsdp, tensor=1), devices)
  return models.build(_config().model, mesh=mesh, rules=RULES, seed=0)[0], mesh


def _reference(model) -> list[np.ndarray]:
  """`decode.decode_weights` of the model's values, on one device."""
  graphdef, state = nnx.split(model)
  host = jax.device_put(jax.tree.map(np.asarray, state), jax.devices()[0])
  return [np.asarray(x) for x in jax.tree.leaves(jax.jit(decode.decode_weights)(nnx.merge(graphdef, host)))]


class PublishLayoutTest(absltest.TestCase):

  def test_the_copy_holds_the_policy_over_a_process_devices_not_the_whole_policy(self):
    mesh = parallel.make_mesh(dict(data=1, fsdp=-1, tensor=1))
    model = _abstract_model(mesh)
    whole = expected_bytes(1)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    for copies in (1, 2, 4):  # As if 1, 2 or 4 processes shared the 8 devices.
      local = 8 // copies
      rows = [devices[i * local:(i + 1) * local] for i in range(copies)]
      out, temp = weights.publish_bytes(model, mesh, RULES, rows=rows)
      pointers = 8 * (2 * 9 + 3)  # XLA's output tuples (CPU): one pointer per array, L layer calls and the rest.
      self.assertBetween(out - expected_bytes(local), 0, pointers, f'{copies} copies')
      self.assertLess(out, whole)  # A replicated gather held all of it on every device.
      self.assertLessEqual(temp, whole // 2)  # One layer's (or the embeddings') at a time.

  def test_a_tpu_pod_compiles_it(self):
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top  # libtpu: a test requirement.
    chips = topologies.get_topology_desc(topology_name='v5e:4x4', platform='tpu').devices
    self.assertEqual(len({d.process_index for d in chips}), 4)  # 4 hosts of 4 chips, 16 GiB each.
    cache = jax.config.jax_enable_compilation_cache  # Not the suite's CPU cache: no client to load TPU programs.
    jax.config.update('jax_enable_compilation_cache', False)
    self.addCleanup(jax.config.update, 'jax_enable_compilation_cache', cache)
    mesh = jax.make_mesh((1, 16, 1), parallel.MESH_AXES, devices=chips)
    big = dict(name='qwen3-8b', param_dtype='float32', dtype='bfloat16')  # 30.5 GiB of float32 parameters.
    programs = weights.lower_publish(_abstract_model(mesh, **big), mesh, RULES).compile()
    layer, outer = programs.layer.memory_analysis(), programs.outer.memory_analysis()
    out = programs.num_layers * layer.output_size_in_bytes + outer.output_size_in_bytes
    self.assertBetween(out / expected_bytes(4, **big), 1, 1.001)  # bfloat16, a quarter of it a chip.
    # Temporaries of one program at a time: a layer's (none at 8B) or the embeddings' (0.72 GiB at 8B), never the
    # whole copy's (a publish converting every layer at once needs at least its output).
    self.assertLess(max(layer.temp_size_in_bytes, outer.temp_size_in_bytes), out / 4)

  def test_shardings_keep_the_learner_device_order(self):
    devices = jax.devices()
    order = [devices[i] for i in (5, 0, 3, 6, 1, 4, 7, 2)]  # A topology-aware mesh's order is not the ids'.
    mesh = jax.sharding.Mesh(np.asarray(order).reshape(1, 8, 1), parallel.MESH_AXES)
    rows = [sorted(devices, key=lambda d: d.id)[:4], sorted(devices, key=lambda d: d.id)[4:]]
    state = nnx.state(_abstract_model(mesh))
    out = jax.tree.leaves(weights.publish_shardings(state, mesh, RULES, rows=rows))
    x = jax.ShapeDtypeStruct((512, 64), jnp.float32)
    for s in out:
      self.assertEqual(list(s._device_assignment), order)  # pylint: disable=protected-access
    vocab_split = next(s for s in out if s.spec and s.spec[0] == 'tensor')
    for row in rows:  # Row i of each copy holds block i.
      for i, d in enumerate(row):
        self.assertEqual(vocab_split.devices_indices_map(x.shape)[d][0], slice(128 * i, 128 * (i + 1)))
    with self.assertRaisesRegex(ValueError, 'one size'):
      weights.publish_shardings(state, mesh, RULES, rows=[devices[:3], devices[3:]])

  def test_the_copies_equal_the_decode_layout_and_carry_the_actor_shardings(self):
    d = sorted(jax.devices(), key=lambda x: x.id)
    cases = {  # name: (learner devices, fsdp, copies' rows, actor devices)
        'actors share the devices (actor_devices=0)': (d, 8, [d[:4], d[4:]], d[:4]),
        'same blocks (2 learner, 2 actor devices)': (d[2:4] + d[6:], 4, [d[2:4], d[6:]], d[:2]),
        'concatenated (2 learner devices, 1 actor)': (d[2:4] + d[6:], 4, [d[2:4], d[6:]], d[:1]),
        'cut (3 learner devices, 2 actors)': (d[2:5] + d[5:], 6, [d[2:5], d[5:]], d[:2]),
    }
    for name, (learner_devices, fsdp, rows, actor_devices) in cases.items():
      with self.subTest(name):
        model, mesh = _build(learner_devices, fsdp)
        want = _reference(model)
        copy = weights.lower_publish(model, mesh, RULES, rows=rows).compile()(model)
        actor_mesh = parallel.make_actor_mesh(actor_devices)
        targets = weights.decode_shardings(copy, actor_mesh, RULES)
        for leaf, w, target in zip(jax.tree.leaves(copy), want, jax.tree.leaves(targets)):
          got = weights.local_reshard(leaf, target)
          self.assertEqual(got.sharding, target)
          np.testing.assert_array_equal(np.asarray(got), w)
          if actor_devices == rows[0]:  # The copy's own buffers: no further copy.
            here = {s.device: s.data.unsafe_buffer_pointer() for s in leaf.addressable_shards}
            for s in got.addressable_shards:
              self.assertEqual(s.data.unsafe_buffer_pointer(), here[s.device])

  def test_decode_shardings_split_what_the_rules_split(self):
    mesh = parallel.make_actor_mesh(jax.devices()[:4])
    cfg = model_config_of(_config().model)
    abstract = jax.eval_shape(lambda: decode.decode_weights(Decoder(cfg, rngs=nnx.Rngs(0))))
    got = weights.decode_shardings(abstract, mesh, RULES)
    layer = got.layers[1]
    rows, cols = PartitionSpec('tensor', None), PartitionSpec(None, 'tensor')
    self.assertEqual(layer.wqkv.spec, rows)  # [(N + 2K) H, D]: its rows over the devices.
    self.assertEqual(layer.wo.spec, cols)  # [D, N H].
    self.assertEqual(layer.w_gate_up.spec, rows)
    self.assertEqual(layer.w_down.spec, cols)
    self.assertEqual(layer.attn_norm.spec, PartitionSpec(None, None))
    self.assertEqual((got.embed.spec, got.unembed.spec), (rows, rows))

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

  def test_publishes_the_decode_layout_onto_the_actor_mesh(self):
    d = jax.devices()
    for learner_devices, fsdp in ((d[4:], 4), (d[7:], 1)):
      with self.subTest(learner_devices=len(learner_devices)):
        model, _ = _build(learner_devices, fsdp)
        graphdef, state = nnx.split(model)
        actor_mesh = parallel.make_actor_mesh(d[:2])
        publisher = WeightPublisher(actor_mesh, RULES)
        doubled = jax.jit(lambda s: jax.tree.map(lambda x: 2 * x, s))(state)
        for version, s in ((1, state), (2, doubled)):
          publisher.publish(nnx.merge(graphdef, s), version=version)
          policy, got_version = publisher.latest()
          self.assertIsInstance(policy, DecodePolicy)
          self.assertEqual((got_version, policy.cfg), (version, model.cfg))
          targets = weights.decode_shardings(policy.weights, actor_mesh, RULES)
          for got, w, target in zip(jax.tree.leaves(policy.weights), _reference(nnx.merge(graphdef, s)),
                                    jax.tree.leaves(targets)):
            self.assertEqual(got.sharding, target)
            np.testing.assert_array_equal(np.asarray(got), w)
        self.assertEqual(publisher.computed_version, 2)

  def test_the_copy_outlives_the_learner_buffers_and_engines_share_it(self):
    """The learner's next update donates its state: the copy is never one of its buffers (a float32 model's tied
    embedding would be, as a jit's output forwarded from its input); every engine's source takes the one copy."""
    d = jax.devices()
    for name, learner_devices, actor_mesh in (('one process, shared', d, None),
                                              ('actor mesh', d[4:], parallel.make_actor_mesh(d[:2]))):
      with self.subTest(name):
        model, _ = _build(learner_devices, len(learner_devices))
        want = _reference(model)
        publisher = WeightPublisher(actor_mesh, RULES)
        publisher.publish(model, version=3)
        for x in jax.tree.leaves(nnx.state(model)):
          x.delete()
        policy, _ = publisher.latest()
        for got, w in zip(jax.tree.leaves(policy.weights), want):
          np.testing.assert_array_equal(np.asarray(got), w)
        sources = [WeightsSource(policy, version=3) for _ in range(2)]
        for source in sources:
          self.assertIs(source.weights, policy.weights)
        sources[0].update_weights(policy, version=4)
        self.assertEqual(sources[0].version, 4)
        with self.assertRaisesRegex(ValueError, 'model config'):
          sources[0].update_weights(DecodePolicy(policy.cfg.replace(num_layers=3), policy.weights))


class LoraPublishTest(absltest.TestCase):
  """A LoRA policy: the base copied once, then each publish moves only the adapters and merges them on the actors'
  side into exactly the decode layout of the merged model (`Decoder.merged`)."""

  def test_adapters_only_after_the_first_publish(self):
    d = jax.devices()
    for name, learner_devices, actor_mesh in (('one process, shared', d, None),
                                              ('actor mesh', d[4:], parallel.make_actor_mesh(d[:2]))):
      with self.subTest(name):
        mesh = parallel.make_mesh(dict(data=1, fsdp=len(learner_devices), tensor=1), learner_devices)
        config = _config()
        config.model.lora.rank = 4
        model, cfg = models.build(config.model, mesh=mesh, rules=RULES, seed=0)
        self.assertEqual(cfg.lora_rank, 4)
        graphdef, adapters, rest = nnx.split(model, lora.ADAPTERS, ...)
        publisher = WeightPublisher(actor_mesh, RULES)
        moved = []
        for version in (0, 1):
          if version:  # As after training: every B non-zero.
            adapters = jax.tree.map(lambda x: x + 0.1 * jnp.ones_like(x), adapters)
          policy_model = nnx.merge(graphdef, adapters, rest)
          publisher.publish(policy_model, version=version)
          policy, _ = publisher.latest()
          for got, w in zip(jax.tree.leaves(policy.weights), _reference(policy_model.merged())):
            np.testing.assert_allclose(np.asarray(got), w, atol=1e-6)
          moved.append(policy.weights)
          if actor_mesh is not None:
            for got, target in zip(jax.tree.leaves(policy.weights),
                                   jax.tree.leaves(weights.decode_shardings(policy.weights, actor_mesh, RULES))):
              self.assertEqual(got.sharding, target)
        self.assertIs(moved[1].embed, moved[0].embed)  # The base's arrays, not a second copy.
        self.assertIsNot(moved[1].layers[0].wqkv, moved[0].layers[0].wqkv)


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
      self.assertEqual(got['lora'], 2)  # Both LoRA publishes checked (the worker asserts them).
      # actor_devices n: the actors' devices and the learner's of each process (n = 0: all 4 shared).
      for n, actors, learners in (('0', 4, 4), ('1', 1, 3), ('2', 2, 2)):
        self.assertEqual(got[n]['actor_processes'], [process] * actors)
        self.assertEqual(set(got[n]['bytes_per_actor_device'].values()), {expected_bytes(actors)}, (process, n))
        self.assertEqual(got[n]['policy_bytes'], expected_bytes(1))
        pointers = 8 * (2 * 9 + 3)  # XLA's output tuples (CPU): one pointer per array.
        self.assertBetween(got[n]['learner_copy_bytes'] - expected_bytes(learners), 0, pointers, (process, n))


if __name__ == '__main__':
  absltest.main()
