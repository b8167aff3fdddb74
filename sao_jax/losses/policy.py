"""Policy-gradient losses: SAO double-side masking, PPO clip (clip-higher), dual-clip, GSPO, decoupled PPO.

All inputs are `[B, T]`. `logprobs = log pi_theta(a_t | s_t)` (the only differentiable input),
`behavior_logprobs = log pi_behavior(a_t | s_t)` recorded by the sampler, `advantages` (no gradient) and
`mask` (action tokens). Ratios are computed in float32 from log-prob differences,
`r_t = exp(clip(logprobs_t - ref_t, -20, 20))` (`common.clamp_log_ratio`), so they never overflow (a clamped
token gets no gradient through the ratio; at e^20 it is far outside any band anyway). The loss is minimised: it is `-J`.

Modes (`clip_mode`), with `A_t` the advantage and `sg` stop-gradient:
  - `double_side` (SAO): `f(r) = r` if `1 - eps_low < r < 1 + eps_high` else 0;
    `l_t = -sg(f(r_t)) A_t log pi_theta(a_t)`, so `dl/dlogpi_t = -f(r_t) A_t`: a token outside the open band
    gives no gradient whatever the sign of A.
  - `ppo`: `l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t)` (DAPO clip-higher when
    eps_high > eps_low).
  - `dual_clip`: ppo, and for `A_t < 0` the loss is capped at `-c A_t`:
    `l_t = min(l_t^ppo, -c A_t)` (option `dual_clip_c` = c > 1).
  - `gspo`: sequence ratio `s_b = exp(mean_{t in b} (logpi_t - ref_t))` (geometric mean over the row's action
    tokens), used per token as `s_{b,t} = sg(s_b) exp(logpi_t - sg(logpi_t))` (GSPO-token) in the PPO clip
    `l_t = -min(s_{b,t} A_t, clip(s_{b,t}, 1 - eps_low, 1 + eps_high) A_t)`; so an unclipped token has
    `dl/dlogpi_t = -s_b A_t`, and with `agg='seq_mean_token_mean'` and a row-constant advantage this is the
    GSPO gradient `s_b A_b (1/|y_b|) sum_t grad logpi_t`, clipped as a whole sequence.

Decoupled PPO (AReaL), option `proximal_logprobs`: the ratio above is taken to the proximal policy,
`r_t = pi_theta / pi_prox`, and each token's loss is multiplied by the detached behaviour weight
`w_t = pi_prox / pi_behavior`, corrected by `behavior_correction`: `none` (w as is), `tis` (truncated:
`min(w, tis_cap)`) or `icepop` (`w * 1[icepop_low <= w <= icepop_high]`). Without `proximal_logprobs` the
ratio is to the behaviour policy and there is no weight.

Aggregation (`agg`, see `common.aggregate`): `token_mean` (denominator = every action token of the batch,
cut ones included), `seq_mean_token_mean`, `seq_mean_token_sum` (divided by `agg_max_len`, 0 = T).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax import lax

from sao_jax.losses import common


def safe_ratio(log_ratio: jax.Array) -> jax.Array:
  """`exp(common.clamp_log_ratio(log_ratio))` in float32: never inf."""
  return jnp.exp(common.clamp_log_ratio(log_ratio))


# ---- Ratios: (logp, logp_ref, mask) -> r. The clip modes' choice of ratio.


def _token_ratio(logp, logp_ref, m, segment_ids=None, num_segments=1):
  del m, segment_ids, num_segments
  return safe_ratio(logp - logp_ref)


def _sequence_ratio(logp, logp_ref, m, segment_ids=None, num_segments=1):
  """GSPO-token: `s_{q,t} = sg(s_q) * pi_t / sg(pi_t)` (value s_q, gradient s_q w.r.t. logp_t), with the
  geometric-mean sequence ratio `s_q` over the action tokens of the token's sequence q (the row, or its segment
  of a packed row; padding excluded)."""
  mf = m.astype(jnp.float32)
  total = common.sequence_sum(jnp.where(m, logp - logp_ref, 0.0), segment_ids, num_segments)
  count = common.sequence_sum(mf, segment_ids, num_segments)
  seq_ratio = common.sequence_to_tokens(safe_ratio(total / jnp.maximum(count, 1.0)), segment_ids)
  return lax.stop_gradient(seq_ratio) * jnp.exp(logp - lax.stop_gradient(logp))


# ---- Surrogates: (ratio, adv, logp, lo, hi, c, m) -> (per-token loss, cut_low, cut_high, extra metrics).


def _double_side(ratio, adv, logp, lo, hi, c, m):
  del c, m
  r = lax.stop_gradient(ratio)
  weight = jnp.where((r > lo) & (r < hi), r, 0.0)
  return -weight * adv * logp, r <= lo, r >= hi, {}


def _ppo_clip(ratio, adv, logp, lo, hi, c, m):
  del logp, c, m
  r = lax.stop_gradient(ratio)
  per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
  # The clipped branch wins (and the gradient vanishes) where the ratio left the band on A's side.
  return per_token, (r < lo) & (adv < 0), (r > hi) & (adv > 0), {}


def _dual_clip(ratio, adv, logp, lo, hi, c, m):
  per_token, cut_low, cut_high, _ = _ppo_clip(ratio, adv, logp, lo, hi, c, m)
  lower_bound = -jnp.asarray(c, jnp.float32) * adv
  dual = (adv < 0) & (per_token > lower_bound)
  per_token = jnp.where(adv < 0, jnp.minimum(per_token, lower_bound), per_token)
  return per_token, cut_low, cut_high, {'dual_clip_frac': common.masked_mean(dual.astype(jnp.float32), m)}


# clip_mode -> (ratio, surrogate); the config check takes its choices from here.
_CLIP = {
    'double_side': (_token_ratio, _double_side),
    'ppo': (_token_ratio, _ppo_clip),
    'dual_clip': (_token_ratio, _dual_clip),
    'gspo': (_sequence_ratio, _ppo_clip),
}
CLIP_MODES = tuple(_CLIP)

# ---- Behaviour corrections of decoupled PPO: (w, tis_cap, icepop_low, icepop_high) -> (weight used, dropped).


def _no_correction(w, cap, low, high):
  del cap, low, high
  return w, jnp.zeros(w.shape, bool)


def _tis(w, cap, low, high):
  del low, high
  return jnp.minimum(w, jnp.asarray(cap, jnp.float32)), jnp.zeros(w.shape, bool)


def _icepop(w, cap, low, high):
  del cap
  keep = (w >= low) & (w <= high)
  return jnp.where(keep, w, 0.0), ~keep


_BEHAVIOR = {'none': _no_correction, 'tis': _tis, 'icepop': _icepop}
BEHAVIOR_CORRECTIONS = tuple(_BEHAVIOR)


def policy_loss(logprobs: jax.Array, behavior_logprobs: jax.Array, advantages: jax.Array, mask: jax.Array,
                *, clip_mode: str, eps_low: float | jax.Array, eps_high: float | jax.Array,
                agg: str = 'token_mean', proximal_logprobs: jax.Array | None = None,
                dual_clip_c: float | jax.Array = 3.0, agg_max_len: int = 0, behavior_correction: str = 'none',
                tis_cap: float | jax.Array = 2.0, icepop_low: float | jax.Array = 0.5,
                icepop_high: float | jax.Array = 2.0, segment_ids: jax.Array | None = None,
                num_segments: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Policy loss (to minimise) and scalar metrics; formulas in the module docstring.

  Args:
    logprobs: `[B, T]` log pi_theta of the taken tokens (differentiable).
    behavior_logprobs: `[B, T]` log-probs recorded by the sampler (no gradient).
    advantages: `[B, T]` (no gradient).
    mask: `[B, T]` action tokens (bool or 0/1).
    clip_mode: one of `CLIP_MODES` (static).
    eps_low: lower band / clip width (the band is `(1 - eps_low, 1 + eps_high)`).
    eps_high: upper band / clip width.
    agg: one of `common.AGGREGATIONS` (static).
    proximal_logprobs: `[B, T]` log-probs of the proximal policy (decoupled PPO), or None.
    dual_clip_c: the c of `dual_clip` (> 1).
    agg_max_len: divisor of `seq_mean_token_sum` (static int, 0 = T).
    behavior_correction: one of `BEHAVIOR_CORRECTIONS` (static); needs `proximal_logprobs` unless 'none'.
    tis_cap: cap of the TIS behaviour weight.
    icepop_low: IcePop keeps behaviour weights >= this.
    icepop_high: IcePop keeps behaviour weights <= this.
    segment_ids: `[B, T]` int, the sequences packed into each row (1..S, 0 = padding), or None (a row is one
      sequence): what the `seq_mean_*` aggregations and GSPO's sequence ratio take as a sequence.
    num_segments: S (static).

  Returns:
    `(loss, metrics)`: float32 scalar loss; metrics (float32 scalars over action tokens):
    `clip_frac_low` / `clip_frac_high` (fraction of action tokens whose gradient the low / high side of the
    band or clip removes), `ratio_mean`, `ratio_max`, `ratio_min` (of the ratio the clip acts on),
    `approx_kl` (k3 estimate of KL(pi_behavior || pi_theta): `mean((r_b - 1) - log r_b)`, r_b =
    pi_theta / pi_behavior), `num_action_tokens`, and `dual_clip_frac` (dual_clip), `behavior_weight_mean`
    and `behavior_masked_frac` (decoupled PPO).
  """
  if clip_mode not in CLIP_MODES:
    raise ValueError(f'clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}')
  if agg not in common.AGGREGATIONS:
    raise ValueError(f'agg must be one of {common.AGGREGATIONS}, got {agg!r}')
  if behavior_correction not in BEHAVIOR_CORRECTIONS:
    raise ValueError(f'behavior_correction must be one of {BEHAVIOR_CORRECTIONS}, got {behavior_correction!r}')
  if proximal_logprobs is None and behavior_correction != 'none':
    raise ValueError(f'behavior_correction={behavior_correction!r} needs proximal_logprobs (decoupled PPO)')
  chex.assert_rank(logprobs, 2)
  floats = [logprobs, behavior_logprobs, advantages]
  if proximal_logprobs is not None:
    floats.append(proximal_logprobs)
  chex.assert_equal_shape(floats + [mask])
  chex.assert_type(floats, float)

  m = jnp.asarray(mask) != 0
  mf = m.astype(jnp.float32)
  logp = logprobs.astype(jnp.float32)
  logp_behavior = lax.stop_gradient(behavior_logprobs.astype(jnp.float32))
  adv = lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  if proximal_logprobs is None:
    logp_ref = logp_behavior
  else:
    logp_ref = lax.stop_gradient(proximal_logprobs.astype(jnp.float32))
  lo = 1.0 - jnp.asarray(eps_low, jnp.float32)
  hi = 1.0 + jnp.asarray(eps_high, jnp.float32)

  ratio_fn, surrogate = _CLIP[clip_mode]
  ratio = ratio_fn(logp, logp_ref, m, segment_ids, num_segments)
  ratio_sg = lax.stop_gradient(ratio)
  per_token, cut_low, cut_high, metrics = surrogate(ratio, adv, logp, lo, hi, dual_clip_c, m)

  if proximal_logprobs is not None:
    w_used, dropped = _BEHAVIOR[behavior_correction](safe_ratio(logp_ref - logp_behavior), tis_cap, icepop_low,
                                                     icepop_high)
    per_token = per_token * w_used
    metrics['behavior_weight_mean'] = common.masked_mean(w_used, m)
    metrics['behavior_masked_frac'] = common.masked_mean(dropped.astype(jnp.float32), m)

  loss = common.aggregate(per_token, m, agg, agg_max_len, segment_ids, num_segments)

  log_ratio_behavior = common.clamp_log_ratio(lax.stop_gradient(logp) - logp_behavior)
  k3 = jnp.exp(log_ratio_behavior) - 1.0 - log_ratio_behavior
  metrics.update(
      clip_frac_low=common.masked_mean(cut_low.astype(jnp.float32), m),
      clip_frac_high=common.masked_mean(cut_high.astype(jnp.float32), m),
      ratio_mean=common.masked_mean(ratio_sg, m),
      ratio_max=common.masked_max(ratio_sg, m),
      ratio_min=common.masked_min(ratio_sg, m),
      approx_kl=common.masked_mean(k3, m),
      num_action_tokens=jnp.sum(mf),
  )
  return loss, metrics
