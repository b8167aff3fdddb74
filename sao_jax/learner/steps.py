"""The update steps as pure functions of (states, batch): SAO / PPO with a critic, and the GRPO family.

One SAO step (DESIGN "Order inside one SAO step"):

  1. critic forward -> V_old[B, T] (and V at the state after each row's last token, for truncated rows);
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

Truncated rows (`batch.truncated`: cut by a turn, observation or token limit, so not terminal), by
`algo.truncation`:
  - 'bootstrap': the GAE chain of the trajectory ends in the critic's value of the state after its last
    token (`next_values` at the segment's last token, see `critic_values` and `truncation_bootstrap`). The
    rollout makes that end a kind of state the critic is trained on (its targets sit at states where an action token is generated): a
    turn-limit or observation-overflow cut keeps the final observation as non-action tokens, a
    `max_new_tokens` cut ends mid-turn on an action token, and rows ending right after a turn-closing stop
    token are dropped there.
  - 'drop': the row's tokens leave the mask: no critic target, no policy gradient, no count in any
    denominator or metric.
  - 'terminal': the cut ends the episode, with the reward the env gave (0 for a reply cut before its answer):
    the chain ends in 0, as at a stop token. For tasks whose budget is part of the scoring (an eval counts a
    cut reply as wrong), where bootstrapping would value a cut reply as if it could still finish.

Packed rows (`trainer.pack`, `Batch.segment_ids`): every model call attends within a segment with positions
restarting per segment; GAE, lambda, the bootstrap and the sequence statistics are per segment (trajectory);
group baselines group by id. Minibatch and microbatch counts are those of the unpacked batch (`StepConfig`),
their rows a share of the packed rows.

Minibatches are interleaved rows (`b = m * n_minibatches + i` for minibatch i), so with rows sharded
over `('data', 'fsdp')` every device already holds its share of every minibatch: no data movement.
Microbatches (`microbatch_size` rows, gradient accumulation) are interleaved the same way inside a
minibatch. One optimizer update sums the microbatches' gradients of the minibatch loss written as
`L = sum_j w_j L_j`: a term aggregated with `agg` gets `w_j = c_j / c` (`losses.aggregate_count`: the
microbatch's share of the action tokens for token means, of the non-empty rows for row means), so the sum
is the whole minibatch's gradient exactly (up to float summation order) for every aggregation; the
update's loss and metrics are computed once on the minibatch from the microbatches' per-token outputs.
The whole-batch forward passes (critic values, proximal log-probs) run per microbatch too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import chex
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
from sao_jax.models import loops
from sao_jax.structs import Batch


Metrics = dict[str, jax.Array]
Hparams = dict[str, Any]  # `StepConfig.hparams()`: host scalars, or the jitted step's inputs.


# ---------------------------------------------------------------------------------------------------------
# Small masked statistics.

masked_mean = losses.masked_mean


def truncation_bootstrap(next_values: jax.Array, segment_ids: jax.Array, truncated: jax.Array) -> jax.Array:
  """`V(state after a trajectory's last token)` = `next_values` at its segment's last token, for truncated
  trajectories; 0 for terminal ones. float32 `[B, S]` (`truncated` is `[B, S]`)."""
  at_end = jnp.where(losses.segment_edges(segment_ids)[1], next_values, 0.0)  # Padding: no segment to sum into.
  end = losses.sequence_sum(at_end, segment_ids, truncated.shape[1])
  return jnp.where(truncated, end, 0.0)


# ---------------------------------------------------------------------------------------------------------
# Model calls.


def critic_values(critic: nnx.Module, tokens: jax.Array,
                  segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The critic (`sao_jax.models.value.ValueModel`) on `tokens[B, T]` -> (values[B, T], next_values[B, T]).

  `next_values[b, t] = head(hidden[b, t])` = V(tokens[b, :t+1]), the value of the state after token t;
  `values[b, t] = next_values[b, t-1]` (DESIGN alignment, `values[:, 0] = 0`), exactly what
  `ValueModel.__call__` returns. One backbone pass gives both: `next_values` at a trajectory's last token
  bootstraps a truncated one from the state after it. `segment_ids`: packed rows (the first token of a segment
  gets the previous segment's last value: it is a prompt token, never read).
  """
  next_values = critic.head(critic.backbone.hidden(tokens, segment_ids=segment_ids))
  values = jnp.pad(next_values[:, :-1], ((0, 0), (1, 0)))
  return values, next_values


