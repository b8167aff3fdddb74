"""Environment protocol, task base class, and the episode -> token layout.

An episode alternates model actions and environment observations:

    prompt | action_1 | observation_1 | action_2 | ... | action_n

and becomes ONE token sequence (a `sao_jax.types.Trajectory`): `action_mask` is True exactly on the tokens
the policy generated (never on prompt or observation tokens), `behavior_logprobs` carries the sampler's
log-probs on those tokens (0 elsewhere), and the scalar reward sits on the last action token (DESIGN.md,
Contracts). An episode cut by a turn or token limit is `truncated` (not terminal) and gets reward 0: the
learner bootstraps from the value of its last state, or drops it.

Observations come in two layouts:
  * 'inline': the observation text is encoded as-is and appended inside the assistant's stream (the model
    stops at a tool-closing tag such as `</calc>`, the env appends `<result>408</result>`, the model goes on);
  * 'message': the observation is a new chat message (role `observation_role`) rendered by the tokenizer's
    chat template; the template's tokens that close the assistant turn and open the next one are observation
    tokens (the model did not generate them).
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from absl import logging
import numpy as np

from sao_jax import types
from sao_jax.tokenizers import Tokenizer

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
  token budget) ended the episode, and `info['error']` is set when the environment itself failed (the
  episode then carries no reward and the trainer drops it).
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
  `info['truncated']=True` (the model was still working, so this is not a terminal state).
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
      obs, reward, done = None, 0.0, True
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
# Episode -> token layout.


@dataclasses.dataclass
class Turn:
  """One model turn and the observation that followed it (empty when the episode ended)."""
  action_ids: Sequence[int]
  action_logprobs: Sequence[float]
  observation_ids: Sequence[int] = ()


def episode_to_trajectory(prompt_ids: Sequence[int], turns: Sequence[Turn], reward: float, *,
                          truncated: bool = False, policy_version: int = 0, group_id: int = -1,
                          info: dict[str, Any] | None = None,
                          sampling_logprobs: Sequence[Sequence[float]] | None = None) -> types.Trajectory:
  """Lays an episode out as one token sequence.

  tokens = prompt ++ a_1 ++ o_1 ++ a_2 ++ o_2 ++ ... ++ a_n (++ o_n, normally empty);
  action_mask[t] = 1 iff t lies in some a_k; behavior_logprobs[t] = the sampler's log-prob there, 0 elsewhere.
  The reward is the episode's scalar (`Trajectory.reward`); the learner puts it on `last_action_index`.
  A truncated episode gets reward 0 whatever `reward` says (a cut episode is not terminal; DESIGN.md).

  Args:
    prompt_ids: the rendered first messages, ending with the assistant generation prompt.
    turns: model turns, in order, each with the observation that followed it.
    reward: the verifier's reward.
    truncated: a length or turn limit ended the episode.
    policy_version: params version that generated the (first) action.
    group_id: prompt index for group baselines.
    info: task metadata, copied into the trajectory.
    sampling_logprobs: optional per-turn log-probs under the distribution actually sampled from.

  Returns:
    The `Trajectory`.

  Raises:
    ValueError: a turn whose log-probs do not match its action length, or an episode without action tokens.
  """
  tokens = [np.asarray(prompt_ids, np.int32)]
  mask = [np.zeros(len(prompt_ids), bool)]
  logp = [np.zeros(len(prompt_ids), np.float32)]
  samp = [np.zeros(len(prompt_ids), np.float32)] if sampling_logprobs is not None else None
  for k, turn in enumerate(turns):
    a = np.asarray(turn.action_ids, np.int32)
    lp = np.asarray(turn.action_logprobs, np.float32)
    if lp.shape != a.shape:
      raise ValueError(f'Turn {k}: {lp.shape[0]} log-probs for {a.shape[0]} action tokens.')
    o = np.asarray(turn.observation_ids, np.int32)
    tokens += [a, o]
    mask += [np.ones(a.size, bool), np.zeros(o.size, bool)]
    logp += [lp, np.zeros(o.size, np.float32)]
    if samp is not None:
      sp = np.asarray(sampling_logprobs[k], np.float32)
      if sp.shape != a.shape:
        raise ValueError(f'Turn {k}: {sp.shape[0]} sampling log-probs for {a.shape[0]} action tokens.')
      samp += [sp, np.zeros(o.size, np.float32)]
  action_mask = np.concatenate(mask)
  if not action_mask.any():
    raise ValueError('An episode needs at least one action token.')
  return types.Trajectory(
      tokens=np.concatenate(tokens), action_mask=action_mask, behavior_logprobs=np.concatenate(logp),
      reward=0.0 if truncated else float(reward), truncated=bool(truncated), policy_version=policy_version,
      group_id=group_id, sampling_logprobs=None if samp is None else np.concatenate(samp),
      info=dict(info or {}))


def _find_last(ids: Sequence[int], targets: set[int], start: int) -> int:
  for i in range(len(ids) - 1, start - 1, -1):
    if ids[i] in targets:
      return i
  return -1


def message_observation_ids(tokenizer: Tokenizer, history: list[Message], action_text: str,
                            action_ended_with_stop: bool, observation: Message, *,
                            _neutral: bool = False) -> list[int]:
  """Observation tokens of a 'message' observation, from the chat template.

  With R1 = template(history, gen=True), R3 = template(history + [assistant], gen=False) and
  R2 = template(history + [assistant, observation], gen=True): the observation tokens are the tail of R3
  after the stop token that closes the assistant turn (the stop token itself too, when the model did not
  emit it) followed by R2[len(R3):]. Requires the template to render prefixes consistently (ChatML does);
  otherwise it falls back to rendering the observation after a neutral one-turn history.
  """
  assistant = {'role': 'assistant', 'content': action_text}
  r1, _ = tokenizer.apply_chat_template(history, add_generation_prompt=True)
  r3, _ = tokenizer.apply_chat_template(history + [assistant], add_generation_prompt=False)
  r2, _ = tokenizer.apply_chat_template(history + [assistant, observation], add_generation_prompt=True)
  if list(r2[:len(r3)]) != list(r3) or list(r3[:len(r1)]) != list(r1):
    if _neutral:
      raise ValueError('The chat template renders conversations inconsistently (a longer conversation does '
                       'not extend a shorter one); message observations cannot be laid out.')
    logging.log_first_n(logging.WARNING, 'Chat template is not prefix-consistent; rendering observations '
                        'after a neutral history.', 1)
    return message_observation_ids(tokenizer, [{'role': 'user', 'content': '.'}], '.', True, observation,
                                   _neutral=True)
  close = _find_last(r3, set(tokenizer.stop_ids), len(r1))
  if close < 0:
    trailer = []
  else:
    trailer = list(r3[close + 1:]) if action_ended_with_stop else list(r3[close:])
  return trailer + list(r2[len(r3):])


# ------------------------------------------------------------------------------------------------------------
# A reference single-episode driver (the rollout workers batch this; tests and eval use it as is).

GenerateFn = Callable[[list[int], int, tuple[int, ...]], tuple[Sequence[int], Sequence[float]]]


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Budgets of one episode: `max_turns` model turns, `max_new_tokens` per turn, `max_seq_len` in all."""
  max_turns: int = 1
  max_new_tokens: int = 64
  max_seq_len: int = 256

  @classmethod
  def from_config(cls, config) -> 'EpisodeLimits':
    """From `config.task.max_turns`, `config.sampler.max_new_tokens` and `config.sampler.max_seq_len`."""
    return cls(max_turns=int(config.task.max_turns), max_new_tokens=int(config.sampler.max_new_tokens),
               max_seq_len=int(config.sampler.max_seq_len))


