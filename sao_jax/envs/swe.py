"""`swe`: agentic coding in the style of SWE-bench: a repository, tools over many turns, hidden tests decide.

An instance (`sao_jax.envs.swe_data.Instance`, SWE-bench fields) is a repository snapshot, a problem statement,
the gold patch, the test patch and the FAIL_TO_PASS / PASS_TO_PASS test ids. An episode starts from a fresh copy
of the snapshot (the episode's working tree, a dict of text files held by the env) and the model acts through
tools, one Hermes/Qwen tool call per call block, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(at most `max_calls_per_turn` run per turn, in order):

  view {"path", "start"?, "end"?}   a file with line numbers (a 1-based inclusive line range), or a directory's files
  search {"pattern", "path"?}       lines containing the literal text, under a path (default: everywhere)
  edit {"path", "old", "new"}       replace `old`, which must occur exactly once in the file, by `new`
  create {"path", "content"}        write a file (new or replaced)
  run {"command"}                   `/bin/sh -c command` in the repository root, in the sandbox; files the command
                                    leaves behind become the working tree
  test {"target"}                   run tests on the working tree: a test file, a directory or a test id
  submit {}                         end the episode; the hidden tests decide

Each turn's tool results come back as ONE observation message (role `observation_role`), cut to
`max_observation_chars` with a note saying so. The parser is total: a turn without a call, a call that is not
JSON, an unknown tool or wrong arguments give an error observation, never an environment error.

Reward (decided here, outside the model's reach): after `submit` (or on the last allowed turn when
`score_at_turn_limit`), the FAIL_TO_PASS and PASS_TO_PASS tests run in a FRESH sandbox on the edited tree with
every test file put back as the instance has it: the snapshot's test files restored (edits and deletions undone),
the test patch's hidden files applied, test files the model added removed (`swe_data.is_test_path`). Reward 1
when every one passes, else 0 ('all'), or the fraction passed ('fraction').

Isolation (docs/design.md, Security model): file tools act on the in-memory tree (paths are checked:
relative, inside the repository; nothing on the host's disk is read or written). `run`, `test` and the verdict
run the harness (`_HARNESS`) in the bubblewrap sandbox (`sandbox.Sandbox`: no network, read-only system, a
size-capped tmpfs, CPU/memory/file-size/process limits, a wall clock): it writes the tree into the sandbox's
`/tmp/repo`, runs the command or the tests, and prints ONE record tagged with a per-run secret mark (the harness
makes itself non-dumpable, so processes it starts cannot read its memory or its output descriptors). Each test
runs in its own `python3 -I` process (`_RUNNER`) that reads its per-test mark from stdin only after the test
function returned, then prints `mark PASS`; a test passes only with that line and exit status 0. Hidden test
files and the gold patch never enter a sandbox the model's commands run in, nor any observation.
Residual risk: code under test shares the process of its test, so a program written against this harness (one
that reads the runner's stdin before the runner does) could forge a pass; report files, printed lines, early
exits, `conftest.py`/`sitecustomize.py` and edited or deleted tests cannot (tests/envs/swe_test.py).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import posixpath
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

from sao_jax.errors import ConfigError
from sao_jax.envs import base
from sao_jax.envs import datasets
from sao_jax.envs import registry
from sao_jax.envs import safe_eval
from sao_jax.envs import sandbox as sandbox_lib
from sao_jax.envs import swe_data

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), 'data', 'swe_synthetic.jsonl')
TOOLS = ('view', 'search', 'edit', 'create', 'run', 'test', 'submit')
_OPEN, _CLOSE = '<tool_call>', '</tool_call>'
_MAX_HITS = 50  # Search hits shown.
_MAX_LISTED = 200  # Files listed by `view` of a directory.

INSTRUCTIONS = '''You are working in a Python repository to resolve the issue the user gives. Each turn, call tools \
as <tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Tools:
- view {"path": P, "start": L1, "end": L2}: file P with line numbers (the line range is optional), or the files \
of a directory ("." is the root).
- search {"pattern": S, "path": P}: the lines containing the text S, under P (optional).
- edit {"path": P, "old": A, "new": B}: replace the text A, which must occur exactly once in P, by B.
- create {"path": P, "content": C}: write the file P.
- run {"command": C}: run a shell command in the repository root (no network).
- test {"target": T}: run tests: a test file, a directory or a test id (path.py::test_name).
- submit {}: finish; hidden tests then decide.'''
BRIEF = 'Tools (<tool_call>{"name": N, "arguments": {...}}</tool_call>): view search edit create run test submit.'


@dataclasses.dataclass(frozen=True)
class SweOptions:
  """`config.task.kwargs` of swe."""
  data_file: str = DEFAULT_DATA  # SWE-bench-format JSONL (default: the shipped synthetic set, envs/swe_gen.py).
  eval_file: str = ''  # Optional separate eval instances ('' = hold out eval_size of data_file).
  repos_root: str = ''  # Directory of local repositories (`<repos_root>/<repo>`) for rows without repo_files.
  reward: str = 'all'  # 'all' (1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes) or 'fraction'.
  instructions: str = 'full'  # Tools described: 'full' (a system message), 'brief' (one line after the issue) or
  # 'none' (the issue alone: a model warm-started on the oracle's episodes learns the tools from them).
  observation_role: str = 'tool'  # Chat role of tool results.
  max_observation_chars: int = 3000  # Tool results of a turn are cut to this, with a note.
  max_action_chars: int = 200000  # A longer turn is not parsed (an error observation).
  max_calls_per_turn: int = 4  # Tool calls run per turn (later ones are reported as skipped).
  score_at_turn_limit: bool = True  # On the last turn without submit: score the tree (terminal), else a cut.
  budget_ends_turn: bool = False  # A turn that runs out of sampler.max_new_tokens goes to the env as it is (its
  # unclosed call gets an error observation) and the episode goes on; False: the episode ends there (cut mid-turn).
  command_timeout_s: float = 20.0  # Wall clock of one `run` / `test` call (sandbox).
  per_test_timeout_s: float = 5.0  # Wall clock of one test (its own process).
  verdict_timeout_s: float = 120.0  # Wall clock of the verdict (all hidden tests).
  max_file_bytes: int = 65536  # Largest file the tools write.
  max_repo_bytes: int = 2097152  # Largest working tree (a command's file changes past it are discarded).
  cpu_s: int = 10  # RLIMIT_CPU of each sandboxed process.
  memory_mb: int = 1024  # RLIMIT_AS of each sandboxed process.
  file_size_mb: int = 4  # RLIMIT_FSIZE.
  max_procs: int = 64  # RLIMIT_NPROC of the sandbox uid.
  tmpfs_mb: int = 64  # Size of the sandbox's /tmp (the repository copy lives there).
  isolation: str = 'bwrap'  # bwrap (required), or a weaker mode by name: unshare, rlimits (see sandbox.WEAKER).
  max_concurrent: int = 4  # Sandboxes running at once (tools and verdicts each).

  def check(self, path: str = 'task.kwargs') -> None:
    registry.check_file(f'{path}.data_file', self.data_file)
    if self.eval_file:
      registry.check_file(f'{path}.eval_file', self.eval_file)
    if self.repos_root and not os.path.isdir(self.repos_root):
      raise ConfigError(f'config.{path}.repos_root={self.repos_root!r}: no such directory.')
    if self.reward not in ('all', 'fraction'):
      raise ConfigError(f'config.{path}.reward={self.reward!r}: all or fraction.')
    if self.instructions not in ('full', 'brief', 'none'):
      raise ConfigError(f'config.{path}.instructions={self.instructions!r}: full, brief or none.')
    if self.isolation not in sandbox_lib.ISOLATIONS:
      raise ConfigError(f'config.{path}.isolation={self.isolation!r}: one of {sandbox_lib.ISOLATIONS} (bwrap '
                        'unless a weaker mode is asked for by name).')
    for name in ('max_observation_chars', 'max_action_chars', 'max_calls_per_turn', 'command_timeout_s',
                 'per_test_timeout_s', 'verdict_timeout_s', 'max_file_bytes', 'max_repo_bytes', 'cpu_s',
                 'memory_mb', 'file_size_mb', 'max_procs', 'tmpfs_mb', 'max_concurrent'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'config.{path}.{name}={getattr(self, name)!r}: must be > 0.')

  def limits(self, timeout_s: float) -> sandbox_lib.SandboxLimits:
    # The harness's record carries the tree back: room for it and the (capped) output.
    return sandbox_lib.SandboxLimits(timeout_s=timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                                     file_size_mb=self.file_size_mb, max_procs=self.max_procs,
                                     max_open_files=256, tmpfs_mb=self.tmpfs_mb,
                                     max_output_bytes=2 * self.max_repo_bytes + (1 << 20))


# ------------------------------------------------------------------------------------------------------------
# The sandboxed harness: one program, two jobs ('command', 'tests'), one record out.

# One test in its own process (light imports: `inspect` and `unittest` alone cost ~120 ms of start-up).
_RUNNER = r'''
import os, sys
ROOT = '/tmp/repo'
sys.path.insert(0, ROOT)
path, _, rest = sys.argv[1].partition('::')
def load():
  parts = path[:-3].split('/')
  if path.endswith('.py') and all(p.isidentifier() for p in parts):
    __import__('.'.join(parts))
    return sys.modules['.'.join(parts)]
  import importlib.util
  spec = importlib.util.spec_from_file_location('test_module', os.path.join(ROOT, path))
  mod = importlib.util.module_from_spec(spec); sys.modules['test_module'] = mod; spec.loader.exec_module(mod)
  return mod
def run():
  obj = load()
  names = rest.split('::')
  owner = None
  for n in names:
    owner, obj = obj, getattr(obj, n)
  ut = sys.modules.get('unittest')
  if isinstance(owner, type) and ut is not None and issubclass(owner, ut.TestCase):
    result = ut.TestResult()
    owner(names[-1]).run(result)
    for _, text in result.errors + result.failures:
      sys.stderr.write(text)
    return result.wasSuccessful()
  if isinstance(owner, type):
    inst = owner()
    method = getattr(inst, names[-1])
    if hasattr(inst, 'setup_method'):
      inst.setup_method(method)
    method()
    if hasattr(inst, 'teardown_method'):
      inst.teardown_method(method)
    return True
  code = getattr(obj, '__code__', None)
  if code is None or code.co_argcount + code.co_kwonlyargcount > len(obj.__defaults__ or ()) + len(
      obj.__kwdefaults__ or {}):
    raise TypeError('not a test function without arguments (fixtures are not supported)')
  obj()
  return True
try:
  ok = run()
except BaseException:
  import traceback
  traceback.print_exc(limit=-4)
  ok = False
sys.stdout.flush(); sys.stderr.flush()
if ok:
  mark = sys.stdin.readline().strip()
  os.write(1, (mark + ' PASS\n').encode())
os._exit(0 if ok else 1)
'''

_HARNESS = r'''
import ctypes, json, os, secrets, signal, subprocess, sys, threading
try:
  ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 0: children cannot read our memory or fds.
except Exception:
  pass
MARK = {mark!r}
JOB = json.loads({job!r})
RUNNER = {runner!r}
ROOT = '/tmp/repo'
CAP = JOB['output_cap']
def emit(obj):
  sys.stdout.write(MARK + json.dumps(obj) + '\n'); sys.stdout.flush()
os.makedirs(ROOT)
for p, text in JOB['files'].items():
  full = os.path.join(ROOT, p)
  os.makedirs(os.path.dirname(full), exist_ok=True)
  with open(full, 'w', encoding='utf-8') as f:
    f.write(text)
ENV = {{'PATH': '/usr/bin:/bin', 'HOME': '/tmp', 'LANG': 'C.UTF-8', 'PYTHONDONTWRITEBYTECODE': '1',
       'PYTHONPATH': ROOT}}
def run(argv, timeout, stdin=b''):
  p = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, start_new_session=True)
  buf = bytearray()
  def drain():
    while True:
      chunk = p.stdout.read(65536)
      if not chunk:
        break
      if len(buf) < CAP:
        buf.extend(chunk[:CAP - len(buf)])
  t = threading.Thread(target=drain, daemon=True); t.start()
  try:
    p.stdin.write(stdin); p.stdin.close()
  except OSError:
    pass
  try:
    rc = p.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    rc = None
  try:
    os.killpg(p.pid, signal.SIGKILL)
  except OSError:
    pass
  p.wait(); t.join(2)
  return rc, bytes(buf).decode('utf-8', 'replace')
def tree():
  files, skipped, total = {{}}, [], 0
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = sorted(d for d in dirnames if d != '__pycache__' and not os.path.islink(os.path.join(dirpath, d)))
    for name in sorted(filenames):
      full = os.path.join(dirpath, name)
      rel = os.path.relpath(full, ROOT)
      if name.endswith('.pyc'):
        continue
      if os.path.islink(full) or not os.path.isfile(full):
        skipped.append(rel); continue
      try:
        with open(full, 'rb') as f:
          data = f.read(JOB['max_repo_bytes'] + 1)
        text = data.decode('utf-8')
      except (OSError, UnicodeDecodeError):
        skipped.append(rel); continue
      total += len(data)
      if total > JOB['max_repo_bytes']:
        return None, skipped, total
      files[rel] = text
  return files, skipped, total
if JOB['kind'] == 'command':
  rc, out = run(['/bin/sh', '-c', JOB['command']], JOB['timeout'])
  files, skipped, total = tree()
  emit({{'rc': rc, 'out': out, 'files': files, 'skipped': skipped[:50], 'total': total}})
else:
  results, todo = {{}}, list(JOB['tests'])
  def worker():
    while todo:
      try:
        test_id = todo.pop()
      except IndexError:
        return
      mark = secrets.token_hex(16)
      rc, out = run([sys.executable, '-I', '-c', RUNNER, test_id], JOB['timeout'], (mark + '\n').encode())
      lines = out.splitlines()
      ok = rc == 0 and (mark + ' PASS') in lines
      results[test_id] = {{'ok': ok, 'rc': rc, 'out': '\n'.join(l for l in lines if mark not in l)[-1500:]}}
  workers = [threading.Thread(target=worker) for _ in range(JOB['parallel'])]
  for w in workers:
    w.start()
  for w in workers:
    w.join()
  emit({{'results': results}})
'''


class HarnessError(RuntimeError):
  """The sandbox gave no readable record (it was killed, or its output was damaged)."""


@dataclasses.dataclass(frozen=True)
class CommandResult:
  returncode: int | None  # None: the command timed out.
  output: str  # stdout and stderr together, capped.
  files: dict[str, str] | None  # The tree the command left (None: not kept, see `note`).
  note: str  # Why the tree was not kept, or which files were left out ('' when all kept).


def _record(stdout: str, mark: str) -> dict[str, Any]:
  for line in stdout.splitlines():
    if line.startswith(mark):
      try:
        rec = json.loads(line[len(mark):])
      except (ValueError, RecursionError):
        break
      if isinstance(rec, dict):
        return rec
      break
  raise HarnessError('the sandbox returned no readable record')


def _job(sandbox: sandbox_lib.Sandbox, job: dict[str, Any]) -> dict[str, Any]:
  mark = f'@@SWE_{secrets.token_hex(12)}@@'
  res = sandbox.run(_HARNESS.format(mark=mark, job=json.dumps(job), runner=_RUNNER))
  if res.timed_out:
    raise HarnessError(f'the sandbox timed out after {sandbox.limits.timeout_s:g}s')
  return _record(res.stdout, mark)


def run_command(sandbox: sandbox_lib.Sandbox, files: Mapping[str, str], command: str, *, timeout_s: float,
                max_repo_bytes: int, output_cap: int = 65536) -> CommandResult:
  """Runs `/bin/sh -c command` in a copy of `files` in the sandbox; returns its output and the tree it left.

  Raises:
    HarnessError: no readable record (the whole sandbox ran out of time or was killed).
    sandbox_lib.SandboxError: the sandbox did not start.
  """
  rec = _job(sandbox, {'kind': 'command', 'files': dict(files), 'command': command, 'timeout': timeout_s,
                       'output_cap': output_cap, 'max_repo_bytes': max_repo_bytes})
  rc, out, tree = rec.get('rc'), rec.get('out'), rec.get('files')
  if not (rc is None or type(rc) is int) or not isinstance(out, str):
    raise HarnessError('the sandbox record is malformed')
  note = ''
  if tree is None:
    note = f'the tree grew past {max_repo_bytes} bytes: file changes discarded'
  elif not isinstance(tree, dict) or any(not isinstance(k, str) or not isinstance(v, str) for k, v in tree.items()):
    tree, note = None, 'file changes could not be read back: discarded'
  else:
    try:
      tree = {swe_data.check_path(k): v for k, v in tree.items()}
    except ValueError:
      tree, note = None, 'file changes could not be read back: discarded'
  skipped = rec.get('skipped')
  if tree is not None and isinstance(skipped, list) and skipped:
    note = 'left out (binary, links or special files): ' + ', '.join(str(s)[:80] for s in skipped[:10])
  return CommandResult(rc, out, tree, note)


def run_tests(sandbox: sandbox_lib.Sandbox, files: Mapping[str, str], test_ids: Sequence[str], *,
              per_test_timeout_s: float, parallel: int = 2, output_cap: int = 16384) -> dict[str, tuple[bool, str]]:
  """Runs each test id in its own process in one sandbox on `files` (`parallel` at a time); {id: (passed,
  output tail)}.

  A test without a well-formed result counts as failed. Raises `sandbox_lib.SandboxError` when the sandbox does
  not start; a sandbox that gives no readable record fails every test.
  """
  try:
    rec = _job(sandbox, {'kind': 'tests', 'files': dict(files), 'tests': list(test_ids),
                         'timeout': per_test_timeout_s, 'output_cap': output_cap, 'max_repo_bytes': 0,
                         'parallel': max(1, int(parallel))})
  except HarnessError as e:
    return {t: (False, str(e)) for t in test_ids}
  results = rec.get('results') if isinstance(rec.get('results'), dict) else {}
  out = {}
  for t in test_ids:
    r = results.get(t)
    ok = isinstance(r, dict) and r.get('ok') is True
    text = r.get('out') if isinstance(r, dict) and isinstance(r.get('out'), str) else 'no result'
    out[t] = (ok, text)
  return out


# ------------------------------------------------------------------------------------------------------------
# Tool calls.


def parse_tool_calls(text: str, max_calls: int) -> tuple[list[dict[str, Any] | str], int]:
  """The tool calls of a turn, in order: each a dict {'name', 'arguments'} or an error string; and how many
  complete call blocks were left unparsed past `max_calls`. Linear in the text."""
  calls: list[dict[str, Any] | str] = []
  extra, pos = 0, 0
  while True:
    start = text.find(_OPEN, pos)
    if start < 0:
      break
    end = text.find(_CLOSE, start)
    if end < 0:
      calls.append(f'tool call {len(calls) + 1} has no closing {_CLOSE}')
      break
    pos = end + len(_CLOSE)
    if len(calls) >= max_calls:
      extra += 1
      continue
    body = text[start + len(_OPEN):end]
    try:
      call = json.loads(body)
    except (ValueError, RecursionError) as e:
      calls.append(f'tool call {len(calls) + 1} is not valid JSON ({str(e)[:80]})')
      continue
    if not isinstance(call, dict) or not isinstance(call.get('name'), str):
      calls.append(f'tool call {len(calls) + 1} must be an object with a "name"')
      continue
    args = call.get('arguments', {})
    if isinstance(args, str):  # Some templates send arguments as a JSON string.
      try:
        args = json.loads(args) if args.strip() else {}
      except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
      calls.append(f'tool call {len(calls) + 1}: "arguments" must be an object')
      continue
    calls.append({'name': call['name'], 'arguments': args})
  return calls, extra


class ToolError(ValueError):
  """A tool call that cannot be carried out (the message goes back to the model)."""


def _arg(args: Mapping[str, Any], name: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
  if name not in args or args[name] is None:
    if default is dataclasses.MISSING:
      raise ToolError(f'missing argument "{name}"')
    return default
  value = args[name]
  if kind is int and (type(value) is not int):
    raise ToolError(f'argument "{name}" must be an integer')
  if kind is str and not isinstance(value, str):
    raise ToolError(f'argument "{name}" must be a string')
  return value


def _path(args: Mapping[str, Any], default: Any = dataclasses.MISSING) -> str:
  raw = _arg(args, 'path', str, default)
  if raw in ('', '.', './', '/repo', '/repo/'):
    return '.'
  try:
    return swe_data.check_path(raw.removeprefix('/repo/'))
  except ValueError as e:
    raise ToolError(str(e)) from None


def _under(path: str, root: str) -> bool:
  return root == '.' or path == root or path.startswith(root + '/')


def _numbered(lines: Sequence[str], first: int) -> str:
  return '\n'.join(f'{first + k:6d}\t{line}' for k, line in enumerate(lines))


def collect_tests(files: Mapping[str, str], target: str) -> list[str]:
  """Test ids of `target` in the tree: itself when it names a test (`path.py::name`), else the top-level
  `test*` functions and the `test*` methods of `Test*` classes of the test files at or under it."""
  if '::' in target:
    return [target]
  ids = []
  for path in sorted(p for p in files if _under(p, target) and p.endswith('.py')
                     and posixpath.basename(p).startswith('test')):
    try:
      with safe_eval.PARSE_LOCK:  # ast.parse is not thread-safe on CPython 3.11.
        tree = ast.parse(files[path])
    except (SyntaxError, ValueError, RecursionError, MemoryError):
      ids.append(f'{path}::<collection error>')
      continue
    for node in tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith('test'):
        ids.append(f'{path}::{node.name}')
      elif isinstance(node, ast.ClassDef) and node.name.startswith('Test'):
        ids += [f'{path}::{node.name}::{m.name}' for m in node.body
                if isinstance(m, ast.FunctionDef) and m.name.startswith('test')]
  return ids


def _cut(text: str, limit: int) -> str:
  if len(text) <= limit:
    return text
  return text[:limit] + f'\n[output cut: {len(text)} characters, the first {limit} shown]'


# ------------------------------------------------------------------------------------------------------------
# The environment.


@dataclasses.dataclass(frozen=True)
class Sandboxes:
  """The task's two sandboxes: `tools` (run / test calls, `command_timeout_s`) and `verdict` (the hidden tests,
  `verdict_timeout_s`)."""
  tools: sandbox_lib.Sandbox
  verdict: sandbox_lib.Sandbox

  @classmethod
  def make(cls, opts: SweOptions) -> Sandboxes:
    kw = dict(isolation=opts.isolation, max_concurrent=opts.max_concurrent)
    return cls(sandbox_lib.Sandbox(opts.limits(opts.command_timeout_s + 5.0), **kw),
               sandbox_lib.Sandbox(opts.limits(opts.verdict_timeout_s), **kw))


def verdict_tree(files: Mapping[str, str], snapshot: Mapping[str, str], hidden: Mapping[str, str | None]
                 ) -> dict[str, str]:
  """The tree the hidden tests run on: `files` with every test file as the instance has it (the snapshot's test
  files restored, the hidden ones applied, test files that only the model wrote removed)."""
  tree = {p: t for p, t in files.items() if not swe_data.is_test_path(p) or p in snapshot or p in hidden}
  tree.update({p: t for p, t in snapshot.items() if swe_data.is_test_path(p)})
  for p, t in hidden.items():
    if t is None:
      tree.pop(p, None)
    else:
      tree[p] = t
  return tree


class SweEnv(base.BaseEnv):
  """See module docstring. `example.data`: `files` (the snapshot), `hidden_tests`, `fail_to_pass`,
  `pass_to_pass`, `patch` (gold; read only by `oracle_actions`)."""

  def __init__(self, example: base.Example, opts: SweOptions, sandboxes: Sandboxes, *, max_turns: int):
    super().__init__(example, max_turns=max_turns)
    self.opts = opts
    self.sandboxes = sandboxes
    self.observation_role = opts.observation_role
    self.budget_ends_turn = opts.budget_ends_turn  # Read by the episode runners (`rollout.episodes.absorb`).
    self.files: dict[str, str] = {}
    self.tool_calls: dict[str, int] = {}
    self.tool_seconds: list[tuple[str, float]] = []  # (tool, wall seconds) of every call, verdict included.

  def _reset(self) -> None:
    self.files = dict(self.example.data['files'])
    self.tool_calls = {}
    self.tool_seconds = []

  # ---- tools (each returns the result text or raises ToolError).

  def _view(self, args: Mapping[str, Any]) -> str:
    path = _path(args, '.')
    if path in self.files:
      lines = self.files[path].split('\n')
      if lines and lines[-1] == '':
        lines.pop()
      start, end = _arg(args, 'start', int, 1), _arg(args, 'end', int, len(lines))
      if start < 1 or end < start:
        raise ToolError(f'bad line range {start}-{end} ({len(lines)} lines)')
      return f'{path} ({len(lines)} lines)\n' + _numbered(lines[start - 1:end], start)
    listed = sorted(p for p in self.files if _under(p, path))
    if not listed:
      raise ToolError(f'no such file or directory: {path}')
    more = f'\n[{len(listed) - _MAX_LISTED} more]' if len(listed) > _MAX_LISTED else ''
    return '\n'.join(listed[:_MAX_LISTED]) + more

  def _search(self, args: Mapping[str, Any]) -> str:
    pattern = _arg(args, 'pattern', str)
    if not pattern or len(pattern) > 500:
      raise ToolError('"pattern" must be 1 to 500 characters')
    root = _path(args, '.')
    hits = []
    for p in sorted(self.files):
      if _under(p, root):
        for n, line in enumerate(self.files[p].split('\n'), 1):
          if pattern in line:
            hits.append(f'{p}:{n}: {line[:200]}')
    if not hits:
      return f'no match for {pattern!r}'
    return '\n'.join(hits[:_MAX_HITS]) + (f'\n[{len(hits) - _MAX_HITS} more matches]' if len(hits) > _MAX_HITS else '')

  def _write(self, path: str, text: str) -> None:
    if path == '.':
      raise ToolError('a file path is needed')
    if len(text.encode()) > self.opts.max_file_bytes:
      raise ToolError(f'the file would be larger than {self.opts.max_file_bytes} bytes')
    if any(p.startswith(path + '/') for p in self.files):
      raise ToolError(f'{path} is a directory')
    total = sum(len(t) for p, t in self.files.items() if p != path) + len(text)
    if total > self.opts.max_repo_bytes:
      raise ToolError(f'the repository would be larger than {self.opts.max_repo_bytes} bytes')
    parent = posixpath.dirname(path)
    while parent:
      if parent in self.files:
        raise ToolError(f'{parent} is a file')
      parent = posixpath.dirname(parent)
    self.files[path] = text

  def _edit(self, args: Mapping[str, Any]) -> str:
    path, old, new = _path(args), _arg(args, 'old', str), _arg(args, 'new', str)
    if path not in self.files:
      raise ToolError(f'no such file: {path}')
    if not old:
      raise ToolError('"old" must not be empty')
    count = self.files[path].count(old)
    if count != 1:
      raise ToolError(f'"old" occurs {count} times in {path}; it must occur exactly once')
    text = self.files[path].replace(old, new, 1)
    self._write(path, text)
    first = text[:text.index(new) if new else 0].count('\n')
    lines = text.split('\n')
    lo, hi = max(first - 2, 0), min(first + new.count('\n') + 3, len(lines))
    return f'edited {path}:\n' + _numbered(lines[lo:hi], lo + 1)

  def _create(self, args: Mapping[str, Any]) -> str:
    path, content = _path(args), _arg(args, 'content', str)
    existed = path in self.files
    self._write(path, content)
    return f'{"replaced" if existed else "created"} {path} ({len(content)} characters)'

  def _run(self, args: Mapping[str, Any]) -> str:
    command = _arg(args, 'command', str)
    if not command.strip() or len(command) > 10000:
      raise ToolError('"command" must be 1 to 10000 characters')
    try:
      res = run_command(self.sandboxes.tools, self.files, command, timeout_s=self.opts.command_timeout_s,
                        max_repo_bytes=self.opts.max_repo_bytes)
    except HarnessError as e:
      return f'error: {e}'
    if res.files is not None:
      self.files = res.files
    status = (f'timed out after {self.opts.command_timeout_s:g}s' if res.returncode is None
              else f'exit code {res.returncode}')
    note = f'\n[{res.note}]' if res.note else ''
    return f'{res.output.rstrip()}\n[{status}]{note}'.lstrip('\n')

  def _test(self, args: Mapping[str, Any]) -> str:
    target = _arg(args, 'target', str, 'tests')
    path, sep, name = target.partition('::')
    try:
      target = swe_data.check_path(path) + sep + name if path not in ('', '.') else '.'
    except ValueError as e:
      raise ToolError(str(e)) from None
    ids = collect_tests(self.files, target)
    if not ids:
      raise ToolError(f'no tests found at {target}')
    results = run_tests(self.sandboxes.tools, self.files, ids[:100], per_test_timeout_s=self.opts.per_test_timeout_s)
    lines, passed = [], 0
    for t, (ok, out) in results.items():
      passed += ok
      lines.append(f'PASSED {t}' if ok else f'FAILED {t}\n{out.strip()[-600:]}')
    return '\n'.join(lines) + f'\n{passed} passed, {len(results) - passed} failed'

  # ---- the verdict.

  def score(self) -> tuple[float, dict[str, Any]]:
    """Runs the hidden FAIL_TO_PASS and PASS_TO_PASS tests in a fresh sandbox on the verdict tree
    (`verdict_tree`); (reward, info)."""
    data = self.example.data
    f2p, p2p = list(data['fail_to_pass']), list(data['pass_to_pass'])
    tree = verdict_tree(self.files, data['files'], data['hidden_tests'])
    results = run_tests(self.sandboxes.verdict, tree, list(dict.fromkeys(f2p + p2p)),
                        per_test_timeout_s=self.opts.per_test_timeout_s)
    f2p_ok = sum(results[t][0] for t in f2p)
    p2p_ok = sum(results[t][0] for t in p2p)
    passed, total = sum(ok for ok, _ in results.values()), len(results)
    reward = passed / total if self.opts.reward == 'fraction' else float(passed == total)
    return reward, {'tests_passed': passed, 'tests_total': total, 'fail_to_pass_passed': f2p_ok,
                    'pass_to_pass_passed': p2p_ok, 'correct': passed == total}

  def _step(self, action_text: str) -> base.StepResult:
    submitted = False
    if len(action_text) > self.opts.max_action_chars:
      parts = [f'error: the turn is longer than {self.opts.max_action_chars} characters; it was not read']
    else:
      calls, extra = parse_tool_calls(action_text, self.opts.max_calls_per_turn)
      parts = []
      if not calls:
        parts.append('error: no tool call; write <tool_call>{"name": ..., "arguments": {...}}</tool_call> '
                     f'(tools: {", ".join(TOOLS)})')
      for k, call in enumerate(calls, 1):
        if isinstance(call, str):
          parts.append(f'error: {call}')
          continue
        name = call['name']
        if name == 'submit':
          submitted = True
          break
        result = self._call(name, call['arguments'])
        parts.append(result if len(calls) == 1 else f'[{k}: {name}]\n{result}')
      if extra:
        parts.append(f'[{extra} more tool call(s) skipped: at most {self.opts.max_calls_per_turn} a turn]')
    info = {'tool_calls': sum(self.tool_calls.values()), 'isolation': self.sandboxes.verdict.isolation}
    if submitted or (self.turn >= self.max_turns and self.opts.score_at_turn_limit):
      t0 = time.perf_counter()
      reward, verdict = self.score()
      self.tool_seconds.append(('verdict', time.perf_counter() - t0))
      return base.StepResult(None, reward, True, {**info, **verdict, 'submitted': submitted})
    return base.StepResult(_cut('\n'.join(parts), self.opts.max_observation_chars), 0.0, False, info)

  def _call(self, name: str, args: Mapping[str, Any]) -> str:
    tool = {'view': self._view, 'search': self._search, 'edit': self._edit, 'create': self._create,
            'run': self._run, 'test': self._test}.get(name)
    if tool is None:
      return f'error: unknown tool {name[:40]!r}; tools: {", ".join(TOOLS)}'
    self.tool_calls[name] = self.tool_calls.get(name, 0) + 1
    t0 = time.perf_counter()
    try:
      return tool(args)
    except ToolError as e:
      return f'error: {e}'
    finally:
      self.tool_seconds.append((name, time.perf_counter() - t0))


# ------------------------------------------------------------------------------------------------------------
# The oracle (the reference episode: the gold patch applied through the tools).


def _call_text(name: str, **arguments: Any) -> str:
  return f'{_OPEN}{json.dumps({"name": name, "arguments": arguments})}{_CLOSE}'


def oracle_actions(example: base.Example, *, run_tests_first: bool = True) -> list[str]:
  """The turns of a scripted policy that reads the gold patch and applies it through the tools: for each file
  the patch changes it views the file and replaces each hunk's old lines by its new ones (`edit`; `create` with
  the patched file when the old lines are not unique), writes created files (`create`) and removes deleted ones
  (`run rm`); then it runs the repository's tests (`test`, when `run_tests_first`) and submits."""
  snapshot = example.data['files']
  fixed = swe_data.apply_patch(snapshot, example.data['patch'])
  files = dict(snapshot)
  actions = []
  for fp in swe_data.parse_patch(example.data['patch']):
    if fp.old is not None and fp.old == fp.new:
      path = fp.old
      actions.append(_call_text('view', path=path))
      for hunk in fp.hunks:
        old = '\n'.join(t for tag, t in hunk.lines if tag in ' -') + '\n'
        new = '\n'.join(t for tag, t in hunk.lines if tag in ' +') + '\n'
        if files[path].count(old) != 1:
          break
        actions.append(_call_text('edit', path=path, old=old, new=new))
        files[path] = files[path].replace(old, new, 1)
      if files[path] != fixed[path]:
        actions.append(_call_text('create', path=path, content=fixed[path]))
        files[path] = fixed[path]
      continue
    if fp.new is not None:
      actions.append(_call_text('create', path=fp.new, content=fixed[fp.new]))
    if fp.old is not None:
      actions.append(_call_text('run', command=f'rm -f -- {json.dumps(fp.old)}'))
  if run_tests_first:
    actions.append(_call_text('test', target='.'))
  actions.append(_call_text('submit'))
  return actions


