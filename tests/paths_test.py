"""Tests of sao_jax.paths, and of a run whose workdir is `gs://bucket/run` (tests/fake_gcs.py: an in-process GCS that
etils.epath, tensorstore and google-cloud-storage all reach): every file lands in the bucket, none on the disk."""

import glob
import json
import os
import tempfile

from absl.testing import absltest
import jax
import numpy as np

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import eval as eval_lib
from sao_jax import metrics
from sao_jax import paths
from sao_jax import trainer
from sao_jax.envs import evaluation
from tests import fake_gcs
from tests import metrics_test
from tests import trainer_test


class LocalPathsTest(absltest.TestCase):
  """A local path: exactly `os` (the files a run wrote before this layer are written the same way)."""

  def test_local_operations(self):
    d = tempfile.mkdtemp()
    sub = paths.join(d, 'a', 'b')
    self.assertEqual(sub, os.path.join(d, 'a', 'b'))
    self.assertTrue(paths.is_local(sub))
    self.assertEqual(paths.absolute('rel'), os.path.abspath('rel'))
    paths.makedirs(sub)
    paths.makedirs(sub)  # exist_ok.
    self.assertTrue(paths.isdir(sub))
    f = paths.join(sub, 'x.txt')
    paths.write_text(f, 'one\n')
    paths.write_text(f, 'two\n')
    self.assertEqual(paths.read_text(f), 'two\n')
    self.assertEqual(sorted(os.listdir(sub)), ['x.txt'])  # No temporary file left.
    with paths.open_file(f, 'a') as fh:
      fh.write('three\n')
    self.assertEqual(paths.read_text(f), 'two\nthree\n')
    self.assertEqual(paths.listdir(d), ['a'])
    paths.copy_file(f, paths.join(d, 'y.txt'))
    self.assertEqual(paths.read_text(paths.join(d, 'y.txt')), 'two\nthree\n')
    paths.remove(paths.join(d, 'y.txt'))
    paths.rmtree(paths.join(d, 'a'))
    paths.rmtree(paths.join(d, 'a'), missing_ok=True)
    self.assertFalse(paths.exists(paths.join(d, 'a')))

  def test_staged_dir_of_a_local_target_is_the_target(self):
    d = os.path.join(tempfile.mkdtemp(), 'out')
    with paths.StagedDir(d, sync_every_s=0) as stage:
      self.assertEqual(stage.local, d)
      self.assertTrue(os.path.isdir(d))
      with open(os.path.join(stage.local, 'f'), 'w') as f:
        f.write('x')
      self.assertFalse(stage.due())
      self.assertEqual(stage.sync(), 0)
    self.assertEqual(os.listdir(d), ['f'])

  def test_uri_helpers_need_no_store(self):
    self.assertFalse(paths.is_local('gs://bucket/run'))
    self.assertEqual(paths.join('gs://bucket/run', 'checkpoints', '3'), 'gs://bucket/run/checkpoints/3')
    self.assertEqual(paths.absolute('gs://bucket/run/'), 'gs://bucket/run')


