"""`drift`: the online-learning setting, arithmetic whose rule changes on a schedule.

Phases are arith option overrides, e.g. `('ops=+-', 'ops=*', 'answer_format=boxed,instruct_format=False',
'min_digits=3,max_digits=3')`, each applied on top of the base options (not cumulatively). Phase
`k = position // period` (cycled through the phases when `cycle`, else staying on the last one), where the
position is the number of training examples drawn (`unit='examples'`, deterministic and resumable with the
iterator) or the learner step told by `set_step(step)` (`unit='steps'`). The current phase is in every env
info (`info['phase']`), in `Task.metrics()` (`drift/phase`) and in each example (`data['phase']`), so the
speed of adaptation after a shift can be measured. An example is scored by the rule of the phase that
generated it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import arith
from sao_jax.envs import base
from sao_jax.envs import registry

_PHASE_KEYS = ('min_digits', 'max_digits', 'min_ops', 'max_ops', 'ops', 'answer_format', 'strict',
               'format_reward', 'instruct_format')


def parse_phase(spec: str, field: str) -> dict[str, Any]:
  """'key=value,key=value' -> overrides of `ArithOptions` (values typed by the field)."""
  hints = typing.get_type_hints(arith.ArithOptions)
  out: dict[str, Any] = {}
  for item in filter(None, (s.strip() for s in spec.split(','))):
    key, sep, raw = item.partition('=')
    key, raw = key.strip(), raw.strip()
    if not sep or key not in _PHASE_KEYS:
      raise ConfigError(f'config.{field}={spec!r}: {item!r} is not key=value with a key in '
                        f'{list(_PHASE_KEYS)}.')
    kind = hints[key]
    try:
      if kind is bool:
        if raw.lower() not in ('true', 'false', '1', '0'):
          raise ValueError(raw)
        out[key] = raw.lower() in ('true', '1')
      else:
        out[key] = kind(raw)
    except ValueError:
      raise ConfigError(
          f'config.{field}={spec!r}: {raw!r} is not a valid {kind.__name__} for {key}.') from None
  return out


@dataclasses.dataclass(frozen=True)
class DriftOptions(arith.ArithOptions):
  """`config.task.kwargs` of drift: arith's knobs (the base rule) plus the schedule."""
  phases: tuple[str, ...] = (  # Per phase: 'key=value,...' overrides of the arith knobs above.
      'ops=+-', 'ops=*', 'answer_format=boxed', 'min_digits=2,max_digits=3')
  period: int = 200  # Length of a phase, in `unit`s.
  unit: str = 'examples'  # 'examples' (training examples drawn) or 'steps' (learner steps, via set_step).
  cycle: bool = True  # After the last phase, start again from the first (else stay on the last).

  def check(self, path: str = 'task.kwargs') -> None:
    super().check(path)
    if not self.phases:
      raise ConfigError(f'config.{path}.phases is empty; give at least one phase (e.g. "ops=+").')
    for i, spec in enumerate(self.phases):
      if not isinstance(spec, str):
        raise ConfigError(f'config.{path}.phases[{i}]={spec!r}: must be a "key=value,..." string.')
      self.phase_options(i, f'{path}.phases[{i}]').check(f'{path}.phases[{i}]')
    if self.period < 1:
      raise ConfigError(f'config.{path}.period={self.period!r}: must be >= 1.')
    if self.unit not in ('examples', 'steps'):
      raise ConfigError(f'config.{path}.unit={self.unit!r}: examples or steps.')

  def base_options(self) -> arith.ArithOptions:
    names = {f.name for f in dataclasses.fields(arith.ArithOptions)}
    return arith.ArithOptions(**{k: getattr(self, k) for k in names})

  def phase_options(self, k: int, field: str = 'task.kwargs.phases') -> arith.ArithOptions:
    return dataclasses.replace(self.base_options(), **parse_phase(self.phases[k], field))


class DriftEnv(arith.ArithEnv):
  """arith's env under the phase's rule, reporting the phase."""

  def __init__(self, example: base.Example, opts: arith.ArithOptions, phase: int):
    super().__init__(example, opts)
    self.phase = phase

  def _step(self, action_text: str) -> base.StepResult:
    obs, reward, done, info = super()._step(action_text)
    return base.StepResult(obs, reward, done, {**info, 'phase': self.phase})