# ---------------------------------------------------------------------------------------------------------
# Guarded optimizer update and minibatching.


def guarded_apply(spec: state_lib.ModelSpec, ts: state_lib.TrainState, grads: Any, loss: jax.Array,
                  opt_hparams: Any = None) -> tuple[state_lib.TrainState, Metrics]:
  """One optimizer update unless the loss or the gradient is non-finite.

  The optimizer is `spec.tx`, or `spec.tx_at(opt_hparams)` when hyperparameters are given (runtime inputs).
  Skipped updates leave `params` and `opt_state` bit-identical (selected with `jnp.where`), count in
  `skipped` and extend `consecutive_skips`; an applied update resets the latter. Gradients are widened to float32
  first (those of bfloat16 parameters are bfloat16): the norm, the clip and the update are float32 math.
  """
  grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
  grad_norm = optax.tree.norm(grads)
  ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  tx = spec.tx if opt_hparams is None else spec.tx_at(opt_hparams)
  updates, new_opt = tx.update(grads, ts.opt_state, ts.params)
  new_params = optax.apply_updates(ts.params, updates)
  keep = lambda new, old: jnp.where(ok, new, old)
  new_ts = ts.replace(
      params=jax.tree.map(keep, new_params, ts.params),
      opt_state=jax.tree.map(keep, new_opt, ts.opt_state),
      step=ts.step + ok.astype(jnp.int32),
      skipped=ts.skipped + (~ok).astype(jnp.int32),
      consecutive_skips=jnp.where(ok, 0, ts.consecutive_skips + 1))
  return new_ts, {'grad_norm': jnp.where(ok, grad_norm, 0.0), 'skipped': (~ok).astype(jnp.float32)}


def _num_parts(rows: int, size: int, field: str) -> int:
  if size <= 0 or size >= rows:
    return 1
  if rows % size:
    raise ValueError(f'config.trainer.{field}={size} does not divide the {rows} rows it splits.')
  return rows // size


def num_minibatches(rows: int, minibatch_size: int) -> int:
  """Minibatches (optimizer updates per epoch) of a batch of `rows` (1 when `minibatch_size` is 0)."""
  return _num_parts(rows, minibatch_size, 'minibatch_size')


def num_microbatches(rows: int, microbatch_size: int) -> int:
  """Microbatches (gradient-accumulation chunks) of `rows` rows (1 when `microbatch_size` is 0)."""
  return _num_parts(rows, microbatch_size, 'microbatch_size')


def _constrain_rows(y: jax.Array, mesh: Mesh | None) -> jax.Array:
  if mesh is None:
    return y
  return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, parallel.batch_spec(y.ndim)))


def take_minibatch(tree: Any, i: jax.Array, n: int, mesh: Mesh | None) -> Any:
  """Rows `{m * n + i}` of every `[B, ...]` leaf (interleaved: no cross-device movement)."""
  def one(x):
    if n == 1:
      return x
    x = x.reshape((x.shape[0] // n, n) + x.shape[1:])
    return _constrain_rows(jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False), mesh)
  return jax.tree.map(one, tree)


def join_parts(tree: Any, mesh: Mesh | None) -> Any:
  """Inverse of `take_minibatch` over all its parts: leaves `[n, B / n, ...]` (part i = rows `m * n + i`)
  -> `[B, ...]` in row order."""
  def one(x):
    return _constrain_rows(jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:]), mesh)
  return jax.tree.map(one, tree)


