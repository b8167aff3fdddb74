"""Batched KV-cache sampler: jitted prefill + a jitted `lax.while_loop` decode, multi-turn continuation.

What the actor runs. One `Sampler` holds decode-ready copies of a `Decoder`'s weights and two kinds of jitted
programs:

* **chunk prefill** `(weights, cache, chunk[B, T]) -> (first token, cache)`: writes a left-padded chunk of
  tokens into the cache and samples the next token from the chunk's last position. It serves both the prompt
  of a new episode and a continuation chunk (the previous turn's last generated token followed by the
  observation tokens of a multi-turn episode), so continuing never re-runs the history;
* **decode** `(weights, cache, ...) -> (tokens[B, N], logprobs, ...)`: a `lax.while_loop` that feeds one
  token per row per step and stops when every row has produced a stop token or used its budget. No host
  sync happens inside; the cache is donated and updated in place.

Cache layout (`DecodeCache`): keys/values are one `[B, K, S, H]` array per layer (a tuple, so the per-step
write is an in-place `dynamic_update_slice` at a *scalar* slot shared by all rows and attention is a plain
batched matmul over `(b, k)`), `valid: bool[B, S]` marks slots holding a real token of the row (left padding,
padding inside a continuation chunk and the steps of rows that already finished are holes), `index` is the
next slot to write and `positions[b]` the RoPE position of the row's next token (slot != position).
The query of a token in slot `i` attends to slots `s <= i` with `valid[b, s]`.

Why not `Decoder.__call__(..., cache=KVCache)`: that path writes per-row offsets (a scatter into the stacked
`[L, B, S, K, H]` cache) inside a `lax.scan` over layers, which XLA:CPU executes by copying the cache per
layer; it was ~50x slower per decode step on SmolLM2-135M. This module computes the *same function* (same
weights, RoPE tables and norms from `sao_jax.models.llama`) in a decode-shaped graph: fused q|k|v and
gate|up matmuls, per-layer weights pre-split (no slicing of stacked weights per step), the lm head in
`[D, V]` layout and only at the positions that are sampled. Tests check it against the Decoder's plain
forward pass (log-probs of the finished sequences, greedy generations).

Shapes are bucketed so that a run compiles a handful of programs: prompt / chunk lengths go up to the next
of `prompt_buckets` (or a power of two), the number of new tokens to a power of two (>= `min_new_bucket`),
the batch to a power of two (padding rows generate nothing) and the cache length S = prompt bucket + new
token bucket (grown to a power of two if a continuation needs more room). `Sampler.num_compiled()` counts
the compiled programs.

Token alignment of the outputs: `tokens[b, j]` is the j-th generated token of row b, `logprobs[b, j] =
log pi(tokens[b, j] | prefix)` under the policy at temperature 1 and `sampling_logprobs[b, j]` the
log-probability under the distribution actually sampled from (`sampling.select_tokens`); entries at
`j >= lengths[b]` are `pad_id` / 0.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Any, Sequence

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx

from sao_jax.models import sampling
from sao_jax.models.config import ModelConfig
from sao_jax.models.llama import apply_rope, rope_inv_freq, rope_tables
from sao_jax.models.sampling import SamplingParams

Array = jax.Array
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # Finite "-inf": fully masked rows stay NaN-free.


class StopReason(enum.IntEnum):
  """Why a row stopped generating."""
  NOT_DONE = 0  # Still running (never returned by `generate`).
  STOP_TOKEN = 1  # Produced one of the stop tokens (it is the row's last generated token).
  BUDGET = 2  # Used its budget of new tokens (or had a budget of 0).


# ---------------------------------------------------------------------------------------------------------
# Decode-ready weights and the cache.


@flax.struct.dataclass
class LayerWeights:
  """One decoder block's weights in decode layout (compute dtype)."""
  attn_norm: Array  # [D, 1]
  wqkv: Array  # [(N + 2K) H, D]: q | k | v projections fused, [out, in].
  bqkv: Array | None  # [(N + 2K) H, 1] (qkv_bias) or None.
  q_norm: Array | None  # [H] (qk_norm) or None.
  k_norm: Array | None  # [H]
  wo: Array  # [D, N H]
  mlp_norm: Array  # [D, 1]
  w_gate_up: Array  # [2F, D]: gate | up fused.
  w_down: Array  # [D, F]


