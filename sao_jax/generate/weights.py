"""Where the engines' weights come from: a `WeightsSource` holds the newest decode-layout snapshot, and the
learner's `WeightPublisher` copies each new policy onto the actors' devices for the sources to take.

A snapshot (`WeightsSnapshot`: weights and their policy version) is immutable and swapped as a whole: a device
call reads it once, so calls in flight finish on the weights they started with and every generated token
carries the version that produced it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

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


class _Published(NamedTuple):
  graphdef: Any
  state: Any  # On the actors' sharding; futures until the update that computes them (and the copy) has run.
  version: int


class WeightPublisher:
  """The newest policy weights and their version, copied onto the actors' sharding (module docstring).

  Args:
    shardings_fn: `state -> shardings` of the actor copy on the actors' own mesh (`parallel.make_actor_mesh`),
      or None: the actors share the learner's mesh, each array keeps its sharding (a device-side copy).

  With an actor mesh the copy is `jax.device_put` onto it (dispatched asynchronously: the learner goes on). A
  learner state that spans several processes is first all-gathered on the learner mesh (one jitted program that
  every process runs at the same point of the loop), then each process copies its local replica onto its own
  actor devices.

  Published weights are futures of the update still in flight. Besides the newest, the publisher keeps the
  newest computed version (`latest(computed=True)`, `computed_version`) until a newer one is computed too: the
  trainer publishes right after each dispatch, so a busy learner's newest weights are nearly always in flight,
  and an actor that only takes computed weights must still find the previous version (two copies at most).
  """

  def __init__(self, shardings_fn: Callable[[Any], Any] | None = None):
    self._shardings_fn = shardings_fn
    self._lock = threading.Lock()
    self._published: list[_Published] = []  # Oldest first: the newest computed one, then newer ones in flight.
    self._copy = None
    self._target = None
    self._gather = None

  def _to_actors(self, state: Any) -> Any:
    if self._shardings_fn is None:
      if self._copy is None:
        self._copy = jax.jit(lambda s: jax.tree.map(jnp.copy, s))
      return self._copy(state)
    if self._target is None:
      self._target = self._shardings_fn(state)
    if not all(x.is_fully_addressable for x in jax.tree.leaves(state)):
      if self._gather is None:
        mesh = next(x.sharding.mesh for x in jax.tree.leaves(state) if hasattr(x.sharding, 'mesh'))
        self._gather = jax.jit(lambda s: jax.tree.map(jnp.copy, s),
                               out_shardings=NamedSharding(mesh, PartitionSpec()))
      state = jax.tree.map(lambda x: x.addressable_data(0), self._gather(state))
    return jax.device_put(state, self._target)

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
