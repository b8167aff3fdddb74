"""Where the engines' weights come from: a `WeightsSource` holds the newest decode-layout snapshot, and the
learner's `WeightPublisher` converts each new policy into decode layout and compute dtype on the actors' devices
(a `DecodePolicy`), which every actor's source takes as it is.

A snapshot (`WeightsSnapshot`: weights and their policy version) is immutable and swapped as a whole: a device
call reads it once, so calls in flight finish on the weights they started with and every generated token
carries the version that produced it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from sao_jax import parallel
from sao_jax.models.config import ModelConfig
from sao_jax.models import decode as decode_lib
from sao_jax.models import lora
from sao_jax.models.decode import DecodeWeights, LayerWeights, decode_weights


@dataclasses.dataclass(frozen=True)
class WeightsSnapshot:
  """Decode-layout weights and the policy version they belong to (immutable; swapped as a whole)."""
  weights: DecodeWeights
  version: int


class SnapshotSource(Protocol):
  """What an engine reads its weights from: a `WeightsSource`, or anything with its `cfg` and `snapshot`."""
  cfg: ModelConfig

  @property
  def snapshot(self) -> WeightsSnapshot:
    ...


def _to_decode_layout(graphdef, state) -> DecodeWeights:
  return decode_weights(nnx.merge(graphdef, state))


_decode_layout = jax.jit(_to_decode_layout, static_argnums=(0,))  # One program per model graph, process-wide.


@dataclasses.dataclass(frozen=True)
class DecodePolicy:
  """A policy's weights in decode layout and compute dtype (what `WeightPublisher` hands the actors): engines and
  `WeightsSource.update_weights` take it wherever they take a model, without a conversion."""
  cfg: ModelConfig
  weights: DecodeWeights


class WeightsSource:
  """The engines' weights: the snapshot of the newest policy version taken (`update_weights`).

  Args:
    model: the policy (`sao_jax.models.llama.Decoder`, converted to decode layout) or a `DecodePolicy` (taken as
      is).
    version: its policy version.
  """

  def __init__(self, model: nnx.Module | DecodePolicy, *, version: int = 0):
    self.cfg: ModelConfig = model.cfg
    self._snapshot: WeightsSnapshot | None = None
    self.update_weights(model, version=version)

  def update_weights(self, model: nnx.Module | DecodePolicy, *, version: int | None = None) -> None:
    """Takes `model`'s weights, in decode layout, as the snapshot of policy `version` (default: the current
    version + 1): a `DecodePolicy`'s as they are (shared, no copy), a module's through one jitted conversion; then
    an atomic swap of the snapshot; no engine program recompiles."""
    if model.cfg != self.cfg:
      raise ValueError('update_weights: the model config differs from the one the engine was built for.')
    if version is None:
      version = self._snapshot.version + 1
    weights = model.weights if isinstance(model, DecodePolicy) else _decode_layout(*nnx.split(model))
    self._snapshot = WeightsSnapshot(weights, int(version))

  @property
  def snapshot(self) -> WeightsSnapshot:
    """The current (weights, version); a device call reads it once."""
    return self._snapshot

  @property
  def weights(self) -> DecodeWeights:
    return self._snapshot.weights

  @property
  def version(self) -> int:
    return self._snapshot.version


PROCESS_AXIS = 'processes'  # The publish layout's axis over processes (replicated: one copy per process).


def _process_rows(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
  """`devices` grouped by process (in process order), each group sorted by device id."""
  rows: dict[int, list[jax.Device]] = {}
  for d in devices:
    rows.setdefault(d.process_index, []).append(d)
  return [sorted(rows[p], key=lambda d: d.id) for p in sorted(rows)]


def _copies_mesh(learner_mesh: Mesh, rows: Sequence[Sequence[jax.Device]] | None
                 ) -> tuple[Mesh, tuple[int, ...] | None]:
  """The mesh of the copies over `learner_mesh`'s devices (`publish_shardings`) and its explicit device order."""
  flat = list(learner_mesh.devices.flat)
  rows = [list(r) for r in (_process_rows(flat) if rows is None else rows)]
  if len({len(r) for r in rows}) != 1 or sorted(d.id for r in rows for d in r) != sorted(d.id for d in flat):
    raise ValueError(f'publish_shardings: the copies\' device groups {[[d.id for d in r] for r in rows]} must be of '
                     f'one size and cover the learner mesh\'s devices {sorted(d.id for d in flat)} once.')
  mesh = Mesh(np.asarray(flat, dtype=object).reshape(len(rows), 1, 1, len(rows[0])),
              (PROCESS_AXIS, *parallel.MESH_AXES), axis_types=(AxisType.Auto,) * (1 + len(parallel.MESH_AXES)))
  # Mesh position (copy, 0, 0, i) holds device rows[copy][i]: an explicit device order over the learner mesh's
  # (`_logical_device_ids`, as jax's own `device_put` between device orders does), so the jit's in and out
  # shardings keep one device assignment.
  position = {d.id: i for i, d in enumerate(flat)}
  ids = tuple(position[d.id] for r in rows for d in r)
  return mesh, (None if ids == tuple(range(len(flat))) else ids)


