"""drift: online learning; the problem distribution shifts every `period` learner steps (the demo's model).

    python -m sao_jax.main --config=configs/drift.py --workdir=/tmp/sao_drift     # `:PERIOD` sets the period

The demo's 0.14M-parameter model (`configs/arith.py`) is warm-started on a broad base rule (operands of 1-3 digits,
`+`, `-` and `*` by one digit, mixed), then trained by RL while the rule shifts every `period` learner steps
through sub-distributions of it: 3-digit `+`/`-` only, then products only, then 1-digit operands only, then back
to the base mix (and around again with `cycle`). Each shift moves the training and the held-out distribution at
once: the held-out greedy accuracy (logged every `trainer.eval_every` steps) is always on the current phase's own
held-out set, so a curve shows the drop at a shift and the recovery after it (`experiments/report.py` counts the
steps back to the pre-shift level). The current phase is logged as `drift/phase`.

Why sub-distributions of the warm start rather than new rules: probes of the demo's warm-started model (seed 0)
found it answers nothing it was not warm-started on (3-digit operands 0%, two operators 0%, 1-digit operands 6%,
an instruction in the prompt: too long), and a policy that never earns a reward cannot learn from it. Shifts among
skills it half has make every phase learnable by RL, and the cycle back to earlier phases shows forgetting.
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
              'min_digits=3,max_digits=3,ops=+-',  # 1: 3-digit sums and differences only.
              'ops=*',  # 2: products only (1-3 digits by one digit).
              'min_digits=1,max_digits=1',  # 3: 1-digit operands only, all operators.
              ),
      period=int(arg) if arg else 100,  # Phase length, in `unit`s.
      unit='steps',  # Learner steps (the warm start draws phase 0's problems: the base rule).
      cycle=True,  # After the last phase, start again from the first.
  ))
  c.task.kwargs.min_digits = 1  # Operand digits of the base rule: 1 ...
  c.task.kwargs.max_digits = 3  # ... to 3.
  c.task.eval_size = 200  # Held-out problems per phase (1-digit operands have 300 distinct problems).

  # ---- Lengths: 'Compute 999*9.' is 17 tokens with the chat markers, '18 18 18 1998\n#### 8991<|end|>' 25.
  c.sampler.max_new_tokens = 27  # The longest reply and its end token, and some slack.
  c.sampler.max_seq_len = 48  # Prompt + reply.
  c.sampler.prompt_buckets = (48,)  # One prompt shape: one compile.
  c.trainer.seq_buckets = (48,)  # One packed length: one compile of the learner step.

  # ---- RL under drift: a constant learning rate (a decaying one would stop adapting to later shifts).
  c.trainer.num_steps = 400  # Four phases of 100 steps.
  c.trainer.eval_every = 10  # Held-out accuracy of the current phase every 10 steps.
  c.trainer.checkpoint_every = 100
  c.optim.schedule = 'constant'
  c.optim.total_steps = 0  # No cosine.
  return c
