"""imo: IMO-AnswerBench (short-answer olympiad problems), rewarded by math-verify.

Usage: `python -m sao_jax.main --config=configs/imo.py[:ANSWERBENCH_CSV]` with the benchmark's CSV
(`Problem ID, Problem, Short Answer, ...`); default: a 4-problem sample in that layout (for smoke tests).
A real run sets `--config.model.name=... --config.model.hf_dir=... --config.model.tokenizer=hf`.

`configs/imo.py:long[,ANSWERBENCH_CSV]`: the long-reasoning recipe a pod run would use: replies up to 31744
tokens in 32768-token episodes, the learner's rows packed (`trainer.pack='ffd'`: a long-tailed batch of lengths
costs its tokens, not its longest reply times its rows), every decoder block rematerialised, attention without
T x T scores (`model.attention_impl='auto'`: splash on TPU). Its memory per chip: `python -m sao_jax.tools.aot`
(docs/benchmarks/attention.md).
"""

import os

import ml_collections

from configs import base

_SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'sao_jax', 'envs', 'data',
                       'imo_answerbench_sample.csv')


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  long = arg == 'long' or (arg or '').startswith('long,')
  if long:
    arg = arg[len('long,'):] or None
  c = base.get_config()
  c.task.name = 'math'
  c.task.max_turns = 1  # Single turn.
  c.task.eval_size = 2  # Held out (use eval_file for a separate benchmark file).
  c.task.kwargs = ml_collections.ConfigDict(dict(
      data_file=arg or _SAMPLE,  # IMO-AnswerBench CSV/JSONL/Parquet.
      eval_file='',  # Separate eval problems ('' = hold out eval_size problems of data_file).
      layout='imo_answerbench',  # Fields: Problem ID / Problem / Short Answer.
      verify_timeout_s=10.0,  # Olympiad answers (sets, expressions) can take sympy a while.
      verify_workers=2,  # math-verify worker processes.
  ))
  c.sampler.max_new_tokens = 4096  # Long reasoning.
  c.sampler.max_seq_len = 5120  # Prompt + response.
  c.sampler.prompt_buckets = (256, 512, 1024)  # Olympiad statements are longer.
  c.trainer.seq_buckets = (1024, 2048, 4096, 5120)  # Row lengths.
  if long:
    c.sampler.max_new_tokens = 31744
    c.sampler.max_seq_len = 32768
    c.trainer.seq_buckets = (4096, 8192, 16384, 32768)
    # Slots of 32k-token KV caches: Qwen3-0.6B on v5e-64 (actors sharing the learner's chips) fits 2 a process,
    # not 8 (docs/benchmarks/aot.md, 2026-12-06).
    c.sampler.batch_size = 2
    c.trainer.pack = 'ffd'  # Several replies per row: a short one no longer pads to the longest's length.
    c.trainer.pack_segments = 16
    c.model.remat = 'full'  # Keep only each block's input for the backward.
    c.model.attention_impl = 'auto'
  return c
