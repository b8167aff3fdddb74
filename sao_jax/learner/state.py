"""Train states: one per model (policy, critic), sharded from their logical-axis metadata.

A model is split with an NNX filter into the *trainable* parameters and the *rest* (frozen parameters,
such as the critic's attention under SAO, plus any non-parameter variables). Gradients are taken only
w.r.t. the trainable part and the optimizer is initialised on it alone, so frozen leaves have neither
gradients nor optimizer state: that is how frozen attention saves memory and compute, not a zero mask.
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
  """
  graphdef: Any
  tx: optax.GradientTransformation
  trainable: Any
  tx_at: Callable[[Any], optax.GradientTransformation] | None = None


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


def create_train_state(model: nnx.Module | Callable[[], nnx.Module], tx: optax.GradientTransformation,
                       mesh: Mesh, rules, *, trainable: Any = nnx.Param, abstract_only: bool = False
                       ) -> tuple[ModelSpec, TrainState, TrainState]:
  """Builds a sharded train state.

  Args:
    model: a module (its values are placed onto the mesh), or a zero-argument function that creates
      one (run under `jax.jit` with sharded outputs, so a large model is never whole on one device).
    tx: the optimizer.
    mesh: learner mesh.
    rules: `config.mesh.rules`.
    trainable: nnx filter of the leaves that train (e.g. `nnx.All(nnx.Param, nnx.Not(CRITIC_ATTENTION))`).
    abstract_only: the state as `jax.ShapeDtypeStruct`s with their shardings (`abstract`): nothing is allocated,
      so a model of any size can be planned on a small host (`model` must then be a function).

  Returns:
    `(spec, state, shardings)`: static spec, the state, and a `TrainState` of `NamedSharding`s
    (for jit in/out shardings).
  """
  if callable(model) and not isinstance(model, nnx.Module):
    model_fn = model

    def split_fn():
      with nnx.use_eager_sharding(False):
        return nnx.split(model_fn(), trainable, ...)

    graphdef, abs_params, abs_rest = _abstract_split(split_fn)
    p_sh = parallel.tree_shardings(abs_params, mesh, rules)
    r_sh = parallel.tree_shardings(abs_rest, mesh, rules)
    if abstract_only:
      params, rest = abstract(abs_params, p_sh), abstract(abs_rest, r_sh)
    else:
      params, rest = jax.jit(lambda: split_fn()[1:], out_shardings=(p_sh, r_sh))()
  elif abstract_only:
    raise ValueError('create_train_state(abstract_only=True) takes a function that creates the model.')
  else:
    graphdef, params, rest = nnx.split(model, trainable, ...)
    p_sh = parallel.tree_shardings(params, mesh, rules)
    r_sh = parallel.tree_shardings(rest, mesh, rules)
    params, rest = place(params, p_sh), place(rest, r_sh)
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
  return ModelSpec(graphdef, tx, trainable), state, shardings


def _abstract_split(split_fn):
  """`nnx.split` of a model built abstractly (shapes only) -> (graphdef, abstract params, abstract rest)."""
  box = {}

  def f():
    graphdef, params, rest = split_fn()
    box['graphdef'] = graphdef
    return params, rest

  abs_params, abs_rest = jax.eval_shape(f)
  return box['graphdef'], abs_params, abs_rest


def merge(spec: ModelSpec, state: TrainState) -> nnx.Module:
  """The module of a train state (inside or outside jit)."""
  return nnx.merge(spec.graphdef, state.params, state.rest)


def num_elements(tree: Any) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))
