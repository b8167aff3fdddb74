"""Checkpoints: a thin wrapper over orbax's `CheckpointManager` (save, resume, keep-N, async).

One checkpoint (directory `<dir>/<step>/`) holds these orbax items:

  policy     pytree of arrays  the policy model's state (`nnx.State`; what `load_policy` rebuilds a Decoder from)
  critic     pytree of arrays  the value model's state (optional)
  optimizer  pytree of arrays  optimizer states and learner counters, any structure (e.g. optax states)
  data       JSON              the training data iterator's `state()` (optional)
  metadata   JSON              the policy's `ModelConfig` (key `model_config`) plus anything the caller adds

Arrays are written by every process for its own shards (orbax/tensorstore); the JSON items are written by
process 0 only (orbax's `primary_host`). Restoring into an *abstract target* whose leaves are
`jax.ShapeDtypeStruct`s carrying shardings places every array directly onto those shardings, so a sharded
run restores sharded without gathering on one host (`abstract_target`).

Saving is asynchronous by default: `save` returns once the arrays have been copied off the devices (the
caller may then donate or overwrite them) and the files are written in the background; `wait()` blocks until
the write is committed and `close()` (or leaving a `with` block) waits then releases the manager. A
checkpoint directory appears atomically (orbax writes a temporary directory and renames it on commit), so an
interrupted save never shadows the previous checkpoint; the temporary directories such saves leave behind
are removed when a `Checkpointer` opens the directory. The directory may be a URI (`gs://bucket/run/checkpoints`,
`sao_jax.paths`): there orbax cannot rename, and commits a step by writing `commit_success.txt` into it last; a
step without one is an interrupted save, removed when the directory is opened.

Integrity: every checkpoint also holds a `manifest` (JSON) with the names of the items saved and a fingerprint
of every array: `fingerprint(x) = (sum_i fmix(u_i ^ fmix(i + c1)), sum_i fmix(u_i ^ fmix(i + c2))) mod 2^32`
over the elements' bit patterns u_i (flattened index i, murmur3's bijective finaliser fmix), computed on the
device under jit over the GLOBAL array, so it does not depend on the sharding nor on which process holds
which shard (every process computes the same replicated value; a changed element always changes each sum).
JSON items carry a SHA-256 of their canonical text. `restore` checks that every item of the manifest is on
disk and that what it read matches the manifest; the newest step that fails (unreadable, missing item or
manifest, a fingerprint that differs) is reported with a loud error naming the step, the item, the array and
what was wrong, and `restore()` falls back to the newest intact step (an explicit `step` raises instead). A run
resuming (`restore(set_aside_damaged=True)`) also moves each damaged newer step aside, renamed, never deleted, into
`<dir>/damaged/<step>-<UTC time>/` with a `DAMAGED.txt` saying what failed: its step number is free again, so the
run retrains that step and saves it, and the same command always recovers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Mapping
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
from flax import nnx
import orbax.checkpoint as ocp

from sao_jax import paths
from sao_jax.errors import ConfigError
from sao_jax.models.config import ModelConfig

ARRAY_ITEMS = ('policy', 'critic', 'optimizer')
JSON_ITEMS = ('data', 'metadata')
MANIFEST = 'manifest'  # Internal JSON item: the items saved and their fingerprints (module docstring).
_TMP_DIR = re.compile(r'.*\.orbax-checkpoint-tmp.*')
_COMMIT_FILE = ocp.path.atomicity.COMMIT_SUCCESS_FILE  # What orbax writes last into a step on an object store.
DAMAGED_DIR = 'damaged'  # Where damaged steps are moved aside (`Checkpointer.restore(set_aside_damaged=True)`).


class CheckpointCorrupt(RuntimeError):
  """A checkpoint step cannot be restored as saved (unreadable, incomplete, or not what was written)."""


@dataclasses.dataclass
class CheckpointState:
  """What one checkpoint holds (see the module docstring).

  Attributes:
    step: the checkpoint's step (the learner step it was taken at).
    policy: pytree of arrays of the policy (normally `nnx.state(policy_model)`).
    critic: pytree of arrays of the critic, or None.
    optimizer: pytree of arrays: optimizer states and counters (any structure), or None.
    data: JSON-serialisable dict: the data iterator's state, or None.
    metadata: JSON-serialisable dict; `model_config` holds the policy's `ModelConfig` as a dict.
  """
  step: int
  policy: Any
  critic: Any = None
  optimizer: Any = None
  data: dict[str, Any] | None = None
  metadata: dict[str, Any] | None = None


# ------------------------------------------------------------------------------------------------------------
# ModelConfig <-> JSON.


def model_config_to_json(cfg: ModelConfig) -> dict[str, Any]:
  """A JSON-serialisable dict of every `ModelConfig` field (tuples become lists)."""
  d = dataclasses.asdict(cfg)
  d['eos_ids'] = list(cfg.eos_ids)
  d['lora_targets'] = list(cfg.lora_targets)
  d['rope_scaling'] = None if cfg.rope_scaling is None else dict(cfg.rope_scaling)
  return d


def model_config_from_json(d: Mapping[str, Any]) -> ModelConfig:
  """Inverse of `model_config_to_json`; unknown keys are an error naming them (a newer checkpoint format)."""
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(d) - fields)
  if unknown:
    raise ValueError(f'Checkpoint model config has fields {unknown} that this ModelConfig does not know.')
  kwargs = dict(d)
  if kwargs.get('eos_ids') is not None:
    kwargs['eos_ids'] = tuple(kwargs['eos_ids'])
  return ModelConfig(**kwargs)


# ------------------------------------------------------------------------------------------------------------
# Abstract targets.


def abstract_target(tree: Any, shardings: Any = None) -> Any:
  """`tree` (arrays, or already abstract) as `jax.ShapeDtypeStruct` leaves, each with its sharding.

  Args:
    tree: pytree of arrays or `ShapeDtypeStruct`s (e.g. `nnx.eval_shape(...)` state, `jax.eval_shape` output).
    shardings: None (keep each leaf's own sharding, if any) or a pytree of `jax.sharding.Sharding` with the
      structure of `tree` (e.g. `sao_jax.parallel.tree_shardings(tree, mesh, rules)`).

  Returns:
    The abstract target to pass to `Checkpointer.restore`.
  """
  def one(x, s=None):
    sharding = s if s is not None else getattr(x, 'sharding', None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  if shardings is None:
    return jax.tree.map(one, tree)
  return jax.tree.map(one, tree, shardings)


def _single_device_target(tree: Any) -> Any:
  """Abstract target on the first local device for leaves without a sharding (plain restores)."""
  dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def one(x):
    sharding = getattr(x, 'sharding', None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if sharding is not None else dev)
  return jax.tree.map(one, tree)


# ------------------------------------------------------------------------------------------------------------
# Fingerprints.


def _fmix(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finaliser (a bijection of uint32)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _bits(x: jax.Array) -> jax.Array:
  """The elements' bit patterns as a flat uint32 vector (8-byte types give two words per element)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.iscomplexobj(x):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  u = jax.lax.bitcast_convert_type(x, unsigned)  # 8-byte types: a trailing axis of two uint32 words.
  return u.astype(jnp.uint32).reshape(-1)


@jax.jit
def _fingerprint_tree(tree: Any) -> Any:
  def one(x):
    u = _bits(x)
    i = jnp.arange(u.size, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(_fmix(u ^ _fmix(i + jnp.uint32(c))), dtype=jnp.uint32)
                      for c in (0x9E3779B9, 0x7F4A7C15)])
  return jax.tree.map(one, tree)


