"""drift: online learning; the arithmetic rule shifts every `period` training examples (or learner steps).

Usage: `python -m sao_jax.main --config=configs/drift.py[:PERIOD]` (default 200 examples per phase).
The current phase is logged as `drift/phase`; eval per phase measures adaptation after each shift.
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'drift'
  c.task.max_turns = 1  # Single turn.
  c.task.eval_size = 32  # Held-out problems per phase.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=1,  # Base rule: operand digits ...
      max_digits=2,  # ... up to 2.
      ops='+-*',  # Base operator set.
      answer_format='tag',  # Base answer format.
      phases=('ops=+-', 'ops=*', 'answer_format=boxed', 'min_digits=2,max_digits=3'),  # Rule per phase.
      period=int(arg) if arg else 200,  # Phase length, in `unit`s.
      unit='examples',  # 'examples' (drawn for training) or 'steps' (learner steps via set_step).
      cycle=True,  # Start over after the last phase.
  ))
  c.sampler.max_new_tokens = 16  # Short answers.
  c.sampler.max_seq_len = 128  # Prompt + answer.
  return c
