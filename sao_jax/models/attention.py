"""Causal self-attention of the plain (uncached) forward pass, within segments.

    out[b, t] = sum_s softmax_s(q[b, t] . k[b, s] / sqrt(H) over allowed s) v[b, s],
    allowed(t, s) = s <= t and segment_ids[b, s] == segment_ids[b, t].

`segment_ids` int [B, T] numbers the sequences packed into a row (several trajectories in one learner row);
a token never attends across a segment boundary. A single right- or left-padded sequence is the segment ids
`attention_mask.astype(int)`: its real tokens are segment 1 and attend to real tokens only (padding is
segment 0 and attends to padding: its outputs are garbage and masked downstream, never NaN).

Grouped-query layout: q [B, T, K, G, H] (K key/value heads, G query heads per key head), k/v [B, T, K, H].

Three implementations of the same function (`ModelConfig.attention_impl`; 'auto' picks one: `resolve_impl`):

- 'reference': dense masked scores, [B, K, G, Tq, T] float32 per query chunk (`chunk`); its backward keeps the
  probabilities of every chunk: T x T per head.
- 'flash': blocks of queries x blocks of keys with an online softmax (`flash_attention`), blocks above the causal
  diagonal skipped; a custom VJP recomputes each block's probabilities from the saved log-sum-exp, so neither
  pass holds more than one [B, K, G, block, block] tile of scores. Pure JAX: every backend.
- 'splash': the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.splash_attention` (causal mask, segment ids,
  grouped heads), inside `shard_map` over the batch (and head) axes when traced under a mesh.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from sao_jax.models.config import ATTENTION_IMPLS

Array = jax.Array
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # Finite "minus infinity" (no NaN on fully masked rows).
FLASH_BLOCK = 512  # Flash attention's block (queries and keys) when `chunk` is 0.
_SPLASH_BLOCKS = (512, 256, 128)  # Splash's block: the largest of these that divides T padded to 128.
_PAD_SEGMENT = -1  # Segment id of the positions a blocked attention pads T with (after every real position).


def segment_mask(q_segments: Array, k_segments: Array, q_offset: int | Array = 0) -> Array:
  """bool [B, Tq, Tk]: causal (key s <= query q_offset + i) and within one segment."""
  tq, tk = q_segments.shape[1], k_segments.shape[1]
  causal = (q_offset + jnp.arange(tq))[:, None] >= jnp.arange(tk)[None, :]
  return causal[None] & (q_segments[:, :, None] == k_segments[:, None, :])


def resolve_impl(impl: str) -> str:
  """The implementation of `impl`: 'auto' is 'splash' when the program is for TPU (the abstract mesh's devices
  under `jax.sharding.use_abstract_mesh`, e.g. an ahead-of-time plan for a TPU topology; else
  `jax.default_backend()`), 'flash' elsewhere; the others as they are.

  Raises:
    ValueError: `impl` is not one of `ATTENTION_IMPLS`.
  """
  if impl == 'auto':
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return 'splash' if platform == 'tpu' else 'flash'
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f'attention impl {impl!r} is not one of {ATTENTION_IMPLS}.')
  return impl


def attention(q: Array, k: Array, v: Array, segment_ids: Array, *, chunk: int = 0, impl: str = 'reference'
              ) -> Array:
  """Causal attention within segments (module docstring); q [B,T,K,G,H], k/v [B,T,K,H] -> [B,T,K,G,H].

  `impl` (`resolve_impl`): 'reference' with `chunk` > 0 and < T takes query blocks of `chunk` positions (at
  most 16 blocks), each against the keys up to its end only (the blocks above the diagonal are skipped: about
  half the work at long T); 'flash' uses blocks of `chunk` (0: `FLASH_BLOCK`) queries and keys; 'splash'
  picks its own blocks.
  """
  b, t, kh, g, h = q.shape
  chex.assert_shape([k, v], (b, t, kh, h))
  chex.assert_shape(segment_ids, (b, t))
  impl = resolve_impl(impl)
  if impl == 'flash':
    return flash_attention(q, k, v, segment_ids, block=chunk or FLASH_BLOCK)
  if impl == 'splash':
    return splash_attention(q, k, v, segment_ids)
  return reference_attention(q, k, v, segment_ids, chunk=chunk)


# ---- Reference: dense masked scores.

def _attend(q: Array, k: Array, v: Array, mask: Array) -> Array:
  """softmax(q k^T / sqrt(H) masked) v: q [B,T,K,G,H], k/v [B,S,K,H], mask bool [B,T,S] -> [B,T,K,G,H]."""
  scores = jnp.einsum('btkgh,bskh->bkgts', q, k, preferred_element_type=jnp.float32) * (q.shape[-1] ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum('bkgts,bskh->btkgh', probs, v)


def reference_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, chunk: int = 0) -> Array:
  """Dense masked attention (module docstring), in query chunks of `chunk` (`attention`)."""
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


# ---- Flash: query blocks x key blocks, online softmax, recomputing backward.

def _pad_time(x: Array, t: int, value: int | float = 0) -> Array:
  """x [B, T, ...] padded with `value` to [B, t, ...] (after the last position)."""
  if x.shape[1] == t:
    return x
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, t - x.shape[1])
  return jnp.pad(x, pad, constant_values=value)


def flash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, block: int = FLASH_BLOCK) -> Array:
  """Causal attention within segments by blocks (module docstring), the same values as `reference_attention`.

  T is padded to a multiple of `block` with segment `_PAD_SEGMENT` (after every real position: causality keeps
  it out of the real queries' keys). For query block i and key blocks j = 0..i (the others are above the
  diagonal), with s = q_i k_j^T / sqrt(H) masked, the float32 running max m, sum l and output a:

      m' = max(m, max_s s),  p = exp(s - m') on allowed keys (0 elsewhere),
      l' = l exp(m - m') + sum_s p,  a' = a exp(m - m') + p v_j,  out_i = a / l,  lse_i = m + log l.

  The backward (`_flash_bwd`) recomputes p = exp(s - lse) block by block (FlashAttention-2).
  """
  b, t, kh, g, h = q.shape
  chex.assert_shape([k, v], (b, t, kh, h))
  chex.assert_shape(segment_ids, (b, t))
  block = min(block, t)
  tp = -(-t // block) * block
  seg = _pad_time(segment_ids.astype(jnp.int32), tp, _PAD_SEGMENT)
  out = _flash(_pad_time(q, tp), _pad_time(k, tp), _pad_time(v, tp), seg, block)
  return out[:, :t]


def _block(x: Array, i: Array | int, block: int) -> Array:
  """Block i (positions [i * block, (i + 1) * block)) of x [B, T, ...] along T."""
  return jax.lax.dynamic_slice_in_dim(x, i * block, block, axis=1)


def _block_scores(q_i: Array, k_j: Array, seg_i: Array, seg_j: Array, i: Array, j: Array, block: int
                  ) -> tuple[Array, Array]:
  """(s, mask) of query block i against key block j: s = q_i k_j^T / sqrt(H) float32 [B, K, G, bq, bk],
  `_MASK_VALUE` where mask (causal, same segment: [B, 1, 1, bq, bk]) is False."""
  s = jnp.einsum('btkgh,bskh->bkgts', q_i, k_j, preferred_element_type=jnp.float32) * (q_i.shape[-1] ** -0.5)
  mask = segment_mask(seg_i, seg_j, q_offset=(i - j) * block)[:, None, None]
  return jnp.where(mask, s, _MASK_VALUE), mask


def _flash_forward(q: Array, k: Array, v: Array, seg: Array, block: int) -> tuple[Array, Array]:
  """(out [B, T, K, G, H], lse float32 [B, K, G, T]) of padded inputs (T a multiple of `block`)."""
  b, t, kh, g, h = q.shape
  f32 = jnp.float32

  def query_block(i):
    q_i, seg_i = _block(q, i, block), _block(seg, i, block)

    def key_block(j, carry):
      m, l, acc = carry
      s, mask = _block_scores(q_i, _block(k, j, block), seg_i, _block(seg, j, block), i, j, block)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum('bkgts,bskh->bkgth', p.astype(v.dtype), _block(v, j, block), preferred_element_type=f32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    init = (jnp.full((b, kh, g, block), _MASK_VALUE, f32), jnp.zeros((b, kh, g, block), f32),
            jnp.zeros((b, kh, g, block, h), f32))
    m, l, acc = jax.lax.fori_loop(0, i + 1, key_block, init)  # Key blocks j <= i only.
    return jnp.einsum('bkgth->btkgh', acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

  outs, lses = jax.lax.map(query_block, jnp.arange(t // block))  # [n, B, block, K, G, H], [n, B, K, G, block]
  out = jnp.moveaxis(outs, 0, 1).reshape(b, t, kh, g, h)
  lse = jnp.moveaxis(lses, 0, 3).reshape(b, kh, g, t)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q: Array, k: Array, v: Array, seg: Array, block: int) -> Array:
  return _flash_forward(q, k, v, seg, block)[0]


def _flash_fwd(q, k, v, seg, block):
  out, lse = _flash_forward(q, k, v, seg, block)
  return out, (q, k, v, seg, out, lse)


def _flash_bwd(block, residuals, d_out):
  """Gradients of `_flash` by key blocks j, each against query blocks i >= j; with p recomputed from the lse,
  D = rowsum(dO * O), dP = dO v_j^T, dS = p (dP - D):

      dv_j = sum_i p^T dO_i,  dk_j = sum_i dS^T q_i / sqrt(H),  dq_i = sum_j dS k_j / sqrt(H)  (dq accumulated
      in place: one pass, no [T, T] anything)."""
  q, k, v, seg, out, lse = residuals
  b, t, kh, g, h = q.shape
  n, f32, scale = t // block, jnp.float32, h ** -0.5
  delta = jnp.einsum('btkgh,btkgh->bkgt', d_out.astype(f32), out.astype(f32))

  def key_block(dq, j):
    k_j, v_j, seg_j = _block(k, j, block), _block(v, j, block), _block(seg, j, block)

    def query_block(i, carry):
      dk_j, dv_j, dq = carry
      q_i, do_i = _block(q, i, block), _block(d_out, i, block)
      lse_i = jax.lax.dynamic_slice_in_dim(lse, i * block, block, axis=3)
      delta_i = jax.lax.dynamic_slice_in_dim(delta, i * block, block, axis=3)
      s, mask = _block_scores(q_i, k_j, _block(seg, i, block), seg_j, i, j, block)
      p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
      dv_j += jnp.einsum('bkgts,btkgh->bskh', p.astype(do_i.dtype), do_i, preferred_element_type=f32)
      dp = jnp.einsum('btkgh,bskh->bkgts', do_i, v_j, preferred_element_type=f32)
      ds = p * (dp - delta_i[..., None])
      dk_j += jnp.einsum('bkgts,btkgh->bskh', ds.astype(q_i.dtype), q_i, preferred_element_type=f32) * scale
      dq_i = jnp.einsum('bkgts,bskh->btkgh', ds.astype(k_j.dtype), k_j, preferred_element_type=f32) * scale
      dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, block) + dq_i, i * block, axis=1)
      return dk_j, dv_j, dq

    zeros = jnp.zeros((b, block, kh, h), f32)
    dk_j, dv_j, dq = jax.lax.fori_loop(j, n, query_block, (zeros, zeros, dq))  # Query blocks i >= j only.
    return dq, (dk_j, dv_j)

  dq, (dks, dvs) = jax.lax.scan(key_block, jnp.zeros(q.shape, f32), jnp.arange(n))
  dk = jnp.moveaxis(dks, 0, 1).reshape(k.shape)
  dv = jnp.moveaxis(dvs, 0, 1).reshape(v.shape)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---- Splash: the Pallas TPU kernel.

def splash_attention(q: Array, k: Array, v: Array, segment_ids: Array, *, interpret: bool = False) -> Array:
  """Causal attention within segments by the Pallas TPU splash kernel (module docstring); `interpret` runs the
  kernel in Pallas' interpreter (any backend: the tests on CPU).

  The kernel takes one row: q [N, T, H] with query head n on key head n // G (our [K, G] head order), k/v
  [K, T, H], `SegmentIds(q, kv)` [T] each, the causal `MultiHeadMask`, and does not scale: q is multiplied by
  1/sqrt(H) first. T is padded to a multiple of 128 with segment `_PAD_SEGMENT`. Under a mesh with the batch axes
  (`jax.sharding.use_abstract_mesh`: the learner's steps) it runs in `shard_map` on each device's rows (and its
  share of the key heads over `tensor` when K divides), as a Pallas call is not partitioned by GSPMD.
  """
  b, t, kh, g, h = q.shape
  chex.assert_shape([k, v], (b, t, kh, h))
  chex.assert_shape(segment_ids, (b, t))
  tp = -(-t // 128) * 128
  seg = _pad_time(segment_ids.astype(jnp.int32), tp, _PAD_SEGMENT)
  qh = jnp.einsum('btkgh->bkgth', _pad_time(q * jnp.asarray(h ** -0.5, q.dtype), tp))
  kt, vt = (jnp.einsum('btkh->bkth', _pad_time(x, tp)) for x in (k, v))

  def rows(qh, kt, vt, seg):
    """Splash on the local rows: qh [b, k, G, T, H], kt/vt [b, k, T, H], seg [b, T] -> [b, k, G, T, H]."""
    lb, lk = qh.shape[:2]
    kernel = _splash_kernel(lk * g, tp, interpret)
    out = jax.vmap(kernel)(qh.reshape(lb, lk * g, tp, h), kt, vt, splash.SegmentIds(q=seg, kv=seg))
    return out.reshape(qh.shape)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and {'data', 'fsdp'} <= set(mesh.axis_names):
    batch = ('data', 'fsdp')
    heads = 'tensor' if 'tensor' in mesh.axis_names and kh % mesh.shape['tensor'] == 0 else None
    p = jax.sharding.PartitionSpec
    rows = jax.shard_map(rows, mesh=mesh, in_specs=(p(batch, heads), p(batch, heads), p(batch, heads), p(batch)),
                         out_specs=p(batch, heads), check_vma=False)
  out = rows(qh, kt, vt, seg)
  return jnp.einsum('bkgth->btkgh', out)[:, :t]


def _splash_kernel(heads: int, t: int, interpret: bool) -> splash.SplashAttentionKernel:
  """The splash kernel of `heads` query heads over T = `t` (a multiple of 128) keys, causal, in blocks of the
  largest of `_SPLASH_BLOCKS` that divides `t` (the mask's block tables, numpy work, are cached by jax)."""
  blk = next(s for s in _SPLASH_BLOCKS if t % s == 0)
  sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                            block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
  mask = splash.MultiHeadMask([splash.CausalMask((t, t)) for _ in range(heads)])
  return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
