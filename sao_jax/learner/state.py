"""Train states: one per model (policy, critic), sharded from their logical-axis metadata.

A model is split with an NNX filter into the *trainable* parameters and the *rest* (frozen parameters,
such as the critic's attention under SAO, plus any non-parameter variables). Gradients are taken only
w.r.t. the trainable part and the optimizer is initialised on it alone, so frozen leaves have neither
gradients nor optimizer state: that is how frozen attention saves memory and compute, not a zero mask.

A shared base (LoRA: `sao_jax.models.lora`): the frozen weights that policy and critic have in common are held
once, outside both train states (`split_base`); each model's spec records where they sit in it (`base_paths`,
the critic's under `backbone`), and `with_base` lends them to a train state's `rest` inside a program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from sao_jax import parallel


@flax.struct.dataclass
class TrainState:
  """Device state of one model.

  Attributes:
    params: trainable parameters (`nnx.State`); the only leaves with gradients and optimizer state.
    rest: everything else of the model (`nnx.State`): frozen parameters, non-parameter variables.
    opt_state: optax state over `params`.
    step: optimizer updates applied (int32 scalar).
    skipped: updates skipped because the loss or gradient was non-finite (int32, total).
    consecutive_skips: skips since the last applied update (int32).
  """
  params: Any
  rest: Any
  opt_state: Any
  step: jax.Array
  skipped: jax.Array
  consecutive_skips: jax.Array


@flax.struct.dataclass
class LearnerState:
  """Everything the learner updates: one train state per model and the learner-step counter.

  Attributes:
    policy: the policy's `TrainState`.
    critic: the critic's `TrainState` (None for the GRPO family).
    step: learner steps done (int32); the critic-only warmup compares it to `critic_warmup_steps`.
  """
  policy: TrainState
  critic: TrainState | None
  step: jax.Array


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Static side of a train state: how to rebuild the module and update it.

  Attributes:
    graphdef: the module's graph definition.
    tx: the optimizer, its hyperparameters compiled in.
    trainable: the nnx filter that selects `TrainState.params`.
    tx_at: the same optimizer with its hyperparameters from a pytree (`optim.OptimHParams`), which the learner
      passes to its jitted update as inputs (None: `tx` only). Same optimizer-state tree as `tx`.
    shared: the nnx filter of the leaves held in a shared base (None: none; `create_train_state`).
    base_paths: the paths of the model's leaves that come from a shared base (`with_base`); () = none.
    base_prefix: what those paths start with in the model and not in the base (the critic's `('backbone',)`).
  """
  graphdef: Any
  tx: optax.GradientTransformation
  trainable: Any
  tx_at: Callable[[Any], optax.GradientTransformation] | None = None
  shared: Any = None
  base_paths: tuple[tuple[str, ...], ...] = ()
  base_prefix: tuple[str, ...] = ()


def _counter() -> jax.Array:
  return jnp.zeros((), jnp.int32)


def place(tree: Any, shardings: Any) -> Any:
  """Puts a host/device tree onto `shardings`; works across processes (every process holds the same tree)."""
  def one(x, s):
    if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
      return jax.device_put(x, s, may_alias=False)  # A copy: the learner donates its buffers.
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # A global array: resharded on the devices.
      return jax.jit(jnp.copy, out_shardings=s)(x)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])
  return jax.tree.map(one, tree, shardings)


def abstract(tree: Any, shardings: Any) -> Any:
  """`jax.ShapeDtypeStruct`s of `tree`'s arrays (concrete or abstract) carrying `shardings` (a tree of the same
  structure): what `jax.jit(...).lower` takes to compile a program without allocating its inputs."""
  def one(x, s):
    if not hasattr(x, 'dtype'):
      x = np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(one, tree, shardings)


def _paths(state: Any) -> tuple[tuple[str, ...], ...]:
  return tuple(tuple(str(k) for k in path) for path, _ in nnx.to_flat_state(state))


def _split_placed(model: nnx.Module | Callable[[], nnx.Module], filters: tuple[Any, ...], keep: tuple[int, ...],
                  mesh: Mesh, rules, abstract_only: bool) -> tuple[Any, list[Any], list[Any], list[Any]]:
  """`nnx.split(model, *filters)`: (graphdef, the abstract parts, the `keep` parts placed on `mesh` (or abstract),
  their shardings). A model function runs under one jit whose outputs are the kept parts, sharded, so a large model
  is never whole on one device and a part not kept is never computed."""
  if callable(model) and not isinstance(model, nnx.Module):
    model_fn = model

    def split_fn():
      with nnx.use_eager_sharding(False):
        return nnx.split(model_fn(), *filters)

    graphdef, *abs_parts = _abstract_split(split_fn)
    shardings = [parallel.tree_shardings(abs_parts[i], mesh, rules) for i in keep]
    if abstract_only:
      parts = [abstract(abs_parts[i], sh) for i, sh in zip(keep, shardings)]
    else:
      parts = list(jax.jit(lambda: tuple(split_fn()[1 + i] for i in keep), out_shardings=tuple(shardings))())
    return graphdef, abs_parts, parts, shardings
  if abstract_only:
    raise ValueError('create_train_state(abstract_only=True) takes a function that creates the model.')
  graphdef, *all_parts = nnx.split(model, *filters)
  shardings = [parallel.tree_shardings(all_parts[i], mesh, rules) for i in keep]
  return graphdef, all_parts, [place(all_parts[i], sh) for i, sh in zip(keep, shardings)], shardings


