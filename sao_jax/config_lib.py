"""Config checks that run at start: a bad config fails here, with a message naming the field."""

from typing import Any

import ml_collections

from sao_jax.envs import registry
from sao_jax.errors import ConfigError
from sao_jax.losses.common import AGGREGATIONS
from sao_jax.losses.policy import CLIP_MODES

ALGOS = ('sao', 'ppo', 'grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo')


def _get(config: ml_collections.ConfigDict, path: str) -> Any:
  node = config
  for part in path.split('.'):
    node = node[part]
  return node


def _one_of(config, path: str, choices) -> None:
  value = _get(config, path)
  if value not in choices:
    raise ConfigError(f'config.{path}={value!r} is not one of {list(choices)}.')


def _check(ok: bool, path: str, value: Any, why: str) -> None:
  if not ok:
    raise ConfigError(f'config.{path}={value!r}: {why}')


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Raises `ConfigError` naming the first field whose value cannot work; returns the config."""
  a = config.algo
  _one_of(config, 'algo.name', ALGOS)
  _one_of(config, 'algo.clip_mode', CLIP_MODES)
  _one_of(config, 'algo.agg', AGGREGATIONS)
  _one_of(config, 'algo.behavior_correction', ('none', 'tis', 'icepop'))
  _one_of(config, 'algo.advantages_from', ('updated_critic', 'pre_update'))
  _one_of(config, 'algo.truncation', ('bootstrap', 'drop'))
  _one_of(config, 'algo.group_baseline', ('mean', 'leave_one_out'))
  _one_of(config, 'algo.kl_estimator', ('k1', 'k2', 'k3'))
  _check(0.0 < a.eps_low <= 1.0, 'algo.eps_low', a.eps_low, 'must be in (0, 1].')
  _check(a.eps_high > 0.0, 'algo.eps_high', a.eps_high, 'must be > 0.')
  _check(a.dual_clip_c > 1.0, 'algo.dual_clip_c', a.dual_clip_c, 'must be > 1.')
  _check(0.0 <= a.gamma <= 1.0, 'algo.gamma', a.gamma, 'must be in [0, 1].')
  _check(0.0 <= a.lam_critic <= 1.0, 'algo.lam_critic', a.lam_critic, 'must be in [0, 1].')
  _check(a.lam_policy <= 1.0, 'algo.lam_policy', a.lam_policy,
         'must be <= 1 (or < 0 for the length-adaptive lambda).')
  _check(a.adaptive_alpha > 0.0, 'algo.adaptive_alpha', a.adaptive_alpha, 'must be > 0.')
  _check(a.critic_epochs >= 1, 'algo.critic_epochs', a.critic_epochs, 'must be >= 1.')
  _check(a.critic_warmup_steps >= 0, 'algo.critic_warmup_steps', a.critic_warmup_steps, 'must be >= 0.')
  _check(a.group_size >= 1, 'algo.group_size', a.group_size, 'must be >= 1.')
  if a.name in ('grpo', 'dr_grpo', 'dapo', 'gspo', 'rloo'):
    _check(a.group_size >= 2, 'algo.group_size', a.group_size,
           f'algo.name={a.name!r} needs a group of at least 2 rollouts per prompt.')
  if a.clip_mode == 'double_side':
    s = config.sampler
    _check(s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == 0, 'sampler.temperature',
           (s.temperature, s.top_p, s.top_k),
           'clip_mode=double_side needs the ratio to the distribution actually sampled from: sample at '
           'temperature 1, top_p 1, top_k 0 (the sampler records log-probs at temperature 1).')

  o = config.optim
  _one_of(config, 'optim.optimizer', ('adamw', 'sgd'))
  _check(o.actor_lr >= 0.0, 'optim.actor_lr', o.actor_lr, 'must be >= 0.')
  _check(o.critic_lr >= 0.0, 'optim.critic_lr', o.critic_lr, 'must be >= 0.')
  _one_of(config, 'optim.schedule', ('constant', 'cosine'))
  _check(o.grad_clip >= 0.0, 'optim.grad_clip', o.grad_clip, 'must be >= 0 (0 = off).')

  m = config.model
  _one_of(config, 'model.dtype', ('float32', 'bfloat16'))

  s = config.sampler
  _check(s.temperature > 0.0, 'sampler.temperature', s.temperature, 'must be > 0.')
  _check(0.0 < s.top_p <= 1.0, 'sampler.top_p', s.top_p, 'must be in (0, 1].')
  _check(s.top_k >= 0, 'sampler.top_k', s.top_k, 'must be >= 0.')
  _check(s.max_new_tokens >= 1, 'sampler.max_new_tokens', s.max_new_tokens, 'must be >= 1.')

  for axis in ('data', 'fsdp', 'tensor'):
    size = config.mesh[axis]
    _check(size == -1 or size >= 1, f'mesh.{axis}', size, 'must be >= 1 or -1 (the rest).')
  _check([config.mesh[x] for x in ('data', 'fsdp', 'tensor')].count(-1) <= 1, 'mesh',
         dict(config.mesh.items()), 'at most one of data/fsdp/tensor may be -1.')

  tr = config.trainer
  _one_of(config, 'trainer.mode', ('sync', 'async'))
  _check(tr.batch_size >= 1, 'trainer.batch_size', tr.batch_size, 'must be >= 1.')
  _check(tr.batch_size % a.group_size == 0, 'trainer.batch_size', tr.batch_size,
         f'must be a multiple of algo.group_size={a.group_size} (whole groups per batch).')
  _check(tr.minibatch_size == 0 or tr.batch_size % tr.minibatch_size == 0, 'trainer.minibatch_size',
         tr.minibatch_size, f'must divide trainer.batch_size={tr.batch_size} (or be 0).')
  mb = tr.minibatch_size or tr.batch_size
  _check(tr.microbatch_size >= 0 and (tr.microbatch_size == 0 or mb % tr.microbatch_size == 0),
         'trainer.microbatch_size', tr.microbatch_size,
         f'must divide the minibatch ({mb} rows: trainer.minibatch_size, or trainer.batch_size when 0), or be 0.')
  _check(tr.max_staleness >= 0, 'trainer.max_staleness', tr.max_staleness, 'must be >= 0.')
  del m

  registry.validate_task_config(config)  # Task name, limits, kwargs, data files (loads no data).
  return config
