"""experiments/: every arm of every experiment validates; a --quick run writes the report; the report's figures
(seed statistics, drift recovery) against hand-computed values."""

import csv
import json
import os
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

from experiments import report
from experiments import runner as run_lib
from experiments import specs
from sao_jax import metrics
from sao_jax import trainer
from tests import trainer_helpers


def _write_run(runs_dir, arm, seed, rows, done=True):
  workdir = os.path.join(runs_dir, arm, f'seed{seed}')
  os.makedirs(workdir)
  with open(os.path.join(workdir, metrics.METRICS_FILE), 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
  if done:
    open(os.path.join(workdir, 'done.json'), 'w', encoding='utf-8').write('{}')


class SpecsTest(absltest.TestCase):

  def test_every_arm_of_every_experiment_validates(self):
    run_lib.validate(sorted(specs.EXPERIMENTS), quick=True)
    self.assertContainsSubset({'algos_arith', 'algos_calculator', 'ablations', 'stability', 'drift', 'smollm2'},
                              specs.EXPERIMENTS)

  def test_a_bad_arm_is_named(self):
    bad = specs.Experiment('bad', 'bad', 'configs/arith.py', (specs.Arm('oops', {'algo.clip_mode': 'nope'}),))
    with absltest.mock.patch.dict(specs.EXPERIMENTS, {'bad': bad}):
      with self.assertRaisesRegex(ValueError, 'experiment bad, arm oops: .*algo.clip_mode'):
        run_lib.validate(['bad'], quick=True)

  def test_group_arms_keep_trajectories_per_step(self):
    for exp in specs.EXPERIMENTS.values():
      sizes = {run_lib.load_config(exp, run_lib.run_overrides(exp, a, 0, quick=False)).trainer.batch_size
               for a in exp.arms}
      self.assertLen(sizes, 1, exp.name)


class ReportTest(absltest.TestCase):

  def test_summary_statistics_and_curves(self):
    exp = specs.EXPERIMENTS['algos_arith']
    runs_dir, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    for seed, (a0, a1) in enumerate([(0.1, 0.5), (0.2, 0.7), (0.3, 0.9)]):
      _write_run(runs_dir, 'sao', seed, [
          {'step': 0, 'eval_accuracy': a0, 'trajectories': 0, 'time/wall_s': 10.0},
          {'step': 1, 'reward_mean': 0.4, 'trajectories': 64, 'time/wall_s': 20.0},
          {'step': 2, 'eval_accuracy': a1, 'trajectories': 128, 'time/wall_s': 30.0 + seed}])
    _write_run(runs_dir, 'grpo', 0, [{'step': 0, 'eval_accuracy': 0.5}], done=False)  # Unfinished: curves only.
    got = report.write(exp, runs_dir, out)
    self.assertEqual(got['runs'], 4)
    table = open(os.path.join(out, 'summary.md'), encoding='utf-8').read()
    # Means 0.2 / 0.7, sample std 0.1 / 0.2, wall mean 31.
    self.assertIn('| sao | 3 | 0.200 ± 0.100 [0.100, 0.300] | 0.700 ± 0.200 [0.500, 0.900] |', table)
    self.assertIn('| 2 | 128 | 31 |', table)
    self.assertIn('| grpo | 0 |', table)
    with open(os.path.join(out, 'curves.csv'), encoding='utf-8') as f:
      lines = list(csv.DictReader(f))
    self.assertLen(lines, 10)
    self.assertEqual([x['eval_accuracy'] for x in lines[:3]], ['0.1', '', '0.5'])
    self.assertEqual(lines[-1]['done'], '0')
    self.assertTrue(os.path.getsize(os.path.join(out, 'algos_arith.png')) > 1000)

  def test_restore_rebuilds_the_finished_runs_of_a_report(self):
    exp = specs.EXPERIMENTS['ablations']  # Has panel columns.
    runs_dir, results = tempfile.mkdtemp(), tempfile.mkdtemp()
    for seed in (0, 1):
      _write_run(runs_dir, 'sao', seed, [
          {'step': 0, 'eval_accuracy': 0.25 + 0.5 * seed, 'trajectories': 0, 'time/wall_s': 10.0, 'other': 1},
          {'step': 1, 'reward_mean': 0.5, 'trajectories': 64, 'time/wall_s': 20.5,
           'learner/critic/grad_norm': 2.0, 'learner/critic/explained_variance': -0.125},
          {'step': 2, 'eval_accuracy': 0.75, 'trajectories': 128, 'time/wall_s': 31.0 + seed}])
    _write_run(runs_dir, 'critic_k1', 0, [{'step': 0, 'eval_accuracy': 0.5}], done=False)
    report.write(exp, runs_dir, os.path.join(results, exp.name))
    committed = os.path.join(results, exp.name, 'curves.csv')
    # A fresh runs directory: the finished runs come back, the unfinished one does not (nothing to resume).
    fresh = tempfile.mkdtemp()
    self.assertEqual(report.restore(exp, committed, os.path.join(fresh, exp.name)), [('sao', 0), ('sao', 1)])
    self.assertFalse(os.path.exists(os.path.join(fresh, exp.name, 'critic_k1')))
    self.assertTrue(os.path.exists(os.path.join(fresh, exp.name, 'sao', 'seed1', 'done.json')))
    # The report rewritten from them alone is the committed one (curves less the unfinished run's rows).
    rewritten = tempfile.mkdtemp()
    report.write(exp, os.path.join(fresh, exp.name), rewritten)
    read = lambda d, n: open(os.path.join(d, n), encoding='utf-8').read()
    self.assertEqual(read(rewritten, 'summary.md').replace('| critic_k1 | 0 |', ''),
                     read(os.path.join(results, exp.name), 'summary.md').replace('| critic_k1 | 0 |', ''))
    self.assertIn('| sao | 2 | 0.500 ± 0.354', read(rewritten, 'summary.md'))
    self.assertIn('| 2 | 128 | 32 |', read(rewritten, 'summary.md'))  # wall_s is time/wall_s again.
    committed_lines = [x for x in read(os.path.join(results, exp.name), 'curves.csv').splitlines()
                       if not x.startswith('critic_k1,')]
    self.assertEqual(read(rewritten, 'curves.csv').splitlines(), committed_lines)  # 64 stays 64, 2.0 stays 2.0.
    # Through the runner (as `experiments.run` does first): a run present is never overwritten, and nothing is
    # restored twice.
    again = tempfile.mkdtemp()
    _write_run(os.path.join(again, exp.name), 'sao', 0, [{'step': 0, 'eval_accuracy': 0.0}], done=False)
    run_lib.run_experiment(exp.name, runs=again, results=results, report_only=True)
    self.assertEqual(metrics.read_metrics(os.path.join(again, exp.name, 'sao', 'seed0')),
                     [{'step': 0, 'eval_accuracy': 0.0}])
    self.assertLen(metrics.read_metrics(os.path.join(again, exp.name, 'sao', 'seed1')), 3)
    self.assertEqual(report.restore(exp, committed, os.path.join(again, exp.name)), [])

  def test_drift_recovery_steps(self):
    phase = [0, 0, 0, 1, 1, 1, 1, 2, 2]
    acc = {0: 0.2, 2: 0.6, 4: 0.3, 5: 0.5, 6: 0.7, 8: 0.1}
    rows = [{'step': s, 'drift/phase': p, **({'eval_accuracy': acc[s]} if s in acc else {})}
            for s, p in enumerate(phase)]
    # Shift 0->1 after step 2 (level 0.6): back at step 6 (0.7) -> 4 steps. Shift 1->2 after step 6 (level
    # 0.7): never back -> None.
    self.assertEqual(report.recovery_steps(rows), [4, None])
    # Phases: steps 0-2 (evals 0.2, 0.6), 3-6 (0.3, 0.5, 0.7), 7-8 (0.1): the first eval of a phase is its
    # accuracy at the shift, the last its end.
    self.assertEqual([(s['phase'], s['first_step'], s['last_step'], s['at_shift'], s['end'])
                      for s in report.phase_segments(rows)],
                     [(0, 0, 2, 0.2, 0.6), (1, 3, 6, 0.3, 0.7), (2, 7, 8, 0.1, 0.1)])
    # A leading row without the phase (step 0's eval, logged before the first update) is the first phase's.
    segs = report.phase_segments([{'step': -1, 'eval_accuracy': 0.0}, *rows])
    self.assertEqual([(s['first_step'], s['at_shift'], s['end']) for s in segs],
                     [(-1, 0.0, 0.6), (3, 0.3, 0.7), (7, 0.1, 0.1)])
    self.assertSequenceAlmostEqual([s['mean'] for s in segs], [0.8 / 3, 0.5, 0.1])


def _stopped_at_step_one():
  """A quick `ablations` run (2 steps) whose workdir holds step 1's metrics: (runs dir, experiment, workdir)."""
  runs = tempfile.mkdtemp()
  workdir = os.path.join(runs, 'ablations', 'sao', 'seed0')
  os.makedirs(workdir)
  with open(os.path.join(workdir, metrics.METRICS_FILE), 'w', encoding='utf-8') as f:
    f.write(json.dumps({'step': 1}) + '\n')
  return runs, specs.EXPERIMENTS['ablations'], workdir


class QuickRunTest(absltest.TestCase):

  def test_a_run_past_its_timeout_is_stopped_and_the_next_goes_on(self):
    runs = tempfile.mkdtemp()
    exp = specs.EXPERIMENTS['ablations']
    got = run_lib.run_one(exp, exp.arm('sao'), 0, runs=runs, quick=True, timeout_s=0.01)
    self.assertIsNone(got)  # Killed while starting; not marked done, so the next call runs it again.
    workdir = os.path.join(runs, 'ablations', 'sao', 'seed0')
    self.assertTrue(os.path.exists(os.path.join(workdir, 'log.txt')))
    self.assertFalse(os.path.exists(os.path.join(workdir, report.DONE_FILE)))

  def test_a_run_that_exits_before_its_last_step_is_not_done(self):
    """SIGTERM makes a run checkpoint and exit 0: the runner must not take that for the end."""
    runs, exp, workdir = _stopped_at_step_one()
    with mock.patch.object(subprocess, 'run', return_value=subprocess.CompletedProcess([], 0)):
      self.assertIsNone(run_lib.run_one(exp, exp.arm('sao'), 0, runs=runs, quick=True))
      self.assertFalse(os.path.exists(os.path.join(workdir, report.DONE_FILE)))
      with open(os.path.join(workdir, metrics.METRICS_FILE), 'a', encoding='utf-8') as f:
        f.write(json.dumps({'step': 2}) + '\n')
      self.assertEqual(run_lib.run_one(exp, exp.arm('sao'), 0, runs=runs, quick=True)['arm'], 'sao')
    self.assertTrue(os.path.exists(os.path.join(workdir, report.DONE_FILE)))

  def test_a_run_that_spent_its_training_time_is_done(self):
    """`trainer.max_train_minutes` ends a run before its last step: done when the trainer's summary says so (a
    signal's summary does not)."""
    runs, exp, workdir = _stopped_at_step_one()
    summary = os.path.join(workdir, trainer.SUMMARY_FILE)
    with mock.patch.object(subprocess, 'run', return_value=subprocess.CompletedProcess([], 0)):
      with open(summary, 'w', encoding='utf-8') as f:
        json.dump({'steps': 1, 'stopped_by_signal': True, 'stopped_by_time_budget': False}, f)
      self.assertIsNone(run_lib.run_one(exp, exp.arm('sao'), 0, runs=runs, quick=True))
      with open(summary, 'w', encoding='utf-8') as f:
        json.dump({'steps': 1, 'stopped_by_signal': False, 'stopped_by_time_budget': True}, f)
      self.assertEqual(run_lib.run_one(exp, exp.arm('sao'), 0, runs=runs, quick=True)['arm'], 'sao')
    self.assertTrue(os.path.exists(os.path.join(workdir, report.DONE_FILE)))

  def test_quick_run_writes_the_report_and_does_not_rerun(self):
    runs = tempfile.mkdtemp()
    env = trainer_helpers.subprocess_env(devices=1)
    # The runs' compilation cache (`RUNS/quick/compile_cache`) is the suite's (tests/conftest.py): the tiny
    # calculator runs load the programs the other tests' children compiled with the same flags
    # (trainer_configs_test's calculator run: its samplers and update) instead of compiling them again.
    if os.environ.get('JAX_COMPILATION_CACHE_DIR'):
      os.makedirs(os.path.join(runs, 'quick'))
      os.symlink(os.environ['JAX_COMPILATION_CACHE_DIR'], os.path.join(runs, 'quick', 'compile_cache'))
    cmd = [sys.executable, '-m', 'experiments.run', '--experiment=ablations', '--arms=sao,gae_through_obs',
           '--quick', f'--runs={runs}']
    proc = subprocess.run(cmd, cwd=trainer_helpers.ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    out = os.path.join(runs, 'quick', 'results', 'ablations')
    self.assertIn('| sao | 1 |', proc.stdout)
    self.assertIn('| gae_through_obs | 1 |', proc.stdout)
    with open(os.path.join(out, 'curves.csv'), encoding='utf-8') as f:
      lines = list(csv.DictReader(f))
    for arm in ('sao', 'gae_through_obs'):
      self.assertEqual([int(x['step']) for x in lines if x['arm'] == arm], [0, 1, 2])
    self.assertTrue(os.path.exists(os.path.join(out, 'ablations.png')))
    # The ablation ran as one: the learner recorded its switch.
    log = open(os.path.join(runs, 'quick', 'ablations', 'gae_through_obs', 'seed0', 'log.txt')).read()
    self.assertIn('algo.gae_over', log)
    # A second call finds both runs done and only rewrites the report: the runner as `experiments.run --quick`
    # calls it, in this process (a second command line would cost a process start and jax import for a report).
    before = os.path.getmtime(os.path.join(runs, 'quick', 'ablations', 'sao', 'seed0', metrics.METRICS_FILE))
    os.remove(os.path.join(out, 'summary.md'))
    with mock.patch.object(subprocess, 'run', side_effect=AssertionError('a finished run was started again')):
      got = run_lib.run_experiment('ablations', arms=['sao', 'gae_through_obs'], quick=True,
                                   runs=os.path.join(runs, 'quick'), results=os.path.join(runs, 'quick', 'results'))
    self.assertEqual(got, out)
    self.assertIn('| gae_through_obs | 1 |', open(os.path.join(out, 'summary.md'), encoding='utf-8').read())
    self.assertEqual(before,
                     os.path.getmtime(os.path.join(runs, 'quick', 'ablations', 'sao', 'seed0', metrics.METRICS_FILE)))


if __name__ == '__main__':
  absltest.main()
