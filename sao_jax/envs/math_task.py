"""`math`: competition problems from JSONL / JSON / CSV / Parquet, rewarded by math-verify.

Field names are configurable; `layout` presets cover the public benchmark formats:
  * 'imo_answerbench': IMO-AnswerBench (`Problem ID`, `Problem`, `Short Answer`);
  * 'aime2025': AIME 2025 as on MathArena (`problem_idx`, `problem`, `answer`);
  * 'hmmt': HMMT February 2025 as on MathArena (`problem_idx`, `problem`, `answer`);
  * 'beyond_aime': BeyondAIME (`problem`, `answer`, no id);
  * 'custom': the `problem_field` / `answer_field` / `id_field` options.
Single turn; reward 1 when math-verify finds the response's final answer (its last `\\boxed{}` first)
equal to the reference (LaTeX or plain), else 0. The check runs in a worker pool with a timeout and an
address-space limit. At load, rows with an unusable reference answer (NaN, inf, or nothing math-verify can
parse: `check_answers`) are skipped and reported with the malformed and duplicate rows (`datasets`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from sao_jax.errors import ConfigError
from sao_jax.envs import base
from sao_jax.envs import datasets
from sao_jax.envs import registry
from sao_jax.envs import verifier as verifier_lib

DATA_DIR = os.path.join(os.path.dirname(__file__), 'data')
DEFAULT_DATA = os.path.join(DATA_DIR, 'math_sample.jsonl')

LAYOUTS: dict[str, tuple[str, str, str]] = {  # layout -> (problem, answer, id) fields.
    'imo_answerbench': ('Problem', 'Short Answer', 'Problem ID'),
    'aime2025': ('problem', 'answer', 'problem_idx'),
    'hmmt': ('problem', 'answer', 'problem_idx'),
    'beyond_aime': ('problem', 'answer', ''),
}

DEFAULT_INSTRUCTION = 'Please reason step by step, and put your final answer within \\boxed{}.'


@dataclasses.dataclass(frozen=True)
class MathOptions:
  """`config.task.kwargs` of math."""
  data_file: str = DEFAULT_DATA  # Problems file (jsonl/json/csv/parquet); default: the shipped sample.
  eval_file: str = ''  # Optional separate eval file ('' = hold out eval_size problems of data_file).
  layout: str = 'custom'  # Field preset: custom, imo_answerbench, aime2025, hmmt, beyond_aime.
  problem_field: str = 'problem'  # custom layout: field with the problem statement.
  answer_field: str = 'answer'  # custom layout: field with the reference answer (LaTeX or plain).
  id_field: str = 'id'  # custom layout: field with a problem id ('' or missing = the row number).
  instruction: str = DEFAULT_INSTRUCTION  # Appended to every problem.
  system_prompt: str = ''  # Optional system message.
  verify_timeout_s: float = 5.0  # Hard limit of one math-verify check (its worker is killed after it).
  verify_workers: int = 2  # math-verify worker processes (shared by all math tasks of the process).
  verify_memory_mb: int = 1024  # RLIMIT_AS of each math-verify worker.
  check_answers: bool = True  # Parse every reference answer with math-verify at load (~10-30 ms each).

  def check(self, path: str = 'task.kwargs') -> None:
    registry.check_file(f'{path}.data_file', self.data_file)
    if self.eval_file:
      registry.check_file(f'{path}.eval_file', self.eval_file)
    if self.layout != 'custom' and self.layout not in LAYOUTS:
      raise ConfigError(f'config.{path}.layout={self.layout!r} is not one of {["custom", *LAYOUTS]}.')
    if self.verify_timeout_s <= 0:
      raise ConfigError(f'config.{path}.verify_timeout_s={self.verify_timeout_s!r}: must be > 0.')
    if self.verify_workers < 1:
      raise ConfigError(f'config.{path}.verify_workers={self.verify_workers!r}: must be >= 1.')
    if self.verify_memory_mb < 256:
      raise ConfigError(f'config.{path}.verify_memory_mb={self.verify_memory_mb!r}: must be >= 256 (sympy).')

  def fields(self) -> tuple[str, str, str]:
    if self.layout == 'custom':
      return self.problem_field, self.answer_field, self.id_field
    return LAYOUTS[self.layout]


def load_problems(path: str, opts: MathOptions, field: str = 'task.kwargs.data_file',
                  reports: list[datasets.FileReport] | None = None) -> list[base.Example]:
  """The valid problems of a file (malformed rows skipped with a warning; the file's report appended to
  `reports`)."""
  problem_f, answer_f, id_f = opts.fields()

  def convert(n: int, row: dict[str, Any]) -> base.Example:
    problem = datasets.text_field(row, problem_f)
    answer = datasets.text_field(row, answer_f, allow_numbers=True)
    why = verifier_lib.gold_problem(answer) if opts.check_answers else None
    if why is not None:
      raise datasets.BadRow(why)
    uid = row.get(id_f) if id_f else None
    uid = str(uid) if uid not in (None, '') else f'row{n}'
    prompt = f'{problem}\n{opts.instruction}' if opts.instruction else problem
    return base.Example(uid=f'math:{uid}', prompt=prompt, answer=answer, system=opts.system_prompt or None)

  return datasets.build_examples(datasets.read_rows(path, field), convert, path=path, field=field, reports=reports)


class MathEnv(base.BaseEnv):
  """Single turn, scored by math-verify."""

  def __init__(self, example: base.Example, checker: verifier_lib.MathVerifier):
    super().__init__(example, max_turns=1)
    self.checker = checker

  def _step(self, action_text: str) -> base.StepResult:
    reward, info = self.checker.check(self.example.answer, action_text)
    return base.StepResult(None, reward, True, info)


class MathTask(base.DatasetTask):
  """Problems from a file, split into train / held-out eval."""

  def __init__(self, opts: MathOptions, *, max_turns: int, eval_size: int):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    self.file_reports = []
    problems = load_problems(opts.data_file, opts, reports=self.file_reports)
    evals = (load_problems(opts.eval_file, opts, 'task.kwargs.eval_file', self.file_reports) if opts.eval_file
             else None)
    self._train, self._eval = datasets.split(problems, eval_size, eval_examples=evals)
    self._checker: verifier_lib.MathVerifier | None = None

  @property
  def checker(self) -> verifier_lib.MathVerifier:
    if self._checker is None:  # Started on first use: building the task for a dry run spawns nothing.
      self._checker = verifier_lib.shared_verifier(self.opts.verify_workers, self.opts.verify_timeout_s,
                                                   self.opts.verify_memory_mb)
    return self._checker

  def make_env(self, example: base.Example) -> MathEnv:
    return MathEnv(example, self.checker)


@registry.register_task('math', MathOptions)
def _make(opts: MathOptions, *, max_turns: int, eval_size: int) -> MathTask:
  return MathTask(opts, max_turns=max_turns, eval_size=eval_size)
