"""Masked reductions and loss aggregation shared by the loss modules.

Conventions: per-token arrays are `[B, T]`; `mask[b, t]` (bool or 0/1) marks the tokens that take part
(the action tokens). Every reduction is computed in float32 and is safe when the mask is empty (it then
returns 0 rather than NaN), so padded rows and padded batches cost nothing.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

AGGREGATIONS = ('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum')
LOG_RATIO_CLAMP = 20.0  # |log r| is clamped here before any exp: e^20 ~ 5e8, no inf in float32.


def clamp_log_ratio(log_ratio: jax.Array) -> jax.Array:
  """`clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)` in float32: safe to exponentiate.

  A clamped entry gets no gradient (at e^20 it is far outside any ratio band or sensible KL anyway).
  """
  return jnp.clip(jnp.asarray(log_ratio).astype(jnp.float32), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def as_float_mask(mask: jax.Array) -> jax.Array:
  """`mask != 0` as float32 (accepts bool, int or float masks)."""
  return (jnp.asarray(mask) != 0).astype(jnp.float32)


def masked_sum(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """`sum(x * m)` over `axis` in float32; x outside the mask never leaks in (NaN-safe: `where`, not `*`)."""
  m = jnp.asarray(mask) != 0
  return jnp.sum(jnp.where(m, x.astype(jnp.float32), 0.0), axis=axis)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
  """`sum(x * m) / max(sum(m), 1)` over `axis`, float32; 0 where the mask is empty."""
  return masked_sum(x, mask, axis) / jnp.maximum(masked_sum(jnp.ones_like(x, jnp.float32), mask, axis), 1.0)


def masked_var(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Population variance of x over the masked entries: `mean_m((x - mean_m(x))^2)` (0 if empty)."""
  mean = masked_mean(x, mask)
  return masked_mean(jnp.square(x.astype(jnp.float32) - mean), mask)


