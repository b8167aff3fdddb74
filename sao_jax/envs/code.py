"""`code`: the model writes a Python function; hidden tests call it in the sandbox; up to N attempts.

Problems (JSONL/JSON/CSV/Parquet; field names configurable) carry a prompt, the function name and hidden
tests of two kinds, both decided in this (trusted) process from the VALUES the function returned:
  * input/output tests `{"input": [args...], "output": value}`: compared JSON-wise with `output`;
  * assert tests (MBPP's `test_list`, e.g. `"assert f(2) == (4, 5)"`): each call of the entry point in the
    assert (literal arguments) is run in the sandbox, and the assert's expression is evaluated HERE by a small
    whitelisted evaluator (`_Eval`: literals, comparisons, and/or/not, numeric arithmetic, `abs len sorted set
    ... math.isclose`) with the returned values in place of the calls. An assert that does not fit (a call
    with non-literal arguments, a name other than the entry point) makes its row malformed at load.
The sandbox only runs `f(*args)` and prints each result in a tagged JSON encoding of plain data (`_encode`:
None, bool, int, float, str, bytes, complex, list, tuple, set, dict); expected values never enter it and
nothing it prints can say "passed": an object whose `==` is always true cannot be encoded, and forged records
only claim values the program could have returned. Any output that does not parse (bad JSON, deep nesting,
wrong types) counts as no result: the attempt scores 0, it is never an environment error.
Each attempt's test report is the observation for the next attempt; the episode ends when every test passes
or after `config.task.max_turns` attempts. Reward of the last attempt: 1 if all tests pass, else 0
('all'), or the fraction passed ('fraction').
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
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
from sao_jax.envs import safe_eval
from sao_jax.envs import sandbox as sandbox_lib

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), 'data', 'code_sample.jsonl')

_FENCE = re.compile(r'```(?:python|py|Python)?[ \t]*\n(.*?)```', re.S)
_MAX_DEPTH = 32  # Deepest nesting of an encoded value.
_MAX_INT_BITS = 1 << 14  # Largest int the parent evaluator computes with.


# ------------------------------------------------------------------------------------------------------------
# Values: one tagged JSON encoding of plain data, used by the harness (its source is embedded) and the parent.


def _encode(x, depth=0):
  """Plain data -> JSON-able; `ValueError` on anything else (objects of other types, subclasses, deep nests)."""
  if depth > _MAX_DEPTH:
    raise ValueError('nested too deeply')
  t = type(x)
  if x is None or t is bool or t is int or t is str:
    return x
  if t is float:
    return x if x == x and x not in (float('inf'), float('-inf')) else {'float': repr(x)}
  if t is list:
    return [_encode(y, depth + 1) for y in x]
  if t is tuple:
    return {'tuple': [_encode(y, depth + 1) for y in x]}
  if t is set or t is frozenset:
    return {'set': [_encode(y, depth + 1) for y in x]}
  if t is dict:
    return {'dict': [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in x.items()]}
  if t is bytes:
    return {'bytes': x.hex()}
  if t is complex:
    return {'complex': [_encode(x.real, depth + 1), _encode(x.imag, depth + 1)]}
  raise ValueError('a value of type ' + t.__name__ + ', not plain data')


def _decode(x, depth=0):
  """Inverse of `_encode`; `ValueError` on anything `_encode` cannot produce."""
  if depth > _MAX_DEPTH:
    raise ValueError('nested too deeply')
  t = type(x)
  if x is None or t is bool or t is str:
    return x
  if t is int:
    if x.bit_length() > _MAX_INT_BITS:
      raise ValueError('integer too large')
    return x
  if t is float:
    return x
  if t is list:
    return [_decode(y, depth + 1) for y in x]
  if t is dict and len(x) == 1:
    (tag, v), = x.items()
    if tag == 'float' and v in ('nan', 'inf', '-inf'):
      return float(v)
    if tag == 'bytes' and type(v) is str:
      return bytes.fromhex(v)
    if type(v) is list:
      items = [_decode(y, depth + 1) for y in v]
      if tag == 'tuple':
        return tuple(items)
      if tag == 'set':
        return set(items)  # TypeError on unhashable items.
      if tag == 'complex' and len(items) == 2 and all(type(y) in (int, float) for y in items):
        return complex(*items)
      if tag == 'dict' and all(type(p) is list and len(p) == 2 for p in items):
        return dict((k, v) for k, v in items)
  raise ValueError('not an encoded value')


def _harness(mark: str, source: str, entry: str, calls: list[Any], per_test_s: float) -> str:
  """The program run in the sandbox: load `source`, call `entry` on each encoded argument list, print results."""
  codec = ''.join(inspect.getsource(f) for f in (_encode, _decode))
  return _HARNESS.format(codec=codec, max_depth=_MAX_DEPTH, max_int_bits=_MAX_INT_BITS, mark=mark, source=source,
                         entry=entry, calls=json.dumps(calls), per_test=float(per_test_s))


_HARNESS = r'''
import json as _json, signal as _signal, sys as _sys
_MAX_DEPTH, _MAX_INT_BITS = {max_depth!r}, {max_int_bits!r}
{codec}
_MARK = {mark!r}
_SOURCE = {source!r}
_ENTRY = {entry!r}
_CALLS = _json.loads({calls!r})
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
_ns = {{'__name__': '__solution__'}}
try:
  _signal.setitimer(_signal.ITIMER_REAL, 2 * _PER_TEST)
  exec(compile(_SOURCE, '<solution>', 'exec'), _ns)
  _signal.setitimer(_signal.ITIMER_REAL, 0)
except BaseException as e:
  _signal.setitimer(_signal.ITIMER_REAL, 0)
  _emit({{'k': 'load', 'e': _err(e)}}); raise SystemExit(0)
_fn = _ns.get(_ENTRY)
if not callable(_fn):
  _emit({{'k': 'load', 'e': 'no function named ' + _ENTRY}}); raise SystemExit(0)
for _i, (_args, _kwargs) in enumerate(_CALLS):
  try:
    _signal.setitimer(_signal.ITIMER_REAL, _PER_TEST)
    _r = _fn(*_decode(_args), **_decode(_kwargs))
  except BaseException as e:
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'k': 'call', 'i': _i, 'e': 'raised ' + _err(e)}})
    continue
  try:
    _v = _encode(_r)
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'k': 'call', 'i': _i, 'v': _v}})
  except BaseException as e:
    _signal.setitimer(_signal.ITIMER_REAL, 0)
    _emit({{'k': 'call', 'i': _i, 'e': 'returned ' + _err(e)}})
'''


# ------------------------------------------------------------------------------------------------------------
# Assert tests -> calls of the entry point + an expression evaluated here.


class UnsupportedAssert(ValueError):
  """An assert that cannot be decided from returned values (its row is malformed)."""


def _arith(x: Any) -> bool:
  return type(x) in (int, float, bool, complex)


def _check_int(x: Any) -> Any:
  if type(x) is int and x.bit_length() > _MAX_INT_BITS:
    raise ValueError('integer too large')
  return x


_FUNCS = {'abs': abs, 'len': len, 'sorted': sorted, 'set': set, 'frozenset': frozenset, 'list': list,
          'tuple': tuple, 'round': round, 'min': min, 'max': max, 'sum': sum, 'all': all, 'any': any,
          'bool': bool, 'str': str, 'int': int, 'float': float, 'dict': dict, 'math.isclose': math.isclose}
_MATH_CONSTANTS = {'math.pi': math.pi, 'math.e': math.e, 'math.inf': math.inf, 'math.nan': math.nan}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}
_CMPOPS = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
           ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
           ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b, ast.Is: lambda a, b: a is b,
           ast.IsNot: lambda a, b: a is not b}
_NODES = (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict, ast.UnaryOp, ast.BinOp, ast.BoolOp, ast.Compare,
          ast.Subscript, ast.Slice, ast.IfExp, ast.Call, ast.Name, ast.Attribute, ast.keyword, ast.Load, ast.Not,
          ast.USub, ast.UAdd, ast.And, ast.Or, *_BINOPS, *_CMPOPS)
# Errors that make an assert fail (never an environment error): whatever plain data can raise in `_Eval`.
_EVAL_ERRORS = (UnsupportedAssert, ArithmeticError, TypeError, ValueError, IndexError, KeyError, RecursionError,
                MemoryError)


def _dotted(node: ast.AST) -> str | None:
  if isinstance(node, ast.Name):
    return node.id
  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
    return f'{node.value.id}.{node.attr}'
  return None


class _Eval:
  """Evaluates a whitelisted expression on plain data; `values[id(call)]` stands for an entry-point call.

  Every operation is bounded: arithmetic on numbers only (ints up to `_MAX_INT_BITS` bits, no `**`), builtins
  linear or n log n in their (capped) inputs. Anything else raises `UnsupportedAssert`.
  """

  def __init__(self, values: dict[int, Any]):
    self.values = values

  def __call__(self, node: ast.AST) -> Any:
    if isinstance(node, ast.Call) and id(node) in self.values:
      return self.values[id(node)]
    if isinstance(node, ast.Constant):
      if node.value is Ellipsis:
        raise UnsupportedAssert('...')
      return _check_int(node.value)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
      return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](self(e) for e in node.elts)
    if isinstance(node, ast.Dict):
      if any(k is None for k in node.keys):
        raise UnsupportedAssert('** in a dict')
      return {self(k): self(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
      v = self(node.operand)
      if isinstance(node.op, ast.Not):
        return not v
      if isinstance(node.op, (ast.USub, ast.UAdd)) and _arith(v):
        return -v if isinstance(node.op, ast.USub) else +v
      raise UnsupportedAssert('unary operator on a non-number')
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
      a, b = self(node.left), self(node.right)
      if not (_arith(a) and _arith(b)):
        raise UnsupportedAssert('arithmetic on non-numbers')
      return _check_int(_BINOPS[type(node.op)](a, b))
    if isinstance(node, ast.BoolOp):
      value = None
      for v in node.values:
        value = self(v)
        if bool(value) == isinstance(node.op, ast.Or):
          break
      return value
    if isinstance(node, ast.Compare):
      left = self(node.left)
      for op, comp in zip(node.ops, node.comparators):
        right = self(comp)
        if not _CMPOPS[type(op)](left, right):
          return False
        left = right
      return True
    if isinstance(node, ast.Subscript):
      s = node.slice
      index = (slice(*(None if p is None else self(p) for p in (s.lower, s.upper, s.step)))
               if isinstance(s, ast.Slice) else self(s))
      return self(node.value)[index]
    if isinstance(node, ast.IfExp):
      return self(node.body) if self(node.test) else self(node.orelse)
    name = _dotted(node.func) if isinstance(node, ast.Call) else None
    if name in _FUNCS and not any(isinstance(a, ast.Starred) for a in node.args) and all(
        k.arg is not None for k in node.keywords):
      return _check_int(_FUNCS[name](*[self(a) for a in node.args], **{k.arg: self(k.value)
                                                                        for k in node.keywords}))
    if _dotted(node) in _MATH_CONSTANTS:
      return _MATH_CONSTANTS[_dotted(node)]
    raise UnsupportedAssert(f'{type(node).__name__} {name or _dotted(node) or ""}'.rstrip())


@dataclasses.dataclass(frozen=True)
class AssertCheck:
  """One assert test: the entry-point calls it makes and the expression that decides it (`decide`)."""
  source: str
  expr: ast.expr
  call_nodes: tuple[ast.Call, ...]
  calls: tuple[tuple[list[Any], dict[str, Any]], ...]  # (args, kwargs) of each call, plain data.

  def decide(self, results: list[Any]) -> bool:
    """The assert's truth with `results[i]` returned by the i-th call, evaluated here; False on any error."""
    try:
      return bool(_Eval({id(n): r for n, r in zip(self.call_nodes, results)})(self.expr))
    except _EVAL_ERRORS:
      return False


