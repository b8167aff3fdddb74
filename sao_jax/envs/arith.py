"""`arith`: synthetic integer arithmetic, the embedded default task of the CPU demo.

A problem is `a op b op c ...` with `num_ops` operators drawn from `ops` and operands of `min_digits` to
`max_digits` digits, evaluated with the usual precedence. Reward (single turn):
  1 if the answer, read in `answer_format` (strictly when `strict`), equals the value;
  `format_reward` if it is well-formed but wrong; 0 otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import answers
from sao_jax.envs import base
from sao_jax.envs import registry
from sao_jax.envs import safe_eval

SCRATCHPADS = ('none', 'reversed', 'partials')
EVAL_SEED = 0x5EED  # Eval problems come from their own stream, whatever the training seed.


@dataclasses.dataclass(frozen=True)
class ArithOptions:
  """`config.task.kwargs` of arith (also the problem generator of calculator and drift)."""
  min_digits: int = 1  # Fewest digits of an operand.
  max_digits: int = 2  # Most digits of an operand.
  mul_max_digits: int = 0  # Most digits of the right factor of a '*' (0 = max_digits); fewest: min(min_digits, this).
  min_ops: int = 1  # Fewest operators in a problem.
  max_ops: int = 1  # Most operators in a problem.
  ops: str = '+-*'  # Operator set, drawn uniformly: any of '+', '-', '*'.
  answer_format: str = 'tag'  # tag (<answer>N</answer>), boxed, hash (#### N) or plain.
  strict: bool = True  # Strict format: one integer answer, nothing after it.
  format_reward: float = 0.0  # Reward for a well-formed but wrong answer (0 = exact match only).
  instruct_format: bool = True  # State the answer format in the prompt (drift can hide it).
  system_prompt: str = ''  # Optional system message.
  scratchpad: str = 'none'  # Reference reply (warm start): none (the answer alone), reversed or partials (`solution`).

  def check(self, path: str = 'task.kwargs') -> None:
    if not 1 <= self.min_digits <= self.max_digits <= 18:
      raise ConfigError(f'config.{path}.min_digits/max_digits=({self.min_digits}, {self.max_digits}): need '
                        '1 <= min_digits <= max_digits <= 18.')
    if not 0 <= self.mul_max_digits <= 18:
      raise ConfigError(f'config.{path}.mul_max_digits={self.mul_max_digits}: need 0 <= mul_max_digits <= 18 '
                        '(0 = max_digits).')
    if not 1 <= self.min_ops <= self.max_ops <= 16:
      raise ConfigError(f'config.{path}.min_ops/max_ops=({self.min_ops}, {self.max_ops}): need '
                        '1 <= min_ops <= max_ops <= 16.')
    if not self.ops or any(o not in '+-*' for o in self.ops):
      raise ConfigError(f'config.{path}.ops={self.ops!r}: a non-empty subset of "+-*".')
    if self.answer_format not in answers.FORMATS:
      raise ConfigError(f'config.{path}.answer_format={self.answer_format!r} is not one of '
                        f'{list(answers.FORMATS)}.')
    if self.scratchpad not in SCRATCHPADS:
      raise ConfigError(f'config.{path}.scratchpad={self.scratchpad!r} is not one of {list(SCRATCHPADS)}.')
    if self.scratchpad != 'none' and self.answer_format not in ('hash', 'tag', 'boxed'):
      raise ConfigError(f'config.{path}.scratchpad={self.scratchpad!r} writes text before the answer: '
                        f'answer_format={self.answer_format!r} must allow it (hash, tag or boxed).')
    if not 0.0 <= self.format_reward < 1.0:
      raise ConfigError(f'config.{path}.format_reward={self.format_reward!r}: must be in [0, 1).')


def _operand(rng: np.random.Generator, opts: ArithOptions) -> int:
  digits = int(rng.integers(opts.min_digits, opts.max_digits + 1))
  low = 0 if digits == 1 else 10 ** (digits - 1)
  return int(rng.integers(low, 10 ** digits))


def generate_expression(rng: np.random.Generator, opts: ArithOptions) -> tuple[str, int]:
  """A random expression and its integer value.

  With `mul_max_digits` set, the right factor of every '*' is then redrawn in its own digit range (after the
  draws of the expression, so the problem stream without it is unchanged): e.g. 2-digit by 1-digit products.
  """
  n_ops = int(rng.integers(opts.min_ops, opts.max_ops + 1))
  parts = [str(_operand(rng, opts))]
  for _ in range(n_ops):
    parts += [opts.ops[int(rng.integers(len(opts.ops)))], str(_operand(rng, opts))]
  if opts.mul_max_digits:
    factor = dataclasses.replace(opts, min_digits=min(opts.min_digits, opts.mul_max_digits),
                                 max_digits=opts.mul_max_digits)
    for i in range(2, len(parts), 2):  # Operands sit at even indices, operators between them.
      if parts[i - 1] == '*':
        parts[i] = str(_operand(rng, factor))
  expr = ''.join(parts)
  value = safe_eval.safe_eval(expr, max_abs=1e60, max_len=1000)
  return expr, int(value)


def make_example(rng: np.random.Generator, opts: ArithOptions, *, task: str = 'arith',
                 extra: dict[str, Any] | None = None, question: str | None = None) -> base.Example:
  expr, value = generate_expression(rng, opts)
  prompt = question.format(expr=expr) if question else f'Compute {expr}.'
  if opts.instruct_format:
    prompt += ' ' + answers.instruction(opts.answer_format)
  data = {'expression': expr, 'answer_format': opts.answer_format}
  data.update(extra or {})
  return base.Example(uid=f'{task}:{opts.answer_format}:{expr}', prompt=prompt, answer=str(value), data=data,
                      system=opts.system_prompt or None)


_ONE_DIGIT_PRODUCT = re.compile(r'(\d+)\*(\d)')


def render_solution(expression: str, answer: str, opts: ArithOptions) -> str:
  """The reference reply to `expression` (value `answer`): the answer in `opts.answer_format`, after a scratchpad
  line for `opts.scratchpad` (the reward reads only the final answer; the scratchpad is what the warm start
  teaches). Hash-format examples:

    none      85 -> '#### 85'
    reversed  the answer's digits least-significant first (sign first): 85 -> '58\\n#### 85', -35 -> '-53\\n#### -35'
    partials  as reversed, and a product `A*b` with one-digit b first lists the partial products a_i*b
              (digits of A from the units up), each as two digits least-significant first:
              47*8 -> '65 23 673\\n#### 376' (7*8 = 56, 4*8 = 32, 56 + 320 = 376)
  """
  final = answers.render(answer, opts.answer_format)
  if opts.scratchpad == 'none':
    return final
  sign, digits = ('-', answer[1:]) if answer.startswith('-') else ('', answer)
  line = f'{sign}{digits[::-1]}'
  m = _ONE_DIGIT_PRODUCT.fullmatch(expression)
  if opts.scratchpad == 'partials' and m:
    a, b = m.group(1), int(m.group(2))
    line = ' '.join(f'{int(d) * b:02d}'[::-1] for d in reversed(a)) + ' ' + line
  return f'{line}\n{final}'


def score(text: str, answer: str, opts: ArithOptions) -> tuple[float, dict[str, Any]]:
  """(reward, info) of a final response against the integer `answer`."""
  parsed = answers.parse(text, opts.answer_format, strict=opts.strict)
  correct = parsed is not None and parsed == str(int(answer))
  reward = 1.0 if correct else (opts.format_reward if parsed is not None else 0.0)
  return reward, {'correct': correct, 'well_formed': parsed is not None, 'parsed': parsed}


class ArithEnv(base.BaseEnv):
  """Single turn: the response is scored and the episode ends."""

  def __init__(self, example: base.Example, opts: ArithOptions, *, max_turns: int = 1):
    super().__init__(example, max_turns=max_turns)
    self.opts = opts

  def _step(self, action_text: str) -> base.StepResult:
    reward, info = score(action_text, self.example.answer, self.opts)
    return base.StepResult(None, reward, True, info)


class GeneratedTask(base.Task):
  """Problems from `make_example(rng)`; the eval set comes from a fixed stream, disjoint from train."""

  def __init__(self, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self._eval: list[base.Example] | None = None

  def make_example(self, rng: np.random.Generator) -> base.Example:
    raise NotImplementedError

  def eval_set(self) -> list[base.Example]:
    if self._eval is None:
      seen, out = set(), []
      it = base.GeneratedIterator(self.make_example, EVAL_SEED)
      for _ in range(20 * self.eval_size + 100):
        if len(out) == self.eval_size:
          break
        ex = next(it)
        if ex.uid not in seen:
          seen.add(ex.uid)
          out.append(ex)
      if len(out) < self.eval_size:
        raise ConfigError(f'config.task.eval_size={self.eval_size}: only {len(out)} distinct problems found; '
                          'raise the difficulty or lower eval_size.')
      self._eval = out
    return list(self._eval)

  def train_iterator(self, seed: int) -> base.GeneratedIterator:
    exclude = frozenset(ex.uid for ex in self.eval_set())
    return base.GeneratedIterator(self.make_example, seed, exclude=exclude)


class ArithTask(GeneratedTask):
  """Synthetic arithmetic (see module docstring)."""

  def __init__(self, opts: ArithOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts

  def make_example(self, rng: np.random.Generator) -> base.Example:
    return make_example(rng, self.opts)

  def make_env(self, example: base.Example) -> ArithEnv:
    return ArithEnv(example, self.opts, max_turns=1)

  def solution(self, example: base.Example) -> str:
    """The canonical correct reply (the warm start's target): `render_solution` of the example's answer."""
    return render_solution(example.data['expression'], example.answer, self.opts)


@registry.register_task('arith', ArithOptions)
def _make(opts: ArithOptions, *, max_turns: int, eval_size: int) -> ArithTask:
  return ArithTask(opts, max_turns=max_turns, eval_size=eval_size)