@flax.struct.dataclass
class DecodeWeights:
  """All weights of a Decoder, re-laid-out for decoding (see module docstring)."""
  embed: Array  # [V, D] input embedding table.
  layers: tuple[LayerWeights, ...]
  final_norm: Array  # [D, 1]
  unembed: Array  # [V, D] lm head (the embedding table itself when tied).


@flax.struct.dataclass
class DecodeCache:
  """Per-layer KV cache with a shared write slot (see the module docstring).

  Attributes:
    k: per layer `[B, K, S, H]` keys (after RoPE).
    v: per layer `[B, K, S, H]` values.
    valid: bool `[B, S]`, True where the slot holds a real token of the row.
    index: int32 scalar, next slot to write (the same for every row).
    positions: int32 `[B]`, RoPE position of each row's next token (= number of real tokens so far).
  """
  k: tuple[Array, ...]
  v: tuple[Array, ...]
  valid: Array
  index: Array
  positions: Array

  @property
  def batch_size(self) -> int:
    return self.valid.shape[0]

  @property
  def max_len(self) -> int:
    return self.valid.shape[1]


def _rms_norm(x: Array, scale: Array, eps: float, axis: int = -1) -> Array:
  """x / sqrt(mean(x^2, axis) + eps) * scale in float32, cast back (as `llama.RMSNorm`)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


def decode_weights(model: nnx.Module) -> DecodeWeights:
  """Re-lays-out a `Decoder`'s parameters for decoding (run under jit by `Sampler.update_weights`)."""
  cfg: ModelConfig = model.cfg
  dt = jnp.dtype(cfg.dtype)
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  blocks = model.layers
  attn, mlp = blocks.attn, blocks.mlp
  cast = lambda x: x.astype(dt)
  layers = []
  for i in range(cfg.num_layers):
    wqkv = jnp.concatenate([attn.q_proj.value[i].reshape(d, n * h), attn.k_proj.value[i].reshape(d, k * h),
                            attn.v_proj.value[i].reshape(d, k * h)], axis=1).T
    bqkv = None
    if cfg.qkv_bias:
      bqkv = cast(jnp.concatenate([attn.q_bias.value[i].reshape(-1), attn.k_bias.value[i].reshape(-1),
                                   attn.v_bias.value[i].reshape(-1)])[:, None])
    layers.append(LayerWeights(
        attn_norm=blocks.attn_norm.scale.value[i][:, None],
        wqkv=cast(wqkv), bqkv=bqkv,
        q_norm=attn.q_norm.scale.value[i] if cfg.qk_norm else None,
        k_norm=attn.k_norm.scale.value[i] if cfg.qk_norm else None,
        wo=cast(attn.o_proj.value[i].reshape(n * h, d).T),
        mlp_norm=blocks.mlp_norm.scale.value[i][:, None],
        w_gate_up=cast(jnp.concatenate([mlp.gate_proj.value[i], mlp.up_proj.value[i]], axis=1).T),
        w_down=cast(mlp.down_proj.value[i].T)))
  w, layout = model.unembedding()
  unembed = w if layout == 'vd' else w.T
  return DecodeWeights(embed=cast(model.embed.embedding.value), layers=tuple(layers),
                       final_norm=model.final_norm.scale.value[:, None], unembed=cast(unembed))


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int) -> DecodeCache:
  """An empty cache: `batch_size` rows of `max_len` slots (compute dtype)."""
  shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
  dt = jnp.dtype(cfg.dtype)
  return DecodeCache(
      k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
      v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
      valid=jnp.zeros((batch_size, max_len), bool), index=jnp.zeros((), jnp.int32),
      positions=jnp.zeros((batch_size,), jnp.int32))


def _grow_cache(cache: DecodeCache, max_len: int) -> DecodeCache:
  """The same cache with `max_len` slots (new slots empty)."""
  pad = max_len - cache.max_len
  grow = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
  return cache.replace(k=tuple(map(grow, cache.k)), v=tuple(map(grow, cache.v)),
                       valid=jnp.pad(cache.valid, ((0, 0), (0, pad))))


