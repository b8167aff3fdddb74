"""Llama-family decoder in Flax NNX (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3) with a preallocated KV cache.

Architecture (pre-norm): for each of L blocks,
  h = h + Attn(RMSNorm(h)),   h = h + MLP(RMSNorm(h)),   logits = RMSNorm(h) @ W_out,
  RMSNorm(x) = x / sqrt(mean(x^2) + eps) * scale,
  MLP(x) = (silu(x W_gate) * (x W_up)) W_down                                   (SwiGLU),
  Attn: q = x Wq (+bq), k = x Wk (+bk), v = x Wv (+bv); optional RMSNorm over head_dim on q, k (Qwen3);
        RoPE on q, k; grouped-query attention (N query heads share K key/value heads);
        softmax(q k^T / sqrt(H) + mask) v (causal, within a segment: `sao_jax.models.attention`), then Wo.

Parameters are stored in `cfg.param_dtype` (float32 or bfloat16) and cast to `cfg.dtype` at use; norms, softmax
and logits are float32. Blocks are stacked along a leading 'layers' axis (one `nnx.vmap`-created `Block`) and run
with `lax.scan` (or an unrolled loop with `cfg.scan_layers=False`); `cfg.remat` names the policy that
rematerialises each block (`models.config.REMAT_POLICIES`, `remat_policy_fn`).

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
  layers/attn/q_proj_lora/a, b [L, D, r], [L, r, N, H]   LoRA adapters (`lora`; one per `cfg.lora_targets` entry,
                                                        beside the weight it adapts, e.g. mlp/down_proj_lora)
Every attention parameter lives under an `attn` path: `nnx.PathContains('attn')` selects them all.

MoE models (`cfg.num_experts > 0`, `sao_jax.models.moe`): `layers` holds the first `cfg.first_k_dense` (dense) blocks
only, absent if none, and `moe_layers` the other L_moe = L - first_k_dense blocks (`MoeBlock`: the MLP replaced by
`moe`, its own scan), each with attn_norm, attn/*, mlp_norm as above and
  moe_layers/moe/router          [L_moe, D, E]     ('layers', 'embed', None)
  moe_layers/moe/router_bias     [L_moe, E]        (router_bias only; a `RouterBias` variable, not a Param)
  moe_layers/moe/gate_proj, up_proj [L_moe, E, D, F_e]  ('layers', 'expert', 'embed', 'mlp')
  moe_layers/moe/down_proj       [L_moe, E, F_e, D]  ('layers', 'expert', 'mlp', 'embed')
  moe_layers/moe/shared_gate_proj, shared_up_proj [L_moe, D, F_s], shared_down_proj [L_moe, F_s, D]
                                 (num_shared_experts only; F_s = num_shared_experts * F_e)
`return_aux=True` adds the MoE layers' `moe.MoeAux` (stacked over them); `routing=` replays chosen experts.

KV cache: `model(tokens, cache=cache)` runs the cached forward pass of `sao_jax.models.decode` (the one
implementation, also run by the sampler) and returns the updated cache; one call signature serves prefill,
single-token decode and continuation chunks (e.g. observation tokens appended in a multi-turn episode):

  cache = model.init_cache(batch_size=B, max_len=S)                        # a `decode.DecodeCache`
  logits, cache = model(prompt[B, T0], attention_mask=m0, cache=cache)      # prefill (left or right padded)
  logits, cache = model(next_tok[B, 1], cache=cache)                       # decode one token per row
  logits, cache = model(obs[B, T1], attention_mask=m1, cache=cache)        # continuation chunk

Every row writes the chunk at the same slots [index, index + T); a token attends to the earlier slots of its
row that hold real tokens (masked tokens are holes); positions continue from the row's last real token. See
`sao_jax.models.decode` for the exact semantics. It re-lays-out the weights on every call: a decode loop should
call `decode.decode_weights` once and `decode.forward` per step, as `sao_jax.generate.static` does.
"""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import attention
from sao_jax.models import decode
from sao_jax.models import lora
from sao_jax.models import moe
from sao_jax.models.config import REMAT_POLICIES, ModelConfig
from sao_jax.models.layers import apply_rope, default_positions, rms_norm, rope_inv_freq, rope_tables, swiglu