def map_rows(fn: Callable[[Any], Any], tree: Any, parts: int, mesh: Mesh | None) -> Any:
  """`fn(tree)` computed on `parts` interleaved row chunks one after another (`lax.map`), in row order.

  For row-wise `fn` (a model forward) the result equals `fn(tree)`; peak activation memory is one chunk's.
  """
  if parts == 1:
    return fn(tree)
  out = jax.lax.map(lambda j: fn(take_minibatch(tree, j, parts, mesh)), jnp.arange(parts, dtype=jnp.int32))
  return join_parts(out, mesh)


def _mean_metrics(stacked: Metrics) -> Metrics:
  out = {}
  for k, v in stacked.items():
    out[k] = jnp.sum(v) if k == 'skipped' else jnp.mean(v)
  return out


Scale = Callable[[str], Any]


def _whole(agg: str) -> float:
  """The `Scale` of a loss over the whole minibatch: every term counts once."""
  del agg
  return 1.0


@dataclasses.dataclass(frozen=True)
class Objective:
  """A loss split at the model, so the rows of one update can be cut into microbatches.

  Attributes:
    forward: `(model, rows, extra) -> outputs`, the model on some rows: a dict of per-row arrays
      (`[b, T]`, differentiable w.r.t. the model).
    loss: `(outputs, rows, scale) -> (loss, metrics)`, pure; each term of the loss aggregated with
      `agg` (see `losses.common.AGGREGATIONS`) is multiplied by `scale(agg)`.
    num_segments: S, the trajectories a row holds (`rows['segment_ids']` numbers them): what a sequence mean
      counts as a sequence (static).
  """
  forward: Callable[[nnx.Module, Any, Any], dict[str, jax.Array]]
  loss: Callable[[dict[str, jax.Array], Any, Scale], tuple[jax.Array, Metrics]]
  num_segments: int = 1


def _grad_and_metrics(spec: state_lib.ModelSpec, ts: state_lib.TrainState, mb: Any, objective: Objective,
                      extra: Any, parts: int, mesh: Mesh | None) -> tuple[jax.Array, Metrics, Any]:
  """(loss, metrics, gradient w.r.t. `ts.params`) of the objective on the minibatch `mb`.

  With `parts` > 1 the gradient is accumulated over `parts` interleaved microbatches (`lax.scan`): part j's
  terms are scaled by `aggregate_count(mask_j, agg) / aggregate_count(mask, agg)`, so the sum of the parts'
  gradients is the minibatch's gradient. Loss and metrics come from `objective.loss` on the whole
  minibatch, fed the parts' outputs in row order.
  """
  def at(params, rows, scale):
    out = objective.forward(nnx.merge(spec.graphdef, params, ts.rest), rows, extra)
    loss, metrics = objective.loss(out, rows, scale)
    return loss, (metrics, out)

  if parts == 1:
    (loss, (metrics, _)), grads = jax.value_and_grad(at, has_aux=True)(ts.params, mb, _whole)
    return loss, metrics, grads

  count = lambda rows, agg: losses.aggregate_count(rows['mask'], agg, rows.get('segment_ids'),
                                                   objective.num_segments)
  totals = {agg: jnp.maximum(count(mb, agg), 1.0) for agg in losses.common.AGGREGATIONS}

  def micro(acc, j):
    rows = take_minibatch(mb, j, parts, mesh)
    scale = lambda agg: count(rows, agg) / totals[agg]
    (_, (_, out)), grads = jax.value_and_grad(at, has_aux=True)(ts.params, rows, scale)
    return jax.tree.map(jnp.add, acc, grads), jax.lax.stop_gradient(out)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), ts.params)  # Sums in float32 (bf16 params too).
  grads, outs = loops.scan(micro, zeros, jnp.arange(parts, dtype=jnp.int32))
  loss, metrics = objective.loss(join_parts(outs, mesh), mb, _whole)
  return loss, metrics, grads


