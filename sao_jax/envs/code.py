"""`code`: the model writes a Python function; hidden unit tests run in the sandbox; up to N attempts.

Problems (JSONL/JSON/CSV/Parquet; field names configurable) carry a prompt, the function name and hidden
tests of two kinds:
  * input/output tests `{"input": [args...], "output": value}`: the sandbox only computes `f(*args)` and
    prints the JSON of the result; the EXPECTED values never enter the sandbox and are compared in the
    parent, so a program cannot fake a pass;
  * assert tests (MBPP's `test_list`, e.g. `"assert f(2) == 4"`), run in the sandbox after the solution
    (weaker: a hostile program could print fake results; prefer input/output tests).
Each attempt's test report is the observation for the next attempt; the episode ends when every test passes
or after `config.task.max_turns` attempts. Reward of the last attempt: 1 if all tests pass, else 0
('all'), or the fraction passed ('fraction').
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
from typing import Any

from sao_jax.errors import ConfigError
from sao_jax.envs import base
from sao_jax.envs import datasets
from sao_jax.envs import registry
from sao_jax.envs import sandbox as sandbox_lib

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), 'data', 'code_sample.jsonl')

_FENCE = re.compile(r'```(?:python|py|Python)?[ \t]*\n(.*?)```', re.S)

_HARNESS = r'''
import json as _json, signal as _signal, sys as _sys
_MARK = {mark!r}
_SOURCE = {source!r}
_ENTRY = {entry!r}
_INPUTS = _json.loads({inputs!r})
_ASSERTS = {asserts!r}
_PER_TEST = {per_test!r}
_out = _sys.stdout
def _emit(obj):
  _out.write(_MARK + _json.dumps(obj) + '\n'); _out.flush()
class _Timeout(BaseException):
  pass
def _alarm(signum, frame):
  raise _Timeout('timed out')
_signal.signal(_signal.SIGALRM, _alarm)
def _err(e):
  return (type(e).__name__ + ': ' + str(e))[:300]
def _jsonable(x):
  try:
    return _json.loads(_json.dumps(x))
  except Exception:
    return {{'__repr__': repr(x)[:200]}}
_ns = {{'__name__': '__solution__'}}
try:
  _signal.setitimer(_signal.ITIMER_REAL, 2 * _PER_TEST)
  exec(compile(_SOURCE, '<solution>', 'exec'), _ns)
  _signal.setitimer(_signal.ITIMER_REAL, 0)
except BaseException as e:
  _signal.setitimer(_signal.ITIMER_REAL, 0)
  _emit({{'kind': 'load', 'error': _err(e)}}); raise SystemExit(0)
_fn = _ns.get(_ENTRY)
if _INPUTS and not callable(_fn):
  _emit({{'kind': 'load', 'error': 'no function named ' + _ENTRY}}); raise SystemExit(0)
for _i, _args in enumerate(_INPUTS):
  try:
    _signal.setitimer(_signal.ITIMER_REAL, _PER_TEST)
    _r = _fn(*_args)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'kind': 'io', 'i': _i, 'output': _jsonable(_r)}})
  except BaseException as e:
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'kind': 'io', 'i': _i, 'error': _err(e)}})
for _i, _src in enumerate(_ASSERTS):
  try:
    _signal.setitimer(_signal.ITIMER_REAL, _PER_TEST)
    exec(compile(_src, '<test>', 'exec'), _ns)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'kind': 'assert', 'i': _i, 'ok': True}})
  except BaseException as e:
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'kind': 'assert', 'i': _i, 'error': _err(e)}})
'''


@dataclasses.dataclass(frozen=True)
class CodeOptions:
  """`config.task.kwargs` of code."""
  data_file: str = DEFAULT_DATA  # Problems file (jsonl/json/csv/parquet); default: the shipped sample.
  eval_file: str = ''  # Optional separate eval problems ('' = hold out eval_size problems of data_file).
  prompt_field: str = 'prompt'  # Field with the problem statement.
  entry_point_field: str = 'entry_point'  # Field with the function name.
  tests_field: str = 'tests'  # Field with input/output tests [{"input": [...], "output": ...}].
  asserts_field: str = 'test_list'  # Field with assert-statement tests (MBPP style); either kind suffices.
  id_field: str = 'task_id'  # Field with a problem id ('' or missing = the row number).
  reward: str = 'all'  # 'all' (1 iff every test passes) or 'fraction' (share of tests passed).
  feedback: str = 'inputs'  # After a failed attempt: summary, inputs (+ got) or full (+ expected).
  max_feedback_chars: int = 600  # Cap on the observation text.
  timeout_s: float = 10.0  # Wall-clock limit of one attempt (all its tests).
  per_test_timeout_s: float = 2.0  # Limit of one test (SIGALRM inside the sandbox).
  cpu_s: int = 5  # RLIMIT_CPU of an attempt.
  memory_mb: int = 512  # RLIMIT_AS of an attempt.
  file_size_mb: int = 4  # RLIMIT_FSIZE of an attempt.
  max_procs: int = 32  # RLIMIT_NPROC of the sandbox uid.
  isolation: str = 'auto'  # auto (bwrap if it works), bwrap, unshare or rlimits.
  max_concurrent: int = 4  # Sandboxes running at once.

  def check(self, path: str = 'task.kwargs') -> None:
    registry.check_file(f'{path}.data_file', self.data_file)
    if self.eval_file:
      registry.check_file(f'{path}.eval_file', self.eval_file)
    if self.reward not in ('all', 'fraction'):
      raise ConfigError(f'config.{path}.reward={self.reward!r}: all or fraction.')
    if self.feedback not in ('summary', 'inputs', 'full'):
      raise ConfigError(f'config.{path}.feedback={self.feedback!r}: summary, inputs or full.')
    if self.isolation not in ('auto', 'bwrap', 'unshare', 'rlimits'):
      raise ConfigError(f'config.{path}.isolation={self.isolation!r}: auto, bwrap, unshare or rlimits.')
    for name in ('timeout_s', 'per_test_timeout_s', 'cpu_s', 'memory_mb', 'file_size_mb', 'max_procs',
                 'max_concurrent'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'config.{path}.{name}={getattr(self, name)!r}: must be > 0.')

  def limits(self) -> sandbox_lib.SandboxLimits:
    return sandbox_lib.SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                                     file_size_mb=self.file_size_mb, max_procs=self.max_procs)


def extract_code(text: str) -> str:
  """The last fenced code block of `text`, or all of it when there is none."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def _same(got: Any, want: Any) -> bool:
  """JSON-level equality; floats compare with a 1e-6 tolerance (relative or absolute)."""
  if isinstance(got, bool) or isinstance(want, bool):
    return got is want
  if isinstance(got, (int, float)) and isinstance(want, (int, float)):
    if isinstance(got, float) or isinstance(want, float):
      return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)
    return got == want
  if isinstance(got, list) and isinstance(want, list):
    return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
  if isinstance(got, dict) and isinstance(want, dict):
    return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
  return got == want


