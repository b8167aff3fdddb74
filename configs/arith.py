"""arith: synthetic integer arithmetic, the CPU demo (the README's first command).

    python -m sao_jax.main --config=configs/arith.py --workdir=/tmp/sao_run

The 0.14M-parameter `demo` decoder (char tokenizer), randomly initialised, learns 2-digit `+`, `-` and 2-digit by
1-digit `*` on a 2-core CPU: a supervised warm start on task-generated solutions (`config.sft`), then SAO. The
held-out greedy accuracy (step 0 = after the warm start; `sft/eval_accuracy_before` = the random model's) is in
WORKDIR/metrics.jsonl. The reward is 1 exactly when the reply ends with '#### N', N the true value; the reply
before it is the config's choice: the warm start teaches a scratchpad line (`scratchpad='partials'`: the answer's
digits least-significant first, a product's partial products first, e.g. "Compute 47*8." -> "65 23 673\n#### 376"),
the order carries flow in (answer alone 37%, reversed 77%, partials 94%: docs/benchmarks/demo.md).

`:N` sets the operands of `+` and `-` to N digits (default 2; the settings below are tuned for 2).
"""

import ml_collections

from configs import base


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  digits = int(arg) if arg else 2
  c.model.name = 'demo'  # 2 layers, width 64, vocabulary 128 (the char tokenizer's 111 tokens).
  c.task.name = 'arith'
  c.task.max_turns = 1  # Single turn: the answer is scored and the episode ends.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      min_digits=digits,  # Operands of `+`, `-` and the left factor of `*`: exactly `digits` digits.
      max_digits=digits,  # Most digits of an operand (the `:arg`).
      mul_max_digits=1,  # Right factor of `*`: 1 digit (0-9), so 2-digit by 1-digit products.
      min_ops=1,  # Fewest operators.
      max_ops=1,  # Most operators.
      ops='+-*',  # Operator set, mixed uniformly.
      answer_format='hash',  # The reply ends with '#### N' (text before it allowed: the scratchpad line).
      strict=True,  # Exactly one '#### N' with an integer literal, nothing after it.
      scratchpad='partials',  # Warm-start replies: partial products of a '*', the answer reversed, then it.
      instruct_format=False,  # The prompt is 'Compute 47+38.' (the warm start teaches the format).
      format_reward=0.0,  # Exact match only.
  ))

  # ---- Lengths: '<|user|>Compute 99*9.<|end|><|assistant|>' is 16 char tokens, '18 18 198\n#### 891<|end|>' 19.
  c.sampler.max_new_tokens = 21  # Room for the longest reply and its end token, and some slack.
  c.sampler.max_seq_len = 40  # Prompt + reply.
  c.sampler.prompt_buckets = (40,)  # One prompt shape: one compile.
  c.trainer.seq_buckets = (40,)  # One packed length: one compile of the learner step.

  # ---- Supervised warm start: stopped early on purpose, so that SAO does a measurable share of the rise (1000
  # steps reach ~94% alone; at 750 the level varies too much with the seed: docs/benchmarks/demo.md).
  c.sft.steps = 850  # Cross-entropy steps on task-generated solutions.
  c.sft.batch_size = 64  # Problems per step (a fresh problem for every row).
  c.sft.lr = 2e-3  # Peak learning rate (5e-3 learned slower, 1e-3 no faster: docs/benchmarks/demo.md).
  c.sft.warmup_steps = 20  # Linear warmup.
  c.sft.schedule = 'constant'  # No decay: a cosine-annealed one left SAO nothing to gain (docs/benchmarks/demo.md).
  c.sft.log_every = 100  # Loss lines.

  # ---- SAO.
  c.trainer.mode = 'async'  # Sampler thread + queue, the learner updates as soon as a batch is there.
  c.trainer.batch_size = 64  # Trajectories per learner step.
  c.trainer.num_steps = 400  # Learner steps (the probes gained little after 250: docs/benchmarks/demo.md).
  c.trainer.max_staleness = 4  # Drop trajectories more than 4 versions behind the learner (none are: lag is 1).
  c.trainer.queue_size = 64  # One sampler call of room: trajectories lag the learner by one version (128: two,
  # which destabilised a probe: docs/benchmarks/demo.md).
  c.task.eval_size = 500  # Held-out problems (a fixed stream, never trained on); 200 gave +-3 points of noise.
  c.trainer.eval_every = 50  # Held-out greedy accuracy every 50 steps (and at the end).
  c.trainer.checkpoint_every = 100  # Learner steps between checkpoints (a killed run resumes).
  c.sampler.batch_size = 64  # Episodes per sampler call (one learner batch).
  c.sampler.num_threads = 1  # One sampler thread (2 cores: the learner has the other).
  c.sampler.continuous = False  # Static calls: single-turn replies of <= 21 tokens leave continuous batching little
  # to win, and its slot programs (up to ~50, against 2) cost minutes of CPU compile (docs/benchmarks/demo.md).
  c.optim.actor_lr = 2e-4  # A 0.14M-parameter model takes larger steps than SAO's 1e-6 (1e-4 barely moved, >= 4e-4
  # fell back or collapsed: docs/benchmarks/demo.md).
  c.optim.schedule = 'cosine'  # Decay to lr * end_lr_factor over the run (the critic's K=2 updates per step
  # reach its floor halfway).
  c.optim.total_steps = 400  # Cosine horizon of both optimizers (0 = each one's own updates in the run).
  c.optim.end_lr_factor = 0.1  # Floor of the decay.
  c.optim.critic_lr = 1e-3  # Critic (value head from zero, backbone from the warm-started policy).
  return c