def masked_max(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Max of x over the mask (float32 scalar); 0 when the mask is empty."""
  m = jnp.asarray(mask) != 0
  return jnp.where(jnp.any(m), jnp.max(jnp.where(m, x.astype(jnp.float32), -jnp.inf)), 0.0)


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
  """Min of x over the mask (float32 scalar); 0 when the mask is empty."""
  m = jnp.asarray(mask) != 0
  return jnp.where(jnp.any(m), jnp.min(jnp.where(m, x.astype(jnp.float32), jnp.inf)), 0.0)


def sequence_sum(x: jax.Array, segment_ids: jax.Array | None = None, num_segments: int = 1) -> jax.Array:
  """`out[b, s] = sum_t x[b, t] [segment_ids[b, t] == s + 1]`, float32 `[B, S]`: the sums over each sequence.

  A packed row holds sequences numbered 1..S by `segment_ids` (0 = padding, in no sequence); without segment
  ids the row is one sequence (`[B, 1]`, `num_segments` ignored).
  """
  x = jnp.asarray(x, jnp.float32)
  if segment_ids is None:
    return jnp.sum(x, axis=-1, keepdims=True)
  chex.assert_equal_shape([x, segment_ids])
  b, _ = x.shape
  s = int(num_segments)
  seg = jnp.asarray(segment_ids, jnp.int32)
  flat = (jnp.arange(b, dtype=jnp.int32)[:, None] * (s + 1) + jnp.clip(seg, 0, s)).reshape(-1)
  sums = jax.ops.segment_sum(x.reshape(-1), flat, num_segments=b * (s + 1))
  return sums.reshape(b, s + 1)[:, 1:]


def segment_edges(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """bool `[B, T]` (starts, ends): the first and the last token of each run of equal `segment_ids` in a row (a
  packed row's sequences, and its padding run); a row's first token starts a run, its last ends one."""
  seg = jnp.asarray(segment_ids)
  change = seg[:, 1:] != seg[:, :-1]
  edge = jnp.ones_like(seg[:, :1], bool)
  return jnp.concatenate([edge, change], axis=1), jnp.concatenate([change, edge], axis=1)


def sequence_to_tokens(x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """Per-sequence values `[B, S]` put on their tokens: `out[b, t] = x[b, segment_ids[b, t] - 1]`, 0 on padding
  (segment 0); without segment ids `x` is `[B, 1]` or `[B]` and every token of row b gets `x[b]`."""
  x = jnp.asarray(x)
  if segment_ids is None:
    return x.reshape(x.shape[0], 1)
  seg = jnp.asarray(segment_ids, jnp.int32)
  out = jnp.take_along_axis(x, jnp.clip(seg - 1, 0, x.shape[1] - 1), axis=1)
  return jnp.where(seg > 0, out, jnp.zeros((), x.dtype))


def aggregate_count(mask: jax.Array, agg: str, segment_ids: jax.Array | None = None,
                    num_segments: int = 1) -> jax.Array:
  """What `aggregate` divides by, before its `max(., 1)`: masked tokens (`token_mean`) or sequences (rows, or
  the segments of packed rows) with at least one masked token (the `seq_mean_*` modes), float32.

  This is what makes a loss over the rows of a batch split exactly into parts (gradient accumulation):
  with rows partitioned into parts `P_i`, `aggregate(l, m) = sum_i (c_i / max(c, 1)) aggregate(l[P_i], m[P_i])`
  where `c_i = aggregate_count(m[P_i])` and `c = sum_i c_i` (a part without tokens contributes 0).
  """
  if agg == 'token_mean':
    return jnp.sum(as_float_mask(mask))
  if agg in AGGREGATIONS:
    return jnp.sum((sequence_sum(as_float_mask(mask), segment_ids, num_segments) > 0).astype(jnp.float32))
  raise ValueError(f'agg must be one of {AGGREGATIONS}, got {agg!r}')


def aggregate(per_token: jax.Array, mask: jax.Array, agg: str = 'token_mean', max_len: int = 0,
              segment_ids: jax.Array | None = None, num_segments: int = 1) -> jax.Array:
  """Reduces a per-token loss `[B, T]` to a scalar.

  A sequence is a row, or with `segment_ids` one of the S segments packed into a row (`sequence_sum`). With
  `m` the mask, `n_q = sum_{t in q} m_t` and `R = {q : n_q > 0}` the sequences with at least one token:
    - `token_mean`:          `sum_{b,t} m l / max(sum_q n_q, 1)` (every masked token weighs the same).
    - `seq_mean_token_mean`: `(1/|R|) sum_{q in R} (sum_{t in q} m l) / n_q` (every sequence weighs the same).
    - `seq_mean_token_sum`:  `(1/|R|) sum_{q in R} (sum_{t in q} m l) / L`, L = `max_len` or T when 0 (Dr.GRPO).
  Sequences without tokens (padding) are left out of the means, so padding a batch changes nothing.

  Args:
    per_token: `[B, T]` loss per token.
    mask: `[B, T]` tokens that count.
    agg: one of `AGGREGATIONS` (static).
    max_len: the constant divisor of `seq_mean_token_sum` (static int; 0 = T).
    segment_ids: `[B, T]` int, packed sequences (1..S, 0 = padding), or None (one sequence per row).
    num_segments: S (static).

  Returns:
    float32 scalar.
  """
  chex.assert_rank(per_token, 2)
  chex.assert_equal_shape([per_token, mask])
  if agg == 'token_mean':
    return masked_mean(per_token, mask)
  m = as_float_mask(mask)
  row_sum = sequence_sum(jnp.where(m > 0, per_token.astype(jnp.float32), 0.0), segment_ids, num_segments)
  row_n = sequence_sum(m, segment_ids, num_segments)
  nonempty = (row_n > 0).astype(jnp.float32)
  if agg == 'seq_mean_token_mean':
    row = row_sum / jnp.maximum(row_n, 1.0)
  elif agg == 'seq_mean_token_sum':
    if not isinstance(max_len, int) or max_len < 0:
      raise ValueError(f'agg_max_len must be an int >= 0 (0 = T), got {max_len!r}')
    row = row_sum / float(max_len or per_token.shape[1])
  else:
    raise ValueError(f'agg must be one of {AGGREGATIONS}, got {agg!r}')
  return jnp.sum(row * nonempty) / jnp.maximum(jnp.sum(nonempty), 1.0)