def run_updates(spec: state_lib.ModelSpec, ts: state_lib.TrainState, data: Any, objective: Objective, *,
                epochs: int, minibatch_size: int, mesh: Mesh | None, microbatch_size: int = 0,
                extra: Any = None, opt_hparams: Any = None) -> tuple[state_lib.TrainState, Metrics]:
  """`epochs` passes of guarded updates over minibatches of `data` (a `lax.scan`, one compile).

  `data` is a dict of `[B, ...]` arrays with the action mask under 'mask'; each update's gradient is
  accumulated over microbatches of `microbatch_size` rows (0: the whole minibatch at once) and taken
  w.r.t. `ts.params` only; `opt_hparams`: the optimizer's runtime hyperparameters (`guarded_apply`).
  Returns the new state and the metrics averaged over updates (`skipped` summed).
  """
  rows = jax.tree.leaves(data)[0].shape[0]
  n = num_minibatches(rows, minibatch_size)
  parts = num_microbatches(rows // n, microbatch_size)

  rest = ts.rest  # Frozen (a shared base too): closed over, not carried by the loop.

  def body(carry, k):
    mb = take_minibatch(data, k % n, n, mesh)
    ts = carry.replace(rest=rest)
    loss, metrics, grads = _grad_and_metrics(spec, ts, mb, objective, extra, parts, mesh)
    ts, guard = guarded_apply(spec, ts, grads, loss, opt_hparams)
    return ts.replace(rest=None), {'loss': loss, **metrics, **guard}

  ts, stacked = loops.scan(body, ts.replace(rest=None), jnp.arange(epochs * n, dtype=jnp.int32))
  return ts.replace(rest=rest), _mean_metrics(stacked)


# ---------------------------------------------------------------------------------------------------------
# Objectives of one minibatch.


def critic_objective(cfg: algo_lib.StepConfig, h: Hparams | None = None, num_segments: int = 1) -> Objective:
  """Masked MSE of the critic's values to the fixed returns (`losses.value_loss`, token mean); the values of
  `h` (`cfg.hparams()` when None), the structure of `cfg`."""
  h = cfg.hparams() if h is None else h
  clip = cfg.value_clip_eps > 0

  def forward(model, rows, _):
    return {'values': critic_values(model, rows['tokens'], rows.get('segment_ids'))[0]}

  def loss(out, rows, scale):
    value, metrics = losses.value_loss(out['values'], rows['returns'], rows['mask'],
                                       old_values=rows['old_values'] if clip else None,
                                       clip_eps=h['value_clip_eps'] if clip else None)
    return scale('token_mean') * value, metrics

  return Objective(forward, loss, num_segments)


def policy_objective(cfg: algo_lib.StepConfig, ref_graphdef: Any = None, h: Hparams | None = None,
                     num_segments: int = 1) -> Objective:
  """`losses.policy_loss` (aggregated with `cfg.agg`), minus `entropy_coef` times the token-mean entropy,
  plus `kl_coef` times the token-mean KL to the reference policy (`extra`: its full `nnx.State`); the values
  of `h` (`cfg.hparams()` when None), the structure of `cfg`. Every log-prob and the entropy are the tempered
  policy's, `log_softmax(logits / cfg.temperature)`: the distribution the sampler draws from."""
  h = cfg.hparams() if h is None else h
  use_ref = bool(cfg.kl_coef)

  def forward(model, rows, ref):
    seg = rows.get('segment_ids')
    logp, ent = logprobs_lib.token_logprobs(model, rows['tokens'], segment_ids=seg, temperature=cfg.temperature,
                                            return_entropy=True)
    out = {'logprobs': logp, 'entropy': ent}
    if use_ref and ref is not None:
      ref_model = nnx.merge(ref_graphdef, ref)
      out['ref_logprobs'] = jax.lax.stop_gradient(
          logprobs_lib.token_logprobs(ref_model, rows['tokens'], segment_ids=seg, temperature=cfg.temperature))
    return out

  def loss(out, rows, scale):
    logp, mask = out['logprobs'], rows['mask']
    pg, metrics = losses.policy_loss(
        logp, rows['behavior_logprobs'], rows['advantages'], mask, clip_mode=cfg.clip_mode,
        eps_low=h['eps_low'], eps_high=h['eps_high'], agg=cfg.agg, dual_clip_c=h['dual_clip_c'],
        agg_max_len=cfg.agg_max_len, proximal_logprobs=rows.get('proximal_logprobs'),
        behavior_correction=cfg.behavior_correction, tis_cap=h['tis_cap'], icepop_low=h['icepop_low'],
        icepop_high=h['icepop_high'], segment_ids=rows.get('segment_ids'), num_segments=num_segments)
    metrics.pop('num_action_tokens', None)
    total = scale(cfg.agg) * pg
    entropy = masked_mean(out['entropy'], mask)
    if cfg.entropy_coef:
      total = total - h['entropy_coef'] * scale('token_mean') * entropy
    metrics = {**metrics, 'entropy': jax.lax.stop_gradient(entropy)}
    if 'ref_logprobs' in out:
      kl_ref = losses.masked_kl(logp, out['ref_logprobs'], mask, cfg.kl_estimator)
      total = total + h['kl_coef'] * scale('token_mean') * kl_ref
      metrics['kl_ref'] = jax.lax.stop_gradient(kl_ref)
    return total, metrics

  return Objective(forward, loss, num_segments)


# ---------------------------------------------------------------------------------------------------------
# Steps.


def step_hparams(cfg: algo_lib.StepConfig, policy: Any, critic: Any = None) -> dict[str, Any]:
  """The runtime inputs of a step made by `make_sao_step` / `make_group_step`: `{'algo': cfg.hparams(),
  'policy': policy's optimizer hyperparameters, 'critic': the critic's (None without one)}` (the optimizers'
  as `optim.OptimHParams`, read by each `ModelSpec.tx_at`)."""
  return {'algo': cfg.hparams(), 'policy': policy, 'critic': critic}


def _unpack(cfg: algo_lib.StepConfig, hparams: Any) -> tuple[Hparams, Any, Any]:
  if hparams is None:
    return cfg.hparams(), None, None
  return hparams['algo'], hparams['policy'], hparams['critic']


def _trajectory_rewards(batch: Batch) -> jax.Array:
  """Each trajectory's reward (the sum of its rewards on action tokens), `[B, S]`."""
  return losses.sequence_sum(batch.rewards * batch.action_mask, batch.segment_ids, batch.num_segments)


def group_advantages(cfg: algo_lib.StepConfig, rewards: jax.Array, group_ids: jax.Array,
                     valid: jax.Array) -> jax.Array:
  """Advantages `[B, S]` of the trajectories of a batch, grouped by `group_ids` (`losses.group_advantages_by_id`:
  rollouts of one prompt, in any rows and segments).

  GRPO: `(R - mean_g R) / (std_g R + eps)`; Dr.GRPO (`group_std_normalize=False`): `R - mean_g R`;
  RLOO (`group_baseline='leave_one_out'`): `R_i - mean_{j != i} R_j`.
  """
  baseline = 'leave_one_out' if cfg.group_baseline == 'leave_one_out' else 'mean'
  return losses.group_advantages_by_id(rewards, group_ids, valid, baseline=baseline,
                                       std_normalize=cfg.group_std_normalize)


def split_sizes(cfg: algo_lib.StepConfig, rows: int) -> tuple[int, int]:
  """(minibatch, microbatch) sizes in rows of a batch of `rows` rows: `StepConfig`'s counts of minibatches and
  microbatches (those of the unpacked batch of `batch_size` trajectories) over these rows (0 = whole)."""
  n, parts = cfg.minibatches, cfg.microbatches
  if rows % (n * parts):
    raise ValueError(f'{rows} batch rows do not split into {n} minibatches of {parts} microbatches '
                     '(config.trainer.minibatch_size / microbatch_size; packed row counts are multiples of both).')
  return (rows // n if n > 1 else 0), (rows // (n * parts) if parts > 1 else 0)


def _policy_phase(cfg, policy_spec, ref_graphdef, ts, data, ref_params, active, mesh, h, opt_hparams,
                  num_segments):
  """Policy updates; under `lax.cond(active, ...)` when `active` is given (warmup leaves ts untouched)."""
  objective = policy_objective(cfg, ref_graphdef, h, num_segments)
  minibatch_size, microbatch_size = split_sizes(cfg, data['tokens'].shape[0])

  def run(ts):
    mb_data = data
    if cfg.behavior_correction != 'none':
      # Decoupled PPO: the proximal policy is the policy at the start of this learner step.
      model = state_lib.merge(policy_spec, ts)
      prox = map_rows(lambda x: logprobs_lib.token_logprobs(model, x[0], segment_ids=x[1],
                                                            temperature=cfg.temperature),
                      (data['tokens'], data['segment_ids']),
                      num_microbatches(data['tokens'].shape[0], microbatch_size), mesh)
      mb_data = {**data, 'proximal_logprobs': jax.lax.stop_gradient(prox)}
    return run_updates(policy_spec, ts, mb_data, objective, epochs=cfg.policy_epochs,
                       minibatch_size=minibatch_size, microbatch_size=microbatch_size, mesh=mesh,
                       extra=ref_params, opt_hparams=opt_hparams)

  if active is None:
    return run(ts)
  rest = ts.rest  # Frozen: closed over, not an operand of the cond.

  def run_active(carry):
    new_ts, metrics = run(carry.replace(rest=rest))
    return new_ts.replace(rest=None), metrics

  def skip(carry):
    shapes = jax.eval_shape(run_active, carry)[1]
    return carry, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

  new_ts, metrics = jax.lax.cond(active, run_active, skip, ts.replace(rest=None))
  return new_ts.replace(rest=rest), metrics


def _advantage_metrics(adv: jax.Array, mask: jax.Array) -> Metrics:
  return {
      'adv/mean': masked_mean(adv, mask),
      'adv/std': jnp.sqrt(losses.common.masked_var(adv, mask)),
      'adv/max': losses.common.masked_max(adv, mask),
      'adv/min': losses.common.masked_min(adv, mask),
  }


def _batch_metrics(batch: Batch, mask: jax.Array) -> Metrics:
  real = batch.segment_mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(real), 1.0)
  return {
      'batch/rows': jnp.sum(real),  # Trajectories (several per row when packed).
      'batch/action_tokens': jnp.sum(mask),
      'batch/reward_mean': jnp.sum(_trajectory_rewards(batch) * real) / n,
      'batch/truncated_frac': jnp.sum(batch.truncated.astype(jnp.float32) * real) / n,
      'batch/padding_frac': jnp.mean((batch.segment_ids == 0).astype(jnp.float32)),
  }


def _prefixed(prefix: str, metrics: Metrics) -> Metrics:
  return {f'{prefix}/{k}': v for k, v in metrics.items()}


def _under_mesh(step: Callable[..., Any], mesh: Mesh | None) -> Callable[..., Any]:
  """`step` traced under `mesh` (as an abstract mesh): the model's activation constraints (`llama.rows_split`)
  then keep rows split over the batch axes."""
  if mesh is None:
    return step

  def traced_under_mesh(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return step(*args, **kwargs)
  return traced_under_mesh


def sharing_base(step: Callable[..., Any], policy_spec: state_lib.ModelSpec,
                 critic_spec: state_lib.ModelSpec | None = None) -> Callable[..., Any]:
  """`step` (`make_sao_step`'s, `make_group_step`'s) with a fifth input, `base`: the frozen weights policy and
  critic share (LoRA), held once outside the learner state (`state_lib.split_base`). Each train state's `rest`
  borrows them for the step (`state_lib.with_base`) and gives them back; the returned state has the input's
  structure. The KL reference `ref_params` (the policy's zeroed adapters, LoRA's initial policy) is completed with
  the base too. `base` None: `step` as it is."""

  def run(state: state_lib.LearnerState, batch: Batch, ref_params: Any = None, hparams: Any = None,
          base: Any = None):
    if base is None:
      return step(state, batch, ref_params, hparams)
    policy = state_lib.with_base(policy_spec, state.policy, base)
    critic = None if critic_spec is None else state_lib.with_base(critic_spec, state.critic, base)
    inside = state.replace(policy=policy, critic=critic)
    if ref_params is not None:
      ref_params = nnx.merge_state(ref_params, policy.rest)
    new, metrics = step(inside, batch, ref_params, hparams)
    new = new.replace(policy=new.policy.replace(rest=state.policy.rest),
                      critic=None if new.critic is None else new.critic.replace(rest=state.critic.rest))
    return new, metrics

  return run


def make_sao_step(cfg: algo_lib.StepConfig, policy_spec: state_lib.ModelSpec,
                  critic_spec: state_lib.ModelSpec, mesh: Mesh | None = None, ref_graphdef: Any = None):
  """Pure SAO/PPO step: `(LearnerState, Batch, ref_state | None, hparams | None) -> (LearnerState, metrics)`.

  `ref_state` (with `ref_graphdef`) is the frozen reference policy for the KL penalty (`kl_coef > 0`).
  `hparams` (`step_hparams`): the step's numbers as inputs; None = `cfg`'s and the specs' `tx`, as constants.
  """

  def step(state: state_lib.LearnerState, batch: Batch, ref_params: Any = None, hparams: Any = None):
    chex.assert_rank(batch.tokens, 2)
    h, policy_hp, critic_hp = _unpack(cfg, hparams)
    f32 = jnp.float32
    seg, num_segments = batch.segment_ids, batch.num_segments
    real = batch.segment_mask.astype(f32)  # [B, S]
    truncated = batch.truncated.astype(bool) & (real > 0)
    action_mask = batch.action_mask.astype(f32) * losses.sequence_to_tokens(real, seg)
    if cfg.truncation == 'drop':
      mask = action_mask * losses.sequence_to_tokens((~truncated).astype(f32), seg)
    else:
      mask = action_mask
    # The TD chain of GAE (and the critic's trained tokens): the action tokens, or their span (ablation).
    chain = mask if cfg.gae_over == 'actions' else losses.action_span_mask(mask, seg)
    minibatch_size, microbatch_size = split_sizes(cfg, batch.tokens.shape[0])
    parts = num_microbatches(batch.tokens.shape[0], microbatch_size)

    def values_of(critic_ts):  # (values, next_values) of the batch, one microbatch at a time.
      critic = state_lib.merge(critic_spec, critic_ts)
      out = map_rows(lambda x: critic_values(critic, x[0], x[1]), (batch.tokens, seg), parts, mesh)
      return jax.lax.stop_gradient(out)

    def bootstrap(next_values):
      if cfg.truncation != 'bootstrap':
        return None
      return truncation_bootstrap(next_values, seg, truncated)

    # 1-2. Fixed value targets from the critic before its update.
    values_old, next_old = values_of(state.critic)
    _, returns = losses.skip_observation_gae(batch.rewards, values_old, chain, gamma=h['gamma'],
                                              lam=h['lam_critic'], bootstrap=bootstrap(next_old), segment_ids=seg)
    returns = jax.lax.stop_gradient(returns)

    # 3. K critic epochs on the fixed returns.
    critic_data = {'tokens': batch.tokens, 'segment_ids': seg, 'returns': returns, 'mask': chain,
                   'old_values': values_old}
    critic_ts, critic_m = run_updates(critic_spec, state.critic, critic_data,
                                      critic_objective(cfg, h, num_segments), epochs=cfg.critic_epochs,
                                      minibatch_size=minibatch_size, microbatch_size=microbatch_size, mesh=mesh,
                                      opt_hparams=critic_hp)

    # 4-5. Policy advantages from the updated (or the pre-update) critic.
    if cfg.advantages_from == 'updated_critic':
      values_new, next_new = values_of(critic_ts)
    else:
      values_new, next_new = values_old, next_old
    lam = (losses.adaptive_lambda(mask, h['adaptive_alpha'], seg, num_segments) if cfg.lam_policy < 0
           else jnp.full(real.shape, h['lam_policy'], f32))
    advantages, _ = losses.skip_observation_gae(batch.rewards, values_new, chain, gamma=h['gamma'], lam=lam,
                                                 bootstrap=bootstrap(next_new), segment_ids=seg)
    advantages = advantages * mask  # The policy's tokens only (a no-op for the action chain).
    if cfg.whiten_advantages:
      advantages = losses.whiten(advantages, mask)
    advantages = jax.lax.stop_gradient(advantages)

    # 6. Policy update(s), after the critic-only warmup.
    active = state.step >= h['critic_warmup_steps']
    policy_data = {'tokens': batch.tokens, 'segment_ids': seg, 'behavior_logprobs': batch.behavior_logprobs,
                   'advantages': advantages, 'mask': mask}
    policy_ts, policy_m = _policy_phase(cfg, policy_spec, ref_graphdef, state.policy, policy_data,
                                        ref_params, active, mesh, h, policy_hp, num_segments)

    metrics = {
        **_prefixed('critic', critic_m),
        'critic/explained_variance_before': losses.explained_variance(values_old, returns, mask),
        'critic/explained_variance_after': losses.explained_variance(values_new, returns, mask),
        'critic/value_mean_before': masked_mean(values_old, mask),
        'critic/return_mean': masked_mean(returns, mask),
        **_prefixed('policy', policy_m),
        'policy/active': active.astype(f32),
        'policy/lambda_mean': masked_mean(lam, real),
        **_advantage_metrics(advantages, mask),
        **_batch_metrics(batch, mask),
        'guard/policy_skipped_total': policy_ts.skipped.astype(f32),
        'guard/critic_skipped_total': critic_ts.skipped.astype(f32),
    }
    return state_lib.LearnerState(policy=policy_ts, critic=critic_ts, step=state.step + 1), metrics

  return _under_mesh(step, mesh)


def make_group_step(cfg: algo_lib.StepConfig, policy_spec: state_lib.ModelSpec, mesh: Mesh | None = None,
                    ref_graphdef: Any = None):
  """Pure GRPO-family step: `(LearnerState, Batch, ref_state | None, hparams | None) -> (LearnerState, metrics)`
  (see `make_sao_step`)."""

  def step(state: state_lib.LearnerState, batch: Batch, ref_params: Any = None, hparams: Any = None):
    h, policy_hp, _ = _unpack(cfg, hparams)
    f32 = jnp.float32
    seg, real = batch.segment_ids, batch.segment_mask.astype(f32)
    mask = batch.action_mask.astype(f32) * losses.sequence_to_tokens(real, seg)
    adv = group_advantages(cfg, _trajectory_rewards(batch), batch.group_ids, real)
    advantages = jnp.where(mask > 0, losses.sequence_to_tokens(adv, seg), 0.0)
    if cfg.whiten_advantages:
      advantages = losses.whiten(advantages, mask)
    advantages = jax.lax.stop_gradient(advantages)
    data = {'tokens': batch.tokens, 'segment_ids': seg, 'behavior_logprobs': batch.behavior_logprobs,
            'advantages': advantages, 'mask': mask}
    policy_ts, policy_m = _policy_phase(cfg, policy_spec, ref_graphdef, state.policy, data, ref_params,
                                        None, mesh, h, policy_hp, batch.num_segments)
    metrics = {
        **_prefixed('policy', policy_m),
        **_advantage_metrics(advantages, mask),
        **_batch_metrics(batch, mask),
        'guard/policy_skipped_total': policy_ts.skipped.astype(f32),
    }
    return state_lib.LearnerState(policy=policy_ts, critic=None, step=state.step + 1), metrics

  return _under_mesh(step, mesh)
