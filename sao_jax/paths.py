"""The one path layer of a run's files: a local path or an object-store URI (`gs://bucket/run`) alike.

Everything a run writes or reads in its workdir goes through here (metrics.jsonl, TensorBoard events, checkpoints'
directory checks, eval outputs, the HF export); orbax takes the same paths (it uses `etils.epath` itself). A local
path behaves exactly as with `os` (appends, atomic replace by rename); a URI goes through `etils.epath`'s fsspec
backend (gcsfs for `gs://`; tensorstore writes checkpoint arrays with its own GCS driver).

An object store is not a disk, and the functions here absorb the differences:
- no directories: `makedirs` creates nothing there; a "directory" exists once an object lies under it;
- no append (gcsfs silently turns mode 'a' into 'w'): `open` refuses 'a' on a URI; a file that grows
  (metrics.jsonl, TensorBoard events) is written in a local staging directory and uploaded whole at sync
  points (`StagedDir`);
- no atomic rename (a rename is a copy then a delete): `write_text` uploads the object in one piece, which GCS
  makes visible atomically (a reader sees the old object or the new one, never a part), so nothing is renamed.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import shutil
import tempfile
import time
from typing import IO, Any

from absl import logging
from etils import epath

# gcsfs's default client asks GCS's control API for a bucket's layout (zonal / hierarchical) before each operation, and
# asks again after every failure (no permission for it, no such API): an extra call and a warning per file. Every GCS
# access of a run uses the JSON API anyway (tensorstore's arrays too), so the plain client is used unless set.
os.environ.setdefault('GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT', 'false')

PathLike = str | os.PathLike
_URI = re.compile(r'^[A-Za-z][A-Za-z0-9+.-]*://')


def is_local(path: PathLike) -> bool:
  """True for a local path, False for a URI (`gs://...`, `s3://...`)."""
  return not _URI.match(os.fspath(path))


def to_epath(path: PathLike) -> epath.Path:
  """`path` as an `etils.epath.Path` (what orbax takes)."""
  return epath.Path(os.fspath(path))


def join(base: PathLike, *parts: str) -> str:
  """`os.path.join` for a local path; '/'-joined for a URI."""
  base = os.fspath(base)
  if is_local(base):
    return os.path.join(base, *parts)
  return posixpath.join(base, *parts)


def absolute(path: PathLike) -> str:
  """`os.path.abspath` of a local path; a URI as it is, without a trailing '/'."""
  path = os.fspath(path)
  return os.path.abspath(path) if is_local(path) else path.rstrip('/')


def makedirs(path: PathLike) -> None:
  """Creates the directory and its parents if missing (on an object store: nothing to create)."""
  if is_local(path):
    os.makedirs(path, exist_ok=True)
  else:
    to_epath(path).mkdir(parents=True, exist_ok=True)


def exists(path: PathLike) -> bool:
  return os.path.exists(path) if is_local(path) else to_epath(path).exists()


def isdir(path: PathLike) -> bool:
  """A directory (on an object store: a prefix with at least one object under it)."""
  return os.path.isdir(path) if is_local(path) else to_epath(path).is_dir()


def listdir(path: PathLike) -> list[str]:
  """The names in a directory, sorted."""
  if is_local(path):
    return sorted(os.listdir(path))
  return sorted(p.name for p in to_epath(path).iterdir())


def remove(path: PathLike) -> None:
  """Deletes a file (an object)."""
  if is_local(path):
    os.remove(path)
  else:
    to_epath(path).unlink()


def rmtree(path: PathLike, *, missing_ok: bool = False) -> None:
  """Deletes a directory and everything under it."""
  if is_local(path):
    if missing_ok and not os.path.exists(path):
      return
    shutil.rmtree(path)
  else:
    to_epath(path).rmtree(missing_ok=missing_ok)


def open_file(path: PathLike, mode: str = 'r') -> IO[Any]:
  """Opens a file, text modes in UTF-8. On a URI only 'r'/'w' (and 'rb'/'wb'): an object cannot be appended to."""
  if is_local(path):
    return open(path, mode, encoding=None if 'b' in mode else 'utf-8')  # pylint: disable=unspecified-encoding
  if 'a' in mode or '+' in mode:
    raise ValueError(f'{os.fspath(path)}: mode {mode!r} is not possible on an object store (objects are written '
                     'whole); write in a local StagedDir and sync it.')
  f = to_epath(path).open(mode.replace('t', '').replace('b', '') + 'b')
  return f if 'b' in mode else io.TextIOWrapper(f, encoding='utf-8')  # (Not the locale's encoding.)


def read_text(path: PathLike) -> str:
  with open_file(path, 'r') as f:
    return f.read()


def write_text(path: PathLike, text: str) -> None:
  """Replaces the file with `text`, all or nothing: locally a temporary file `<path>.tmp` renamed over it; on an
  object store one upload (the object appears whole when it completes)."""
  path = os.fspath(path)
  if is_local(path):
    tmp = path + '.tmp'
    with open(tmp, 'w', encoding='utf-8') as f:
      f.write(text)
    os.replace(tmp, path)
  else:
    with open_file(path, 'w') as f:
      f.write(text)


def move(src: PathLike, dst: PathLike) -> None:
  """Renames a file or a directory (its parents created). Locally one `os.rename` (atomic on one filesystem); on
  an object store every object under `src` copied, then deleted (not atomic: a reader may see both for a while)."""
  src, dst = os.fspath(src), os.fspath(dst)
  if is_local(src):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.rename(src, dst)
    return
  root = to_epath(src)
  if not root.is_dir():
    copy_file(src, dst)
    remove(src)
    return

  def files(d: epath.Path):  # (epath refuses a recursive glob on GCS: one listing per "directory".)
    for p in d.iterdir():
      yield from files(p) if p.is_dir() else (p,)
  for f in files(root):
    copy_file(os.fspath(f), join(dst, *f.relative_to(root).parts))
  rmtree(src)


def copy_file(src: PathLike, dst: PathLike) -> None:
  """Copies one file between any two places (a local file to a bucket, an object to a local file, ...)."""
  with open_file(src, 'rb') as fin, open_file(dst, 'wb') as fout:
    shutil.copyfileobj(fin, fout, 1 << 20)


class StagedDir:
  """A local directory whose files are mirrored to `target`: for writers that need a local file (appends,
  libraries writing with `open`), e.g. metrics.jsonl and TensorBoard events.

  For a local `target` it is `target` itself and syncing does nothing (files are written in place, as they always
  were). For a URI it is a fresh temporary directory: `fetch` names files copied down from `target` first (to be
  appended to); `sync()` uploads every file changed since its last upload, whole, to the same relative path under
  `target`; `close()` syncs and deletes the temporary directory. What was written after the last sync is lost if
  the process dies: callers sync at the points that must survive (a checkpoint) and every `sync_every_s`
  (`due()`).

  Args:
    target: the directory mirrored (a local path or a URI).
    fetch: relative paths of files to copy from `target` into the staging directory first (if they exist).
    sync_every_s: `due()` turns True this long after the last sync.
  """

  def __init__(self, target: PathLike, *, fetch: tuple[str, ...] = (), sync_every_s: float = 30.0):
    self.target = absolute(target)
    self.remote = not is_local(self.target)
    self.sync_every_s = float(sync_every_s)
    self._uploaded: dict[str, tuple[int, int]] = {}  # Relative path -> (size, mtime_ns) last uploaded.
    self._last_sync = time.monotonic()
    if not self.remote:
      makedirs(self.target)
      self.local = self.target
      return
    self.local = tempfile.mkdtemp(prefix='sao_jax_staged_')
    for rel in fetch:
      src = join(self.target, rel)
      if exists(src):
        dst = os.path.join(self.local, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        copy_file(src, dst)
        self._uploaded[rel] = _stamp(dst)

  def due(self) -> bool:
    """True when `target` is remote and `sync_every_s` have passed since the last sync."""
    return self.remote and time.monotonic() - self._last_sync >= self.sync_every_s

  def sync(self) -> int:
    """Uploads the files changed since their last upload; returns how many (0 for a local target)."""
    self._last_sync = time.monotonic()
    if not self.remote or not os.path.isdir(self.local):
      return 0
    n = 0
    for dirpath, _, names in os.walk(self.local):
      for name in sorted(names):
        src = os.path.join(dirpath, name)
        rel = os.path.relpath(src, self.local)
        stamp = _stamp(src)
        if self._uploaded.get(rel) == stamp:
          continue
        copy_file(src, join(self.target, *rel.split(os.sep)))
        self._uploaded[rel] = stamp
        n += 1
    return n

  def close(self, *, upload: bool = True) -> None:
    """Syncs (unless `upload=False`) and, for a remote target, deletes the staging directory (idempotent)."""
    if not self.remote or not os.path.isdir(self.local):
      return
    try:
      if upload:
        self.sync()
    finally:
      shutil.rmtree(self.local, ignore_errors=True)
      logging.vlog(1, 'StagedDir %s: closed (%s).', self.target, self.local)

  def __enter__(self) -> StagedDir:
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self.close(upload=exc_type is None)


def _stamp(path: str) -> tuple[int, int]:
  st = os.stat(path)
  return st.st_size, st.st_mtime_ns
