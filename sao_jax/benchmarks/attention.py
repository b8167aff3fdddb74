r"""Memory (and time) of attention without T x T scores: the reference against flash, alone and in a learner step.

  python -m sao_jax.benchmarks.attention [--model=tiny --seqs=4096,16384 --impls=reference,flash --batch=1
                                          --chunk=64 --flash_block=512 --time_max=4096 --remat=none]

Two programs per sequence length T and implementation (`ModelConfig.attention_impl`), both jitted forward +
backward and compiled (nothing is allocated to read their memory: `compiled.memory_analysis()`):

- op: `models.attention.attention` alone, q [B, T, K, G, H], k/v [B, T, K, H] of the model's heads, two
  segments per row; loss sum(out * w), gradients w.r.t. q, k, v.
- step: one learner forward + backward of the model: `jax.value_and_grad` of the next-token loss
  -mean(token_logprobs) (chunked log-probs, `models.logprobs.token_logprobs`) w.r.t. the parameters, with
  segment ids of two packed sequences per row.

Printed per program: temporaries (`temp_size_in_bytes`: what the program allocates besides its arguments and
outputs, the activations kept for the backward included) and arguments + outputs; with T <= --time_max, the
median of 3 timed calls after one warm-up. 'reference' uses `--chunk` (the model's `attention_chunk`: query
chunks of the dense scores), 'flash' blocks of `--flash_block` queries and keys.

`--impls=scan_remat` (op program only) is the alternative flash's custom VJP was chosen over: the same online
softmax as `lax.scan`s differentiated by JAX, each query block and each key step under `jax.checkpoint` (a scan
cannot skip the blocks above the diagonal, so they are computed and masked).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from sao_jax.models import attention
from sao_jax.models import config as config_lib
from sao_jax.models import llama, logprobs

_MODEL = flags.DEFINE_string('model', 'tiny', 'Named model config (its heads shape the op program too).')
_SEQS = flags.DEFINE_list('seqs', ['4096', '16384'], 'Sequence lengths T.')
_IMPLS = flags.DEFINE_list('impls', ['reference', 'flash'], 'Attention implementations (ModelConfig.attention_impl).')
_BATCH = flags.DEFINE_integer('batch', 1, 'Rows per program.')
_CHUNK = flags.DEFINE_integer('chunk', 64, "The reference's query chunk (ModelConfig.attention_chunk).")
_FLASH_BLOCK = flags.DEFINE_integer('flash_block', attention.FLASH_BLOCK, "Flash's block (attention_chunk for it).")
_TIME_MAX = flags.DEFINE_integer('time_max', 4096, 'Time the programs with T up to this (0: compile only).')
_REMAT = flags.DEFINE_enum('remat', 'none', config_lib.REMAT_POLICIES, 'Remat policy of the blocks (step program).')
_PROGRAMS = flags.DEFINE_list('programs', ['op', 'step'], 'Which programs: op, step.')


def _segments(b: int, t: int) -> jax.Array:
  """Two packed sequences per row: segment 1 on the first 3/5 of the row, segment 2 on the rest."""
  return jnp.broadcast_to(jnp.where(jnp.arange(t) < 3 * t // 5, 1, 2).astype(jnp.int32), (b, t))


def _scan_remat_attention(q, k, v, seg, *, block: int):
  """Flash's forward as scans under `jax.checkpoint`, differentiated by JAX (T a multiple of `block`)."""
  b, t, kh, g, h = q.shape
  n, f32 = t // block, jnp.float32
  kb, vb, sb = (jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0) for x in (k, v, seg))

  @jax.checkpoint
  def query_block(_, xs):
    i, q_i, seg_i = xs

    @jax.checkpoint
    def key_block(carry, ys):
      m, l, acc = carry
      j, k_j, v_j, seg_j = ys
      s = jnp.einsum('btkgh,bskh->bkgts', q_i, k_j, preferred_element_type=f32) * h ** -0.5
      mask = attention.segment_mask(seg_i, seg_j, q_offset=(i - j) * block)[:, None, None]
      s = jnp.where(mask, s, -1e30)  # Before the exp: no inf in a masked entry's gradient.
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      return (m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum('bkgts,bskh->bkgth', p, v_j)), None

    init = (jnp.full((b, kh, g, block), -1e30, f32), jnp.zeros((b, kh, g, block), f32),
            jnp.zeros((b, kh, g, block, h), f32))
    (_, l, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(n), kb, vb, sb))
    return None, jnp.einsum('bkgth->btkgh', acc / l[..., None])

  qb = jnp.moveaxis(q.reshape(b, n, block, kh, g, h), 1, 0)
  _, out = jax.lax.scan(query_block, None, (jnp.arange(n), qb, sb))
  return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def _op_program(cfg: config_lib.ModelConfig, impl: str, b: int, t: int):
  """(jitted fn, args): value and gradients (q, k, v) of sum(attention(q, k, v) * w)."""
  kh, g, h = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, kh, g, h), jnp.float32)
  k, v = (jax.random.normal(key, (b, t, kh, h), jnp.float32) for key in keys[1:3])
  w = jax.random.normal(keys[3], q.shape, jnp.float32)
  chunk = cfg.attention_chunk

  def loss(q, k, v, seg, w):
    if impl == 'scan_remat':
      return jnp.sum(_scan_remat_attention(q, k, v, seg, block=chunk) * w)
    return jnp.sum(attention.attention(q, k, v, seg, chunk=chunk, impl=impl) * w)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, _segments(b, t), w)


def _step_program(cfg: config_lib.ModelConfig, impl: str, b: int, t: int):
  """(jitted fn, args): loss and parameter gradients of one learner forward + backward."""
  model = llama.Decoder(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size, jnp.int32)

  def loss(params, tokens, seg):
    lp = logprobs.token_logprobs(nnx.merge(graphdef, params), tokens, segment_ids=seg)
    return -jnp.mean(lp)

  return jax.jit(jax.value_and_grad(loss)), (params, tokens, _segments(b, t))


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(argv):
  del argv
  base = config_lib.get_model_config(_MODEL.value, remat=_REMAT.value)
  b = _BATCH.value
  print(f'devices: {jax.devices()}  model {base.name}: L={base.num_layers} D={base.embed_dim} N={base.num_heads} '
        f'K={base.num_kv_heads} H={base.head_dim}, batch {b}, remat={base.remat}, reference chunk {_CHUNK.value}, '
        f'flash block {_FLASH_BLOCK.value}')
  print('| program | T | impl | temporaries MiB | arguments + outputs MiB | compile s | time s |')
  print('|---|---|---|---|---|---|---|')
  programs = {'op': _op_program, 'step': _step_program}
  for name in _PROGRAMS.value:
    for t in (int(s) for s in _SEQS.value):
      for impl in _IMPLS.value:
        if impl == 'scan_remat' and name != 'op':
          continue
        chunk = _FLASH_BLOCK.value if impl in ('flash', 'scan_remat') else _CHUNK.value
        fn, args = programs[name](base.replace(attention_chunk=chunk), impl, b, t)
        t0 = time.perf_counter()
        compiled = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        io = mem.argument_size_in_bytes + mem.output_size_in_bytes
        run_s = '-'
        if t <= _TIME_MAX.value:
          jax.block_until_ready(compiled(*args))
          times = []
          for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
          run_s = f'{statistics.median(times):.2f}'
        print(f'| {name} | {t} | {impl} | {mem.temp_size_in_bytes / 2**20:,.1f} | {io / 2**20:,.1f} | '
              f'{compile_s:.1f} | {run_s} |', flush=True)
        del compiled, fn, args


if __name__ == '__main__':
  app.run(main)
