"""arith: synthetic integer arithmetic, the CPU demo task (tiny model, char tokenizer, single turn).

Usage: `python -m sao_jax.main --config=configs/arith.py[:MAX_DIGITS]` (default 2-digit operands).
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  max_digits = int(arg) if arg else 2
  c.task.name = 'arith'
  c.task.max_turns = 1  # Single turn: the answer is scored and the episode ends.
  c.task.eval_size = 64  # Held-out problems (a fixed stream, disjoint from training).
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=1,  # Fewest digits of an operand.
      max_digits=max_digits,  # Most digits of an operand (the `:arg`).
      min_ops=1,  # Fewest operators.
      max_ops=1,  # Most operators.
      ops='+-*',  # Operator set.
      answer_format='tag',  # <answer>N</answer>.
      strict=True,  # One integer answer, nothing after it.
      format_reward=0.0,  # Exact match only.
  ))
  c.sampler.max_new_tokens = 16  # '<answer>-9801</answer><|end|>' is 9 char tokens.
  c.sampler.max_seq_len = 128  # Prompt (~60 char tokens) + answer.
  return c