@dataclasses.dataclass(frozen=True)
class TestReport:
  passed: int
  total: int
  lines: tuple[str, ...]  # Human-readable failures, in test order.
  load_error: str | None
  timed_out: bool
  stdout: str

  @property
  def all_passed(self) -> bool:
    return self.total > 0 and self.passed == self.total


def run_tests(sandbox: sandbox_lib.Sandbox, source: str, entry_point: str, tests: list[dict[str, Any]],
              asserts: list[str], *, per_test_timeout_s: float = 2.0, feedback: str = 'inputs') -> TestReport:
  """Runs the hidden tests of one attempt in `sandbox` and compares outputs in this (trusted) process."""
  mark = f'@@SAO_{secrets.token_hex(8)}@@'
  program = _HARNESS.format(mark=mark, source=source, entry=entry_point,
                            inputs=json.dumps([t['input'] for t in tests]), asserts=list(asserts),
                            per_test=float(per_test_timeout_s))
  res = sandbox.run(program)
  results: dict[tuple[str, int], dict[str, Any]] = {}
  load_error = None
  user_out = []
  for line in res.stdout.splitlines():
    if line.startswith(mark):
      try:
        rec = json.loads(line[len(mark):])
      except json.JSONDecodeError:
        continue
      if rec.get('kind') == 'load':
        load_error = str(rec.get('error'))
      elif rec.get('kind') in ('io', 'assert') and isinstance(rec.get('i'), int):
        results.setdefault((rec['kind'], rec['i']), rec)
    else:
      user_out.append(line)
  passed, lines = 0, []
  for i, t in enumerate(tests):
    rec = results.get(('io', i))
    call = f'{entry_point}({", ".join(json.dumps(a) for a in t["input"])})'
    if rec is not None and 'output' in rec and _same(rec['output'], t['output']):
      passed += 1
      continue
    if rec is None:
      why = 'did not finish' if res.timed_out or res.returncode != 0 else 'no result'
    elif 'error' in rec:
      why = f'raised {rec["error"]}'
    else:
      why = f'returned {json.dumps(rec["output"])[:100]}'
    if feedback == 'full':
      why += f', expected {json.dumps(t["output"])[:100]}'
    lines.append(f'{call[:150]} {why}' if feedback != 'summary' else why)
  for i, src in enumerate(asserts):
    rec = results.get(('assert', i))
    if rec is not None and rec.get('ok') is True:
      passed += 1
      continue
    why = 'did not finish' if rec is None else rec.get('error', 'failed')
    lines.append(f'{src[:150]}: {why}' if feedback != 'summary' else why)
  return TestReport(passed=passed, total=len(tests) + len(asserts), lines=tuple(lines),
                    load_error=load_error, timed_out=res.timed_out, stdout='\n'.join(user_out)[-2000:])