def _path(keys: tuple[Any, ...]) -> str:
  parts = []
  for k in keys:
    for attr in ('key', 'idx', 'name'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '/'.join(parts)


def fingerprints(tree: Any) -> dict[str, list[Any]]:
  """{path: [h1, h2, shape, dtype]} of every array leaf of `tree` (module docstring).

  Collective under multi-process: every process must call it on the same global arrays (as `save` and
  `restore` do); each gets the same values.
  """
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for _, x in leaves]
  sums = jax.device_get(_fingerprint_tree(arrays))
  return {_path(p): [int(h[0]), int(h[1]), list(np.shape(x)), str(np.dtype(x.dtype))]
          for (p, _), x, h in zip(leaves, arrays, sums)}


def _all_processes(ok: bool) -> bool:
  """Whether `ok` holds on every process (a collective under multi-process)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def json_digest(value: Any) -> str:
  """sha256 of `value` as sorted-key JSON."""
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _compare(item: str, got: dict[str, list[Any]], want: dict[str, list[Any]]) -> str | None:
  """What differs between restored and saved fingerprints of one item (None when they agree)."""
  if set(got) != set(want):  # A raw restore may name containers differently: compare the multisets.
    key = lambda fp: (fp[0], fp[1], tuple(fp[2]))  # pylint: disable=unnecessary-lambda-assignment
    if sorted(map(key, got.values())) != sorted(map(key, want.values())):
      return f'{item}: its arrays differ from the manifest ({len(got)} read, {len(want)} saved)'
    return None
  for path, (h1, h2, shape, dtype) in want.items():
    g1, g2, gshape, gdtype = got[path]
    if list(gshape) != list(shape):
      return f'{item}/{path}: shape {gshape}, saved {shape}'
    if gdtype == dtype and (g1, g2) != (h1, h2):  # (A restore cast to another dtype cannot be compared.)
      return f'{item}/{path}: the data read differs from the data saved (fingerprint mismatch)'
  return None


# ------------------------------------------------------------------------------------------------------------
# The manager.


def check_config(config: Any, *, need_workdir: bool = True) -> None:
  """The checkpointer's checks (run by `CheckpointConfig.from_config` and by `sao_jax.config_lib.validate`).

  `config.trainer.keep_checkpoints >= 1`; with `need_workdir`, a `config.workdir` that is set and is not a file.

  Raises:
    ConfigError: naming the field.
  """
  keep = config.trainer.keep_checkpoints
  if keep < 1:
    raise ConfigError(f'config.trainer.keep_checkpoints={keep}: must be >= 1.')
  if need_workdir:
    if not config.workdir:
      raise ConfigError("config.workdir='': checkpoints need a work directory (--workdir, or "
                        'config.trainer.checkpoint_every=0).')
    if paths.exists(config.workdir) and not paths.isdir(config.workdir):
      raise ConfigError(f'config.workdir={config.workdir!r} exists and is not a directory.')


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """A run's checkpointer settings, read from its config once (`from_config`).

  Attributes:
    directory: where step directories go (`<config.workdir>/checkpoints` unless another directory is given).
    keep: checkpoints kept on disk (`config.trainer.keep_checkpoints`).
  """
  directory: str
  keep: int

  @classmethod
  def from_config(cls, config: Any, directory: str | None = None) -> CheckpointConfig:
    """The settings of `config` after `check_config` (a `config.workdir` is needed unless `directory` is given)."""
    check_config(config, need_workdir=directory is None)
    if directory is None:
      directory = paths.join(config.workdir, 'checkpoints')
    return cls(directory=directory, keep=int(config.trainer.keep_checkpoints))


class Checkpointer:
  """Saves and restores `CheckpointState`s under one directory, keeping the newest `keep` of them.

  Args:
    directory: where step directories go (created if missing; must be shared by all processes).
    keep: number of checkpoints kept (older ones are deleted after a newer one is committed); None = all.
    async_save: write in a background thread (`save` returns after the device-to-host copy).
    save_interval_steps: `save` ignores steps that are not multiples of this (unless `force=True`).

  Use as a context manager, or call `close()` at the end (it waits for a pending async save).
  """

  def __init__(self, directory: str, *, keep: int | None = 3, async_save: bool = True,
               save_interval_steps: int = 1):
    if keep is not None and keep < 1:
      raise ValueError(f'Checkpointer keep={keep}: must be >= 1 (or None to keep every checkpoint).')
    self.directory = paths.absolute(directory)
    self._save_interval = save_interval_steps
    self._remove_interrupted_saves()
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_interval_steps, create=True,
        enable_async_checkpointing=async_save,
        multiprocessing_options=ocp.options.MultiprocessingOptions(primary_host=0))
    self._manager = ocp.CheckpointManager(paths.to_epath(self.directory), options=options)
    self._closed = False

  @classmethod
  def from_settings(cls, settings: CheckpointConfig, **kwargs) -> Checkpointer:
    """A checkpointer in `settings.directory` keeping `settings.keep` checkpoints (`kwargs`: the constructor's)."""
    return cls(settings.directory, keep=settings.keep, **kwargs)

  def _remove_interrupted_saves(self) -> None:
    """Deletes what interrupted saves left (process 0; before the manager starts): locally orbax's temporary
    directories (renamed on commit); on an object store the step directories without a commit file."""
    if jax.process_index() != 0 or not paths.isdir(self.directory):
      return
    local = paths.is_local(self.directory)
    for name in paths.listdir(self.directory):
      path = paths.join(self.directory, name)
      if local:
        interrupted = _TMP_DIR.fullmatch(name) and paths.isdir(path)
      else:
        interrupted = name.isdigit() and not paths.exists(paths.join(path, _COMMIT_FILE))
      if interrupted:
        logging.warning('Checkpoint: removing %s, left by an interrupted save.', path)
        try:
          paths.rmtree(path)
        except OSError as e:
          logging.warning('Checkpoint: could not remove %s: %s', path, e)

  # ---- Queries.

  def all_steps(self) -> list[int]:
    """Committed checkpoint steps, ascending."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The newest committed step, or None when there is no checkpoint."""
    return self._manager.latest_step()

  # ---- Save / restore.

  def save(self, state: CheckpointState, *, force: bool = False) -> bool:
    """Saves `state` at `state.step`; returns False if skipped (by `save_interval_steps`).

    Raises:
      ValueError: `state.policy` is None, a JSON item is not serialisable, or the step already exists.
    """
    self._check_open()
    if state.policy is None:
      raise ValueError('CheckpointState.policy is required.')
    step = int(state.step)
    if step in self._manager.all_steps():
      raise ValueError(f'A checkpoint for step {step} already exists in {self.directory}.')
    if not force and step % self._save_interval:
      return False  # (Checked here too: the manifest's fingerprints are not computed for a skipped step.)
    items = {}
    manifest: dict[str, Any] = {'version': 1, 'items': [], 'arrays': {}, 'json': {}}
    for name in ARRAY_ITEMS:
      value = getattr(state, name)
      if value is not None:
        items[name] = ocp.args.StandardSave(value)
        manifest['arrays'][name] = fingerprints(value)
    for name in JSON_ITEMS:
      value = getattr(state, name)
      if value is not None:
        try:
          manifest['json'][name] = json_digest(value)
        except TypeError as e:
          raise ValueError(f'CheckpointState.{name} must be JSON-serialisable: {e}') from e
        items[name] = ocp.args.JsonSave(value)
    manifest['items'] = sorted(items)
    items[MANIFEST] = ocp.args.JsonSave(manifest)
    saved = self._manager.save(step, args=ocp.args.Composite(**items), force=force)
    if saved:
      logging.info('Checkpoint step %d -> %s (%s).', step, self.directory, ', '.join(manifest['items']))
    return bool(saved)

  def items_at(self, step: int) -> set[str]:
    """Names of the items stored at `step` (the manifest included)."""
    path = paths.join(self.directory, str(step))
    return {name for name in ARRAY_ITEMS + JSON_ITEMS + (MANIFEST,) if paths.isdir(paths.join(path, name))}

  def resolve_step(self, step: int | None) -> int:
    """`step`, or the latest one; a clear error when the checkpoint is missing."""
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'No checkpoint in {self.directory}.')
    if step is None:
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(f'No checkpoint for step {step} in {self.directory}; available: {steps}.')
    return int(step)

  def restore(self, step: int | None = None, *, target: CheckpointState | None = None,
              items: tuple[str, ...] | None = None, set_aside_damaged: bool = False) -> CheckpointState:
    """Restores and verifies the checkpoint at `step` (default: the newest intact one).

    Args:
      step: the step to restore; None = the newest step that restores intact (a damaged newer one is reported
        with `logging.error` and skipped).
      target: abstract (or concrete) trees for the array items, with shardings
        (`abstract_target(tree, shardings)`): restored arrays take the target's structure, dtypes and
        shardings; leaves without a sharding go to the first local device. An array item whose target is
        None is restored with its saved structure onto the first local device (plain dicts/lists; an
        nnx.State or optax state needs a target to come back typed).
      items: names of the items to restore (default: every item saved). The others come back as None.
      set_aside_damaged: with `step=None`, move every damaged step newer than the one restored into
        `<dir>/damaged/` (module docstring): a resuming run does, so the steps it retrains can be saved again.
        Nothing is moved when no step is intact (the error then lists them all).

    Returns:
      The `CheckpointState` (`step` = the restored step).

    Raises:
      FileNotFoundError: no checkpoint, no checkpoint at `step`, or an item that was never saved.
      CheckpointCorrupt: the explicit `step` (or, with `step=None`, every step) is damaged; the message says how.
    """
    self._check_open()
    unknown = set(items or ()) - set(ARRAY_ITEMS + JSON_ITEMS)
    if unknown:
      raise ValueError(f'Unknown checkpoint items {sorted(unknown)}; known: {ARRAY_ITEMS + JSON_ITEMS}.')
    return self._first_intact(step, lambda s: self._restore_verified(s, target, items),
                              set_aside_damaged=set_aside_damaged)

  def _first_intact(self, step: int | None, fn, *, set_aside_damaged: bool = False):
    """`fn(s)` for `step`, or for the newest step where it does not raise `CheckpointCorrupt` (logged loudly)."""
    steps = [self.resolve_step(step)] if step is not None else sorted(self.all_steps(), reverse=True)
    if not steps:
      raise FileNotFoundError(f'No checkpoint in {self.directory}.')
    problems = []
    for k, s in enumerate(steps):
      try:
        result = fn(s)
      except CheckpointCorrupt as e:
        problems.append(f'step {s}: {e}')
        logging.error('CHECKPOINT STEP %d IN %s IS DAMAGED: %s.%s', s, self.directory, e,
                      ' Trying the previous step.' if k + 1 < len(steps) else '')
        continue
      if problems:
        logging.error('Restored checkpoint step %d instead of the newer damaged one(s): %s', s,
                      '; '.join(problems))
        if set_aside_damaged:
          self._set_aside(dict(zip(steps[:k], problems)))
      return result
    raise CheckpointCorrupt(f'No intact checkpoint in {self.directory}: ' + '; '.join(problems))

  def _set_aside(self, damaged: dict[int, str]) -> None:
    """Moves the `damaged` steps (step -> what failed) into `<dir>/damaged/<step>-<UTC time>/` (process 0; every
    process then re-reads the directory's steps)."""
    if jax.process_index() == 0:
      stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
      for step, why in sorted(damaged.items()):
        src = paths.join(self.directory, str(step))
        dst = paths.join(self.directory, DAMAGED_DIR, f'{step}-{stamp}')
        paths.move(src, dst)
        paths.write_text(paths.join(dst, 'DAMAGED.txt'), f'{why}\n')
        logging.error('Checkpoint step %d moved aside to %s (kept, not deleted): %s', step, dst, why)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('sao_jax_checkpoint_set_aside')
    self._manager.reload()

  def _restore_verified(self, step: int, target: CheckpointState | None,
                        items: tuple[str, ...] | None) -> CheckpointState:
    # Reading is local to each process (its own shards): all processes agree on whether it worked before
    # the fingerprints (a collective), whose replicated values then give every process the same verdict.
    try:
      manifest, wanted, restored = self._read(step, target, items)
      failure = None
    except CheckpointCorrupt as e:
      failure = e
    if not _all_processes(failure is None):
      raise failure or CheckpointCorrupt('another process could not read its part of it')
    out = CheckpointState(step=step, policy=None)
    for name in sorted(wanted):
      value = restored[name]
      if name in ARRAY_ITEMS:
        want = manifest.get('arrays', {}).get(name)
        problem = (f'{name}: no fingerprints in the {MANIFEST}' if not isinstance(want, dict)
                   else _compare(name, fingerprints(value), want))
      else:
        want = manifest.get('json', {}).get(name)
        problem = None if json_digest(value) == want else f'{name}: differs from what was saved'
      if problem:
        raise CheckpointCorrupt(problem)
      setattr(out, name, value)
    return out

  def _read(self, step: int, target: CheckpointState | None, items: tuple[str, ...] | None
            ) -> tuple[dict[str, Any], set[str], dict[str, Any]]:
    """(manifest, items wanted, items as read) of `step`; `CheckpointCorrupt` if it cannot be read."""
    stored = self.items_at(step)
    if MANIFEST not in stored:
      raise CheckpointCorrupt(f'no {MANIFEST} (an interrupted save or a damaged directory; it has '
                              f'{sorted(stored) or "nothing"})')
    try:
      manifest = self._manager.restore(step, args=ocp.args.Composite(
          **{MANIFEST: ocp.args.JsonRestore()}))[MANIFEST]
      saved = set(manifest['items'])
    except Exception as e:  # pylint: disable=broad-except  (orbax / tensorstore / json raise anything)
      raise CheckpointCorrupt(f'unreadable {MANIFEST}: {type(e).__name__}: {str(e)[:300]}') from e
    wanted = saved if items is None else set(items)
    never = wanted - saved
    if never:
      raise FileNotFoundError(f'Checkpoint step {step} in {self.directory} has no item(s) {sorted(never)} '
                              f'(it has {sorted(saved)}).')
    lost = wanted - stored
    if lost:
      raise CheckpointCorrupt(f'item(s) {sorted(lost)} saved but missing on disk')
    args = {}
    try:
      for name in ARRAY_ITEMS:
        if name not in wanted:
          continue
        tree = None if target is None else getattr(target, name)
        if tree is None:
          tree = _metadata_tree(self._manager.item_metadata(step)[name])
        # Leaves without a sharding go to the first local device (never the saved topology, which may be
        # another mesh or another number of processes).
        args[name] = ocp.args.StandardRestore(_single_device_target(tree))
      for name in JSON_ITEMS:
        if name in wanted:
          args[name] = ocp.args.JsonRestore()
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    except Exception as e:  # pylint: disable=broad-except  (truncated / garbled files: tensorstore errors)
      raise CheckpointCorrupt(f'unreadable: {type(e).__name__}: {str(e)[:300]}') from e
    return manifest, wanted, restored

  # ---- Lifetime.

  def wait(self) -> None:
    """Blocks until a pending async save is committed; raises its error if it failed."""
    self._manager.wait_until_finished()

  def check(self) -> None:
    """Raises the error of an async save that has failed, without waiting for one still in progress (a failed
    save's step is then forgotten: `all_steps` no longer lists it)."""
    if not self._manager.is_saving_in_progress():
      self._manager.wait_until_finished()

  def remove_interrupted_saves(self) -> None:
    """Deletes what failed or interrupted saves left (process 0): their space, before a save is tried again."""
    self._remove_interrupted_saves()

  def close(self) -> None:
    """Waits for a pending save and releases the manager (idempotent)."""
    if not self._closed:
      self._manager.wait_until_finished()
      self._manager.close()
      self._closed = True

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError(f'Checkpointer({self.directory}) is closed.')

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _metadata_tree(meta: Any) -> Any:
  """The tree of `ArrayMetadata` of a stored item, as a pytree of objects with shape and dtype."""
  tree = getattr(meta, 'tree', meta)
  return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), tree,
                      is_leaf=lambda m: hasattr(m, 'shape') and hasattr(m, 'dtype'))


