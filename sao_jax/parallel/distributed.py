"""Multi-host: `jax.distributed` start-up, process roles, and feeding each process's slice of a batch.

On a pod every process runs the same program; each one reads its own share of the data and the
learner's SPMD program sees one global array (`jax.make_array_from_process_local_data`). Logs and
checkpoint writes that must happen once are gated by `is_main_process()`.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.errors import ConfigError
from sao_jax.parallel import sharding as sharding_lib

ENV_COORDINATOR = 'SAO_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'SAO_NUM_PROCESSES'
ENV_PROCESS_ID = 'SAO_PROCESS_ID'

_initialized = False


def _settings(cfg: Any | None) -> tuple[str, int, int]:
  """`(coordinator_address, num_processes, process_id)` from `config.distributed`, else the env vars."""
  address = (cfg.coordinator_address if cfg is not None else '') or os.environ.get(ENV_COORDINATOR, '')
  num = int(cfg.num_processes if cfg is not None and cfg.num_processes != 1
            else os.environ.get(ENV_NUM_PROCESSES, 1))
  pid = int(cfg.process_id if cfg is not None and cfg.process_id != 0
            else os.environ.get(ENV_PROCESS_ID, 0))
  return address, num, pid


def _check(address: str, num: int, pid: int) -> None:
  if num < 1:
    raise ConfigError(f'config.distributed.num_processes={num}: must be >= 1.')
  if not 0 <= pid < num:
    raise ConfigError(f'config.distributed.process_id={pid}: must be in [0, num_processes={num}).')
  if num > 1 and not address:
    raise ConfigError(f'config.distributed.num_processes={num} needs config.distributed.coordinator_address '
                      f'(host:port of process 0) or ${ENV_COORDINATOR}.')


def check_config(config: Any) -> None:
  """The multi-host checks of `config.distributed` (with the env-var fallbacks of `initialize`), without
  starting anything: `num_processes >= 1`, `0 <= process_id < num_processes`, a coordinator when > 1.

  Raises:
    ConfigError: naming `config.distributed.*`.
  """
  _check(*_settings(config.distributed))


def num_processes(config: Any) -> int:
  """Processes the run will have (`config.distributed` or the env var), before `initialize`."""
  return _settings(config.distributed)[1]


def initialize(distributed_config: Any | None = None, *, timeout_s: int = 300) -> bool:
  """Starts `jax.distributed` when more than one process is configured; a no-op otherwise.

  Sources, first found wins: `config.distributed` (`coordinator_address`, `num_processes`,
  `process_id`), then the env vars `SAO_COORDINATOR_ADDRESS`, `SAO_NUM_PROCESSES`, `SAO_PROCESS_ID`.
  Must run before anything touches a JAX device.

  Returns:
    True when this call (or an earlier one) set up a multi-process run.

  Raises:
    ConfigError: naming `config.distributed.*` for an inconsistent setting.
  """
  global _initialized
  if _initialized:
    return True
  address, num, pid = _settings(distributed_config)
  _check(address, num, pid)
  if num == 1:
    return False
  logging.info('jax.distributed.initialize(%s, num_processes=%d, process_id=%d)', address, num, pid)
  jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid,
                             initialization_timeout=timeout_s)
  _initialized = True
  return True


_barrier_count = 0
_handshakes: dict[Mesh, Any] = {}


def handshake_program(mesh: Mesh) -> tuple[Any, jax.Array] | None:
  """A compiled program and its input: one `psum` of a value per device over every device group of `mesh` (the
  groups of each non-empty subset of its axes longer than 1), so running it uses every group the mesh's
  collectives can use. Returns the sums, one array per subset (in `itertools.combinations` order). None when no
  axis is longer than 1. Compiled once per mesh.
  """
  if mesh in _handshakes:
    return _handshakes[mesh]
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  subsets = [g for r in range(1, len(axes) + 1) for g in itertools.combinations(axes, r)]
  out = None
  if subsets:
    spec = PartitionSpec(tuple(mesh.axis_names))  # One element per device.
    x = jax.make_array_from_callback((mesh.devices.size,), NamedSharding(mesh, spec),
                                     lambda index: np.ones((1,), np.int32))
    fn = jax.shard_map(lambda v: tuple(jax.lax.psum(v, g) for g in subsets), mesh=mesh, in_specs=spec,
                       out_specs=(spec,) * len(subsets))
    out = (jax.jit(fn).lower(x).compile(), x)
  _handshakes[mesh] = out
  return out


def _processes_mesh() -> Mesh:
  """All devices as (processes, local devices): the groups of `multihost_utils.process_allgather` (and so of
  orbax's barriers and of `_any_process`-style host gathers)."""
  return Mesh(np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count()),
              ('processes', 'local_devices'))


