"""sao_jax.models.moe against a float64 numpy loop per token written from the module docstring's formulas: the router
(softmax / sigmoid with correction bias, groups, scaling), the dropless and the capacity experts, shared experts,
the load and balance statistics, routing replay, the grouped matmul; and the config's checks (the Decoder with MoE
layers: moe_decoder_test.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import base
from sao_jax import config_lib
from sao_jax.errors import ConfigError
from sao_jax.models import moe
from sao_jax.models.config import ModelConfig, get_model_config

_D, _E, _F, _M = 16, 8, 8, 24
_ROUTERS = {
    'softmax_norm': dict(router_scoring='softmax', norm_topk_prob=True),
    'softmax_raw': dict(router_scoring='softmax', norm_topk_prob=False),
    'sigmoid_grouped': dict(router_scoring='sigmoid', router_bias=True, moe_groups=4, moe_topk_groups=2,
                            routed_scaling_factor=2.5, num_shared_experts=2, norm_topk_prob=True),
}


def _cfg(**kw) -> ModelConfig:
  base = dict(vocab_size=32, embed_dim=_D, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32,
              num_experts=_E, num_experts_per_tok=3, moe_mlp_dim=_F)
  return ModelConfig(**{**base, **kw})


def _params(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
  r = np.random.RandomState(seed)
  p = dict(router=r.randn(_D, _E), gate_proj=0.3 * r.randn(_E, _D, _F), up_proj=0.3 * r.randn(_E, _D, _F),
           down_proj=0.3 * r.randn(_E, _F, _D))
  if cfg.router_bias:
    p['router_bias'] = 0.3 * r.randn(_E)
  if cfg.num_shared_experts:
    fs = _F * cfg.num_shared_experts
    p.update(shared_gate_proj=0.3 * r.randn(_D, fs), shared_up_proj=0.3 * r.randn(_D, fs),
             shared_down_proj=0.3 * r.randn(fs, _D))
  return {k: v.astype(np.float32) for k, v in p.items()}


def _swiglu(x, g, u, d):
  a, b = x @ g, x @ u
  return (a / (1 + np.exp(-a)) * b) @ d


def _reference(cfg, x, p, mask=None, slots=None, experts=None):
  """(y, experts, load, aux_loss, dropped) by a loop over tokens, float64, from the formulas."""
  p = {k: v.astype(np.float64) for k, v in p.items()}
  x = x.astype(np.float64)
  m, k, e = x.shape[0], cfg.num_experts_per_tok, cfg.num_experts
  mask = np.ones(m, bool) if mask is None else mask
  y = np.zeros_like(x)
  chosen = np.zeros((m, k), np.int64)
  probs = np.zeros((m, e))
  seen = np.zeros(e, np.int64)  # Pairs each expert was offered so far (token order): capacity's queue.
  dropped = 0
  for t in range(m):
    logits = x[t] @ p['router']
    if cfg.router_scoring == 'softmax':
      s = np.exp(logits - logits.max())
      s /= s.sum()
      probs[t] = c = s
    else:
      s = 1 / (1 + np.exp(-logits))
      probs[t] = s / s.sum()
      c = s + p.get('router_bias', 0.0)
    c = c.copy()
    if cfg.moe_groups > 1:
      groups = c.reshape(cfg.moe_groups, -1)
      score = np.sort(groups, axis=1)[:, -2:].sum(1)
      kept = np.argsort(-score)[:cfg.moe_topk_groups]
      for g in range(cfg.moe_groups):
        if g not in kept:
          c.reshape(cfg.moe_groups, -1)[g] = -np.inf
    chosen[t] = np.argsort(-c, kind='stable')[:k] if experts is None else experts[t]
    w = s[chosen[t]]
    if cfg.norm_topk_prob:
      w = w / w.sum()
    w = w * cfg.routed_scaling_factor
    for j, ex in enumerate(chosen[t]):
      keep = slots is None or seen[ex] < slots
      seen[ex] += 1
      if keep:
        y[t] += w[j] * _swiglu(x[t], p['gate_proj'][ex], p['up_proj'][ex], p['down_proj'][ex])
      elif mask[t]:
        dropped += 1
    if cfg.num_shared_experts:
      y[t] += _swiglu(x[t], p['shared_gate_proj'], p['shared_up_proj'], p['shared_down_proj'])
  n = mask.sum()
  counts = np.zeros(e)
  for t in np.nonzero(mask)[0]:
    counts[chosen[t]] += 1
  aux_loss = e * np.sum(counts / n * probs[mask].mean(0))
  return y, chosen, counts / (n * k), aux_loss, dropped / (n * k)


class MoeReferenceTest(parameterized.TestCase):

  @parameterized.product(router=tuple(_ROUTERS), impl=('dropless', 'capacity'))
  def test_layer_equals_loop_per_token(self, router, impl):
    """Router, experts, shared expert and statistics, with 4 padding tokens outside the statistics; 'capacity' at
    factor 0.5 drops pairs (the first C of each expert in token order are kept)."""
    cfg = _cfg(moe_impl=impl, capacity_factor=0.5, **_ROUTERS[router])
    p = _params(cfg)
    x = np.random.RandomState(1).randn(_M, _D).astype(np.float32)
    mask = np.arange(_M) < _M - 4
    slots = moe.capacity(cfg, _M) if impl == 'capacity' else None
    y, aux = moe.moe_mlp(cfg, jnp.asarray(x), jax.tree.map(jnp.asarray, p), jnp.asarray(mask))
    ref_y, ref_experts, ref_load, ref_aux, ref_dropped = _reference(cfg, x, p, mask, slots)
    np.testing.assert_array_equal(np.sort(np.asarray(aux.experts), 1), np.sort(ref_experts, 1))
    np.testing.assert_allclose(np.asarray(y), ref_y, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(aux.load), ref_load, atol=1e-6)
    np.testing.assert_allclose(float(aux.aux_loss), ref_aux, rtol=1e-5)
    np.testing.assert_allclose(float(aux.dropped), ref_dropped, atol=1e-6)
    if impl == 'capacity':
      self.assertGreater(ref_dropped, 0.1)  # The factor really drops.

  def test_capacity_without_drops_equals_dropless(self):
    cfg = _cfg(**_ROUTERS['sigmoid_grouped'])
    p = jax.tree.map(jnp.asarray, _params(cfg))
    x = jnp.asarray(np.random.RandomState(2).randn(_M, _D), jnp.float32)
    y, _ = jax.jit(moe.moe_mlp, static_argnums=0)(cfg, x, p)
    y_cap, aux = jax.jit(moe.moe_mlp, static_argnums=0)(cfg.replace(moe_impl='capacity', capacity_factor=float(_E)),
                                                        x, p)
    self.assertEqual(float(aux.dropped), 0.0)
    np.testing.assert_allclose(np.asarray(y_cap), np.asarray(y), atol=1e-5)

  def test_replay_uses_given_experts_with_this_routers_weights(self):
    """Replayed experts: the loop's output for those experts (weights from the scores of the replaying router)."""
    cfg = _cfg(**_ROUTERS['sigmoid_grouped'])
    p = _params(cfg)
    x = np.random.RandomState(3).randn(_M, _D).astype(np.float32)
    given = np.stack([np.random.RandomState(4 + t).permutation(_E)[:3] for t in range(_M)])
    y, aux = moe.moe_mlp(cfg, jnp.asarray(x), jax.tree.map(jnp.asarray, p), experts=jnp.asarray(given))
    np.testing.assert_array_equal(np.asarray(aux.experts), given)
    np.testing.assert_allclose(np.asarray(y), _reference(cfg, x, p, experts=given)[0], atol=2e-5, rtol=1e-5)

  def test_router_gradient_and_bias_only_in_the_choice(self):
    """The router's weights get a gradient through the combine weights; the correction bias none (choice only)."""
    cfg = _cfg(**_ROUTERS['sigmoid_grouped'])
    p = jax.tree.map(jnp.asarray, _params(cfg))
    x = jnp.asarray(np.random.RandomState(5).randn(_M, _D), jnp.float32)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(moe.moe_mlp(cfg, x, p)[0] ** 2)))(p)
    self.assertGreater(float(jnp.abs(grads['router']).max()), 1e-3)
    self.assertEqual(float(jnp.abs(grads['router_bias']).max()), 0.0)


