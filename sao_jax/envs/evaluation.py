"""Scoring of an eval run: greedy accuracy, avg@k, unbiased pass@k, per-problem JSONL and a summary table.

The sampler-driven part (`python -m sao_jax.eval`) generates; this module only scores what it produced.

Estimators, for a problem with n samples of which c are correct:
  pass@k = 1 - C(n-c, k) / C(n, k)  (Chen et al. 2021, unbiased; = 1 - prod_{i=n-c+1}^{n} (1 - k/i)),
  avg@k  = mean reward of the first k samples (with 0/1 rewards: the expected accuracy of one sample),
both averaged over problems. Problems whose episode ended with an env error are counted and excluded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from sao_jax import paths
from sao_jax.envs import base

if TYPE_CHECKING:  # Annotations only: envs imports no jax (sao_jax.structs holds jax arrays).
  from sao_jax import structs


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem: P(at least one of k samples drawn without replacement is correct)."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f'pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}.')
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def avg_at_k(rewards: Sequence[float], k: int) -> float:
  """Mean reward of the first k samples."""
  if not 1 <= k <= len(rewards):
    raise ValueError(f'avg_at_k needs 1 <= k <= {len(rewards)} samples; got k={k}.')
  return float(np.mean(np.asarray(rewards[:k], np.float64)))


@dataclasses.dataclass
class ProblemResult:
  """Everything the eval produced for one problem.

  Attributes:
    uid, prompt, answer: the example.
    greedy_response / greedy_reward / greedy_correct: the temperature-0 episode (None if not run).
    responses / rewards / correct: the k sampled episodes, in order.
    errors: env errors of any episode of this problem (the problem is excluded from the metrics if any).
    info: task metadata (e.g. drift phase, turns used).
  """
  uid: str
  prompt: str
  answer: str
  greedy_response: str | None = None
  greedy_reward: float | None = None
  greedy_correct: bool | None = None
  responses: list[str] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  correct: list[bool] = dataclasses.field(default_factory=list)
  errors: list[str] = dataclasses.field(default_factory=list)
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    n, c = len(self.correct), sum(self.correct)
    d['num_samples'], d['num_correct'] = n, c
    return d


def response_text(traj: structs.Trajectory, decode: Callable[[Sequence[int]], str]) -> str:
  """Everything after the prompt (actions and observations), decoded."""
  first = int(np.argmax(traj.action_mask)) if traj.action_mask.any() else len(traj.tokens)
  return decode(traj.tokens[first:].tolist())


def is_correct(traj: structs.Trajectory) -> bool:
  """The task's verdict (`info['correct']`), else reward >= 1; never for truncated or failed episodes."""
  if traj.truncated or 'error' in traj.info:
    return False
  return bool(traj.info.get('correct', traj.reward >= 1.0))


def problem_result(example: base.Example, *, greedy: structs.Trajectory | None = None,
                   samples: Sequence[structs.Trajectory] = (),
                   decode: Callable[[Sequence[int]], str]) -> ProblemResult:
  """Collects one problem's greedy and sampled episodes; env errors go to `errors`."""
  errors = [str(t.info['error']) for t in ([greedy] if greedy is not None else []) + list(samples)
            if 'error' in t.info]
  ref = greedy if greedy is not None else (samples[0] if samples else None)
  info = {} if ref is None else {k: ref.info[k] for k in ('phase',) if k in ref.info}
  return ProblemResult(
      uid=example.uid, prompt=example.prompt, answer=example.answer,
      greedy_response=None if greedy is None else response_text(greedy, decode),
      greedy_reward=None if greedy is None else float(greedy.reward),
      greedy_correct=None if greedy is None else is_correct(greedy),
      responses=[response_text(t, decode) for t in samples], rewards=[float(t.reward) for t in samples],
      correct=[is_correct(t) for t in samples], errors=errors, info=info)


def default_ks(n: int) -> list[int]:
  """1, 2, 4, ... up to n, and n itself."""
  ks = [k for k in (2 ** i for i in range(20)) if k <= n]
  return ks + ([n] if n and n not in ks else [])


def summarize(results: Sequence[ProblemResult], ks: Iterable[int] | None = None) -> dict[str, float]:
  """Metrics over problems: greedy_accuracy, avg@k, pass@k, counts.

  Every problem scored must have the same number n of samples (pass@k needs k <= n); `ks` defaults to
  `default_ks(n)`.
  """
  ok = [r for r in results if not r.errors]
  out: dict[str, float] = {'num_problems': float(len(results)), 'num_errors': float(len(results) - len(ok))}
  greedy = [r.greedy_correct for r in ok if r.greedy_correct is not None]
  if greedy:
    out['greedy_accuracy'] = float(np.mean(greedy))
    out['greedy_reward'] = float(np.mean([r.greedy_reward for r in ok if r.greedy_reward is not None]))
  sampled = [r for r in ok if r.correct]
  if sampled:
    ns = {len(r.correct) for r in sampled}
    if len(ns) != 1:
      raise ValueError(f'Problems have different sample counts {sorted(ns)}; pass@k needs one n.')
    n = ns.pop()
    for k in (default_ks(n) if ks is None else ks):
      if not 1 <= k <= n:
        raise ValueError(f'k={k} is outside [1, n={n}].')
      out[f'pass@{k}'] = float(np.mean([pass_at_k(n, sum(r.correct), k) for r in sampled]))
      out[f'avg@{k}'] = float(np.mean([avg_at_k(r.rewards, k) for r in sampled]))
    out['num_samples'] = float(n)
  return out


def write_jsonl(path: str, results: Iterable[ProblemResult]) -> int:
  """Writes one JSON object per problem, all or nothing (`paths.write_text`; `path` may be a URI); returns the
  count."""
  lines = [json.dumps(r.to_json(), ensure_ascii=False) + '\n' for r in results]
  paths.makedirs(os.path.dirname(paths.absolute(path)))
  paths.write_text(path, ''.join(lines))
  return len(lines)


def read_jsonl(path: str) -> list[ProblemResult]:
  fields = {f.name for f in dataclasses.fields(ProblemResult)}
  with paths.open_file(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [ProblemResult(**{k: v for k, v in row.items() if k in fields}) for row in rows]


def format_table(summary: dict[str, float], *, title: str = '') -> str:
  """A fixed-width two-column table, metrics in a stable order (counts, greedy, avg@k, pass@k by k)."""
  def order(key: str) -> tuple[int, int, str]:
    if key.startswith('num_'):
      return (0, 0, key)
    if key.startswith('greedy'):
      return (1, 0, key)
    head, _, k = key.partition('@')
    return (2 if head == 'avg' else 3, int(k) if k.isdigit() else 0, key)

  rows = []
  for key in sorted(summary, key=order):
    v = summary[key]
    rows.append((key, str(int(v)) if key.startswith('num_') and float(v).is_integer() else f'{v:.4f}'))
  width = max([len(k) for k, _ in rows] + [6])
  vwidth = max([len(v) for _, v in rows] + [5])
  rule = '-' * (width + vwidth + 3)
  lines = ([title] if title else []) + [rule, f'{"metric":<{width}} | {"value":>{vwidth}}', rule]
  lines += [f'{k:<{width}} | {v:>{vwidth}}' for k, v in rows] + [rule]
  return '\n'.join(lines)
