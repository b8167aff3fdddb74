"""math: problems from a file, rewarded by math-verify (LaTeX or plain answers).

Usage: `python -m sao_jax.main --config=configs/math.py[:DATA_FILE]` (default: the shipped 32-problem sample).
Field names: `--config.task.kwargs.layout=aime2025|hmmt|imo_answerbench|beyond_aime` or the *_field options.
"""

import ml_collections

from configs import base
from sao_jax.envs import math_task


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'math'
  c.task.max_turns = 1  # Single turn.
  c.task.eval_size = 8  # Held out of the data file (or use eval_file).
  kwargs = dict(
      data_file=arg or math_task.DEFAULT_DATA,  # Problems file (jsonl/json/csv/parquet).
      eval_file='',  # Separate eval problems ('' = hold out eval_size problems of data_file).
      layout='custom',  # Field names below (problem / answer / id).
      problem_field='problem',  # Problem statement field.
      answer_field='answer',  # Reference answer field.
      id_field='id',  # Problem id field.
      verify_timeout_s=5.0,  # Hard limit of one math-verify check (worker killed after it).
      verify_workers=2,  # math-verify worker processes.
  )
  c.task.kwargs = ml_collections.ConfigDict(kwargs)  # Each kwarg settable: --config.task.kwargs.data_file=F.
  c.sampler.max_new_tokens = 512  # Reasoning + \boxed{} answer.
  c.sampler.max_seq_len = 768  # Prompt + response.
  return c