class DriftIterator(base.ExampleIterator):
  """Example i comes from `default_rng([seed, i, attempt])` under the phase of its position."""

  def __init__(self, task: 'DriftTask', seed: int, exclude: frozenset[str]):
    self._task = task
    self._seed = int(seed)
    self._exclude = exclude
    self._index = 0

  def __next__(self) -> base.Example:
    phase = self._task.phase_at(self._index if self._task.opts.unit == 'examples' else self._task.step)
    for attempt in range(1000):
      ex = self._task.make_example(np.random.default_rng([self._seed, self._index, attempt]), phase)
      if ex.uid not in self._exclude:
        break
    else:
      raise RuntimeError(f'Phase {phase}: 1000 draws all fell in the eval set; lower config.task.eval_size.')
    self._index += 1
    self._task.observe(self._index, phase)
    return ex

  def state(self) -> dict[str, Any]:
    return {'kind': 'drift', 'seed': self._seed, 'index': self._index, 'step': self._task.step}

  def restore(self, state: Mapping[str, Any]) -> None:
    base._check_state(state, 'drift', ('seed', 'index', 'step'))  # pylint: disable=protected-access
    self._seed, self._index = int(state['seed']), int(state['index'])
    self._task.set_step(int(state['step']))
    self._task.observe(self._index, self._task.phase_at(
        max(self._index - 1, 0) if self._task.opts.unit == 'examples' else self._task.step))


class DriftTask(base.Task):
  """Arithmetic whose rule shifts every `period` examples or steps."""

  def __init__(self, opts: DriftOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    self._phase_opts = [opts.phase_options(k) for k in range(len(opts.phases))]
    self.step = 0
    self.current_phase = 0
    self.examples_drawn = 0
    self._evals: dict[int, list[base.Example]] = {}

  @property
  def num_phases(self) -> int:
    return len(self._phase_opts)

  def phase_at(self, position: int) -> int:
    k = position // self.opts.period
    return k % self.num_phases if self.opts.cycle else min(k, self.num_phases - 1)

  def set_step(self, step: int) -> None:
    """Tells the task the learner step (drives the schedule when `unit='steps'`)."""
    self.step = int(step)
    if self.opts.unit == 'steps':
      self.current_phase = self.phase_at(self.step)

  def observe(self, examples_drawn: int, phase: int) -> None:
    self.examples_drawn = examples_drawn
    if self.opts.unit == 'examples':
      self.current_phase = phase

  def make_example(self, rng: np.random.Generator, phase: int) -> base.Example:
    return arith.make_example(rng, self._phase_opts[phase], task='drift', extra={'phase': phase})

  def eval_set_for(self, phase: int) -> list[base.Example]:
    """The held-out set of one phase (fixed stream, deduplicated)."""
    if phase not in self._evals:
      gen = base.GeneratedIterator(lambda rng: self.make_example(rng, phase), arith.EVAL_SEED + 1 + phase)
      seen: dict[str, base.Example] = {}
      for _ in range(20 * self.eval_size + 100):
        if len(seen) == self.eval_size:
          break
        ex = next(gen)
        seen.setdefault(ex.uid, ex)
      if len(seen) < self.eval_size:
        raise ConfigError(f'config.task.eval_size={self.eval_size}: phase {phase} has only {len(seen)} '
                          'distinct problems.')
      self._evals[phase] = list(seen.values())
    return list(self._evals[phase])

  def eval_set(self) -> list[base.Example]:
    """The held-out set of the current phase."""
    return self.eval_set_for(self.current_phase)

  def train_iterator(self, seed: int) -> DriftIterator:
    exclude = frozenset(ex.uid for k in range(self.num_phases) for ex in self.eval_set_for(k))
    return DriftIterator(self, seed, exclude)

  def make_env(self, example: base.Example) -> DriftEnv:
    phase = int(example.data.get('phase', self.current_phase))
    return DriftEnv(example, self._phase_opts[phase], phase)

  def solution(self, example: base.Example) -> str:
    """The reference reply under the rule of the example's phase (the warm start's target): arith's
    `render_solution` with that phase's options (answer format, scratchpad)."""
    opts = self._phase_opts[int(example.data.get('phase', self.current_phase))]
    return arith.render_solution(example.data['expression'], example.answer, opts)

  def metrics(self) -> dict[str, float]:
    position = self.examples_drawn if self.opts.unit == 'examples' else self.step
    return {'drift/phase': float(self.current_phase),
            'drift/position_in_phase': float(position % self.opts.period)}


@registry.register_task('drift', DriftOptions)
def _make(opts: DriftOptions, *, max_turns: int, eval_size: int) -> DriftTask:
  return DriftTask(opts, max_turns=max_turns, eval_size=eval_size)
