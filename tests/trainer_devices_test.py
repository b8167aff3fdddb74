"""Separate actor and learner devices (tunix-style roles) on 8 simulated CPU devices: actors on 2, learner on 6."""

import tempfile

from absl.testing import absltest
import jax
import numpy as np
from flax import nnx

from configs import arith
from sao_jax import metrics
from sao_jax import models
from sao_jax import parallel
from sao_jax import trainer
from sao_jax.errors import ConfigError
from sao_jax.generate.weights import WeightPublisher
from sao_jax.models import decode
from sao_jax import config_lib
from tests import trainer_helpers


class DevicesTest(absltest.TestCase):

  def test_split_devices(self):
    config = arith.get_config()
    self.assertEqual(jax.device_count(), 8)
    learner, actors = parallel.split_devices(config.mesh)
    self.assertLen(learner, 8)
    self.assertIsNone(actors)  # 0: the actors share the learner's mesh.
    config.mesh.actor_devices = 2
    learner, actors = parallel.split_devices(config.mesh)
    self.assertEqual([d.id for d in actors], [0, 1])
    self.assertEqual([d.id for d in learner], [2, 3, 4, 5, 6, 7])
    config.mesh.actor_devices = 8
    with self.assertRaisesRegex(ConfigError, 'config.mesh.actor_devices=8'):
      parallel.split_devices(config.mesh)

  def test_publisher_reshards_onto_the_actor_mesh(self):
    config = arith.get_config()
    config.mesh.actor_devices = 2
    learner_devices, actor_devices = parallel.split_devices(config.mesh)
    mesh = parallel.make_mesh(config.mesh, learner_devices)
    model, _ = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=0)
    actor_mesh = parallel.make_actor_mesh(actor_devices)
    publisher = WeightPublisher(actor_mesh, config.mesh.rules)
    publisher.publish(model, version=3)
    policy, version = publisher.latest()
    self.assertEqual(version, 3)
    host = jax.device_put(jax.tree.map(np.asarray, nnx.state(model)), jax.devices()[0])
    want = jax.tree.leaves(jax.jit(decode.decode_weights)(nnx.merge(nnx.graphdef(model), host)))
    got = jax.tree.leaves(policy.weights)
    self.assertLen(got, len(want))
    for w, g in zip(want, got):
      self.assertEqual({d.id for d in g.sharding.device_set}, {0, 1})
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

  def test_actors_on_two_devices_learner_on_six_trains(self):
    workdir = tempfile.mkdtemp()
    config = arith.get_config()
    config_lib.override(config, {**trainer_helpers.TINY, 'workdir': workdir, 'mesh.actor_devices': 2,
                                   'trainer.batch_size': 6, 'trainer.mode': 'async'})
    with self.assertLogs('absl', level='INFO') as logs:
      summary = trainer.run(config)
    self.assertEqual(summary['steps'], 2)
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2])
    text = '\n'.join(logs.output)
    self.assertIn("Learner mesh {'data': 1, 'fsdp': 6, 'tensor': 1} on 6 device(s)", text)
    self.assertIn("actors on their own mesh {'data': 1, 'fsdp': 1, 'tensor': 2} (devices [0, 1])", text)


if __name__ == '__main__':
  absltest.main()
