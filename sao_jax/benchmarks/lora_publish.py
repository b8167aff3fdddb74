r"""Publishing a LoRA policy to the actors: what moves, what it costs, and merging against applying in the forward.

  python -m sao_jax.benchmarks.lora_publish [--model=smollm2-135m --rank=16 --rows=8 --cache=512 --reps=5]

Prints, for the policy with rank-r adapters on every projection:

  bytes      the full policy in decode layout (what a full-fine-tuning publish writes for the actors) against the
             adapters (what a LoRA publish moves: `WeightPublisher._lora_to_actors`), and their ratio; the parameter
             ratio of every named model at the same rank (from shapes);
  publish    per publish, the median wall time of the full conversion (`decode_weights` of the merged model, every
             weight read and re-laid-out) and of the LoRA merge on the actors' side (the base's decode layers plus
             s A B, after the base was copied once);
  forward    the other way to serve adapters: the decode step of `--rows` rows over a `--cache`-slot KV cache
             (`decode.forward`, one token a row), and the same step's extra work if the adapters were applied in
             the forward instead of merged: per token, every adapted projection's x A then (x A) B (timed as one
             jitted program over all layers, an estimate from below: a fused implementation pays at least this);
  break-even the decode steps per publish above which merging costs less than applying in the forward
             (merge time / per-step adapter time).

One device, random weights (shapes decide every figure). On a shared host the load moves them: the script prints it.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from sao_jax.generate import weights as weights_lib
from sao_jax.models import Decoder, decode, get_model_config
from sao_jax.models.config import MODEL_NAMES
from sao_jax.models import lora

_MODEL = flags.DEFINE_string('model', 'smollm2-135m', 'Named model config.')
_RANK = flags.DEFINE_integer('rank', 16, 'Adapter rank (every projection).')
_ROWS = flags.DEFINE_integer('rows', 8, 'Decode rows (tokens per step).')
_CACHE = flags.DEFINE_integer('cache', 512, 'KV cache slots of the decode step.')
_REPS = flags.DEFINE_integer('reps', 5, 'Timed repetitions (after one that compiles).')


def _median_s(fn, reps: int) -> float:
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(argv):
  del argv
  cfg = get_model_config(_MODEL.value).replace(lora_rank=_RANK.value, lora_targets=lora.TARGETS)
  reps = _REPS.value
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  for path, var in nnx.to_flat_state(nnx.state(model, lora.ADAPTERS)):  # As after training: B non-zero.
    if path[-1] == 'b':
      var[...] = 0.01 * jnp.ones_like(var[...])
  print(f'model {cfg.name}: {cfg.num_params() / 1e6:.1f}M params, rank-{cfg.lora_rank} adapters on '
        f'{", ".join(cfg.lora_targets)}; {jax.devices()[0].platform}; load average {os.getloadavg()[0]:.1f}')

  full = jax.jit(decode.decode_weights)
  merged = model.merged()
  full_weights = full(merged)
  adapters = nnx.state(model, lora.ADAPTERS)
  full_b, adapter_b = _nbytes(full_weights), _nbytes(adapters)
  print(f'bytes     full policy (decode layout) {full_b / 2 ** 20:.1f} MiB, adapters {adapter_b / 2 ** 20:.2f} MiB: '
        f'{full_b / adapter_b:.0f}x fewer per publish')

  sizes = []
  for name in MODEL_NAMES:  # From the shapes alone: the ratio grows with the width (r (in + out) against in x out).
    if get_model_config(name).is_moe:  # No LoRA on an MoE model yet (ModelConfig refuses it).
      continue
    named = get_model_config(name).replace(lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets)
    n_adapters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda c=named: Decoder(c, rngs=nnx.Rngs(0))), lora.ADAPTERS)))
    sizes.append(f'{name} {named.num_params() / n_adapters:.0f}x')
  print(f'          parameters / adapter parameters at rank {cfg.lora_rank}: {", ".join(sizes)}')

  publisher = weights_lib.WeightPublisher()
  publisher.publish(model, version=0)  # The base copied once, and the first merge compiled.
  full_s = _median_s(lambda: full(merged), reps)
  version = iter(range(1, 10 ** 6))

  def lora_publish():
    publisher.publish(model, version=next(version))
    return publisher.latest()[0].weights.layers

  merge_s = _median_s(lora_publish, reps)
  print(f'publish   full conversion {1e3 * full_s:.1f} ms, LoRA merge {1e3 * merge_s:.1f} ms per publish')

  rows, slots = _ROWS.value, _CACHE.value
  cache = decode.init_cache(cfg, rows, slots)
  cache = cache.replace(valid=cache.valid.at[:, : slots // 2].set(True), index=jnp.int32(slots // 2))
  tokens, valid = jnp.ones((rows, 1), jnp.int32), jnp.ones((rows, 1), bool)
  step = jax.jit(lambda w, c: decode.forward(cfg, w, c, tokens, valid)[0])
  step_s = _median_s(lambda: step(full_weights, cache), reps)
  stacked = decode.named_params(adapters, decode.LAYER_PATHS)
  shapes = lora.shapes(cfg)

  def adapter_work(stacked, x):  # Per layer and target: x A then (x A) B, one token a row.
    out = []
    for target in cfg.lora_targets:
      in_shape, _, out_shape, _ = shapes[target]
      xin = x[:, : int(np.prod(in_shape))].reshape(rows, *in_shape)
      for i in range(cfg.num_layers):
        xa = jnp.tensordot(xin, stacked[f'{target}_lora_a'][i], axes=len(in_shape))
        out.append(jnp.tensordot(xa, stacked[f'{target}_lora_b'][i], axes=1).sum())
    return jnp.stack(out).sum()

  x = jax.random.normal(jax.random.key(1), (rows, max(cfg.embed_dim, cfg.mlp_dim, cfg.num_heads * cfg.head_dim)))
  work = jax.jit(adapter_work)
  extra_s = _median_s(lambda: work(stacked, x), reps)
  print(f'forward   decode step ({rows} rows, {slots // 2} of {slots} slots) {1e3 * step_s:.2f} ms; adapters applied '
        f'in it would add >= {1e3 * extra_s:.2f} ms a step (+{100 * extra_s / step_s:.0f}%)')
  print(f'break-even merging is cheaper once a version serves more than {merge_s / extra_s:.0f} decode steps '
        f'({rows * merge_s / extra_s:.0f} tokens at {rows} rows)')


if __name__ == '__main__':
  app.run(main)
