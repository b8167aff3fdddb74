"""One process of the 2-process publish test (run by weights_test.MultiProcessTest, not by pytest).

Usage: python -m tests.generate.publish_worker OUT_DIR, started by `tests.multiprocess.start` (the SAO_* env vars,
4 CPU devices per process). For `mesh.actor_devices` 0, 1 and 2 it builds the tiny policy on the learner mesh
(`parallel.split_devices`), publishes it twice (the second time doubled), and checks on each process that the
actors' copy equals `decode.decode_weights` of the learner's values and carries exactly the actor mesh's decode
shardings; then a LoRA policy's two publishes (the base copied, then its adapters gathered and merged on each
process's actor device) against the merged model's decode layout; it writes what it saw (and the per-device bytes of the publish's copy on the learner devices) to
OUT_DIR/publish<process>.json.
"""

import json
import os
import sys


def main(out: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from configs import base  # pylint: disable=g-import-not-at-top
  from sao_jax import models  # pylint: disable=g-import-not-at-top
  from sao_jax import parallel  # pylint: disable=g-import-not-at-top
  from sao_jax.generate import weights  # pylint: disable=g-import-not-at-top
  from sao_jax.models import decode  # pylint: disable=g-import-not-at-top
  from sao_jax.models import lora  # pylint: disable=g-import-not-at-top

  assert parallel.initialize(timeout_s=120)
  assert jax.process_count() == 2 and jax.local_device_count() == 4, (jax.process_count(), jax.local_device_count())
  config = base.get_config()
  config.model.name = 'tiny'
  rules = config.mesh.rules
  double = jax.jit(lambda s: jax.tree.map(lambda x: 2 * x, s))
  seen = {}
  for n in (0, 1, 2):
    mesh_config = dict(data=1, fsdp=-1, tensor=1, actor_devices=n)
    learner_devices, actor_devices = parallel.split_devices(mesh_config)
    mesh = parallel.make_mesh(mesh_config, learner_devices)
    actor_mesh = parallel.make_actor_mesh(actor_devices)
    model, _ = models.build(config.model, mesh=mesh, rules=rules, seed=0)
    publisher = weights.WeightPublisher(actor_mesh, rules)
    graphdef, state = nnx.split(model)
    for version, learner_state in ((1, state), (2, double(state))):
      publisher.publish(nnx.merge(graphdef, learner_state), version=version)
      policy, got_version = publisher.latest()
      assert got_version == version, (got_version, version)
      host = jax.device_put(parallel.to_host(learner_state), jax.local_devices()[0])
      want = jax.tree.leaves(jax.jit(decode.decode_weights)(nnx.merge(graphdef, host)))
      got = jax.tree.leaves(policy.weights)
      shardings = jax.tree.leaves(weights.decode_shardings(policy.weights, actor_mesh, rules))
      assert len(got) == len(want) == len(shardings)
      for g, w, s in zip(got, want, shardings):
        assert g.sharding == s, (n, g.sharding, s)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    seen[str(n)] = {
        'actor_processes': [d.process_index for d in actor_devices],
        'bytes_per_actor_device': {str(d.id): sum(s.data.nbytes for x in got for s in x.addressable_shards
                                                  if s.device == d) for d in actor_devices},
        'policy_bytes': sum(x.nbytes for x in got),
        # Per learner device, the publish's copy (compiled by this process, grouped by the devices' processes).
        'learner_copy_bytes': weights.publish_bytes(model, mesh, rules)[0],
    }
  # LoRA over 2 processes: the adapters (global arrays over both processes' learner devices) gathered on each host
  # and merged on its actors' devices (`_lora_to_actors`), equal to the merged model's decode layout.
  config.model.lora.rank = 4
  mesh_config = dict(data=1, fsdp=-1, tensor=1, actor_devices=1)
  learner_devices, actor_devices = parallel.split_devices(mesh_config)
  mesh = parallel.make_mesh(mesh_config, learner_devices)
  actor_mesh = parallel.make_actor_mesh(actor_devices)
  model, _ = models.build(config.model, mesh=mesh, rules=rules, seed=0)
  publisher = weights.WeightPublisher(actor_mesh, rules)
  graphdef, adapters, rest = nnx.split(model, lora.ADAPTERS, ...)
  bump = jax.jit(lambda s: jax.tree.map(lambda x: x + 0.1, s))  # B non-zero, as after training.
  for version, learner_adapters in ((1, adapters), (2, bump(adapters))):
    policy_model = nnx.merge(graphdef, learner_adapters, rest)
    publisher.publish(policy_model, version=version)
    policy, _ = publisher.latest()
    graphdef_all, state = nnx.split(policy_model)
    host = jax.device_put(parallel.to_host(state), jax.local_devices()[0])
    want = jax.tree.leaves(jax.jit(decode.decode_weights)(nnx.merge(graphdef_all, host).merged()))
    got = jax.tree.leaves(policy.weights)
    for g, w, sh in zip(got, want, jax.tree.leaves(weights.decode_shardings(policy.weights, actor_mesh, rules))):
      assert g.sharding == sh, ('lora', g.sharding, sh)
      np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)
  seen['lora'] = version
  with open(os.path.join(out, f'publish{jax.process_index()}.json'), 'w') as f:
    json.dump(seen, f)
  jax.distributed.shutdown()


if __name__ == '__main__':
  main(sys.argv[1])
