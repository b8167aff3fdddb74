"""LoRA adapters (`sao_jax.models.lora`): step 0 is the base bit for bit, the adapted projection is
y = x W + (alpha / r) (x A) B (a numpy reference), merged weights equal the adapter forward, HF export merges."""

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from sao_jax.models import hf_io
from sao_jax.models import lora
from sao_jax.models import value as value_lib
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder

BASE = get_model_config('tiny', vocab_size=64, embed_dim=32, mlp_dim=48, num_heads=4, num_kv_heads=2, head_dim=8,
                        num_layers=2, tie_embeddings=False)
LORA = BASE.replace(lora_rank=3, lora_alpha=6.0, lora_targets=lora.TARGETS)


def _tokens(seed=0, shape=(2, 12)):
  return jax.random.randint(jax.random.key(seed), shape, 0, BASE.vocab_size)


def _trained(model, seed=7):
  """`model` with every adapter's B drawn non-zero (as after training)."""
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, lora.ADAPTERS))):
    if path[-1] == 'b':
      var[...] = 0.3 * jax.random.normal(jax.random.key(seed + i), var.shape)
  return model


class LoraTest(absltest.TestCase):

  def test_fresh_adapters_leave_the_base_bit_for_bit(self):
    """B = 0, and the adapters draw their randomness after every base weight: same seed, same base."""
    base, adapted = Decoder(BASE, rngs=nnx.Rngs(0)), Decoder(LORA, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(adapted(_tokens()), base(_tokens()))
    base_flat = dict(nnx.to_flat_state(nnx.state(base)))
    for path, var in nnx.to_flat_state(nnx.state(adapted, nnx.Not(lora.ADAPTERS))):
      np.testing.assert_array_equal(var.get_value(), base_flat[path].get_value())
    adapters = nnx.state(adapted, lora.ADAPTERS)
    self.assertLen(jax.tree.leaves(adapters), 2 * len(lora.TARGETS))
    for path, var in nnx.to_flat_state(adapters):
      if path[-1] == 'b':
        self.assertFalse(np.any(np.asarray(var.get_value())), path)
      else:
        self.assertGreater(float(jnp.std(var.get_value())), 0.0, path)

  def test_projection_against_numpy(self):
    """One layer's q and down projections: x W + (alpha / r) (x A) B in float64 numpy. Catches a missing or
    inverted scale (r / alpha) and A, B applied in the wrong order."""
    model = _trained(Decoder(LORA, rngs=nnx.Rngs(1)))
    layer = jax.tree.map(lambda x: x[0], nnx.state(model.layers))
    block = nnx.merge(nnx.graphdef(model.layers), layer)
    x = np.asarray(jax.random.normal(jax.random.key(2), (2, 5, BASE.embed_dim)), np.float64)
    s = LORA.lora_alpha / LORA.lora_rank
    w, a, b = (np.asarray(v, np.float64) for v in (block.attn.q_proj[...], block.attn.q_proj_lora.a[...],
                                                   block.attn.q_proj_lora.b[...]))
    want = np.einsum('btd,dnh->btnh', x, w) + s * np.einsum('btr,rnh->btnh', x @ a, b)
    got = lora.project(block.attn, 'q_proj', 'btd,dnh->btnh', jnp.asarray(x, jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    h = np.asarray(jax.random.normal(jax.random.key(3), (2, 5, BASE.mlp_dim)), np.float64)
    w, a, b = (np.asarray(v, np.float64) for v in (block.mlp.down_proj[...], block.mlp.down_proj_lora.a[...],
                                                   block.mlp.down_proj_lora.b[...]))
    got = lora.project(block.mlp, 'down_proj', 'btf,fd->btd', jnp.asarray(h, jnp.float32))
    np.testing.assert_allclose(got, h @ w + s * (h @ a) @ b, rtol=1e-5, atol=1e-5)

  def test_merged_model_and_decode_equal_the_adapter_forward(self):
    model = _trained(Decoder(LORA, rngs=nnx.Rngs(4)))
    tokens = _tokens(5)
    want = model(tokens)
    self.assertGreater(float(jnp.max(jnp.abs(want - Decoder(BASE, rngs=nnx.Rngs(4))(tokens)))), 0.1)
    merged = model.merged()
    self.assertEqual(merged.cfg, BASE)
    self.assertEmpty(jax.tree.leaves(nnx.state(merged, lora.ADAPTERS)))
    np.testing.assert_allclose(merged(tokens), want, atol=2e-5)
    cached, _ = model(tokens, cache=model.init_cache(tokens.shape[0], 16))  # The sampler's path merges per layer.
    np.testing.assert_allclose(cached, want, atol=2e-5)

  def test_hf_export_merges_and_loads_back(self):
    model = _trained(Decoder(LORA, rngs=nnx.Rngs(6)))
    with tempfile.TemporaryDirectory() as d:
      hf_io.save_hf(model, None, d)
      loaded, cfg = hf_io.load_hf(d)
      self.assertEqual(cfg.lora_rank, 0)
      np.testing.assert_allclose(loaded(_tokens(8)), model(_tokens(8)), atol=2e-5)
      # Loading with adapters asked for: the same base, fresh adapters (B = 0), so the same logits.
      again, cfg = hf_io.load_hf(d, lora_rank=2, lora_targets=('q_proj', 'down_proj'), lora_seed=3)
      self.assertEqual(cfg.lora_targets, ('q_proj', 'down_proj'))
      self.assertLen(jax.tree.leaves(nnx.state(again, lora.ADAPTERS)), 4)
      np.testing.assert_array_equal(again(_tokens(8)), loaded(_tokens(8)))

  def test_critic_from_a_lora_policy(self):
    """Its own fresh adapters (B = 0) over the policy's base, not the policy's adapters: values = those of a critic
    of the merged-out base."""
    policy = _trained(Decoder(LORA, rngs=nnx.Rngs(9)))
    critic = value_lib.ValueModel.from_policy(policy, rngs=nnx.Rngs(1), lora_rank=2, lora_targets=lora.MLP_TARGETS)
    self.assertEqual(critic.cfg.lora_targets, lora.MLP_TARGETS)
    paths = {tuple(str(k) for k in p) for p, _ in nnx.to_flat_state(nnx.state(critic, lora.ADAPTERS))}
    self.assertEqual({p[-2] for p in paths}, {lora.suffix(t) for t in lora.MLP_TARGETS})
    critic.head.kernel[...] = jnp.ones_like(critic.head.kernel[...])
    plain = value_lib.ValueModel.from_policy(Decoder(BASE, rngs=nnx.Rngs(9)))
    plain.head.kernel[...] = jnp.ones_like(plain.head.kernel[...])
    np.testing.assert_array_equal(critic(_tokens(1)), plain(_tokens(1)))

  def test_config_refuses_bad_targets(self):
    with self.assertRaisesRegex(ValueError, 'lora_targets'):
      BASE.replace(lora_rank=4, lora_targets=('q_proj', 'wq'))
    with self.assertRaisesRegex(ValueError, 'lora_targets'):
      BASE.replace(lora_rank=4, lora_targets=())


if __name__ == '__main__':
  absltest.main()
