"""No two modules the suite imports define the same absl flag.

pytest runs every test file of a worker in one process, so the flags of every module a test imports (directly or
through the package's own imports, lazy ones included) share one `flags.FLAGS`: two modules defining one name
fail the whole file's collection with `DuplicateFlagError` (CI went red on `--seed`, defined by
`benchmarks.moe` and once by `tools.compare_evals`). Read with `ast`, nothing imported: the flags a module
defines at import (outside functions and its `if __name__ == '__main__':` block) and the modules it imports.
A command's flags belong in the module that is run; tests import the flag-free module holding its logic (as
`benchmarks.attention_programs` beside `benchmarks.attention`).
"""

import ast
import collections
import os

from absl.testing import absltest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ('sao_jax', 'experiments', 'configs', 'tests')


def _path(module: str) -> str | None:
  """The file of a module of this repository, or None (third-party)."""
  if module.split('.')[0] not in PACKAGES:
    return None
  base = os.path.join(ROOT, *module.split('.'))
  for path in (base + '.py', os.path.join(base, '__init__.py')):
    if os.path.exists(path):
      return path
  return None


def _is_main_block(node: ast.stmt) -> bool:
  return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
          and isinstance(node.test.left, ast.Name) and node.test.left.id == '__name__')


def _import_time_nodes(tree: ast.Module):
  """Nodes run when the module is imported: its body, less function / class bodies and the main block."""
  stack = [n for n in tree.body if not _is_main_block(n)]
  while stack:
    node = stack.pop()
    yield node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      stack.extend(ast.iter_child_nodes(node))


def _scan(path: str) -> tuple[set[str], set[str]]:
  """(flag names the module defines at import, repository modules it imports anywhere)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  flags = set()
  for node in _import_time_nodes(tree):
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith('DEFINE') and node.args and isinstance(node.args[0], ast.Constant)):
      flags.add(node.args[0].value)
  imports = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      imports.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      imports.add(node.module)
      imports.update(f'{node.module}.{a.name}' for a in node.names)  # `from pkg import module`.
  return flags, {m for m in imports if _path(m)}


class FlagsTest(absltest.TestCase):

  def test_the_modules_the_tests_import_define_each_flag_once(self):
    scans: dict[str, tuple[set[str], set[str]]] = {}

    def scan(module):
      if module not in scans:
        scans[module] = _scan(_path(module))
      return scans[module]

    todo = []
    for d, _, files in os.walk(os.path.join(ROOT, 'tests')):
      for f in files:
        if f.endswith('.py'):
          rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3]
          todo.append(rel.replace(os.sep, '.').removesuffix('.__init__'))
    seen = set()
    while todo:
      module = todo.pop()
      if module not in seen:
        seen.add(module)
        todo.extend(scan(module)[1])
    definers = collections.defaultdict(list)
    for module in sorted(seen):
      for name in scan(module)[0]:
        definers[name].append(module)
    self.assertGreater(len(definers), 0)  # The scan sees flags at all (benchmarks the tests import define some).
    clashes = {name: mods for name, mods in definers.items() if len(mods) > 1}
    self.assertEqual(clashes, {}, 'flags defined by more than one module the tests import')


if __name__ == '__main__':
  absltest.main()
