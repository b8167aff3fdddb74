"""The experiments of experiments/README.md as data: each a base config, a set of arms (config overrides), seeds.

An arm is `config.<path> = value` overrides on top of the experiment's config file; every run of an arm is
`python -m sao_jax.main --config=<config> --workdir=<runs>/<experiment>/<arm>/seed<k> --config.seed=<k>
--config.<path>=<value> ...`, so any run can be reproduced by hand with the command the runner prints.

Comparisons hold the trajectories per learner step fixed (SAO: B prompts x 1 rollout; group methods: B/G
prompts x G rollouts) and change one thing at a time (ablations flip one switch of SAO's recipe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from configs import _tiny


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Experiment:
  """One experiment: `config` (a file under configs/, optionally `:arg`) with `overrides` for all arms."""
  name: str
  title: str
  config: str
  arms: tuple[Arm, ...]
  seeds: tuple[int, ...] = (0, 1, 2)
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Metrics drawn against the learner step besides accuracy (stability: entropy, clipping, grad norms, ...).
  panels: tuple[str, ...] = ()
  # On a CPU host, split it into this many XLA devices for every run (JAX_NUM_CPU_DEVICES; 0 = one device), so
  # that `mesh.actor_devices` can give the actors a device of their own. Other platforms ignore it.
  cpu_devices: int = 0

  def arm(self, name: str) -> Arm:
    for a in self.arms:
      if a.name == name:
        return a
    raise KeyError(f'{self.name} has no arm {name!r}; arms: {[a.name for a in self.arms]}')


G = 8  # Group size of the group baselines.


def _algos(task_overrides: Mapping[str, Any]) -> tuple[Arm, ...]:
  """SAO (single rollout, value model) vs the group baselines at the same trajectories per step."""
  return (
      Arm('sao', {**task_overrides}),
      Arm('grpo', {**task_overrides, 'algo.name': 'grpo', 'algo.group_size': G}),
      Arm('dapo', {**task_overrides, 'algo.name': 'dapo', 'algo.group_size': G}),
      Arm('dr_grpo', {**task_overrides, 'algo.name': 'dr_grpo', 'algo.group_size': G}),
  )


# One switch of SAO's recipe per arm (the learner records each as an ablation of the preset).
ABLATIONS = (
    Arm('sao'),
    Arm('clip_ppo', {'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.28}),
    Arm('clip_dual', {'algo.clip_mode': 'dual_clip', 'algo.eps_low': 0.2, 'algo.eps_high': 0.28}),
    Arm('critic_k1', {'algo.critic_epochs': 1}),
    Arm('attention_trained', {'optim.freeze_critic_attention': False}),
    Arm('no_critic_warmup', {'algo.critic_warmup_steps': 0}),
    Arm('gae_through_obs', {'algo.gae_over': 'span'}),
    Arm('fixed_lambda', {'algo.lam_policy': 0.95}),
    Arm('staleness_0', {'trainer.max_staleness': 0}),
    Arm('staleness_2', {'trainer.max_staleness': 2}),
    Arm('staleness_8', {'trainer.max_staleness': 8}),
)

STABILITY_PANELS = ('learner/policy/entropy', 'learner/policy/clip_frac_low', 'learner/policy/clip_frac_high',
                    'learner/policy/grad_norm', 'learner/critic/grad_norm', 'learner/critic/explained_variance',
                    'staleness/mean', 'reward_mean')

# configs/smollm2_arith.py's settings of the 2026-12-02 run that have changed since (the task's ranges, 32 new
# tokens at temperature 1, 30 steps, 3 critic warmup steps, 256 eval problems, unpacked rows).
SMOLLM2_FIRST = {'task.kwargs.sum_min': 10, 'task.kwargs.sum_max': 99, 'task.kwargs.mul_max': 99,
                 'task.eval_size': 256, 'sampler.max_new_tokens': 32, 'sampler.max_seq_len': 200,
                 'sampler.temperature': 1.0,
                 'algo.critic_warmup_steps': 3, 'trainer.num_steps': 30, 'trainer.max_train_minutes': 0.0,
                 'trainer.pack': 'none', 'trainer.seq_buckets': (104, 200), 'trainer.eval_every': 15,
                 'trainer.checkpoint_every': 5}

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in (
    Experiment('algos_arith', 'SAO vs GRPO / DAPO / Dr.GRPO on arith (async, equal trajectories per step)',
               'configs/arith.py', _algos({})),
    Experiment('algos_calculator', 'SAO vs GRPO / DAPO / Dr.GRPO on multi-turn calculator (async)',
               'configs/calculator.py', _algos({})),
    Experiment('ablations', "SAO's recipe, one switch at a time (multi-turn calculator)", 'configs/calculator.py',
               ABLATIONS, panels=('learner/critic/grad_norm', 'learner/critic/explained_variance')),
    # The staleness bound only binds when the actors can run ahead of the learner: on one shared device they
    # run between its updates, and a queue of one batch (calculator's 64) holds them at most ~2 versions ahead
    # (the `ablations` arms staleness_2 / 8 are sao's recipe again). Here the actors have a device of their own
    # (the loop benchmark's setting) and the queue room for 8 batches.
    Experiment('staleness', "SAO's staleness bound with actors on a device of their own (calculator)",
               'configs/calculator.py',
               (Arm('sao'), Arm('staleness_0', {'trainer.max_staleness': 0}),
                Arm('staleness_2', {'trainer.max_staleness': 2}), Arm('staleness_8', {'trainer.max_staleness': 8})),
               seeds=(0,), overrides={'mesh.actor_devices': 1, 'trainer.queue_size': 512}, cpu_devices=2,
               panels=('staleness/mean', 'learner/critic/explained_variance', 'reward_mean')),
    Experiment('stability', 'SAO for 1000 learner steps, async GRPO beside it (calculator)',
               'configs/calculator.py',
               (Arm('sao'), Arm('grpo', {'algo.name': 'grpo', 'algo.group_size': G})),
               seeds=(0,), overrides={'trainer.num_steps': 1000, 'trainer.eval_every': 50,
                                      'optim.total_steps': 0},  # Each optimizer's cosine spans the 1000 steps.
               panels=STABILITY_PANELS),
    Experiment('drift', 'Online learning under drift: SAO vs GRPO across rule shifts', 'configs/drift.py',
               (Arm('sao'), Arm('grpo', {'algo.name': 'grpo', 'algo.group_size': G})),
               panels=('drift/phase', 'reward_mean')),
    # The first real-model run (2026-12-02): configs/smollm2_arith.py as it was then, pinned here.
    Experiment('smollm2', 'SmolLM2-135M-Instruct on arithmetic word problems: SAO vs GRPO (G=8)',
               'configs/smollm2_arith.py',
               (Arm('sao'), Arm('grpo', {'algo.name': 'grpo', 'algo.group_size': G})), seeds=(0,),
               overrides=SMOLLM2_FIRST),
    # The recipe of configs/smollm2_arith.py (90 minutes of training a run): SAO from the base model against
    # GRPO with groups of 4 (16 trajectories a step each), and SAO with LoRA adapters.
    Experiment('smollm2_rl', 'SmolLM2-135M-Instruct, 90 minutes of RL: SAO vs GRPO (G=4) vs SAO with LoRA',
               'configs/smollm2_arith.py',
               (Arm('sao'), Arm('grpo', {'algo.name': 'grpo', 'algo.group_size': 4}),
                Arm('sao_lora', {'model.lora.rank': 16, 'model.lora.alpha': 32.0, 'optim.actor_lr': 1e-4,
                                 'optim.critic_lr': 6e-4})),  # (configs/smollm2_arith.py:lora's settings.)
               seeds=(0, 1), panels=('reward_mean', 'learner/critic/explained_variance',
                                     'learner/policy/clip_frac_low', 'learner/policy/clip_frac_high')),
)}

# --quick: a few steps of a tiny model, so the scripts run in the test suite and cannot rot (not results).
QUICK: dict[str, Any] = {**_tiny.TINY, 'model.hf_dir': '', 'task.eval_size': 4, 'trainer.eval_every': 1}
