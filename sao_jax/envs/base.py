"""Environment protocol, task base class, guarded env steps and resumable example iterators (text level).

An episode alternates model actions and environment observations, as text: `Env.reset()` gives the first
chat messages, `Env.step(action_text)` the observation that follows an action (or the end of the episode and
its reward). Observations come in two layouts (`Env.observation_mode`): 'inline' (the observation text is
appended inside the assistant's stream, after a tool-closing stop text such as `</calc>`) or 'message' (a new
chat message of role `observation_role`). Tokens, log-probs and the episode -> token layout live in
`sao_jax.rollout`; this module imports no jax and no models.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from absl import logging
import numpy as np

Message = dict[str, str]


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem.

  Attributes:
    uid: stable identifier (dataset id or a hash of the generated problem); eval results are keyed by it.
    prompt: the user message.
    answer: the reference answer, as a string.
    data: task-specific payload (hidden tests, drift phase, source row number); JSON-serialisable.
    system: optional system message.
  """
  uid: str
  prompt: str
  answer: str
  data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  system: str | None = None

  def messages(self) -> list[Message]:
    """The first chat messages of an episode on this example."""
    msgs = [] if self.system is None else [{'role': 'system', 'content': self.system}]
    return msgs + [{'role': 'user', 'content': self.prompt}]

  def to_json(self) -> dict[str, Any]:
    return {'uid': self.uid, 'prompt': self.prompt, 'answer': self.answer, 'data': dict(self.data)}


class StepResult(NamedTuple):
  """What `Env.step` returns; unpacks as `(observation, reward, done, info)`."""
  observation: str | None
  reward: float
  done: bool
  info: dict[str, Any]


@runtime_checkable
class Env(Protocol):
  """One episode of a task.

  `reset()` returns the first chat messages; `step(action_text)` consumes the decoded text of one model turn
  and returns `(observation | None, reward, done, info)`. `info['truncated']` is True when a limit (turn or
  token budget) ended the episode (an observation returned with it is kept as the episode's last tokens),
  and `info['error']` is set when the environment itself failed (the episode then carries no reward and the
  trainer drops it).
  """
  max_turns: int
  observation_mode: str  # 'inline' or 'message'.
  observation_role: str  # Chat role of 'message' observations.
  stop_texts: tuple[str, ...]  # Texts ending a model turn besides the tokenizer's stop ids ('</calc>').

  def reset(self, example: Example | None = None) -> list[Message]:
    ...

  def step(self, action_text: str) -> StepResult:
    ...


class BaseEnv(abc.ABC):
  """Turn counting and the turn limit; subclasses implement `_step`.

  When `_step` returns `done=False` on the last allowed turn, the episode is cut: `done=True`, reward 0,
  `info['truncated']=True`, `info['cut_by']='max_turns'` (the model was still working, so this is not a
  terminal state). The observation `_step` returned is kept: the episode runner appends it, so that the cut
  episode ends where the next turn would start (the state the learner bootstraps from).
  """
  observation_mode: str = 'message'
  observation_role: str = 'user'
  stop_texts: tuple[str, ...] = ()

  def __init__(self, example: Example, *, max_turns: int = 1):
    if max_turns < 1:
      raise ValueError(f'max_turns must be >= 1, got {max_turns}.')
    self.example = example
    self.max_turns = max_turns
    self.turn = 0
    self.done = False

  def reset(self, example: Example | None = None) -> list[Message]:
    if example is not None:
      self.example = example
    self.turn = 0
    self.done = False
    self._reset()
    return self.example.messages()

  def _reset(self) -> None:
    """Hook for subclasses with per-episode state."""

  def step(self, action_text: str) -> StepResult:
    if self.done:
      raise RuntimeError('step() called on a finished episode; call reset() first.')
    self.turn += 1
    obs, reward, done, info = self._step(action_text)
    info = dict(info)
    info.setdefault('turn', self.turn)
    if not done and self.turn >= self.max_turns:
      reward, done = 0.0, True
      info['truncated'] = True
      info['cut_by'] = 'max_turns'
    self.done = done
    return StepResult(obs, float(reward), bool(done), info)

  @abc.abstractmethod
  def _step(self, action_text: str) -> StepResult:
    """One model turn -> (observation, reward, done, info)."""


