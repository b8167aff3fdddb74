"""math: problems from a file, rewarded by math-verify (LaTeX or plain answers).

Usage: `python -m sao_jax.main --config=configs/math.py[:DATA_FILE]` (default: the shipped 32-problem sample).
Field names: `--config.task.kwargs.layout=aime2025|hmmt|imo_answerbench|beyond_aime` or the *_field options.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'math'
  c.task.max_turns = 1  # Single turn.
  c.task.eval_size = 8  # Held out of the data file (or use eval_file).
  kwargs = dict(
      layout='custom',  # Field names below (problem / answer / id).
      problem_field='problem',  # Problem statement field.
      answer_field='answer',  # Reference answer field.
      id_field='id',  # Problem id field.
      verify_timeout_s=5.0,  # Hard limit of one math-verify check (worker killed after it).
      verify_workers=2,  # math-verify worker processes.
  )
  if arg:
    kwargs['data_file'] = arg  # Problems file (jsonl/json/csv/parquet).
  c.task.kwargs = ml_collections.ConfigDict(kwargs)
  c.sampler.max_new_tokens = 512  # Reasoning + \boxed{} answer.
  c.sampler.max_seq_len = 768  # Prompt + response.
  c.algo.eps_low, c.algo.eps_high = 0.3, 5.0  # SAO's math setting.
  return c
