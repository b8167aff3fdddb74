"""Benchmark of the MoE layer's expert computation: `python -m sao_jax.benchmarks.moe [--tokens=M ...]`.

On one batch of M tokens x D (float32 by default) through one MoE layer (`sao_jax.models.moe.moe_mlp`: router, E
experts of width F, top-k, optional shared expert), times in the same run, jitted, compile excluded:
  - 'dropless': tokens sorted by expert, grouped matmuls (`moe.grouped_matmul`, each `--matmuls` form), no token
    dropped;
  - 'capacity' at each `--factors` value: per-expert buffers of ceil(factor M k / E) slots, batched matmuls;
each as a forward and as forward + backward (gradients of sum(y^2) w.r.t. x and every weight). Prints the median and
min wall time, the CPU time, the share of token-expert pairs the capacity dropped, the max difference between
dropless and a capacity large enough to drop nothing (a check), and the host's load (`os.getloadavg`): on a shared
host the min wall time is the figure least disturbed. Defaults are Qwen3-30B-A3B's router shape scaled down (E=128,
k=8, F/D = 0.375): D=512, F=192.
"""

from __future__ import annotations

import os
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.benchmarks import common
from sao_jax.models import moe
from sao_jax.models.config import ModelConfig

_TOKENS = flags.DEFINE_integer('tokens', 4096, 'Tokens M of the batch.')
_EMBED = flags.DEFINE_integer('embed', 512, 'Model width D.')
_EXPERTS = flags.DEFINE_integer('experts', 128, 'Routed experts E.')
_TOPK = flags.DEFINE_integer('topk', 8, 'Experts per token k.')
_MLP = flags.DEFINE_integer('moe_mlp_dim', 192, 'Expert hidden width F.')
_SHARED = flags.DEFINE_integer('shared', 0, 'Shared expert width multiple (0 = none).')
_ROUTER = flags.DEFINE_enum('router', 'softmax', ['softmax', 'sigmoid'], 'Router scoring.')
_FACTORS = flags.DEFINE_list('factors', ['1.25'], 'Capacity factors to time beside dropless.')
_MATMULS = flags.DEFINE_list('matmuls', ['auto'], "Dropless grouped matmuls to time ('auto', 'tiles', 'ragged_dot': "
                             'ragged_dot on a CPU is E dense products, minutes at the defaults).')
_REPEATS = flags.DEFINE_integer('repeats', 10, 'Timed calls of each program (after one warm-up).')
# (Not --dtype: the suite imports train_step, which defines it, into the same process.)
_DTYPE = flags.DEFINE_enum('compute_dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype of x and the weights.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the batch and weights.')


def make_layer(cfg: ModelConfig, tokens: int, dtype, seed: int = 0):
  """Random x [M, D] and one layer's parameters (router float32, experts in `dtype`)."""
  d, e, f = cfg.embed_dim, cfg.num_experts, cfg.moe_mlp_dim
  keys = iter(jax.random.split(jax.random.key(seed), 8))
  normal = lambda shape, scale: (scale * jax.random.normal(next(keys), shape, jnp.float32))
  p = dict(router=normal((d, e), d ** -0.5), gate_proj=normal((e, d, f), d ** -0.5).astype(dtype),
           up_proj=normal((e, d, f), d ** -0.5).astype(dtype), down_proj=normal((e, f, d), f ** -0.5).astype(dtype))
  if cfg.router_bias:
    p['router_bias'] = normal((e,), 0.1)
  if cfg.num_shared_experts:
    fs = f * cfg.num_shared_experts
    p.update(shared_gate_proj=normal((d, fs), d ** -0.5).astype(dtype),
             shared_up_proj=normal((d, fs), d ** -0.5).astype(dtype),
             shared_down_proj=normal((fs, d), fs ** -0.5).astype(dtype))
  return normal((tokens, d), 1.0).astype(dtype), p