def guarded_step(env: Env, action_text: str, *, timeout_s: float | None = None) -> StepResult:
  """`env.step` that never raises nor hangs the caller.

  An exception, or no answer within `timeout_s`, ends the episode: `(None, 0.0, True, {'error': ...})`. A
  timed-out step keeps running in an abandoned daemon thread (Python cannot kill a thread); envs that do real
  work bound it themselves (the code sandbox and the math verifier kill their worker processes), so this is
  the last line of defence, not the main one.
  """
  def _run():
    try:
      return env.step(action_text)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('Env %s raised on step: %r', type(env).__name__, e)
      return StepResult(None, 0.0, True, {'error': f'{type(e).__name__}: {e}'})

  if timeout_s is None:
    return _run()
  box: list[StepResult] = []
  thread = threading.Thread(target=lambda: box.append(_run()), daemon=True, name='env-step')
  thread.start()
  thread.join(timeout_s)
  if not box:
    logging.warning('Env %s step timed out after %.1fs.', type(env).__name__, timeout_s)
    return StepResult(None, 0.0, True, {'error': f'timeout: env.step took more than {timeout_s}s'})
  return box[0]


# ------------------------------------------------------------------------------------------------------------
# Tasks and their example streams.


class ExampleIterator(abc.ABC):
  """An infinite, seeded, resumable stream of training examples.

  `state()` is a small JSON-able dict saved with checkpoints; `restore(state)` resumes so that the next
  examples are exactly those the saved iterator would have produced.
  """

  def __iter__(self):
    return self

  @abc.abstractmethod
  def __next__(self) -> Example:
    ...

  @abc.abstractmethod
  def state(self) -> dict[str, Any]:
    ...

  @abc.abstractmethod
  def restore(self, state: Mapping[str, Any]) -> None:
    ...


def _check_state(state: Mapping[str, Any], kind: str, keys: Sequence[str]) -> None:
  if state.get('kind') != kind or any(k not in state for k in keys):
    raise ValueError(f'Iterator state {dict(state)!r} is not a {kind!r} state with keys {list(keys)}.')


class GeneratedIterator(ExampleIterator):
  """Example k is drawn from `np.random.default_rng([seed, k, attempt])`: O(1) resume at any index.

  Examples whose uid is in `exclude` (the eval set) are redrawn (attempt 1, 2, ...), so train and eval are
  disjoint.
  """

  def __init__(self, generate: Callable[[np.random.Generator], Example], seed: int,
               exclude: frozenset[str] = frozenset(), max_attempts: int = 1000):
    self._generate = generate
    self._seed = int(seed)
    self._exclude = exclude
    self._max_attempts = max_attempts
    self._index = 0

  def example_at(self, index: int) -> Example:
    for attempt in range(self._max_attempts):
      ex = self._generate(np.random.default_rng([self._seed, index, attempt]))
      if ex.uid not in self._exclude:
        return ex
    raise RuntimeError(f'{self._max_attempts} draws all fell in the eval set: the problem space is too small '
                       'for config.task.eval_size (raise the difficulty or lower eval_size).')

  def __next__(self) -> Example:
    ex = self.example_at(self._index)
    self._index += 1
    return ex

  @property
  def index(self) -> int:
    return self._index

  def state(self) -> dict[str, Any]:
    return {'kind': 'generated', 'seed': self._seed, 'index': self._index}

  def restore(self, state: Mapping[str, Any]) -> None:
    _check_state(state, 'generated', ('seed', 'index'))
    self._seed, self._index = int(state['seed']), int(state['index'])


class ShuffledIterator(ExampleIterator):
  """Epochs over a fixed list, each in the order `default_rng([seed, epoch]).permutation(n)`."""

  def __init__(self, examples: Sequence[Example], seed: int):
    if not examples:
      raise ValueError('ShuffledIterator needs at least one example.')
    self._examples = list(examples)
    self._seed = int(seed)
    self._epoch = 0
    self._pos = 0
    self._order = self._permutation(0)

  def _permutation(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self._seed, epoch]).permutation(len(self._examples))

  def __next__(self) -> Example:
    if self._pos >= len(self._examples):
      self._epoch, self._pos = self._epoch + 1, 0
      self._order = self._permutation(self._epoch)
    ex = self._examples[int(self._order[self._pos])]
    self._pos += 1
    return ex

  @property
  def epoch(self) -> int:
    return self._epoch

  def state(self) -> dict[str, Any]:
    return {'kind': 'shuffled', 'seed': self._seed, 'epoch': self._epoch, 'position': self._pos,
            'size': len(self._examples)}

  def restore(self, state: Mapping[str, Any]) -> None:
    _check_state(state, 'shuffled', ('seed', 'epoch', 'position', 'size'))
    if int(state['size']) != len(self._examples):
      raise ValueError(f'Iterator state was saved over {state["size"]} examples; this dataset has '
                       f'{len(self._examples)} (did the data file change?).')
    self._seed, self._epoch, self._pos = int(state['seed']), int(state['epoch']), int(state['position'])
    self._order = self._permutation(self._epoch)


