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
_LOG_RATIO_CLAMP = 20.0


def kl_estimate(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str = 'k3') -> jax.Array:
  """Per-token estimate of KL(pi || ref) from `logprobs = log pi(a)` and `ref_logprobs = log ref(a)`.

  Formulas in the module docstring (`log_r = ref_logprobs - logprobs`, clamped to +-20 before exp in k3).
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
    log_r = jnp.clip(log_r, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return jnp.exp(log_r) - 1.0 - log_r
  raise ValueError(f'estimator must be one of {KL_ESTIMATORS}, got {estimator!r}')


def masked_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array, estimator: str = 'k3') -> jax.Array:
  """Mean over the masked tokens of `kl_estimate` (float32 scalar, 0 for an empty mask)."""
  chex.assert_equal_shape([logprobs, ref_logprobs, mask])
  return common.masked_mean(kl_estimate(logprobs, ref_logprobs, estimator), mask)


def entropy_from_logits(logits: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Per-token entropy `H = logsumexp(z) - sum_v softmax(z)_v z_v` of `logits [..., V]`, float32 `[...]`.

  Computed on `z - max(z)` (H is shift invariant) so large logits do not cancel.

  Written as two reductions over a float32 view of the logits so XLA fuses the upcast, exp and products
  into them (no float32 `[..., V]` probability tensor beside the upcast; bf16 logits stay bf16 in memory).
  Tokens outside `mask` (same shape as the leading dims) are 0; average them with `common.masked_mean`.
  """
  chex.assert_type(logits, float)
  z = logits.astype(jnp.float32)
  # Shift by the max first: with z ~ 1e4, logsumexp(z) - E[z] would cancel away float32's digits.
  z = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  lse = jax.nn.logsumexp(z, axis=-1)
  ent = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
  if mask is not None:
    chex.assert_equal_shape([ent, mask])
    ent = jnp.where(jnp.asarray(mask) != 0, ent, 0.0)
  return ent