# ------------------------------------------------------------------------------------------------------------
# Policy loading (eval, export).


def policy_metadata(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
  """The `metadata` item for a policy built from `cfg` (`load_policy` reads `model_config`)."""
  return {'model_config': model_config_to_json(cfg), **extra}


def _lora_policy(ckpt: Checkpointer, step: int, meta: Mapping[str, Any], cfg: ModelConfig, shardings_fn
                 ) -> nnx.Module:
  """The policy of a LoRA checkpoint (it holds the adapters only): the base rebuilt as the run built it (its
  `model.hf_dir`, or the named model of its `seed`), checked against the saved base fingerprint, then the adapters
  restored into it."""
  from sao_jax.models import hf_io, lora  # pylint: disable=g-import-not-at-top
  from sao_jax.models.llama import Decoder  # pylint: disable=g-import-not-at-top
  run = meta.get('config', {})
  hf_dir, seed = run.get('model.hf_dir', ''), int(run.get('seed', 0))
  if hf_dir:
    model, _ = hf_io.load_hf(hf_dir, dtype=cfg.dtype, param_dtype=cfg.param_dtype, lora_rank=cfg.lora_rank,
                             lora_alpha=cfg.lora_alpha, lora_targets=cfg.lora_targets, lora_seed=seed)
  else:  # Built in one jit as the run built it (eager random draws can round differently).
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    model = nnx.merge(graphdef, jax.jit(lambda: nnx.state(Decoder(cfg, rngs=nnx.Rngs(seed))))())
  if json_digest(fingerprints(nnx.state(model, nnx.Not(lora.ADAPTERS)))) != meta.get('base_fingerprint'):
    raise ValueError(f'Checkpoint step {step} holds LoRA adapters trained over another base than '
                     f'{hf_dir or f"the named model of seed {seed}"} (the base fingerprints differ).')
  target = abstract_target(nnx.state(model, lora.ADAPTERS))
  restored = ckpt.restore(step, target=CheckpointState(step=step, policy=target), items=('policy',))
  nnx.update(model, restored.policy)
  if shardings_fn is not None:
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, shardings_fn(state)))
  return model


