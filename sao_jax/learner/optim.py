"""Optimizers from `config.optim`: AdamW (or plain SGD), linear warmup then constant or cosine, global-norm clipping.

The actor and the critic each get their own optimizer (SAO: actor 1e-6, critic 5e-6). Which leaves an
optimizer sees is decided by the train state (`sao_jax.learner.state`): frozen leaves are split off
before `tx.init`, so they hold no optimizer state at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax.numpy as jnp
import numpy as np
import optax

from sao_jax.errors import ConfigError
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import steps as steps_lib


OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine')


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  """`config.optim`, typed (see `configs/base.py` for each field's meaning): what the functions of this module
  read as `optim_config` (they also take the `config.optim` section itself)."""
  optimizer: str
  actor_lr: float
  critic_lr: float
  schedule: str
  warmup_steps: int
  total_steps: int
  end_lr_factor: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  grad_clip: float
  freeze_critic_attention: bool
  max_consecutive_skips: int

  @classmethod
  def from_config(cls, config: Any) -> OptimConfig:
    """`config.optim` with its algorithm's preset filled in (`algo.resolve`: `freeze_critic_attention`), after
    `check_optim`."""
    o = algo_lib.resolve(config)[0].optim
    check_optim(o)
    return cls(
        optimizer=str(o.get('optimizer', 'adamw')), actor_lr=float(o.actor_lr), critic_lr=float(o.critic_lr),
        schedule=str(o.schedule), warmup_steps=int(o.warmup_steps), total_steps=int(o.total_steps),
        end_lr_factor=float(o.end_lr_factor), b1=float(o.b1), b2=float(o.b2), eps=float(o.eps),
        weight_decay=float(o.weight_decay), grad_clip=float(o.grad_clip),
        freeze_critic_attention=bool(o.freeze_critic_attention), max_consecutive_skips=int(o.max_consecutive_skips))


def check_optim(optim_config: Any) -> None:
  """The optimizer's checks of `config.optim` (run by `make_schedule` / `make_optimizer` and at start).

  Raises:
    ConfigError: an unknown optimizer or schedule, or a cosine schedule with `total_steps <= warmup_steps`
      (no decay phase), naming the field. `total_steps = 0` (the run's own length, see `make_schedule`) is
      checked where the horizon is known.
  """
  o = optim_config
  name = getattr(o, 'optimizer', 'adamw')
  if name not in OPTIMIZERS:
    raise ConfigError(f'config.optim.optimizer={name!r} is not one of {list(OPTIMIZERS)}.')
  if o.schedule not in SCHEDULES:
    raise ConfigError(f'config.optim.schedule={o.schedule!r} is not one of {list(SCHEDULES)}.')
  if o.schedule == 'cosine' and int(o.total_steps) and int(o.total_steps) <= int(o.warmup_steps):
    raise ConfigError(f'config.optim.total_steps={o.total_steps}: must exceed config.optim.warmup_steps='
                      f'{o.warmup_steps} for the cosine schedule (it decays over total_steps - warmup_steps).')


def check_config(config: Any) -> None:
  """`check_optim(config.optim)` and, for a cosine schedule over the whole run (`total_steps = 0`), each
  optimizer's horizon against the warmup: the optimizer's part of `sao_jax.config_lib.validate`."""
  o = config.optim
  check_optim(o)
  if o.schedule == 'cosine' and not int(o.total_steps):
    for who, updates in zip(('policy', 'critic'), optimizer_horizons(config)):
      if updates:
        _check_run_horizon(o, updates, f'the {who}', f' (trainer.num_steps={config.trainer.num_steps})')


def _check_run_horizon(o: Any, updates: int, who: str, detail: str = '') -> None:
  """A cosine schedule over the whole run (`total_steps = 0`) needs more updates than its warmup."""
  if updates <= int(o.warmup_steps):
    raise ConfigError(f'config.optim.total_steps=0: {who} makes {updates} optimizer updates in the run{detail}, not '
                      f'more than config.optim.warmup_steps={o.warmup_steps}; the cosine schedule needs a decay '
                      'phase.')


def optimizer_horizons(config: Any) -> tuple[int, int]:
  """(policy, critic) optimizer updates in a run of `config.trainer.num_steps` learner steps: the cosine
  schedules' horizons when `config.optim.total_steps` is 0.

  A learner step makes `policy_epochs * M` policy updates after the critic-only warmup (none during it) and
  `critic_epochs * M` critic updates (K = 2 for SAO), M = minibatches per batch (`trainer.minibatch_size`):

      policy = max(num_steps - critic_warmup_steps, 1) * policy_epochs * M,   critic = num_steps * K * M

  (critic 0 for the group algorithms, which have none).
  """
  cfg = algo_lib.StepConfig.from_config(config)
  steps = int(config.trainer.num_steps)
  m = steps_lib.num_minibatches(int(config.trainer.batch_size), cfg.minibatch_size)
  warmup = cfg.critic_warmup_steps if cfg.uses_critic else 0
  policy = max(steps - warmup, 1) * cfg.policy_epochs * m
  critic = steps * cfg.critic_epochs * m if cfg.uses_critic else 0
  return policy, critic


@flax.struct.dataclass
class OptimHParams:
  """The optimizer's hyperparameters as float32 scalars: inputs of the jitted learner update, not constants
  compiled into it, so runs (and sweeps) that differ only in these values share one compiled program.

  What changes the program stays in `config.optim` and is read when the optimizer is built (`optimizer_at`):
  `optimizer` (adamw / sgd) and whether `grad_clip > 0`. The constant schedule is the cosine with floor f = 1
  (exactly the peak: `(1 - 1) * cos + 1 = 1`), so both schedules run one program.

  Attributes:
    lr: peak learning rate.
    warmup_steps: W, linear warmup from 0 over the first W optimizer steps.
    decay_steps: D = N - W, the cosine's length (N: `total_steps`, or the run's updates); 1 when constant.
    end_lr_factor: f, the cosine's floor as a fraction of the peak; 1 when constant.
    b1, b2, eps, weight_decay: AdamW's.
    grad_clip: the global-norm clip (read only when `config.optim.grad_clip > 0`).
  """
  lr: Any
  warmup_steps: Any
  decay_steps: Any
  end_lr_factor: Any
  b1: Any
  b2: Any
  eps: Any
  weight_decay: Any
  grad_clip: Any


def optim_hparams(optim_config: Any, peak_lr: float, run_steps: int | None = None) -> OptimHParams:
  """The `OptimHParams` of `config.optim` at peak `peak_lr` (host float32 scalars).

  `run_steps`: the optimizer updates this optimizer makes in the whole run (`optimizer_horizons`), the
  cosine's horizon when `total_steps` is 0.

  Raises:
    ConfigError: `check_optim`'s, a cosine schedule with `total_steps = 0` and no `run_steps`, or a horizon
      N <= W.
  """
  o = optim_config
  check_optim(o)
  warmup = int(o.warmup_steps)
  decay, floor = 1, 1.0  # The constant schedule: the cosine at its floor f = 1.
  if o.schedule == 'cosine':
    horizon = int(o.total_steps) or int(run_steps or 0)
    if not horizon:
      raise ConfigError('config.optim.total_steps=0 (the run\'s length) needs the run\'s optimizer updates: '
                        'set config.optim.total_steps, or build the optimizer through the Learner.')
    if not int(o.total_steps):
      _check_run_horizon(o, horizon, 'this optimizer')
    decay, floor = horizon - warmup, float(o.end_lr_factor)
  f32 = np.float32
  return OptimHParams(lr=f32(peak_lr), warmup_steps=f32(max(warmup, 0)), decay_steps=f32(decay),
                      end_lr_factor=f32(floor), b1=f32(o.b1), b2=f32(o.b2), eps=f32(o.eps),
                      weight_decay=f32(o.weight_decay), grad_clip=f32(o.grad_clip))


def schedule_at(hp: OptimHParams) -> optax.Schedule:
  """Learning rate per optimizer step from the values of `hp` (host or traced).

  `lr(s) = peak * s / W` for `s < W` (W = `warmup_steps`), then
  `peak * (f + (1 - f) * (1 + cos(pi * min(s - W, D) / D)) / 2)` (f = `end_lr_factor`, D = `decay_steps`;
  f = 1: constant): the values of optax's `linear_schedule` joined to its `cosine_decay_schedule`, written out
  so that every number may be traced.
  """
  peak, warmup = hp.lr, hp.warmup_steps

  def after(count):
    count = jnp.minimum(count, hp.decay_steps)
    cosine = 0.5 * (1 + jnp.cos(jnp.pi * count / hp.decay_steps))
    return peak * ((1 - hp.end_lr_factor) * cosine + hp.end_lr_factor)

  def schedule(count):
    ramp = 1 - jnp.clip(count, 0, warmup) / jnp.maximum(warmup, 1)
    return jnp.where(count < warmup, -peak * ramp + peak, after(count - warmup))

  return schedule


def optimizer_at(optim_config: Any, hp: OptimHParams) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` (when `config.optim.grad_clip > 0`) then AdamW (or SGD:
  `p <- p - lr * g`) with `schedule_at(hp)`; every value from `hp` (host or traced), the
  structure (and so the optimizer state's tree) from `config.optim` alone."""
  o = optim_config
  name = getattr(o, 'optimizer', 'adamw')
  lr = schedule_at(hp)
  if name == 'adamw':
    tx = optax.adamw(lr, b1=hp.b1, b2=hp.b2, eps=hp.eps, weight_decay=hp.weight_decay)
  else:
    tx = optax.sgd(lr)
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(hp.grad_clip), tx)
  return tx


def make_schedule(optim_config: Any, peak_lr: float, run_steps: int | None = None) -> optax.Schedule:
  """Learning rate per optimizer step: `schedule_at` with `optim_hparams(optim_config, peak_lr, run_steps)`.

  Raises:
    ConfigError: `optim_hparams`'.
  """
  return schedule_at(optim_hparams(optim_config, peak_lr, run_steps))


def make_optimizer(optim_config: Any, peak_lr: float, run_steps: int | None = None
                   ) -> optax.GradientTransformation:
  """`optimizer_at` with `optim_hparams(optim_config, peak_lr, run_steps)`: the values compiled in.

  SGD makes an update linear in the gradient, which is what the reference-step tests need to pin the loss.
  """
  return optimizer_at(optim_config, optim_hparams(optim_config, peak_lr, run_steps))
