"""Llama-family decoder in Flax NNX (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3) with a preallocated KV cache.

Architecture (pre-norm): for each of L blocks,
  h = h + Attn(RMSNorm(h)),   h = h + MLP(RMSNorm(h)),   logits = RMSNorm(h) @ W_out,
  RMSNorm(x) = x / sqrt(mean(x^2) + eps) * scale,
  MLP(x) = (silu(x W_gate) * (x W_up)) W_down                                   (SwiGLU),
  Attn: q = x Wq (+bq), k = x Wk (+bk), v = x Wv (+bv); optional RMSNorm over head_dim on q, k (Qwen3);
        RoPE on q, k; grouped-query attention (N query heads share K key/value heads);
        softmax(q k^T / sqrt(H) + mask) v, then Wo.

Parameters are float32 (`cfg.param_dtype`) and cast to `cfg.dtype` at use; norms, softmax and logits are
float32. Blocks are stacked along a leading 'layers' axis (one `nnx.vmap`-created `Block`) and run with
`lax.scan` (or an unrolled loop with `cfg.scan_layers=False`); `cfg.remat` rematerialises each block.

Parameter tree (logical axis names in brackets, `L` = layers):
  embed/embedding              [V, D]         ('vocab', 'embed')
  layers/attn_norm/scale       [L, D]         ('layers', 'norm')
  layers/attn/q_proj           [L, D, N, H]   ('layers', 'embed', 'heads', 'head_dim')
  layers/attn/k_proj, v_proj   [L, D, K, H]   ('layers', 'embed', 'kv_heads', 'head_dim')
  layers/attn/o_proj           [L, N, H, D]   ('layers', 'heads', 'head_dim', 'embed')
  layers/attn/q_bias           [L, N, H]      (qkv_bias only; k_bias, v_bias [L, K, H])
  layers/attn/q_norm/scale     [L, H]         (qk_norm only; also k_norm)
  layers/mlp_norm/scale        [L, D]
  layers/mlp/gate_proj, up_proj [L, D, F]     ('layers', 'embed', 'mlp')
  layers/mlp/down_proj         [L, F, D]      ('layers', 'mlp', 'embed')
  final_norm/scale             [D]
  lm_head                      [D, V]         ('embed', 'vocab'), absent when tie_embeddings
Every attention parameter lives under an `attn` path: `nnx.PathContains('attn')` selects them all.

KV cache (`KVCache`, a pytree; see its docstring) — one call signature serves prefill, single-token decode
and continuation chunks (e.g. observation tokens appended in a multi-turn episode):

  cache = KVCache.init(cfg, batch_size=B, max_len=S)          # or model.init_cache(B, S)
  logits, cache = model(prompt[B, T0], attention_mask=m0, cache=cache)      # prefill (left or right padded)
  logits, cache = model(next_tok[B, 1], cache=cache)                       # decode one token per row
  logits, cache = model(obs[B, T1], attention_mask=m1, cache=cache)        # continuation chunk

Each call writes the chunk's keys/values into slots [end, end + T) of every row (`end` is one scalar shared
by the rows, so the write is an in-place `dynamic_update_slice`, no scatter) and attends over all cache
slots with the mask `slot_pos[b, s] <= q_pos[b, t]`: causal by position, and empty slots and masked
(padding) tokens carry `slot_pos = EMPTY_POS` (int32 max) so they are never visible ("holes"). Afterwards
`end += T` and `next_pos[b]` is one past the largest position of the row's unmasked tokens (unchanged for a
row whose chunk is entirely masked, e.g. a finished row during decode). Positions default to
`next_pos[b] + cumsum(attention_mask[b]) - 1`, so left- or right-padded prompts get positions 0.. on their
real tokens; pass `positions` explicitly to override. Slot index and position differ in general (holes).
The caller must keep `end + T <= S` (XLA clamps writes past the end, which would corrupt the last slots).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models.config import ModelConfig

Array = jax.Array
EMPTY_POS = np.iinfo(np.int32).max  # Position of an empty / masked cache slot: never visible.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # Finite "minus infinity" (no NaN on fully masked rows).


def _dtype(name: str) -> jnp.dtype:
  return jnp.dtype(name)


def _param(key: Array, shape: tuple[int, ...], names: tuple[str, ...], dtype, *, stddev: float | None,
           value: float = 0.0) -> nnx.Param:
  """A parameter with logical axis names; normal(0, stddev) init, or constant `value` if stddev is None."""
  if stddev is None:
    init = jnp.full(shape, value, dtype)
  else:
    init = (stddev * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)
  return nnx.Param(init, out_sharding=names, eager_sharding=False)


# ---------------------------------------------------------------------------------------------------------
# KV cache.


@flax.struct.dataclass
class KVCache:
  """Preallocated key/value cache for all layers (a pytree: pass it through jit, donate it).

  Attributes:
    k: [L, B, S, K, H] keys (after RoPE), compute dtype.
    v: [L, B, S, K, H] values.
    pos: int32[B, S] position of the token held in each slot; `EMPTY_POS` for empty or masked slots.
    end: int32[] next slot to write (shared by all rows).
    next_pos: int32[B] default position of the next token of each row (one past the largest written).
  """
  k: Array
  v: Array
  pos: Array
  end: Array
  next_pos: Array

  @classmethod
  def init(cls, cfg: ModelConfig, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty cache of `max_len` slots per row, in `dtype` (default: the compute dtype `cfg.dtype`)."""
    dtype = _dtype(cfg.dtype) if dtype is None else dtype
    shape = (cfg.num_layers, batch_size, max_len, cfg.num_kv_heads, cfg.head_dim)
    return cls(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
        pos=jnp.full((batch_size, max_len), EMPTY_POS, jnp.int32),
        end=jnp.zeros((), jnp.int32), next_pos=jnp.zeros((batch_size,), jnp.int32))

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