@functools.lru_cache(maxsize=4096)
def parse_assert(src: str, entry: str) -> AssertCheck:
  """`assert EXPR` calling `entry` with plain-data arguments -> an `AssertCheck`.

  Raises:
    UnsupportedAssert: not one assert statement, no call of `entry`, a call with non-literal arguments, or a
      node / name / function `_Eval` does not know.
  """
  try:
    with safe_eval.PARSE_LOCK:  # Not thread-safe on CPython 3.11 (`safe_eval.PARSE_LOCK`).
      tree = ast.parse(src.strip())
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise UnsupportedAssert(f'not Python ({type(e).__name__})') from None
  if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
    raise UnsupportedAssert('not a single assert statement')
  expr = tree.body[0].test
  names = {entry, 'math', *(f for f in _FUNCS if '.' not in f)}
  for node in ast.walk(expr):
    if not isinstance(node, _NODES):
      raise UnsupportedAssert(type(node).__name__)
    if isinstance(node, ast.Name) and node.id not in names:
      raise UnsupportedAssert(f'name {node.id!r}')
    if isinstance(node, ast.Attribute) and _dotted(node) not in {*_FUNCS, *_MATH_CONSTANTS}:
      raise UnsupportedAssert(f'attribute {node.attr!r}')
    if isinstance(node, ast.Call) and _dotted(node.func) not in {entry, *_FUNCS}:
      raise UnsupportedAssert(f'call of {_dotted(node.func) or "an expression"}')
  call_nodes = tuple(n for n in ast.walk(expr) if isinstance(n, ast.Call) and _dotted(n.func) == entry)
  if not call_nodes:
    raise UnsupportedAssert(f'no call of {entry}')
  literal = _Eval({})  # Arguments: plain values (a nested call of the entry point is not one).
  calls = []
  for n in call_nodes:
    try:
      if any(isinstance(a, ast.Starred) for a in n.args) or any(k.arg is None for k in n.keywords):
        raise UnsupportedAssert('*args or **kwargs')
      args, kwargs = [literal(a) for a in n.args], {k.arg: literal(k.value) for k in n.keywords}
      _encode(args), _encode(kwargs)
    except _EVAL_ERRORS as e:
      raise UnsupportedAssert(f'arguments of {entry}: {e}') from None
    calls.append((args, kwargs))
  return AssertCheck(src, expr, call_nodes, tuple(calls))


