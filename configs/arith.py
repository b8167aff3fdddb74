"""arith: synthetic integer arithmetic, the CPU demo (the README's first command).

    python -m sao_jax.main --config=configs/arith.py --workdir=/tmp/sao_run

A 0.14M-parameter decoder (`model.name='demo'`, char tokenizer), randomly initialised, learns 2-digit `+` and `-`
and 2-digit by 1-digit `*`, mixed ("Compute 47+38." -> "85"), on a 2-core CPU: a short supervised warm start
on task-generated solutions (`config.sft`), then SAO (async, single rollout, critic initialised from the
warm-started policy, K=2, frozen attention, critic warmup). The held-out greedy accuracy is logged at step 0
(after the warm start; the step-0 row also holds `sft/eval_accuracy_before`, the random model's), every
`trainer.eval_every` steps and at the end, in WORKDIR/metrics.jsonl.

`:N` sets the operands of `+` and `-` to N digits (default 2; the demo's settings are tuned for 2).
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  digits = int(arg) if arg else 2
  c.model.name = 'demo'  # 2 layers, width 64, vocabulary 128 (the char tokenizer's 111 tokens).
  c.task.name = 'arith'
  c.task.max_turns = 1  # Single turn: the answer is scored and the episode ends.
  c.task.eval_size = 200  # Held-out problems (a fixed stream, never trained on: excluded from training).
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=digits,  # Operands of `+`, `-` and the left factor of `*`: exactly `digits` digits.
      max_digits=digits,  # Most digits of an operand (the `:arg`).
      mul_max_digits=1,  # Right factor of `*`: 1 digit (0-9), so 2-digit by 1-digit products.
      min_ops=1,  # Fewest operators.
      max_ops=1,  # Most operators.
      ops='+-*',  # Operator set, mixed uniformly.
      answer_format='plain',  # The reply is the integer alone, e.g. '85'.
      strict=True,  # Exactly one integer literal, nothing else.
      instruct_format=False,  # The prompt is 'Compute 47+38.' (the warm start teaches the format).
      format_reward=0.0,  # Exact match only.
  ))

  # ---- Lengths: '<|user|>Compute 99-99.<|end|><|assistant|>' is 17 char tokens, '-99<|end|>' 4.
  c.sampler.max_new_tokens = 6  # Room for the longest answer and its end token, and some slack.
  c.sampler.max_seq_len = 24  # Prompt + answer.
  c.sampler.prompt_buckets = (24,)  # One prompt shape: one compile.
  c.trainer.seq_buckets = (24,)  # One packed length: one compile of the learner step.

  # ---- Supervised warm start.
  c.sft.steps = 1000  # Cross-entropy steps on task-generated solutions (the format and a start on the sums).
  c.sft.batch_size = 64  # Problems per step (a fresh problem for every row).
  c.sft.lr = 2e-3  # Peak learning rate (5e-3 learned slower in probes, 1e-3 about as fast).
  c.sft.warmup_steps = 20  # Linear warmup.
  c.sft.log_every = 100  # Loss lines.

  # ---- SAO.
  c.trainer.mode = 'async'  # Sampler thread + queue, the learner updates as soon as a batch is there.
  c.trainer.batch_size = 64  # Trajectories per learner step.
  c.trainer.num_steps = 150  # Learner steps.
  c.trainer.max_staleness = 4  # Drop trajectories more than 4 versions behind the learner.
  c.trainer.queue_size = 128  # Two sampler calls of room.
  c.trainer.eval_every = 25  # Held-out greedy accuracy every 25 steps (and at the end).
  c.trainer.checkpoint_every = 50  # Learner steps between checkpoints (a killed run resumes).
  c.sampler.batch_size = 64  # Episodes per sampler call.
  c.sampler.num_threads = 1  # One sampler thread (2 cores: the learner has the other).
  c.optim.actor_lr = 1e-4  # A 0.14M-parameter model takes larger steps than SAO's 1e-6 (1e-3 lost accuracy).
  c.optim.critic_lr = 1e-3  # Critic (value head from zero, backbone from the warm-started policy).
  return c
