"""Where the engines' weights come from: a `WeightsSource` holds the newest decode-layout snapshot, and the
learner's `WeightPublisher` copies each new policy onto the actors' devices for the sources to take.

A snapshot (`WeightsSnapshot`: weights and their policy version) is immutable and swapped as a whole: a device
call reads it once, so calls in flight finish on the weights they started with and every generated token
carries the version that produced it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from sao_jax import parallel
from sao_jax.models.config import ModelConfig
from sao_jax.models.decode import DecodeWeights, decode_weights


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


class WeightsSource:
  """The engines' weights: the snapshot of the newest policy version taken (`update_weights`).

  Args:
    model: the policy (`sao_jax.models.llama.Decoder`) whose weights are converted to decode layout.
    version: its policy version.
  """

  def __init__(self, model: nnx.Module, *, version: int = 0):
    self.cfg: ModelConfig = model.cfg
    self._snapshot: WeightsSnapshot | None = None
    self.update_weights(model, version=version)

  def update_weights(self, model: nnx.Module, *, version: int | None = None) -> None:
    """Takes `model`'s weights, in decode layout, as the snapshot of policy `version` (default: the current
    version + 1): one jitted conversion, then an atomic swap of the snapshot; no engine program recompiles."""
    if model.cfg != self.cfg:
      raise ValueError('update_weights: the model config differs from the one the engine was built for.')
    if version is None:
      version = self._snapshot.version + 1
    graphdef, state = nnx.split(model)
    self._snapshot = WeightsSnapshot(_decode_layout(graphdef, state), int(version))

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


def publish_shardings(abstract_state: Any, learner_mesh: Mesh, rules: Sequence[tuple[str, Any]], *,
                      rows: Sequence[Sequence[jax.Device]] | None = None) -> Any:
  """Where `publish_reshard` leaves the policy: a copy per process over that process's devices of `learner_mesh`
  (sorted by id), sharded as `parallel.make_actor_mesh` over them and `rules` shard it (per device: the policy /
  its process's devices); device order the learner mesh's, so one jit reads the learner state and writes this.

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
  ids = None if ids == tuple(range(len(flat))) else ids
  return jax.tree.map(lambda s: NamedSharding(mesh, s.spec, _logical_device_ids=ids),
                      parallel.tree_shardings(abstract_state, mesh, rules))


def _reshard_steps(x: jax.Array, source: Any, target: NamedSharding) -> jax.Array:
  """`x` (laid out as `source`) toward `target` (a `publish_shardings` sharding) in steps XLA's partitioner does
  without gathering the whole array on one device: its split dim split over `tensor` and another dim over the
  processes, in the learner's device order (an all-to-all), then in the copies' order (a collective-permute); the
  out sharding then gathers the processes' parts (an all-gather). Straight from the learner's layout, the
  partitioner replicates a multi-process target's arrays first ("involuntary full rematerialization")."""
  spec = tuple(target.spec) + (None,) * (x.ndim - len(target.spec))
  split = [i for i, a in enumerate(spec) if a is not None]
  if not split:
    return jnp.copy(x)  # Replicated: the out sharding all-gathers it.
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
  return jnp.copy(x)  # New buffers even where nothing moves (XLA drops the copy where something does).


def publish_reshard(learner_shardings: Sequence[Any], out_shardings: Sequence[NamedSharding]
                    ) -> Callable[[list[jax.Array]], list[jax.Array]]:
  """One publish program: arrays (a list, laid out as `learner_shardings`) -> new copies (the learner's next update
  donates its state), to jit with `in_shardings=(learner_shardings,), out_shardings=out_shardings` (lists of
  `publish_shardings`' leaves); per device no whole array, temporaries about the size of its output."""
  sources, targets = list(learner_shardings), list(out_shardings)

  def reshard(arrays: list[jax.Array]) -> list[jax.Array]:
    if not len(arrays) == len(sources) == len(targets):
      raise ValueError(f'publish_reshard: {len(arrays)} arrays, {len(sources)} learner and {len(targets)} out '
                       'shardings.')
    return [_reshard_steps(*z) for z in zip(arrays, sources, targets)]

  return reshard


GROUP_BYTES = 1 << 28  # Per device: output bytes of one publish program (one large array goes alone).


def lower_publish(abstract_state: Any, learner_shardings: Any, learner_mesh: Mesh,
                  rules: Sequence[tuple[str, Any]], *, rows: Sequence[Sequence[jax.Device]] | None = None,
                  group_bytes: int = GROUP_BYTES) -> list[tuple[list[int], jax.stages.Lowered]]:
  """The publish of a learner state laid out as `learner_shardings` (on `learner_mesh`) onto `publish_shardings`,
  lowered for `abstract_state`'s shapes: programs run one after another, each on the arrays (indices into
  `jax.tree.leaves(abstract_state)`) whose copies hold up to `group_bytes` per device, so temporaries stay those of
  one group. Lowers on real devices or a TPU topology's (`publish_bytes` compiles them)."""
  arrays = jax.tree.leaves(abstract_state)
  sources = jax.tree.leaves(learner_shardings)
  targets = jax.tree.leaves(publish_shardings(abstract_state, learner_mesh, rules, rows=rows))
  groups: list[list[int]] = []
  size = 0
  for i, (x, t) in enumerate(zip(arrays, targets)):
    nbytes = math.prod(t.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    if not groups or size + nbytes > group_bytes:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += nbytes
  programs = []
  for group in groups:
    src, dst = [sources[i] for i in group], [targets[i] for i in group]
    fn = jax.jit(publish_reshard(src, dst), in_shardings=(src,), out_shardings=dst)
    programs.append((group, fn.lower([arrays[i] for i in group])))
  return programs


def publish_bytes(abstract_state: Any, learner_shardings: Any, learner_mesh: Mesh,
                  rules: Sequence[tuple[str, Any]], **kwargs) -> tuple[int, int]:
  """Per device, compiled (`lower_publish`, same arguments): the publish's output bytes (all its programs') and
  its largest temporaries (one program's)."""
  stats = [lowered.compile().memory_analysis() for _, lowered in
           lower_publish(abstract_state, learner_shardings, learner_mesh, rules, **kwargs)]
  return sum(m.output_size_in_bytes for m in stats), max(m.temp_size_in_bytes for m in stats)


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


def _holds(x: jax.Array, sharding: NamedSharding) -> bool:
  """Every block `sharding` puts on this process's devices is one of `x`'s addressable shards."""
  shape = tuple(x.shape)
  held = {_box(s.index, shape) for s in x.addressable_shards}
  return all(_box(i, shape) in held for i in sharding.addressable_devices_indices_map(shape).values())


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
  graphdef: Any
  state: Any  # On the actors' sharding; futures until the update that computes them (and the copy) has run.
  version: int


class WeightPublisher:
  """The newest policy weights and their version, copied onto the actors' sharding (module docstring).

  Args:
    actor_mesh: this process's actors' mesh (`parallel.make_actor_mesh`), the copy sharded on it by `rules`
      (`parallel.tree_shardings`); or None: the actors share the learner's mesh, each array keeps its sharding
      (a device-side copy).
    rules: `config.mesh.rules`.

  With an actor mesh, the learner state is first resharded on the learner's devices (`lower_publish`'s programs,
  which every process runs at the same point of the loop) into a copy per process over its own learner devices,
  sharded as the actors' is: a device holds the policy / its process's learner devices, never the whole policy.
  With `mesh.actor_devices=0` (several processes) those are the actors' devices and that copy is the actors' (no
  further copy); else `local_reshard` moves it device to device onto the actor devices (and alone where the
  learner's shards already are the actors' blocks, e.g. a single learner device). All of it is dispatched
  asynchronously (no host copy): the learner goes on.

  Published weights are futures of the update still in flight. Besides the newest, the publisher keeps the
  newest computed version (`latest(computed=True)`, `computed_version`) until a newer one is computed too: the
  trainer publishes right after each dispatch, so a busy learner's newest weights are nearly always in flight,
  and an actor that only takes computed weights must still find the previous version (two copies at most).
  """

  def __init__(self, actor_mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] = ()):
    self._actor_mesh = actor_mesh
    self._rules = tuple(rules)
    self._lock = threading.Lock()
    self._published: list[_Published] = []  # Oldest first: the newest computed one, then newer ones in flight.
    self._copy = None
    self._target = None
    self._reshard = None

  def _to_actors(self, state: Any) -> Any:
    if self._actor_mesh is None:
      if self._copy is None:
        self._copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
      return self._copy(state)
    arrays, treedef = jax.tree.flatten(state)
    if self._target is None:
      self._target = parallel.tree_shardings(state, self._actor_mesh, self._rules)
      targets = jax.tree.leaves(self._target)
      actors = set(self._actor_mesh.devices.flat)
      if all(x.is_fully_addressable and _holds(x, t) and not actors & x.sharding.device_set
             for x, t in zip(arrays, targets)):
        self._reshard = []  # Every actor block is a learner shard already (e.g. one learner device): copies only.
      else:
        mesh = next(x.sharding.mesh for x in arrays if isinstance(x.sharding, NamedSharding))
        learner = jax.tree.map(lambda x: x.sharding, state)
        self._reshard = [(group, lowered.compile()) for group, lowered in
                         lower_publish(state, learner, mesh, self._rules)]
        # Compiled before, run after a barrier: its device groups' first collective (a gloo context on CPU, which
        # fails when a process comes more than 30 s after another) starts with the processes together.
        parallel.sync('publish')
    for group, program in self._reshard:
      for i, x in zip(group, program([arrays[i] for i in group])):
        arrays[i] = x
    return jax.tree.map(local_reshard, jax.tree.unflatten(treedef, arrays), self._target)

  def _computed(self, entry: _Published) -> bool:
    """`entry`'s arrays hold values (a program reading them runs at once)."""
    return all(x.is_ready() for x in jax.tree.leaves(entry.state))

  def _newest_computed(self) -> _Published | None:
    """Under the lock: the newest computed entry (older ones are let go), or None."""
    for i in range(len(self._published) - 1, -1, -1):
      if self._computed(self._published[i]):
        del self._published[:i]
        return self._published[0]
    return None

  def publish(self, model: nnx.Module, *, version: int) -> None:
    graphdef, state = nnx.split(model)
    copied = self._to_actors(state)
    with self._lock:
      self._published.append(_Published(graphdef, copied, int(version)))
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

  def latest(self, computed: bool = False) -> tuple[nnx.Module, int]:
    """The newest published weights as a model, with their version; `computed`: the newest computed ones
    (taking them costs no wait; a program reading weights still in flight waits for their update, even on
    devices of its own)."""
    with self._lock:
      if not self._published:
        raise RuntimeError('No weights have been published yet.')
      entry = self._newest_computed() if computed else self._published[-1]
      if entry is None:
        raise RuntimeError('No published weights are computed yet.')
    return nnx.merge(entry.graphdef, entry.state), entry.version