def publish_shardings(abstract_state: Any, learner_mesh: Mesh, rules: Sequence[tuple[str, Any]], *,
                      rows: Sequence[Sequence[jax.Device]] | None = None) -> Any:
  """A copy per process over that process's devices of `learner_mesh` (sorted by id), sharded as
  `parallel.make_actor_mesh` over them and `rules` shard it (per device: the policy / its process's devices);
  device order the learner mesh's, so one jit reads the learner state and writes this.

  Args:
    abstract_state: the policy state (`nnx.split(model)[1]`), concrete or of `jax.ShapeDtypeStruct`s.
    learner_mesh: the learner's mesh (devices with `process_index` and `id`: real ones or a topology's).
    rules: `config.mesh.rules`.
    rows: the copies' device groups, one per copy, covering `learner_mesh` (default: by `process_index`).

  Returns:
    A `NamedSharding` per array of `abstract_state` (same tree structure).

  Raises:
    ValueError: groups of unequal sizes, or not covering the learner mesh's devices once.
  """
  mesh, ids = _copies_mesh(learner_mesh, rows)
  return jax.tree.map(lambda s: NamedSharding(mesh, s.spec, _logical_device_ids=ids),
                      parallel.tree_shardings(abstract_state, mesh, rules))


def decode_shardings(weights: DecodeWeights, mesh: Mesh, rules: Sequence[tuple[str, Any]], *,
                     ids: tuple[int, ...] | None = None) -> DecodeWeights:
  """Where decode-layout `weights` (arrays or `jax.ShapeDtypeStruct`s) lie on `mesh`: their logical names
  (`decode.layer_axes`, `decode.outer_axes`) mapped by `rules` (a dim they do not divide is replicated); `ids`: the
  mesh's explicit device order (`_copies_mesh`)."""
  rules_map = parallel.rules_dict(rules, mesh)

  def one(names, x, what):
    if x is None:
      return None
    spec = parallel.logical_to_spec(names, x.shape, mesh, rules_map, name=what)
    return NamedSharding(mesh, spec, _logical_device_ids=ids)

  layer = lambda w: LayerWeights(**{f.name: one(decode_lib.layer_axes(f.name), getattr(w, f.name), f.name)
                                    for f in dataclasses.fields(LayerWeights)})
  return DecodeWeights(embed=one(decode_lib.outer_axes('embed'), weights.embed, 'embed'),
                       layers=tuple(layer(w) for w in weights.layers),
                       final_norm=one(decode_lib.outer_axes('final_norm'), weights.final_norm, 'final_norm'),
                       unembed=one(decode_lib.outer_axes('unembed'), weights.unembed, 'unembed'))


def _reshard_steps(x: jax.Array, source: Any, target: NamedSharding) -> jax.Array:
  """`x` (laid out as `source`) toward `target` (a `publish_shardings` sharding) in steps XLA's partitioner does
  without gathering the whole array on one device: its split dim split over `tensor` and another dim over the
  processes, in the learner's device order (an all-to-all), then in the copies' order (a collective-permute); the
  program's out sharding then gathers the processes' parts (an all-gather). Straight from the learner's layout,
  the partitioner replicates a multi-process target's arrays first ("involuntary full rematerialization")."""
  spec = tuple(target.spec) + (None,) * (x.ndim - len(target.spec))
  split = [i for i, a in enumerate(spec) if a is not None]
  if not split:
    return x
  d = split[0]
  mesh = target.mesh
  held = tuple(getattr(source, 'spec', ())) + (None,) * x.ndim
  first = [i for i in range(x.ndim) if held[i] is not None] + sorted(range(x.ndim), key=lambda i: -x.shape[i])
  e = next((i for i in first if i != d and x.shape[i] % mesh.shape[PROCESS_AXIS] == 0), None)
  if e is not None:
    step = [None] * x.ndim
    step[d], step[e] = spec[d], PROCESS_AXIS
    ids = target._logical_device_ids  # pylint: disable=protected-access
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*step)))
    if ids is not None:
      x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*step), _logical_device_ids=ids))
  return jax.lax.with_sharding_constraint(x, target)


