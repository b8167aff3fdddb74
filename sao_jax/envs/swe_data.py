"""SWE-bench-format instances: unified diffs, repository snapshots from local directories, the JSONL loader.

An instance (`Instance`) is what the `swe` environment (`sao_jax.envs.swe`) needs: a repository snapshot as a
dict of text files (relative POSIX path -> content), the problem statement, the gold `patch` and the
`test_patch` (unified diffs, as SWE-bench ships them), and the FAIL_TO_PASS / PASS_TO_PASS test ids. The
hidden test files (`Instance.hidden_tests`) are the files the test patch touches, as they are after it: the
model never sees them; the verdict restores them.

A row of a SWE-bench-format JSONL file has the fields `instance_id`, `repo`, `base_commit`, `problem_statement`,
`patch`, `test_patch`, `FAIL_TO_PASS`, `PASS_TO_PASS` (the two test lists as JSON lists or JSON-encoded strings,
as the Hugging Face dataset has them). The repository comes from (in order):
  * `repo_files`: the files inline, {path: content} (the shipped synthetic set, `sao_jax.envs.swe_gen`);
  * a local directory: `repo_dir` if the row has it, else `<repos_root>/<repo>` (with `/` in `repo` also tried
    as `__`, SWE-bench's own directory naming). When the directory is a git repository and the row names a
    `base_commit`, the snapshot is that commit (`git archive`, local only); otherwise the directory's files as
    they are. `.git` and other hidden directories, `__pycache__`, binary files and files over `max_file_bytes`
    are left out.
Nothing is fetched over a network. Test ids are pytest node ids (`path.py::test_name`,
`path.py::Class::test_name`), which the environment's runner executes (`sao_jax.envs.swe`, Harness).
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import json
import os
import posixpath
import re
import subprocess
import tarfile
from collections.abc import Mapping
from typing import Any

from sao_jax.envs import datasets

MAX_FILE_BYTES = 256 << 10  # Larger files are left out of a snapshot read from a directory.
MAX_REPO_BYTES = 4 << 20  # A snapshot larger than this is refused (the row is skipped).
_SKIP_DIRS = frozenset({'__pycache__', 'node_modules'})
_TEST_FILE = re.compile(r'(^|/)(tests?/|test_[^/]*\.py$|[^/]*_test\.py$|conftest\.py$)')


class PatchError(ValueError):
  """A diff that does not parse or does not apply to the files."""


@dataclasses.dataclass(frozen=True)
class Instance:
  """One task instance (module docstring). `files` is the snapshot the model starts from."""
  instance_id: str
  problem_statement: str
  files: Mapping[str, str]
  patch: str
  test_patch: str
  fail_to_pass: tuple[str, ...]
  pass_to_pass: tuple[str, ...]
  repo: str = ''

  @property
  def hidden_tests(self) -> dict[str, str | None]:
    """Test files as the test patch leaves them: path -> content (None: the patch deletes it)."""
    after = apply_patch(self.files, self.test_patch)
    return {p: after.get(p) for p in patched_paths(self.test_patch)}


def is_test_path(path: str) -> bool:
  """Whether `path` is a test file (under a `test/` or `tests/` directory, `test_*.py`, `*_test.py`,
  `conftest.py`): the files the verdict restores to the instance's version."""
  return bool(_TEST_FILE.search(path))


def check_path(path: str) -> str:
  """`path` as a normalised relative POSIX path inside a repository; ValueError when it is absolute, leaves the
  root ('..'), is empty, has NUL or control characters, or is longer than 255 characters."""
  if not isinstance(path, str) or not path or len(path) > 255:
    raise ValueError(f'bad path {path!r:.80}: a non-empty relative path of at most 255 characters')
  if any(ord(c) < 32 for c in path) or '\\' in path:
    raise ValueError(f'bad path {path!r:.80}: control characters or backslashes')
  if path.startswith('/'):
    raise ValueError(f'path {path!r:.80} is absolute; paths are relative to the repository root')
  norm = posixpath.normpath(path)
  if norm == '.' or norm == '..' or norm.startswith('../'):
    raise ValueError(f'path {path!r:.80} is outside the repository')
  return norm


# ------------------------------------------------------------------------------------------------------------
# Unified diffs.


@dataclasses.dataclass
class _Hunk:
  old_start: int
  lines: list[tuple[str, str]]  # (' ' | '-' | '+', text without newline)


@dataclasses.dataclass
class _FilePatch:
  old: str | None  # None: a new file.
  new: str | None  # None: a deleted file.
  hunks: list[_Hunk]


_HUNK = re.compile(r'^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@')


def _strip_prefix(name: str) -> str | None:
  name = name.split('\t', 1)[0].strip()
  if name == '/dev/null':
    return None
  for prefix in ('a/', 'b/'):
    if name.startswith(prefix):
      return check_path(name[len(prefix):])
  return check_path(name)