class GcsPathsTest(absltest.TestCase):
  """`gs://` paths through the fake store: object semantics (no directories, no append, whole objects)."""

  CLIENT = 'fake'  # etils.epath's fsspec filesystem for gs:// (tests/fake_gcs.py).

  def setUp(self):
    super().setUp()
    self.root = self.enterContext(fake_gcs.installed(self.CLIENT))

  def obj(self, name: str) -> str:
    return os.path.join(self.root, *name.split('/'))

  def test_object_store_operations(self):
    run = 'gs://bucket/run'
    paths.makedirs(run)
    self.assertFalse(paths.exists(run))  # No directories: nothing until an object lies under it.
    paths.write_text(f'{run}/a/x.txt', 'one\n')
    paths.write_text(f'{run}/a/x.txt', 'two\n')
    self.assertTrue(paths.isdir(run))
    self.assertEqual(paths.read_text(f'{run}/a/x.txt'), 'two\n')
    self.assertEqual(paths.listdir(f'{run}/a'), ['x.txt'])  # No temporary object.
    with open(self.obj('bucket/run/a/x.txt'), encoding='utf-8') as f:
      self.assertEqual(f.read(), 'two\n')
    with self.assertRaisesRegex(ValueError, 'not possible on an object store'):
      paths.open_file(f'{run}/a/x.txt', 'a')
    local = os.path.join(tempfile.mkdtemp(), 'l.txt')
    paths.copy_file(f'{run}/a/x.txt', local)
    paths.copy_file(local, f'{run}/b.txt')
    self.assertEqual(paths.listdir(run), ['a', 'b.txt'])
    paths.remove(f'{run}/b.txt')
    paths.rmtree(f'{run}/a')
    self.assertFalse(paths.exists(run))
    paths.rmtree(f'{run}/a', missing_ok=True)

  def test_move_renames_a_directory_of_objects(self):
    run = 'gs://bucket/ckpt'
    paths.write_text(f'{run}/4/policy/d/blob', 'x')
    paths.write_text(f'{run}/4/manifest', 'm')
    paths.move(f'{run}/4', f'{run}/damaged/4-T')  # (What a resume does with a damaged step.)
    self.assertEqual(paths.listdir(run), ['damaged'])
    self.assertEqual(paths.read_text(f'{run}/damaged/4-T/policy/d/blob'), 'x')
    self.assertEqual(paths.read_text(f'{run}/damaged/4-T/manifest'), 'm')
    paths.move(f'{run}/damaged/4-T/manifest', f'{run}/m2')  # One object.
    self.assertEqual(paths.read_text(f'{run}/m2'), 'm')
    self.assertFalse(paths.exists(f'{run}/damaged/4-T/manifest'))

  def test_staged_dir_uploads_changed_files_whole(self):
    target = 'gs://bucket/stage'
    paths.write_text(f'{target}/log.txt', 'old\n')
    stage = paths.StagedDir(target, fetch=('log.txt', 'absent.txt'), sync_every_s=3600)
    self.assertTrue(stage.remote)
    self.assertFalse(stage.due())
    self.assertNotEqual(stage.local, target)
    with open(os.path.join(stage.local, 'log.txt'), 'a', encoding='utf-8') as f:
      f.write('new\n')
    os.makedirs(os.path.join(stage.local, 'sub'))
    with open(os.path.join(stage.local, 'sub', 'e'), 'wb') as f:
      f.write(b'\0' * 10)
    self.assertEqual(paths.read_text(f'{target}/log.txt'), 'old\n')  # Nothing uploaded before a sync.
    self.assertEqual(stage.sync(), 2)
    self.assertEqual(stage.sync(), 0)  # Unchanged files are not sent again.
    self.assertEqual(paths.read_text(f'{target}/log.txt'), 'old\nnew\n')
    self.assertEqual(os.path.getsize(self.obj('bucket/stage/sub/e')), 10)
    stage.close()
    self.assertFalse(os.path.exists(stage.local))

  def test_metrics_writer_on_gcs(self):
    run = 'gs://bucket/m'
    w = metrics.MetricsWriter(run, sync_every_s=3600)
    for s in (1, 2, 3):
      w.write(s, {'x': s, 'learner/loss': 0.5 / s})
    self.assertEqual(metrics.read_metrics(run), [])  # Not due yet: nothing sent.
    w.flush()  # (The trainer flushes before each checkpoint.)
    self.assertEqual([r['step'] for r in metrics.read_metrics(run)], [1, 2, 3])
    w.write(4, {'x': 4})
    w.close()
    self.assertEqual([r['step'] for r in metrics.read_metrics(run)], [1, 2, 3, 4])
    scalars = metrics_test._tb_scalars(self.obj('bucket/m/tensorboard'))  # pylint: disable=protected-access
    self.assertIn(('learner/loss', 3, 0.5 / 3), [(t, s, np.float32(v)) for t, s, v in scalars])
    # A resume from step 2 drops rows 3 and 4 in the bucket, and appends after them.
    with metrics.MetricsWriter(run, resume_step=2, tensorboard=False, sync_every_s=0) as w:
      self.assertEqual([r['step'] for r in metrics.read_metrics(run)], [1, 2])
      w.write(3, {'x': 30})
      self.assertEqual([r['x'] for r in metrics.read_metrics(run)], [1, 2, 30])  # sync_every_s=0: each row sent.
    self.assertEqual([r['step'] for r in metrics.read_metrics(run)], [1, 2, 3])

  def test_eval_outputs_on_gcs(self):
    out = 'gs://bucket/eval/results.jsonl'
    results = [evaluation.ProblemResult(uid=str(i), prompt='p', answer='1', greedy_response='1', greedy_reward=1.0,
                                        greedy_correct=True) for i in range(3)]
    self.assertEqual(evaluation.write_jsonl(out, results), 3)
    self.assertEqual([r.uid for r in evaluation.read_jsonl(out)], ['0', '1', '2'])
    eval_lib.write_outputs(out, eval_lib.EvalRun(results=results, summary={'greedy_accuracy': 1.0}))
    self.assertEqual(json.loads(paths.read_text(out + '.summary.json')), {'greedy_accuracy': 1.0})

  def test_checkpointer_on_gcs_removes_interrupted_saves(self):
    directory = 'gs://bucket/ckpt'
    with checkpoint_lib.Checkpointer(directory, keep=2) as ckpt:
      for step in (1, 2, 3):
        ckpt.save(checkpoint_lib.CheckpointState(step=step, policy={'w': np.arange(4.0) * step},
                                                 data={'step': step}))
    self.assertEqual(paths.listdir(directory), ['2', '3'])  # keep=2: step 1 deleted.
    self.assertTrue(os.path.isfile(self.obj('bucket/ckpt/3/commit_success.txt')))  # GCS: a commit file, no rename.
    paths.write_text(f'{directory}/4/policy/blob', 'x' * 100)  # A save interrupted before its commit file.
    with self.assertLogs(level='WARNING') as logs:
      ckpt = checkpoint_lib.Checkpointer(directory, keep=2)
    self.assertIn('left by an interrupted save', '\n'.join(logs.output))
    self.assertFalse(paths.exists(f'{directory}/4'))
    with ckpt:
      self.assertEqual(ckpt.all_steps(), [2, 3])
      got = ckpt.restore()
      self.assertEqual(got.step, 3)
      np.testing.assert_array_equal(got.policy['w'], np.arange(4.0) * 3)
      self.assertEqual(ckpt.items_at(3), {'policy', 'data', 'manifest'})