def stop_ids_for(env: Env, tokenizer: Tokenizer) -> tuple[int, ...]:
  """The tokenizer's end-of-turn ids plus the env's stop texts, each of which must be a single token."""
  ids = list(tokenizer.stop_ids)
  for text in env.stop_texts:
    enc = tokenizer.encode(text)
    if len(enc) != 1:
      raise ValueError(f'Stop text {text!r} of {type(env).__name__} encodes to {len(enc)} tokens; inline '
                       'observations need it to be one token (use observation_mode="message").')
    ids.append(enc[0])
  return tuple(dict.fromkeys(ids))


def run_episode(env: Env, tokenizer: Tokenizer, generate: GenerateFn, *, limits: EpisodeLimits,
                policy_version: int = 0, group_id: int = -1, step_timeout_s: float | None = None,
                info: dict[str, Any] | None = None) -> types.Trajectory:
  """Plays one episode with `generate(context_ids, max_new_tokens, stop_ids) -> (action_ids, logprobs)`.

  The generator returns the tokens it sampled, including the stop token when it stopped on one. Budgets:
  each turn gets `min(max_new_tokens, max_seq_len - len(context))` tokens; a turn that ends without a stop
  token (length cut), or an observation that would overflow `max_seq_len`, truncates the episode; the turn
  limit is the env's (`Env.max_turns`, cut reported in `info['truncated']`). Env failures end the episode
  with `info['error']` (see `guarded_step`).
  """
  messages = env.reset()
  prompt_ids, _ = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  prompt_ids = list(prompt_ids)
  if len(prompt_ids) >= limits.max_seq_len:
    raise ValueError(f'Prompt of {len(prompt_ids)} tokens does not fit max_seq_len={limits.max_seq_len}.')
  stop_ids = stop_ids_for(env, tokenizer)
  end_ids = set(tokenizer.stop_ids)
  context = list(prompt_ids)
  turns: list[Turn] = []
  reward, truncated = 0.0, False
  ep_info: dict[str, Any] = dict(info or {})
  for _ in range(max(env.max_turns, 1)):
    budget = min(limits.max_new_tokens, limits.max_seq_len - len(context))
    action_ids, logprobs = generate(list(context), budget, stop_ids)
    action_ids = list(action_ids)[:budget]
    logprobs = list(logprobs)[:len(action_ids)]
    turn = Turn(action_ids, logprobs)
    turns.append(turn)
    context += action_ids
    stopped = bool(action_ids) and action_ids[-1] in stop_ids
    if not stopped:
      truncated, ep_info['truncated'], ep_info['cut_by'] = True, True, 'max_new_tokens'
      break
    action_text = tokenizer.decode(action_ids)
    obs, reward, done, step_info = guarded_step(env, action_text, timeout_s=step_timeout_s)
    ep_info.update(step_info)
    if done:
      truncated = bool(step_info.get('truncated', False))
      break
    if obs is None:
      raise RuntimeError(f'{type(env).__name__}.step returned no observation on a non-final turn.')
    if env.observation_mode == 'inline':
      obs_ids = list(tokenizer.encode(obs))
    else:
      obs_ids = message_observation_ids(
          tokenizer, messages, action_text, action_ids[-1] in end_ids,
          {'role': env.observation_role, 'content': obs})
      messages = messages + [{'role': 'assistant', 'content': action_text},
                             {'role': env.observation_role, 'content': obs}]
    if len(context) + len(obs_ids) >= limits.max_seq_len:
      truncated, ep_info['truncated'], ep_info['cut_by'] = True, True, 'max_seq_len'
      break
    turn.observation_ids = obs_ids
    context += obs_ids
  if 'error' in ep_info:
    reward = 0.0
  ep_info['num_turns'] = len(turns)
  return episode_to_trajectory(prompt_ids, turns, reward, truncated=truncated, policy_version=policy_version,
                               group_id=group_id, info=ep_info)


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
  """
  name: str = ''

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

  def metrics(self) -> dict[str, float]:
    """Task-level metrics to log (e.g. the drift phase); empty by default."""
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

  def train_iterator(self, seed: int) -> ShuffledIterator:
    return ShuffledIterator(self._train, seed)

  def eval_set(self) -> list[Example]:
    return list(self._eval)
