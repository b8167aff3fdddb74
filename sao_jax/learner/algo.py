"""The static description of an update step, from `config.algo` / `config.trainer`.

Every algorithm is a config: `algo.name` picks the advantage family (a learned critic for `sao` / `ppo`,
group baselines for `grpo`, `dr_grpo`, `dapo`, `gspo`, `rloo`); the loss is always `policy_loss` with
`algo.clip_mode` / `algo.agg` and friends. A name whose defining setting contradicts the fields (e.g.
`gspo` without `clip_mode=gspo`) is refused with the flags to set, so an ablation never silently runs
a different algorithm than its name says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sao_jax.errors import ConfigError

CRITIC_ALGOS = ('sao', 'ppo')
GROUP_ALGOS = ('grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo')

# What each group algorithm's name implies: field -> required value.
_IMPLIED = {
    'dr_grpo': {'group_std_normalize': False, 'agg': 'seq_mean_token_sum'},
    'dapo': {'agg': 'token_mean'},
    'gspo': {'clip_mode': 'gspo'},
    'rloo': {'group_baseline': 'leave_one_out'},
    'grpo': {'group_baseline': 'mean'},
}


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Hashable settings of the jitted update steps (see `configs/base.py` for each field's meaning)."""
  name: str
  clip_mode: str
  eps_low: float
  eps_high: float
  dual_clip_c: float
  agg: str
  agg_max_len: int
  gamma: float
  lam_critic: float
  lam_policy: float
  adaptive_alpha: float
  whiten_advantages: bool
  advantages_from: str
  critic_epochs: int
  critic_warmup_steps: int
  value_clip_eps: float
  truncation: str
  group_std_normalize: bool
  group_baseline: str
  group_size: int
  behavior_correction: str
  tis_cap: float
  icepop_low: float
  icepop_high: float
  kl_coef: float
  kl_estimator: str
  entropy_coef: float
  minibatch_size: int
  microbatch_size: int
  policy_epochs: int

  @property
  def uses_critic(self) -> bool:
    return self.name in CRITIC_ALGOS

  @classmethod
  def from_config(cls, config: Any) -> StepConfig:
    a, tr = config.algo, config.trainer
    if a.name not in CRITIC_ALGOS + GROUP_ALGOS:
      raise ConfigError(f'config.algo.name={a.name!r} is not one of {list(CRITIC_ALGOS + GROUP_ALGOS)}.')
    for field, value in _IMPLIED.get(a.name, {}).items():
      if a[field] != value:
        raise ConfigError(f'config.algo.name={a.name!r} needs config.algo.{field}={value!r} '
                          f'(got {a[field]!r}); set --config.algo.{field}={value}.')
    if tr.policy_epochs < 1:
      raise ConfigError(f'config.trainer.policy_epochs={tr.policy_epochs}: must be >= 1.')
    return cls(
        name=a.name, clip_mode=a.clip_mode, eps_low=float(a.eps_low), eps_high=float(a.eps_high),
        dual_clip_c=float(a.dual_clip_c), agg=a.agg, agg_max_len=int(a.agg_max_len), gamma=float(a.gamma),
        lam_critic=float(a.lam_critic), lam_policy=float(a.lam_policy),
        adaptive_alpha=float(a.adaptive_alpha), whiten_advantages=bool(a.whiten_advantages),
        advantages_from=a.advantages_from, critic_epochs=int(a.critic_epochs),
        critic_warmup_steps=int(a.critic_warmup_steps), value_clip_eps=float(a.value_clip_eps),
        truncation=a.truncation, group_std_normalize=bool(a.group_std_normalize),
        group_baseline=a.group_baseline, group_size=int(a.group_size),
        behavior_correction=a.behavior_correction, tis_cap=float(a.tis_cap), icepop_low=float(a.icepop_low),
        icepop_high=float(a.icepop_high), kl_coef=float(a.kl_coef), kl_estimator=a.kl_estimator,
        entropy_coef=float(a.entropy_coef), minibatch_size=int(tr.minibatch_size),
        microbatch_size=int(tr.get('microbatch_size', 0)),
        policy_epochs=int(tr.policy_epochs))
