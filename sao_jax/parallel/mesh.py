"""Device mesh from the config, and the layout checks that must pass before anything is sharded.

The mesh has three named axes (MaxText / big_vision convention):

- `data`: pure data parallelism (parameters replicated along it);
- `fsdp`: data parallelism with parameters and optimizer states sharded along it (ZeRO-3 style);
- `tensor`: tensor (model) parallelism inside a layer (heads, MLP hidden, vocab).

Batches are split over `('data', 'fsdp')`, so `data * fsdp` must divide the number of rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from sao_jax.errors import ConfigError

MESH_AXES = ('data', 'fsdp', 'tensor')
BATCH_AXES = ('data', 'fsdp')
# Expert parallelism (MoE models): a mesh with an `expert` axis between fsdp and tensor; config.mesh.rules map the
# logical axis 'expert' (the experts dim of the MoE weights, `models.llama.MoeMLP`) to it, so an expert weight
# [E, D, F] lies over expert x fsdp x tensor. Rows are split over BATCH_AXES only (the expert axis holds every row
# of its fsdp shard). `make_mesh` builds the 3-axis mesh; an expert mesh is built with these names for now.
EXPERT_AXIS = 'expert'
MOE_MESH_AXES = ('data', 'fsdp', EXPERT_AXIS, 'tensor')


def mesh_shape(mesh_config: Any, num_devices: int) -> tuple[int, int, int]:
  """Resolves `config.mesh` (`data`, `fsdp`, `tensor`; one may be -1 = the rest) to concrete sizes.

  Args:
    mesh_config: `config.mesh` (anything with `data`, `fsdp`, `tensor` attributes or keys).
    num_devices: devices the mesh must cover exactly (all devices of all processes).

  Returns:
    `(data, fsdp, tensor)` whose product is `num_devices`.

  Raises:
    ConfigError: naming `config.mesh.<axis>` when the sizes cannot cover the devices.
  """
  sizes = {axis: int(_field(mesh_config, axis)) for axis in MESH_AXES}
  for axis, size in sizes.items():
    if size == 0 or size < -1:
      raise ConfigError(f'config.mesh.{axis}={size}: must be >= 1 or -1 (the rest of the devices).')
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ConfigError(f'config.mesh: at most one of data/fsdp/tensor may be -1, got {sizes}.')
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise ConfigError(
          f'config.mesh.{free[0]}=-1: the other axes ({sizes}) use {fixed} devices, which does not divide '
          f'the {num_devices} available devices.')
    sizes[free[0]] = num_devices // fixed
  elif fixed > num_devices:
    raise ConfigError(
        f'{_product(sizes)} = {fixed}: needs {fixed} devices but only {num_devices} exist '
        f'(jax.device_count()); shrink config.mesh.data/fsdp/tensor.')
  elif fixed != num_devices:
    raise ConfigError(
        f'{_product(sizes)} = {fixed}: covers {fixed} of the {num_devices} devices; the mesh must use all of them '
        '(set one axis to -1 to take the rest).')
  return sizes['data'], sizes['fsdp'], sizes['tensor']


def _product(sizes: dict[str, int]) -> str:
  return ' * '.join(f'config.mesh.{axis}={size}' for axis, size in sizes.items())


def make_mesh(mesh_config: Any, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the `('data', 'fsdp', 'tensor')` mesh over `devices` (default: all devices of all processes).

  Axes are `AxisType.Auto` (GSPMD propagation from the jit's in/out shardings). `jax.make_mesh` picks a
  topology-aware device order; the `tensor` axis is innermost so tensor-parallel collectives stay on
  neighbouring devices (and inside one host when it fits).
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(mesh_config, len(devices))
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  if len(devices) == jax.device_count() and devices == list(jax.devices()):
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)


def actor_device_count(mesh_config: Any) -> int:
  """`config.mesh.actor_devices` (0 when the field is absent)."""
  try:
    return int(_field(mesh_config, 'actor_devices'))
  except (KeyError, AttributeError):
    return 0


def split_devices(mesh_config: Any, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device] | None]:
  """The learner's devices (all processes) and this process's actor devices (tunix-style roles).

  `config.mesh.actor_devices = n > 0`: the first `n` local devices of EVERY process run its actors (the first
  ones, so the default device, where uncommitted host inputs land, is an actor device); the learner mesh spans
  the others. `n = 0`: one process shares the learner's mesh with the actors by reference (actor devices None);
  on several processes the actors of each one run on its local devices (which the learner also uses). Actor
  devices come sorted by id (the order of the copy `WeightPublisher` leaves on a process's devices).

  Raises:
    ConfigError: naming `config.mesh.actor_devices` when it leaves a process no learner device.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = actor_device_count(mesh_config)
  if n < 0:
    raise ConfigError(f'config.mesh.actor_devices={n}: must be >= 0 (0 = actors share the learner\'s devices).')
  by_process: dict[int, list[jax.Device]] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  if n == 0:
    local = sorted(by_process.get(jax.process_index(), []), key=lambda d: d.id)
    return devices, (None if len(by_process) == 1 else local)
  fewest = min(len(v) for v in by_process.values())
  if n >= fewest:
    raise ConfigError(f'config.mesh.actor_devices={n}: each process has {fewest} device(s) and the learner needs '
                      'at least one of them; lower it (0 = actors share the learner\'s devices).')
  actors = {p: sorted(v, key=lambda d: d.id)[:n] for p, v in by_process.items()}
  taken = {d.id for v in actors.values() for d in v}
  return [d for d in devices if d.id not in taken], actors.get(jax.process_index(), [])


def make_actor_mesh(devices: Sequence[jax.Device]) -> Mesh:
  """The actors' mesh over `devices` (one process's): every device on the `tensor` axis (heads, MLP and vocab
  split by `config.mesh.rules`; what does not divide is replicated), `data` and `fsdp` of size 1, so the same
  rules and logical axes serve both roles."""
  devices = list(devices)
  return Mesh(np.asarray(devices, dtype=object).reshape(1, 1, len(devices)), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def batch_divisor(mesh: Mesh) -> int:
  """Number of shards a batch's rows are split into (`data * fsdp`)."""
  return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def check_layout(config: Any, mesh: Mesh | Mapping[str, int], model_config: Any | None = None) -> None:
  """Refuses layouts that cannot work, naming the config fields.

  Checks: `trainer.batch_size` (and `trainer.minibatch_size`, `trainer.microbatch_size`) divisible by
  `data * fsdp`;
  attention heads and kv heads divisible by the mesh axis their logical names map to (`tensor` by
  default) when the model config is given.

  Args:
    config: the full config (`trainer`, `mesh.rules`).
    mesh: the mesh, or its shape `{axis: size}` (a mesh over devices this process cannot see).
    model_config: the policy's `ModelConfig` (or None: no head checks).

  Raises:
    ConfigError: naming the fields.
  """
  tr = config.trainer
  check_layout_sizes(mesh, batch_size=tr.batch_size, minibatch_size=tr.minibatch_size,
                     microbatch_size=tr.get('microbatch_size', 0), rules=config.mesh.rules, model_config=model_config)


def check_layout_sizes(mesh: Mesh | Mapping[str, int], *, batch_size: int, minibatch_size: int,
                       microbatch_size: int, rules: Any, model_config: Any | None = None) -> None:
  """`check_layout` of the values themselves (`config.trainer`'s sizes, `config.mesh.rules`): what a part that
  holds its own typed settings (the learner) checks."""
  shape = dict(mesh.shape) if isinstance(mesh, Mesh) else dict(mesh)
  shards = math.prod(shape[axis] for axis in BATCH_AXES)
  if batch_size % shards:
    raise ConfigError(
        f'config.trainer.batch_size={batch_size} is not divisible by config.mesh.data * config.mesh.fsdp '
        f'= {shape["data"]} * {shape["fsdp"]} = {shards} (rows are split over those axes).')
  if minibatch_size and minibatch_size % shards:
    raise ConfigError(
        f'config.trainer.minibatch_size={minibatch_size} is not divisible by config.mesh.data * '
        f'config.mesh.fsdp = {shards}: every minibatch is split over those axes.')
  if microbatch_size and microbatch_size % shards:
    raise ConfigError(
        f'config.trainer.microbatch_size={microbatch_size} is not divisible by config.mesh.data * '
        f'config.mesh.fsdp = {shards}: every microbatch is split over those axes.')
  if model_config is None:
    return
  rules = dict(rules)
  for logical, field in (('heads', 'num_heads'), ('kv_heads', 'num_kv_heads')):
    axes = _as_tuple(rules.get(logical))
    size = math.prod(shape[a] for a in axes) if axes else 1
    count = getattr(model_config, field)
    if count % size:
      raise ConfigError(
          f'model {field}={count} is not divisible by config.mesh.{"*".join(axes)}={size} '
          f"(config.mesh.rules maps '{logical}' to {axes}); change config.mesh.tensor or the rule.")


def _as_tuple(value: Any) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str):
    return (value,)
  return tuple(value)


def _field(obj: Any, name: str) -> Any:
  if isinstance(obj, dict):
    return obj[name]
  try:
    return obj[name]
  except (TypeError, KeyError):
    return getattr(obj, name)