def parse_patch(diff: str) -> list[_FilePatch]:
  """The file patches of a unified diff (git or plain `---`/`+++` headers); PatchError when malformed."""
  lines = diff.splitlines()
  out: list[_FilePatch] = []
  i = 0
  while i < len(lines):
    if not lines[i].startswith('--- ') or i + 1 >= len(lines) or not lines[i + 1].startswith('+++ '):
      i += 1
      continue
    try:
      fp = _FilePatch(_strip_prefix(lines[i][4:]), _strip_prefix(lines[i + 1][4:]), [])
    except ValueError as e:
      raise PatchError(str(e)) from None
    i += 2
    while i < len(lines) and lines[i].startswith('@@'):
      m = _HUNK.match(lines[i])
      if not m:
        raise PatchError(f'bad hunk header {lines[i]!r:.80}')
      old_n = int(m.group(2) if m.group(2) is not None else 1)
      new_n = int(m.group(4) if m.group(4) is not None else 1)
      hunk = _Hunk(int(m.group(1)), [])
      i += 1
      while (old_n > 0 or new_n > 0) and i < len(lines):
        line = lines[i]
        tag, text = (line[:1] or ' '), line[1:]
        if tag == '\\':  # "\ No newline at end of file": the snapshot format keeps text lines only.
          i += 1
          continue
        if tag not in ' -+':
          raise PatchError(f'bad hunk line {line!r:.80}')
        hunk.lines.append((tag, text))
        old_n -= tag in ' -'
        new_n -= tag in ' +'
        i += 1
      if old_n or new_n:
        raise PatchError('a hunk is shorter than its header says')
      while i < len(lines) and lines[i].startswith('\\'):
        i += 1
      fp.hunks.append(hunk)
    if fp.old is None and fp.new is None:
      raise PatchError('a file patch from /dev/null to /dev/null')
    out.append(fp)
  return out


def patched_paths(diff: str) -> list[str]:
  """The paths a diff creates, changes or deletes, in order."""
  return list(dict.fromkeys(fp.new or fp.old for fp in parse_patch(diff)))


def _apply_hunks(text: str, hunks: list[_Hunk], path: str) -> str:
  lines = text.split('\n')
  trailing = lines and lines[-1] == ''
  if trailing:
    lines.pop()
  offset = 0
  for h in hunks:
    old = [t for tag, t in h.lines if tag in ' -']
    new = [t for tag, t in h.lines if tag in ' +']
    at = max(h.old_start - 1 + offset, 0) if old else h.old_start + offset
    if lines[at:at + len(old)] != old:  # Not where the header says: the block must occur exactly once.
      hits = [k for k in range(len(lines) - len(old) + 1) if lines[k:k + len(old)] == old]
      if len(hits) != 1:
        raise PatchError(f'a hunk of {path} does not apply (its lines occur {len(hits)} times)')
      at = hits[0]
    lines[at:at + len(old)] = new
    offset += len(new) - len(old)
  return '\n'.join(lines) + ('\n' if trailing or not lines else '')


def apply_patch(files: Mapping[str, str], diff: str) -> dict[str, str]:
  """`files` with the unified diff applied (a new dict); PatchError when it does not apply."""
  out = dict(files)
  for fp in parse_patch(diff):
    if fp.old is None:
      if fp.new in out:
        raise PatchError(f'the patch creates {fp.new}, which exists')
      out[fp.new] = _apply_hunks('', fp.hunks, fp.new)
      continue
    if fp.old not in out:
      raise PatchError(f'the patch changes {fp.old}, which does not exist')
    text = _apply_hunks(out.pop(fp.old), fp.hunks, fp.old)
    if fp.new is not None:
      out[fp.new] = text
  return out


def make_patch(old: Mapping[str, str], new: Mapping[str, str], *, context: int = 3) -> str:
  """The git-style unified diff from `old` to `new` (files compared by path, in sorted order)."""
  parts = []
  for path in sorted(set(old) | set(new)):
    a, b = old.get(path), new.get(path)
    if a == b:
      continue
    body = list(difflib.unified_diff((a or '').splitlines(), (b or '').splitlines(),
                                     'a/' + path if a is not None else '/dev/null',
                                     'b/' + path if b is not None else '/dev/null', n=context, lineterm=''))
    parts.append(f'diff --git a/{path} b/{path}\n' + '\n'.join(body) + '\n')
  return ''.join(parts)


# ------------------------------------------------------------------------------------------------------------
# Snapshots and the loader.


def _keep(path: str, data: bytes, max_file_bytes: int) -> str | None:
  parts = path.split('/')
  if any(p.startswith('.') or p in _SKIP_DIRS for p in parts) or len(data) > max_file_bytes:
    return None
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError:
    return None
  return text if '\x00' not in text else None


def read_directory(root: str, *, max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, str]:
  """The text files under `root` (symlinks not followed, hidden directories and binary files left out)."""
  files = {}
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith('.') and d not in _SKIP_DIRS)
    for name in sorted(filenames):
      full = os.path.join(dirpath, name)
      if os.path.islink(full) or not os.path.isfile(full):
        continue
      rel = os.path.relpath(full, root).replace(os.sep, '/')
      with open(full, 'rb') as f:
        data = f.read(max_file_bytes + 1)
      text = _keep(rel, data, max_file_bytes)
      if text is not None:
        files[rel] = text
  return files