class GcsfsPathsTest(GcsPathsTest):
  """The same through the real gcsfs client (what a pod uses), over HTTP to the fake store."""

  CLIENT = 'gcsfs'


class GcsRunTest(absltest.TestCase):
  """A short training run with `workdir='gs://bucket/run'`, then its resume, all in the fake bucket, through the
  clients a pod uses (gcsfs, tensorstore's GCS driver, google-cloud-storage)."""

  def test_run_and_resume_in_a_bucket(self):
    cwd = tempfile.mkdtemp()  # A `gs:` folder made relative to the working directory would be here.
    start_dir = os.getcwd()
    os.chdir(cwd)
    self.addCleanup(os.chdir, start_dir)
    root = self.enterContext(fake_gcs.installed('gcsfs'))
    run_dir = os.path.join(root, 'bucket', 'run')
    workdir = 'gs://bucket/run'

    summary = trainer.run(trainer_test.tiny_config(workdir, mode='sync', tensorboard=True))
    self.assertEqual(summary['steps'], 2)
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2])
    self.assertEqual(sorted(os.listdir(run_dir)),
                     ['RUN_LOCK', 'checkpoints', 'metrics.jsonl', trainer.SUMMARY_FILE, 'tensorboard'])
    with open(os.path.join(run_dir, trainer.SUMMARY_FILE)) as f:
      self.assertEqual(json.load(f)['steps'], 2)  # Written through the bucket.
    with open(os.path.join(run_dir, 'RUN_LOCK')) as f:
      self.assertTrue(json.load(f)['released'])  # The workdir lock, held through the bucket, let go at the end.
    self.assertLen(glob.glob(os.path.join(run_dir, 'tensorboard', 'events.out.tfevents.*')), 1)
    scalars = metrics_test._tb_scalars(os.path.join(run_dir, 'tensorboard'))  # pylint: disable=protected-access
    self.assertEqual(sorted({s for t, s, _ in scalars if t == 'reward_mean'}), [1, 2])
    for step in (1, 2):
      self.assertTrue(os.path.isfile(os.path.join(run_dir, 'checkpoints', str(step), 'commit_success.txt')))
    with checkpoint_lib.Checkpointer(paths.join(workdir, 'checkpoints'), keep=None) as ckpt:
      self.assertEqual(ckpt.all_steps(), [1, 2])
      meta = ckpt.restore(2, items=('metadata',)).metadata
    self.assertEqual(meta['config']['workdir'], workdir)  # The run's config, in its checkpoint.
    self.assertEqual(meta['config']['trainer.num_steps'], 2)

    # Resume to step 3 from the bucket.
    summary = trainer.run(trainer_test.tiny_config(workdir, mode='sync', tensorboard=True, num_steps=3))
    self.assertEqual(summary['steps'], 3)
    self.assertEqual(summary['trajectories'], 24)  # 16 carried from the first run's rows.
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2, 3])
    self.assertLen(glob.glob(os.path.join(run_dir, 'tensorboard', 'events.out.tfevents.*')), 2)
    with checkpoint_lib.Checkpointer(paths.join(workdir, 'checkpoints'), keep=None) as ckpt:
      self.assertEqual(ckpt.all_steps(), [1, 2, 3])
      self.assertEqual(ckpt.restore(3, items=('data',)).data['prompts']['taken'], 24)

    # No local folder named 'gs:' (what `os.makedirs('gs://bucket/run')` makes, relative to the working directory).
    self.assertEqual(glob.glob(os.path.join(cwd, '**', 'gs:'), recursive=True), [])
    self.assertFalse(os.path.exists(os.path.join(start_dir, 'gs:')))
    self.assertEqual(glob.glob(os.path.join(tempfile.gettempdir(), 'sao_jax_staged_*')), [])  # Staging removed.
    self.assertEqual(jax.process_count(), 1)


if __name__ == '__main__':
  absltest.main()
