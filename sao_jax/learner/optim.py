"""Optimizers from `config.optim`: AdamW (or plain SGD), linear warmup then constant or cosine, global-norm clipping.

The actor and the critic each get their own optimizer (SAO: actor 1e-6, critic 5e-6). Which leaves an
optimizer sees is decided by the train state (`sao_jax.learner.state`): frozen leaves are split off
before `tx.init`, so they hold no optimizer state at all.

Storage dtypes (the memory path of large models). `config.optim.state_dtype` stores AdamW's moments mu and nu in
float32 or bfloat16, `config.model.param_dtype` the parameters (and so their gradients). The update is computed
in float32 whatever they are (`scale_by_adam`): gradients, mu and nu are widened, the new moments rounded back
to `state_dtype`, and a parameter becomes `round_to_param_dtype(float32(p) + u)` (`optax.apply_updates`).
Rounding to the nearest bfloat16 (8 significant bits) has costs, said plainly:

- bfloat16 parameters lose every update smaller than about 2^-8 of the weight (half a unit in the last place is
  2^-9 to 2^-8 of |w|): the sum rounds back to the old value. An AdamW step moves a weight by about lr at most,
  so a bfloat16 weight with |w| > 2^9 lr never moves: at SAO's actor lr 1e-6 every weight above 5e-4 in magnitude
  (nearly all of them); at the demo's actor lr 2e-4 those above 0.1. There is no float32 master copy and no
  stochastic rounding: keep float32 parameters unless the learning rate is large against the weights.
- bfloat16 moments hold mu and nu to 2^-8 relative. An EMA step changes nu by (1 - b2)(g^2 - nu), under half a
  unit in the last place while |g^2 - nu| < ~2 nu at b2 = 0.999: nu then stays where it is (it neither decays nor
  follows gradients of the same scale) and moves only on gradients about 1.7x larger than sqrt(nu) or more. mu
  (b1 = 0.9) follows to 2^-8.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sao_jax.errors import ConfigError
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import steps as steps_lib


OPTIMIZERS = ('adamw', 'sgd')
SCHEDULES = ('constant', 'cosine')
STATE_DTYPES = ('float32', 'bfloat16')  # config.optim.state_dtype: AdamW's mu and nu.


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
  state_dtype: str = 'float32'

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
        freeze_critic_attention=bool(o.freeze_critic_attention), max_consecutive_skips=int(o.max_consecutive_skips),
        state_dtype=str(o.get('state_dtype', 'float32')))


def check_optim(optim_config: Any) -> None:
  """The optimizer's checks of `config.optim` (run by `make_schedule` / `make_optimizer` and at start).

  Raises:
    ConfigError: an unknown optimizer, schedule or state dtype, or a cosine schedule with
      `total_steps <= warmup_steps` (no decay phase), naming the field. `total_steps = 0` (the run's own length,
      see `make_schedule`) is checked where the horizon is known.
  """
  o = optim_config
  name = getattr(o, 'optimizer', 'adamw')
  if name not in OPTIMIZERS:
    raise ConfigError(f'config.optim.optimizer={name!r} is not one of {list(OPTIMIZERS)}.')
  state_dtype = getattr(o, 'state_dtype', 'float32')
  if state_dtype not in STATE_DTYPES:
    raise ConfigError(f'config.optim.state_dtype={state_dtype!r} is not one of {list(STATE_DTYPES)}.')
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
  m = cfg.minibatches
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


def scale_by_adam(b1: Any, b2: Any, eps: Any, state_dtype: str = 'float32') -> optax.GradientTransformation:
  """Adam's scaling with the moments stored in `state_dtype` and the math in float32 (optax's `scale_by_adam`
  has a dtype for mu only).

      g = f32(grad),  mu' = b1 f32(mu) + (1 - b1) g,  nu' = b2 f32(nu) + (1 - b2) g^2,  n = count + 1,
      u = (mu' / (1 - b1^n)) / (sqrt(nu' / (1 - b2^n)) + eps)                            (float32),

  and the state keeps `(n, mu' -> state_dtype, nu' -> state_dtype)` (round to nearest). Its state is optax's
  `ScaleByAdamState`, so the optimizer state's tree is `optax.adamw`'s; with float32 gradients and
  `state_dtype='float32'` every value is bit for bit optax's.
  """
  dtype = jnp.dtype(state_dtype)
  f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)

  def init(params):
    zeros = lambda p: jnp.zeros(jnp.shape(p), dtype)
    return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                                  nu=jax.tree.map(zeros, params))

  def update(updates, state, params=None):
    del params
    g = f32(updates)
    mu = optax.tree.update_moment(g, f32(state.mu), b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(g, f32(state.nu), b2, 2)
    count = optax.safe_increment(state.count)
    mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
    cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
    return out, optax.ScaleByAdamState(count=count, mu=cast(mu), nu=cast(nu))

  return optax.GradientTransformation(init, update)


def optimizer_at(optim_config: Any, hp: OptimHParams) -> optax.GradientTransformation:
  """`clip_by_global_norm(grad_clip)` (when `config.optim.grad_clip > 0`) then AdamW (or SGD:
  `p <- p - lr * g`) with `schedule_at(hp)`; every value from `hp` (host or traced), the
  structure (and so the optimizer state's tree) from `config.optim` alone.

  AdamW is optax's chain (`scale_by_adam`, `add_decayed_weights`, `scale_by_learning_rate`) with this module's
  `scale_by_adam`: moments in `config.optim.state_dtype`, float32 math, float32 updates `u` (the decay term
  `wd * p` widened too); `optax.apply_updates` adds them to each parameter in float32 and rounds the sum to the
  parameter's dtype (the module docstring says what bfloat16 loses)."""
  o = optim_config
  name = getattr(o, 'optimizer', 'adamw')
  lr = schedule_at(hp)
  if name == 'adamw':
    tx = optax.chain(scale_by_adam(hp.b1, hp.b2, hp.eps, getattr(o, 'state_dtype', 'float32')),
                     optax.add_decayed_weights(hp.weight_decay), optax.scale_by_learning_rate(lr))
  else:
    tx = optax.sgd(lr)
  if o.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(hp.grad_clip), tx)
  return _float32_gradients(tx)


def _float32_gradients(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """`tx` fed float32 gradients (bfloat16 parameters have bfloat16 gradients), so the clip's norm and the update
  are float32 math; the state (and its tree) is `tx`'s own."""
  def update(updates, state, params=None):
    return tx.update(jax.tree.map(lambda g: g.astype(jnp.float32), updates), state, params)
  return optax.GradientTransformation(tx.init, update)


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
