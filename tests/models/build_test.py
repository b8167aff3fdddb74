"""`models.build`: the policy from `config.model` (named config, sharded on a mesh, or HF weights)."""

import tempfile

from absl.testing import absltest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import base as base_config
from sao_jax import models
from sao_jax import parallel
from sao_jax.errors import ConfigError
from sao_jax.models import hf_io


class BuildTest(absltest.TestCase):

  def test_named_config_seeded(self):
    config = base_config.get_config()
    model, cfg = models.build(config.model, seed=3)
    self.assertIsInstance(model, models.Decoder)
    self.assertEqual(cfg, models.get_model_config('tiny', dtype='float32', remat=False))
    same, _ = models.build(config, seed=3)  # The full config works too.
    other, _ = models.build(config.model, seed=4)
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_array_equal(model(tokens), same(tokens))
    self.assertFalse(np.allclose(model(tokens), other(tokens)))

  def test_on_a_mesh_the_parameters_are_created_sharded(self):
    config = base_config.get_config()
    mesh = parallel.make_mesh(config.mesh)
    model, _ = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=3)
    want = parallel.tree_shardings(nnx.state(model), mesh, config.mesh.rules)
    got = jax.tree.map(lambda x: x.sharding, nnx.state(model))
    self.assertEqual(jax.tree.leaves(got), jax.tree.leaves(want))
    ref, _ = models.build(config.model, seed=3)
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_allclose(model(tokens), ref(tokens), atol=1e-5)  # Same init, under jit.

  def test_hf_dir_and_errors(self):
    config = base_config.get_config()
    saved, cfg = models.build(config.model, seed=1)
    tmp = tempfile.mkdtemp()
    hf_io.save_hf(saved, cfg, tmp)
    config.model.name = 'hf'
    config.model.hf_dir = tmp
    loaded, _ = models.build(config.model)
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_allclose(loaded(tokens), saved(tokens), atol=1e-5)
    config.model.hf_dir = ''
    with self.assertRaisesRegex(ConfigError, "name='hf' needs config.model.hf_dir"):
      models.build(config.model)
    config.model.name = 'nope'
    with self.assertRaisesRegex(ConfigError, "config.model.name='nope'"):
      models.build(config.model)


if __name__ == '__main__':
  absltest.main()