def forward_chunk(cfg: ModelConfig, weights: DecodeWeights, cache: DecodeCache, tokens: Array,
                  chunk_valid: Array, window: int | None = None) -> tuple[Array, DecodeCache]:
  """Runs a chunk through the decoder, writing it into slots `[index, index + T)` of the cache.

  Positions: `positions[b] + cumsum(chunk_valid[b]) - 1` on the real tokens. Token t of the chunk attends to
  cache slots `s <= index + t` that are valid.

  Args:
    cfg: model config (static).
    weights: decode weights.
    cache: the cache; needs `index + T <= S` (the caller guarantees it).
    tokens: int32 `[B, T]`.
    chunk_valid: bool `[B, T]`, False on padding.
    window: static; attend only over slots `[0, window)` (the caller guarantees `index + T <= window`). A
      cache preallocated for a long episode then costs attention over the filled part only.

  Returns:
    `(hidden [D, B] (transposed) of the chunk's last position after the final norm, new cache)`.
  """
  b, t = tokens.shape
  n, kh, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  s = cache.max_len
  dt = jnp.dtype(cfg.dtype)
  positions = cache.positions[:, None] + jnp.cumsum(chunk_valid.astype(jnp.int32), axis=1) - 1
  positions = jnp.maximum(positions, 0)
  cos, sin = rope_tables(positions, rope_inv_freq(cfg))
  valid = jax.lax.dynamic_update_slice(cache.valid, chunk_valid, (0, cache.index))
  slots = jnp.arange(s, dtype=jnp.int32)
  query_slots = cache.index + jnp.arange(t, dtype=jnp.int32)
  mask = valid[:, None, :] & (slots[None, None, :] <= query_slots[None, :, None])  # [B, T, S]
  window = s if window is None else min(window, s)
  mask = mask[:, None, None, :, :window]  # [B, 1, 1, T, W]
  # Orientation of the activations (static, by M = B * T). 'col': kept transposed, x [D, M], every weight
  # matmul is W[out, in] @ x; 'row': x [M, D], x @ W^T. On XLA:CPU (2 cores, SmolLM2) 'col' is the fastest for
  # M = 1 and M >= 8 (~1.4x over 'row' at M = 8 and 32) but ~2.5x slower for M = 2..4, where 'row' wins.
  m = b * t
  col = not 2 <= m < 8
  f = cfg.mlp_dim
  if col:
    proj = lambda w, x: w @ x
    take = lambda x, lo, hi: x[lo:hi]
    vec = lambda v: v  # [E, 1] column vectors broadcast over M.
    heads = lambda y, c: y.reshape(c, h, b, t).transpose(2, 3, 0, 1)  # [c H, M] -> [B, T, c, H]
    att_eq, att_shape = 'bkgts,bksh->kghbt', (n * h, m)
  else:
    proj = lambda w, x: jnp.einsum('mi,oi->mo', x, w)
    take = lambda x, lo, hi: x[:, lo:hi]
    vec = lambda v: v.reshape(-1)
    heads = lambda y, c: y.reshape(b, t, c, h)  # [M, c H] -> [B, T, c, H]
    att_eq, att_shape = 'bkgts,bksh->btkgh', (m, n * h)
  axis = 0 if col else -1
  x = jnp.take(weights.embed, tokens.reshape(m), axis=0).astype(dt)
  if col:
    x = x.T
  new_k, new_v = [], []
  for i, lw in enumerate(weights.layers):
    y = _rms_norm(x, vec(lw.attn_norm), cfg.norm_eps, axis=axis)
    qkv = proj(lw.wqkv, y)
    if lw.bqkv is not None:
      qkv = qkv + vec(lw.bqkv)
    q = heads(take(qkv, 0, n * h), n)
    k = heads(take(qkv, n * h, (n + kh) * h), kh)
    v = heads(take(qkv, (n + kh) * h, (n + 2 * kh) * h), kh)
    if lw.q_norm is not None:
      q, k = _rms_norm(q, lw.q_norm, cfg.norm_eps), _rms_norm(k, lw.k_norm, cfg.norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = jax.lax.dynamic_update_slice(cache.k[i], k.transpose(0, 2, 1, 3).astype(cache.k[i].dtype),
                                           (0, 0, cache.index, 0))
    v_cache = jax.lax.dynamic_update_slice(cache.v[i], v.transpose(0, 2, 1, 3).astype(cache.v[i].dtype),
                                           (0, 0, cache.index, 0))
    new_k.append(k_cache)
    new_v.append(v_cache)
    q = q.reshape(b, t, kh, g, h)
    k_att, v_att = (k_cache, v_cache) if window == s else (k_cache[:, :, :window], v_cache[:, :, :window])
    scores = jnp.einsum('btkgh,bksh->bkgts', q, k_att.astype(dt), preferred_element_type=jnp.float32)
    scores = jnp.where(mask, scores * (h ** -0.5), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    att = jnp.einsum(att_eq, probs, v_att.astype(dt)).reshape(att_shape)
    x = x + proj(lw.wo, att)
    y = _rms_norm(x, vec(lw.mlp_norm), cfg.norm_eps, axis=axis)
    gate_up = proj(lw.w_gate_up, y)
    x = x + proj(lw.w_down, jax.nn.silu(take(gate_up, 0, f)) * take(gate_up, f, 2 * f))
  last = x.reshape(-1, b, t)[:, :, -1] if col else x.reshape(b, t, -1)[:, -1].T  # [D, B]
  hidden = _rms_norm(last, weights.final_norm, cfg.norm_eps, axis=0)
  new_cache = DecodeCache(k=tuple(new_k), v=tuple(new_v), valid=valid, index=cache.index + t,
                          positions=cache.positions + jnp.sum(chunk_valid, axis=1, dtype=jnp.int32))
  return hidden, new_cache


def _logits(weights: DecodeWeights, hidden_t: Array) -> Array:
  """float32 [B, V] = (unembed [V, D] @ hidden_t [D, B])^T (the fast layout for a [V, D] table on CPU)."""
  return jnp.dot(weights.unembed, hidden_t.astype(weights.unembed.dtype), preferred_element_type=jnp.float32).T


# ---------------------------------------------------------------------------------------------------------
# Jitted programs (pure functions; `static` = hashable settings).


@dataclasses.dataclass(frozen=True)
class _Static:
  cfg: ModelConfig
  params: SamplingParams
  stop_ids: tuple[int, ...]
  pad_id: int
  window: int  # Attention window (slots) of this call's programs, see `forward_chunk`.


def _select(st: _Static, logits: Array, seeds: Array, key_pos: Array, n_generated: Array,
            min_new: Array) -> tuple[Array, Array, Array]:
  """`sampling.select_tokens` with the stop tokens banned for rows with n_generated < min_new."""
  banned = None
  if st.stop_ids:
    ban_row = n_generated < min_new  # [B]
    stop_cols = jnp.zeros((logits.shape[-1],), bool).at[jnp.asarray(st.stop_ids)].set(True)
    banned = ban_row[:, None] & stop_cols[None, :]
  # The ban is almost always off (min_new = 0): skip the [B, V] select when no row needs it.
  if banned is not None:
    return jax.lax.cond(
        jnp.any(ban_row),
        lambda: sampling.select_tokens(logits, seeds, key_pos, st.params, banned=banned),
        lambda: sampling.select_tokens(logits, seeds, key_pos, st.params))
  return sampling.select_tokens(logits, seeds, key_pos, st.params)


def _is_stop(st: _Static, tokens: Array) -> Array:
  if not st.stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[:, None] == jnp.asarray(st.stop_ids, jnp.int32)[None, :], axis=-1)


def _prefill_impl(st: _Static, weights: DecodeWeights, cache: DecodeCache, chunk: Array, chunk_valid: Array,
                  seeds: Array, budgets: Array, min_new: Array):
  """Writes the chunk, samples each row's first new token. Rows with budget 0 generate nothing."""
  hidden, cache = forward_chunk(st.cfg, weights, cache, chunk, chunk_valid, st.window)
  logits = _logits(weights, hidden)
  zeros = jnp.zeros_like(budgets)
  tok, lp, slp = _select(st, logits, seeds, cache.positions, zeros, min_new)
  active = budgets > 0
  stop = _is_stop(st, tok) & active
  reason = jnp.where(~active, int(StopReason.BUDGET),
                     jnp.where(stop, int(StopReason.STOP_TOKEN),
                               jnp.where(budgets <= 1, int(StopReason.BUDGET), int(StopReason.NOT_DONE))))
  tok = jnp.where(active, tok, st.pad_id)
  return cache, tok, jnp.where(active, lp, 0.0), jnp.where(active, slp, 0.0), reason.astype(jnp.int32)


def _decode_impl(st: _Static, num_steps: int, weights: DecodeWeights, cache: DecodeCache, first_tok: Array,
                 first_lp: Array, first_slp: Array, first_reason: Array, seeds: Array, budgets: Array,
                 min_new: Array):
  """The decode loop: up to `num_steps` tokens per row (column 0 comes from prefill)."""
  b = first_tok.shape[0]
  active = budgets > 0
  tokens = jnp.full((b, num_steps), st.pad_id, jnp.int32).at[:, 0].set(first_tok)
  lps = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(first_lp)
  slps = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(first_slp)
  lengths = active.astype(jnp.int32)
  done = first_reason != int(StopReason.NOT_DONE)

  def cond(carry):
    i, _, _, _, _, _, done, _, _ = carry
    return (i < num_steps) & ~jnp.all(done)

  def body(carry):
    i, cache, tokens, lps, slps, lengths, done, reason, last = carry
    hidden, cache = forward_chunk(st.cfg, weights, cache, last[:, None], ~done[:, None], st.window)
    logits = _logits(weights, hidden)
    tok, lp, slp = _select(st, logits, seeds, cache.positions, lengths, min_new)
    live = ~done
    tok = jnp.where(live, tok, st.pad_id)
    tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, i))
    lps = jax.lax.dynamic_update_slice(lps, jnp.where(live, lp, 0.0)[:, None], (0, i))
    slps = jax.lax.dynamic_update_slice(slps, jnp.where(live, slp, 0.0)[:, None], (0, i))
    lengths = lengths + live.astype(jnp.int32)
    stop = _is_stop(st, tok) & live
    out_of_budget = live & ~stop & (lengths >= budgets)
    reason = jnp.where(stop, int(StopReason.STOP_TOKEN), jnp.where(out_of_budget, int(StopReason.BUDGET), reason))
    last = jnp.where(live, tok, last)
    return i + 1, cache, tokens, lps, slps, lengths, done | stop | out_of_budget, reason, last

  carry = (jnp.ones((), jnp.int32), cache, tokens, lps, slps, lengths, done, first_reason, first_tok)
  _, cache, tokens, lps, slps, lengths, _, reason, last = jax.lax.while_loop(cond, body, carry)
  return cache, tokens, lps, slps, lengths, reason, last