class GroupedMatmulTest(parameterized.TestCase):

  @parameterized.parameters('tiles', 'ragged_dot')
  def test_value_and_gradients_equal_a_loop_per_row(self, impl):
    """Groups of 5, 0, 17, 3, 0, 9, 1, 14 rows (empty groups, groups inside one tile and across tiles): out[r] =
    lhs[r] @ rhs[g(r)], and the gradients of sum(sin(out)) w.r.t. lhs and rhs (the tiles' own backward)."""
    r = np.random.RandomState(0)
    sizes = np.array([5, 0, 17, 3, 0, 9, 1, 14], np.int32)
    lhs, rhs = r.randn(sizes.sum(), 16).astype(np.float32), r.randn(8, 16, 12).astype(np.float32)
    group = np.repeat(np.arange(8), sizes)
    out = np.einsum('rk,rkn->rn', lhs.astype(np.float64), rhs[group].astype(np.float64))
    dout = np.cos(out)
    d_lhs = np.einsum('rn,rkn->rk', dout, rhs[group])
    d_rhs = np.zeros(rhs.shape)
    for i, g in enumerate(group):
      d_rhs[g] += np.outer(lhs[i], dout[i])
    fn = lambda a, b: moe.grouped_matmul(a, b, jnp.asarray(sizes), impl)
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(lhs, rhs)), out, atol=1e-5)
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.sin(fn(a, b))), argnums=(0, 1)))(lhs, rhs)
    np.testing.assert_allclose(np.asarray(grads[0]), d_lhs, atol=1e-4)
    np.testing.assert_allclose(np.asarray(grads[1]), d_rhs, atol=1e-4)


