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
from absl import app, flags

from sao_jax.benchmarks import attention_programs as programs
from sao_jax.models import attention
from sao_jax.models import config as config_lib

_MODEL = flags.DEFINE_string('model', 'tiny', 'Named model config (its heads shape the op program too).')
_SEQS = flags.DEFINE_list('seqs', ['4096', '16384'], 'Sequence lengths T.')
_IMPLS = flags.DEFINE_list('impls', ['reference', 'flash'], 'Attention implementations (ModelConfig.attention_impl).')
_BATCH = flags.DEFINE_integer('batch', 1, 'Rows per program.')
_CHUNK = flags.DEFINE_integer('chunk', 64, "The reference's query chunk (ModelConfig.attention_chunk).")
_FLASH_BLOCK = flags.DEFINE_integer('flash_block', attention.FLASH_BLOCK, "Flash's block (attention_chunk for it).")
_TIME_MAX = flags.DEFINE_integer('time_max', 4096, 'Time the programs with T up to this (0: compile only).')
_REMAT = flags.DEFINE_enum('remat', 'none', config_lib.REMAT_POLICIES, 'Remat policy of the blocks (step program).')
_PROGRAMS = flags.DEFINE_list('programs', ['op', 'step'], 'Which programs: op, step.')


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
  builders = {'op': programs.op_program, 'step': programs.step_program}
  for name in _PROGRAMS.value:
    for t in (int(s) for s in _SEQS.value):
      for impl in _IMPLS.value:
        if impl == 'scan_remat' and name != 'op':
          continue
        chunk = _FLASH_BLOCK.value if impl in ('flash', 'scan_remat') else _CHUNK.value
        fn, args = builders[name](base.replace(attention_chunk=chunk), impl, b, t)
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
