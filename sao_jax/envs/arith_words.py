"""`arith_words`: `+` / `-` of 1-2-digit numbers and small `*`, asked in plain and word-problem forms, for chat models.

A problem is `a op b`: for `+` and `-` two operands in `[sum_min, sum_max]` (2 to 50 by default; `a >= b` for
`-`, so no answer is negative), for `*` a factor in `[2, mul_max]` times one in `[2, mul_small_max]` (in either
order; 2-25 times 2-9 by default). The defaults are sized for SmolLM2-135M-Instruct, right on 19.1% of 512
held-out problems greedy (`configs/smollm2_arith.py` has the measurement): enough reward for RL from the
base model. It is asked in one of many phrasings: plain ("What is 23 plus 58?", "Compute 71 + 19.") with
probability `1 - word_fraction`, else a word problem (people, objects, buying, taking away, boxes of items).
The user message is `"<problem> <instruction>"` (default instruction "Answer with just the number."), with no
system message of our own (`system_prompt=''`): the tokenizer's chat template adds its default one, if any.

Reward (single turn): 1 when the last number in the reply (`last_number`: optional sign, thousands
separators, decimals) equals the answer, 0 otherwise.

Held-out problems come from their own seed (`arith.EVAL_SEED`); an example's uid is its arithmetic
(`arith_words:23+58`), so training skips every problem of the eval set in any phrasing. With
`eval_file` the eval set is the file's `{"id", "problem", "answer"}` rows instead (asked and scored the same
way; all rows when `config.task.eval_size` is 0, else the first `eval_size`); a malformed row fails with a
`ConfigError` naming it, and training skips generated problems whose text is one of the file's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import arith
from sao_jax.envs import base
from sao_jax.envs import datasets
from sao_jax.envs import registry

DEFAULT_INSTRUCTION = 'Answer with just the number.'

# ------------------------------------------------------------------------------------------------------------
# Phrasings. Fields: {a} {b} (operands, in order: the answer is a op b), {name} {name2} (two different people),
# {he} {He} {his} {His} (pronouns of {name}), {items} (a plural noun), {food} (a plural food noun).

_PLAIN = {
    '+': (
        'What is {a} plus {b}?', 'Compute {a} + {b}.', 'Calculate {a} + {b}.', 'What is the sum of {a} and {b}?',
        'Add {a} and {b}.', '{a} + {b} = ?', 'Find {a} + {b}.', 'How much is {a} plus {b}?', 'Evaluate {a} + {b}.',
        'What do you get when you add {a} and {b}?', 'What is {a} added to {b}?', 'Work out {a} + {b}.',
        'Add {b} to {a}. What is the result?',
    ),
    '-': (
        'What is {a} minus {b}?', 'Compute {a} - {b}.', 'Calculate {a} - {b}.', 'Subtract {b} from {a}.',
        '{a} - {b} = ?', 'Find {a} - {b}.', 'How much is {a} minus {b}?', 'Evaluate {a} - {b}.',
        'What do you get when you subtract {b} from {a}?', 'What is {a} take away {b}?',
        'What is the difference between {a} and {b}?', 'Work out {a} - {b}.', 'Take {b} away from {a}.',
    ),
    '*': (
        'What is {a} times {b}?', 'Compute {a} * {b}.', 'Calculate {a} x {b}.', 'What is the product of {a} and '
        '{b}?', 'Multiply {a} by {b}.', '{a} * {b} = ?', 'Find {a} * {b}.', 'How much is {a} multiplied by {b}?',
        'Evaluate {a} * {b}.', 'What do you get when you multiply {a} by {b}?', 'What is {a} x {b}?',
        'Work out {a} times {b}.',
    ),
}

_WORDS = {
    '+': (
        '{name} has {a} {items}. {He} gets {b} more. How many {items} does {name} have now?',
        '{name} has {a} {items} and {name2} has {b} {items}. How many {items} do they have together?',
        'There are {a} people on a bus. At the next stop, {b} more people get on. How many people are on the '
        'bus now?',
        '{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {he} read in all?',
        'A shop sold {a} {items} yesterday and {b} {items} today. How many {items} did the shop sell in the two '
        'days?',
        '{name} saved {a} dollars in May and {b} dollars in June. How many dollars did {he} save altogether?',
        '{name} picked {a} {food} in the morning and {b} {food} in the afternoon. How many {food} did {he} pick '
        'in total?',
        'A library has {a} books on one shelf and {b} books on another. How many books are on the two shelves?',
        '{name} buys a book for {a} dollars and a game for {b} dollars. How many dollars does {he} spend?',
        'There are {a} girls and {b} boys in a school choir. How many children are in the choir?',
        '{name} walked {a} minutes to the park and {b} minutes back home. How many minutes did {he} walk?',
        'A farmer has {a} cows and {b} sheep. How many animals does the farmer have?',
    ),
    '-': (
        '{name} had {a} {items} and gave {b} of them to {name2}. How many {items} does {name} have left?',
        'There were {a} {food} in a basket. {name} took away {b} {food}. How many {food} are left in the basket?',
        '{name} has {a} dollars and spends {b} dollars on a present. How many dollars does {he} have left?',
        'A bus had {a} passengers. At a stop, {b} passengers got off. How many passengers are still on the bus?',
        '{name} has {a} {items} and {name2} has {b} {items}. How many more {items} does {name} have than '
        '{name2}?',
        'A library had {a} books. {b} books were borrowed. How many books are still in the library?',
        '{name} needs {a} {items} and already has {b}. How many more {items} does {he} need?',
        'A tree had {a} apples. {b} apples fell off. How many apples are still on the tree?',
        '{name} baked {a} cookies and the family ate {b} of them. How many cookies are left?',
        'A book has {a} pages. {name} has read {b} pages. How many pages does {he} still have to read?',
        'A parking lot had {a} cars. Then {b} cars drove away. How many cars are in the parking lot now?',
        '{name} had {a} {items}. {He} lost {b} of them. How many {items} does {he} have now?',
    ),
    '*': (
        'There are {a} boxes with {b} {items} in each box. How many {items} are there in total?',
        '{name} buys {a} {items} that cost {b} dollars each. How many dollars does {he} spend?',
        'A classroom has {a} rows of desks with {b} desks in each row. How many desks are in the classroom?',
        'Each of {a} children has {b} {items}. How many {items} do the children have altogether?',
        '{name} reads {b} pages every day for {a} days. How many pages does {he} read?',
        'A farmer plants {a} rows of trees with {b} trees in each row. How many trees does the farmer plant?',
        'A bag holds {b} {food}. How many {food} are in {a} bags?',
        '{name} earns {b} dollars an hour and works for {a} hours. How many dollars does {he} earn?',
        'A shelf has {a} stacks of books, and each stack has {b} books. How many books are on the shelf?',
        '{name} puts {b} {items} into each of {a} jars. How many {items} does {he} use?',
        'A bus has {a} rows of seats with {b} seats in each row. How many seats does the bus have?',
        'Tickets cost {b} dollars each. {name} buys {a} tickets. How many dollars does {he} pay?',
    ),
}

_NAMES = (
    ('Alice', 'she'), ('Ben', 'he'), ('Carla', 'she'), ('David', 'he'), ('Emma', 'she'), ('Farid', 'he'),
    ('Grace', 'she'), ('Hugo', 'he'), ('Ines', 'she'), ('Jack', 'he'), ('Keiko', 'she'), ('Liam', 'he'),
    ('Maria', 'she'), ('Noah', 'he'), ('Olivia', 'she'), ('Pablo', 'he'), ('Quinn', 'she'), ('Ravi', 'he'),
    ('Sofia', 'she'), ('Tom', 'he'), ('Uma', 'she'), ('Victor', 'he'), ('Wen', 'she'), ('Yusuf', 'he'),
)
_ITEMS = ('marbles', 'stickers', 'pencils', 'cards', 'stamps', 'coins', 'balloons', 'shells', 'crayons', 'buttons',
          'toy cars', 'beads', 'books', 'notebooks', 'erasers', 'paper clips')
_FOOD = ('apples', 'oranges', 'cookies', 'strawberries', 'eggs', 'lemons', 'plums', 'carrots', 'potatoes', 'pears')
_PRONOUNS = {'she': ('she', 'her'), 'he': ('he', 'his')}

# The last number of a reply: a sign only where it cannot be a binary minus (not right after a digit), then
# digits with thousands separators or plain digits, and an optional decimal part.
_NUMBER = re.compile(r'(?<![\d.,])(-?)(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?![\d])')


def last_number(text: str) -> Fraction | None:
  """The last number written in `text` ('The answer is 1,234.' -> 1234, '5-3=2' -> 2, '-7' -> -7), or None."""
  found = None
  for found in _NUMBER.finditer(text):
    pass
  if found is None:
    return None
  sign, digits, frac = found.groups()
  value = Fraction(digits.replace(',', '') + (frac or ''))
  return -value if sign else value


@dataclasses.dataclass(frozen=True)
class ArithWordsOptions:
  """`config.task.kwargs` of arith_words."""
  ops: str = '+-*'  # Operators, drawn uniformly: any of '+', '-', '*'.
  sum_min: int = 2  # Smallest operand of + and -.
  sum_max: int = 50  # Largest operand of + and -.
  mul_max: int = 25  # Largest value of the first factor of * (the factors are drawn in [2, mul_max] and
  mul_small_max: int = 9  # [2, mul_small_max], then put in random order).
  word_fraction: float = 0.5  # Probability of a word-problem phrasing (else a plain one).
  instruction: str = DEFAULT_INSTRUCTION  # Appended to every problem (after a space).
  system_prompt: str = ''  # System message ('' = none of ours: the chat template's default, if any).
  eval_file: str = ''  # Eval problems from this file of {"id", "problem", "answer"} rows ('' = generated).

  def check(self, path: str = 'task.kwargs') -> None:
    if not self.ops or any(o not in '+-*' for o in self.ops):
      raise ConfigError(f'config.{path}.ops={self.ops!r}: a non-empty subset of "+-*".')
    if not 0 <= self.sum_min <= self.sum_max:
      raise ConfigError(f'config.{path}.sum_min/sum_max=({self.sum_min}, {self.sum_max}): need '
                        '0 <= sum_min <= sum_max.')
    if not 2 <= self.mul_small_max <= self.mul_max:
      raise ConfigError(f'config.{path}.mul_small_max/mul_max=({self.mul_small_max}, {self.mul_max}): need '
                        '2 <= mul_small_max <= mul_max.')
    if not 0.0 <= self.word_fraction <= 1.0:
      raise ConfigError(f'config.{path}.word_fraction={self.word_fraction!r}: must be in [0, 1].')
    if self.eval_file:
      registry.check_file(f'{path}.eval_file', self.eval_file)


def _operands(rng: np.random.Generator, op: str, opts: ArithWordsOptions) -> tuple[int, int]:
  if op == '*':
    x, y = int(rng.integers(2, opts.mul_max + 1)), int(rng.integers(2, opts.mul_small_max + 1))
    return (x, y) if rng.random() < 0.5 else (y, x)
  a, b = (int(v) for v in rng.integers(opts.sum_min, opts.sum_max + 1, size=2))
  return (max(a, b), min(a, b)) if op == '-' else (a, b)


def _value(a: int, op: str, b: int) -> int:
  return {'+': a + b, '-': a - b, '*': a * b}[op]


def _choice(rng: np.random.Generator, seq):
  return seq[int(rng.integers(len(seq)))]


def make_problem(rng: np.random.Generator, opts: ArithWordsOptions) -> tuple[str, int, dict[str, Any]]:
  """(problem text, answer, data) of one random problem."""
  op = _choice(rng, opts.ops)
  a, b = _operands(rng, op, opts)
  word = bool(rng.random() < opts.word_fraction)
  templates = (_WORDS if word else _PLAIN)[op]
  k = int(rng.integers(len(templates)))
  i, j = rng.choice(len(_NAMES), size=2, replace=False)
  (name, pronoun), (name2, _) = _NAMES[int(i)], _NAMES[int(j)]
  he, his = _PRONOUNS[pronoun]
  text = templates[k].format(a=a, b=b, name=name, name2=name2, he=he, He=he.capitalize(), his=his,
                             His=his.capitalize(), items=_choice(rng, _ITEMS), food=_choice(rng, _FOOD))
  data = {'expression': f'{a}{op}{b}', 'form': 'word' if word else 'plain', 'template': k}
  return text, _value(a, op, b), data


def _example(uid: str, problem: str, answer: str, data: dict[str, Any], opts: ArithWordsOptions) -> base.Example:
  prompt = f'{problem} {opts.instruction}' if opts.instruction else problem
  return base.Example(uid=uid, prompt=prompt, answer=answer, data={'problem': problem, **data},
                      system=opts.system_prompt or None)


def make_example(rng: np.random.Generator, opts: ArithWordsOptions) -> base.Example:
  problem, value, data = make_problem(rng, opts)
  return _example(f'arith_words:{data["expression"]}', problem, str(value), data, opts)


def _number(value: Any) -> Fraction:
  """A reference answer (int, float or numeric string) as an exact number; ValueError otherwise."""
  if isinstance(value, bool):
    raise ValueError(f'answer {value!r} is a boolean')
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError(f'answer {value!r} is not finite')
  if isinstance(value, (int, float)):
    return Fraction(value)
  if isinstance(value, str):
    parsed = last_number(value)
    if parsed is not None and _NUMBER.fullmatch(value.strip()):
      return parsed
  raise ValueError(f'answer {value!r:.60} is not a number')


def load_eval_file(path: str, opts: ArithWordsOptions, field: str = 'task.kwargs.eval_file',
                   reports: list[datasets.FileReport] | None = None) -> list[base.Example]:
  """The rows of a `{"id", "problem", "answer"}` file (JSONL, JSON, CSV or Parquet) as examples.

  Each example records `data['file']` and `data['row']`; the file's report (every row kept) is appended to
  `reports` when given.

  Raises:
    ConfigError: naming `config.<field>`, the file and the row, for the first malformed row (not an object, a
      missing or empty field, an answer that is not a number, a repeated id), or when the file has no row.
  """
  rows = datasets.read_rows(path, field)
  if not rows:
    raise ConfigError(f'config.{field}={path!r}: the file has no row.')
  out, seen = [], {}
  for n, row in rows:
    try:
      if isinstance(row, datasets.BadRow):
        raise row
      if not isinstance(row, dict):
        raise datasets.BadRow(f'not an object but {type(row).__name__}')
      uid = datasets.text_field(row, 'id', allow_numbers=True)
      problem = datasets.text_field(row, 'problem')
      if 'answer' not in row or row['answer'] is None:
        raise datasets.BadRow("missing field 'answer'")
      try:
        answer = _number(row['answer'])
      except ValueError as e:
        raise datasets.BadRow(str(e)) from None
      if uid in seen:
        raise datasets.BadRow(f'duplicate id {uid!r:.60} (first at row {seen[uid]})')
    except datasets.BadRow as e:
      raise ConfigError(f'config.{field}={path!r}: row {n}: {e}.') from None
    seen[uid] = n
    text = str(answer.numerator) if answer.denominator == 1 else str(answer)
    out.append(_example(f'arith_words:file:{uid}', problem, text, {'file': path, 'row': n, 'id': uid}, opts))
  if reports is not None:
    reports.append(datasets.FileReport(field, path, len(rows), [n for n, _ in rows], []))
  return out


def score(text: str, answer: str) -> tuple[float, dict[str, Any]]:
  """(reward, info): 1 when `last_number(text)` equals `answer`, else 0."""
  parsed = last_number(text)
  correct = parsed is not None and parsed == Fraction(answer)
  return (1.0 if correct else 0.0), {'correct': correct, 'parsed': None if parsed is None else str(parsed)}


class ArithWordsEnv(base.BaseEnv):
  """Single turn: the reply is scored and the episode ends."""

  def _step(self, action_text: str) -> base.StepResult:
    reward, info = score(action_text, self.example.answer)
    return base.StepResult(None, reward, True, info)


def _norm(text: str) -> str:
  return ' '.join(text.split()).lower()


_HELD_OUT = 'arith_words:held-out'  # The uid a generated problem gets when its text is an eval-file problem's.


class ArithWordsTask(arith.GeneratedTask):
  """Arithmetic word problems (see the module docstring)."""

  def __init__(self, opts: ArithWordsOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    self._file_eval: list[base.Example] | None = None
    self.file_reports = []
    if opts.eval_file:
      rows = load_eval_file(opts.eval_file, opts, reports=self.file_reports)
      self._file_eval = rows[:eval_size] if eval_size else rows
      self._held_texts = frozenset(_norm(ex.data['problem']) for ex in self._file_eval)

  def make_example(self, rng: np.random.Generator) -> base.Example:
    return make_example(rng, self.opts)

  def _train_example(self, rng: np.random.Generator) -> base.Example:
    ex = self.make_example(rng)
    return dataclasses.replace(ex, uid=_HELD_OUT) if _norm(ex.data['problem']) in self._held_texts else ex

  def eval_set(self) -> list[base.Example]:
    return super().eval_set() if self._file_eval is None else list(self._file_eval)

  def file_problems(self) -> list[base.Example]:
    return list(self._file_eval or [])

  def filter_problems(self, keep: Callable[[base.Example], bool]) -> None:
    if self._file_eval is not None:
      self._file_eval = [ex for ex in self._file_eval if keep(ex)]

  def train_iterator(self, seed: int) -> base.GeneratedIterator:
    if self._file_eval is None:
      return super().train_iterator(seed)  # Skips the eval set's problems (by uid: a op b) in any phrasing.
    return base.GeneratedIterator(self._train_example, seed, exclude=frozenset({_HELD_OUT}))

  def make_env(self, example: base.Example) -> ArithWordsEnv:
    return ArithWordsEnv(example, max_turns=1)


@registry.register_task('arith_words', ArithWordsOptions)
def _make(opts: ArithWordsOptions, *, max_turns: int, eval_size: int) -> ArithWordsTask:
  return ArithWordsTask(opts, max_turns=max_turns, eval_size=eval_size)
