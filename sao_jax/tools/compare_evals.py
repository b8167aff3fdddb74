r"""Two evals of the same problems, side by side: what a training run changed, problem by problem.

  python -m sao_jax.tools.compare_evals --before=WORKDIR/eval/step0.jsonl --after=WORKDIR/eval/step100.jsonl \
      [--examples=3] [--examples_seed=0]

The files are per-problem results (`sao_jax.eval --output`, or a run's `<workdir>/eval/step<N>.jsonl`). Printed:
greedy accuracy before and after, each with its band of two standard errors `2 sqrt(p (1 - p) / n)`; the paired
counts (right -> right, wrong -> right, right -> wrong, wrong -> wrong) and McNemar's exact two-sided p-value of
the change, `p = min(1, 2 sum_{i <= min(b, c)} C(b + c, i) / 2^(b + c))` over the b problems fixed and the c broken
(the paired test: the same problems scored twice, so it sees a change the two bands alone would not); the share of
replies cut by the token budget and their mean length in characters; and `--examples` problems of each kind
(fixed, broken, right in both) with both replies, drawn with `--examples_seed`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

from absl import app, flags

from sao_jax.envs import evaluation

_BEFORE = flags.DEFINE_string('before', None, 'Per-problem results of the first eval (JSONL).')
_AFTER = flags.DEFINE_string('after', None, 'Per-problem results of the second eval, same problems (JSONL).')
_EXAMPLES = flags.DEFINE_integer('examples', 3, 'Problems shown of each kind (fixed, broken, right in both).')
_SEED = flags.DEFINE_integer('examples_seed', 0, 'Seed of the examples drawn.')

KINDS = ('fixed', 'broken', 'both_right', 'both_wrong')  # wrong -> right, right -> wrong, right -> right, ...


@dataclasses.dataclass(frozen=True)
class Comparison:
  """Paired greedy results of two evals: the problem ids of each kind (`KINDS`) and the per-eval summaries."""
  kinds: dict[str, list[str]]
  before: dict[str, float]
  after: dict[str, float]

  @property
  def n(self) -> int:
    return sum(len(v) for v in self.kinds.values())


def band(p: float, n: int) -> float:
  """Two standard errors of a mean of n Bernoulli(p) scores: `2 sqrt(p (1 - p) / n)`."""
  return 2.0 * math.sqrt(p * (1.0 - p) / n) if n else math.nan


def mcnemar_exact(b: int, c: int) -> float:
  """Exact two-sided McNemar p-value of b changes one way and c the other: `min(1, 2 P(X <= min(b, c)))`,
  X ~ Binomial(b + c, 1/2); 1 when nothing changed."""
  n = b + c
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
  return min(1.0, 2.0 * tail)


def _summary(results: Sequence[evaluation.ProblemResult]) -> dict[str, float]:
  n = len(results)
  right = sum(bool(r.greedy_correct) for r in results) / n
  cut = sum(bool(r.info.get('greedy_truncated')) for r in results) / n
  chars = sum(len(r.greedy_response or '') for r in results) / n
  return {'accuracy': right, 'band': band(right, n), 'cut': cut, 'reply_chars': chars}


def compare(before: Sequence[evaluation.ProblemResult], after: Sequence[evaluation.ProblemResult]) -> Comparison:
  """Pairs the two evals by problem id (the same set, any order; greedy results needed)."""
  a = {r.uid: r for r in before}
  b = {r.uid: r for r in after}
  if len(a) != len(before) or len(b) != len(after):
    raise ValueError('A problem id appears twice in one eval.')
  if set(a) != set(b):
    missing = sorted(set(a) ^ set(b))
    raise ValueError(f'The evals are of different problems ({len(missing)} ids in one only, e.g. {missing[:3]}).')
  if any(r.greedy_correct is None for r in (*before, *after)):
    raise ValueError('Both evals need greedy results (sao_jax.eval without --nogreedy).')
  kinds: dict[str, list[str]] = {k: [] for k in KINDS}
  for uid, x in a.items():
    was, now = bool(x.greedy_correct), bool(b[uid].greedy_correct)
    kinds['both_right' if was and now else 'fixed' if now else 'broken' if was else 'both_wrong'].append(uid)
  return Comparison(kinds, _summary(before), _summary(after))


def report(c: Comparison, before: Sequence[evaluation.ProblemResult], after: Sequence[evaluation.ProblemResult],
           *, examples: int = 3, seed: int = 0) -> str:
  """The printed comparison (module docstring)."""
  n, k = c.n, c.kinds
  fixed, broken = len(k['fixed']), len(k['broken'])
  lines = [f'{n} problems, greedy accuracy {c.before["accuracy"]:.1%} +- {c.before["band"]:.1%} -> '
           f'{c.after["accuracy"]:.1%} +- {c.after["band"]:.1%} ({c.after["accuracy"] - c.before["accuracy"]:+.1%})',
           f'paired: right in both {len(k["both_right"])}, fixed {fixed}, broken {broken}, wrong in both '
           f'{len(k["both_wrong"])}; McNemar exact p = {mcnemar_exact(fixed, broken):.3g}',
           f'replies cut by the budget {c.before["cut"]:.1%} -> {c.after["cut"]:.1%}; mean reply '
           f'{c.before["reply_chars"]:.0f} -> {c.after["reply_chars"]:.0f} characters']
  by_id = ({r.uid: r for r in before}, {r.uid: r for r in after})
  rng = random.Random(seed)
  for kind in ('fixed', 'broken', 'both_right'):
    ids = sorted(k[kind])
    for uid in rng.sample(ids, min(examples, len(ids))):
      x, y = by_id[0][uid], by_id[1][uid]
      lines += [f'[{kind}] {x.prompt!r} (answer {x.answer})',
                f'    before ({"right" if x.greedy_correct else "wrong"}): {x.greedy_response!r}',
                f'    after  ({"right" if y.greedy_correct else "wrong"}): {y.greedy_response!r}']
  return '\n'.join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  before, after = evaluation.read_jsonl(_BEFORE.value), evaluation.read_jsonl(_AFTER.value)
  print(report(compare(before, after), before, after, examples=_EXAMPLES.value, seed=_SEED.value))


if __name__ == '__main__':
  flags.mark_flags_as_required(['before', 'after'])
  app.run(main)