def _drop_leading(s: NamedSharding) -> NamedSharding:
  """`s` for a slice along an array's leading (layers) dim."""
  return NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:]), _logical_device_ids=s._logical_device_ids)  # pylint: disable=protected-access


@dataclasses.dataclass
class PublishPrograms:
  """The publish of one learner layout, lowered or compiled (`lower_publish`): `layer(params, i)` -> layer i's
  `LayerWeights` on the copies' `decode_shardings` (run once per layer: temporaries of one layer), and
  `outer(params)` -> (embed, final_norm, unembed); `index_sharding` is where `i` lies."""
  layer: Any
  outer: Any
  num_layers: int
  index_sharding: NamedSharding
  shardings: DecodeWeights  # The copies' decode_shardings.
  abstract: DecodeWeights  # Their shapes and dtypes.
  _indices: list[jax.Array] | None = None  # Each layer's `i`, made at the first call (on real devices).

  def compile(self) -> PublishPrograms:
    return dataclasses.replace(self, layer=self.layer.compile(), outer=self.outer.compile())

  def __call__(self, model: nnx.Module) -> DecodeWeights:
    """The copies of `model` (the learner's policy), compiled programs run one after another."""
    if self._indices is None:
      self._indices = [jax.make_array_from_callback((), self.index_sharding, lambda _, i=i: np.int32(i))
                       for i in range(self.num_layers)]
    stacked = decode_lib.layer_params(model)
    layers = tuple(self.layer(stacked, i) for i in self._indices)
    embed, final_norm, unembed = self.outer(decode_lib.outer_params(model))
    return DecodeWeights(embed=embed, layers=layers, final_norm=final_norm, unembed=unembed)


def lower_publish(model: nnx.Module, learner_mesh: Mesh, rules: Sequence[tuple[str, Any]], *,
                  rows: Sequence[Sequence[jax.Device]] | None = None) -> PublishPrograms:
  """The publish of `model` (a policy whose arrays, concrete or `jax.ShapeDtypeStruct`s, lie on `learner_mesh`)
  into decode layout, compute dtype, as a copy per process over that process's learner devices
  (`publish_shardings`' mesh; `rows`: its device groups), lowered. Per layer, one program slices layer i of the
  stacked parameters, casts them, moves them toward the copies' layout (`_reshard_steps`: never the whole array
  on a device) and fuses them (`decode.decode_layer`); another does the embeddings and the final norm. A device
  holds the decode weights / its process's devices, plus one layer's temporaries."""
  cfg: ModelConfig = model.cfg
  dt = jnp.dtype(cfg.dtype)
  stacked, outer = decode_lib.layer_params(model), decode_lib.outer_params(model)
  mesh, ids = _copies_mesh(learner_mesh, rows)
  copies = publish_shardings(nnx.state(model), learner_mesh, rules, rows=rows)  # The model-form copies' layout.
  stacked_target = decode_lib.named_params(copies, decode_lib.LAYER_PATHS)
  outer_target = decode_lib.named_params(copies, decode_lib.OUTER_PATHS)
  source = lambda tree: {k: x.sharding for k, x in tree.items()}
  stacked_source, outer_source = source(stacked), source(outer)
  abstract = jax.eval_shape(lambda s, o: decode_lib.assemble(cfg, s, o), stacked, outer)
  shardings = decode_shardings(abstract, mesh, rules, ids=ids)
  index_sharding = NamedSharding(learner_mesh, PartitionSpec())

  def cast(name, x):
    return x if decode_lib.is_norm(name) else x.astype(dt)

  def layer(params, i):
    one = {k: cast(k, jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False)) for k, x in params.items()}
    one = {k: _reshard_steps(x, _drop_leading(stacked_source[k]), _drop_leading(stacked_target[k]))
           for k, x in one.items()}
    return jax.tree.map(jnp.copy, decode_lib.decode_layer(cfg, one))

  def outer_fn(params):
    moved = {k: _reshard_steps(cast(k, x), outer_source[k], outer_target[k]) for k, x in params.items()}
    return jax.tree.map(jnp.copy, decode_lib.decode_outer(cfg, moved))  # Copies: never the learner's buffers.

  outer_out = (shardings.embed, shardings.final_norm, shardings.unembed)
  layer_fn = jax.jit(layer, in_shardings=(stacked_source, index_sharding), out_shardings=shardings.layers[0])
  outer_jit = jax.jit(outer_fn, in_shardings=(outer_source,), out_shardings=outer_out)
  index = jax.ShapeDtypeStruct((), jnp.int32, sharding=index_sharding)
  return PublishPrograms(layer=layer_fn.lower(stacked, index), outer=outer_jit.lower(outer),
                         num_layers=cfg.num_layers, index_sharding=index_sharding, shardings=shardings,
                         abstract=abstract)