# ------------------------------------------------------------------------------------------------------------
# The task.


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
  tmpfs_mb: int = 16  # Size of each writable tmpfs of the sandbox (/tmp and /dev/shm).
  isolation: str = 'bwrap'  # bwrap (required), or a weaker mode by name: unshare, rlimits (see sandbox.WEAKER).
  max_concurrent: int = 4  # Sandboxes running at once.

  def check(self, path: str = 'task.kwargs') -> None:
    registry.check_file(f'{path}.data_file', self.data_file)
    if self.eval_file:
      registry.check_file(f'{path}.eval_file', self.eval_file)
    if self.reward not in ('all', 'fraction'):
      raise ConfigError(f'config.{path}.reward={self.reward!r}: all or fraction.')
    if self.feedback not in ('summary', 'inputs', 'full'):
      raise ConfigError(f'config.{path}.feedback={self.feedback!r}: summary, inputs or full.')
    if self.isolation not in sandbox_lib.ISOLATIONS:
      raise ConfigError(f'config.{path}.isolation={self.isolation!r}: one of {sandbox_lib.ISOLATIONS} (bwrap '
                        'unless a weaker mode is asked for by name).')
    for name in ('timeout_s', 'per_test_timeout_s', 'cpu_s', 'memory_mb', 'file_size_mb', 'max_procs',
                 'tmpfs_mb', 'max_concurrent'):
      if getattr(self, name) <= 0:
        raise ConfigError(f'config.{path}.{name}={getattr(self, name)!r}: must be > 0.')

  def limits(self) -> sandbox_lib.SandboxLimits:
    return sandbox_lib.SandboxLimits(timeout_s=self.timeout_s, cpu_s=self.cpu_s, memory_mb=self.memory_mb,
                                     file_size_mb=self.file_size_mb, max_procs=self.max_procs,
                                     tmpfs_mb=self.tmpfs_mb)


