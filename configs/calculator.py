"""calculator: multi-turn tool use (`<calc>expr</calc>` -> `<result>v</result>`); exercises skip-obs GAE.

Usage: `python -m sao_jax.main --config=configs/calculator.py[:MAX_TURNS]` (default 4 turns).
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'calculator'
  c.task.max_turns = int(arg) if arg else 4  # Tool calls + the final answer.
  c.task.eval_size = 64  # Held-out problems.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=3,  # Operands of 3-4 digits: hard by heart, easy with the tool.
      max_digits=4,  # Most digits of an operand.
      min_ops=2,  # Fewest operators.
      max_ops=2,  # Most operators.
      ops='+-*',  # Operator set.
      answer_format='tag',  # Final answer as <answer>N</answer>.
      observation_mode='inline',  # Results appended inside the assistant's stream (stop at </calc>).
      format_reward=0.0,  # Exact match only.
  ))
  c.sampler.max_new_tokens = 48  # Per turn.
  c.sampler.max_seq_len = 512  # Whole episode: prompt (~220 char tokens) + turns + observations.
  c.algo.domain = 'agentic'  # The presets' agentic setting (SAO: band (0.8, 3.0)).
  return c