# ---------------------------------------------------------------------------------------------------------
# Layers.


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2, -1) + eps) * scale, computed in float32 (HF casting order)."""

  def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=('norm',), eager_sharding=False)
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    return y.astype(x.dtype) * self.scale[...].astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies theta^(-2i/H), i < H/2, with optional Llama-3 scaling (float32, as HF)."""
  h = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))))
  inv = inv.astype(np.float32)
  rs = cfg.rope_scaling
  if rs is not None:  # Llama 3: long wavelengths divided by `factor`, smooth ramp in between.
    factor = float(rs['factor'])
    low, high = float(rs['low_freq_factor']), float(rs['high_freq_factor'])
    old_ctx = float(rs['original_max_position_embeddings'])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * np.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, inv_l).astype(np.float32)
  return inv


def rope_tables(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
  """cos, sin of angle[b, t, i] = positions[b, t] * inv_freq[i]: float32 [B, T, H/2]."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates halves of x [B, T, n, H]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (HF rotate_half)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention with RoPE, optional qkv bias (Qwen2) and q/k RMSNorm (Qwen3)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = _dtype(cfg.param_dtype)
    self.q_proj = _param(rngs.params(), (d, n, h), ('embed', 'heads', 'head_dim'), pd, stddev=d ** -0.5)
    self.k_proj = _param(rngs.params(), (d, k, h), ('embed', 'kv_heads', 'head_dim'), pd, stddev=d ** -0.5)
    self.v_proj = _param(rngs.params(), (d, k, h), ('embed', 'kv_heads', 'head_dim'), pd, stddev=d ** -0.5)
    self.o_proj = _param(rngs.params(), (n, h, d), ('heads', 'head_dim', 'embed'), pd,
                         stddev=(n * h) ** -0.5 / (2 * cfg.num_layers) ** 0.5)
    if cfg.qkv_bias:
      self.q_bias = _param(None, (n, h), ('heads', 'head_dim'), pd, stddev=None)
      self.k_bias = _param(None, (k, h), ('kv_heads', 'head_dim'), pd, stddev=None)
      self.v_bias = _param(None, (k, h), ('kv_heads', 'head_dim'), pd, stddev=None)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(h, cfg.norm_eps, param_dtype=pd)
      self.k_norm = RMSNorm(h, cfg.norm_eps, param_dtype=pd)
    self.cfg = cfg

  def __call__(self, x: Array, cos: Array, sin: Array, mask: Array,
               kv: tuple[Array, Array, Array, Array] | None = None) -> tuple[Array, Any]:
    """x [B, T, D]; mask bool [B, T, S]; kv = (k_cache [L,B,S,K,H], v_cache, layer index, write slot []).

    Returns (out [B, T, D], (k_cache, v_cache) updated or None).
    """
    cfg = self.cfg
    dt = x.dtype
    q = jnp.einsum('btd,dnh->btnh', x, self.q_proj[...].astype(dt))
    k = jnp.einsum('btd,dkh->btkh', x, self.k_proj[...].astype(dt))
    v = jnp.einsum('btd,dkh->btkh', x, self.v_proj[...].astype(dt))
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    new_kv = None
    if kv is not None:
      k_cache, v_cache, layer, start = kv
      # In-place write of this chunk: cache[layer, :, start + t] = k[:, t].
      zero = jnp.zeros((), jnp.int32)
      idx = (jnp.asarray(layer, jnp.int32), zero, start, zero, zero)
      k_cache = jax.lax.dynamic_update_slice(k_cache, k[None].astype(k_cache.dtype), idx)
      v_cache = jax.lax.dynamic_update_slice(v_cache, v[None].astype(v_cache.dtype), idx)
      new_kv = (k_cache, v_cache)
      k = jax.lax.dynamic_index_in_dim(k_cache, layer, axis=0, keepdims=False).astype(dt)
      v = jax.lax.dynamic_index_in_dim(v_cache, layer, axis=0, keepdims=False).astype(dt)
    b, t = q.shape[:2]
    q = q.reshape(b, t, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim)
    if kv is None and cfg.attention_chunk and t > cfg.attention_chunk:
      # Causal without cache: query block [i0, i1) only needs keys [0, i1); skipping the blocks above the
      # diagonal halves the work (and the softmax traffic) at long T. Same result as the full version.
      c = max(cfg.attention_chunk, -(-t // 16))  # At most 16 blocks (bounded program size).
      outs = []
      for i0 in range(0, t, c):
        i1 = min(i0 + c, t)
        outs.append(_attend(q[:, i0:i1], k[:, :i1], v[:, :i1], mask[:, i0:i1, :i1], cfg.head_dim))
      out = jnp.concatenate(outs, axis=1)
    else:
      out = _attend(q, k, v, mask, cfg.head_dim)
    out = out.reshape(b, t, cfg.num_heads, cfg.head_dim)
    return jnp.einsum('btnh,nhd->btd', out, self.o_proj[...].astype(dt)), new_kv


def _attend(q: Array, k: Array, v: Array, mask: Array, head_dim: int) -> Array:
  """softmax(q k^T / sqrt(H) masked) v: q [B,T,K,G,H], k/v [B,S,K,H], mask bool [B,T,S] -> [B,T,K,G,H]."""
  scores = jnp.einsum('btkgh,bskh->bkgts', q, k, preferred_element_type=jnp.float32) * (head_dim ** -0.5)
  scores = jnp.where(mask[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  return jnp.einsum('bkgts,bskh->btkgh', probs, v)


class MLP(nnx.Module):
  """SwiGLU: (silu(x W_gate) * (x W_up)) W_down."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    pd = _dtype(cfg.param_dtype)
    self.gate_proj = _param(rngs.params(), (d, f), ('embed', 'mlp'), pd, stddev=d ** -0.5)
    self.up_proj = _param(rngs.params(), (d, f), ('embed', 'mlp'), pd, stddev=d ** -0.5)
    self.down_proj = _param(rngs.params(), (f, d), ('mlp', 'embed'), pd,
                            stddev=f ** -0.5 / (2 * cfg.num_layers) ** 0.5)

  def __call__(self, x: Array) -> Array:
    dt = x.dtype
    gate = jnp.einsum('btd,df->btf', x, self.gate_proj[...].astype(dt))
    up = jnp.einsum('btd,df->btf', x, self.up_proj[...].astype(dt))
    return jnp.einsum('btf,fd->btd', jax.nn.silu(gate) * up, self.down_proj[...].astype(dt))


class Embedder(nnx.Module):
  """Token embedding table E [V, D] ('vocab', 'embed'); also the tied lm head."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.embedding = _param(rngs.params(), (cfg.vocab_size, cfg.embed_dim), ('vocab', 'embed'),
                            _dtype(cfg.param_dtype), stddev=cfg.embed_dim ** -0.5)


class Block(nnx.Module):
  """Pre-norm decoder block: h += Attn(RMSNorm(h)); h += MLP(RMSNorm(h))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, h, cos, sin, mask, kv=None):
    a, new_kv = self.attn(self.attn_norm(h), cos, sin, mask, kv)
    h = h + a
    h = h + self.mlp(self.mlp_norm(h))
    return h, new_kv


