"""compare_evals: paired counts, bands and McNemar's exact p against hand computations; read back from files."""

import math
import os
import tempfile

from absl.testing import absltest

from sao_jax.envs import evaluation
from sao_jax.tools import compare_evals


def _result(i: int, right: bool, cut: bool = False) -> evaluation.ProblemResult:
  return evaluation.ProblemResult(uid=f'p{i}', prompt=f'{i} + 1?', answer=str(i + 1),
                                  greedy_response=('no' if not right else str(i + 1)) + (' ...' * 5 if cut else ''),
                                  greedy_reward=float(right), greedy_correct=right,
                                  info={'greedy_truncated': cut})


# 20 problems: 5 right in both, 8 fixed, 2 broken, 5 wrong in both; 4 cut before, 1 after.
BEFORE = ([_result(i, True) for i in range(5)] + [_result(i, False, cut=i < 9) for i in range(5, 13)]
          + [_result(i, True) for i in range(13, 15)] + [_result(i, False) for i in range(15, 20)])
AFTER = ([_result(i, True) for i in range(5)] + [_result(i, True) for i in range(5, 13)]
         + [_result(i, False) for i in range(13, 15)] + [_result(i, False, cut=i == 19) for i in range(15, 20)])


class CompareEvalsTest(absltest.TestCase):

  def test_mcnemar_exact_by_hand(self):
    self.assertAlmostEqual(compare_evals.mcnemar_exact(8, 2), 2 * (1 + 10 + 45) / 1024)  # 0.109375
    self.assertAlmostEqual(compare_evals.mcnemar_exact(2, 8), 2 * (1 + 10 + 45) / 1024)
    self.assertEqual(compare_evals.mcnemar_exact(3, 3), 1.0)  # 2 P(X <= 3) > 1 for X ~ B(6, 1/2): capped.
    self.assertEqual(compare_evals.mcnemar_exact(0, 0), 1.0)
    self.assertAlmostEqual(compare_evals.mcnemar_exact(0, 10), 2 / 1024)

  def test_paired_counts_and_summaries(self):
    c = compare_evals.compare(BEFORE, list(reversed(AFTER)))  # Paired by id, not by position.
    self.assertEqual({k: len(v) for k, v in c.kinds.items()},
                     {'fixed': 8, 'broken': 2, 'both_right': 5, 'both_wrong': 5})
    self.assertEqual(sorted(c.kinds['broken']), ['p13', 'p14'])
    self.assertAlmostEqual(c.before['accuracy'], 7 / 20)
    self.assertAlmostEqual(c.after['accuracy'], 13 / 20)
    self.assertAlmostEqual(c.before['band'], 2 * math.sqrt(0.35 * 0.65 / 20))
    self.assertAlmostEqual(c.before['cut'], 4 / 20)
    self.assertAlmostEqual(c.after['cut'], 1 / 20)

  def test_report_from_files(self):
    d = tempfile.mkdtemp()
    paths = [os.path.join(d, 'step0.jsonl'), os.path.join(d, 'step9.jsonl')]
    for path, results in zip(paths, (BEFORE, AFTER)):
      evaluation.write_jsonl(path, results)
    before, after = (evaluation.read_jsonl(p) for p in paths)
    text = compare_evals.report(compare_evals.compare(before, after), before, after, examples=2)
    self.assertIn('20 problems, greedy accuracy 35.0% +- 21.3% -> 65.0% +- 21.3% (+30.0%)', text)
    self.assertIn('fixed 8, broken 2', text)
    self.assertIn('McNemar exact p = 0.109', text)
    self.assertIn('replies cut by the budget 20.0% -> 5.0%', text)
    self.assertEqual(text.count('[fixed]'), 2)
    self.assertEqual(text.count('[broken]'), 2)
    self.assertEqual(text.count('[both_right]'), 2)

  def test_refuses_different_problem_sets(self):
    with self.assertRaisesRegex(ValueError, 'different problems'):
      compare_evals.compare(BEFORE, AFTER[:-1])
    with self.assertRaisesRegex(ValueError, 'twice'):
      compare_evals.compare(BEFORE + BEFORE[:1], AFTER)


if __name__ == '__main__':
  absltest.main()
