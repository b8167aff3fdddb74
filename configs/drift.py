"""drift: online learning; the problem distribution shifts every `period` learner steps (the demo's model).

    python -m sao_jax.main --config=configs/drift.py --workdir=/tmp/sao_drift     # `:PERIOD` sets the period

The demo's model (`configs/arith.py`) is warm-started on a broad base rule (operands of 1-3 digits, `+`, `-` and
`*` by one digit), then trained by RL while the rule moves every `period` learner steps through phases: the base
mix, 2-digit sums and differences, products of 2-3 digits by one digit, and around again (`cycle`). The held-out
greedy accuracy is always on the current phase's own held-out set (the phase: `drift/phase`), so a curve shows
the level at a shift, the recovery after it, and on the return to the base mix what specialising cost. Phases
are sub-distributions of the warm start, not new rules: the warm-started model answers almost nothing it was not
warm-started on, and a policy that never earns a reward cannot learn from it; each phase has thousands of
distinct problems, or the policy memorises them (docs/benchmarks/demo.md).
"""

import ml_collections

from configs import arith


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = arith.get_config()  # The demo's model, tokenizer, warm start and SAO settings; changes below.
  c.task.name = 'drift'
  c.task.kwargs = ml_collections.ConfigDict(dict(
      **c.task.kwargs.to_dict(),
      # Base rule (the warm start's, and phase 0's): operands of 1-3 digits, products by one digit.
      phases=('ops=+-*',  # 0: the base mix.
              'min_digits=2,max_digits=2,ops=+-',  # 1: 2-digit sums and differences only.
              'min_digits=2,max_digits=3,ops=*',  # 2: products of 2-3 digits by one digit only.
              ),
      period=int(arg) if arg else 100,  # Phase length, in `unit`s.
      unit='steps',  # Learner steps (the warm start draws phase 0's problems: the base rule).
      cycle=True,  # After the last phase, start again from the first.
  ))
  c.task.kwargs.min_digits = 1  # Operand digits of the base rule: 1 ...
  c.task.kwargs.max_digits = 3  # ... to 3.
  c.task.eval_size = 200  # Held-out problems per phase.

  # ---- Lengths: 'Compute 999*9.' is 17 tokens with the chat markers, '18 18 18 1998\n#### 8991<|end|>' 25.
  c.sampler.max_new_tokens = 27  # The longest reply and its end token, and some slack.
  c.sampler.max_seq_len = 48  # Prompt + reply.
  c.sampler.prompt_buckets = (48,)  # One prompt shape: one compile.
  c.trainer.seq_buckets = (48,)  # One packed length: one compile of the learner step.

  # ---- RL under drift: a constant learning rate (a decaying one would stop adapting to later shifts).
  c.trainer.num_steps = 400  # Phases 0, 1, 2 and 0 again, 100 steps each.
  c.trainer.eval_every = 10  # Held-out accuracy of the current phase every 10 steps.
  c.trainer.checkpoint_every = 100
  c.optim.schedule = 'constant'
  c.optim.total_steps = 0  # No cosine.
  return c
