"""Task registry: `get_task(config.task)` builds a registered task; `validate_task_config` checks it at start.

A task module registers a factory with `@register_task('name', Options)` where `Options` is a frozen
dataclass of the task's `config.task.kwargs` (defaults on the fields). Unknown kwargs, wrong types and
missing files fail at start with a `ConfigError` naming the field (`config.task.kwargs.<key>`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import types as pytypes
import typing
from collections.abc import Callable, Mapping
from typing import Any

import ml_collections

from sao_jax.errors import ConfigError
from sao_jax.envs import base

# Built-in tasks and the module that registers each (imported lazily, so `import sao_jax.envs` stays light).
_BUILTIN_MODULES = {
    'arith': 'sao_jax.envs.arith',
    'arith_words': 'sao_jax.envs.arith_words',
    'calculator': 'sao_jax.envs.calculator',
    'code': 'sao_jax.envs.code',
    'math': 'sao_jax.envs.math_task',
    'drift': 'sao_jax.envs.drift',
    'latency': 'sao_jax.envs.latency',
    'swe': 'sao_jax.envs.swe',
}


@dataclasses.dataclass(frozen=True)
class _Entry:
  factory: Callable[..., base.Task]
  options: type
  min_turns: int = 1


_REGISTRY: dict[str, _Entry] = {}


def register_task(name: str, options: type, *, min_turns: int = 1
                  ) -> Callable[[Callable[..., base.Task]], Callable[..., base.Task]]:
  """Registers `factory(options_instance, *, max_turns, eval_size) -> Task` under `name`.

  `options` is the dataclass of the task's `config.task.kwargs`; `min_turns` the least `config.task.max_turns`
  the task can work with.
  """
  if not dataclasses.is_dataclass(options):
    raise TypeError(f'Options of task {name!r} must be a dataclass, got {options!r}.')

  def deco(factory):
    _REGISTRY[name] = _Entry(factory, options, min_turns)
    return factory
  return deco


def _entry(name: str) -> _Entry:
  if name not in _REGISTRY and name in _BUILTIN_MODULES:
    importlib.import_module(_BUILTIN_MODULES[name])
  if name not in _REGISTRY:
    raise ConfigError(f'config.task.name={name!r} is not a registered task; known: '
                      f'{sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))}.')
  return _REGISTRY[name]


def task_names() -> list[str]:
  return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def _to_plain(value: Any) -> Any:
  if isinstance(value, ml_collections.ConfigDict):
    return {k: _to_plain(v) for k, v in value.items()}
  if isinstance(value, ml_collections.FieldReference):
    return _to_plain(value.get())
  return value


def _type_ok(value: Any, annotation: Any) -> bool:
  origin = typing.get_origin(annotation)
  if annotation is Any:
    return True
  if origin in (typing.Union, pytypes.UnionType):
    return any(_type_ok(value, a) for a in typing.get_args(annotation))
  if annotation is type(None):
    return value is None
  if annotation is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if annotation is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if origin in (tuple, list):
    return isinstance(value, (tuple, list))
  if origin is dict or annotation is dict:
    return isinstance(value, Mapping)
  if isinstance(annotation, type):
    return isinstance(value, annotation)
  return True


def parse_options(options_cls: type, kwargs: Mapping[str, Any] | ml_collections.ConfigDict,
                  path: str = 'task.kwargs') -> Any:
  """Builds the options dataclass from `config.task.kwargs`, naming the field of any bad value."""
  kwargs = _to_plain(kwargs) or {}
  fields = {f.name: f for f in dataclasses.fields(options_cls)}
  hints = typing.get_type_hints(options_cls)
  for key, value in kwargs.items():
    if key not in fields:
      raise ConfigError(f'config.{path}.{key} is not an option of this task; known: {sorted(fields)}.')
    if not _type_ok(value, hints[key]):
      raise ConfigError(f'config.{path}.{key}={value!r} has the wrong type; expected {hints[key]}.')
  values = {k: (tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items()}
  try:
    opts = options_cls(**values)
  except (ValueError, TypeError) as e:
    raise ConfigError(f'config.{path}: {e}') from e
  check = getattr(opts, 'check', None)
  if check is not None:
    check(path)
  return opts


def check_file(path_field: str, value: str) -> None:
  """Raises a `ConfigError` naming `path_field` when `value` is not a file that opens for reading."""
  if not value:
    raise ConfigError(f'config.{path_field} is empty; set it to a data file.')
  if not os.path.isfile(value):
    raise ConfigError(f'config.{path_field}={value!r}: no such file.')
  try:
    with open(value, 'rb') as f:
      f.read(1)
  except OSError as e:
    raise ConfigError(f'config.{path_field}={value!r} does not open: {e.strerror or e}.') from e


def _task_fields(task_config) -> tuple[str, int, int, Any]:
  name = task_config.get('name') if hasattr(task_config, 'get') else task_config.name
  max_turns = int(task_config.get('max_turns', 1))
  eval_size = int(task_config.get('eval_size', 64))
  return name, max_turns, eval_size, task_config.get('kwargs', {})


def _checked(task_config) -> tuple[_Entry, Any, int, int]:
  name, max_turns, eval_size, kwargs = _task_fields(task_config)
  entry = _entry(name)
  if max_turns < entry.min_turns:
    raise ConfigError(f'config.task.max_turns={max_turns!r}: task {name!r} needs >= {entry.min_turns}.')
  if eval_size < 0:
    raise ConfigError(f'config.task.eval_size={eval_size!r}: must be >= 0.')
  return entry, parse_options(entry.options, kwargs), max_turns, eval_size


def validate_task_config(config: ml_collections.ConfigDict) -> None:
  """Checks `config.task` (name, limits, kwargs, data files) without loading the task's data."""
  if 'task' not in config:
    raise ConfigError('config.task is missing.')
  _checked(config.task)


def get_task(task_config: ml_collections.ConfigDict | Mapping[str, Any]) -> base.Task:
  """Builds the task named by `config.task.name` with `config.task.kwargs`."""
  if isinstance(task_config, Mapping) and not isinstance(task_config, ml_collections.ConfigDict):
    task_config = ml_collections.ConfigDict(dict(task_config))
  entry, opts, max_turns, eval_size = _checked(task_config)
  task = entry.factory(opts, max_turns=max_turns, eval_size=eval_size)
  task.name = task_config.name
  return task
