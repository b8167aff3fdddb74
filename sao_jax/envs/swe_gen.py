"""Generator of the shipped synthetic SWE-style instances (`data/swe_synthetic.jsonl`), seeded.

    python -m sao_jax.envs.swe_gen --seed=0 --num=40 --out=sao_jax/envs/data/swe_synthetic.jsonl

Each instance is a small package (two modules of a few functions, `tests/` with one visible test per function)
in which ONE function carries a seeded bug: a single-token mutation of its correct source (a comparison, an
arithmetic operator, an integer constant, `and`/`or`) found by walking its AST. A mutation is kept only when
some of the function's cases fail under it (those become the hidden FAIL_TO_PASS test, added to the module's
test file by `test_patch`) and the rest pass (they stay in the visible test, PASS_TO_PASS with every other
visible test). The gold `patch` undoes the mutation. The problem statement quotes the shortest failing call,
what it gives and what it should give, and the function's docstring. Cases are evaluated by running the generator's
own (trusted) sources in this process, each call under a 0.1 s alarm (a mutation that loops fails that case).

Rows are SWE-bench-format (`sao_jax.envs.swe_data`) with the repository inline (`repo_files`); a row is the same
for the same seed and library (tests/envs/swe_test.py regenerates the shipped file and compares).
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np

from sao_jax.envs import swe_data

DEFAULT_OUT = os.path.join(os.path.dirname(__file__), 'data', 'swe_synthetic.jsonl')
SEED, NUM = 0, 40  # The shipped file's draw.

# ---- The library: packages of modules; each function has cases (argument tuples) whose expected values are
# what the correct source returns.

_LIBRARY: dict[str, dict[str, str]] = {
    'textkit': {
        'strings': '''\
"""String helpers."""


def slugify(text):
  """Lowercase words of `text` joined by single hyphens."""
  words = [w for w in text.lower().split() if w]
  return '-'.join(words)


def truncate(text, width):
  """`text` cut to at most `width` characters, ending with '...' when cut."""
  if len(text) <= width:
    return text
  return text[:max(width - 3, 0)] + '...'


def count_vowels(text):
  """Number of vowels (a, e, i, o, u, either case) in `text`."""
  return sum(1 for c in text.lower() if c in 'aeiou')


def is_palindrome(text):
  """Whether the letters of `text`, case ignored, read the same both ways."""
  letters = [c for c in text.lower() if c.isalpha()]
  return letters == letters[::-1]
''',
        'wrap': '''\
"""Line wrapping."""


def wrap_words(text, width):
  """Greedy wrap of the words of `text` into lines of at most `width` characters."""
  lines, line = [], ''
  for word in text.split():
    if line and len(line) + 1 + len(word) > width:
      lines.append(line)
      line = word
    else:
      line = word if not line else line + ' ' + word
  if line:
    lines.append(line)
  return lines


def pad_left(text, width, fill=' '):
  """`text` padded on the left with `fill` up to `width` characters."""
  missing = width - len(text)
  return fill * missing + text if missing > 0 else text


def center(text, width):
  """`text` centred in `width` characters (an odd extra space goes right)."""
  total = max(width - len(text), 0)
  left = total // 2
  return ' ' * left + text + ' ' * (total - left)
''',
    },
    'numkit': {
        'stats': '''\
"""Descriptive statistics."""


def mean(xs):
  """Arithmetic mean of a non-empty list."""
  return sum(xs) / len(xs)


def median(xs):
  """Median of a non-empty list (mean of the two middle values for an even length)."""
  s = sorted(xs)
  n = len(s)
  mid = n // 2
  if n % 2 == 1:
    return s[mid]
  return (s[mid - 1] + s[mid]) / 2


def value_range(xs):
  """Largest minus smallest value of a non-empty list."""
  return max(xs) - min(xs)


def variance(xs):
  """Population variance of a non-empty list."""
  m = sum(xs) / len(xs)
  return sum((x - m) ** 2 for x in xs) / len(xs)
''',
        'arith': '''\
"""Integer arithmetic."""


def clamp(x, lo, hi):
  """`x` limited to the interval [lo, hi]."""
  if x < lo:
    return lo
  if x > hi:
    return hi
  return x


def is_prime(n):
  """Whether the integer `n` is prime."""
  if n < 2:
    return False
  d = 2
  while d * d <= n:
    if n % d == 0:
      return False
    d += 1
  return True


def digit_sum(n):
  """Sum of the decimal digits of the integer `n` (sign ignored)."""
  n = abs(n)
  total = 0
  while n > 0:
    total += n % 10
    n //= 10
  return total


def gcd(a, b):
  """Greatest common divisor of two non-negative integers."""
  while b != 0:
    a, b = b, a % b
  return a
''',
    },
    'listkit': {
        'seqs': '''\
"""Sequence helpers."""


def chunk(xs, size):
  """`xs` split into consecutive lists of `size` items (the last may be shorter)."""
  return [xs[i:i + size] for i in range(0, len(xs), size)]


def dedupe(xs):
  """`xs` without repeated items, first occurrences kept in order."""
  seen, out = set(), []
  for x in xs:
    if x not in seen:
      seen.add(x)
      out.append(x)
  return out


def rotate(xs, k):
  """`xs` rotated left by `k` places."""
  if not xs:
    return []
  k = k % len(xs)
  return xs[k:] + xs[:k]


def running_sum(xs):
  """Prefix sums of `xs`."""
  out, total = [], 0
  for x in xs:
    total += x
    out.append(total)
  return out
''',
        'search': '''\
"""Searching sorted and unsorted lists."""


def binary_search(xs, target):
  """Index of `target` in the sorted list `xs`, or -1."""
  lo, hi = 0, len(xs) - 1
  while lo <= hi:
    mid = (lo + hi) // 2
    if xs[mid] == target:
      return mid
    if xs[mid] < target:
      lo = mid + 1
    else:
      hi = mid - 1
  return -1


def argmax(xs):
  """Index of the first largest item of a non-empty list."""
  best = 0
  for i in range(1, len(xs)):
    if xs[i] > xs[best]:
      best = i
  return best


def count_between(xs, lo, hi):
  """Number of items x of `xs` with lo <= x < hi."""
  return sum(1 for x in xs if lo <= x and x < hi)
''',
    },
}

_CASES: dict[str, list[tuple]] = {
    'slugify': [('Hello World',), ('  Many   spaces here ',), ('one',), ('A B C',)],
    'truncate': [('hello', 10), ('hello world', 8), ('abcdef', 6), ('abcdefg', 6), ('abc', 2)],
    'count_vowels': [('banana',), ('AEIOU xyz',), ('rhythm',), ('Queueing',)],
    'is_palindrome': [('Racecar',), ('A man, a plan, a canal: Panama',), ('python',), ('ab',), ('',)],
    'wrap_words': [('the quick brown fox', 10), ('a b c d', 3), ('word', 2), ('aa bb cc', 5), ('', 4)],
    'pad_left': [('7', 3, '0'), ('abc', 2, ' '), ('x', 1, '-'), ('42', 5, '*')],
    'center': [('ab', 6), ('abc', 6), ('toolong', 3), ('x', 4)],
    'mean': [([1, 2, 3, 4],), ([5],), ([2, 2, 8],), ([-1, 1, 3],)],
    'median': [([3, 1, 2],), ([4, 1, 3, 2],), ([7],), ([10, 2, 8, 4, 6, 12],)],
    'value_range': [([3, 9, 1],), ([5],), ([-2, 4, 0],)],
    'variance': [([1, 2, 3, 4],), ([5, 5, 5],), ([0, 10],)],
    'clamp': [(5, 0, 10), (-3, 0, 10), (12, 0, 10), (0, 0, 10), (10, 0, 10)],
    'is_prime': [(2,), (9,), (13,), (1,), (25,), (29,), (4,)],
    'digit_sum': [(123,), (-45,), (0,), (9,), (1000,)],
    'gcd': [(12, 18), (7, 3), (0, 5), (5, 0), (100, 75)],
    'chunk': [([1, 2, 3, 4, 5], 2), ([1, 2, 3], 3), ([], 4), ([1, 2, 3, 4], 1)],
    'dedupe': [([1, 2, 1, 3, 2],), ([],), (['a', 'a'],), ([3, 2, 1],)],
    'rotate': [([1, 2, 3, 4], 1), ([1, 2, 3], 3), ([1, 2, 3], 5), ([], 2), ([1, 2], 0)],
    'running_sum': [([1, 2, 3],), ([],), ([5, -5, 5],), ([0, 0, 1],)],
    'binary_search': [([1, 3, 5, 7], 5), ([1, 3, 5, 7], 1), ([1, 3, 5, 7], 7), ([1, 3, 5, 7], 4), ([], 1), ([2], 2)],
    'argmax': [([1, 5, 3],), ([4, 4, 1],), ([9],), ([1, 2, 3],)],
    'count_between': [([1, 2, 3, 4, 5], 2, 4), ([0, 10], 0, 10), ([5, 5, 6], 5, 6), ([], 0, 1)],
}

_CMP_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
              ast.NotEq: ast.Eq}
_BIN_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.FloorDiv: ast.Div, ast.Div: ast.FloorDiv,
              ast.Mod: ast.FloorDiv, ast.Mult: ast.Add}


@dataclasses.dataclass(frozen=True)
class Mutation:
  """A single-node edit of a module's source: `source[start:end]` becomes `text` (one line)."""
  function: str
  line: int
  start: int  # Offset into the module source.
  end: int
  text: str
  kind: str

  def apply(self, source: str) -> str:
    return source[:self.start] + self.text + source[self.end:]