class MoeConfigTest(parameterized.TestCase):

  @parameterized.parameters(
      ('num_experts_per_tok', dict(num_experts_per_tok=9)),
      ('moe_mlp_dim', dict(moe_mlp_dim=0)),
      ('router_scoring', dict(router_scoring='relu')),
      ('router_bias', dict(router_bias=True)),
      ('moe_groups', dict(router_scoring='sigmoid', moe_groups=3)),
      ('moe_topk_groups', dict(router_scoring='sigmoid', moe_groups=4, moe_topk_groups=5)),
      ('first_k_dense', dict(first_k_dense=2)),
      ('moe_impl', dict(moe_impl='dense')),
      ('capacity_factor', dict(capacity_factor=0.0)),
      ('lora_rank', dict(lora_rank=4, lora_targets=('q_proj',))),
  )
  def test_bad_field_is_named(self, field, kw):
    with self.assertRaisesRegex(ValueError, f'ModelConfig.{field}='):
      _cfg(**kw)

  @parameterized.parameters(('qwen3-30b-a3b', 30.5, 3.0), ('glm-4.5-air', 106.9, 12.8))
  def test_named_shapes(self, name, total_b, active_b):
    """The published sizes (Qwen3-30B-A3B 30.5B, 3.3B active with the embedding; GLM-4.5-Air 106B, 12B active) and a
    config.json round trip. `active_b`: the weights one token's matmuls use (flops_per_token / 6 at T = 0)."""
    cfg = get_model_config(name)
    self.assertAlmostEqual(cfg.num_params() / 1e9, total_b, delta=0.05)
    self.assertAlmostEqual(cfg.flops_per_token(0) / 6e9, active_b, delta=0.05)
    self.assertEqual(ModelConfig.from_hf_config(cfg.to_hf_config(), name=name), cfg)

  def test_a_run_on_an_moe_model_is_refused_at_start(self):
    config = base.get_config()
    config.model.name = 'qwen3-30b-a3b'
    with self.assertRaisesRegex(ConfigError, "config.model.name='qwen3-30b-a3b' is a mixture-of-experts"):
      config_lib.validate(config, log=False)

  def test_dense_config_unchanged(self):
    cfg = get_model_config('tiny')
    self.assertFalse(cfg.is_moe)
    self.assertEqual((cfg.num_dense_layers, cfg.num_moe_layers, cfg.rotary_dim), (2, 0, 16))
    self.assertEqual([f.name for f in dataclasses.fields(cfg)][-1], 'name')


if __name__ == '__main__':
  absltest.main()
