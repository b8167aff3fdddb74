"""The package's rooms depend downward only (docs/design.md, Layout).

Every `import` of every module of `sao_jax` (lazy ones inside functions included) is read with `ast` and
checked against `ALLOWED`: which rooms of the package a room may import, and which third-party packages it
must not. A new top-level room fails here until it is placed in the table, so the layering is a decision,
not an accident.
"""

import ast
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest

PACKAGE = 'sao_jax'
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)

_BASE = {'errors', 'structs', 'losses', 'tokenizers', 'paths'}
_BELOW_LOOP = _BASE | {'envs', 'models', 'parallel', 'generate', 'rollout', 'learner', 'checkpoint', 'metrics',
                       'workdir'}

# room -> rooms of the package it may import (besides itself).
ALLOWED = {
    'errors': set(),
    'structs': set(),
    'losses': set(),
    'paths': set(),  # The one path layer of a run's files (local or gs://).
    'sim': {'errors'},
    'tokenizers': {'errors'},
    'envs': {'errors', 'tokenizers', 'paths'},
    'parallel': {'errors', 'structs'},
    'models': {'errors', 'structs', 'losses', 'parallel', 'tokenizers'},
    'generate': {'errors', 'structs', 'parallel', 'models'},
    'metrics': {'errors', 'parallel', 'paths'},
    'workdir': {'errors', 'parallel', 'paths'},  # The workdir's lock and writability check.
    'checkpoint': {'errors', 'structs', 'models', 'parallel', 'learner', 'paths'},  # contents: a learner's checkpoint.
    'rollout': _BASE | {'envs', 'models', 'parallel', 'generate'},
    'learner': _BASE | {'models', 'parallel'},
    'config_lib': _BELOW_LOOP,
    'eval': _BELOW_LOOP | {'config_lib'},
    'sft': _BELOW_LOOP | {'eval'},
    'trainer': _BELOW_LOOP | {'config_lib', 'eval', 'sft'},
    'main': {'errors', 'config_lib', 'trainer', 'parallel', 'metrics', 'envs', 'tokenizers', 'checkpoint'},
    'benchmarks': _BELOW_LOOP | {'config_lib', 'eval', 'trainer', 'sim'},
    'tools': _BELOW_LOOP | {'config_lib'},
    'experiments': _BELOW_LOOP | {'config_lib', 'eval', 'trainer', 'sim'},
}

_DEVICE_LIBS = {'jax', 'jaxlib', 'flax', 'optax', 'chex', 'orbax', 'tensorstore'}
# room -> third-party top-level packages it must not import.
FORBIDDEN_THIRD_PARTY = {
    'envs': _DEVICE_LIBS,
    'tokenizers': _DEVICE_LIBS,
    'errors': _DEVICE_LIBS,
    'paths': _DEVICE_LIBS,
    'sim': _DEVICE_LIBS,
}


def _room(module: str) -> str:
  """'sao_jax.envs.base' -> 'envs'; 'sao_jax.eval' -> 'eval'."""
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def _modules():
  for dirpath, _, files in os.walk(ROOT):
    for name in sorted(files):
      if name.endswith('.py'):
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, '.')
        if rel.endswith('.__init__'):
          rel = rel[:-len('.__init__')]
        yield rel, path


def _imports(path: str, module: str, is_package: bool):
  """Absolute names of everything `path` imports (lazy imports too); relative imports resolved."""
  with open(path, encoding='utf-8') as f:
    tree = ast.parse(f.read(), path)
  typing_only = set()  # Imports under `if TYPE_CHECKING:` (annotations only: no runtime dependency).
  for node in ast.walk(tree):
    if isinstance(node, ast.If) and 'TYPE_CHECKING' in ast.unparse(node.test):
      typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, node.lineno
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = module.split('.')
        base = base[:len(base) - node.level + (1 if is_package else 0)]
        prefix = '.'.join(base + ([node.module] if node.module else []))
      else:
        prefix = node.module or ''
      yield prefix, node.lineno
      if prefix == PACKAGE:  # `from sao_jax import envs` imports the room `envs`.
        for alias in node.names:
          yield f'{PACKAGE}.{alias.name}', node.lineno


class LayeringTest(absltest.TestCase):

  def test_text_level_rooms_load_no_device_library(self):
    """Importing every module of envs, tokenizers, sim and paths in a fresh interpreter loads no jax or flax."""
    modules = [m for m, _ in _modules() if _room(m) in ('envs', 'tokenizers', 'sim', 'errors', 'paths')]
    code = ('import sys\n' + ''.join(f'import {m}\n' for m in modules) +
            'print(sorted(k for k in sys.modules if k.split(".")[0] in %r))' % sorted(_DEVICE_LIBS))
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(ROOT))
    self.assertEqual(out.stdout.strip(), '[]', out.stderr[-2000:])

  def test_every_room_is_placed(self):
    rooms = {_room(m) for m, _ in _modules()} - {''}
    self.assertEmpty(rooms - set(ALLOWED), 'new rooms of sao_jax: place them in ALLOWED (tests/layering_test.py)')

  def test_rooms_import_downward_only(self):
    bad = []
    for module, path in _modules():
      room = _room(module)
      if not room:
        continue
      for name, line in _imports(path, module, path.endswith('__init__.py')):
        top = name.split('.')[0]
        if top == PACKAGE:
          target = _room(name)
          if target and target != room and target not in ALLOWED.get(room, set()):
            bad.append(f'{path}:{line}: {room} imports {name} ({target} is not below {room})')
        elif top in FORBIDDEN_THIRD_PARTY.get(room, ()):
          bad.append(f'{path}:{line}: {room} imports {name} ({room} must not use {top})')
    self.assertEmpty(bad, '\n'.join(bad))

  def test_the_checker_sees_violations(self):
    """The walker resolves both import forms, so a violation cannot hide behind `from sao_jax import x`."""
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, 'm.py')
      with open(path, 'w', encoding='utf-8') as f:
        f.write('import jax\nfrom sao_jax import trainer\nfrom sao_jax.models import llama\n'
                'def f():\n  from . import sibling\n')
      names = [n for n, _ in _imports(path, 'sao_jax.envs.m', False)]
    self.assertIn('jax', names)
    self.assertIn('sao_jax.trainer', names)
    self.assertIn('sao_jax.models', names)
    self.assertIn('sao_jax.envs', names)


if __name__ == '__main__':
  absltest.main()
