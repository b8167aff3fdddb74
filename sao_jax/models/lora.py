"""LoRA adapters of the decoder's projections: low-rank updates trained over a frozen base.

For a target projection with weight W (laid out `[*in, *out]`, e.g. q_proj `[D, N, H]`, o_proj `[N, H, D]`),

  y = x W + s (x A) B,   A [*in, r],  B [r, *out],  s = alpha / r,

A drawn from normal(0, 1 / fan_in) (truncated at 2 sigma, as the base's own init), B = 0: a fresh adapter adds
exactly 0, so step 0 is the base model bit for bit. Merged: W' = W + s A B (`merged_weight`), what the sampler and
an HF export use. The adapter of target `t` is a submodule `<t>_lora` beside the weight (e.g.
`layers/attn/q_proj_lora/a`), so the attention adapters live under `attn` (`value.CRITIC_ATTENTION` selects them
too) and the adapters stack along the layers axis with their block.

What trains is a filter: `ADAPTERS` (every `LoraParam`); the base weights are plain `nnx.Param`s and get neither
gradients nor optimizer states (`learner.state`). Without gradients w.r.t. W, the backward pass has no weight
gradient matmul for the base: x^T dy [in, out] per projection is replaced by two rank-r products.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models.config import LORA_ATTENTION_TARGETS, LORA_TARGETS, ModelConfig

Array = jax.Array

ATTENTION_TARGETS = LORA_ATTENTION_TARGETS
MLP_TARGETS = ('gate_proj', 'up_proj', 'down_proj')
TARGETS = LORA_TARGETS  # The projections an adapter can target (HF PEFT's module names).
HOLDER = {t: 'attn' if t in ATTENTION_TARGETS else 'mlp' for t in TARGETS}  # The block's submodule of each target.


class LoraParam(nnx.Param):
  """A LoRA adapter's parameter (A or B): what trains under LoRA."""


ADAPTERS = nnx.OfType(LoraParam)  # Filter: every adapter parameter of a model.


def suffix(target: str) -> str:
  """The adapter submodule's name of projection `target` (`q_proj` -> `q_proj_lora`)."""
  return f'{target}_lora'


class Adapter(nnx.Module):
  """A [L, *in, r], B [L, r, *out] of one projection in every layer (module docstring); inside a layer (the
  decoder's scan slices the leading axis) `delta(x)` = s (x A) B."""

  def __init__(self, a: Array, b: Array, in_names: tuple[str, ...], out_names: tuple[str, ...], scale: float):
    self.a = LoraParam(a, out_sharding=('layers', *in_names, None), eager_sharding=False)
    self.b = LoraParam(b, out_sharding=('layers', None, *out_names), eager_sharding=False)
    self.scale = scale
    self.num_in = len(in_names)

  def delta(self, x: Array) -> Array:
    """s (x A) B for x [..., *in] -> [..., *out], in x's dtype (one layer's A and B)."""
    xa = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.num_in)
    return jnp.tensordot(xa * jnp.asarray(self.scale, x.dtype), self.b[...].astype(x.dtype), axes=1)


def initial(cfg: ModelConfig, target: str, key: Array) -> tuple[Array, Array]:
  """A fresh adapter of `target` in every layer: (A, B), A [L, *in, r] ~ normal(0, 1 / fan_in) truncated at 2 sigma
  drawn from `fold_in(key, TARGETS.index(target))`, B [L, r, *out] = 0, in `cfg.param_dtype`."""
  in_shape, _, out_shape, _ = shapes(cfg)[target]
  dtype = jnp.dtype(cfg.param_dtype)
  key = jax.random.fold_in(key, TARGETS.index(target))
  a = math.prod(in_shape) ** -0.5 * jax.random.truncated_normal(
      key, -2.0, 2.0, (cfg.num_layers, *in_shape, cfg.lora_rank), jnp.float32)
  return a.astype(dtype), jnp.zeros((cfg.num_layers, cfg.lora_rank, *out_shape), dtype)


def shapes(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]]:
  """Per target: (in shape, in logical names, out shape, out logical names), the layout of the weight it adapts
  (`llama` module docstring)."""
  d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return dict(
      q_proj=((d,), ('embed',), (n, h), ('heads', 'head_dim')),
      k_proj=((d,), ('embed',), (k, h), ('kv_heads', 'head_dim')),
      v_proj=((d,), ('embed',), (k, h), ('kv_heads', 'head_dim')),
      o_proj=((n, h), ('heads', 'head_dim'), (d,), ('embed',)),
      gate_proj=((d,), ('embed',), (f,), ('mlp',)),
      up_proj=((d,), ('embed',), (f,), ('mlp',)),
      down_proj=((f,), ('mlp',), (d,), ('embed',)))


def attach(layers: nnx.Module, cfg: ModelConfig, key: Array) -> None:
  """Gives the stacked blocks `layers` (a `Decoder`'s) a fresh adapter (`initial`) on each of `cfg.lora_targets`;
  an adapter already there is replaced."""
  for target in cfg.lora_targets:
    _, in_names, _, out_names = shapes(cfg)[target]
    adapter = Adapter(*initial(cfg, target, key), in_names, out_names, cfg.lora_scale)
    setattr(getattr(layers, HOLDER[target]), suffix(target), adapter)


def target_of(path: tuple[str, ...]) -> tuple[str, str] | None:
  """(target, 'a' | 'b') of an adapter parameter's path in a `Decoder` (`layers/<holder>/<target>_lora/<a|b>`), else
  None."""
  if len(path) >= 2 and path[-1] in ('a', 'b') and path[-2].endswith('_lora') and path[-2][:-5] in TARGETS:
    return path[-2][:-5], path[-1]
  return None


def project(module: nnx.Module, target: str, equation: str, x: Array) -> Array:
  """x times `module`'s weight `target` (`jnp.einsum(equation)`, the weight cast to x's dtype), plus its adapter's
  s (x A) B when it has one."""
  y = jnp.einsum(equation, x, getattr(module, target)[...].astype(x.dtype))
  adapter = getattr(module, suffix(target), None)
  return y if adapter is None else y + adapter.delta(x)


def merged_weight(w: Array, a: Array, b: Array, s: float) -> Array:
  """W + s A B for one layer (W [*in, *out], A [*in, r], B [r, *out]), in float32, cast back to W's dtype."""
  delta = jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
  return (w.astype(jnp.float32) + jnp.float32(s) * delta).astype(w.dtype)
