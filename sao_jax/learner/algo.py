"""Algorithm presets and the static description of an update step, from `config.algo` / `config.trainer`.

`config.algo.name` selects a PRESET: the settings that define that algorithm (`PRESETS`, the one table).
In `configs/base.py` those fields default to `None` ("the preset's value"); `resolve(config)` fills them.
A field set explicitly to a value that differs from the preset is an ABLATION: allowed, listed in
`config.algo.ablations` (`'path: preset -> set'`, saved with the run's config) and logged loudly at start
(`log_resolution`). So `--config.algo.name=ppo` runs PPO, never SAO under another name.

| name    | family | clip_mode   | eps_low / eps_high | agg                 | defining settings                        |
|---------|--------|-------------|--------------------|---------------------|------------------------------------------|
| sao     | critic | double_side | 0.3 / 5.0 (math)   | token_mean          | adaptive lam_policy (alpha 1.5),         |
|         |        |             | 0.8 / 3.0 (agentic)|                     | lam_critic 1, K=2 critic epochs, frozen  |
|         |        |             |                    |                     | critic attention, 10 warmup steps, G=1,  |
|         |        |             |                    |                     | skip-observation GAE (gae_over=actions)  |
| ppo     | critic | ppo         | 0.2 / 0.2          | token_mean          | lam 0.95 (critic and policy), 1 critic   |
|         |        |             |                    |                     | epoch, advantages from the pre-update    |
|         |        |             |                    |                     | critic, no frozen attention, no warmup   |
| grpo    | group  | ppo         | 0.2 / 0.2          | seq_mean_token_mean | G=8, (R - mean) / std                    |
| dr_grpo | group  | ppo         | 0.2 / 0.2          | seq_mean_token_sum  | G=8, R - mean (no std)                   |
| dapo    | group  | ppo         | 0.2 / 0.28         | token_mean          | G=8, clip-higher, dynamic sampling       |
| gspo    | group  | gspo        | 3e-4 / 4e-4        | seq_mean_token_mean | G=8, sequence-level ratio                |
| rloo    | group  | ppo         | 0.2 / 0.2          | seq_mean_token_mean | G=8, leave-one-out baseline              |

`config.algo.domain` picks the published setting where a preset has one per domain (SAO's band).
Critic algorithms (`sao`, `ppo`) learn a value model; group algorithms need `group_size >= 2`.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from absl import logging
import numpy as np

from sao_jax.errors import ConfigError

CRITIC_ALGOS = ('sao', 'ppo')
GROUP_ALGOS = ('grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo')
DOMAINS = ('math', 'agentic')
ADVANTAGE_SOURCES = ('updated_critic', 'pre_update')  # Critic values the policy advantages come from.
TRUNCATIONS = ('bootstrap', 'drop', 'terminal')  # A trajectory cut by a length / turn limit.
GAE_OVER = ('actions', 'span')  # GAE's TD chain: action tokens only (skip observations, SAO) or through them.
GROUP_BASELINES = ('mean', 'leave_one_out')  # GRPO's group mean, RLOO's leave-one-out mean.

# The settings that define each algorithm (`config.<path>` -> value). A field absent from a preset is not
# read by that algorithm (e.g. the critic's settings under GRPO); it takes its `_UNUSED` value.
PRESETS: dict[str, dict[str, Any]] = {
    'sao': {
        'algo.clip_mode': 'double_side', 'algo.eps_low': 0.3, 'algo.eps_high': 5.0, 'algo.agg': 'token_mean',
        'algo.lam_critic': 1.0, 'algo.lam_policy': -1.0, 'algo.adaptive_alpha': 1.5,
        'algo.advantages_from': 'updated_critic', 'algo.critic_epochs': 2, 'algo.critic_warmup_steps': 10,
        'optim.freeze_critic_attention': True, 'algo.gae_over': 'actions', 'algo.group_size': 1,
    },
    'ppo': {
        'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.agg': 'token_mean',
        'algo.lam_critic': 0.95, 'algo.lam_policy': 0.95, 'algo.advantages_from': 'pre_update',
        'algo.critic_epochs': 1, 'algo.critic_warmup_steps': 0, 'optim.freeze_critic_attention': False,
        'algo.gae_over': 'actions', 'algo.group_size': 1,
    },
    'grpo': {
        'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.agg': 'seq_mean_token_mean',
        'algo.group_size': 8, 'algo.group_std_normalize': True, 'algo.group_baseline': 'mean',
        'algo.dynamic_sampling': False,
    },
    'dr_grpo': {
        'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.agg': 'seq_mean_token_sum',
        'algo.group_size': 8, 'algo.group_std_normalize': False, 'algo.group_baseline': 'mean',
        'algo.dynamic_sampling': False,
    },
    'dapo': {
        'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.28, 'algo.agg': 'token_mean',
        'algo.group_size': 8, 'algo.group_std_normalize': True, 'algo.group_baseline': 'mean',
        'algo.dynamic_sampling': True,
    },
    'gspo': {
        'algo.clip_mode': 'gspo', 'algo.eps_low': 3e-4, 'algo.eps_high': 4e-4, 'algo.agg': 'seq_mean_token_mean',
        'algo.group_size': 8, 'algo.group_std_normalize': True, 'algo.group_baseline': 'mean',
        'algo.dynamic_sampling': False,
    },
    'rloo': {
        'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.agg': 'seq_mean_token_mean',
        'algo.group_size': 8, 'algo.group_baseline': 'leave_one_out', 'algo.dynamic_sampling': False,
    },
}
# Per-domain changes of a preset (SAO's published bands: math (0.3, 5.0), coding / agentic (0.8, 3.0)).
_DOMAIN_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ('sao', 'agentic'): {'algo.eps_low': 0.8, 'algo.eps_high': 3.0},
}
# The value of a defining field under an algorithm that does not read it.
_UNUSED: dict[str, Any] = {
    'algo.lam_critic': 1.0, 'algo.lam_policy': 1.0, 'algo.adaptive_alpha': 1.5,
    'algo.advantages_from': 'updated_critic', 'algo.critic_epochs': 1, 'algo.critic_warmup_steps': 0,
    'optim.freeze_critic_attention': False, 'algo.gae_over': 'actions', 'algo.group_std_normalize': True,
    'algo.group_baseline': 'mean', 'algo.dynamic_sampling': False,
}
ALGOS = tuple(PRESETS)
# Every field some preset sets: `configs/base.py` leaves them `None` (a placeholder of the right type).
DEFINING_FIELDS = tuple(dict.fromkeys(p for preset in PRESETS.values() for p in preset))


def _get(config: Any, path: str) -> Any:
  node = config
  for part in path.split('.'):
    if part not in node:
      raise ConfigError(f'config.{path} is missing.')
    node = node[part]
  return node


def _set(config: Any, path: str, value: Any) -> None:
  *parents, leaf = path.split('.')
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def preset(name: str, domain: str = 'math') -> dict[str, Any]:
  """`{path: value}` of every defining field under `name` in `domain` (fields `name` does not read: neutral).

  Raises:
    ConfigError: naming `config.algo.name` / `config.algo.domain` when unknown.
  """
  if name not in PRESETS:
    raise ConfigError(f'config.algo.name={name!r} is not one of {list(ALGOS)}.')
  if domain not in DOMAINS:
    raise ConfigError(f'config.algo.domain={domain!r} is not one of {list(DOMAINS)}.')
  return {**{p: _UNUSED[p] for p in DEFINING_FIELDS if p not in PRESETS[name]}, **PRESETS[name],
          **_DOMAIN_PRESETS.get((name, domain), {})}


def resolve(config: Any) -> tuple[Any, tuple[str, ...]]:
  """Fills the `None` defining fields from `PRESETS[config.algo.name]`; returns `(resolved copy, ablations)`.

  An explicitly set defining field that differs from the preset is an ablation, `'path: preset -> set'`;
  the tuple is also stored in the copy's `algo.ablations`. Idempotent: a resolved config resolves to itself.
  Fields the algorithm does not read keep their explicit value and are not ablations. `config` is not changed.
  """
  name = config.algo.name
  want = preset(name, config.algo.get('domain', 'math'))
  out = copy.deepcopy(config)
  ablations = []
  for path in DEFINING_FIELDS:
    value = _get(out, path)
    if value is None:
      _set(out, path, want[path])
    elif path in PRESETS[name] and value != want[path]:
      ablations.append(f'{path}: {want[path]!r} -> {value!r}')
  if 'ablations' in out.algo:
    out.algo.ablations = tuple(ablations)
  return out, tuple(ablations)


def unused_settings(config: Any) -> tuple[str, ...]:
  """Defining fields set explicitly (not `None`) that `config.algo.name` does not read, e.g. critic settings
  under a group algorithm: `'path=value'` each."""
  name = config.algo.name
  return tuple(f'{p}={_get(config, p)!r}' for p in DEFINING_FIELDS
               if p not in PRESETS.get(name, {}) and _get(config, p) is not None)


def log_resolution(config: Any, ablations: tuple[str, ...], unused: tuple[str, ...] = ()) -> None:
  """Logs the algorithm, each ablation (a warning: the run is not the named algorithm's preset) and any
  explicitly set field the algorithm does not read."""
  a = config.algo
  if ablations:
    logging.warning('ABLATION: algo.name=%r runs with %d setting(s) changed from its preset (preset -> set):\n  %s',
                    a.name, len(ablations), '\n  '.join(ablations))
  else:
    logging.info('algo.name=%r: its preset (domain %r), no ablation.', a.name, a.get('domain', 'math'))
  if unused:
    logging.info('Set but not read by algo.name=%r: %s', a.name, ', '.join(unused))


def check_config(config: Any) -> None:
  """The learner's checks of a RESOLVED config: a step that cannot run is refused, naming the field.

  Algorithm name; group algorithms need groups (`group_size >= 2`); `trainer.policy_epochs >= 1`; the batch
  is whole groups, the minibatch divides the batch, the microbatch divides the minibatch.
  """
  a, tr = config.algo, config.trainer
  preset(a.name, a.get('domain', 'math'))
  if a.name in GROUP_ALGOS and a.group_size < 2:
    raise ConfigError(f'config.algo.group_size={a.group_size}: algo.name={a.name!r} needs a group of at least 2 '
                      'rollouts per prompt (its advantage compares rollouts of one prompt).')
  if tr.policy_epochs < 1:
    raise ConfigError(f'config.trainer.policy_epochs={tr.policy_epochs}: must be >= 1.')
  if tr.batch_size % a.group_size:
    raise ConfigError(f'config.trainer.batch_size={tr.batch_size}: must be a multiple of '
                      f'config.algo.group_size={a.group_size} (whole groups per batch).')
  if tr.minibatch_size and tr.batch_size % tr.minibatch_size:
    raise ConfigError(f'config.trainer.minibatch_size={tr.minibatch_size}: must divide '
                      f'config.trainer.batch_size={tr.batch_size} (or be 0 = the whole batch).')
  mb = tr.minibatch_size or tr.batch_size
  micro = tr.get('microbatch_size', 0)
  if micro and mb % micro:
    raise ConfigError(f'config.trainer.microbatch_size={micro}: must divide the minibatch ({mb} rows: '
                      'config.trainer.minibatch_size, or config.trainer.batch_size when 0), or be 0.')


# StepConfig's numbers that are inputs of the jitted update (`StepConfig.hparams`), not constants compiled into
# it: runs that differ only in these (configs, ablations, sweeps of a band or a coefficient) share one program.
# What they switch on or off stays static (`kl_coef > 0` builds a reference model, `entropy_coef != 0` adds a
# term, `value_clip_eps > 0` clips, `lam_policy < 0` picks the adaptive lambda): only their values are inputs.
RUNTIME_FIELDS = ('eps_low', 'eps_high', 'dual_clip_c', 'gamma', 'lam_critic', 'lam_policy', 'adaptive_alpha',
                  'value_clip_eps', 'tis_cap', 'icepop_low', 'icepop_high', 'kl_coef', 'entropy_coef',
                  'critic_warmup_steps')


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """Hashable settings of the jitted update steps (see `configs/base.py` for each field's meaning); the values
  of `RUNTIME_FIELDS` reach the compiled step as inputs (`hparams`)."""
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
  gae_over: str
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
  batch_size: int = 0  # Trajectories per step (0: `minibatch_size`, `microbatch_size` are taken as counts of 1).
  # The learner's policy is the one the sampler draws from: log-probs of logits / `temperature`
  # (`config.sampler.temperature`), so a token's ratio to its behaviour log-prob is 1 on-policy at any temperature.
  temperature: float = 1.0

  @property
  def minibatches(self) -> int:
    """Optimizer updates per epoch: `batch_size / minibatch_size` (1 when either is 0)."""
    return self.batch_size // self.minibatch_size if self.minibatch_size and self.batch_size else 1

  @property
  def microbatches(self) -> int:
    """Gradient-accumulation chunks per update: `minibatch / microbatch_size` (1 when 0)."""
    mb = (self.minibatch_size or self.batch_size) if self.batch_size else 0
    return mb // self.microbatch_size if self.microbatch_size and mb else 1

  @property
  def uses_critic(self) -> bool:
    return self.name in CRITIC_ALGOS

  def hparams(self) -> dict[str, np.ndarray]:
    """`{field: value}` of `RUNTIME_FIELDS` as host scalars (float32; int32 `critic_warmup_steps`): the
    step's runtime inputs."""
    return {f: (np.int32 if f == 'critic_warmup_steps' else np.float32)(getattr(self, f)) for f in RUNTIME_FIELDS}

  @classmethod
  def from_config(cls, config: Any) -> StepConfig:
    """The step of `config` with its algorithm's preset filled in (`resolve`), after `check_config`."""
    config, _ = resolve(config)
    check_config(config)
    a, tr = config.algo, config.trainer
    return cls(
        name=a.name, clip_mode=a.clip_mode, eps_low=float(a.eps_low), eps_high=float(a.eps_high),
        dual_clip_c=float(a.dual_clip_c), agg=a.agg, agg_max_len=int(a.agg_max_len), gamma=float(a.gamma),
        lam_critic=float(a.lam_critic), lam_policy=float(a.lam_policy),
        adaptive_alpha=float(a.adaptive_alpha), whiten_advantages=bool(a.whiten_advantages),
        advantages_from=a.advantages_from, critic_epochs=int(a.critic_epochs),
        critic_warmup_steps=int(a.critic_warmup_steps), value_clip_eps=float(a.value_clip_eps),
        truncation=a.truncation, gae_over=a.gae_over, group_std_normalize=bool(a.group_std_normalize),
        group_baseline=a.group_baseline, group_size=int(a.group_size),
        behavior_correction=a.behavior_correction, tis_cap=float(a.tis_cap), icepop_low=float(a.icepop_low),
        icepop_high=float(a.icepop_high), kl_coef=float(a.kl_coef), kl_estimator=a.kl_estimator,
        entropy_coef=float(a.entropy_coef), minibatch_size=int(tr.minibatch_size),
        microbatch_size=int(tr.get('microbatch_size', 0)),
        policy_epochs=int(tr.policy_epochs), batch_size=int(tr.batch_size),
        temperature=float(config.sampler.temperature))

