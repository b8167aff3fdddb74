"""The KV-cache forward pass of a `Decoder`: prefill, single-token decode and continuation chunks.

The one implementation of the cached forward pass: `Decoder.__call__(..., cache=...)` and the generation engines
(`sao_jax.generate`) run it. It computes the same function as the Decoder's plain forward pass (same RoPE tables,
norms and casting order; tests compare the two) in a graph shaped for decoding:

* `DecodeWeights` (`decode_weights`, once per weight update): q|k|v and gate|up fused, every matmul weight
  `[out, in]`, one entry per layer, the lm head a `[V, D]` table;
* activations transposed, `x [D, M]` with `M = B * T`, every projection `W[out, in] @ x` (for 2 <= M < 8 the row
  orientation `x @ W`, faster there on XLA:CPU: docs/benchmarks/sampler.md);
* `DecodeCache`: per layer, keys slot-minor `[B, K, H, S]` and values `[B, K, S, H]` (single-token attention is
  two fused multiply-reduce passes on a CPU, two dots elsewhere: `attention_for`; chunks of T > 1 tokens use
  batched matmuls). The chunk is written at one slot
  `index` for all rows (an in-place `dynamic_update_slice`), or, in a slot-major cache
  (`init_cache(..., per_row_index=True)`, `sao_jax.generate.slots`'), at one slot per row (`index [B]`);
* `window`: a static bound on the slots attention reads (a long preallocated cache costs its filled part only);
* an MoE layer (`LayerWeights.moe`) keeps its router and experts in model layout and runs `moe.moe_mlp` on the rows
  `[M, D]` (the same function as the plain forward's); its attention and the KV cache are a dense layer's.

Cache semantics. `valid[b, s]` marks slots that hold a real token of row b; left padding, padding inside a
continuation chunk and the decode steps of rows that already finished are holes. Token t of a chunk written
at slots `[index, index + T)` attends to the slots `s <= index + t` with `valid[b, s]` (causal by slot).
`positions[b]` is the RoPE position of row b's next token: the chunk's real tokens get
`positions[b] + 0, 1, ...` in order (slot != position in general), unless positions are given explicitly;
afterwards `positions[b]` is one past the largest position written for the row (unchanged for a row whose
chunk is entirely padding).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import lora
from sao_jax.models import moe as moe_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import apply_rope, default_positions, rms_norm, rope_inv_freq, rope_tables

Array = jax.Array
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # Finite "-inf": fully masked rows stay NaN-free.
# A chunk's attention over the cache goes in key blocks (an online softmax) once T x W passes this many scores:
# a 1024-token prompt against its own 1024 slots stays one dense pass, a continuation against 32k slots does not.
PREFILL_DENSE_SCORES = 1024 * 4096
PREFILL_KEY_BLOCK = 2048


# ---------------------------------------------------------------------------------------------------------
# Weights and cache.


@flax.struct.dataclass
class LayerWeights:
  """One decoder block's weights in decode layout (compute dtype; norm scales float32)."""
  attn_norm: Array  # [D, 1]
  wqkv: Array  # [(N + 2K) H, D]: q | k | v projections fused, [out, in].
  bqkv: Array | None  # [(N + 2K) H, 1] (qkv_bias) or None.
  q_norm: Array | None  # [H] (qk_norm) or None.
  k_norm: Array | None  # [H]
  wo: Array  # [D, N H]
  mlp_norm: Array  # [D, 1]
  w_gate_up: Array | None  # [2F, D]: gate | up fused (None in an MoE layer).
  w_down: Array | None  # [D, F]
  moe: dict[str, Array] | None = None  # An MoE layer's `moe.PARAM_NAMES` in model layout (compute dtype; the
  # router and its bias float32), run by `moe.moe_mlp` on the rows; None in a dense layer.


@flax.struct.dataclass
class DecodeWeights:
  """All weights of a Decoder, re-laid-out for the cached forward pass (module docstring)."""
  embed: Array  # [V, D] input embedding table.
  layers: tuple[LayerWeights, ...]
  final_norm: Array  # [D, 1]
  unembed: Array  # [V, D] lm head (the embedding table itself when tied).


