"""The loop benchmark: its figures from metrics rows (by hand), and `--quick` end to end so it cannot rot."""

import json
import os
import tempfile

from absl.testing import absltest

from sao_jax.benchmarks import loop
from sao_jax.sim import calibrate


def _row(step, dt, wait_fraction, stale=0, dropped=0):
  return {'step': step, 'perf/step_time_s': dt, 'learner/wait_fraction': wait_fraction,
          'learner/busy_s': dt * (1 - wait_fraction), 'staleness/mean': stale, 'staleness/max': stale + 1,
          'dropped/stale': dropped, 'episode/generate_s': 0.5, 'episode/env_s': 0.25, 'reward_mean': 0.1}


class SummarizeTest(absltest.TestCase):

  def test_rates_leave_out_the_warmup_steps(self):
    rows = [_row(1, 30.0, 0.9, dropped=5), _row(2, 2.0, 0.5, 1, dropped=6), _row(3, 6.0, 0.25, 3, dropped=9)]
    got = loop.summarize(rows, {'wall_s': 40.0}, batch=16, skip=1)
    self.assertEqual(got['steps'], 2)
    self.assertAlmostEqual(got['warmup_s'], 30.0)
    self.assertAlmostEqual(got['trajectories_per_s'], 32 / 8.0)
    self.assertAlmostEqual(got['learner_idle_fraction'], (1.0 + 1.5) / 8.0)
    self.assertAlmostEqual(got['staleness_mean'], 2.0)
    self.assertEqual(got['staleness_max'], 4.0)
    self.assertEqual(got['dropped_stale'], 4)
    self.assertEqual(got['learner_busy_s'], [1.0, 4.5])
    with self.assertRaisesRegex(ValueError, 'skip'):
      loop.summarize(rows, {'wall_s': 1.0}, batch=16, skip=3)


class BenchConfigTest(absltest.TestCase):

  def test_continuous_applies_to_the_async_settings_only(self):
    for setting in loop.SETTINGS:
      c = loop.bench_config(setting, continuous=True, threads=2, slots=24, decode_steps=8)
      cont = setting in ('async', 'grpo')
      self.assertEqual(bool(c.sampler.continuous), cont)
      self.assertEqual(c.sampler.batch_size, 24 if cont else 8)  # Slots per actor, or the static call's rows.
      self.assertEqual(c.trainer.queue_size, 2 * 24 + 16 if cont else 2 * 8 + 16)
      self.assertEqual(c.trainer.batch_size, 16)  # The learner's work does not change.
    self.assertTrue(loop.bench_config('async').sampler.continuous)  # The default, as in configs/base.py.
    for setting in loop.SETTINGS:  # Static calls everywhere (whatever configs/base.py's default).
      self.assertFalse(loop.bench_config(setting, continuous=False).sampler.continuous)
    with self.assertRaisesRegex(ValueError, 'GRPO group'):
      loop.bench_config('grpo', continuous=True, slots=4, call_rows=8)


class QuickTest(absltest.TestCase):

  def test_quick_async(self):
    # The async setting only (actor threads, queue, the latency task, the figures): each trainer run compiles its
    # own samplers and learner, and every setting costs minutes of CPU on this shared machine.
    results = loop.run_benchmark(quick=True, settings=('async',))
    (r,) = results['async']
    self.assertEqual(r['steps'], 2)
    self.assertGreater(r['trajectories_per_s'], 0.0)
    self.assertBetween(r['learner_idle_fraction'], 0.0, 1.0)
    self.assertGreater(r['env_s'], 0.0)  # The tool calls really waited.

  def test_measurements_file_reads_in_the_calibration(self):
    runs = {s: [{'trajectories_per_s': 2.0, 'learner_idle_fraction': 0.5, 'learner_busy_s': [0.5, 0.7],
                 'generate_s': 1.0, 'generate_s_median': 1.0, 'load': '1 1 1'}] for s in loop.SETTINGS}
    prb = {'rows': 2, 'gen_tokens': [5, 9], 'turns': [1, 3], 'tool_latency_s': [0.1, 0.2], 'tokens_per_s': 100.0,
           'turn_overhead_s': 0.01, 'call_overhead_s': 0.02, 'generate_s': 0.5}
    path = os.path.join(tempfile.mkdtemp(), 'm.json')
    loop.write_measurements(path, runs, prb, threads=3, batch=4, call_rows=2,
                            continuous={'slots': 32, 'decode_steps': 16})
    with open(path) as f:
      m = json.load(f)
    self.assertEqual(m['continuous'], {'slots': 32, 'decode_steps': 16})
    self.assertEqual(m['settings']['async/sao']['num_slots'], 3)
    self.assertEqual(m['settings']['sync/sao']['num_slots'], 1)
    self.assertEqual(m['settings']['sync/grpo']['num_slots'], 1)
    self.assertEqual(m['settings']['async/grpo']['lockstep']['slowdown'], 2.0)
    rows = calibrate.compare(m)
    self.assertLen([r for r in rows if r['measured'] is not None], 8)  # All four settings, both metrics.


if __name__ == '__main__':
  absltest.main()
