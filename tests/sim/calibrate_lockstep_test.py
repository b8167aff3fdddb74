"""Calibration with lock-stepped batched calls: call durations against a per-row reference, closed forms."""

import math

from absl.testing import absltest
import numpy as np

from sao_jax.sim import calibrate


def _reference_call(turns, gen, tool, ls, slowdown):
  """One call, row by row and turn by turn (independent of the vectorised code)."""
  total = ls['call_overhead_s']
  for k in range(max(turns)):
    longest = max((gen[i][k] for i in range(len(turns)) if turns[i] > k), default=None)
    if longest is None:
      continue
    total += slowdown * (ls['turn_overhead_s'] + longest / ls['tokens_per_s'])
    total += max((tool[i][k] for i in range(len(turns)) if turns[i] > k + 1), default=0.0)
  return total


class LockstepTest(absltest.TestCase):

  def test_constant_call(self):
    ls = {'rows': 2, 'turns': [2], 'gen_tokens': [10], 'tool_latency_s': [0.5], 'tokens_per_s': 10.0,
          'turn_overhead_s': 0.1, 'call_overhead_s': 0.2}
    # 0.2 + 2 turns x (0.1 + 10 / 10) + one tool wait of 0.5.
    np.testing.assert_allclose(calibrate.lockstep_call_durations(ls, 5), 2.9)
    np.testing.assert_allclose(calibrate.lockstep_call_durations(ls, 5, slowdown=2.0), 0.2 + 2 * 2.2 + 0.5)

  def test_a_call_waits_for_its_longest_row_and_slowest_tool(self):
    ls = {'rows': 3, 'turns': [1, 2, 4], 'gen_tokens': [3, 9, 30], 'tool_latency_s': [0.02, 0.1, 0.45],
          'tokens_per_s': 50.0, 'turn_overhead_s': 0.01, 'call_overhead_s': 0.05}
    n, seed = 200, 3
    got = calibrate.lockstep_call_durations(ls, n, slowdown=1.5, seed=seed)
    # Redraw the same samples in the same order as the function does, then compute each call by hand.
    rng = np.random.default_rng(seed)
    turns = rng.choice(np.asarray(ls['turns']), size=(n, 3))
    k_max = int(turns.max())
    gen = rng.choice(np.asarray(ls['gen_tokens'], float), size=(n, 3, k_max))
    tool = rng.choice(np.asarray(ls['tool_latency_s'], float), size=(n, 3, k_max))
    want = [_reference_call(turns[c].tolist(), gen[c].tolist(), tool[c].tolist(), ls, 1.5) for c in range(n)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    self.assertGreater(np.ptp(got), 0.5)  # The calls really differ (different turn counts and tails).

  def test_predictions_in_closed_form(self):
    """Calls of constant duration E = 2.9 s, R = 2 rows, B = 2 calls per step, step S = 1 s.

    sync, one slot: a round plays the 2 calls in turn, then steps: R * B / (B * E + S) trajectories/s, idle
    B * E / (B * E + S). async, 4 slots: calls come in at 4 / E per s, the learner needs B per S (faster), so
    R * 4 / E trajectories/s and idle 1 - (4 / E / B) * S."""
    ls = {'rows': 2, 'turns': [2], 'gen_tokens': [10], 'tool_latency_s': [0.5], 'tokens_per_s': 10.0,
          'turn_overhead_s': 0.1, 'call_overhead_s': 0.2}
    e, b, s, r = 2.9, 2, 1.0, 2
    m = {'config': {'batch_size': b, 'step_time_s': s, 'duration_s': 3000.0, 'warmup_s': 100.0},
         'group_size': 1, 'lockstep': ls,
         'settings': {'sync/sao': {'num_slots': 1}, 'sync/grpo': {'num_slots': 1},
                      'async/sao': {'num_slots': 4}, 'async/grpo': {'num_slots': 4}},
         'measured': {'sync/sao': {'trajectories_per_s': r * b / (b * e + s),
                                   'learner_idle_fraction': b * e / (b * e + s)},
                      'async/sao': {'trajectories_per_s': r * 4 / e,
                                    'learner_idle_fraction': 1 - 4 / e / b * s}}}
    rows = {(x['setting'], x['metric']): x for x in calibrate.compare(m)}
    for setting in ('sync/sao', 'async/sao'):
      for metric in ('trajectories_per_s', 'learner_idle_fraction'):
        self.assertLess(abs(rows[setting, metric]['rel_error']), 0.01, (setting, metric, rows[setting, metric]))
    self.assertTrue(math.isnan(rows['sync/grpo', 'trajectories_per_s']['rel_error']))


if __name__ == '__main__':
  absltest.main()
