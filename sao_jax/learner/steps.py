"""The update steps as pure functions of (states, batch): SAO / PPO with a critic, and the GRPO family.

One SAO step (DESIGN "Order inside one SAO step"):

  1. critic forward -> V_old[B, T] (and V at the state after the last action, for truncated rows);
  2. value targets with skip-observation GAE at lambda_critic (default 1: Monte-Carlo returns), fixed;
  3. K = `critic_epochs` passes of critic updates (masked MSE) over minibatches of the batch;
  4. critic forward again -> V_new (or reuse V_old: `advantages_from='pre_update'`);
  5. policy advantages with skip-observation GAE at the length-adaptive
     lambda_b = 1 - 1 / (alpha * l_b) (l_b = action tokens of row b), or the fixed `lam_policy >= 0`;
  6. `policy_epochs` passes of policy updates with `policy_loss` (ratio to the behaviour log-probs),
     skipped entirely (params and optimizer state untouched) while `step < critic_warmup_steps`.

The GRPO family has no critic: group advantages of the rows' rewards, broadcast to their action tokens,
then step 6. Every optimizer update is guarded: a non-finite loss or gradient norm leaves parameters
and optimizer state as they were and bumps the skip counters.

Minibatches are interleaved rows (`b = m * n_minibatches + i` for minibatch i), so with rows sharded
over `('data', 'fsdp')` every device already holds its share of every minibatch: no data movement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import chex
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from sao_jax import losses
from sao_jax import parallel
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import state as state_lib
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.types import Batch

Metrics = dict[str, jax.Array]


@flax.struct.dataclass
class LearnerState:
  """Everything the learner updates: one train state per model and the learner-step counter.

  Attributes:
    policy: the policy's `TrainState`.
    critic: the critic's `TrainState` (None for the GRPO family).
    step: learner steps done (int32); the critic-only warmup compares it to `critic_warmup_steps`.
  """
  policy: state_lib.TrainState
  critic: state_lib.TrainState | None
  step: jax.Array


# ---------------------------------------------------------------------------------------------------------
# Small masked statistics.

masked_mean = losses.masked_mean


def explained_variance(values: jax.Array, returns: jax.Array, mask: jax.Array) -> jax.Array:
  """1 - Var[R - V] / Var[R] over masked tokens (1: perfect, 0: no better than a constant; 0 if Var[R] = 0)."""
  var_ret = losses.common.masked_var(returns, mask)
  var_res = losses.common.masked_var(returns - values, mask)
  return jnp.where(var_ret > 0, 1.0 - var_res / jnp.where(var_ret > 0, var_ret, 1.0), 0.0)


def last_action_index(action_mask: jax.Array) -> jax.Array:
  """Index of each row's last action token (0 for rows without one)."""
  t = action_mask.shape[-1]
  idx = jnp.arange(t, dtype=jnp.int32)
  return jnp.max(jnp.where(action_mask > 0, idx[None], 0), axis=-1)


# ---------------------------------------------------------------------------------------------------------
# Model calls.