def read_git_commit(root: str, commit: str, *, max_file_bytes: int = MAX_FILE_BYTES) -> dict[str, str]:
  """The text files of `commit` in the local git repository `root` (`git archive`; regular files only).

  Raises:
    ValueError: git failed (no such commit, not a repository).
  """
  if not re.fullmatch(r'[0-9A-Za-z._/-]{1,100}', commit) or commit.startswith('-'):
    raise ValueError(f'bad base_commit {commit!r:.60}')
  proc = subprocess.run(['git', '-C', root, 'archive', '--format=tar', commit], capture_output=True,
                        timeout=60, check=False, env={'PATH': '/usr/bin:/bin', 'GIT_CONFIG_NOSYSTEM': '1'})
  if proc.returncode != 0:
    raise ValueError(f'git archive {commit} in {root}: {proc.stderr.decode(errors="replace").strip()[:200]}')
  files = {}
  with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
    for member in tar:
      if not member.isreg() or member.size > max_file_bytes:
        continue
      try:
        rel = check_path(member.name)
      except ValueError:
        continue
      text = _keep(rel, tar.extractfile(member).read(), max_file_bytes)
      if text is not None:
        files[rel] = text
  return files


def _test_list(row: Mapping[str, Any], name: str) -> tuple[str, ...]:
  value = row.get(name, [])
  if isinstance(value, str):
    try:
      value = json.loads(value) if value.strip() else []
    except json.JSONDecodeError:
      raise datasets.BadRow(f'field {name!r} is not a JSON list') from None
  if not isinstance(value, list) or any(not isinstance(t, str) or '::' not in t for t in value):
    raise datasets.BadRow(f'field {name!r} must be a list of pytest node ids (path.py::test)')
  return tuple(value)


def _repo_files(row: Mapping[str, Any], repos_root: str, max_file_bytes: int) -> dict[str, str]:
  inline = row.get('repo_files')
  if inline is not None:
    if not isinstance(inline, dict) or any(not isinstance(k, str) or not isinstance(v, str)
                                           for k, v in inline.items()):
      raise datasets.BadRow('field "repo_files" must map paths to file contents')
    try:
      return {check_path(k): v for k, v in inline.items()}
    except ValueError as e:
      raise datasets.BadRow(str(e)) from None
  candidates = []
  if row.get('repo_dir'):
    candidates.append(str(row['repo_dir']))
  repo = str(row.get('repo') or '')
  if repo and repos_root:
    candidates += [os.path.join(repos_root, repo), os.path.join(repos_root, repo.replace('/', '__'))]
  root = next((c for c in candidates if os.path.isdir(c)), None)
  if root is None:
    raise datasets.BadRow(f'no repository: no repo_files, and none of {candidates or ["(no repo_dir/repo)"]} '
                          'is a directory (set config.task.kwargs.repos_root)')
  commit = str(row.get('base_commit') or '')
  if commit and os.path.exists(os.path.join(root, '.git')):
    try:
      return read_git_commit(root, commit, max_file_bytes=max_file_bytes)
    except (ValueError, subprocess.SubprocessError, tarfile.TarError) as e:
      raise datasets.BadRow(str(e)) from None
  return read_directory(root, max_file_bytes=max_file_bytes)


def instance_from_row(row: Mapping[str, Any], *, repos_root: str = '',
                      max_file_bytes: int = MAX_FILE_BYTES) -> Instance:
  """One SWE-bench-format row -> `Instance` (module docstring); `datasets.BadRow` saying why a row is unusable
  (missing field, no FAIL_TO_PASS test, a gold patch that changes nothing, no repository, a patch or test patch
  that does not apply to the snapshot)."""
  iid = datasets.text_field(dict(row), 'instance_id')
  statement = datasets.text_field(dict(row), 'problem_statement')
  patch = str(row.get('patch') or '')
  test_patch = str(row.get('test_patch') or '')
  f2p, p2p = _test_list(row, 'FAIL_TO_PASS'), _test_list(row, 'PASS_TO_PASS')
  if not f2p:
    raise datasets.BadRow('no FAIL_TO_PASS test')
  try:
    if not parse_patch(patch):
      raise datasets.BadRow('the patch changes no file')
  except PatchError as e:
    raise datasets.BadRow(f'patch: {e}') from None
  files = _repo_files(row, repos_root, max_file_bytes)
  if sum(len(v) for v in files.values()) > MAX_REPO_BYTES:
    raise datasets.BadRow(f'the repository is larger than {MAX_REPO_BYTES} bytes')
  inst = Instance(iid, statement, files, patch, test_patch, f2p, p2p, str(row.get('repo') or ''))
  try:
    apply_patch(files, patch)
    inst.hidden_tests  # pylint: disable=pointless-statement  (the test patch must apply too)
  except PatchError as e:
    raise datasets.BadRow(f'patch: {e}') from None
  return inst
