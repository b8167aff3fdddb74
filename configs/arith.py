"""arith: synthetic integer arithmetic, the CPU demo (the README's first command).

    python -m sao_jax.main --config=configs/arith.py --workdir=/tmp/sao_run

A 0.14M-parameter decoder (`model.name='demo'`, char tokenizer), randomly initialised, learns 2-digit `+` and `-`
and 2-digit by 1-digit `*`, mixed, on a 2-core CPU: a short supervised warm start on task-generated solutions
(`config.sft`), then SAO (async, single rollout, critic initialised from the warm-started policy, K=2, frozen
attention, critic warmup). The held-out greedy accuracy is logged at step 0 (after the warm start; the step-0
row also holds `sft/eval_accuracy_before`, the random model's), every `trainer.eval_every` steps and at the end,
in WORKDIR/metrics.jsonl.

The reply format is the config's choice (the problem and the reward are not): the reward is 1 exactly when the
reply ends with '#### N' and N is the true value. The warm start teaches a scratchpad line before it
(`scratchpad='partials'`): the digits of the answer least-significant first, and for a product the partial
products first, e.g. "Compute 47+38." -> "58\n#### 85", "Compute 47*8." -> "65 23 673\n#### 376" (7*8 = 56,
4*8 = 32, written reversed). Measured in probes (seed 0, same model and 600-1000 warm-start steps), the answer
alone ('plain') reached 37% after 1000 steps, the reversed answer 77%, partials 94%: a tiny model adds digits
in the order carries flow, and the products' tens digit (the one the reversed answer still got wrong) becomes a
sum of visible digits. RL may change the scratchpad; only the final answer is scored.

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

  # ---- Supervised warm start: it stops early on purpose, so that SAO does a measurable share of the rise (1000
  # steps reach about 94% alone). Seeds differ: 750 steps gave 83% (seed 0) and 67% (seed 1, which SAO then
  # took to 81% only); seed 0 gave 59% at 600, 77% at 700, 86% at 800.
  c.sft.steps = 850  # Cross-entropy steps on task-generated solutions.
  c.sft.batch_size = 64  # Problems per step (a fresh problem for every row).
  c.sft.lr = 2e-3  # Peak learning rate (5e-3 learned slower in probes, 1e-3 about as fast).
  c.sft.warmup_steps = 20  # Linear warmup.
  c.sft.schedule = 'constant'  # No decay: a cosine-annealed warm start left SAO nothing to gain in a probe.
  c.sft.log_every = 100  # Loss lines.

  # ---- SAO.
  c.trainer.mode = 'async'  # Sampler thread + queue, the learner updates as soon as a batch is there.
  c.trainer.batch_size = 64  # Trajectories per learner step.
  c.trainer.num_steps = 400  # Learner steps (about 0.6 s each on 2 cores: the learner's 5 passes set the pace);
  # probes gained most in the first 50-100 steps and little after 250.
  c.trainer.max_staleness = 4  # Drop trajectories more than 4 versions behind the learner (none are: lag is 1).
  c.trainer.queue_size = 64  # One sampler call of room: trajectories lag the learner by one version (128: two,
  # and a probe at actor lr 5e-4 collapsed as the behaviour log-probs drifted from the policy).
  c.task.eval_size = 500  # Held-out problems (a fixed stream, never trained on); 200 gave +-3% of noise.
  c.trainer.eval_every = 50  # Held-out greedy accuracy every 50 steps (and at the end); about 2 s each.
  c.trainer.checkpoint_every = 100  # Learner steps between checkpoints (a killed run resumes).
  c.sampler.batch_size = 64  # Episodes per sampler call (one learner batch).
  c.sampler.num_threads = 1  # One sampler thread (2 cores: the learner has the other).
  c.sampler.continuous = False  # Static calls: single-turn replies of <= 21 tokens leave continuous batching little
  # to win (1.1x on generation) and its up to ~50 slot programs cost minutes of compile on this CPU (a 30-step
  # probe: 1.59 s/step continuous vs 0.94 static, the difference compiles), against 2 static programs.
  c.optim.actor_lr = 2e-4  # A 0.14M-parameter model takes larger steps than SAO's 1e-6 (probes: 1e-4 barely
  # moved, 4e-4 and 6e-4 rose slower and fell back, 5e-4 collapsed).
  c.optim.schedule = 'cosine'  # Decay to lr * end_lr_factor over the run (the critic's K=2 updates per step
  # reach its floor halfway).
  c.optim.total_steps = 400  # Cosine horizon of both optimizers (as measured; 0 = each one's updates in the run).
  c.optim.end_lr_factor = 0.1  # Floor of the decay.
  c.optim.critic_lr = 1e-3  # Critic (value head from zero, backbone from the warm-started policy).
  return c
