"""`calculator`: multi-turn tool use. The task that exercises skip-observation GAE.

Problems are arithmetic with large operands (3-4 digits, 2 operators by default), hard to do in one's head,
easy with the tool. Each model turn either
  * calls the tool, `... <calc>347*589</calc>`: the env evaluates the expression safely (`safe_eval`, no
    `eval`) and answers `<result>204383</result>` (or `<result>error: ...</result>`); the episode goes on;
  * or answers, `<answer>204395</answer>`: scored like arith (exact match, optional format reward); done.
A turn with neither ends the episode with reward 0, and so does a turn longer than `max_action_chars` (checked
before any parsing, so a step's time is bounded; the tool call is found by two `rfind`s, linear in the text).
Reaching `config.task.max_turns` with a pending tool call cuts the episode (truncated, reward 0).

Observations are 'inline' by default (the model stops at `</calc>`, the result is appended inside the
assistant's stream, one assistant turn in all) or 'message' (a new chat message of `observation_role`).

The prompt explains the tool (`tool_instructions`, on by default; a model warm-started on the reference
episodes learns the tool from them and can do without). The reference episode (`solution_actions`, the warm
start's data) calls the tool on the whole expression, then answers with its result.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import answers
from sao_jax.envs import arith
from sao_jax.envs import base
from sao_jax.envs import registry
from sao_jax.envs import safe_eval

_OPEN, _CLOSE = '<calc>', '</calc>'
_TOOL_PROMPT = ('You have a calculator: write <calc>expression</calc> (numbers, + - * / // % ** and '
                'parentheses) and you will get <result>value</result>.')


@dataclasses.dataclass(frozen=True)
class CalculatorOptions(arith.ArithOptions):
  """`config.task.kwargs` of calculator: arith's problem knobs (harder defaults) plus the tool's."""
  min_digits: int = 3  # Fewest digits of an operand.
  max_digits: int = 4  # Most digits of an operand.
  min_ops: int = 2  # Fewest operators in a problem.
  max_ops: int = 2  # Most operators in a problem.
  answer_format: str = 'tag'  # The final answer format (the tool tags are fixed).
  observation_mode: str = 'inline'  # 'inline' (result appended in the assistant stream) or 'message'.
  observation_role: str = 'user'  # Chat role of 'message' observations ('tool' where the template has it).
  max_expression_chars: int = 200  # Longest expression the tool accepts.
  max_abs: float = 1e40  # Bound on |value| of any intermediate result of the tool.
  max_exponent: int = 64  # Bound on exponents the tool accepts.
  max_action_chars: int = 16384  # Longer model turns end the episode with reward 0, unparsed.
  tool_instructions: bool = True  # Explain the tool in the prompt (a warm-started model learns it from solutions).

  def check(self, path: str = 'task.kwargs') -> None:
    super().check(path)
    if self.observation_mode not in ('inline', 'message'):
      raise ConfigError(f'config.{path}.observation_mode={self.observation_mode!r}: inline or message.')
    if self.answer_format == 'plain':
      raise ConfigError(f'config.{path}.answer_format=plain cannot be told apart from a tool call; use '
                        'tag, boxed or hash.')
    if self.max_action_chars < 1:
      raise ConfigError(f'config.{path}.max_action_chars={self.max_action_chars!r}: must be >= 1.')


def tool_call(text: str) -> str | None:
  """The expression of the last complete `<calc>...</calc>` in `text` (None if there is none). Linear time."""
  end = text.rfind(_CLOSE)
  start = -1 if end < 0 else text.rfind(_OPEN, 0, end)
  return None if start < 0 else text[start + len(_OPEN):end]


def tool_result(expr: str, opts: CalculatorOptions) -> str:
  """The observation text for one tool call."""
  try:
    value = safe_eval.safe_eval(expr, max_len=opts.max_expression_chars, max_abs=opts.max_abs,
                                max_exponent=opts.max_exponent)
    return f'<result>{safe_eval.format_number(value)}</result>'
  except safe_eval.UnsafeExpression as e:
    return f'<result>error: {e}</result>'


class CalculatorEnv(base.BaseEnv):
  """See module docstring."""

  def __init__(self, example: base.Example, opts: CalculatorOptions, *, max_turns: int):
    super().__init__(example, max_turns=max_turns)
    self.opts = opts
    self.observation_mode = opts.observation_mode
    self.observation_role = opts.observation_role
    self.stop_texts = ('</calc>',) if opts.observation_mode == 'inline' else ()
    self.tool_calls = 0

  def _reset(self) -> None:
    self.tool_calls = 0

  def _step(self, action_text: str) -> base.StepResult:
    if len(action_text) > self.opts.max_action_chars:
      return base.StepResult(None, 0.0, True, {'tool_calls': self.tool_calls, 'correct': False,
                                               'overlong': len(action_text)})
    has_answer = answers.parse(action_text, self.opts.answer_format, strict=False) is not None
    call = tool_call(action_text)
    if has_answer or call is None:
      reward, info = arith.score(action_text, self.example.answer, self.opts)
      info['tool_calls'] = self.tool_calls
      return base.StepResult(None, reward, True, info)
    self.tool_calls += 1
    return base.StepResult(tool_result(call, self.opts), 0.0, False, {'tool_calls': self.tool_calls})


class CalculatorTask(arith.GeneratedTask):
  """Multi-turn arithmetic with a calculator tool."""

  def __init__(self, opts: CalculatorOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts

  def make_example(self, rng: np.random.Generator) -> base.Example:
    ex = arith.make_example(rng, self.opts, task='calculator')
    return dataclasses.replace(ex, prompt=f'{_TOOL_PROMPT} {ex.prompt}') if self.opts.tool_instructions else ex

  def make_env(self, example: base.Example) -> CalculatorEnv:
    return CalculatorEnv(example, self.opts, max_turns=self.max_turns)

  def solution_actions(self, example: base.Example) -> list[str]:
    """The reference episode's turns (the warm start's data): one tool call on the whole expression, then the
    answer, which the tool's result gives (`demo_actions`)."""
    return demo_actions(example, self.opts.answer_format)


@registry.register_task('calculator', CalculatorOptions, min_turns=2)
def _make(opts: CalculatorOptions, *, max_turns: int, eval_size: int) -> CalculatorTask:
  return CalculatorTask(opts, max_turns=max_turns, eval_size=eval_size)


def demo_actions(example: base.Example, answer_format: str = 'tag') -> list[str]:
  """A correct two-turn episode's action texts: `<calc>EXPR</calc>` (the turn stops at the tool's closing tag in
  'inline' mode, at the end of the assistant turn in 'message' mode), then the answer in `answer_format`."""
  expr = example.data['expression']
  return [f'<calc>{expr}</calc>', answers.render(example.answer, answer_format)]