def extract_code(text: str) -> str:
  """The last fenced code block of `text`, or all of it when there is none."""
  blocks = _FENCE.findall(text)
  return blocks[-1] if blocks else text


def _same(got: Any, want: Any) -> bool:
  """JSON-level equality (tuples read as lists); floats compare with a 1e-6 tolerance (relative or absolute)."""
  if isinstance(got, bool) or isinstance(want, bool):
    return got is want
  if isinstance(got, (int, float)) and isinstance(want, (int, float)):
    if isinstance(got, float) or isinstance(want, float):
      return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6)
    return got == want
  if isinstance(got, (list, tuple)) and isinstance(want, list):
    return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
  if isinstance(got, dict) and isinstance(want, dict):
    return got.keys() == want.keys() and all(_same(got[k], want[k]) for k in got)
  return type(got) is type(want) and got == want


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


def parse_results(stdout: str, mark: str, num_calls: int) -> tuple[dict[int, tuple[str, Any]], str | None, str]:
  """The harness's records in `stdout`: ({call: ('value', v) | ('error', text)}, load error, other output).

  Total: a line that does not parse (bad JSON, nesting too deep, a wrong type, an unknown record, a value
  `_decode` rejects) is ignored or counts as an unreadable value; nothing here raises.
  """
  results: dict[int, tuple[str, Any]] = {}
  load_error, other = None, []
  for line in stdout.splitlines():
    if not line.startswith(mark):
      other.append(line)
      continue
    try:
      rec = json.loads(line[len(mark):])
    except (ValueError, RecursionError):
      continue
    if not isinstance(rec, dict):
      continue
    if rec.get('k') == 'load' and load_error is None:
      load_error = str(rec.get('e'))[:300]
    i = rec.get('i')
    if rec.get('k') != 'call' or type(i) is not int or not 0 <= i < num_calls or i in results:
      continue
    if 'v' in rec:
      try:
        results[i] = ('value', _decode(rec['v']))
      except (ValueError, TypeError, RecursionError):
        results[i] = ('error', 'returned a value that cannot be read back')
    else:
      results[i] = ('error', str(rec.get('e'))[:300])  # 'raised ...' or 'returned ...' (not plain data).
  return results, load_error, '\n'.join(other)[-2000:]


