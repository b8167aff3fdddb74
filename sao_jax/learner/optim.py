"""Optimizers from `config.optim`: AdamW (or plain SGD), linear warmup then constant or cosine, global-norm clipping.

The actor and the critic each get their own optimizer (SAO: actor 1e-6, critic 5e-6). Which leaves an
optimizer sees is decided by the train state (`sao_jax.learner.state`): frozen leaves are split off
before `tx.init`, so they hold no optimizer state at all.
"""

from __future__ import annotations

from typing import Any

import optax

from sao_jax.errors import ConfigError


OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine')


def check_optim(optim_config: Any) -> None:
  """The optimizer's checks of `config.optim` (run by `make_schedule` / `make_optimizer` and at start).

  Raises:
    ConfigError: an unknown optimizer or schedule, or a cosine schedule with `total_steps <= warmup_steps`
      (no decay phase), naming the field.
  """
  o = optim_config
  name = o.get('optimizer', 'adamw')
  if name not in OPTIMIZERS:
    raise ConfigError(f'config.optim.optimizer={name!r} is not one of {list(OPTIMIZERS)}.')
  if o.schedule not in SCHEDULES:
    raise ConfigError(f'config.optim.schedule={o.schedule!r} is not one of {list(SCHEDULES)}.')
  if o.schedule == 'cosine' and int(o.total_steps) <= int(o.warmup_steps):
    raise ConfigError(f'config.optim.total_steps={o.total_steps}: must exceed config.optim.warmup_steps='
                      f'{o.warmup_steps} for the cosine schedule (it decays over total_steps - warmup_steps).')


def check_config(config: Any) -> None:
  """`check_optim(config.optim)`: the optimizer's part of `sao_jax.config_lib.validate`."""
  check_optim(config.optim)


def make_schedule(optim_config: Any, peak_lr: float) -> optax.Schedule:
  """Learning rate per optimizer step.

  `lr(s) = peak * s / W` for `s < W` (W = `warmup_steps`), then `peak` (constant) or
  `peak * (f + (1 - f) * (1 + cos(pi * min(s - W, D) / D)) / 2)` (cosine; f = `end_lr_factor`,
  D = `total_steps - W`).
  """
  o = optim_config
  check_optim(o)
  warmup = int(o.warmup_steps)
  if o.schedule == 'constant':
    after = optax.constant_schedule(peak_lr)
  else:
    after = optax.cosine_decay_schedule(peak_lr, int(o.total_steps) - warmup, alpha=float(o.end_lr_factor))
  if warmup <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup), after], [warmup])


def make_optimizer(optim_config: Any, peak_lr: float) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` (when > 0) then AdamW (or SGD: `p <- p - lr * g`) with `make_schedule`.

  SGD makes an update linear in the gradient, which is what the reference-step tests need to pin the loss.
  """
  o = optim_config
  name = o.get('optimizer', 'adamw')
  if name == 'adamw':
    tx = optax.adamw(make_schedule(o, peak_lr), b1=float(o.b1), b2=float(o.b2), eps=float(o.eps),
                     weight_decay=float(o.weight_decay))
  else:
    tx = optax.sgd(make_schedule(o, peak_lr))
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(float(o.grad_clip)), tx)
  return tx
