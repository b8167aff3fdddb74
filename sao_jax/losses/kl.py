"""KL estimators to a reference policy from per-token log-prob pairs, and entropy from logits.

With samples a ~ pi (the policy being trained) and `log_r = log ref(a) - log pi(a)` (Schulman's notation),
unbiased or low-variance estimators of `KL(pi || ref) = E_pi[log pi - log ref]`:
  - k1 = -log_r                        (unbiased, high variance, can be negative)
  - k2 = 0.5 * log_r^2                 (biased, low variance; `E_pi[k2]` -> KL as ref -> pi)
  - k3 = exp(log_r) - 1 - log_r        (unbiased, always >= 0)
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from sao_jax.losses import common

KL_ESTIMATORS = ('k1', 'k2', 'k3')


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = 'k3') -> jax.Array:
  """Per-token estimate of KL(pi || ref) from `logprobs = log pi(a)` and `ref_logprobs = log ref(a)`.

  Formulas in the module docstring (`log_r = ref_logprobs - logprobs`, clamped with `common.clamp_log_ratio`
  before exp in k3).
  Differentiable w.r.t. both inputs; float32; same shape as the inputs.
  """
  chex.assert_equal_shape([logprobs, ref_logprobs])
  chex.assert_type([logprobs, ref_logprobs], float)
  log_r = ref_logprobs.astype(jnp.float32) - logprobs.astype(jnp.float32)
  if estimator == 'k1':
    return -log_r
  if estimator == 'k2':
    return 0.5 * jnp.square(log_r)
  if estimator == 'k3':
    log_r = common.clamp_log_ratio(log_r)
    return jnp.exp(log_r) - 1.0 - log_r
  raise ValueError(f'estimator must be one of {KL_ESTIMATORS}, got {estimator!r}')


def masked_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, estimator: str = 'k3') -> jax.Array:
  """Mean over the masked tokens of `kl_estimate` (float32 scalar, 0 for an empty mask)."""
  chex.assert_equal_shape([logprobs, ref_logprobs, mask])
  return common.masked_mean(kl_estimate(logprobs, ref_logprobs, estimator), mask)


def entropy_from_logits(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Per-token entropy `H = logsumexp(z) - sum_v softmax(z)_v z_v` of `logits [..., V]`, float32 `[...]`.

  The one entropy of sao_jax (the chunked log-probs of `sao_jax.models.logprobs` call it too). Computed on
  `z' = z - max(z)` (H is shift invariant; the max is a constant for the gradient): with `e = exp(z')`,
  `s = sum_v e_v`, `H = log s - sum_v e_v z'_v / s`. Shifting first matters: with z ~ 1e4,
  `logsumexp(z) - E[z]` would cancel away float32's digits; after it `e <= 1` and `s >= 1`, so nothing
  overflows, and the two sums read one exp of the logits (XLA fuses the upcast, exp and products into
  the reductions: no float32 `[..., V]` probability tensor, bf16 logits stay bf16 in memory).
  Tokens outside `mask` (same shape as the leading dims) are 0; average them with `common.masked_mean`.
  """
  chex.assert_type(logits, float)
  z = logits.astype(jnp.float32)
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  e = jnp.exp(z)
  s = jnp.sum(e, axis=-1)
  ent = jnp.log(s) - jnp.sum(e * z, axis=-1) / s
  if mask is not None:
    chex.assert_equal_shape([ent, mask])
    ent = jnp.where(jnp.asarray(mask) != 0, ent, 0.0)
  return ent
