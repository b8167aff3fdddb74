"""swe: agentic coding in the style of SWE-bench: a repository in the sandbox, tools over many turns, hidden tests.

    python -m sao_jax.main --config=configs/swe.py --workdir=/tmp/sao_swe \
        --config.model.name=qwen2.5-0.5b --config.model.hf_dir=DIR --config.model.tokenizer=hf
    python -m sao_jax.main --config=configs/swe.py:runlocal --workdir=/tmp/sao_swe_smoke   (tiny model, 2 steps)
    python -m sao_jax.main --config=configs/swe.py --workdir=/tmp/sao_swe --dry_run   (checks the config, reads every
        instance)

Instances: the shipped synthetic set (`sao_jax/envs/data/swe_synthetic.jsonl`, made by `python -m
sao_jax.envs.swe_gen`) or any SWE-bench-format JSONL whose repositories are local directories
(`--config.task.kwargs.data_file=F --config.task.kwargs.repos_root=DIR`; sao_jax/envs/README.md). The model
works through Hermes tool calls (view, search, edit, create, run, test, submit); each tool result is an
observation message (non-action tokens: the skip-observation GAE jumps over them); after submit, or on the
last turn, the hidden FAIL_TO_PASS and PASS_TO_PASS tests run in a fresh bubblewrap sandbox: reward 1 when all
pass. SAO's agentic band (eps_low, eps_high) = (0.8, 3.0).
"""

import ml_collections

from configs import base
from sao_jax.envs import swe


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  c = base.get_config()
  c.task.name = 'swe'
  c.task.max_turns = 16  # Model turns (tool-call rounds) per episode; the last one scores the tree.
  c.task.eval_size = 8  # Held-out instances of data_file.
  c.task.step_timeout_s = 180.0  # Backstop of one env step (the verdict's own limit is verdict_timeout_s).
  c.task.kwargs = ml_collections.ConfigDict(dict(
      data_file=swe.DEFAULT_DATA,  # SWE-bench-format JSONL (default: 40 shipped synthetic instances).
      eval_file='',  # Separate eval instances ('' = hold out eval_size of data_file).
      repos_root='',  # Local repositories (<repos_root>/<repo>) of rows without repo_files.
      reward='all',  # 1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes ('fraction' = share passed).
      instructions='full',  # Tool descriptions in a system message ('brief': one line; 'none').
      observation_role='tool',  # Chat role of tool results.
      max_observation_chars=3000,  # A turn's tool results are cut to this, with a note.
      score_at_turn_limit=True,  # The last turn scores the tree (terminal); False: a truncated cut.
      budget_ends_turn=False,  # A turn cut by max_new_tokens: True goes on (an error observation); False ends it.
      command_timeout_s=20.0,  # Wall clock of one run / test call.
      per_test_timeout_s=5.0,  # Wall clock of one test.
      verdict_timeout_s=120.0,  # Wall clock of the verdict.
      cpu_s=10,  # RLIMIT_CPU per sandboxed process.
      memory_mb=1024,  # RLIMIT_AS per sandboxed process.
      tmpfs_mb=64,  # The sandbox's /tmp, where the repository copy lives.
      isolation='bwrap',  # Required; unshare or rlimits only by name (weaker, warned at start).
      max_concurrent=4,  # Sandboxes at once (tools and verdicts each).
  ))
  c.algo.domain = 'agentic'  # The presets' agentic setting: SAO's band (eps_low, eps_high) = (0.8, 3.0).

  c.sampler.max_new_tokens = 512  # Per turn: a tool call (an edit or a whole file).
  c.sampler.max_seq_len = 8192  # Whole episode: instructions, issue, turns and tool results.
  c.sampler.prompt_buckets = (512, 1280)  # Instructions and an issue: ~300 BPE tokens, <= 1054 char tokens.
  c.sampler.batch_size = 16  # Episodes at once (their tool calls overlap; the sandbox runs max_concurrent).
  c.trainer.batch_size = 16  # Trajectories per learner step.
  c.trainer.seq_buckets = (2048, 4096, 8192)  # Packed lengths.
  c.trainer.queue_size = 32  # Two sampler calls.
  if arg == 'runlocal':  # A smoke run: the random tiny model, char tokens, two learner steps.
    c.model.name = 'tiny'
    c.model.hf_dir = ''
    c.model.tokenizer = 'char'
    c.task.max_turns = 3
    c.task.eval_size = 2
    c.task.kwargs.instructions = 'brief'  # The issue and one line of tools (the char prompts fit 384).
    c.sampler.max_new_tokens = 32
    c.sampler.max_seq_len = 512
    c.sampler.prompt_buckets = (384,)
    c.sampler.batch_size = 4
    c.trainer.batch_size = 4
    c.trainer.seq_buckets = (512,)
    c.trainer.queue_size = 8
    c.trainer.num_steps = 2
    c.trainer.eval_every = 0
    c.trainer.checkpoint_every = 0
  elif arg:
    raise ValueError(f'configs/swe.py takes no argument or "runlocal", got {arg!r}.')
  return c
