"""code: write a Python function, hidden unit tests run in the bubblewrap sandbox, up to N attempts.

Usage: `python -m sao_jax.main --config=configs/code.py[:DATA_FILE]` (default: the shipped sample problems).
A real run sets `--config.model.name=... --config.model.hf_dir=... --config.model.tokenizer=hf`.
"""

import ml_collections

from configs import base
from sao_jax.envs import code


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'code'
  c.task.max_turns = 3  # Attempts: each failed attempt's test report is the next observation.
  c.task.eval_size = 4  # Held-out problems (the sample has 22).
  kwargs = dict(
      data_file=arg or code.DEFAULT_DATA,  # Problems file (jsonl/json/csv/parquet).
      eval_file='',  # Separate eval problems ('' = hold out eval_size problems of data_file).
      reward='all',  # 1 iff every hidden test passes ('fraction' = share passed).
      feedback='inputs',  # Show failing inputs and outputs, not expected values.
      timeout_s=10.0,  # Wall clock per attempt.
      per_test_timeout_s=2.0,  # Per test.
      cpu_s=5,  # RLIMIT_CPU per attempt.
      memory_mb=512,  # RLIMIT_AS per attempt.
      isolation='bwrap',  # Required; unshare or rlimits only by name (weaker, warned at start).
  )
  c.task.kwargs = ml_collections.ConfigDict(kwargs)  # Each kwarg settable: --config.task.kwargs.data_file=F.
  c.sampler.max_new_tokens = 256  # Per attempt.
  c.sampler.max_seq_len = 1024  # Prompt + attempts + test reports.
  c.algo.domain = 'agentic'  # The presets' agentic setting (SAO: band (0.8, 3.0)).
  return c
