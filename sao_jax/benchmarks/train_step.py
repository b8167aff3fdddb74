r"""Train-step throughput and model FLOP utilisation (MFU) of the decoder on this machine.

  python -m sao_jax.benchmarks.train_step [--model=bench-25m --batch=16 --seq=512 --steps=5 --loss=chunked
                                           --microbatches=4]

One step = forward + backward + AdamW update of a next-token cross-entropy loss over the whole batch, jitted,
params and optimizer state donated. By default the batch's gradient is accumulated over 4 microbatches of 4
sequences (`lax.scan`; one AdamW update per step, as without accumulation): on a 2-core CPU the smaller
activations stay in cache, and the step is faster than `--microbatches=1` (docs/benchmarks/learner.md). Reported:

  tokens/s = batch * seq / step_time
  model FLOP/s = tokens/s * flops_per_token,  flops_per_token = 6 * N_matmul + 12 * L * N_heads * H * seq / 2
      (N_matmul: every weight used in a matmul, the lm head included, the embedding gather not; the second
      term is QK^T and AV over the causal half of the context: PaLM appendix B)
  MFU = model FLOP/s / peak,  peak = best float32 FLOP/s of a jitted jnp.dot on 2048^2 and 4096^2 matrices,
      measured in the same run (before and after the train steps; the best is used).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from sao_jax.benchmarks.common import matmul_peak
from sao_jax.models import config as config_lib
from sao_jax.models import llama, logprobs

_MODEL = flags.DEFINE_string('model', 'bench-25m', 'Named model config.')
_BATCH = flags.DEFINE_integer('batch', 16, 'Sequences per step.')
_SEQ = flags.DEFINE_integer('seq', 512, 'Tokens per sequence.')
_STEPS = flags.DEFINE_integer('steps', 5, 'Timed steps (after one compile + warm-up step).')
_LOSS = flags.DEFINE_enum('loss', 'full', ['full', 'chunked'],
                          "'full': logits [B,T,V] + log_softmax; 'chunked': models.logprobs.token_logprobs.")
_REMAT = flags.DEFINE_enum('remat', 'none', config_lib.REMAT_POLICIES, 'Remat policy of the blocks.')
_SCAN = flags.DEFINE_bool('scan_layers', False, 'lax.scan over layers (default: unrolled, 7 layers compile fast).')
_MICRO = flags.DEFINE_integer(
    'microbatches', 4, 'Gradient accumulation over this many microbatches per step (1 = the whole batch at once).')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Compute dtype.')


def make_step(model: llama.Decoder, tx: optax.GradientTransformation, loss_kind: str, microbatches: int = 1):
  """A jitted, donated (params, opt_state, tokens) -> (params, opt_state, loss) AdamW step.

  With `microbatches` = m > 1 the batch is split into m microbatches whose gradients are accumulated in a
  `lax.scan` (same update as the whole batch at once, smaller activations) before the one AdamW update.
  """
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(params, tokens):
    m = nnx.merge(graphdef, params)
    if loss_kind == 'chunked':
      lp = logprobs.token_logprobs(m, tokens, chunk_size=128)
    else:
      lp = logprobs.token_logprobs_from_logits(m(tokens), tokens)
    return -jnp.mean(lp[:, 1:])

  def grad_fn(params, tokens):
    if microbatches == 1:
      return jax.value_and_grad(loss_fn)(params, tokens)
    mbs = tokens.reshape(microbatches, -1, *tokens.shape[1:])

    def accumulate(acc, mb):
      loss, grads = jax.value_and_grad(loss_fn)(params, mb)
      return jax.tree.map(jnp.add, acc, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(accumulate, zeros, mbs)
    return jax.tree.map(lambda x: x / microbatches, total)

  def step(params, opt_state, tokens):
    loss, grads = grad_fn(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1)), params


def main(argv):
  del argv
  cfg = config_lib.get_model_config(_MODEL.value, remat=_REMAT.value, scan_layers=_SCAN.value, dtype=_DTYPE.value)
  b, t = _BATCH.value, _SEQ.value
  if _MICRO.value < 1 or b % _MICRO.value:
    raise app.UsageError(f'--microbatches={_MICRO.value} must be >= 1 and divide --batch={b}.')
  print(f'devices: {jax.devices()}  model {cfg.name}: {cfg.num_params() / 1e6:.1f}M params '
        f'(L={cfg.num_layers} D={cfg.embed_dim} N={cfg.num_heads} K={cfg.num_kv_heads} F={cfg.mlp_dim} '
        f'V={cfg.vocab_size}), batch {b} x {t} in {_MICRO.value} microbatches, loss={_LOSS.value}, remat={cfg.remat}, '
        f'scan={cfg.scan_layers}, dtype={cfg.dtype}')
  peak0, per0 = matmul_peak()
  model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
  tx = optax.adamw(1e-4, weight_decay=0.01)
  step, params = make_step(model, tx, _LOSS.value, _MICRO.value)
  opt_state = tx.init(params)
  tokens = jax.random.randint(jax.random.key(2), (b, t), 0, cfg.vocab_size, jnp.int32)
  t0 = time.perf_counter()
  params, opt_state, loss = step(params, opt_state, tokens)
  loss.block_until_ready()
  compile_s = time.perf_counter() - t0
  params, opt_state, loss = step(params, opt_state, tokens)  # Warm-up.
  loss.block_until_ready()
  times = []
  for _ in range(_STEPS.value):
    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, tokens)
    loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  peak1, per1 = matmul_peak()
  peak = max(peak0, peak1)
  step_s = float(np.median(times))
  best_s = float(np.min(times))
  fpt = cfg.flops_per_token(t)
  tok_s = b * t / step_s
  print('matmul peak float32: ' + ', '.join(f'{n}^2: {max(per0[n], per1[n]) / 1e9:.1f} GFLOP/s' for n in per0))
  print(f'first call (compile + step): {compile_s:.1f} s; loss {float(loss):.3f}')
  print(f'step time median {step_s * 1e3:.0f} ms (best {best_s * 1e3:.0f} ms) over {len(times)} steps')
  print(f'model FLOPs per token: {fpt / 1e6:.1f} MFLOP')
  print('| model | batch x seq | tokens/s | model GFLOP/s | peak GFLOP/s | MFU (median) | MFU (best step) |')
  print(f'| {cfg.name} | {b} x {t} | {tok_s:,.0f} | {tok_s * fpt / 1e9:.1f} | {peak / 1e9:.1f} | '
        f'{tok_s * fpt / peak:.1%} | {b * t / best_s * fpt / peak:.1%} |')


if __name__ == '__main__':
  app.run(main)
