"""Eval scoring: unbiased pass@k, avg@k, greedy accuracy, per-problem JSONL, summary table."""

import itertools
import math
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import evaluation
from sao_jax.tokenizers import CharTokenizer


def _brute_pass_at_k(n, c, k):
  """Fraction of k-subsets of n samples (c correct) with at least one correct one."""
  samples = [True] * c + [False] * (n - c)
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


class PassAtKTest(parameterized.TestCase):

  @parameterized.parameters(*[(n, c, k) for n in (1, 4, 7) for c in range(n + 1) for k in range(1, n + 1)])
  def test_matches_brute_force(self, n, c, k):
    self.assertAlmostEqual(evaluation.pass_at_k(n, c, k), _brute_pass_at_k(n, c, k), places=12)

  def test_closed_forms(self):
    self.assertAlmostEqual(evaluation.pass_at_k(10, 3, 1), 0.3)
    self.assertAlmostEqual(evaluation.pass_at_k(100, 1, 10), 0.1)
    self.assertAlmostEqual(evaluation.pass_at_k(200, 50, 5), 1 - math.comb(150, 5) / math.comb(200, 5))

  @parameterized.parameters((3, 4, 1), (3, 1, 4), (3, 1, 0), (3, -1, 1))
  def test_bad_arguments(self, n, c, k):
    with self.assertRaises(ValueError):
      evaluation.pass_at_k(n, c, k)

  def test_avg_at_k(self):
    self.assertAlmostEqual(evaluation.avg_at_k([1, 0, 1, 1], 2), 0.5)
    self.assertAlmostEqual(evaluation.avg_at_k([1, 0, 1, 1], 4), 0.75)
    with self.assertRaises(ValueError):
      evaluation.avg_at_k([1], 2)


def _results():
  r = []
  for i, (greedy, correct) in enumerate([(True, [1, 1, 0, 1]), (False, [0, 0, 0, 1]), (False, [0, 0, 0, 0])]):
    r.append(evaluation.ProblemResult(uid=f'p{i}', prompt=f'q{i}', answer=str(i), greedy_response='x',
                                      greedy_reward=float(greedy), greedy_correct=greedy,
                                      responses=['r'] * 4, rewards=[float(c) for c in correct],
                                      correct=[bool(c) for c in correct]))
  r.append(evaluation.ProblemResult(uid='err', prompt='q', answer='a', errors=['timeout'],
                                    correct=[True] * 2, rewards=[1.0] * 2))  # Excluded (and n differs).
  return r


class SummaryTest(absltest.TestCase):

  def test_summary(self):
    s = evaluation.summarize(_results())
    self.assertEqual(s['num_problems'], 4)
    self.assertEqual(s['num_errors'], 1)
    self.assertAlmostEqual(s['greedy_accuracy'], 1 / 3)
    self.assertAlmostEqual(s['avg@4'], np.mean([0.75, 0.25, 0.0]))
    self.assertAlmostEqual(s['avg@1'], np.mean([1, 0, 0]))
    self.assertAlmostEqual(s['pass@1'], np.mean([0.75, 0.25, 0.0]))
    self.assertAlmostEqual(s['pass@2'], np.mean([1.0, 0.5, 0.0]))
    self.assertAlmostEqual(s['pass@4'], 2 / 3)
    self.assertNotIn('pass@3', s)
    self.assertEqual(evaluation.summarize(_results(), ks=[3])['pass@3'], np.mean([1.0, 0.75, 0.0]))

  def test_mixed_sample_counts_are_refused(self):
    r = _results()
    r[0].correct = r[0].correct[:3]
    with self.assertRaisesRegex(ValueError, 'different sample counts'):
      evaluation.summarize(r)

  def test_jsonl_round_trip_and_table(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, 'sub', 'results.jsonl')
      self.assertEqual(evaluation.write_jsonl(path, _results()), 4)
      back = evaluation.read_jsonl(path)
    self.assertEqual([r.uid for r in back], ['p0', 'p1', 'p2', 'err'])
    self.assertEqual(back[0].correct, [True, True, False, True])
    table = evaluation.format_table(evaluation.summarize(back), title='arith eval')
    lines = table.splitlines()
    self.assertEqual(lines[0], 'arith eval')
    keys = [ln.split('|')[0].strip() for ln in lines if '|' in ln][1:]
    self.assertEqual(keys, ['num_errors', 'num_problems', 'num_samples', 'greedy_accuracy', 'greedy_reward',
                            'avg@1', 'avg@2', 'avg@4', 'pass@1', 'pass@2', 'pass@4'])
    self.assertIn('| 0.3333', table)


class ProblemResultTest(absltest.TestCase):

  def test_from_trajectories(self):
    tok = CharTokenizer()
    task = envs.get_task({'name': 'drift', 'max_turns': 1, 'eval_size': 2, 'kwargs': {}})
    ex = task.eval_set()[0]

    def play(text):
      def gen(context, budget, stop_ids):
        del context, budget, stop_ids
        ids = tok.encode(text) + [tok.eos_id]
        return ids, [-1.0] * len(ids)
      return rollout.run_episode(task.make_env(ex), tok, gen, limits=rollout.EpisodeLimits(1, 32, 256))

    right, wrong = play(f'<answer>{ex.answer}</answer>'), play('<answer>x</answer>')
    broken = play('<answer>1</answer>')
    broken.info['error'] = 'timeout'
    r = evaluation.problem_result(ex, greedy=right, samples=[wrong, right, broken], decode=tok.decode)
    self.assertEqual(r.greedy_response, f'<answer>{ex.answer}</answer>')
    self.assertEqual((r.greedy_correct, r.correct), (True, [False, True, False]))
    self.assertEqual(r.errors, ['timeout'])
    self.assertEqual(r.info, {'phase': 0})
    self.assertEqual(evaluation.summarize([r])['num_errors'], 1)


if __name__ == '__main__':
  absltest.main()
