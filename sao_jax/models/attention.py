"""Causal self-attention of the plain (uncached) forward pass, within segments.

    out[b, t] = sum_s softmax_s(q[b, t] . k[b, s] / sqrt(H) over allowed s) v[b, s],
    allowed(t, s) = s <= t and segment_ids[b, s] == segment_ids[b, t].

`segment_ids` int [B, T] numbers the sequences packed into a row (several trajectories in one learner row);
a token never attends across a segment boundary. A single right- or left-padded sequence is the segment ids
`attention_mask.astype(int)`: its real tokens are segment 1 and attend to real tokens only (padding is
segment 0 and attends to padding: its outputs are garbage and masked downstream, never NaN).

Grouped-query layout: q [B, T, K, G, H] (K key/value heads, G query heads per key head), k/v [B, T, K, H].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # Finite "minus infinity" (no NaN on fully masked rows).


def segment_mask(q_segments: Array, k_segments: Array, q_offset: int = 0) -> Array:
  """bool [B, Tq, Tk]: causal (key s <= query q_offset + i) and within one segment."""
  tq, tk = q_segments.shape[1], k_segments.shape[1]
  causal = (q_offset + jnp.arange(tq))[:, None] >= jnp.arange(tk)[None, :]
  return causal[None] & (q_segments[:, :, None] == k_segments[:, None, :])


def _attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """softmax(q k^T / sqrt(H) masked) v: q [B,T,K,G,H], k/v [B,S,K,H], mask bool [B,T,S] -> [B,T,K,G,H]."""
  scores = jnp.einsum('btkgh,bskh->bkgts', q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum('bkgts,bskh->btkgh', probs, v)


def attention(q: Array, k: Array, v: Array, segment_ids: Array, *, chunk: int = 0) -> Array:
  """Causal attention within segments (module docstring); q [B,T,K,G,H], k/v [B,T,K,H] -> [B,T,K,G,H].

  `chunk` > 0 and < T: query blocks of `chunk` positions (at most 16 blocks), each against the keys up to its
  end only: the blocks above the diagonal are skipped (about half the work at long T), same result.
  """
  t = q.shape[1]
  if not chunk or t <= chunk:
    return _attend(q, k, v, segment_mask(segment_ids, segment_ids))
  c = max(chunk, -(-t // 16))  # At most 16 blocks (bounded program size).
  outs = []
  for i0 in range(0, t, c):
    i1 = min(i0 + c, t)
    mask = segment_mask(segment_ids[:, i0:i1], segment_ids[:, :i1], q_offset=i0)
    outs.append(_attend(q[:, i0:i1], k[:, :i1], v[:, :i1], mask))
  return jnp.concatenate(outs, axis=1)