# ---------------------------------------------------------------------------------------------------------
# Decoder.


def default_positions(attention_mask: Array | None, batch: int, length: int,
                      offset: Array | None = None) -> Array:
  """Positions of a chunk: `offset[b] + cumsum(mask[b]) - 1` (clipped at offset), or `offset + arange`."""
  if attention_mask is None:
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  else:
    pos = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
  if offset is not None:
    pos = pos + offset[:, None]
  return pos


class Decoder(nnx.Module):
  """Llama-family causal decoder (see the module docstring for the maths, params and KV-cache contract).

  Args:
    cfg: the model config.
    rngs: parameter initialisation randomness (`nnx.Rngs(params=seed)` or `nnx.Rngs(seed)`).
    lm_head: create the output projection (False for a value backbone with untied embeddings; `__call__`
      then cannot return logits, use `hidden`).
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lm_head: bool = True):
    self.cfg = cfg
    pd = _dtype(cfg.param_dtype)
    self.embed = Embedder(cfg, rngs=rngs)

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(r: nnx.Rngs) -> Block:
      return Block(cfg, rngs=r)

    self.layers = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.has_lm_head = lm_head
    if lm_head and not cfg.tie_embeddings:
      self.lm_head = _param(rngs.params(), (cfg.embed_dim, cfg.vocab_size), ('embed', 'vocab'), pd,
                            stddev=cfg.embed_dim ** -0.5)

  # ---- Public API.

  def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> KVCache:
    """An empty `KVCache` for this model (see `KVCache.init`)."""
    return KVCache.init(self.cfg, batch_size, max_len, dtype)

  def __call__(self, tokens: Array, *, positions: Array | None = None, attention_mask: Array | None = None,
               cache: KVCache | None = None, return_hidden: bool = False):
    """Runs the decoder.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] RoPE positions (default: see `default_positions`; with a cache, offset by
        `cache.next_pos`).
      attention_mask: bool[B, T], False on padding tokens (right- or left-padding). Without a cache,
        query t attends to keys s <= t with attention_mask[b, s]; with a cache, see the module docstring.
      cache: a `KVCache` to write this chunk into and attend over (prefill, decode or continuation).
      return_hidden: also return the final-norm hidden states [B, T, D] (compute dtype).

    Returns:
      Without cache: logits float32[B, T, V], or (logits, hidden) with return_hidden.
      With cache: (logits, new_cache), or (logits, hidden, new_cache) with return_hidden.
    """
    hidden, new_cache = self._forward(tokens, positions, attention_mask, cache)
    logits = self.logits_from_hidden(hidden)
    if cache is None:
      return (logits, hidden) if return_hidden else logits
    return (logits, hidden, new_cache) if return_hidden else (logits, new_cache)

  def hidden(self, tokens: Array, *, positions: Array | None = None,
             attention_mask: Array | None = None) -> Array:
    """Final-norm hidden states [B, T, D] (compute dtype), without the lm head."""
    return self._forward(tokens, positions, attention_mask, None)[0]

  def unembedding(self) -> tuple[Array, str]:
    """The lm-head weight and its einsum layout: (E [V, D], 'vd') when tied, else (W [D, V], 'dv')."""
    if self.cfg.tie_embeddings:
      return self.embed.embedding[...], 'vd'
    if not self.has_lm_head:
      raise ValueError('This Decoder was built with lm_head=False and has untied embeddings: no logits.')
    return self.lm_head[...], 'dv'

  def logits_from_hidden(self, hidden: Array) -> Array:
    """logits[b, t, v] = hidden[b, t] . W_out[:, v] in float32 ([..., D] -> [..., V])."""
    w, layout = self.unembedding()
    return project_to_vocab(hidden, w, layout)

  # ---- Internals.

  def _forward(self, tokens: Array, positions: Array | None, attention_mask: Array | None,
               cache: KVCache | None) -> tuple[Array, KVCache | None]:
    cfg = self.cfg
    chex.assert_rank(tokens, 2)
    b, t = tokens.shape
    if attention_mask is not None:
      chex.assert_shape(attention_mask, (b, t))
      attention_mask = attention_mask.astype(bool)
    if positions is None:
      positions = default_positions(attention_mask, b, t, None if cache is None else cache.next_pos)
    chex.assert_shape(positions, (b, t))
    positions = positions.astype(jnp.int32)
    dt = _dtype(cfg.dtype)
    h = jnp.take(self.embed.embedding[...], tokens, axis=0).astype(dt)
    cos, sin = rope_tables(positions, rope_inv_freq(cfg))

    if cache is None:
      mask = jnp.tril(jnp.ones((t, t), bool))[None]
      if attention_mask is not None:
        mask = mask & attention_mask[:, None, :]
      mask = jnp.broadcast_to(mask, (b, t, t))
      new_cache = None
      h = self._run_layers(h, cos, sin, mask, None)
    else:
      if cache.batch_size != b:
        raise ValueError(f'cache batch size {cache.batch_size} != tokens batch size {b}.')
      valid = jnp.ones((b, t), bool) if attention_mask is None else attention_mask
      chunk_pos = jnp.where(valid, positions, EMPTY_POS)
      slot_pos = jax.lax.dynamic_update_slice(cache.pos, chunk_pos, (jnp.zeros((), jnp.int32), cache.end))
      mask = slot_pos[:, None, :] <= positions[:, :, None]  # [B, T, S]: causal + padding + empty slots.
      h, k_all, v_all = self._run_layers(h, cos, sin, mask, (cache.k, cache.v, cache.end))
      last_pos = jnp.max(jnp.where(valid, positions, -1), axis=-1)
      new_cache = KVCache(k=k_all, v=v_all, pos=slot_pos, end=cache.end + t,
                          next_pos=jnp.maximum(cache.next_pos, last_pos + 1))
    return self.final_norm(h), new_cache

  def _run_layers(self, h, cos, sin, mask, kv):
    """Applies the L stacked blocks (scan or unrolled) -> h, or (h, k_cache, v_cache) with
    kv=(k_cache, v_cache, start) (each block writes its keys/values at slots start...)."""
    cfg = self.cfg
    graphdef, params = nnx.split(self.layers)

    def body(carry, xs):
      layer_params, layer = xs
      block = nnx.merge(graphdef, layer_params)
      if kv is None:
        h, _ = block(carry, cos, sin, mask)
        return h, None
      h, k_cache, v_cache = carry
      h, (k_cache, v_cache) = block(h, cos, sin, mask, (k_cache, v_cache, layer, kv[2]))
      return (h, k_cache, v_cache), None

    if cfg.remat and kv is None:
      body = jax.checkpoint(body, prevent_cse=not cfg.scan_layers)
    carry = h if kv is None else (h, kv[0], kv[1])
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    if cfg.scan_layers:
      carry, _ = jax.lax.scan(body, carry, (params, layers))
    else:
      for i in range(cfg.num_layers):
        carry, _ = body(carry, (jax.tree.map(lambda x, i=i: x[i], params), i))
    return carry


def project_to_vocab(hidden: Array, w: Array, layout: str) -> Array:
  """Float32 logits from hidden [..., D] and the unembedding `w` ('vd': [V, D], 'dv': [D, V])."""
  w = w.astype(hidden.dtype)
  eq = '...d,vd->...v' if layout == 'vd' else '...d,dv->...v'
  return jnp.einsum(eq, hidden, w, preferred_element_type=jnp.float32)


def count_params(model: nnx.Module) -> int:
  """Number of scalars in the model's nnx.Params."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
