"""bfloat16 parameters (`config.model.param_dtype`): built by `models.build` (policy and critic head), the same
function as float32 parameters holding the same values, exported to HF as float32 and read back, and loaded from a
checkpoint in their dtype."""

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from configs import base
from sao_jax import checkpoint
from sao_jax import models
from sao_jax.models import hf_io
from sao_jax.models import value

BF16 = jnp.dtype(jnp.bfloat16)


def _param_dtypes(module) -> set:
  return {x.dtype for x in jax.tree.leaves(nnx.state(module, nnx.Param))}


def _config(param_dtype: str):
  c = base.get_config()
  c.model.name = 'tiny'
  c.model.param_dtype = param_dtype
  return c


class ParamDtypeTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model, cls.cfg = models.build(_config('bfloat16').model, seed=3)
    cls.tokens = jax.random.randint(jax.random.key(0), (2, 10), 3, cls.cfg.vocab_size, dtype=jnp.int32)

  def test_build_stores_every_parameter_in_param_dtype(self):
    self.assertEqual(self.cfg.param_dtype, 'bfloat16')
    self.assertEqual(_param_dtypes(self.model), {BF16})
    critic = value.ValueModel.from_policy(self.model)
    self.assertEqual(_param_dtypes(critic), {BF16})  # The zero head too.
    # Compute stays float32 (config.model.dtype): the same function as float32 parameters with the same values.
    wide, cfg32 = models.build(_config('float32').model, seed=3)
    self.assertEqual(_param_dtypes(wide), {jnp.dtype(jnp.float32)})
    nnx.update(wide, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(self.model, nnx.Param)))
    forward = nnx.jit(lambda m, t: m(t))
    got = forward(self.model, self.tokens)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, forward(wide, self.tokens), rtol=1e-6, atol=1e-6)
    self.assertEqual(cfg32.replace(param_dtype='bfloat16'), self.cfg)

  def test_hf_export_is_float32_and_loads_back_in_either_dtype(self):
    out = tempfile.mkdtemp(prefix='hf_bf16_params_')
    hf_io.save_hf(self.model, self.cfg, out)
    with open(os.path.join(out, 'config.json'), encoding='utf-8') as f:
      self.assertEqual(json.load(f)['torch_dtype'], 'float32')
    exported = hf_io.SafetensorsReader([os.path.join(out, 'model.safetensors')])
    name = 'model.layers.1.mlp.down_proj.weight'
    np.testing.assert_array_equal(exported.get(name),
                                  np.asarray(self.model.layers.mlp.down_proj.get_value()[1], np.float32).T)
    for param_dtype in ('bfloat16', 'float32'):
      loaded, cfg = hf_io.load_hf(out, param_dtype=param_dtype)
      self.assertEqual(cfg.param_dtype, param_dtype)
      self.assertEqual(_param_dtypes(loaded), {jnp.dtype(param_dtype)})
      for a, b in zip(jax.tree.leaves(nnx.state(loaded, nnx.Param)), jax.tree.leaves(nnx.state(self.model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))  # bf16 widens exactly.
    # models.build reads hf_dir with config.model.param_dtype too.
    c = _config('bfloat16')
    c.model.name, c.model.hf_dir = 'hf', out
    built, _ = models.build(c.model)
    self.assertEqual(_param_dtypes(built), {BF16})

  def test_checkpoint_loads_the_policy_in_its_dtype(self):
    directory = tempfile.mkdtemp(prefix='ckpt_bf16_params_')
    with checkpoint.Checkpointer(directory, async_save=False) as ckpt:
      ckpt.save(checkpoint.CheckpointState(step=1, policy=nnx.state(self.model),
                                           metadata=checkpoint.policy_metadata(self.cfg)))
    loaded, cfg = checkpoint.load_policy(directory)
    self.assertEqual(cfg, self.cfg)
    self.assertEqual(_param_dtypes(loaded), {BF16})
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(self.model))):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


if __name__ == '__main__':
  absltest.main()