def sync(name: str, *, meshes: Sequence[Mesh] = (), timeout_s: float = 3600.0) -> None:
  """Waits until every process has reached this point (one process: returns at once).

  A barrier of `jax.distributed`'s coordination service: no device, no collective, a long timeout. Call it, in the
  same order on every process, before device collectives that follow uneven process-local work (compiling the
  actors' samplers; a persistent compilation cache serves process 0 only, the others' cache keys differ; process
  0's metrics files): on the CPU backend the first collective of a device group sets up a gloo context, and that fails
  ("Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out ... 30s"; the 30 s are fixed
  in XLA, no jax or XLA option changes them) when one process arrives more than 30 s after another. Later
  collectives of the group wait as long as it takes.

  Args:
    name: names the barrier (with a counter: the same sequence of calls on every process).
    meshes: with these, right after the barrier every process runs `handshake_program` of each mesh that spans
      several processes, and of the processes' mesh (`process_allgather`'s groups), compiled before the
      barrier: every group's gloo context is set up while the processes are together, so no later collective
      over those groups can meet the 30 s window, however uneven the work before it (a restore, a warm start).
    timeout_s: of the barrier.
  """
  global _barrier_count
  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top  (as orbax does)
  programs = []
  if meshes:
    spanning = [m for m in meshes if len({d.process_index for d in m.devices.flat}) > 1]
    programs = [p for p in map(handshake_program, [*spanning, _processes_mesh()]) if p is not None]
  _barrier_count += 1  # Unique ids, the same sequence on every process.
  jax_distributed.global_state.client.wait_at_barrier(f'sao_jax/{name}/{_barrier_count}', int(timeout_s * 1000))
  for compiled, x in programs:
    jax.block_until_ready(compiled(x))


_exchange_count = 0


def process_max(name: str, value: int, *, timeout_s: float = 3600.0) -> int:
  """The largest of every process's `value` (one process: `value`). Call it in the same order on every process.

  Through the coordination service's key-value store, not a device collective: it never waits behind programs
  still running on the devices (an async loop agrees on a batch's length while the previous update runs). The
  keys of the exchange two back are deleted: every process has read them by then (this process read every key
  of the last exchange, which each process wrote only after reading all of the one before).
  """
  global _exchange_count
  if jax.process_count() == 1:
    return int(value)
  from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top  (as in `sync`)
  client = jax_distributed.global_state.client
  _exchange_count += 1
  me = jax.process_index()
  client.key_value_set(f'sao_jax/max/{_exchange_count}/{name}/{me}', str(int(value)))
  got = [int(client.blocking_key_value_get(f'sao_jax/max/{_exchange_count}/{name}/{i}', int(timeout_s * 1000)))
         for i in range(jax.process_count())]
  if _exchange_count > 2:
    client.key_value_delete(f'sao_jax/max/{_exchange_count - 2}')  # The key's directory: every process's.
  return max(got)


def is_main_process() -> bool:
  """True on process 0: the one that logs metrics and writes checkpoints' metadata."""
  return jax.process_index() == 0


def process_count() -> int:
  return jax.process_count()


def local_row_range(global_rows: int, mesh: Mesh) -> tuple[int, int]:
  """Rows `[start, stop)` of a global batch this process feeds, from the batch sharding's device map.

  The rows a process owns are contiguous for a `('data', 'fsdp')` row sharding over a mesh built by
  `make_mesh` (each process's devices are adjacent); anything else is refused with a clear error.
  """
  sharding = sharding_lib.batch_sharding(mesh, 1)
  rows = set()
  for index in sharding.addressable_devices_indices_map((global_rows,)).values():
    sl = index[0]
    rows.update(range(*sl.indices(global_rows)))
  start, stop = min(rows), max(rows) + 1
  if len(rows) != stop - start:
    raise ValueError(f'process {jax.process_index()} owns non-contiguous rows of the batch; build the mesh '
                     'with sao_jax.parallel.make_mesh so each process holds a contiguous block.')
  return start, stop


def global_batch(local_batch: Any, mesh: Mesh, global_rows: int) -> Any:
  """One global, row-sharded array per leaf from each process's local rows (numpy).

  Args:
    local_batch: pytree (e.g. `sao_jax.structs.Batch` of numpy arrays) holding this process's rows
      `local_row_range(global_rows, mesh)`, in order.
    mesh: the learner mesh.
    global_rows: rows of the whole batch across processes.

  Returns:
    The same pytree of global `jax.Array`s sharded with `batch_sharding`.
  """
  start, stop = local_row_range(global_rows, mesh)

  def one(x):
    x = np.asarray(x)
    if x.shape[0] != stop - start:
      raise ValueError(f'process {jax.process_index()} must feed rows [{start}, {stop}) of the global batch '
                       f'({stop - start} rows), got a leaf with {x.shape[0]} rows.')
    sharding = NamedSharding(mesh, sharding_lib.batch_spec(x.ndim))
    return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])

  return jax.tree.map(one, local_batch)


def to_host(tree: Any) -> Any:
  """Numpy copy of a tree of global arrays on every host (replicated ones read locally, others gathered)."""
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  def one(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(one, tree)