def _offset(source: str, line: int, col: int) -> int:
  lines = source.splitlines(keepends=True)
  return sum(len(l) for l in lines[:line - 1]) + len(lines[line - 1].encode()[:col].decode())


def _mutants(node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
  """Single-token variants of `node` (kind named)."""
  if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP_SWAPS:
    m = copy.deepcopy(node)
    m.ops = [_CMP_SWAPS[type(node.ops[0])]()]
    yield m, 'comparison'
  if isinstance(node, ast.BinOp) and type(node.op) in _BIN_SWAPS:
    m = copy.deepcopy(node)
    m.op = _BIN_SWAPS[type(node.op)]()
    yield m, 'operator'
  if isinstance(node, ast.Constant) and type(node.value) is int and node.value in (0, 1, 2, 3, 10):
    for delta in (1, -1):
      if node.value + delta >= 0:
        yield ast.Constant(node.value + delta), 'constant'
  if isinstance(node, ast.BoolOp):
    m = copy.deepcopy(node)
    m.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    yield m, 'boolean'


def mutations(source: str) -> list[Mutation]:
  """Every single-line single-node mutation of the functions of a module source, in source order."""
  out = []
  for fn in ast.parse(source).body:
    if not isinstance(fn, ast.FunctionDef):
      continue
    body = fn.body[1:] if ast.get_docstring(fn) else fn.body
    for stmt in body:
      for node in ast.walk(stmt):
        if not hasattr(node, 'lineno') or node.lineno != node.end_lineno:
          continue
        start = _offset(source, node.lineno, node.col_offset)
        end = _offset(source, node.end_lineno, node.end_col_offset)
        for mutant, kind in _mutants(node):
          text = ast.unparse(mutant)
          if not _binds_as(source[:start] + text + source[end:], node, mutant):
            text = f'({text})'
          if text != source[start:end]:
            out.append(Mutation(fn.name, node.lineno, start, end, text, kind))
  return out


def _binds_as(source: str, node: ast.AST, mutant: ast.AST) -> bool:
  """Whether `source` parses with `mutant` where `node` was (no parentheses needed around the new text)."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return False
  return any(type(n) is type(mutant) and getattr(n, 'lineno', None) == node.lineno
             and n.col_offset == node.col_offset and ast.dump(n) == ast.dump(mutant) for n in ast.walk(tree))


_CALL_TIMEOUT_S = 0.1  # A library call takes microseconds; a mutation that loops is cut here.


class _Timeout(Exception):
  pass


def _call(namespace: dict[str, Any], name: str, args: tuple) -> tuple[str, Any]:
  """('value', v) or ('raise', exception name) of `name(*args)`, under a `_CALL_TIMEOUT_S` alarm (main thread only)."""
  def alarm(signum, frame):
    raise _Timeout
  old = signal.signal(signal.SIGALRM, alarm)
  signal.setitimer(signal.ITIMER_REAL, _CALL_TIMEOUT_S)
  try:
    return 'value', namespace[name](*copy.deepcopy(args))
  except _Timeout:
    return 'raise', 'timeout'
  except Exception as e:  # pylint: disable=broad-except  (the generator's own code, mutated)
    return 'raise', type(e).__name__
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, old)


def _load(source: str) -> dict[str, Any]:
  namespace: dict[str, Any] = {}
  exec(compile(source, '<library>', 'exec'), namespace)  # pylint: disable=exec-used  (trusted library)
  return namespace


def _call_text(name: str, args: tuple) -> str:
  return f'{name}({", ".join(repr(a) for a in args)})'


def _test_file(package: str, module: str, source: str, cases: dict[str, list[tuple[tuple, Any]]]) -> str:
  names = [fn.name for fn in ast.parse(source).body if isinstance(fn, ast.FunctionDef)]
  lines = [f'from {package}.{module} import {", ".join(names)}']
  for name in names:
    if not cases.get(name):
      continue
    lines += ['', '', f'def test_{name}():']
    lines += [f'  assert {_call_text(name, args)} == {want!r}' for args, want in cases[name]]
  return '\n'.join(lines) + '\n'


@dataclasses.dataclass(frozen=True)
class _Candidate:
  package: str
  module: str
  mutation: Mutation
  failing: tuple[tuple[tuple, Any, tuple[str, Any]], ...]  # (args, expected, (kind, got)).
  passing: tuple[tuple[tuple, Any], ...]


def candidates() -> list[_Candidate]:
  """Every kept mutation of the library (module docstring), in library order."""
  out = []
  for package, modules in _LIBRARY.items():
    for module, source in modules.items():
      good = _load(source)
      for mut in mutations(source):
        try:
          bad = _load(mut.apply(source))
        except SyntaxError:
          continue
        failing, passing = [], []
        for args in _CASES[mut.function]:
          kind, want = _call(good, mut.function, args)
          assert kind == 'value', (mut.function, args, want)
          got = _call(bad, mut.function, args)
          if got[0] == 'value' and got[1] == want:  # As the test's `assert f(...) == want` decides.
            passing.append((args, want))
          else:
            failing.append((args, want, got))
        if failing and passing:
          out.append(_Candidate(package, module, mut, tuple(failing), tuple(passing)))
  return out


def _statement(c: _Candidate) -> str:
  """The issue: the shortest failing call, what it gives and what it should give, and the function's docstring."""
  fn = c.mutation.function
  doc = ast.get_docstring(next(f for f in ast.parse(_LIBRARY[c.package][c.module]).body
                               if isinstance(f, ast.FunctionDef) and f.name == fn)) or ''
  texts = []
  for args, want, (kind, got) in c.failing:
    seen = f'raises {got}' if kind == 'raise' else f'returns {got!r}'
    texts.append(f'{_call_text(fn, args)} {seen}, but it should return {want!r}.')
  return f'{min(texts, key=len)}\n\n{c.package}.{c.module}.{fn}: {doc}'


def make_instance(c: _Candidate, index: int) -> dict[str, Any]:
  """The SWE-bench-format row of one candidate (repository inline)."""
  package, fn = c.package, c.mutation.function
  repo, fixed = {f'{package}/__init__.py': f'"""{package}."""\n'}, {}
  hidden_tests = {}
  p2p = []
  for module, source in _LIBRARY[package].items():
    good = _load(source)
    cases = {name: [(args, _call(good, name, args)[1]) for args in _CASES[name]]
             for name in _CASES if name in good and callable(good[name])}
    src = c.mutation.apply(source) if module == c.module else source
    repo[f'{package}/{module}.py'] = src
    fixed[f'{package}/{module}.py'] = source
    test_path = f'tests/test_{module}.py'
    if module == c.module:
      cases[fn] = list(c.passing)
    repo[test_path] = _test_file(package, module, source, cases)
    p2p += [f'{test_path}::test_{name}' for name in cases if cases[name]]
    if module == c.module:
      hidden_tests[test_path] = repo[test_path] + '\n\ndef test_{}_regression():\n{}'.format(
          fn, ''.join(f'  assert {_call_text(fn, args)} == {want!r}\n' for args, want, _ in c.failing))
  repo['tests/__init__.py'] = ''
  fixed_repo = {**repo, **fixed}
  tests_after = {**repo, **hidden_tests}
  return {
      'instance_id': f'synthetic__{package}-{index:03d}',
      'repo': f'synthetic/{package}',
      'base_commit': '',
      'problem_statement': _statement(c),
      'patch': swe_data.make_patch(repo, fixed_repo),
      'test_patch': swe_data.make_patch(repo, tests_after),
      'FAIL_TO_PASS': [f'tests/test_{c.module}.py::test_{fn}_regression'],
      'PASS_TO_PASS': p2p,
      'repo_files': repo,
      'bug': {'function': fn, 'kind': c.mutation.kind, 'line': c.mutation.line},
  }


def generate(seed: int, num: int, *, per_function: int = 4) -> list[dict[str, Any]]:
  """`num` instances: at most `per_function` mutations of each function, drawn in the order of
  `np.random.default_rng(seed)`'s permutation of the candidates, each with a problem statement of its own
  (a mutation whose statement repeats an earlier one's is passed over).

  Raises:
    ValueError: the library has fewer than `num` usable mutations under `per_function`.
  """
  pool = candidates()
  order = np.random.default_rng(seed).permutation(len(pool))
  taken: dict[str, int] = {}
  chosen = []
  statements = set()
  for i in order:
    c = pool[int(i)]
    statement = ' '.join(_statement(c).split()).lower()  # As `datasets` compares prompts.
    if taken.get(c.mutation.function, 0) < per_function and statement not in statements:
      taken[c.mutation.function] = taken.get(c.mutation.function, 0) + 1
      statements.add(statement)
      chosen.append(c)
    if len(chosen) == num:
      break
  if len(chosen) < num:
    raise ValueError(f'Only {len(chosen)} instances with per_function={per_function}; asked for {num}.')
  return [make_instance(c, k) for k, c in enumerate(chosen)]


def write_jsonl(rows: list[dict[str, Any]], path: str) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    for row in rows:
      f.write(json.dumps(row, sort_keys=True) + '\n')


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  parser.add_argument('--seed', type=int, default=SEED, help='Seed of the draw.')
  parser.add_argument('--num', type=int, default=NUM, help='Number of instances.')
  parser.add_argument('--out', default=DEFAULT_OUT, help='Output JSONL file.')
  args = parser.parse_args(argv)
  rows = generate(args.seed, args.num)
  write_jsonl(rows, args.out)
  print(f'{len(rows)} instances -> {args.out}')


if __name__ == '__main__':
  main()