# ---------------------------------------------------------------------------------------------------------
# Host API.


@dataclasses.dataclass
class EpisodeState:
  """What `Sampler.continue_generation` needs to extend an episode (device cache + host bookkeeping).

  Attributes:
    cache: the device cache (donated to the next call: do not reuse a state twice).
    seeds: uint32 `[Bp]` per-row seeds (padded batch).
    pending: int32 `[Bp]` the last generated token of each row; it is not in the cache yet.
    has_pending: bool `[Bp]`.
    batch_size: number of real rows.
  """
  cache: DecodeCache
  seeds: np.ndarray
  pending: np.ndarray
  has_pending: np.ndarray
  batch_size: int


@dataclasses.dataclass
class SampleOutput:
  """Result of one generation call (host numpy arrays, real rows only).

  Attributes:
    tokens: int32 `[B, N]` generated tokens (N = the new-token bucket), `pad_id` after `lengths[b]`.
    lengths: int32 `[B]` number of generated tokens (a stop token counts and is included).
    stop_reason: int32 `[B]` `StopReason` values.
    logprobs: float32 `[B, N]` log pi(token) under the policy at temperature 1; 0 after `lengths[b]`.
    sampling_logprobs: float32 `[B, N]` log-prob under the distribution sampled from (== logprobs when
      sampling at temperature 1 without top-p/top-k and without banned tokens).
    state: an `EpisodeState` to continue from (when requested), else None.
    timings: seconds spent in `prefill` and in `decode` (prefill is synchronised only when timing).
  """
  tokens: np.ndarray
  lengths: np.ndarray
  stop_reason: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  state: EpisodeState | None = None
  timings: dict[str, float] = dataclasses.field(default_factory=dict)

  def token_lists(self) -> list[list[int]]:
    """The generated tokens of each row as Python lists."""
    return [self.tokens[b, :self.lengths[b]].tolist() for b in range(len(self.lengths))]


