"""The learner: sharded train states and the jitted SAO / GRPO-family update, driven from the host.

    learner = Learner(LearnerConfig.from_config(config), policy=lambda: Decoder(model_cfg, rngs=nnx.Rngs(0)))
    metrics = learner.update(batch)        # a `sao_jax.structs.Batch` (numpy or jax), one learner step
    params = learner.policy_state()        # to publish to the sampler

The update is one `jax.jit` program with explicit in/out shardings (derived from the models' logical
axes and the mesh rules) and the learner state donated, so parameters and optimizer states are updated in
place. The step's numbers (ratio band, lambdas, gamma, coefficients, critic warmup, learning rates and their
schedules, AdamW's betas: `Learner.hparams`) are inputs of that program, not constants compiled into it: configs,
ablations and sweeps that change only numbers share one compiled update. On several processes each one passes its
own rows of the batch (see `sao_jax.parallel.global_batch`); metrics come back replicated on every host.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from sao_jax import parallel
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import optim as optim_lib
from sao_jax.learner import state as state_lib
from sao_jax.learner import steps as steps_lib
from sao_jax.models import lora as lora_lib
from sao_jax.structs import BATCH_FIELDS, Batch

ModelOrFn = nnx.Module | Callable[[], nnx.Module]

# XLA compile options of the update's program when the learner's devices are CPUs (e.g.
# {'xla_cpu_use_fusion_emitters': False}); none by default. The test suite sets them (tests/conftest.py): its tiny
# models' updates are compile-bound, and no test compares an update's floats with a program compiled otherwise at
# a tolerance the options' rounding exceeds.
CPU_COMPILER_OPTIONS: dict[str, Any] = {}


class NonFiniteUpdateError(RuntimeError):
  """Too many consecutive updates had a non-finite loss or gradient."""


def critic_trainable(freeze_attention: bool, lora: bool = False):
  """Filter of the critic's trained leaves: every Param (LoRA: its adapters and its value head), minus attention
  when frozen (SAO)."""
  from sao_jax.models import value as value_lib  # pylint: disable=g-import-not-at-top
  trained = nnx.Any(lora_lib.ADAPTERS, nnx.PathContains('head')) if lora else nnx.Param
  if freeze_attention:
    return nnx.All(trained, nnx.Not(value_lib.CRITIC_ATTENTION))
  return trained


def default_critic(policy: ModelOrFn, seed: int, remat: str = '', lora: tuple[int, tuple[str, ...]] = (0, ())
                   ) -> ModelOrFn:
  """The SAO critic: the policy's backbone plus a zero-initialised scalar head (a module if `policy` is one), with
  its own remat policy `remat` ('' = the policy's; `config.model.critic_remat`) and its own LoRA adapters `lora`
  = (rank, targets) (rank 0: none)."""
  from sao_jax.models import value as value_lib  # pylint: disable=g-import-not-at-top
  rank, targets = lora

  def make_critic(p):  # Its Rngs made where it is used (inside the jit of a model function).
    return value_lib.ValueModel.from_policy(p, rngs=nnx.Rngs(seed), remat=remat, lora_rank=rank, lora_targets=targets)

  if isinstance(policy, nnx.Module):
    return make_critic(policy)

  def make():
    with nnx.use_eager_sharding(False):
      return make_critic(policy())
  return make


def has_adapters(model: ModelOrFn) -> bool:
  """Whether `model` (a module, or a function creating one: traced abstractly) has LoRA adapters."""
  if not isinstance(model, nnx.Module):
    with nnx.use_eager_sharding(False):
      model = nnx.eval_shape(model)
  return bool(jax.tree.leaves(nnx.state(model, lora_lib.ADAPTERS)))


def check_groups(group_ids: np.ndarray, segment_mask: np.ndarray, group_size: int) -> None:
  """Group baselines need whole groups: each group id of the real trajectories (`segment_mask` 1) held by
  exactly `group_size` of them, in any rows and segments (`steps.group_advantages` groups by id).

  Raises:
    ValueError: naming the first offending group.
  """
  ids = np.asarray(group_ids)[np.asarray(segment_mask) > 0]
  values, counts = np.unique(ids, return_counts=True)
  for gid, n in zip(values.tolist(), counts.tolist()):
    if gid < 0 or n != group_size:
      raise ValueError(f'group id {gid} has {n} trajectories in the batch, not one whole group of '
                       f'config.algo.group_size={group_size}; the group baselines need each prompt\'s rollouts '
                       'together in one batch, under one group id (>= 0).')


def critic_lora(config: Any) -> tuple[int, tuple[str, ...]]:
  """(rank, targets) of the critic's LoRA adapters under `config.model.lora` ((0, ()) without LoRA)."""
  lora = config.model.get('lora')
  if lora is None or not lora.rank:
    return 0, ()
  return int(lora.critic_rank or lora.rank), tuple(lora.critic_targets)


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  """What the learner reads of a run's config, read once (`from_config`), its algorithm's preset filled in.

  Attributes:
    step: the update step's settings (`algo.StepConfig`).
    optim: the optimizers' settings (`optim.OptimConfig`).
    horizons: (policy, critic) optimizer updates in the run (`optim.optimizer_horizons`): the cosine schedules'
      horizons when `optim.total_steps` is 0.
    batch_size: trajectories per learner step (`config.trainer.batch_size`).
    mesh: the learner mesh's axis sizes (`config.mesh`'s data, fsdp, tensor): the default mesh over all devices.
    rules: logical axis name -> mesh axes (`config.mesh.rules`).
    seed: `config.seed` (the default critic's head is initialised from `seed + 1`).
    critic_remat: the default critic's remat policy (`config.model.critic_remat`; '' = the policy's).
    critic_lora: the default critic's LoRA adapters (rank, targets) when the policy has adapters
      (`config.model.lora.critic_rank` (0: the policy's rank), `critic_targets`).
  """
  step: algo_lib.StepConfig
  optim: optim_lib.OptimConfig
  horizons: tuple[int, int]
  batch_size: int
  mesh: tuple[tuple[str, int], ...]
  rules: tuple[Any, ...]
  seed: int
  critic_remat: str = ''
  critic_lora: tuple[int, tuple[str, ...]] = (0, ())

  @classmethod
  def from_config(cls, config: Any) -> LearnerConfig:
    """The learner's settings of `config` (`algo`, `optim`, `trainer`, `mesh`, `seed`, `model.critic_remat`), after
    the algorithm's and the optimizer's checks."""
    config = algo_lib.resolve(config)[0]  # The algorithm's preset filled in (e.g. frozen attention).
    return cls(step=algo_lib.StepConfig.from_config(config), optim=optim_lib.OptimConfig.from_config(config),
               horizons=optim_lib.optimizer_horizons(config), batch_size=int(config.trainer.batch_size),
               mesh=tuple((axis, int(config.mesh[axis])) for axis in parallel.MESH_AXES),
               rules=tuple(config.mesh.rules), seed=int(config.seed),
               critic_remat=str(config.model.get('critic_remat', '')), critic_lora=critic_lora(config))


class Learner:
  """Holds the learner state on the mesh and runs update steps.

  Args:
    settings: the learner's settings (`LearnerConfig.from_config(config)`).
    policy: the policy `Decoder`, or a function creating it (preferred: created directly sharded).
    critic: the value model (or a function); default `ValueModel.from_policy(policy)` for `sao`/`ppo`. With LoRA
      (the policy has adapters) the critic runs over the policy's base: its own backbone weights are not used.
    mesh: the learner mesh (default `parallel.make_mesh` of `settings.mesh` over all devices).
    model_config: the policy's `ModelConfig`, for layout checks (heads divisible by `tensor`).
    abstract: hold the state as `jax.ShapeDtypeStruct`s with their shardings and allocate nothing (`policy` and
      `critic` must be functions): only `lower_update` / `compile_update` work. The ahead-of-time plan
      (`sao_jax.tools.aot`) compiles a model of any size this way, on a topology's devices.
  """

  def __init__(self, settings: LearnerConfig, *, policy: ModelOrFn, critic: ModelOrFn | None = None,
               mesh: Mesh | None = None, model_config: Any = None, abstract: bool = False):
    self.settings = settings
    self.step_config = cfg = settings.step
    self.mesh = mesh if mesh is not None else parallel.make_mesh(dict(settings.mesh))
    if model_config is None and isinstance(policy, nnx.Module):
      model_config = getattr(policy, 'cfg', None)
    parallel.check_layout_sizes(self.mesh, batch_size=settings.batch_size, minibatch_size=cfg.minibatch_size,
                                microbatch_size=cfg.microbatch_size, rules=settings.rules, model_config=model_config)
    rules = settings.rules
    o = settings.optim
    policy_updates, critic_updates = settings.horizons
    tx_at = functools.partial(optim_lib.optimizer_at, o)  # The optimizers' numbers are inputs of the update.
    policy_hp = optim_lib.optim_hparams(o, o.actor_lr, policy_updates)
    self.abstract = abstract
    # LoRA (the policy has adapters): only adapters (and the critic's head) train; the frozen base is held once
    # (`self.base`), shared by policy and critic, and is an input of the update, neither donated nor saved.
    self.lora = has_adapters(policy)
    policy_trainable = lora_lib.ADAPTERS if self.lora else nnx.Param
    policy_shared = nnx.Not(lora_lib.ADAPTERS) if self.lora else None
    self.policy_spec, policy_state, policy_sh = state_lib.create_train_state(
        policy, tx_at(policy_hp), self.mesh, rules, trainable=policy_trainable, shared=policy_shared,
        abstract_only=abstract)
    self.policy_spec = dataclasses.replace(self.policy_spec, tx_at=tx_at)
    self.base, base_sh = None, None
    if self.lora:
      self.base, base_sh = state_lib.split_base(policy, policy_trainable, policy_shared, self.mesh, rules,
                                                abstract_only=abstract)
    rep = parallel.replicated(self.mesh)
    self.critic_spec, critic_state, critic_sh, critic_hp = None, None, None, None
    if cfg.uses_critic:
      if critic is None:
        critic = default_critic(policy, settings.seed + 1, settings.critic_remat,
                                settings.critic_lora if self.lora else (0, ()))
      critic_hp = optim_lib.optim_hparams(o, o.critic_lr, critic_updates)
      critic_shared = nnx.All(nnx.PathContains('backbone'), nnx.Not(lora_lib.ADAPTERS)) if self.lora else None
      self.critic_spec, critic_state, critic_sh = state_lib.create_train_state(
          critic, tx_at(critic_hp), self.mesh, rules,
          trainable=critic_trainable(o.freeze_critic_attention, self.lora), shared=critic_shared,
          base_prefix=('backbone',), abstract_only=abstract)
      self.critic_spec = dataclasses.replace(self.critic_spec, tx_at=tx_at)
      missing = set(self.critic_spec.base_paths) - {('backbone', *p) for p in self.policy_spec.base_paths}
      if missing:
        raise ValueError(f'The critic\'s frozen weights {sorted(missing)[:3]} are not in the policy\'s base: '
                         'a LoRA critic shares the policy\'s base (ValueModel.from_policy builds one).')
    if abstract:
      step0 = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    else:
      step0 = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=rep)()
    self.state = state_lib.LearnerState(policy=policy_state, critic=critic_state, step=step0)
    self.state_shardings = state_lib.LearnerState(policy=policy_sh, critic=critic_sh, step=rep)

    # Reference policy for the KL penalty: a frozen copy of the initial policy.
    self.ref_graphdef, self.ref_state, ref_sh = None, None, None
    # LoRA: the initial policy is the base (B = 0), so the reference is the policy with zeroed adapters over the
    # shared base (`steps.sharing_base` completes it): no second copy of the weights.
    if cfg.kl_coef > 0 and self.lora:
      self.ref_graphdef, ref_sh = self.policy_spec.graphdef, policy_sh.params
      zeros = lambda t: jax.tree.map(jnp.zeros_like, t)
      self.ref_state = (state_lib.abstract(policy_state.params, ref_sh) if abstract
                        else jax.jit(zeros, out_shardings=ref_sh)(policy_state.params))
    elif cfg.kl_coef > 0:
      model = state_lib.merge(self.policy_spec, policy_state)
      self.ref_graphdef, ref = nnx.split(model)
      ref_sh = parallel.tree_shardings(ref, self.mesh, rules)
      if abstract:
        self.ref_state = state_lib.abstract(ref, ref_sh)
      else:
        self.ref_state = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=ref_sh)(ref)

    if cfg.uses_critic:
      fn = steps_lib.make_sao_step(cfg, self.policy_spec, self.critic_spec, self.mesh, self.ref_graphdef)
    else:
      fn = steps_lib.make_group_step(cfg, self.policy_spec, self.mesh, self.ref_graphdef)
    fn = steps_lib.sharing_base(fn, self.policy_spec, self.critic_spec)
    # The step's numbers (bands, lambdas, coefficients, learning rates, schedules) are inputs, not constants: a
    # config or a sweep that changes only numbers runs the same compiled program (the persistent cache's hit).
    hparams = steps_lib.step_hparams(cfg, policy_hp, critic_hp)
    hparams_sh = jax.tree.map(lambda _: rep, hparams)
    self.hparams = (state_lib.abstract if abstract else state_lib.place)(hparams, hparams_sh)
    batch_sh = Batch.map_fields(lambda _: parallel.batch_sharding(self.mesh, 2))
    on_cpu = self.mesh.devices.flat[0].platform == 'cpu'
    self._step_fn = jax.jit(fn, in_shardings=(self.state_shardings, batch_sh, ref_sh, hparams_sh, base_sh),
                            out_shardings=(self.state_shardings, rep), donate_argnums=(0,),
                            compiler_options=dict(CPU_COMPILER_OPTIONS) if on_cpu and CPU_COMPILER_OPTIONS else None)
    self._batch_shardings = batch_sh
    self._compiled: dict[tuple[int, int, int], Any] = {}  # (rows, T, S) -> the update compiled ahead.
    self.max_consecutive_skips = o.max_consecutive_skips
    self.last_step_time_s = float('nan')

  # ---- Batches.

  def put_batch(self, batch: Batch) -> Batch:
    """Global row-sharded arrays from a host batch.

    One process: `batch` is the whole batch. Several processes: `batch` holds this process's rows
    (`parallel.local_row_range`) and the global batch is assembled without any host seeing all of it.
    A batch already placed (global arrays, or arrays on the learner's batch sharding) is passed through.
    """
    leaves = jax.tree.leaves(batch)
    if isinstance(batch, Batch) and all(
        isinstance(x, jax.Array) and (not x.is_fully_addressable or x.sharding.is_equivalent_to(sh, x.ndim))
        for x, sh in zip(leaves, jax.tree.leaves(self._batch_shardings))):
      return batch  # Already placed (e.g. by an earlier put_batch while the previous step ran).
    local = Batch.of_host(batch)
    parallel.sharding.check_batch_rows(local.tokens.shape[0] * jax.process_count(), self.mesh,
                                       'batch rows (config.trainer.batch_size)')
    if not self.step_config.uses_critic:
      check_groups(local.group_ids, local.segment_mask, self.step_config.group_size)
    if jax.process_count() == 1:
      return jax.device_put(local, self._batch_shardings)
    rows = local.tokens.shape[0] * jax.process_count()
    return parallel.global_batch(local, self.mesh, rows)

  # ---- Update.

  def compile_update(self, rows: int, seq_lens: Sequence[int], segments: int = 1) -> None:
    """Compiles the update ahead of time for global batches of `rows` x `T` tokens, each `T` in `seq_lens`, and
    `segments` trajectories per row (1 unpacked).

    `dispatch` then runs these executables and compiles nothing. On several processes the trainer calls this
    before a `parallel.sync` barrier, so the processes reach the update's first collective together however
    uneven their compile times (on the CPU backend the first collective of a device group sets up a gloo
    context, which fails when one process arrives more than 30 s after another). Lowering reads only the
    state's shapes and shardings: nothing runs, nothing is donated.
    """
    for seq_len in seq_lens:
      key = (int(rows), int(seq_len), int(segments))
      if key in self._compiled:
        continue
      t0 = time.perf_counter()
      self._compiled[key] = self.lower_update(*key).compile()
      logging.info('Compiled the learner update for batches of %d x %d tokens (%d per row) in %.1f s.', *key,
                   time.perf_counter() - t0)

  def lower_update(self, rows: int, seq_len: int, segments: int = 1) -> jax.stages.Lowered:
    """The update lowered for global batches of `rows` x `seq_len` tokens holding up to `segments` trajectories
    per row (shapes and shardings only)."""
    batch = Batch.map_fields(lambda k: jax.ShapeDtypeStruct(
        Batch.field_shape(k, rows, seq_len, segments), BATCH_FIELDS[k][1],
        sharding=getattr(self._batch_shardings, k)))
    return self._step_fn.lower(self.state, batch, self.ref_state, self.hparams, self.base)

  def update(self, batch: Batch) -> dict[str, float]:
    """One learner step on `batch`; returns host metrics (floats) including throughput.

    Raises:
      NonFiniteUpdateError: after `config.optim.max_consecutive_skips` consecutive skipped updates.
    """
    return self.collect(self.dispatch(batch))

  def dispatch(self, batch: Batch) -> tuple[Any, ...]:
    """Starts one learner step on `batch` and returns at once (JAX dispatch is asynchronous): the host can draw
    and place the next batch while the step runs. `collect` its result before dispatching another."""
    t0 = time.perf_counter()
    batch = self.put_batch(batch)
    key = (*batch.tokens.shape, batch.num_segments)
    step_fn = self._compiled.get(key, self._step_fn)  # Compiled ahead, else jit's.
    self.state, metrics = step_fn(self.state, batch, self.ref_state, self.hparams, self.base)
    counters = {'policy': self.state.policy.consecutive_skips}
    if self.state.critic is not None:
      counters['critic'] = self.state.critic.consecutive_skips
    return t0, batch.tokens.shape, metrics, counters

  def collect(self, pending: tuple[Any, ...]) -> dict[str, float]:
    """Waits for a dispatched step; returns its host metrics (see `update`)."""
    t0, (b, t), metrics, counters = pending
    metrics, counters = parallel.to_host((metrics, counters))
    dt = time.perf_counter() - t0
    self.last_step_time_s = dt
    out = {k: float(v) for k, v in metrics.items()}
    out['perf/step_time_s'] = dt
    out['perf/tokens_per_s'] = b * t * (1.0 - out['batch/padding_frac']) / dt  # Trained tokens (not padding).
    out['perf/padded_tokens_per_s'] = b * t / dt
    out['perf/action_tokens_per_s'] = out['batch/action_tokens'] / dt
    skipped = out.get('policy/skipped', 0.0) + out.get('critic/skipped', 0.0)
    if skipped and parallel.is_main_process():
      logging.warning('learner step %d: %d update(s) skipped for a non-finite loss or gradient '
                      '(consecutive: %s).', self.step, int(skipped), {k: int(v) for k, v in counters.items()})
    worst = max(int(v) for v in counters.values())
    if self.max_consecutive_skips and worst >= self.max_consecutive_skips:
      raise NonFiniteUpdateError(
          f'{worst} consecutive updates had a non-finite loss or gradient (config.optim.max_consecutive_skips='
          f'{self.max_consecutive_skips}); counters {dict((k, int(v)) for k, v in counters.items())}. '
          'Check the batch (rewards, behaviour log-probs) and the learning rates.')
    return out

  # ---- Accessors.

  @property
  def step(self) -> int:
    return int(parallel.to_host(self.state.step))

  def policy_model(self) -> nnx.Module:
    """The current policy as a module (arrays stay sharded on the learner mesh)."""
    return state_lib.merge(self.policy_spec, self.state.policy, self.base)

  def critic_model(self) -> nnx.Module | None:
    if self.critic_spec is None:
      return None
    return state_lib.merge(self.critic_spec, self.state.critic, self.base)

  def abstract_state(self) -> state_lib.LearnerState:
    """`jax.ShapeDtypeStruct`s (with shardings) of the learner state: the restore target of a checkpoint."""
    return state_lib.abstract(self.state, self.state_shardings)

  def policy_state(self) -> nnx.State:
    """All of the policy's state (params and the rest) for publishing to the sampler."""
    return nnx.state(self.policy_model())