def load_policy(checkpoint_dir: str, step: int | None = None, *, shardings_fn=None,
                **config_overrides: Any) -> tuple[nnx.Module, ModelConfig]:
  """Builds the policy `Decoder` of a checkpoint from its saved model config and restores its weights (a LoRA
  checkpoint's adapters over its run's base: `_lora_policy`).

  Args:
    checkpoint_dir: the checkpointer's directory (the one holding `<step>/` directories).
    step: the step to load; None = latest.
    shardings_fn: optional `abstract_state -> shardings` (e.g. `lambda s: parallel.tree_shardings(s, mesh,
      rules)`) to restore the weights sharded; default: the first local device.
    **config_overrides: `ModelConfig` fields to change (e.g. dtype='bfloat16'); shapes must not change.

  Returns:
    (model, model_config).
  """
  from sao_jax.models.llama import Decoder  # pylint: disable=g-import-not-at-top
  if not paths.isdir(checkpoint_dir):
    raise FileNotFoundError(f'Checkpoint directory {checkpoint_dir!r} does not exist.')
  with Checkpointer(checkpoint_dir, keep=None, async_save=False) as ckpt:

    def load(s: int):
      meta = ckpt.restore(s, items=('metadata',)).metadata or {}
      if 'model_config' not in meta:
        raise ValueError(f'Checkpoint step {s} in {checkpoint_dir} has no metadata.model_config (save it with '
                         '`metadata=policy_metadata(cfg)`).')
      cfg = model_config_from_json(meta['model_config'])
      if config_overrides:
        cfg = cfg.replace(**config_overrides)
      if cfg.lora_rank:
        return s, cfg, _lora_policy(ckpt, s, meta, cfg, shardings_fn)
      abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
      graphdef, abs_state = nnx.split(abstract)
      target = (_single_device_target(abs_state) if shardings_fn is None
                else abstract_target(abs_state, shardings_fn(abs_state)))
      try:
        restored = ckpt.restore(s, target=CheckpointState(step=s, policy=target), items=('policy',))
      except CheckpointCorrupt:
        raise
      except (ValueError, KeyError) as e:
        raise ValueError(f'Checkpoint step {s} in {checkpoint_dir}: the policy item does not fit a Decoder '
                         f'of its saved model config: {e}') from e
      return s, cfg, nnx.merge(graphdef, restored.policy)

    step, cfg, model = ckpt._first_intact(step, load)  # pylint: disable=protected-access
  logging.info('Loaded policy %s (step %d) from %s.', cfg.name or '(unnamed)', step, checkpoint_dir)
  return model, cfg
