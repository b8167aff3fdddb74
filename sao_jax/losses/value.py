"""Critic loss: masked 0.5 * squared error to fixed returns, with optional PPO-style value clipping."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax import lax

from sao_jax.losses import common


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """`1 - Var_m(R - V) / Var_m(R)` over the masked tokens (population variances), float32 scalar, no gradient.

  1: the values explain the returns; 0: no better than a constant; < 0: worse. Undefined when the returns are
  constant, then 0: when `Var_m(R) <= 1e-6 max(mean_m(R^2), mean_m(V^2))`. Returns are computed from the values
  (`R = A + V`), so equal returns carry float32 rounding of the values' size: a batch without a reward has returns
  0 +- ~1e-9 around values of ~0.05, and would otherwise report ~-1e16.
  """
  v = lax.stop_gradient(jnp.asarray(values, jnp.float32))
  ret = lax.stop_gradient(jnp.asarray(returns, jnp.float32))
  var_ret = common.masked_var(ret, mask)
  var_res = common.masked_var(ret - v, mask)
  scale = jnp.maximum(common.masked_mean(jnp.square(ret), mask), common.masked_mean(jnp.square(v), mask))
  varies = var_ret > 1e-6 * scale
  return jnp.where(varies, 1.0 - var_res / jnp.where(varies, var_ret, 1.0), 0.0)


def value_loss(values: jax.Array, returns: jax.Array, mask: jax.Array, *, old_values: jax.Array | None = None,
               clip_eps: float | jax.Array | None = None, agg: str = 'token_mean',
               agg_max_len: int = 0) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Value loss (to minimise) over the masked tokens, and scalar metrics.

  Plain (SAO): `l_t = 0.5 (V_t - R_t)^2`. Clipped (PPO baseline; when both `old_values` and `clip_eps` are
  given): `V^c_t = V^old_t + clip(V_t - V^old_t, -eps, eps)`, `l_t = 0.5 max((V_t - R_t)^2, (V^c_t - R_t)^2)`.
  Then aggregated with `common.aggregate(l, mask, agg, agg_max_len)`.

  Args:
    values: `[B, T]` current critic values (differentiable).
    returns: `[B, T]` fixed targets (no gradient).
    mask: `[B, T]` tokens that count (action tokens).
    old_values: `[B, T]` values of the critic that produced the returns (clipped variant only).
    clip_eps: value clip width (clipped variant only).
    agg: aggregation (static), see `common.AGGREGATIONS`.
    agg_max_len: divisor of `seq_mean_token_sum` (static int, 0 = T).

  Returns:
    `(loss, metrics)` with float32 scalars: `explained_variance` (of `values`, see
    `explained_variance`), `value_mean`, `return_mean`, `value_error` (mean squared error), `value_clip_frac`
    (clipped variant: fraction of tokens where the clip is active and its term the larger, i.e. no gradient).
  """
  chex.assert_rank(values, 2)
  chex.assert_equal_shape([values, returns, mask])
  chex.assert_type([values, returns], float)
  m = jnp.asarray(mask) != 0
  v = values.astype(jnp.float32)
  ret = lax.stop_gradient(jnp.asarray(returns, jnp.float32))
  err = jnp.square(v - ret)
  metrics = {}
  if old_values is not None and clip_eps is not None:
    chex.assert_equal_shape([values, old_values])
    old = lax.stop_gradient(jnp.asarray(old_values, jnp.float32))
    eps = jnp.asarray(clip_eps, jnp.float32)
    v_clipped = old + jnp.clip(v - old, -eps, eps)
    err_clipped = jnp.square(v_clipped - ret)
    # Clip active (|V - V_old| > eps) and the clipped term the larger: these tokens get no gradient.
    clipped = (jnp.abs(v - old) > eps) & (err_clipped > err)
    metrics['value_clip_frac'] = common.masked_mean(clipped.astype(jnp.float32), m)
    per_token = 0.5 * jnp.maximum(err, err_clipped)
  elif (old_values is None) != (clip_eps is None):
    raise ValueError('value clipping needs both old_values and clip_eps (got only one of them)')
  else:
    per_token = 0.5 * err
  loss = common.aggregate(per_token, m, agg, agg_max_len)
  v_sg = lax.stop_gradient(v)
  metrics.update(
      explained_variance=explained_variance(v_sg, ret, m),
      value_mean=common.masked_mean(v_sg, m),
      return_mean=common.masked_mean(ret, m),
      value_error=common.masked_mean(lax.stop_gradient(err), m),
  )
  return loss, metrics