Array = jax.Array


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
# Layers.


class RMSNorm(nnx.Module):
  """y = x / sqrt(mean(x^2, -1) + eps) * scale, computed in float32 (HF casting order)."""

  def __init__(self, dim: int, eps: float, *, param_dtype=jnp.float32):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=('norm',), eager_sharding=False)
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    return rms_norm(x, self.scale[...], self.eps)


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

  def __call__(self, x: Array, cos: Array, sin: Array, segment_ids: Array) -> Array:
    """x [B, T, D], cos/sin [B, T, H/2], segment_ids int [B, T] (`attention.attention`) -> [B, T, D]."""
    cfg = self.cfg
    dt = x.dtype
    q = lora.project(self, 'q_proj', 'btd,dnh->btnh', x)
    k = lora.project(self, 'k_proj', 'btd,dkh->btkh', x)
    v = lora.project(self, 'v_proj', 'btd,dkh->btkh', x)
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    b, t = q.shape[:2]
    q = q.reshape(b, t, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim)
    out = attention.attention(q, k, v, segment_ids, chunk=cfg.attention_chunk, impl=cfg.attention_impl)
    out = out.reshape(b, t, cfg.num_heads, cfg.head_dim)
    return lora.project(self, 'o_proj', 'btnh,nhd->btd', out)


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
    gate = lora.project(self, 'gate_proj', 'btd,df->btf', x)
    up = lora.project(self, 'up_proj', 'btd,df->btf', x)
    return lora.project(self, 'down_proj', 'btf,fd->btd', swiglu(gate, up))


class RouterBias(nnx.Variable):
  """An MoE router's correction bias (HF `e_score_correction_bias`): state of the model, not an `nnx.Param`, so no
  optimizer trains it (it only moves the choice of experts, so it has no gradient; DeepSeek-V3 adjusts it by load)."""


