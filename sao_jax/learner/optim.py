"""Optimizers from `config.optim`: AdamW (or plain SGD), linear warmup then constant or cosine, global-norm clipping.

The actor and the critic each get their own optimizer (SAO: actor 1e-6, critic 5e-6). Which leaves an
optimizer sees is decided by the train state (`sao_jax.learner.state`): frozen leaves are split off
before `tx.init`, so they hold no optimizer state at all.
"""

from __future__ import annotations

from typing import Any

import optax

from sao_jax.errors import ConfigError


def make_schedule(optim_config: Any, peak_lr: float) -> optax.Schedule:
  """Learning rate per optimizer step.

  `lr(s) = peak * s / W` for `s < W` (W = `warmup_steps`), then `peak` (constant) or
  `peak * (f + (1 - f) * (1 + cos(pi * min(s - W, D) / D)) / 2)` (cosine; f = `end_lr_factor`,
  D = `total_steps - W`).
  """
  o = optim_config
  warmup = int(o.warmup_steps)
  if o.schedule == 'constant':
    after = optax.constant_schedule(peak_lr)
  elif o.schedule == 'cosine':
    decay = int(o.total_steps) - warmup
    if decay <= 0:
      raise ConfigError(f'config.optim.total_steps={o.total_steps} must exceed config.optim.warmup_steps='
                        f'{warmup} for the cosine schedule.')
    after = optax.cosine_decay_schedule(peak_lr, decay, alpha=float(o.end_lr_factor))
  else:
    raise ConfigError(f'config.optim.schedule={o.schedule!r} is not one of [constant, cosine].')
  if warmup <= 0:
    return after
  return optax.join_schedules([optax.linear_schedule(0.0, peak_lr, warmup), after], [warmup])


OPTIMIZERS = ('adamw', 'sgd')


def make_optimizer(optim_config: Any, peak_lr: float) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` (when > 0) then AdamW (or SGD: `p <- p - lr * g`) with `make_schedule`.

  SGD makes an update linear in the gradient, which is what the reference-step tests need to pin the loss.
  """
  o = optim_config
  name = o.get('optimizer', 'adamw')
  if name == 'adamw':
    tx = optax.adamw(make_schedule(o, peak_lr), b1=float(o.b1), b2=float(o.b2), eps=float(o.eps),
                     weight_decay=float(o.weight_decay))
  elif name == 'sgd':
    tx = optax.sgd(make_schedule(o, peak_lr))
  else:
    raise ConfigError(f'config.optim.optimizer={name!r} is not one of {list(OPTIMIZERS)}.')
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(float(o.grad_clip)), tx)
  return tx
