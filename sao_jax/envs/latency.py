"""`latency`: an agentic-like workload for the loop benchmark: tool calls that take long-tailed wall time.

Each episode plans, at `reset`, how many tool calls it makes and how long each takes (a sandbox or a remote
service answering), from its own random stream:

  tool calls  n ~ Geometric on {0, 1, ...} with mean `mean_tool_calls`, capped at `max_turns - 1`
              (P[n = k] = (1 - q) q^k, q = m / (1 + m): a long tail of long episodes);
  latency     L ~ LogNormal(log(latency_median_s), latency_sigma), clipped to [latency_min_s, latency_max_s].

Model turn k <= n is a tool call: it ends at a stop character (`stop_chars`, or the end-of-turn token), the env
waits L_k (`sleep`, injectable: tests pass a fake and no real time passes) and answers inline with
`<result>` + `obs_chars` digits + `</result>`. Turn n + 1 is the answer: reward 1 if its text contains the
example's target digit, `format_reward` if it contains another digit, else 0; the episode ends. A turn that
runs out of its token budget is cut by the episode runner (truncated), which with the random policy of a
benchmark gives the generation lengths their tail: a turn's length is the wait for a stop character.

The env records what it did (`info['tool_latencies_s']`, `info['planned_tool_calls']`) so a benchmark can
read the latency distribution off the trajectories.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import arith
from sao_jax.envs import base
from sao_jax.envs import registry

_OPEN, _CLOSE = '<result>', '</result>'


@dataclasses.dataclass(frozen=True)
class LatencyOptions:
  """`config.task.kwargs` of latency."""
  latency_median_s: float = 0.08  # Median wall time of a tool call (log-normal).
  latency_sigma: float = 0.8  # Log-normal sigma of the tool-call time (0 = constant).
  latency_min_s: float = 0.02  # Tool-call times are clipped to [latency_min_s, latency_max_s].
  latency_max_s: float = 0.5
  mean_tool_calls: float = 2.0  # Mean tool calls per episode (geometric, capped at max_turns - 1).
  stop_chars: str = ';'  # Characters that end a model turn (besides end-of-turn): more of them, shorter turns.
  obs_chars: int = 8  # Digits in a tool result.
  format_reward: float = 0.25  # Reward of an answer with a digit that is not the target one.
  seed: int = 0  # Seed of the episodes' plans (tool calls, latencies).

  def check(self, path: str = 'task.kwargs') -> None:
    if not 0 < self.latency_min_s <= self.latency_median_s <= self.latency_max_s:
      raise ConfigError(f'config.{path}: need 0 < latency_min_s <= latency_median_s <= latency_max_s, got '
                        f'({self.latency_min_s}, {self.latency_median_s}, {self.latency_max_s}).')
    if self.latency_sigma < 0:
      raise ConfigError(f'config.{path}.latency_sigma={self.latency_sigma!r}: must be >= 0.')
    if self.mean_tool_calls < 0:
      raise ConfigError(f'config.{path}.mean_tool_calls={self.mean_tool_calls!r}: must be >= 0.')
    if not self.stop_chars or len(set(self.stop_chars)) != len(self.stop_chars) or any(
        c.isdigit() for c in self.stop_chars):
      raise ConfigError(f'config.{path}.stop_chars={self.stop_chars!r}: distinct non-digit characters, at '
                        'least one.')
    if self.obs_chars < 0:
      raise ConfigError(f'config.{path}.obs_chars={self.obs_chars!r}: must be >= 0.')
    if not 0.0 <= self.format_reward < 1.0:
      raise ConfigError(f'config.{path}.format_reward={self.format_reward!r}: must be in [0, 1).')


def plan_episode(rng: np.random.Generator, opts: LatencyOptions, max_turns: int) -> list[float]:
  """The tool-call latencies (seconds) of one episode; their number is its tool-call count (module docstring)."""
  m = float(opts.mean_tool_calls)
  n = 0 if m == 0 else int(rng.geometric(1.0 / (1.0 + m))) - 1  # numpy's geometric counts trials (>= 1).
  n = min(n, max(max_turns - 1, 0))
  lat = np.exp(math.log(opts.latency_median_s) + opts.latency_sigma * rng.standard_normal(n))
  return np.clip(lat, opts.latency_min_s, opts.latency_max_s).tolist()


def score(text: str, answer: str, opts: LatencyOptions) -> float:
  """1 if `text` contains the target digit, `format_reward` if another digit, else 0."""
  if answer in text:
    return 1.0
  return opts.format_reward if any(c.isdigit() for c in text) else 0.0


class LatencyEnv(base.BaseEnv):
  """See the module docstring; `sleep(seconds)` is called for every tool call."""
  observation_mode = 'inline'

  def __init__(self, example: base.Example, opts: LatencyOptions, *, max_turns: int, rng: np.random.Generator,
               sleep: Callable[[float], None] = time.sleep):
    super().__init__(example, max_turns=max_turns)
    self.opts = opts
    self.stop_texts = tuple(opts.stop_chars)
    self._rng = rng
    self._sleep = sleep
    self.plan: list[float] = []
    self.waited: list[float] = []

  def _reset(self) -> None:
    self.plan = plan_episode(self._rng, self.opts, self.max_turns)
    self.waited = []

  def _step(self, action_text: str) -> base.StepResult:
    info = {'planned_tool_calls': len(self.plan)}
    if self.turn <= len(self.plan):
      latency = self.plan[self.turn - 1]
      self._sleep(latency)
      self.waited.append(latency)
      digits = ''.join(str(d) for d in self._rng.integers(0, 10, self.opts.obs_chars))
      return base.StepResult(f'{_OPEN}{digits}{_CLOSE}', 0.0, False,
                             {**info, 'tool_latencies_s': list(self.waited)})
    reward = score(action_text, self.example.answer, self.opts)
    return base.StepResult(None, reward, True, {**info, 'tool_latencies_s': list(self.waited),
                                                'correct': reward == 1.0})


class LatencyTask(arith.GeneratedTask):
  """Episodes of `LatencyEnv`; env k of the task plans from `default_rng([seed, k])`.

  Args:
    sleep: what a tool call waits with (default `time.sleep`; tests inject a fake).
  """

  def __init__(self, opts: LatencyOptions, *, max_turns: int, eval_size: int,
               sleep: Callable[[float], None] = time.sleep):
    super().__init__(max_turns=max_turns, eval_size=eval_size)
    self.opts = opts
    self.sleep = sleep
    self._envs = itertools.count()  # next() is atomic under the GIL: actor threads share the task.

  def make_example(self, rng: np.random.Generator) -> base.Example:
    digit = str(int(rng.integers(0, 10)))
    nonce = int(rng.integers(0, 10 ** 9))
    return base.Example(uid=f'latency:{nonce}', prompt=f'Call the tool, then write the digit {digit}.',
                        answer=digit, data={'nonce': nonce})

  def make_env(self, example: base.Example) -> LatencyEnv:
    rng = np.random.default_rng([int(self.opts.seed), next(self._envs)])
    return LatencyEnv(example, self.opts, max_turns=self.max_turns, rng=rng, sleep=self.sleep)


@registry.register_task('latency', LatencyOptions, min_turns=1)
def _make(opts: LatencyOptions, *, max_turns: int, eval_size: int) -> LatencyTask:
  return LatencyTask(opts, max_turns=max_turns, eval_size=eval_size)
