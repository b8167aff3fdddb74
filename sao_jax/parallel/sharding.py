"""Logical-axis rules -> `PartitionSpec` / `NamedSharding` for parameters, optimizer states and batches.

Every model parameter carries logical axis names in its NNX metadata (`out_sharding`, set by
`nnx.with_partitioning`), e.g. `('embed', 'mlp')`. `config.mesh.rules` maps each logical name to a mesh
axis, a tuple of mesh axes, or None (replicated). Nothing here is written per parameter: shardings are
derived from that metadata, and optimizer states inherit it because optax mirrors the parameter tree
(its `mu` / `nu` leaves are the same `nnx.Variable` nodes, metadata included).

Two rules keep every derived spec valid: a mesh axis is used at most once per array (a later dim that
asks for an axis already taken is replicated, as in MaxText), and a dim that its mesh axes do not divide
is replicated with a warning (the layout still works, only less sharded).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.errors import ConfigError
from sao_jax.parallel.mesh import BATCH_AXES
from sao_jax.parallel.mesh import MESH_AXES

Rules = Sequence[tuple[str, Any]]
_warned: set[tuple[str, ...]] = set()


def rules_dict(rules: Rules, mesh: Mesh | None = None) -> dict[str, tuple[str, ...]]:
  """Normalises `config.mesh.rules` to `{logical: (mesh axes...)}`; checks the mesh axes exist (those of
  `mesh`, or `MESH_AXES`) and that no logical name has two rules.

  Raises:
    ConfigError: naming `config.mesh.rules` for a malformed pair or an unknown mesh axis.
  """
  names = tuple(mesh.axis_names) if mesh is not None else MESH_AXES
  out = {}
  for pair in rules:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str):
      raise ConfigError(f'config.mesh.rules: {pair!r} is not a (logical_name, mesh_axes) pair.')
    logical, target = pair
    axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    unknown = [a for a in axes if a not in names]
    if unknown:
      raise ConfigError(
          f'config.mesh.rules maps {logical!r} to unknown mesh axes {unknown}; mesh axes are {list(names)}.')
    if logical in out:
      raise ConfigError(f'config.mesh.rules has two rules for {logical!r}.')
    out[logical] = axes
  return out


def logical_to_spec(logical_axes: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh,
                    rules: Rules | Mapping[str, tuple[str, ...]], *, name: str = '') -> PartitionSpec:
  """PartitionSpec of one array from its logical axis names.

  Args:
    logical_axes: one logical name (or None) per dim of the array; None/empty = replicated.
    shape: the array's shape (checked for divisibility).
    mesh: target mesh.
    rules: `config.mesh.rules` pairs, or the output of `rules_dict`.
    name: the array's path, for messages.

  Returns:
    A spec with, per dim, None, one mesh axis or a tuple of mesh axes.

  Raises:
    ConfigError: a logical name with no rule (naming `config.mesh.rules`), or rank mismatch.
  """
  if not logical_axes:
    return PartitionSpec()
  rules = rules if isinstance(rules, Mapping) else rules_dict(rules, mesh)
  if len(logical_axes) != len(shape):
    raise ConfigError(f'{name}: logical axes {tuple(logical_axes)} do not match its shape {tuple(shape)}.')
  used: set[str] = set()
  spec = []
  for logical, dim in zip(logical_axes, shape):
    if logical is None:
      spec.append(None)
      continue
    if logical not in rules:
      raise ConfigError(
          f'config.mesh.rules has no rule for logical axis {logical!r} (used by {name or "an array"} with '
          f'axes {tuple(logical_axes)}); add ({logical!r}, <mesh axis or None>).')
    axes = tuple(a for a in rules[logical] if a not in used and mesh.shape[a] > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    if axes and dim % size:
      key = (name, logical)
      if key not in _warned:
        _warned.add(key)
        logging.warning('%s: dim %d (%r) not divisible by mesh axes %s (size %d); replicated instead.',
                        name, dim, logical, axes, size)
      axes = ()
    used.update(axes)
    spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return PartitionSpec(*spec)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', getattr(k, 'idx', k)))) for k in path)


def tree_shardings(tree: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for every array in `tree` (an `nnx.State`, an optax state over one, or a pytree).

  `nnx.Variable` leaves with `out_sharding` metadata get the spec from their logical names; anything
  else (scalars such as optax's `count`, plain arrays) is replicated. Works on concrete and on abstract
  (`jax.ShapeDtypeStruct`) trees, so it can size a jit's `out_shardings` before anything is allocated.

  Returns:
    A tree of the same structure with `NamedSharding` where the arrays were.
  """
  rd = rules_dict(rules, mesh)

  def one(path, x):
    if _is_variable(x):
      value = x.get_value()
      logical = x.get_metadata().get('out_sharding')
      if isinstance(logical, PartitionSpec):
        logical = tuple(logical)
      shape = getattr(value, 'shape', ())
      if logical and len(logical) != len(shape):
        logical = None  # A state leaf whose shape differs from its parameter's (factored stats): replicate.
      return x.replace(NamedSharding(mesh, logical_to_spec(logical, shape, mesh, rd, name=_path_str(path))))
    return NamedSharding(mesh, PartitionSpec())

  return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_variable)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_spec(ndim: int) -> PartitionSpec:
  """Rows over `('data', 'fsdp')`, every other dim replicated."""
  return PartitionSpec(BATCH_AXES, *([None] * (ndim - 1)))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(ndim))


def batch_shardings(batch: Any, mesh: Mesh) -> Any:
  """A sharding per leaf of a batch pytree (e.g. `sao_jax.structs.Batch`): leading dim over the data axes."""
  return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x)), batch)


def check_batch_rows(rows: int, mesh: Mesh, what: str = 'config.trainer.batch_size') -> None:
  shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
  if rows % shards:
    raise ConfigError(f'{what}={rows} is not divisible by config.mesh.data * config.mesh.fsdp = {shards}.')


def shard_tree(tree: Any, shardings: Any) -> Any:
  """`jax.device_put` of a (single-process, fully addressable) tree onto its shardings."""
  return jax.device_put(tree, shardings)
