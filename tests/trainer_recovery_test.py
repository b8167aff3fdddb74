"""Faults a long run meets, each recovered by the same command (README, Resume): a damaged newest checkpoint, a second
run on the same workdir, a signal in the warm start or in an eval, a checkpoint save that fails (no space), a
read-only workdir, a changed config on resume. In-process runs of the tiny arith config (the process-level ones, with
kills at random moments, are tests/trainer_chaos_test.py)."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from unittest import mock

from absl.testing import absltest

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import metrics
from sao_jax import models
from sao_jax import sft
from sao_jax import trainer
from sao_jax import workdir as workdir_lib
from sao_jax.envs import evaluation
from sao_jax.errors import ConfigError
from sao_jax.errors import RunError
from tests import trainer_helpers
from tests import trainer_test


def tiny_config(workdir, **overrides):
  """trainer_test's tiny arith run in sync mode (deterministic), 4 steps, a checkpoint every 2; `overrides`:
  {'section.key': value}."""
  c = trainer_test.tiny_config(workdir, mode='sync', num_steps=4, checkpoint_every=2)
  for path, value in overrides.items():
    section, key = path.split('.')
    c[section][key] = value
  return c


_FINISHED: list[str] = []  # The one run `finished_run` copies (made by the first test that needs it).


def finished_run() -> str:
  """A fresh copy of one finished `tiny_config` run (4 steps, checkpoints 2 and 4), made once per test process:
  the tests that damage, resume or reconfigure a finished run each take their own copy (a workdir may move:
  `workdir` is a resumable change) instead of training the same run again."""
  if not _FINISHED:
    workdir = tempfile.mkdtemp()
    trainer.run(tiny_config(workdir))
    _FINISHED.append(workdir)
  copy = os.path.join(tempfile.mkdtemp(), 'run')
  shutil.copytree(_FINISHED[0], copy)
  return copy


def steps_of(workdir):
  return [r['step'] for r in metrics.read_metrics(workdir)]


def _signal_self_at(n):
  """A `should_stop`-style counter: SIGTERM to this process on its n-th call (the signal handler sets the flag)."""
  calls = [0]

  def hook():
    calls[0] += 1
    if calls[0] == n:
      os.kill(os.getpid(), signal.SIGTERM)
  return hook


class DamagedCheckpointTest(absltest.TestCase):

  def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_same_command_recovers(self):
    workdir = finished_run()
    want = trainer_helpers.checkpoint_fingerprints(workdir, 4)
    ckpts = os.path.join(workdir, 'checkpoints')
    shutil.rmtree(os.path.join(ckpts, '4', 'policy'))  # Damaged: an item is missing.
    # The same command: step 2 restored, steps 3 and 4 retrained, step 4 saved again (it used to raise "A
    # checkpoint for step 4 already exists", at every rerun).
    with self.assertLogs(level='ERROR') as logs:
      summary = trainer.run(tiny_config(workdir))
    self.assertEqual(summary['steps'], 4)
    self.assertIn('Checkpoint step 4 moved aside', '\n'.join(logs.output))
    self.assertEqual(sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()), [2, 4])
    aside = os.listdir(os.path.join(ckpts, checkpoint_lib.DAMAGED_DIR))
    self.assertLen(aside, 1)
    self.assertTrue(aside[0].startswith('4-'))
    with open(os.path.join(ckpts, checkpoint_lib.DAMAGED_DIR, aside[0], 'DAMAGED.txt')) as f:
      self.assertIn("['policy'] saved but missing", f.read())
    # Retrained to the same weights (sync mode is deterministic).
    self.assertEqual(trainer_helpers.checkpoint_fingerprints(workdir, 4), want)
    self.assertEqual(steps_of(workdir), [1, 2, 3, 4])

  def test_no_intact_checkpoint_is_one_error_and_nothing_is_moved(self):
    workdir = finished_run()
    for step in ('2', '4'):
      shutil.rmtree(os.path.join(workdir, 'checkpoints', step, 'policy'))
    with self.assertRaisesRegex(checkpoint_lib.CheckpointCorrupt, 'No intact checkpoint'):
      trainer.run(tiny_config(workdir))
    self.assertTrue(os.path.isdir(os.path.join(workdir, 'checkpoints', '2')))
    self.assertTrue(os.path.isdir(os.path.join(workdir, 'checkpoints', '4')))


class WorkdirLockTest(absltest.TestCase):

  def test_a_second_lock_refuses_naming_the_holder_and_a_released_one_is_free(self):
    workdir = tempfile.mkdtemp()
    first = workdir_lib.WorkdirLock(workdir)
    first.acquire()
    with self.assertRaisesRegex(RunError, rf'is in use by another run \(host .*, pid {os.getpid()}, started'):
      workdir_lib.WorkdirLock(workdir).acquire()
    first.release()
    with workdir_lib.WorkdirLock(workdir) as second:
      self.assertTrue(second.held)

  def test_the_lock_of_a_killed_holder_is_taken_over_with_a_warning(self):
    workdir = tempfile.mkdtemp()
    code = ('import sys, time; from sao_jax import workdir; workdir.WorkdirLock(sys.argv[1]).acquire(); '
            'print("held", flush=True); time.sleep(600)')
    proc = subprocess.Popen([sys.executable, '-c', code, workdir], cwd=trainer_helpers.ROOT, stdout=subprocess.PIPE,
                            env=trainer_helpers.subprocess_env())
    self.assertEqual(proc.stdout.readline().strip(), b'held')
    with self.assertRaisesRegex(RunError, f'pid {proc.pid}'):
      workdir_lib.WorkdirLock(workdir).acquire()
    proc.kill()
    proc.wait()
    with self.assertLogs(level='WARNING') as logs:
      lock = workdir_lib.WorkdirLock(workdir)
      lock.acquire()
    lock.release()
    self.assertIn(f'gone without releasing it (host {os.uname().nodename}, pid {proc.pid}', '\n'.join(logs.output))

  def test_on_an_object_store_a_live_heartbeat_refuses_and_a_stale_one_is_taken_over(self):
    from tests import fake_gcs  # pylint: disable=g-import-not-at-top
    with fake_gcs.installed('fake'):
      first = workdir_lib.WorkdirLock('gs://bucket/run', stale_after_s=60, settle_s=0)
      first.acquire()
      with self.assertRaisesRegex(RunError, r'in use by another run .*heartbeat \d+s ago'):
        workdir_lib.WorkdirLock('gs://bucket/run', settle_s=0).acquire()
      first._stop.set()  # Its heartbeat stops (a killed holder) and grows old.
      info = first._read()
      info['heartbeat'] -= 120
      workdir_lib.paths.write_text(first.path, json.dumps(info))
      with self.assertLogs(level='WARNING') as logs:
        second = workdir_lib.WorkdirLock('gs://bucket/run', stale_after_s=60, settle_s=0)
        second.acquire()
      self.assertIn('heartbeat stopped', '\n'.join(logs.output))
      second.release()

  def test_a_run_refuses_a_held_workdir_before_building_anything(self):
    workdir = tempfile.mkdtemp()
    with workdir_lib.WorkdirLock(workdir):
      with mock.patch.object(models, 'build', side_effect=AssertionError('built')):
        with self.assertRaisesRegex(RunError, 'is in use by another run'):
          trainer.run(tiny_config(workdir))
    self.assertFalse(os.path.exists(os.path.join(workdir, 'metrics.jsonl')))


class SignalTest(absltest.TestCase):

  def test_a_signal_in_the_warm_start_saves_it_and_the_rerun_resumes_it(self):
    # (That the resumed warm start ends bit for bit as an uninterrupted one: tests/trainer_chaos_test.py.)
    overrides = {'sft.steps': 12, 'sft.batch_size': 8, 'sft.checkpoint_every': 5, 'trainer.num_steps': 2,
                 'trainer.eval_every': 2, 'sampler.max_new_tokens': 21}
    workdir = tempfile.mkdtemp()
    make_step = sft.make_sft_step

    def signalling_step(*args, **kwargs):
      step, hook = make_step(*args, **kwargs), _signal_self_at(8)
      return lambda *a: (hook(), step(*a))[1]
    with mock.patch.object(sft, 'make_sft_step', signalling_step):
      summary = trainer.run(tiny_config(workdir, **overrides))
    # It used to say it saved, then run the whole warm start and the step-0 eval, and save nothing.
    self.assertTrue(summary['stopped_by_signal'])
    self.assertEqual(os.listdir(os.path.join(workdir, trainer.WARM_START_DIR, sft.STATE_DIR)), ['8'])
    self.assertEqual(steps_of(workdir), [])
    with self.assertLogs(level='INFO') as logs:
      trainer.run(tiny_config(workdir, **overrides))
    self.assertIn('Warm start: resumed at step 8 of 12', '\n'.join(logs.output))
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [0, 1, 2])  # Step 0 once (it used to be written twice).
    self.assertEqual(rows[0]['sft/steps'], 12)

  def test_a_signal_in_an_eval_stops_it_and_the_resumed_run_fills_in_its_row(self):
    workdir = tempfile.mkdtemp()
    config = tiny_config(workdir, **{'trainer.eval_every': 2, 'trainer.num_steps': 4})
    config.task.eval_size = 24  # Two calls of 12 episodes (the actors' hold 8): stopped after the first.
    config.trainer.eval_batch_size = 12
    evaluate = trainer.eval_lib.evaluate
    calls, batch_sizes = [0], []

    def eval_signalled_at_step_2(*args, should_stop, **kwargs):
      calls[0] += 1
      batch_sizes.append((kwargs['batch_size'], kwargs['backend'].min_rows))
      hook = _signal_self_at(2) if calls[0] == 2 else (lambda: None)  # The second eval (step 2), second batch.
      return evaluate(*args, should_stop=lambda: (hook(), should_stop())[1], **kwargs)
    with mock.patch.object(trainer.eval_lib, 'evaluate', eval_signalled_at_step_2):
      summary = trainer.run(config)
    self.assertTrue(summary['stopped_by_signal'])
    self.assertEqual(batch_sizes, [(12, 12), (12, 12)])
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [0, 1, 2])
    self.assertNotIn('eval_accuracy', rows[2])
    self.assertEqual(sorted(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit()), [2])
    trainer.run(config)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [0, 1, 2, 3, 4])
    self.assertIn('eval_accuracy', rows[2])  # Evaluated by the resumed run, in its own row.
    self.assertIn('eval_accuracy', rows[4])
    # Each eval's problems and replies, the interrupted one's written by the resumed run.
    self.assertEqual(sorted(os.listdir(os.path.join(workdir, trainer.EVAL_DIR))),
                     ['step0.jsonl', 'step0.jsonl.summary.json', 'step2.jsonl', 'step2.jsonl.summary.json',
                      'step4.jsonl', 'step4.jsonl.summary.json'])
    results = evaluation.read_jsonl(os.path.join(workdir, trainer.EVAL_DIR, 'step4.jsonl'))
    self.assertLen(results, 24)
    self.assertEqual(sum(bool(r.greedy_correct) for r in results) / 24, rows[4]['eval_accuracy'])


class SaveFailureTest(absltest.TestCase):

  def _full_disk(self, failures):
    """`Checkpointer.save` raising ENOSPC on its first `failures` calls."""
    save = checkpoint_lib.Checkpointer.save
    left = [failures]

    def failing(self_, state, **kwargs):
      if left[0]:
        left[0] -= 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      return save(self_, state, **kwargs)
    return mock.patch.object(checkpoint_lib.Checkpointer, 'save', failing)

  def test_a_failed_save_is_retried_then_stops_the_run_in_one_error(self):
    workdir = tempfile.mkdtemp()
    config = tiny_config(workdir, **{'trainer.save_retries': 1, 'trainer.save_retry_s': 0.0})
    with self._full_disk(failures=2):
      with self.assertRaisesRegex(RunError, r'Checkpoint of step 2 could not be saved .*\(2 tries\): OSError: '
                                  r'\[Errno 28\] No space left on device'):
        trainer.run(config)
    self.assertEqual(steps_of(workdir), [1, 2])  # It used to train on, unprotected.
    trainer.run(config)  # Space again: the same command starts over (no checkpoint) and completes.
    self.assertEqual(steps_of(workdir), [1, 2, 3, 4])

  def test_a_save_that_fails_once_is_retried_and_the_run_goes_on(self):
    workdir = tempfile.mkdtemp()
    with self._full_disk(failures=1):
      with self.assertLogs(level='ERROR') as logs:
        trainer.run(tiny_config(workdir, **{'trainer.save_retries': 2, 'trainer.save_retry_s': 0.0}))
    self.assertIn('A checkpoint save failed (OSError: [Errno 28] No space left on device); saving step 2 again',
                  '\n'.join(logs.output))
    self.assertEqual(sorted(int(d) for d in os.listdir(os.path.join(workdir, 'checkpoints')) if d.isdigit()), [2, 4])

  def test_a_full_disk_stops_the_run_cleanly_and_the_rerun_with_space_recovers(self):
    mount = trainer_helpers.tmpfs(self, 'size=1m')  # Less than one checkpoint of the tiny run.
    workdir = os.path.join(mount, 'run')
    config = tiny_config(workdir, **{'trainer.save_retries': 1, 'trainer.save_retry_s': 0.0})
    # Whichever write meets the full disk first stops the run: a save (after its retry) or a metrics row.
    with self.assertRaisesRegex(RunError, r'(could not be saved|could not write the row of step \d+).*'
                                r'(No space left on device|RESOURCE_EXHAUSTED)'):
      trainer.run(config)
    with open(os.path.join(workdir, 'metrics.jsonl'), 'rb') as f:
      self.assertTrue(f.read().endswith(b'\n'))  # No half-written row.
    subprocess.run(['mount', '-o', 'remount,size=64m', mount], check=True)
    trainer.run(config)
    self.assertEqual(steps_of(workdir), [1, 2, 3, 4])


class StartUpRefusalTest(absltest.TestCase):

  def test_a_changed_config_on_resume_is_refused_before_the_model_build(self):
    workdir = finished_run()
    changed = tiny_config(workdir, **{'trainer.batch_size': 16})
    with mock.patch.object(models, 'build', side_effect=AssertionError('the model was built')):
      with self.assertRaisesRegex(ConfigError, r'holds a checkpoint \(step 4\) .*trainer.batch_size: 8 -> 16'):
        trainer.run(changed)

  def test_a_read_only_workdir_is_refused_in_one_line_before_the_model_build(self):
    mount = trainer_helpers.tmpfs(self, 'size=1m,ro')
    with mock.patch.object(models, 'build', side_effect=AssertionError('the model was built')):
      with self.assertRaisesRegex(ConfigError, r"config.workdir='.*/run' cannot be created: .* is not a writable"):
        trainer.run(tiny_config(os.path.join(mount, 'run')))
      with self.assertRaisesRegex(ConfigError, r"config.workdir='.*' is not writable: Read-only file system"):
        trainer.run(tiny_config(mount))

  def test_an_unwritable_workdir_is_refused_through_the_path_layer(self):
    from tests import fake_gcs  # pylint: disable=g-import-not-at-top
    with fake_gcs.installed('fake') as root:
      for workdir in (tempfile.mkdtemp(), 'gs://bucket/new_run'):  # A bucket's run is probed before it exists.
        workdir_lib.check_writable(workdir)
        with mock.patch.object(workdir_lib.paths, 'write_text', side_effect=OSError(errno.EROFS, 'Read-only')):
          with self.assertRaisesRegex(ConfigError, rf"config.workdir='{workdir}' is not writable: Read-only"):
            workdir_lib.check_writable(workdir)
      self.assertFalse(os.path.exists(os.path.join(root, 'bucket', 'new_run')))  # The probe is gone.


if __name__ == '__main__':
  absltest.main()