def _next_pow2(x: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(0, int(x) - 1).bit_length())


class Sampler:
  """Batched generation with a preallocated KV cache (see the module docstring).

  Args:
    model: a `sao_jax.models.llama.Decoder` (its weights are copied into decode layout; call
      `update_weights` after the model changes).
    stop_ids: tokens that end a turn (default: `model.cfg.eos_ids`).
    pad_id: token written after a row's end (default: `model.cfg.pad_id`).
    prompt_buckets: allowed chunk lengths (prompts and continuation chunks are left-padded up to the next
      one); longer chunks use the next power of two. Default: powers of two >= 16.
    min_new_bucket: smallest new-token bucket (buckets are powers of two >= this).
    bucket_batch: pad the batch to a power of two (bounded compiles when batch sizes vary).
  """

  def __init__(self, model: nnx.Module, *, stop_ids: Sequence[int] | None = None, pad_id: int | None = None,
               prompt_buckets: Sequence[int] | None = None, min_new_bucket: int = 16,
               bucket_batch: bool = True):
    self.cfg: ModelConfig = model.cfg
    self.stop_ids = tuple(int(i) for i in (self.cfg.eos_ids if stop_ids is None else stop_ids))
    self.pad_id = int(self.cfg.pad_id if pad_id is None else pad_id)
    for name, ids in (('stop_ids', self.stop_ids), ('pad_id', (self.pad_id,))):
      bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
      if bad:
        raise ValueError(f'Sampler {name} {bad} outside the vocabulary [0, {self.cfg.vocab_size}).')
    self.prompt_buckets = tuple(sorted(int(x) for x in prompt_buckets)) if prompt_buckets else ()
    if any(x <= 0 for x in self.prompt_buckets):
      raise ValueError(f'Sampler prompt_buckets must be positive, got {prompt_buckets!r}.')
    if min_new_bucket <= 0:
      raise ValueError(f'Sampler min_new_bucket must be positive, got {min_new_bucket}.')
    self.min_new_bucket = int(min_new_bucket)
    self.bucket_batch = bucket_batch
    self._prepare = jax.jit(lambda graphdef, state: decode_weights(nnx.merge(graphdef, state)),
                            static_argnums=(0,))
    # jax.jit caches compiled programs per Python function object: wrap each function in a fresh partial so
    # that `num_compiled` counts this sampler's programs only.
    fresh = functools.partial
    self._init_cache = jax.jit(fresh(init_cache), static_argnums=(0, 1, 2))
    self._grow = jax.jit(fresh(_grow_cache), static_argnums=(1,), donate_argnums=(0,))
    self._prefill = jax.jit(fresh(_prefill_impl), static_argnums=(0,), donate_argnums=(2,))
    self._decode = jax.jit(fresh(_decode_impl), static_argnums=(0, 1), donate_argnums=(3,))
    self.weights: DecodeWeights | None = None
    self.update_weights(model)

  @classmethod
  def from_config(cls, model: nnx.Module, sampler_config: Any, **kwargs) -> Sampler:
    """A sampler with `config.sampler.prompt_buckets`."""
    return cls(model, prompt_buckets=tuple(sampler_config.prompt_buckets), **kwargs)

  def update_weights(self, model: nnx.Module) -> None:
    """Copies the (new) weights of `model` into decode layout (one jitted call; no recompile of sampling)."""
    if model.cfg != self.cfg:
      raise ValueError('Sampler.update_weights: the model config differs from the one the sampler was built for.')
    graphdef, state = nnx.split(model)
    self.weights = self._prepare(graphdef, state)

  def num_compiled(self) -> dict[str, int]:
    """Number of compiled programs per jitted function (prefill, decode, cache init/grow)."""
    return {'prefill': self._prefill._cache_size(), 'decode': self._decode._cache_size(),
            'init_cache': self._init_cache._cache_size(), 'grow_cache': self._grow._cache_size()}

  # ---- Bucketing.

  def chunk_bucket(self, length: int) -> int:
    """Padded length of a prompt / continuation chunk of `length` tokens."""
    for bucket in self.prompt_buckets:
      if length <= bucket:
        return bucket
    return _next_pow2(length, 16)

  def new_tokens_bucket(self, max_new_tokens: int) -> int:
    return _next_pow2(max_new_tokens, self.min_new_bucket)

  def batch_bucket(self, batch_size: int) -> int:
    return _next_pow2(batch_size) if self.bucket_batch else batch_size

  # ---- Generation.

  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
               params: SamplingParams = SamplingParams(), seeds: int | Sequence[int] = 0,
               min_new_tokens: int = 0, max_total_len: int | None = None, keep_state: bool = False,
               time_prefill: bool = False) -> SampleOutput:
    """Generates a continuation of each prompt.

    Args:
      prompts: B token-id lists (non-empty; lengths may differ: they are left-padded).
      max_new_tokens: budget of new tokens, one int or one per row (0 = the row generates nothing).
      params: temperature / top-p / top-k (`SamplingParams`; static, one compiled program per setting).
      seeds: one int (row b uses seed + b) or one per row. Same seed and logits -> same token.
      min_new_tokens: the stop tokens are banned until a row has this many new tokens.
      max_total_len: preallocate the cache for an episode of this many tokens (prompt + every turn), so
        continuations do not need to grow it. Default: prompt bucket + new-token bucket.
      keep_state: return an `EpisodeState` for `continue_generation`.
      time_prefill: synchronise after prefill and report `timings['prefill']` (benchmarks).

    Returns:
      A `SampleOutput`.
    """
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
      raise ValueError('generate: prompts is empty.')
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f'generate: prompt {i} is empty (a prompt needs at least one token).')
    b = len(prompts)
    bp = self.batch_bucket(b)
    budgets = self._budgets(max_new_tokens, b)
    t = self.chunk_bucket(max(len(p) for p in prompts))
    n = self.new_tokens_bucket(max(int(budgets.max()), 1))
    s = t + n
    if max_total_len is not None:
      s = max(s, _next_pow2(max_total_len))
    seeds_np = self._seeds(seeds, b, bp)
    cache = self._init_cache(self.cfg, bp, s)
    chunk, valid = self._left_pad(prompts, bp, t)
    return self._run(cache, chunk, valid, seeds_np, budgets, n, params, min_new_tokens, b, keep_state,
                     time_prefill, need=t + n)

  def continue_generation(self, state: EpisodeState, observations: Sequence[Sequence[int] | None], *,
                          max_new_tokens: int | Sequence[int], params: SamplingParams = SamplingParams(),
                          min_new_tokens: int = 0, keep_state: bool = False,
                          time_prefill: bool = False) -> SampleOutput:
    """Continues an episode: appends each row's observation tokens and generates the next turn.

    The previous turn's last generated token (not yet in the cache) and the observation tokens are written
    into the existing cache as one chunk; the history is not recomputed. A row whose observation is None
    takes no part (nothing is written, it generates nothing, its pending token stays pending).

    Args:
      state: the `EpisodeState` returned by the previous call (its cache is donated: do not reuse it).
      observations: one token list (may be empty) or None per row.
      max_new_tokens, params, min_new_tokens, keep_state, time_prefill: as in `generate`.
    """
    b = state.batch_size
    if len(observations) != b:
      raise ValueError(f'continue_generation: got {len(observations)} observations for a batch of {b}.')
    bp = state.cache.batch_size
    active = np.zeros((bp,), bool)
    chunks: list[list[int]] = [[] for _ in range(bp)]
    for i, obs in enumerate(observations):
      if obs is None:
        continue
      active[i] = True
      chunks[i] = ([int(state.pending[i])] if state.has_pending[i] else []) + [int(x) for x in obs]
    budgets = self._budgets(max_new_tokens, b)
    budgets[:b] = np.where(active[:b], budgets[:b], 0)
    empty_active = [i for i in range(b) if active[i] and not chunks[i] and budgets[i] > 0]
    if empty_active:
      raise ValueError(f'continue_generation: rows {empty_active} have nothing to condition on (no pending '
                       'token and an empty observation).')
    t = self.chunk_bucket(max(1, max(len(c) for c in chunks)))
    n = self.new_tokens_bucket(max(int(budgets.max()), 1))
    cache = state.cache
    need = int(jax.device_get(cache.index)) + t + n
    if need > cache.max_len:
      cache = self._grow(cache, _next_pow2(need))
    chunk, valid = self._left_pad(chunks, bp, t)
    out = self._run(cache, chunk, valid, state.seeds, budgets, n, params, min_new_tokens, b, keep_state,
                    time_prefill, need=need)
    if out.state is not None:  # Rows that took no part keep their pending token.
      keep = ~active
      out.state.pending = np.where(keep, state.pending, out.state.pending)
      out.state.has_pending = np.where(keep, state.has_pending, out.state.has_pending)
    return out

  # ---- Internals.

  def _budgets(self, max_new_tokens: int | Sequence[int], b: int) -> np.ndarray:
    bp = self.batch_bucket(b)
    if np.ndim(max_new_tokens) == 0:
      per_row = np.full((b,), int(max_new_tokens), np.int32)
    else:
      per_row = np.asarray(max_new_tokens, np.int32)
      if per_row.shape != (b,):
        raise ValueError(f'max_new_tokens has shape {per_row.shape}, expected ({b},) or a scalar.')
    if (per_row < 0).any():
      raise ValueError(f'max_new_tokens must be >= 0, got {per_row.tolist()}.')
    out = np.zeros((bp,), np.int32)
    out[:b] = per_row
    return out

  @staticmethod
  def _seeds(seeds: int | Sequence[int], b: int, bp: int) -> np.ndarray:
    if np.ndim(seeds) == 0:
      per_row = int(seeds) + np.arange(b)
    else:
      per_row = np.asarray(seeds, np.int64)
      if per_row.shape != (b,):
        raise ValueError(f'seeds has shape {per_row.shape}, expected ({b},) or a scalar.')
    out = np.zeros((bp,), np.uint32)
    out[:b] = (per_row % (1 << 32)).astype(np.uint32)
    return out

  def _left_pad(self, chunks: Sequence[Sequence[int]], bp: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((bp, t), self.pad_id, np.int32)
    valid = np.zeros((bp, t), bool)
    for i, c in enumerate(chunks):
      if c:
        tokens[i, t - len(c):] = c
        valid[i, t - len(c):] = True
    return tokens, valid

  def _run(self, cache, chunk, valid, seeds, budgets, n, params, min_new_tokens, b, keep_state, time_prefill,
           need):
    # Attention window: the slots this call can fill, bucketed (a power of two), at most the cache length.
    window = min(cache.max_len, _next_pow2(need, 32))
    st = _Static(self.cfg, params, self.stop_ids, self.pad_id, window)
    min_new = jnp.asarray(min_new_tokens, jnp.int32)
    seeds_d, budgets_d = jnp.asarray(seeds), jnp.asarray(budgets)
    t0 = time.perf_counter()
    cache, tok, lp, slp, reason = self._prefill(st, self.weights, cache, jnp.asarray(chunk), jnp.asarray(valid),
                                                seeds_d, budgets_d, min_new)
    timings = {}
    if time_prefill:
      jax.block_until_ready(tok)
      timings['prefill'] = time.perf_counter() - t0
    t1 = time.perf_counter()
    cache, tokens, lps, slps, lengths, reason, last = self._decode(
        st, n, self.weights, cache, tok, lp, slp, reason, seeds_d, budgets_d, min_new)
    tokens, lps, slps, lengths, reason, last = jax.device_get((tokens, lps, slps, lengths, reason, last))
    timings['decode'] = time.perf_counter() - t1
    timings['total'] = time.perf_counter() - t0
    state = None
    if keep_state:
      state = EpisodeState(cache=cache, seeds=seeds, pending=np.asarray(last, np.int32),
                           has_pending=np.asarray(lengths) > 0, batch_size=b)
    return SampleOutput(tokens=np.asarray(tokens[:b]), lengths=np.asarray(lengths[:b]),
                        stop_reason=np.asarray(reason[:b]), logprobs=np.asarray(lps[:b]),
                        sampling_logprobs=np.asarray(slps[:b]), state=state, timings=timings)