def _shown(value: Any) -> str:
  try:
    return json.dumps(value)[:100] if not isinstance(value, (tuple, set, bytes, complex)) else repr(value)[:100]
  except (TypeError, ValueError):
    return repr(value)[:100]


def run_tests(sandbox: sandbox_lib.Sandbox, source: str, entry_point: str, tests: list[dict[str, Any]],
              asserts: list[str], *, per_test_timeout_s: float = 2.0, feedback: str = 'inputs') -> TestReport:
  """Runs the calls of one attempt's hidden tests in `sandbox`; decides every test here from the values."""
  checks = [parse_assert(a, entry_point) for a in asserts]
  calls = [(t['input'], {}) for t in tests] + [c for check in checks for c in check.calls]
  mark = f'@@SAO_{secrets.token_hex(8)}@@'
  res = sandbox.run(_harness(mark, source, entry_point, [[_encode(list(a)), _encode(k)] for a, k in calls],
                             per_test_timeout_s))
  results, load_error, user_out = parse_results(res.stdout, mark, len(calls))
  missing = 'did not finish' if res.timed_out or res.returncode != 0 else 'no result'
  passed, lines = 0, []
  for i, t in enumerate(tests):
    kind, got = results.get(i, ('error', missing))
    if kind == 'value' and _same(got, t['output']):
      passed += 1
      continue
    why = f'returned {_shown(got)}' if kind == 'value' else got
    if feedback == 'full':
      why += f', expected {json.dumps(t["output"])[:100]}'
    call = f'{entry_point}({", ".join(json.dumps(a) for a in t["input"])})'
    lines.append(f'{call[:150]} {why}' if feedback != 'summary' else why)
  first = len(tests)
  for check in checks:
    got = [results.get(first + j, ('error', missing)) for j in range(len(check.calls))]
    first += len(check.calls)
    errors = [v for k, v in got if k != 'value']
    if not errors and check.decide([v for _, v in got]):
      passed += 1
      continue
    why = errors[0] if errors else 'failed'
    lines.append(f'{check.source[:150]}: {why}' if feedback != 'summary' else why)
  return TestReport(passed=passed, total=len(tests) + len(checks), lines=tuple(lines),
                    load_error=load_error, timed_out=res.timed_out, stdout=user_out)


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
    self.file_reports = []
    self._train, self._eval = datasets.load_split(opts.data_file, opts.eval_file, eval_size, self._example,
                                                  self.file_reports)
    try:
      self.sandbox = sandbox_lib.Sandbox(opts.limits(), isolation=opts.isolation,
                                         max_concurrent=opts.max_concurrent)
    except sandbox_lib.SandboxError as e:
      raise ConfigError(f'config.task.kwargs.isolation={opts.isolation!r}: {e}') from e

  def _example(self, n: int, row: dict[str, Any]) -> base.Example:
    """One data row's `Example` (a malformed row raises `datasets.BadRow`)."""
    o = self.opts
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
    for a in asserts:
      try:
        parse_assert(a, entry)
      except UnsupportedAssert as e:
        raise datasets.BadRow(f'assert {a[:80]!r} cannot be decided from returned values: {e}') from None
    uid = str(row.get(o.id_field) or f'row{n}')
    text = f'{prompt}\nWrite the Python function `{entry}` in a ```python code block.'
    return base.Example(uid=f'code:{uid}', prompt=text, answer='',
                        data={'entry_point': entry, 'tests': tests, 'asserts': asserts})

  def make_env(self, example: base.Example) -> CodeEnv:
    return CodeEnv(example, self.opts, self.sandbox, max_turns=self.max_turns)


@registry.register_task('code', CodeOptions)
def _make(opts: CodeOptions, *, max_turns: int, eval_size: int) -> CodeTask:
  return CodeTask(opts, max_turns=max_turns, eval_size=eval_size)