def feedback_text(report: TestReport, opts: CodeOptions) -> str:
  head = f'{report.passed}/{report.total} tests passed.'
  if report.load_error:
    head += f' Your code failed to load: {report.load_error}'
  elif report.timed_out:
    head += ' The run timed out.'
  if opts.feedback != 'summary' and report.lines:
    head += '\nFailed:\n' + '\n'.join(report.lines[:5])
  return head[:opts.max_feedback_chars]


class CodeEnv(base.BaseEnv):
  """See module docstring."""

  def __init__(self, example: base.Example, opts: CodeOptions, sandbox: sandbox_lib.Sandbox, *,
               max_turns: int):
    super().__init__(example, max_turns=max_turns)
    self.opts = opts
    self.sandbox = sandbox

  def _step(self, action_text: str) -> base.StepResult:
    data = self.example.data
    report = run_tests(self.sandbox, extract_code(action_text), data['entry_point'], list(data['tests']),
                       list(data['asserts']), per_test_timeout_s=self.opts.per_test_timeout_s,
                       feedback=self.opts.feedback)
    frac = report.passed / report.total
    reward = frac if self.opts.reward == 'fraction' else float(report.all_passed)
    info = {'tests_passed': report.passed, 'tests_total': report.total, 'attempt': self.turn,
            'correct': report.all_passed, 'isolation': self.sandbox.isolation}
    if report.all_passed or self.turn >= self.max_turns:
      return base.StepResult(None, reward, True, info)
    return base.StepResult(feedback_text(report, self.opts), 0.0, False, info)


class CodeTask(base.DatasetTask):
  """Sandboxed code problems from a file."""

  def __init__(self, opts: CodeOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    examples = self._load(opts.data_file, 'task.kwargs.data_file')
    evals = self._load(opts.eval_file, 'task.kwargs.eval_file') if opts.eval_file else None
    self._train, self._eval = datasets.split(examples, eval_size, eval_examples=evals)
    self.sandbox = sandbox_lib.Sandbox(opts.limits(), isolation=opts.isolation,
                                       max_concurrent=opts.max_concurrent)

  def _load(self, path: str, field: str) -> list[base.Example]:
    o = self.opts

    def convert(n: int, row: dict[str, Any]) -> base.Example:
      prompt = datasets.text_field(row, o.prompt_field)
      entry = datasets.text_field(row, o.entry_point_field)
      if not entry.isidentifier():
        raise datasets.BadRow(f'entry point {entry!r} is not an identifier')
      tests = row.get(o.tests_field) or []
      asserts = row.get(o.asserts_field) or []
      if isinstance(tests, str):
        try:
          tests = json.loads(tests)
        except json.JSONDecodeError as e:
          raise datasets.BadRow(f'field {o.tests_field!r} is not JSON') from e
      if not isinstance(tests, list) or any(not isinstance(t, dict) or not isinstance(t.get('input'), list)
                                            or 'output' not in t for t in tests):
        raise datasets.BadRow(f'field {o.tests_field!r} must be a list of {{"input": [...], "output": ...}}')
      if not isinstance(asserts, list) or any(not isinstance(a, str) for a in asserts):
        raise datasets.BadRow(f'field {o.asserts_field!r} must be a list of strings')
      if not tests and not asserts:
        raise datasets.BadRow('no tests')
      uid = str(row.get(o.id_field) or f'row{n}')
      text = f'{prompt}\nWrite the Python function `{entry}` in a ```python code block.'
      return base.Example(uid=f'code:{uid}', prompt=text, answer='',
                          data={'entry_point': entry, 'tests': tests, 'asserts': asserts, 'row': n})

    return datasets.build_examples(datasets.read_rows(path, field), convert, path=path, field=field)

  def make_env(self, example: base.Example) -> CodeEnv:
    return CodeEnv(example, self.opts, self.sandbox, max_turns=self.max_turns)


@registry.register_task('code', CodeOptions)
def _make(opts: CodeOptions, *, max_turns: int, eval_size: int) -> CodeTask:
  return CodeTask(opts, max_turns=max_turns, eval_size=eval_size)
