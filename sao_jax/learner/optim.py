"""Optimizers from `config.optim`: AdamW (or plain SGD), linear warmup then constant or cosine, global-norm clipping.

The actor and the critic each get their own optimizer (SAO: actor 1e-6, critic 5e-6). Which leaves an
optimizer sees is decided by the train state (`sao_jax.learner.state`): frozen leaves are split off
before `tx.init`, so they hold no optimizer state at all.
"""

from __future__ import annotations

from typing import Any

import optax

from sao_jax.errors import ConfigError
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import steps as steps_lib


OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine')


def check_optim(optim_config: Any) -> None:
  """The optimizer's checks of `config.optim` (run by `make_schedule` / `make_optimizer` and at start).

  Raises:
    ConfigError: an unknown optimizer or schedule, or a cosine schedule with `total_steps <= warmup_steps`
      (no decay phase), naming the field. `total_steps = 0` (the run's own length, see `make_schedule`) is
      checked where the horizon is known.
  """
  o = optim_config
  name = o.get('optimizer', 'adamw')
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


def make_schedule(optim_config: Any, peak_lr: float, run_steps: int | None = None) -> optax.Schedule:
  """Learning rate per optimizer step.

  `lr(s) = peak * s / W` for `s < W` (W = `warmup_steps`), then `peak` (constant) or
  `peak * (f + (1 - f) * (1 + cos(pi * min(s - W, D) / D)) / 2)` (cosine; f = `end_lr_factor`,
  D = N - W with N = `total_steps`, or, when `total_steps` is 0, `run_steps`: the optimizer updates this
  optimizer makes in the whole run, `optimizer_horizons`).

  Raises:
    ConfigError: `check_optim`'s, a cosine schedule with `total_steps = 0` and no `run_steps`, or a horizon
      N <= W.
  """
  o = optim_config
  check_optim(o)
  warmup = int(o.warmup_steps)
  if o.schedule == 'constant':
    after = optax.constant_schedule(peak_lr)
  else:
    horizon = int(o.total_steps) or int(run_steps or 0)
    if not horizon:
      raise ConfigError('config.optim.total_steps=0 (the run\'s length) needs the run\'s optimizer updates: '
                        'set config.optim.total_steps, or build the optimizer through the Learner.')
    if not int(o.total_steps):
      _check_run_horizon(o, horizon, 'this optimizer')
    after = optax.cosine_decay_schedule(peak_lr, horizon - warmup, alpha=float(o.end_lr_factor))
  if warmup <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup), after], [warmup])


def make_optimizer(optim_config: Any, peak_lr: float, run_steps: int | None = None
                   ) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` (when > 0) then AdamW (or SGD: `p <- p - lr * g`) with
  `make_schedule(optim_config, peak_lr, run_steps)`.

  SGD makes an update linear in the gradient, which is what the reference-step tests need to pin the loss.
  """
  o = optim_config
  name = o.get('optimizer', 'adamw')
  if name == 'adamw':
    tx = optax.adamw(make_schedule(o, peak_lr, run_steps), b1=float(o.b1), b2=float(o.b2), eps=float(o.eps),
                     weight_decay=float(o.weight_decay))
  else:
    tx = optax.sgd(make_schedule(o, peak_lr, run_steps))
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(float(o.grad_clip)), tx)
  return tx