def publish_bytes(model: nnx.Module, learner_mesh: Mesh, rules: Sequence[tuple[str, Any]], **kwargs
                  ) -> tuple[int, int]:
  """Per device, compiled (`lower_publish`, same arguments): the publish's output bytes (every layer's and the
  outer program's) and its largest temporaries (one program's)."""
  programs = lower_publish(model, learner_mesh, rules, **kwargs).compile()
  layer, outer = programs.layer.memory_analysis(), programs.outer.memory_analysis()
  return (programs.num_layers * layer.output_size_in_bytes + outer.output_size_in_bytes,
          max(layer.temp_size_in_bytes, outer.temp_size_in_bytes))


def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


def _assemble(box, held, device: jax.Device) -> jax.Array:
  """The block `box` of an array on `device`: slices of the held shards that overlap it (cut on their own
  devices), copied to `device` and concatenated there."""
  pieces = []
  for have, shards in held.items():
    overlap = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, have))
    if any(lo >= hi for lo, hi in overlap):
      continue
    data = shards[0].data
    if overlap != have:
      data = data[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(overlap, have))]
    pieces.append((tuple(lo for lo, _ in overlap), jax.device_put(data, device)))

  def concat(group, dim):  # The pieces tile a grid: concatenated along each dim in turn.
    if len(group) == 1:
      return group[0][1]
    starts = sorted({p[0][dim] for p in group})
    parts = [concat([p for p in group if p[0][dim] == s], dim + 1) for s in starts]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=dim)

  return concat(pieces, 0)