class MoeMLP(nnx.Module):
  """Mixture-of-experts MLP (`sao_jax.models.moe`): a router, E SwiGLU experts and an optional shared expert."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, e, f = cfg.embed_dim, cfg.num_experts, cfg.moe_mlp_dim
    pd = _dtype(cfg.param_dtype)
    out_std = f ** -0.5 / (2 * cfg.num_layers) ** 0.5
    self.router = _param(rngs.params(), (d, e), ('embed', None), pd, stddev=d ** -0.5)
    if cfg.router_bias:
      self.router_bias = RouterBias(jnp.zeros((e,), jnp.float32), out_sharding=(None,), eager_sharding=False)
    self.gate_proj = _param(rngs.params(), (e, d, f), ('expert', 'embed', 'mlp'), pd, stddev=d ** -0.5)
    self.up_proj = _param(rngs.params(), (e, d, f), ('expert', 'embed', 'mlp'), pd, stddev=d ** -0.5)
    self.down_proj = _param(rngs.params(), (e, f, d), ('expert', 'mlp', 'embed'), pd, stddev=out_std)
    if cfg.num_shared_experts:
      fs = f * cfg.num_shared_experts
      self.shared_gate_proj = _param(rngs.params(), (d, fs), ('embed', 'mlp'), pd, stddev=d ** -0.5)
      self.shared_up_proj = _param(rngs.params(), (d, fs), ('embed', 'mlp'), pd, stddev=d ** -0.5)
      self.shared_down_proj = _param(rngs.params(), (fs, d), ('mlp', 'embed'), pd,
                                     stddev=fs ** -0.5 / (2 * cfg.num_layers) ** 0.5)
    self.cfg = cfg

  def __call__(self, x: Array, mask: Array, experts: Array | None = None) -> tuple[Array, moe.MoeAux]:
    """x [B, T, D], mask bool [B, T] (the valid tokens, of the statistics), experts int [B, T, k] (replay) or None
    -> (y [B, T, D], `moe.MoeAux` with experts [B, T, k])."""
    b, t, d = x.shape
    p = {name: getattr(self, name)[...] for name in moe.PARAM_NAMES if hasattr(self, name)}
    k = self.cfg.num_experts_per_tok
    y, aux = moe.moe_mlp(self.cfg, x.reshape(b * t, d), p, mask.reshape(b * t),
                         None if experts is None else experts.reshape(b * t, k))
    return y.reshape(b, t, d), aux._replace(experts=aux.experts.reshape(b, t, k))


class MoeBlock(nnx.Module):
  """Pre-norm MoE decoder block: h += Attn(RMSNorm(h)); h += MoE(RMSNorm(h)) (also returns the `moe.MoeAux`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = _dtype(cfg.param_dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.moe = MoeMLP(cfg, rngs=rngs)

  def __call__(self, h, cos, sin, segment_ids, experts=None):
    h = h + self.attn(self.attn_norm(h), cos, sin, segment_ids)
    y, aux = self.moe(self.mlp_norm(h), segment_ids > 0, experts)
    return h + y, aux


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

  def __call__(self, h, cos, sin, segment_ids):
    h = h + self.attn(self.attn_norm(h), cos, sin, segment_ids)
    return h + self.mlp(self.mlp_norm(h))


# ---------------------------------------------------------------------------------------------------------
# Decoder.


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

    if cfg.num_dense_layers:
      self.layers = _stack(Block, cfg, cfg.num_dense_layers, rngs)
    if cfg.is_moe:  # After the dense ones: a dense model's weights are those of the same seed as before.
      self.moe_layers = _stack(MoeBlock, cfg, cfg.num_moe_layers, rngs)
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, param_dtype=pd)
    self.has_lm_head = lm_head
    if lm_head and not cfg.tie_embeddings:
      self.lm_head = _param(rngs.params(), (cfg.embed_dim, cfg.vocab_size), ('embed', 'vocab'), pd,
                            stddev=cfg.embed_dim ** -0.5)
    if cfg.lora_rank:  # Last: the base's weights are those of the same seed without LoRA.
      lora.attach(self.layers, cfg, rngs.params())

  # ---- Public API.

  def init_cache(self, batch_size: int, max_len: int, dtype: Any = None) -> decode.DecodeCache:
    """An empty KV cache for this model (`decode.init_cache`; dtype defaults to the compute dtype)."""
    return decode.init_cache(self.cfg, batch_size, max_len, dtype)

  def __call__(self, tokens: Array, *, positions: Array | None = None, attention_mask: Array | None = None,
               segment_ids: Array | None = None, cache: decode.DecodeCache | None = None,
               return_hidden: bool = False, return_aux: bool = False, routing: Array | None = None):
    """Runs the decoder.

    Args:
      tokens: int32[B, T].
      positions: int32[B, T] RoPE positions (default: see `default_positions`; with a cache, continuing
        from `cache.positions`).
      attention_mask: bool[B, T], False on padding tokens (right- or left-padding). Without a cache,
        query t attends to keys s <= t with attention_mask[b, s]; with a cache, see `sao_jax.models.decode`.
      segment_ids: int[B, T], without a cache only: sequences packed into a row (`attention.attention`): a
        token attends within its segment, positions restart at 0 at each segment's first token
        (`segment_positions`). Excludes `attention_mask` (which is segment ids 1 on real tokens, 0 on padding).
      cache: a `decode.DecodeCache` to write this chunk into and attend over (prefill, decode or continuation).
      return_hidden: also return the final-norm hidden states [B, T, D] (compute dtype).
      return_aux: without a cache only: also return the MoE layers' `moe.MoeAux`, stacked over them (experts
        [L_moe, B, T, k], load [L_moe, E], aux_loss and dropped [L_moe]); None for a dense model.
      routing: without a cache, MoE only: int [L_moe, B, T, k] experts to replay (`moe.route`) instead of choosing.

    Returns:
      Without cache: logits float32[B, T, V], or (logits, hidden) with return_hidden; `return_aux` appends the aux.
      With cache: (logits, new_cache), or (logits, hidden, new_cache) with return_hidden.
    """
    if cache is None:
      hidden, aux = self._forward(tokens, positions, attention_mask, segment_ids, routing)
      logits = self.logits_from_hidden(hidden)
      out = (logits, hidden) if return_hidden else (logits,)
      out = out + (aux,) if return_aux else out
      return out if len(out) > 1 else out[0]
    chex.assert_rank(tokens, 2)
    if segment_ids is not None:
      raise ValueError('segment_ids (packed sequences) are for the uncached forward pass only.')
    if cache.batch_size != tokens.shape[0]:
      raise ValueError(f'cache batch size {cache.batch_size} != tokens batch size {tokens.shape[0]}.')
    valid = jnp.ones(tokens.shape, bool) if attention_mask is None else attention_mask
    hidden, new_cache = decode.forward(self.cfg, decode.decode_weights(self), cache, tokens, valid,
                                       positions=positions, all_positions=True)
    logits = self.logits_from_hidden(hidden)
    return (logits, hidden, new_cache) if return_hidden else (logits, new_cache)

  def hidden(self, tokens: Array, *, positions: Array | None = None, attention_mask: Array | None = None,
             segment_ids: Array | None = None, return_aux: bool = False, routing: Array | None = None):
    """Final-norm hidden states [B, T, D] (compute dtype), without the lm head (arguments as `__call__`); with
    `return_aux`, (hidden, the MoE layers' `moe.MoeAux` or None)."""
    hidden, aux = self._forward(tokens, positions, attention_mask, segment_ids, routing)
    return (hidden, aux) if return_aux else hidden

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

  def merged(self) -> Decoder:
    """This model without LoRA adapters, each adapted weight replaced by W + s A B (`lora.merged_weight`): a
    `Decoder` of `cfg.without_lora()` (what an HF export writes). Without adapters, `self`."""
    return self._without_adapters(merge=True)

  def base_model(self) -> Decoder:
    """The frozen base under the LoRA adapters (their weights as they are, the adapters dropped): a `Decoder` of
    `cfg.without_lora()` sharing this model's arrays. Without adapters, `self`."""
    return self._without_adapters(merge=False)

  def _without_adapters(self, merge: bool) -> Decoder:
    cfg = self.cfg
    if not cfg.lora_rank:
      return self
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg.without_lora(), rngs=nnx.Rngs(0),
                                                                  lm_head=self.has_lm_head)))
    flat = {tuple(str(k) for k in path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(self))}
    for target in cfg.lora_targets if merge else ():
      w = ('layers', lora.HOLDER[target], target)
      ab = tuple(flat[('layers', lora.HOLDER[target], lora.suffix(target), x)] for x in 'ab')
      flat[w] = jax.vmap(lambda w_, a, b: lora.merged_weight(w_, a, b, cfg.lora_scale))(flat[w], *ab)

    def fill(path, var):
      return var.replace(flat[tuple(str(getattr(k, 'key', k)) for k in path)])

    state = jax.tree_util.tree_map_with_path(fill, abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)

  # ---- Internals.

  def _forward(self, tokens: Array, positions: Array | None, attention_mask: Array | None,
               segment_ids: Array | None, routing: Array | None = None) -> tuple[Array, moe.MoeAux | None]:
    """Final-norm hidden states [B, T, D] of the plain (uncached) causal forward pass, and the MoE layers' aux."""
    cfg = self.cfg
    chex.assert_rank(tokens, 2)
    b, t = tokens.shape
    if segment_ids is not None:
      if attention_mask is not None:
        raise ValueError('Pass attention_mask or segment_ids, not both.')
      chex.assert_shape(segment_ids, (b, t))
      segment_ids = segment_ids.astype(jnp.int32)
      if positions is None:
        positions = segment_positions(segment_ids)
    else:
      if attention_mask is not None:
        chex.assert_shape(attention_mask, (b, t))
        attention_mask = attention_mask.astype(bool)
      if positions is None:
        positions = default_positions(attention_mask, b, t)
      segment_ids = (jnp.ones((b, t), jnp.int32) if attention_mask is None
                     else attention_mask.astype(jnp.int32))
    chex.assert_shape(positions, (b, t))
    positions = positions.astype(jnp.int32)
    h = rows_split(jnp.take(self.embed.embedding[...], tokens, axis=0).astype(_dtype(cfg.dtype)))
    cos, sin = rope_tables(positions, rope_inv_freq(cfg))
    if cfg.num_dense_layers:
      h = self._run_layers(h, cos, sin, segment_ids)
    aux = None
    if cfg.is_moe:
      if routing is not None:
        chex.assert_shape(routing, (cfg.num_moe_layers, b, t, cfg.num_experts_per_tok))
      h, aux = self._run_moe_layers(h, cos, sin, segment_ids, routing)
    elif routing is not None:
      raise ValueError('routing (replayed experts) is for an MoE model only.')
    return self.final_norm(h), aux

  def _run_moe_layers(self, h, cos, sin, segment_ids, routing):
    """Applies the stacked MoE blocks as `_run_layers` the dense ones; their `moe.MoeAux` stacked over layers."""
    cfg = self.cfg
    graphdef, params = nnx.split(self.moe_layers)

    def body(h, xs):
      layer_params, experts = xs
      h, aux = nnx.merge(graphdef, layer_params)(h, cos, sin, segment_ids, experts)
      return rows_split(h), aux

    if cfg.remat != 'none':
      body = jax.checkpoint(body, policy=remat_policy_fn(cfg.remat), prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      return jax.lax.scan(body, h, (params, routing))
    auxes = []
    for i in range(cfg.num_moe_layers):
      h, aux = body(h, jax.tree.map(lambda x, i=i: x[i], (params, routing)))
      auxes.append(aux)
    return h, jax.tree.map(lambda *x: jnp.stack(x), *auxes)

  def _run_layers(self, h, cos, sin, segment_ids):
    """Applies the stacked dense blocks (`lax.scan`, or unrolled with `cfg.scan_layers=False`)."""
    cfg = self.cfg
    graphdef, params = nnx.split(self.layers)

    def body(h, layer_params):
      return rows_split(nnx.merge(graphdef, layer_params)(h, cos, sin, segment_ids)), None

    if cfg.remat != 'none':
      body = jax.checkpoint(body, policy=remat_policy_fn(cfg.remat), prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
      return jax.lax.scan(body, h, params)[0]
    for i in range(cfg.num_dense_layers):
      h, _ = body(h, jax.tree.map(lambda x, i=i: x[i], params))
    return h


def _stack(block: type, cfg: ModelConfig, n: int, rngs: nnx.Rngs) -> nnx.Module:
  """`n` blocks of class `block` stacked along a leading 'layers' axis (one `nnx.vmap`-created module)."""

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
  def make(r: nnx.Rngs) -> nnx.Module:
    return block(cfg, rngs=r)

  return make(rngs)


def segment_positions(segment_ids: Array) -> Array:
  """RoPE positions restarting at 0 at the first token of each run of equal segment ids: int32 [B, T]."""
  t = segment_ids.shape[-1]
  idx = jnp.arange(t, dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                           axis=1)
  return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def rows_split(x: Array) -> Array:
  """Activations `[B, ...]` split by rows over the mesh's batch axes (`data`, `fsdp`) when traced under a mesh
  (`jax.sharding.use_abstract_mesh`: the learner's steps); unchanged elsewhere (the samplers). Without it GSPMD
  follows the embedding table's fsdp-split width from the lookup on and holds every row on every chip: 15x the
  temporaries of Qwen3-8B's update on v5e-64 (docs/benchmarks/aot.md)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not {'data', 'fsdp'} <= set(mesh.axis_names):
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(('data', 'fsdp')))


def remat_policy_fn(name: str) -> Any:
  """The `jax.checkpoint` policy of a remat name (`models.config.REMAT_POLICIES`; 'none' is no checkpoint at
  all): 'full' -> None (nothing saved but the inputs), else `jax.checkpoint_policies.<name>`."""
  if name == 'full':
    return None
  if name not in REMAT_POLICIES or name == 'none':
    raise ValueError(f'remat policy {name!r} is not one of {[p for p in REMAT_POLICIES if p != "none"]}.')
  return getattr(jax.checkpoint_policies, name)


def project_to_vocab(hidden: Array, w: Array, layout: str) -> Array:
  """Float32 logits from hidden [..., D] and the unembedding `w` ('vd': [V, D], 'dv': [D, V])."""
  w = w.astype(hidden.dtype)
  eq = '...d,vd->...v' if layout == 'vd' else '...d,dv->...v'
  return jnp.einsum(eq, hidden, w, preferred_element_type=jnp.float32)


def count_params(model: nnx.Module) -> int:
  """Number of scalars in the model's nnx.Params."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