@flax.struct.dataclass
class DecodeCache:
  """Per-layer KV cache with a shared write slot (see the module docstring for the semantics).

  Attributes:
    k: per layer `[B, K, H, S]` keys after RoPE (slot-minor).
    v: per layer `[B, K, S, H]` values.
    valid: bool `[B, S]`, True where the slot holds a real token of the row.
    index: int32 scalar, the next slot to write (the same for every row), or int32 `[B]`, one per row (a
      slot-major cache whose rows are independent sequences, e.g. continuous batching).
    positions: int32 `[B]`, the RoPE position of each row's next token.
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

  @property
  def dtype(self) -> Any:
    return self.k[0].dtype


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype: Any = None, *,
               per_row_index: bool = False) -> DecodeCache:
  """An empty cache of `batch_size` rows and `max_len` slots, in `dtype` (default: compute dtype); with
  `per_row_index`, every row has its own write slot (`index [B]`)."""
  dt = jnp.dtype(cfg.dtype if dtype is None else dtype)
  b, k, h = batch_size, cfg.num_kv_heads, cfg.head_dim
  return DecodeCache(
      k=tuple(jnp.zeros((b, k, h, max_len), dt) for _ in range(cfg.num_layers)),
      v=tuple(jnp.zeros((b, k, max_len, h), dt) for _ in range(cfg.num_layers)),
      valid=jnp.zeros((b, max_len), bool), index=jnp.zeros((b,) if per_row_index else (), jnp.int32),
      positions=jnp.zeros((b,), jnp.int32))


def resize_cache(cache: DecodeCache, max_len: int) -> DecodeCache:
  """The same cache with `max_len` slots: new slots are empty; cutting drops the slots >= max_len (the
  caller guarantees they are empty, i.e. `index <= max_len`)."""
  pad = max_len - cache.max_len
  if pad == 0:
    return cache
  if pad < 0:
    return cache.replace(k=tuple(x[..., :max_len] for x in cache.k), v=tuple(x[:, :, :max_len] for x in cache.v),
                         valid=cache.valid[:, :max_len])
  grow_k = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, pad)))
  grow_v = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0)))
  return cache.replace(k=tuple(map(grow_k, cache.k)), v=tuple(map(grow_v, cache.v)),
                       valid=jnp.pad(cache.valid, ((0, 0), (0, pad))))


# Where `decode_layer` and `decode_outer` find a `Decoder`'s parameters in its state (optional ones may be absent).
LAYER_PATHS = dict(
    attn_norm=('layers', 'attn_norm', 'scale'), q_proj=('layers', 'attn', 'q_proj'),
    k_proj=('layers', 'attn', 'k_proj'), v_proj=('layers', 'attn', 'v_proj'), o_proj=('layers', 'attn', 'o_proj'),
    q_bias=('layers', 'attn', 'q_bias'), k_bias=('layers', 'attn', 'k_bias'), v_bias=('layers', 'attn', 'v_bias'),
    q_norm=('layers', 'attn', 'q_norm', 'scale'), k_norm=('layers', 'attn', 'k_norm', 'scale'),
    mlp_norm=('layers', 'mlp_norm', 'scale'), gate_proj=('layers', 'mlp', 'gate_proj'),
    up_proj=('layers', 'mlp', 'up_proj'), down_proj=('layers', 'mlp', 'down_proj'),
    # LoRA adapters (`lora`), merged into their weights by `decode_layer`.
    **{f'{t}_lora_{ab}': ('layers', lora.HOLDER[t], lora.suffix(t), ab) for t in lora.TARGETS for ab in 'ab'})
OUTER_PATHS = dict(embed=('embed', 'embedding'), final_norm=('final_norm', 'scale'), lm_head=('lm_head',))
# The MoE stack's (`moe_layers`): attention and norms as `LAYER_PATHS`, the MLP's `moe.PARAM_NAMES` under `moe`.
MOE_LAYER_PATHS = dict(
    {name: ('moe_layers',) + path[1:] for name, path in LAYER_PATHS.items()
     if path[1] != 'mlp' and 'lora' not in name},
    **{name: ('moe_layers', 'moe', name) for name in moe_lib.PARAM_NAMES})


def named_params(state: nnx.State, paths: dict[str, tuple[str, ...]]) -> dict[str, Any]:
  """The values of `state`'s variables at `paths` (`LAYER_PATHS`, `OUTER_PATHS`), by name; absent ones left out.
  Values are whatever the variables hold: arrays, `jax.ShapeDtypeStruct`s, shardings."""
  flat = {tuple(str(k) for k in path): v for path, v in state.flat_state()}
  return {name: flat[path].get_value() for name, path in paths.items() if path in flat}


def layer_params(model: nnx.Module) -> dict[str, Array]:
  """A `Decoder`'s per-layer parameters by name, stacked `[L, ...]` (`decode_layer` reads one layer of each): its
  dense stack `layers` (an MoE model's first `first_k_dense` layers; empty if it has none)."""
  return named_params(nnx.state(model), LAYER_PATHS)


def moe_layer_params(model: nnx.Module) -> dict[str, Array]:
  """An MoE `Decoder`'s MoE stack (`moe_layers`) by name, stacked `[L_moe, ...]` (empty for a dense model)."""
  return named_params(nnx.state(model), MOE_LAYER_PATHS)


def outer_params(model: nnx.Module) -> dict[str, Array]:
  """A `Decoder`'s parameters outside its layers (what `decode_outer` reads): `embed` [V, D], `final_norm` [D] and,
  untied, `lm_head` [D, V]."""
  return named_params(nnx.state(model), OUTER_PATHS)  # A tied Decoder has no lm_head.


def is_norm(name: str) -> bool:
  """Whether parameter `name` (of `layer_params` / `outer_params`) keeps its dtype in decode layout (norm scales)."""
  return name.endswith('norm')


def fused_matmuls(cfg: ModelConfig, p: dict[str, Array]) -> dict[str, Array]:
  """`LayerWeights`' matmul fields from one layer's projections (q/k/v/o_proj, gate/up/down_proj in their model
  layout), fused and transposed to `[out, in]`, not cast: wqkv, wo, w_gate_up, w_down. Linear in the projections."""
  d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  out = dict(wqkv=jnp.concatenate([p['q_proj'].reshape(d, n * h), p['k_proj'].reshape(d, k * h),
                                   p['v_proj'].reshape(d, k * h)], axis=1).T,
             wo=p['o_proj'].reshape(n * h, d).T)
  if 'router' not in p:  # A dense layer's MLP (an MoE layer's experts stay in model layout: `decode_layer`).
    out.update(w_gate_up=jnp.concatenate([p['gate_proj'], p['up_proj']], axis=1).T, w_down=p['down_proj'].T)
  return out


def decode_layer(cfg: ModelConfig, p: dict[str, Array]) -> LayerWeights:
  """One layer's decode-layout weights from its parameters (`layer_params` without the `L` axis): LoRA adapters
  merged into their weights (W + s A B), matmul weights and biases cast to the compute dtype, fused and transposed;
  norm scales as they are."""
  p = dict(p)
  for target in cfg.lora_targets if cfg.lora_rank else ():
    p[target] = lora.merged_weight(p[target], p.pop(f'{target}_lora_a'), p.pop(f'{target}_lora_b'), cfg.lora_scale)
  dt = jnp.dtype(cfg.dtype)
  cast = lambda x: x.astype(dt)
  bqkv = None
  if cfg.qkv_bias:
    bqkv = cast(jnp.concatenate([p['q_bias'].reshape(-1), p['k_bias'].reshape(-1), p['v_bias'].reshape(-1)])[:, None])
  experts = None
  if 'router' in p:  # An MoE layer: router (and bias) float32, experts in model layout cast.
    experts = {name: (p[name].astype(jnp.float32) if name.startswith('router') else cast(p[name]))
               for name in moe_lib.PARAM_NAMES if name in p}
  matmuls = {name: cast(w) for name, w in fused_matmuls(cfg, p).items()}
  matmuls.setdefault('w_gate_up', None)
  matmuls.setdefault('w_down', None)
  return LayerWeights(
      attn_norm=p['attn_norm'][:, None], bqkv=bqkv,
      q_norm=p['q_norm'] if cfg.qk_norm else None, k_norm=p['k_norm'] if cfg.qk_norm else None,
      mlp_norm=p['mlp_norm'][:, None], moe=experts, **matmuls)


def add_adapters(cfg: ModelConfig, w: LayerWeights, adapters: dict[str, Array]) -> LayerWeights:
  """`w` (a layer of the base in decode layout) plus the LoRA deltas s A B of `adapters` (that layer's
  `<target>_lora_a` / `_b`, `layer_params` names), fused as `fused_matmuls` fuses the weights (it is linear), added in
  float32 and cast back: the layer of the merged model, without the base's model-layout weights."""
  shapes = lora.shapes(cfg)
  deltas = {}
  for target in lora.TARGETS:
    in_shape, _, out_shape, _ = shapes[target]
    if target in cfg.lora_targets:
      a, b = (adapters[f'{target}_lora_{x}'].astype(jnp.float32) for x in 'ab')
      deltas[target] = jnp.float32(cfg.lora_scale) * jnp.tensordot(a, b, axes=1)
    else:
      deltas[target] = jnp.zeros((*in_shape, *out_shape), jnp.float32)
  merged = {name: (getattr(w, name).astype(jnp.float32) + delta).astype(getattr(w, name).dtype)
            for name, delta in fused_matmuls(cfg, deltas).items() if set(_FUSED[name]) & set(cfg.lora_targets)}
  return w.replace(**merged)


_FUSED = dict(wqkv=('q_proj', 'k_proj', 'v_proj'), wo=('o_proj',), w_gate_up=('gate_proj', 'up_proj'),
              w_down=('down_proj',))  # The projections each field of `fused_matmuls` holds.


def decode_outer(cfg: ModelConfig, p: dict[str, Array]) -> tuple[Array, Array, Array]:
  """`DecodeWeights`' `embed`, `final_norm` and `unembed` from `outer_params`."""
  dt = jnp.dtype(cfg.dtype)
  unembed = p['embed'] if cfg.tie_embeddings else p['lm_head'].T
  return p['embed'].astype(dt), p['final_norm'][:, None], unembed.astype(dt)


def assemble(cfg: ModelConfig, stacked: dict[str, Array], outer: dict[str, Array],
             moe_stacked: dict[str, Array] | None = None) -> DecodeWeights:
  """`DecodeWeights` from `layer_params`' stacked arrays and `outer_params`' (arrays or abstract values); an MoE
  model's MoE layers (after its dense ones) from `moe_layer_params`' `moe_stacked`."""
  layers = tuple(decode_layer(cfg, {name: x[i] for name, x in stacked.items()})
                 for i in range(cfg.num_dense_layers))
  layers += tuple(decode_layer(cfg, {name: x[i] for name, x in (moe_stacked or {}).items()})
                  for i in range(cfg.num_moe_layers))
  embed, final_norm, unembed = decode_outer(cfg, outer)
  return DecodeWeights(embed=embed, layers=layers, final_norm=final_norm, unembed=unembed)


def decode_weights(model: nnx.Module) -> DecodeWeights:
  """Re-lays-out a `Decoder`'s parameters for the cached forward pass (jit it: one fused copy)."""
  return assemble(model.cfg, layer_params(model), outer_params(model),
                  moe_layer_params(model) if model.cfg.is_moe else None)


# Logical axis names of the decode layout's arrays (`config.mesh.rules` map them to mesh axes:
# `generate.weights.decode_shardings`).
_LAYER_AXES = dict(attn_norm=('norm', None), wqkv=('heads', 'embed'), bqkv=('heads', None), q_norm=('norm',),
                   k_norm=('norm',), wo=('embed', 'heads'), mlp_norm=('norm', None), w_gate_up=('mlp', 'embed'),
                   w_down=('embed', 'mlp'), moe=None)  # moe: None in a dense layer (MoE layers: not placed yet).
_OUTER_AXES = dict(embed=('vocab', 'embed'), final_norm=('norm', None), unembed=('vocab', 'embed'))


def layer_axes(name: str) -> tuple[str | None, ...]:
  """The logical axis names of a `LayerWeights` field (the fused q|k|v rows count as 'heads', gate|up as 'mlp')."""
  return _LAYER_AXES[name]


def outer_axes(name: str) -> tuple[str | None, ...]:
  """The logical axis names of `DecodeWeights`' `embed`, `final_norm` or `unembed`."""
  return _OUTER_AXES[name]


# ---------------------------------------------------------------------------------------------------------
# Forward pass.


# Whether attention's dots take the cache in its own dtype with float32 accumulation (`preferred_element_type`) or
# float32 copies of it: XLA:CPU has no bf16 x bf16 -> f32 kernel for these dots, so on a CPU the cache is upcast
# (a no-op for float32 compute); elsewhere the upcast makes the TPU compiler write a float32 copy of every layer's
# cache at every decode step (docs/benchmarks/aot.md). Decided when a program is traced: by the default backend,
# or by `attention_for` (the ahead-of-time plan traces TPU programs on a CPU host).
_NATIVE_DOTS: contextvars.ContextVar[bool | None] = contextvars.ContextVar('native_attention_dots', default=None)


@contextlib.contextmanager
def attention_for(platform: str) -> Iterator[None]:
  """Programs traced inside this block use `platform`'s attention formulation ('cpu': float32 copies). jit keeps
  one trace per function and arguments: a program traced before, on the same arguments, keeps its formulation."""
  token = _NATIVE_DOTS.set(platform != 'cpu')
  try:
    yield
  finally:
    _NATIVE_DOTS.reset(token)


def _native_dots() -> bool:
  native = _NATIVE_DOTS.get()
  return jax.default_backend() != 'cpu' if native is None else native


def _attend_one(q: Array, k_cache: Array, v_cache: Array, mask: Array, scale: float) -> Array:
  """Single-token attention: q [B, K, G, H], k [B, K, H, W], v [B, K, W, H], mask bool [B, W] -> [B, K, G, H].
  Both reductions accumulate in float32; probabilities are rounded to the compute dtype as in `_attend_chunk`. On
  a CPU, multiply-reduce passes over float32 operands; elsewhere dots over the cache's own dtype."""
  f32 = jnp.float32
  if _native_dots():
    scores = jnp.einsum('bkgh,bkhw->bkgw', q, k_cache, preferred_element_type=f32)
  else:
    scores = jnp.sum(q.astype(f32)[..., None] * k_cache.astype(f32)[:, :, None], axis=-2)
  scores = jnp.where(mask[:, None, None, :], scores * scale, _MASK_VALUE)  # [B, K, G, W]
  probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
  if _native_dots():
    return jnp.einsum('bkgw,bkwh->bkgh', probs, v_cache, preferred_element_type=f32).astype(q.dtype)
  return jnp.sum(probs.astype(f32)[..., None] * v_cache.astype(f32)[:, :, None], axis=-2).astype(q.dtype)


def _attend_chunk(q: Array, k_cache: Array, v_cache: Array, mask: Array, scale: float,
                  key_block: int | None = None) -> Array:
  """Chunk attention as batched matmuls: q [B, T, K, G, H], k [B, K, H, W], v [B, K, W, H],
  mask bool [B, T, W] -> [B, T, K, G, H]; float32 products and sums (operands upcast on a CPU, else float32
  accumulation of the compute dtype's products: the same values, `_native_dots`).

  `key_block` (dividing W): an online softmax over blocks of that many cache slots, so a long cache never holds
  T x W scores at once (a continuation's prefill against a 32k-token history); the same values to rounding."""
  dt, f32 = q.dtype, jnp.float32
  cast = (lambda x: x) if _native_dots() else (lambda x: x.astype(f32))
  if key_block is None:
    scores = jnp.einsum('btkgh,bkhs->bkgts', cast(q), cast(k_cache), preferred_element_type=f32)
    scores = jnp.where(mask[:, None, None], scores * scale, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    return jnp.einsum('bkgts,bksh->btkgh', cast(probs), cast(v_cache), preferred_element_type=f32).astype(dt)
  b, t, kh, g, h = q.shape
  n = k_cache.shape[-1] // key_block
  kb = jnp.moveaxis(k_cache.reshape(b, kh, h, n, key_block), 3, 0)  # [n, B, K, H, blk]
  vb = jnp.moveaxis(v_cache.reshape(b, kh, n, key_block, h), 2, 0)  # [n, B, K, blk, H]
  mb = jnp.moveaxis(mask.reshape(b, t, n, key_block), 2, 0)  # [n, B, T, blk]
  qc = cast(q)  # Once, not per block.

  def step(carry, xs):
    m, l, acc = carry
    k_j, v_j, mask_j = xs
    s = jnp.einsum('btkgh,bkhs->bkgts', qc, cast(k_j), preferred_element_type=f32)
    s = jnp.where(mask_j[:, None, None], s * scale, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    corr = jnp.exp(m - m_new)
    pv = jnp.einsum('bkgts,bksh->bkgth', cast(p.astype(dt)), cast(v_j), preferred_element_type=f32)
    return (m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv), None

  init = (jnp.full((b, kh, g, t), _MASK_VALUE, f32), jnp.zeros((b, kh, g, t), f32),
          jnp.zeros((b, kh, g, t, h), f32))
  (_, l, acc), _ = jax.lax.scan(step, init, (kb, vb, mb))
  return jnp.einsum('bkgth->btkgh', acc / l[..., None]).astype(dt)


def chunk_key_block(t: int, window: int) -> int | None:
  """The `_attend_chunk` key block of a T-token chunk against `window` cache slots: `PREFILL_KEY_BLOCK` once the
  scores of a dense pass would pass `PREFILL_DENSE_SCORES` (per row, head), else None (dense)."""
  if t * window <= PREFILL_DENSE_SCORES or window % PREFILL_KEY_BLOCK:
    return None
  return PREFILL_KEY_BLOCK


def forward(cfg: ModelConfig, weights: DecodeWeights, cache: DecodeCache, tokens: Array, valid: Array, *,
            positions: Array | None = None, window: int | None = None,
            all_positions: bool = False) -> tuple[Array, DecodeCache]:
  """Runs a chunk through the decoder, writing it into slots `[index, index + T)` of the cache.

  Args:
    cfg: model config (static).
    weights: `decode_weights(model)`.
    cache: the cache; needs `index + T <= S` (the caller guarantees it: XLA clamps writes past the end). With a
      per-row `index [B]`, row b writes at its own `index[b]` and attends to slots `s <= index[b] + t`.
    tokens: int32 `[B, T]`.
    valid: bool `[B, T]`, False on padding.
    positions: optional int32 `[B, T]` RoPE positions (default: `cache.positions[b]` onwards on the real
      tokens, see the module docstring).
    window: static; attend only over slots `[0, window)` (the caller guarantees `max(index) + T <= window`).
    all_positions: static; return the hidden states of every position, not only the last.

  Returns:
    `(hidden, new_cache)`: final-norm hidden states, `[D, B]` (transposed) of the chunk's last position, or
    `[B, T, D]` with `all_positions`.
  """
  b, t = tokens.shape
  chex.assert_shape(valid, (b, t))
  n, kh, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  s = cache.max_len
  dt = jnp.dtype(cfg.dtype)
  valid = valid.astype(bool)
  if positions is None:
    positions = default_positions(valid, b, t, cache.positions)
  chex.assert_shape(positions, (b, t))
  positions = positions.astype(jnp.int32)
  cos, sin = rope_tables(positions, rope_inv_freq(cfg))
  per_row = cache.index.ndim == 1
  if per_row:  # Row b writes at its own slot index[b] (a per-row update: a scatter of T slots per row).
    chex.assert_shape(cache.index, (b,))
    write = lambda x, u, axis: jax.vmap(
        lambda xr, ur, i: jax.lax.dynamic_update_slice_in_dim(xr, ur, i, axis=axis - 1))(x, u, cache.index)
    query_slots = cache.index[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
  else:
    write = lambda x, u, axis: jax.lax.dynamic_update_slice_in_dim(x, u, cache.index, axis=axis)
    query_slots = jnp.broadcast_to(cache.index + jnp.arange(t, dtype=jnp.int32), (b, t))
  slot_valid = write(cache.valid, valid, 1)
  window = s if window is None else min(window, s)
  slots = jnp.arange(window, dtype=jnp.int32)
  mask = slot_valid[:, None, :window] & (slots[None, None, :] <= query_slots[:, :, None])  # [B, T, W]
  scale = h ** -0.5
  # Orientation of the activations (static, by M = B * T): 'col' x [D, M] (W @ x) or 'row' x [M, D] (x @ W^T).
  m = b * t
  col = not 2 <= m < 8
  f = cfg.mlp_dim
  if col:
    proj = lambda w, x: w @ x
    take = lambda x, lo, hi: x[lo:hi]
    vec = lambda v: v  # [E, 1] column vectors broadcast over M.
    heads = lambda y, c: y.reshape(c, h, b, t).transpose(2, 3, 0, 1)  # [c H, M] -> [B, T, c, H]
    merge = lambda o: o.reshape(b, t, n * h).transpose(2, 0, 1).reshape(n * h, m)  # [B, T, N, H] -> [N H, M]
  else:
    proj = lambda w, x: jnp.einsum('mi,oi->mo', x, w)
    take = lambda x, lo, hi: x[:, lo:hi]
    vec = lambda v: v.reshape(-1)
    heads = lambda y, c: y.reshape(b, t, c, h)  # [M, c H] -> [B, T, c, H]
    merge = lambda o: o.reshape(m, n * h)
  axis = 0 if col else -1
  x = jnp.take(weights.embed, tokens.reshape(m), axis=0).astype(dt)
  if col:
    x = x.T
  new_k, new_v = [], []
  for i, lw in enumerate(weights.layers):
    y = rms_norm(x, vec(lw.attn_norm), cfg.norm_eps, axis=axis)
    qkv = proj(lw.wqkv, y)
    if lw.bqkv is not None:
      qkv = qkv + vec(lw.bqkv)
    q = heads(take(qkv, 0, n * h), n)
    k = heads(take(qkv, n * h, (n + kh) * h), kh)
    v = heads(take(qkv, (n + kh) * h, (n + 2 * kh) * h), kh)
    if lw.q_norm is not None:
      q, k = rms_norm(q, lw.q_norm, cfg.norm_eps), rms_norm(k, lw.k_norm, cfg.norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = write(cache.k[i], k.transpose(0, 2, 3, 1).astype(cache.k[i].dtype), 3)
    v_cache = write(cache.v[i], v.transpose(0, 2, 1, 3).astype(cache.v[i].dtype), 2)
    new_k.append(k_cache)
    new_v.append(v_cache)
    if window < s:
      k_cache, v_cache = k_cache[..., :window], v_cache[:, :, :window]
    if t == 1:
      att = _attend_one(q.reshape(b, kh, g, h), k_cache, v_cache, mask[:, 0], scale)
    else:
      att = _attend_chunk(q.reshape(b, t, kh, g, h), k_cache, v_cache, mask, scale,
                          key_block=chunk_key_block(t, window))
    x = x + proj(lw.wo, merge(att.reshape(b, t, n, h)))
    y = rms_norm(x, vec(lw.mlp_norm), cfg.norm_eps, axis=axis)
    if lw.moe is not None:  # Experts on the rows [M, D].
      out, _ = moe_lib.moe_mlp(cfg, y.T if col else y, lw.moe)
      x = x + (out.T if col else out)
      continue
    gate_up = proj(lw.w_gate_up, y)
    x = x + proj(lw.w_down, jax.nn.silu(take(gate_up, 0, f)) * take(gate_up, f, 2 * f))
  if all_positions:
    x = x.T if col else x
    hidden = rms_norm(x.reshape(b, t, -1), weights.final_norm[:, 0], cfg.norm_eps)
  else:
    last = x.reshape(-1, b, t)[:, :, -1] if col else x.reshape(b, t, -1)[:, -1].T  # [D, B]
    hidden = rms_norm(last, weights.final_norm, cfg.norm_eps, axis=0)
  last_pos = jnp.max(jnp.where(valid, positions, -1), axis=-1)
  new_cache = DecodeCache(k=tuple(new_k), v=tuple(new_v), valid=slot_valid, index=cache.index + t,
                          positions=jnp.maximum(cache.positions, last_pos + 1))
  return hidden, new_cache


def forward_mixed(cfg: ModelConfig, weights: DecodeWeights, cache: DecodeCache, tokens: Array, active: Array,
                  chunk_rows: Array | None = None, chunk: Array | None = None, chunk_valid: Array | None = None, *,
                  window: int | None = None, chunk_window: int | None = None
                  ) -> tuple[Array, Array | None, DecodeCache]:
  """One decode step of R rows, optionally fused with chunks written into some of them, in one pass over the
  weights.

  The slot engine's step that starts a queued episode (`sao_jax.generate.programs`): the R decode tokens and the
  P x T chunk tokens go through every projection and MLP as one `[D, R + P T]` block (on a CPU, a step's cost is
  mostly reading the weights, so the chunk rides along for its extra FLOPs), and each part attends with its own
  kernel: single-token attention for the decode rows, chunk attention for the chunks.

  Args:
    cfg: model config (static).
    weights: `decode_weights(model)`.
    cache: a slot-major cache of R rows (`per_row_index=True`).
    tokens: int32 `[R]`: each row's next token, written at its `index` where `active`.
    active: bool `[R]`: rows that decode (inactive rows write a hole and do not advance).
    chunk_rows: int32 `[P]`: the rows (in `[0, R)`) the chunks are written into, at their `index`; R marks a
      padding entry (nothing written). A chunk's row must not be `active`, and rows must be distinct. None
      (with `chunk` and `chunk_valid`): a plain decode step.
    chunk: int32 `[P, T]`, right-padded; `chunk_valid` bool `[P, T]` marks the real tokens.
    window: static; attend only over slots `[0, window)` (needs `index + 1` and `index + T` inside it).
    chunk_window: static; the chunks attend only over (and are written only into) slots `[0, chunk_window)`
      of their rows (needs each chunk row's `index + T` inside it): a chunk that starts a new episode in a
      row of a long window reads its prompt's slots, not the window's.

  Returns:
    `(hidden, chunk_hidden, new_cache)`: final-norm hidden states `[D, R]` of the decode tokens and `[D, P]` of
    each chunk's last real token (None without chunks); the cache with `index` and `positions` advanced by one
    on active rows and by the chunk's real tokens on chunk rows. The same function as `forward` on the decode
    rows and on the chunks (tests compare them).
  """
  r, = tokens.shape
  if cache.batch_size != r:
    raise ValueError(f'forward_mixed: {r} tokens for a cache of {cache.batch_size} rows.')
  chunk_rows = jnp.zeros((0,), jnp.int32) if chunk_rows is None else chunk_rows
  p, t = (0, 1) if chunk is None else chunk.shape
  chunk = jnp.zeros((p, t), jnp.int32) if chunk is None else chunk
  chunk_valid = jnp.zeros((p, t), bool) if chunk_valid is None else chunk_valid.astype(bool)
  chex.assert_shape(active, (r,))
  chex.assert_shape(chunk_rows, (p,))
  chex.assert_shape(chunk_valid, (p, t))
  n, kh, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  dt = jnp.dtype(cfg.dtype)
  w = cache.max_len if window is None else min(window, cache.max_len)
  cw = w if chunk_window is None else min(chunk_window, w)
  active = active.astype(bool)
  rows_of = lambda x: jnp.take(x, chunk_rows, axis=0, mode='clip')  # The chunks' rows (padding: any row).
  chunk_index = rows_of(cache.index)
  chunk_pos = default_positions(chunk_valid, p, t, rows_of(cache.positions))  # [P, T]
  cos_d, sin_d = rope_tables(cache.positions[:, None], rope_inv_freq(cfg))
  cos_c, sin_c = rope_tables(chunk_pos, rope_inv_freq(cfg))
  per_row = lambda xs, us, idx, axis: jax.vmap(
      lambda xr, ur, i: jax.lax.dynamic_update_slice_in_dim(xr, ur, i, axis=axis - 1))(xs, us, idx)

  def write(x, dec, part, axis):
    """The decode tokens at each row's index, then the chunks at their rows' index (they overwrite the hole an
    inactive chunk row's decode token left there)."""
    x = per_row(x, dec, cache.index, axis)
    if p == 0:
      return x
    cut = (slice(None),) * (axis - 1) + (slice(0, cw),)  # The chunks' slots.
    return x.at[(chunk_rows,) + cut].set(per_row(rows_of(x[(slice(None),) + cut]), part, chunk_index, axis),
                                         mode='drop')

  slot_valid = write(cache.valid, active[:, None], chunk_valid, 1)
  slots = jnp.arange(w, dtype=jnp.int32)
  dec_mask = slot_valid[:, :w] & (slots[None, :] <= cache.index[:, None])  # [R, W]
  chunk_slots = chunk_index[:, None] + jnp.arange(t, dtype=jnp.int32)  # [P, T]
  chunk_mask = rows_of(slot_valid[:, :cw])[:, None] & (slots[None, None, :cw] <= chunk_slots[:, :, None])
  scale = h ** -0.5
  f = cfg.mlp_dim

  def heads(y, c):  # [c H, M] -> ([R, 1, c, H], [P, T, c, H])
    return (y[:, :r].reshape(c, h, r, 1).transpose(2, 3, 0, 1),
            y[:, r:].reshape(c, h, p, t).transpose(2, 3, 0, 1))

  x = jnp.take(weights.embed, jnp.concatenate([tokens, chunk.reshape(p * t)]), axis=0).astype(dt).T  # [D, M]
  new_k, new_v = [], []
  for i, lw in enumerate(weights.layers):
    y = rms_norm(x, lw.attn_norm, cfg.norm_eps, axis=0)
    qkv = lw.wqkv @ y
    if lw.bqkv is not None:
      qkv = qkv + lw.bqkv
    (qd, qc), (kd, kc) = heads(qkv[:n * h], n), heads(qkv[n * h:(n + kh) * h], kh)
    vd, vc = heads(qkv[(n + kh) * h:(n + 2 * kh) * h], kh)
    if lw.q_norm is not None:
      qd, kd = rms_norm(qd, lw.q_norm, cfg.norm_eps), rms_norm(kd, lw.k_norm, cfg.norm_eps)
      qc, kc = rms_norm(qc, lw.q_norm, cfg.norm_eps), rms_norm(kc, lw.k_norm, cfg.norm_eps)
    qd, kd = apply_rope(qd, cos_d, sin_d), apply_rope(kd, cos_d, sin_d)
    qc, kc = apply_rope(qc, cos_c, sin_c), apply_rope(kc, cos_c, sin_c)
    kd, vd = kd.transpose(0, 2, 3, 1), vd.transpose(0, 2, 1, 3)
    kc, vc = kc.transpose(0, 2, 3, 1), vc.transpose(0, 2, 1, 3)
    k_cache = write(cache.k[i], kd.astype(cache.k[i].dtype), kc.astype(cache.k[i].dtype), 3)
    v_cache = write(cache.v[i], vd.astype(cache.v[i].dtype), vc.astype(cache.v[i].dtype), 2)
    new_k.append(k_cache)
    new_v.append(v_cache)
    att_d = _attend_one(qd.reshape(-1, kh, g, h), k_cache[..., :w], v_cache[:, :, :w], dec_mask, scale)
    att = [att_d.reshape(r, n * h)]
    if p:  # Each chunk attends over its own row.
      att_c = _attend_chunk(qc.reshape(p, t, kh, g, h), rows_of(k_cache[..., :cw]), rows_of(v_cache[:, :, :cw]),
                            chunk_mask, scale, key_block=chunk_key_block(t, cw))
      att.append(att_c.reshape(p * t, n * h))
    x = x + lw.wo @ jnp.concatenate(att).T  # [N H, M]
    y = rms_norm(x, lw.mlp_norm, cfg.norm_eps, axis=0)
    if lw.moe is not None:  # Experts on the rows [M, D].
      x = x + moe_lib.moe_mlp(cfg, y.T, lw.moe)[0].T
      continue
    gate_up = lw.w_gate_up @ y
    x = x + lw.w_down @ (jax.nn.silu(gate_up[:f]) * gate_up[f:])
  hidden = rms_norm(x[:, :r], weights.final_norm, cfg.norm_eps, axis=0)
  step = active.astype(jnp.int32)
  index, positions = cache.index + step, cache.positions + step
  chunk_hidden = None
  if p:
    lengths = jnp.sum(chunk_valid, axis=1, dtype=jnp.int32)  # [P]
    last = jnp.take_along_axis(x[:, r:].reshape(-1, p, t), jnp.maximum(lengths - 1, 0)[None, :, None],
                               axis=2)[..., 0]
    chunk_hidden = rms_norm(last, weights.final_norm, cfg.norm_eps, axis=0)
    chunk_last = jnp.max(jnp.where(chunk_valid, chunk_pos, -1), axis=-1)
    index = index.at[chunk_rows].set(chunk_index + lengths, mode='drop')
    positions = positions.at[chunk_rows].set(jnp.maximum(rows_of(cache.positions), chunk_last + 1), mode='drop')
  return hidden, chunk_hidden, DecodeCache(k=tuple(new_k), v=tuple(new_v), valid=slot_valid, index=index,
                                           positions=positions)


def last_logits(weights: DecodeWeights, hidden_t: Array) -> Array:
  """float32 `[B, V]` logits from the transposed last hidden states `[D, B]` (`unembed @ hidden_t`, the
  fast layout for a `[V, D]` table on CPU). Operands are upcast to float32 (no-ops for float32 compute): with
  bfloat16 ones XLA:CPU rewrites this dot into a bf16 x bf16 -> f32 kernel it does not have."""
  logits_t = jnp.dot(weights.unembed.astype(jnp.float32), hidden_t.astype(jnp.float32))  # [V, B]
  # Transposed after a barrier: XLA would otherwise fold the transpose into the dot, and the [B, D] x [D, V] form
  # with both operands transposed runs on a slower XLA:CPU kernel (docs/benchmarks/sampler.md).
  return jax.lax.optimization_barrier(logits_t).T