# ------------------------------------------------------------------------------------------------------------
# The task.


class SweTask(base.DatasetTask):
  """SWE-bench-format instances from a JSONL file (module docstring)."""

  def __init__(self, opts: SweOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    self.file_reports = []
    self._train, self._eval = datasets.load_split(opts.data_file, opts.eval_file, eval_size, self._example,
                                                  self.file_reports)
    try:
      self.sandboxes = Sandboxes.make(opts)
    except sandbox_lib.SandboxError as e:
      raise ConfigError(f'config.task.kwargs.isolation={opts.isolation!r}: {e}') from e

  def _example(self, n: int, row: dict[str, Any]) -> base.Example:
    """One data row's `Example` (a malformed row raises `datasets.BadRow`)."""
    del n
    return make_example(swe_data.instance_from_row(row, repos_root=self.opts.repos_root), self.opts.instructions)

  def make_env(self, example: base.Example) -> SweEnv:
    return SweEnv(example, self.opts, self.sandboxes, max_turns=self.max_turns)

  def solution_actions(self, example: base.Example) -> list[str]:
    """The oracle's turns (`oracle_actions`): the reference episode of a warm start."""
    return oracle_actions(example)


def make_example(inst: swe_data.Instance, instructions: str = 'full') -> base.Example:
  """The `Example` of an instance: the issue as the user message, with the tools described in a system message
  ('full'), in one line after the issue ('brief') or not at all ('none'); `data` holds the snapshot, the hidden
  test files, the test ids and the gold patch (none of which the model sees)."""
  prompt = f'{inst.problem_statement}\n{BRIEF}' if instructions == 'brief' else inst.problem_statement
  return base.Example(
      uid=f'swe:{inst.instance_id}', prompt=prompt, answer='',
      system=INSTRUCTIONS if instructions == 'full' else None,
      data={'instance_id': inst.instance_id, 'files': dict(inst.files), 'hidden_tests': inst.hidden_tests,
            'fail_to_pass': list(inst.fail_to_pass), 'pass_to_pass': list(inst.pass_to_pass), 'patch': inst.patch})


@registry.register_task('swe', SweOptions, min_turns=2)
def _make(opts: SweOptions, *, max_turns: int, eval_size: int) -> SweTask:
  return SweTask(opts, max_turns=max_turns, eval_size=eval_size)