def programs(cfg: ModelConfig):
  """(forward, forward + backward) jitted for `cfg` (its moe_impl and capacity_factor)."""
  fwd = jax.jit(lambda x, p: moe.moe_mlp(cfg, x, p))

  def loss(x, p):
    y, aux = moe.moe_mlp(cfg, x, p)
    return jnp.sum(jnp.square(y.astype(jnp.float32))), aux

  grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
  return fwd, grad


def main(argv):
  del argv
  dtype = jnp.dtype(_DTYPE.value)
  base = ModelConfig(vocab_size=8, embed_dim=_EMBED.value, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                     mlp_dim=8, num_experts=_EXPERTS.value, num_experts_per_tok=_TOPK.value,
                     moe_mlp_dim=_MLP.value, router_scoring=_ROUTER.value, router_bias=_ROUTER.value == 'sigmoid',
                     num_shared_experts=_SHARED.value, dtype=_DTYPE.value)
  m = _TOKENS.value
  x, p = make_layer(base, m, dtype, _SEED.value)
  print(f'devices: {jax.devices()}  load average (1, 5, 15 min): {os.getloadavg()}')
  print(f'MoE layer: M={m} tokens, D={base.embed_dim}, E={base.num_experts}, k={base.num_experts_per_tok}, '
        f'F={base.moe_mlp_dim}, shared={base.num_shared_experts}, router={base.router_scoring}, {dtype.name}; '
        f'expert FLOPs a forward {6 * m * base.num_experts_per_tok * base.embed_dim * base.moe_mlp_dim / 1e9:.2f} G')
  variants = [(f'dropless {mm}', base.replace(moe_matmul=mm)) for mm in _MATMULS.value] + [(f'capacity {float(c):g}', base.replace(moe_impl='capacity',
                                                                             capacity_factor=float(c)))
                                     for c in _FACTORS.value]
  rows, outputs = [], {}
  for name, cfg in variants:
    fwd, grad = programs(cfg)
    t0 = time.perf_counter()
    y, aux = jax.block_until_ready(fwd(x, p))
    jax.block_until_ready(grad(x, p))
    compile_s = time.perf_counter() - t0
    outputs[name] = y
    f_med, f_min, f_cpu = common.timings(lambda: fwd(x, p), _REPEATS.value)
    g_med, g_min, g_cpu = common.timings(lambda: grad(x, p), _REPEATS.value)
    slots = moe.capacity(cfg, m) if cfg.moe_impl == 'capacity' else None
    rows.append((name, slots, float(aux.dropped), compile_s, f_med, f_min, f_cpu, g_med, g_min, g_cpu))
  full = base.replace(moe_impl='capacity', capacity_factor=float(base.num_experts))  # Drops nothing.
  y_full = jax.jit(lambda x, p: moe.moe_mlp(full, x, p)[0])(x, p)
  for name in outputs:
    if name.startswith('dropless'):
      err = float(jnp.max(jnp.abs(y_full.astype(jnp.float32) - outputs[name].astype(jnp.float32))))
      print(f'check: max |{name} - capacity without drops| = {err:.2e}')
  print('| variant | slots/expert | dropped | compile s | fwd ms median (min, cpu) | fwd+bwd ms median (min, cpu) |')
  print('|---|---|---|---|---|---|')
  for name, slots, dropped, compile_s, f_med, f_min, f_cpu, g_med, g_min, g_cpu in rows:
    print(f'| {name} | {slots or "-"} | {dropped:.1%} | {compile_s:.1f} | {f_med * 1e3:.1f} ({f_min * 1e3:.1f}, '
          f'{f_cpu * 1e3:.1f}) | {g_med * 1e3:.1f} ({g_min * 1e3:.1f}, {g_cpu * 1e3:.1f}) |')
  drop = rows[0]
  for row in rows[1:]:
    print(f'{row[0]} / {drop[0]}: forward {row[5] / drop[5]:.2f}x, forward+backward {row[8] / drop[8]:.2f}x '
          '(min wall times; > 1: dropless faster)')
  print(f'load average after: {os.getloadavg()}')


if __name__ == '__main__':
  app.run(main)