def create_train_state(model: nnx.Module | Callable[[], nnx.Module], tx: optax.GradientTransformation,
                       mesh: Mesh, rules, *, trainable: Any = nnx.Param, shared: Any = None,
                       base_prefix: tuple[str, ...] = (), abstract_only: bool = False
                       ) -> tuple[ModelSpec, TrainState, TrainState]:
  """Builds a sharded train state.

  Args:
    model: a module (its values are placed onto the mesh), or a zero-argument function that creates
      one (run under `jax.jit` with sharded outputs, so a large model is never whole on one device).
    tx: the optimizer.
    mesh: learner mesh.
    rules: `config.mesh.rules`.
    trainable: nnx filter of the leaves that train (e.g. `nnx.All(nnx.Param, nnx.Not(CRITIC_ATTENTION))`).
    shared: nnx filter of the (frozen) leaves held in a shared base instead (`split_base`; None: none): they are
      left out of the state (and never computed from a model function); the spec records their paths.
    base_prefix: the shared leaves' path prefix in this model that the base does not have (`ModelSpec`).
    abstract_only: the state as `jax.ShapeDtypeStruct`s with their shardings (`abstract`): nothing is allocated,
      so a model of any size can be planned on a small host (`model` must then be a function).

  Returns:
    `(spec, state, shardings)`: static spec, the state, and a `TrainState` of `NamedSharding`s
    (for jit in/out shardings).
  """
  filters = (trainable, ...) if shared is None else (trainable, shared, ...)
  rest_index = len(filters) - 1
  graphdef, abs_parts, (params, rest), (p_sh, r_sh) = _split_placed(model, filters, (0, rest_index), mesh, rules,
                                                                    abstract_only)
  base_paths = () if shared is None else _paths(abs_parts[1])
  abs_opt = jax.eval_shape(tx.init, params)
  o_sh = parallel.tree_shardings(abs_opt, mesh, rules)
  rep = parallel.replicated(mesh)
  if abstract_only:
    opt_state = abstract(abs_opt, o_sh)
    counters = tuple(jax.ShapeDtypeStruct((), jnp.int32, sharding=rep) for _ in range(3))
  else:
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(params)
    counters = jax.jit(lambda: (_counter(), _counter(), _counter()), out_shardings=(rep, rep, rep))()
  state = TrainState(params, rest, opt_state, *counters)
  shardings = TrainState(p_sh, r_sh, o_sh, rep, rep, rep)
  spec = ModelSpec(graphdef, tx, trainable, shared=shared, base_paths=base_paths, base_prefix=base_prefix)
  return spec, state, shardings


def split_base(model: nnx.Module | Callable[[], nnx.Module], trainable: Any, shared: Any, mesh: Mesh, rules, *,
               abstract_only: bool = False) -> tuple[Any, Any]:
  """The leaves of `model` that `shared` selects (and `trainable` does not), placed on `mesh` as
  `create_train_state` places a state (or abstract): `(base, shardings)`, the base other models share."""
  _, _, (base,), (shardings,) = _split_placed(model, (trainable, shared, ...), (1,), mesh, rules, abstract_only)
  return base, shardings


def with_base(spec: ModelSpec, ts: TrainState | None, base: Any) -> TrainState | None:
  """`ts` whose `rest` also holds the shared `base`'s leaves at `spec.base_paths` (unchanged when the model shares
  none): what `merge` and the update steps need to run the model."""
  if ts is None or not spec.base_paths or base is None:
    return ts
  flat = {tuple(str(k) for k in path): var for path, var in nnx.to_flat_state(base)}
  n = len(spec.base_prefix)
  view = nnx.from_flat_state([(path, flat[path[n:]]) for path in spec.base_paths])
  return ts.replace(rest=nnx.merge_state(ts.rest, view))


def _abstract_split(split_fn):
  """`nnx.split` of a model built abstractly (shapes only) -> (graphdef, *abstract parts)."""
  box = {}

  def f():
    graphdef, *parts = split_fn()
    box['graphdef'] = graphdef
    return tuple(parts)

  parts = jax.eval_shape(f)
  return (box['graphdef'], *parts)


def own_state(spec: ModelSpec, model: nnx.Module) -> Any:
  """The state of `model` but its shared base's leaves: what a checkpoint holds of it (all of it without a base)."""
  return nnx.state(model) if spec.shared is None else nnx.state(model, nnx.Not(spec.shared))


def split_own(spec: ModelSpec, model: nnx.Module) -> tuple[Any, Any]:
  """(params, rest) of `model` as its train state holds them (its shared base's leaves left out)."""
  if spec.shared is None:
    return nnx.split(model, spec.trainable, ...)[1:]
  _, params, _, rest = nnx.split(model, spec.trainable, spec.shared, ...)
  return params, rest


def merge(spec: ModelSpec, state: TrainState, base: Any = None) -> nnx.Module:
  """The module of a train state (inside or outside jit); `base`: the shared base, for a model that has one."""
  state = with_base(spec, state, base)
  return nnx.merge(spec.graphdef, state.params, state.rest)


def num_elements(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