class Task(abc.ABC):
  """A named task: a training stream, a held-out eval set, and envs.

  Attributes:
    name: registry name.
    max_turns: turn limit of an episode (`config.task.max_turns`).
    eval_size: size of the held-out eval set (`config.task.eval_size`).
    file_reports: a `datasets.FileReport` per data file the task read (rows kept and skipped); none for a
      generated task.
  """
  name: str = ''
  file_reports: Sequence[Any] = ()

  def __init__(self, *, max_turns: int, eval_size: int):
    self.max_turns = int(max_turns)
    self.eval_size = int(eval_size)

  @abc.abstractmethod
  def train_iterator(self, seed: int) -> ExampleIterator:
    """A fresh training stream; disjoint from `eval_set()`."""

  @abc.abstractmethod
  def eval_set(self) -> list[Example]:
    """The held-out examples (fixed, independent of the training seed)."""

  @abc.abstractmethod
  def make_env(self, example: Example) -> Env:
    """An env bound to `example` (call `reset()` to start)."""

  def solution(self, example: Example) -> str:
    """A correct final response to `example` (the assistant's reply text) of a single-turn task. Tasks without
    one raise NotImplementedError."""
    raise NotImplementedError(f'Task {self.name or type(self).__name__!r} has no reference solutions '
                              '(Task.solution / Task.solution_actions), so it cannot be warm-started '
                              '(config.sft.steps).')

  def solution_actions(self, example: Example) -> list[str]:
    """The model turns of a correct episode on `example`, in order: the data of a supervised warm start
    (`sao_jax.sft`).

    Each is the text of one model turn, as the env's `step` receives it: it ends where a model would stop,
    at the end of the assistant turn or at one of the env's `stop_texts` (an inline tool call ends with
    `</calc>`). Only the actions come from here: the observations between them are what `make_env(example)`
    answers when the actions are played through it, so the reference episode is laid out exactly as the
    rollout lays out a sampled one (`sao_jax.rollout.replay_episode`). Default: the single reply
    `[self.solution(example)]`; multi-turn tasks override it.
    """
    return [self.solution(example)]

  def file_problems(self) -> list[Example]:
    """The problems read from data files that the run uses (train and eval), each with `data['file']` and
    `data['row']`; what the start-of-run data check (`envs.data_check`) measures. Empty by default (a generated
    task)."""
    return []

  def filter_problems(self, keep: Callable[[Example], bool]) -> None:
    """Keeps only the file problems `keep` accepts, in train and eval alike (the data check drops the prompts
    that do not fit the episode budget). Call it before `train_iterator`. Nothing to filter by default."""

  def set_step(self, step: int) -> None:
    """Told the learner's step after every update and on resume (drift's `unit='steps'` schedule reads it);
    nothing by default."""

  def metrics(self) -> dict[str, float]:
    """Task-level metrics to log (e.g. the drift phase), read by the trainer into every metrics row; empty by
    default."""
    return {}

  def close(self) -> None:
    """Releases worker processes; the task is unusable afterwards."""


class DatasetTask(Task):
  """A task over a fixed list of examples split into train and held-out eval (math, code).

  Subclasses set `self._train` and `self._eval` (e.g. with `datasets.split`) and implement `make_env`.
  """
  _train: list[Example]
  _eval: list[Example]

  def train_examples(self) -> list[Example]:
    return list(self._train)

  def file_problems(self) -> list[Example]:
    return self._train + self._eval

  def filter_problems(self, keep: Callable[[Example], bool]) -> None:
    self._train = [ex for ex in self._train if keep(ex)]
    self._eval = [ex for ex in self._eval if keep(ex)]

  def train_iterator(self, seed: int) -> ShuffledIterator:
    return ShuffledIterator(self._train, seed)

  def eval_set(self) -> list[Example]:
    return list(self._eval)