def local_reshard(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """`x` with `sharding` (over this process's devices) from `x`'s own addressable shards, device to device, no
  host copy and no collective: each device's block is `x`'s shard with that block where one exists (kept as is
  when it already lies on that device), else cut from the shards that overlap it and concatenated there."""
  shape = tuple(x.shape)
  held: dict[tuple, list] = {}
  for shard in x.addressable_shards:
    held.setdefault(_box(shard.index, shape), []).append(shard)
  out = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    box = _box(index, shape)
    if box not in held:
      out.append(_assemble(box, held, device))
      continue
    here = [s.data for s in held[box] if s.device == device]
    out.append(here[0] if here else jax.device_put(held[box][0].data, device))
  return jax.make_array_from_single_device_arrays(shape, sharding, out)


class _Published(NamedTuple):
  policy: DecodePolicy  # On the actors' sharding; futures until the update that computes them has run.
  version: int


def _copied(weights: DecodeWeights) -> DecodeWeights:
  return jax.tree.map(jnp.copy, weights)  # New buffers: the learner's next update donates its state.


_decode_copy = jax.jit(lambda graphdef, state: _copied(_to_decode_layout(graphdef, state)), static_argnums=(0,))


def _merge_adapters(cfg: ModelConfig, layers: tuple[LayerWeights, ...], adapters: dict[str, jax.Array]
                    ) -> tuple[LayerWeights, ...]:
  """The base's decode-layout `layers` plus the LoRA adapters (`layer_params` names, stacked `[L, ...]`)."""
  return tuple(decode_lib.add_adapters(cfg, w, {k: x[i] for k, x in adapters.items()}) for i, w in enumerate(layers))


class WeightPublisher:
  """The newest policy weights and their version, in decode layout and compute dtype on the actors' sharding
  (`DecodePolicy`): one copy per version a process's actors all share (module docstring).

  Args:
    actor_mesh: this process's actors' mesh (`parallel.make_actor_mesh`), the copy sharded on it by `rules`
      (`decode_shardings`); or None: one process whose actors share the learner's mesh (one jitted conversion, laid
      out as XLA chooses from the learner's sharding).
    rules: `config.mesh.rules`.

  With an actor mesh, `lower_publish`'s programs (which every process runs at the same point of the loop) convert
  the learner state layer by layer into a copy per process over its own learner devices, sharded as the actors'
  is: a device holds the decode weights / its process's learner devices, never the whole policy, and one layer's
  temporaries. With `mesh.actor_devices=0` those are the actors' devices and that copy is the actors' (no further
  copy); else `local_reshard` moves it device to device onto the actor devices. All of it is dispatched
  asynchronously (no host copy): the learner goes on.

  A LoRA policy (`config.model.lora`): its frozen base is copied as above once, at the first publish; every later
  publish moves its adapters only (a few MB), which a program on the actors' devices merges into a new copy of the
  base's layers (`_lora_to_actors`).

  Published weights are futures of the programs that compute them. Besides the newest, the publisher keeps the
  newest computed version (`latest(computed=True)`, `computed_version`) until a newer one is computed too, so an
  actor that only takes computed weights always finds one (two copies at most; the trainer publishes once each
  update has run, so its temporaries and a second copy are not allocated together).
  """

  def __init__(self, actor_mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] = ()):
    self._actor_mesh = actor_mesh
    self._rules = tuple(rules)
    self._lock = threading.Lock()
    self._published: list[_Published] = []  # Oldest first: the newest computed one, then newer ones in flight.
    self._programs: PublishPrograms | None = None
    self._target: DecodeWeights | None = None
    self._base: DecodeWeights | None = None  # LoRA: the base on the actors' side (`_lora_to_actors`).
    self._merge = None

  def _to_actors(self, model: nnx.Module) -> DecodeWeights:
    if self._actor_mesh is None:
      return _decode_copy(*nnx.split(model))
    if self._programs is None:
      learner_mesh = next(x.sharding.mesh for x in jax.tree.leaves(nnx.state(model))
                          if isinstance(x.sharding, NamedSharding))
      self._programs = lower_publish(model, learner_mesh, self._rules).compile()
      self._target = decode_shardings(self._programs.abstract, self._actor_mesh, self._rules)
      # Compiled before, run after a barrier: its device groups' first collective (a gloo context on CPU, which
      # fails when a process comes more than 30 s after another) starts with the processes together.
      parallel.sync('publish')
    return jax.tree.map(local_reshard, self._programs(model), self._target)

  def _computed(self, entry: _Published) -> bool:
    """`entry`'s arrays hold values (a program reading them runs at once)."""
    return all(x.is_ready() for x in jax.tree.leaves(entry.policy.weights))

  def _newest_computed(self) -> _Published | None:
    """Under the lock: the newest computed entry (older ones are let go), or None."""
    for i in range(len(self._published) - 1, -1, -1):
      if self._computed(self._published[i]):
        del self._published[:i]
        return self._published[0]
    return None

  def _lora_to_actors(self, model: nnx.Module) -> DecodeWeights:
    """A LoRA policy's weights for the actors: its base copied once (the first publish, `_to_actors` of
    `base_model()`), then each version's adapters moved (replicated onto the base's devices: their bytes only) and
    merged there into a new copy of the base's layers (`decode.add_adapters`); embeddings and norms are the base's."""
    if self._base is None:
      self._base = self._to_actors(model.base_model())
      self._merge = jax.jit(functools.partial(_merge_adapters, model.cfg),
                            out_shardings=jax.tree.map(lambda x: x.sharding, self._base.layers))
    adapters = decode_lib.named_params(nnx.state(model, lora.ADAPTERS), decode_lib.LAYER_PATHS)
    here = self._base.embed.sharding
    here = NamedSharding(here.mesh, PartitionSpec()) if isinstance(here, NamedSharding) else here
    adapters = {k: jax.device_put(x if x.is_fully_addressable else np.asarray(
        multihost_utils.process_allgather(x, tiled=True)), here) for k, x in adapters.items()}
    return self._base.replace(layers=self._merge(self._base.layers, adapters))

  def publish(self, model: nnx.Module, *, version: int) -> None:
    """Copies `model` (the learner's policy) for the actors as policy `version` (a LoRA policy: `_lora_to_actors`)."""
    weights = self._lora_to_actors(model) if model.cfg.lora_rank else self._to_actors(model)
    policy = DecodePolicy(model.cfg, weights)
    with self._lock:
      self._published.append(_Published(policy, int(version)))
      self._newest_computed()

  @property
  def version(self) -> int:
    """The newest published version (-1 before the first)."""
    with self._lock:
      return self._published[-1].version if self._published else -1

  @property
  def computed_version(self) -> int:
    """The newest version whose weights are computed (-1 when none is yet)."""
    with self._lock:
      entry = self._newest_computed()
      return -1 if entry is None else entry.version

  def latest(self, computed: bool = False) -> tuple[DecodePolicy, int]:
    """The newest published weights, with their version; `computed`: the newest computed ones (taking them costs
    no wait; a program reading weights still in flight waits for their update, even on devices of its own)."""
    with self._lock:
      if not self._published:
        raise RuntimeError('No weights have been published yet.')
      entry = self._newest_computed() if computed else self._published[-1]
      if entry is None:
        raise RuntimeError('No published weights are computed yet.')
    return entry.policy, entry.version