def critic_values(critic: nnx.Module, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The critic (`sao_jax.models.value.ValueModel`) on `tokens[B, T]` -> (values[B, T], next_values[B, T]).

  `next_values[b, t] = head(hidden[b, t])` = V(tokens[b, :t+1]), the value of the state after token t;
  `values[b, t] = next_values[b, t-1]` (DESIGN alignment, `values[:, 0] = 0`), exactly what
  `ValueModel.__call__` returns. One backbone pass gives both: `next_values` at a row's last action
  token bootstraps a truncated row from the state after its last generated token.
  """
  next_values = critic.head(critic.backbone.hidden(tokens))
  values = jnp.pad(next_values[:, :-1], ((0, 0), (1, 0)))
  return values, next_values


# ---------------------------------------------------------------------------------------------------------
# Guarded optimizer update and minibatching.


def guarded_apply(spec: state_lib.ModelSpec, ts: state_lib.TrainState, grads: Any,
                  loss: jax.Array) -> tuple[state_lib.TrainState, Metrics]:
  """One optimizer update unless the loss or the gradient is non-finite.

  Skipped updates leave `params` and `opt_state` bit-identical (selected with `jnp.where`), count in
  `skipped` and extend `consecutive_skips`; an applied update resets the latter.
  """
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt = spec.tx.update(grads, ts.opt_state, ts.params)
  new_params = optax.apply_updates(ts.params, updates)
  keep = lambda new, old: jnp.where(ok, new, old)
  new_ts = ts.replace(
      params=jax.tree.map(keep, new_params, ts.params),
      opt_state=jax.tree.map(keep, new_opt, ts.opt_state),
      step=ts.step + ok.astype(jnp.int32),
      skipped=ts.skipped + (~ok).astype(jnp.int32),
      consecutive_skips=jnp.where(ok, 0, ts.consecutive_skips + 1))
  return new_ts, {'grad_norm': jnp.where(ok, grad_norm, 0.0), 'skipped': (~ok).astype(jnp.float32)}


def num_minibatches(rows: int, minibatch_size: int) -> int:
  if minibatch_size <= 0 or minibatch_size >= rows:
    return 1
  if rows % minibatch_size:
    raise ValueError(f'config.trainer.minibatch_size={minibatch_size} does not divide the batch ({rows} rows).')
  return rows // minibatch_size


def take_minibatch(tree: Any, i: jax.Array, n: int, mesh: Mesh | None) -> Any:
  """Rows `{m * n + i}` of every `[B, ...]` leaf (interleaved: no cross-device movement)."""
  def one(x):
    if n == 1:
      return x
    x = x.reshape((x.shape[0] // n, n) + x.shape[1:])
    y = jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
    if mesh is not None:
      y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, parallel.batch_spec(y.ndim)))
    return y
  return jax.tree.map(one, tree)


def _mean_metrics(stacked: Metrics) -> Metrics:
  out = {}
  for k, v in stacked.items():
    out[k] = jnp.sum(v) if k == 'skipped' else jnp.mean(v)
  return out


def run_updates(spec: state_lib.ModelSpec, ts: state_lib.TrainState, data: Any,
                loss_fn: Callable[..., tuple[jax.Array, Metrics]], *, epochs: int, minibatch_size: int,
                mesh: Mesh | None, extra: Any = None) -> tuple[state_lib.TrainState, Metrics]:
  """`epochs` passes of guarded updates over minibatches of `data` (a `lax.scan`, one compile).

  `loss_fn(model, minibatch, extra) -> (loss, metrics)`; gradients are taken w.r.t. `ts.params` only.
  Returns the new state and the metrics averaged over updates (`skipped` summed).
  """
  rows = jax.tree.leaves(data)[0].shape[0]
  n = num_minibatches(rows, minibatch_size)

  def body(ts, k):
    mb = take_minibatch(data, k % n, n, mesh)

    def objective(params):
      model = nnx.merge(spec.graphdef, params, ts.rest)
      return loss_fn(model, mb, extra)

    (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(ts.params)
    ts, guard = guarded_apply(spec, ts, grads, loss)
    return ts, {'loss': loss, **metrics, **guard}

  ts, stacked = jax.lax.scan(body, ts, jnp.arange(epochs * n, dtype=jnp.int32))
  return ts, _mean_metrics(stacked)


# ---------------------------------------------------------------------------------------------------------
# Losses of one minibatch.


def make_critic_loss(cfg: algo_lib.StepConfig):
  def critic_loss(model, mb, _):
    values, _ = critic_values(model, mb['tokens'])
    clip = cfg.value_clip_eps > 0
    loss, metrics = losses.value_loss(values, mb['returns'], mb['mask'],
                                      old_values=mb['old_values'] if clip else None,
                                      clip_eps=cfg.value_clip_eps if clip else None)
    return loss, metrics
  return critic_loss


def make_policy_loss(cfg: algo_lib.StepConfig, ref_graphdef: Any = None):
  """Policy loss of a minibatch; `ref` (the extra argument) is the reference model's full `nnx.State`."""

  def loss_fn(model, mb, ref):
    logp, ent = logprobs_lib.token_logprobs(model, mb['tokens'], return_entropy=True)
    loss, metrics = losses.policy_loss(
        logp, mb['behavior_logprobs'], mb['advantages'], mb['mask'], clip_mode=cfg.clip_mode,
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, agg=cfg.agg, dual_clip_c=cfg.dual_clip_c,
        agg_max_len=cfg.agg_max_len, proximal_logprobs=mb.get('proximal_logprobs'),
        behavior_correction=cfg.behavior_correction, tis_cap=cfg.tis_cap, icepop_low=cfg.icepop_low,
        icepop_high=cfg.icepop_high)
    metrics.pop('num_action_tokens', None)
    mask = mb['mask']
    entropy = masked_mean(ent, mask)
    if cfg.entropy_coef:
      loss = loss - cfg.entropy_coef * entropy
    entropy = jax.lax.stop_gradient(entropy)
    metrics = {**metrics, 'entropy': entropy}
    if cfg.kl_coef and ref is not None:
      ref_model = nnx.merge(ref_graphdef, ref)
      ref_logp = jax.lax.stop_gradient(logprobs_lib.token_logprobs(ref_model, mb['tokens']))
      kl_ref = losses.masked_kl(logp, ref_logp, mask, cfg.kl_estimator)
      loss = loss + cfg.kl_coef * kl_ref
      metrics['kl_ref'] = jax.lax.stop_gradient(kl_ref)
    return loss, metrics
  return loss_fn


# ---------------------------------------------------------------------------------------------------------
# Steps.


def _row_reward(batch: Batch) -> jax.Array:
  return jnp.sum(batch.rewards * batch.action_mask, axis=-1)


def group_advantages(cfg: algo_lib.StepConfig, row_rewards: jax.Array) -> jax.Array:
  """Advantages `[B]` of rows laid out as contiguous groups of `group_size` rollouts of one prompt.

  GRPO: `(R - mean_g R) / (std_g R + eps)`; Dr.GRPO (`group_std_normalize=False`): `R - mean_g R`;
  RLOO (`group_baseline='leave_one_out'`): `R_i - mean_{j != i} R_j`.
  """
  b = row_rewards.shape[0]
  g = cfg.group_size
  if b % g:
    raise ValueError(f'batch rows {b} are not whole groups of config.algo.group_size={g}.')
  r = row_rewards.reshape(b // g, g)
  if cfg.group_baseline == 'leave_one_out':
    adv = losses.leave_one_out_advantages(r)
  else:
    adv = losses.group_advantages(r, std_normalize=cfg.group_std_normalize)
  return adv.reshape(b)


def _policy_phase(cfg, policy_spec, ref_graphdef, ts, data, ref_params, active, mesh):
  """Policy updates; under `lax.cond(active, ...)` when `active` is given (warmup leaves ts untouched)."""
  loss_fn = make_policy_loss(cfg, ref_graphdef)

  def run(ts):
    mb_data = data
    if cfg.behavior_correction != 'none':
      # Decoupled PPO: the proximal policy is the policy at the start of this learner step.
      prox = logprobs_lib.token_logprobs(state_lib.merge(policy_spec, ts), data['tokens'])
      mb_data = {**data, 'proximal_logprobs': jax.lax.stop_gradient(prox)}
    return run_updates(policy_spec, ts, mb_data, loss_fn, epochs=cfg.policy_epochs,
                       minibatch_size=cfg.minibatch_size, mesh=mesh, extra=ref_params)

  if active is None:
    return run(ts)

  def skip(ts):
    shapes = jax.eval_shape(run, ts)[1]
    return ts, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  return jax.lax.cond(active, run, skip, ts)


def _advantage_metrics(adv: jax.Array, mask: jax.Array) -> Metrics:
  return {
      'adv/mean': masked_mean(adv, mask),
      'adv/std': jnp.sqrt(losses.common.masked_var(adv, mask)),
      'adv/max': losses.common.masked_max(adv, mask),
      'adv/min': losses.common.masked_min(adv, mask),
  }


def _batch_metrics(batch: Batch, mask: jax.Array) -> Metrics:
  rows = jnp.maximum(jnp.sum(batch.row_mask), 1.0)
  return {
      'batch/rows': jnp.sum(batch.row_mask),
      'batch/action_tokens': jnp.sum(mask),
      'batch/reward_mean': jnp.sum(_row_reward(batch) * batch.row_mask) / rows,
      'batch/truncated_frac': jnp.sum(batch.truncated.astype(jnp.float32) * batch.row_mask) / rows,
  }


def _prefixed(prefix: str, metrics: Metrics) -> Metrics:
  return {f'{prefix}/{k}': v for k, v in metrics.items()}


def make_sao_step(cfg: algo_lib.StepConfig, policy_spec: state_lib.ModelSpec,
                  critic_spec: state_lib.ModelSpec, mesh: Mesh | None = None, ref_graphdef: Any = None):
  """Pure SAO/PPO step: `(LearnerState, Batch, ref_state | None) -> (LearnerState, metrics)`.

  `ref_state` (with `ref_graphdef`) is the frozen reference policy for the KL penalty (`kl_coef > 0`).
  """

  def step(state: LearnerState, batch: Batch, ref_params: Any = None):
    chex.assert_rank(batch.tokens, 2)
    f32 = jnp.float32
    action_mask = batch.action_mask.astype(f32) * batch.row_mask.astype(f32)[:, None]
    truncated = batch.truncated.astype(bool)
    if cfg.truncation == 'drop':
      mask = action_mask * (~truncated).astype(f32)[:, None]
    else:
      mask = action_mask
    last = last_action_index(mask)

    # 1-2. Fixed value targets from the critic before its update.
    critic = state_lib.merge(critic_spec, state.critic)
    values_old, next_old = critic_values(critic, batch.tokens)
    values_old, next_old = jax.lax.stop_gradient((values_old, next_old))

    def bootstrap(next_values):
      if cfg.truncation != 'bootstrap':
        return None
      v_last = jnp.take_along_axis(next_values, last[:, None], axis=1)[:, 0]
      return jnp.where(truncated, v_last, 0.0)

    _, returns = losses.skip_observation_gae(batch.rewards, values_old, mask, gamma=cfg.gamma,
                                              lam=cfg.lam_critic, bootstrap=bootstrap(next_old))
    returns = jax.lax.stop_gradient(returns)

    # 3. K critic epochs on the fixed returns.
    critic_data = {'tokens': batch.tokens, 'returns': returns, 'mask': mask, 'old_values': values_old}
    critic_ts, critic_m = run_updates(critic_spec, state.critic, critic_data, make_critic_loss(cfg),
                                      epochs=cfg.critic_epochs, minibatch_size=cfg.minibatch_size, mesh=mesh)

    # 4-5. Policy advantages from the updated (or the pre-update) critic.
    if cfg.advantages_from == 'updated_critic':
      values_new, next_new = jax.lax.stop_gradient(
          critic_values(state_lib.merge(critic_spec, critic_ts), batch.tokens))
    else:
      values_new, next_new = values_old, next_old
    lam = (losses.adaptive_lambda(mask, cfg.adaptive_alpha) if cfg.lam_policy < 0
           else jnp.full((mask.shape[0],), cfg.lam_policy, f32))
    advantages, _ = losses.skip_observation_gae(batch.rewards, values_new, mask, gamma=cfg.gamma, lam=lam,
                                                 bootstrap=bootstrap(next_new))
    if cfg.whiten_advantages:
      advantages = losses.whiten(advantages, mask)
    advantages = jax.lax.stop_gradient(advantages)

    # 6. Policy update(s), after the critic-only warmup.
    active = state.step >= cfg.critic_warmup_steps
    policy_data = {'tokens': batch.tokens, 'behavior_logprobs': batch.behavior_logprobs,
                   'advantages': advantages, 'mask': mask}
    policy_ts, policy_m = _policy_phase(cfg, policy_spec, ref_graphdef, state.policy, policy_data,
                                        ref_params, active, mesh)

    metrics = {
        **_prefixed('critic', critic_m),
        'critic/explained_variance_before': explained_variance(values_old, returns, mask),
        'critic/explained_variance_after': explained_variance(values_new, returns, mask),
        'critic/value_mean_before': masked_mean(values_old, mask),
        'critic/return_mean': masked_mean(returns, mask),
        **_prefixed('policy', policy_m),
        'policy/active': active.astype(f32),
        'policy/lambda_mean': masked_mean(lam, batch.row_mask.astype(f32)),
        **_advantage_metrics(advantages, mask),
        **_batch_metrics(batch, mask),
        'guard/policy_skipped_total': policy_ts.skipped.astype(f32),
        'guard/critic_skipped_total': critic_ts.skipped.astype(f32),
    }
    return LearnerState(policy=policy_ts, critic=critic_ts, step=state.step + 1), metrics

  return step


def make_group_step(cfg: algo_lib.StepConfig, policy_spec: state_lib.ModelSpec, mesh: Mesh | None = None,
                    ref_graphdef: Any = None):
  """Pure GRPO-family step: `(LearnerState, Batch, ref_state | None) -> (LearnerState, metrics)`."""

  def step(state: LearnerState, batch: Batch, ref_params: Any = None):
    f32 = jnp.float32
    mask = batch.action_mask.astype(f32) * batch.row_mask.astype(f32)[:, None]
    advantages = losses.broadcast_to_tokens(group_advantages(cfg, _row_reward(batch)), mask)
    if cfg.whiten_advantages:
      advantages = losses.whiten(advantages, mask)
    advantages = jax.lax.stop_gradient(advantages)
    data = {'tokens': batch.tokens, 'behavior_logprobs': batch.behavior_logprobs,
            'advantages': advantages, 'mask': mask}
    policy_ts, policy_m = _policy_phase(cfg, policy_spec, ref_graphdef, state.policy, data, ref_params,
                                        None, mesh)
    metrics = {
        **_prefixed('policy', policy_m),
        **_advantage_metrics(advantages, mask),
        **_batch_metrics(batch, mask),
        'guard/policy_skipped_total': policy_ts.skipped.astype(f32),
    }
    return LearnerState(policy=policy_ts, critic=None, step=state.step + 1), metrics

  return step
