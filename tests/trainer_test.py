"""End-to-end tests of the actor-learner loop on a tiny model: sync and async, resume, signals, failures."""

import json
import os
import tempfile
from unittest import mock

from absl.testing import absltest
import jax
import numpy as np
from flax import nnx

from configs import arith
from sao_jax import checkpoint as checkpoint_lib
from sao_jax import config_lib
from sao_jax import metrics
from sao_jax import trainer
from sao_jax.errors import ConfigError


def tiny_config(workdir, matmul_precision='default', **trainer_kw):
  c = arith.get_config('1')
  c.workdir = workdir
  c.model.name = 'tiny'
  c.model.matmul_precision = matmul_precision
  c.sft.steps = 0  # No warm start (configs/arith.py has one): these tests are about the loop.
  c.task.eval_size = 4
  c.sampler.batch_size = 8
  c.sampler.max_new_tokens = 6
  c.sampler.max_seq_len = 96
  c.sampler.prompt_buckets = (96,)
  c.trainer.batch_size = 8
  c.trainer.seq_buckets = (96,)
  c.trainer.num_steps = 2
  c.trainer.checkpoint_every = 1
  c.trainer.eval_every = 0
  c.trainer.tensorboard = False
  c.algo.critic_warmup_steps = 0
  c.optim.actor_lr = 1e-3
  c.optim.critic_lr = 1e-3
  for k, v in trainer_kw.items():
    c.trainer[k] = v
  return c


class TrainerTest(absltest.TestCase):

  def test_sync_run_trains_checkpoints_and_resumes_exactly(self):
    workdir = tempfile.mkdtemp()
    before = jax.config.jax_default_matmul_precision
    # (Any precision: the CPU computes float32 in full.) A training time budget spent at once: one step, then stop.
    config = tiny_config(workdir, 'highest', mode='sync', max_train_minutes=1e-9)
    with mock.patch.object(jax.config, 'update', wraps=jax.config.update) as update:
      summary = trainer.run(config)
    # The run's programs were traced under the config's precision, and the process's is back after the run.
    update.assert_any_call('jax_default_matmul_precision', 'highest')
    self.assertEqual(jax.config.jax_default_matmul_precision, before)
    self.assertEqual((summary['steps'], summary['stopped_by_time_budget']), (1, True))
    with open(os.path.join(workdir, trainer.SUMMARY_FILE), encoding='utf-8') as f:
      self.assertEqual(json.load(f), summary)  # What the experiments runner reads (a time budget's end is done).
    summary = trainer.run(tiny_config(workdir, 'highest', mode='sync'))  # Resumed without a budget: on to step 2.
    self.assertFalse(summary['stopped_by_time_budget'])
    with open(os.path.join(workdir, trainer.SUMMARY_FILE), encoding='utf-8') as f:
      self.assertFalse(json.load(f)['stopped_by_time_budget'])  # Rewritten by the resumed process.
    self.assertEqual(summary['steps'], 2)
    self.assertEqual(summary['trajectories'], 16)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [1, 2])
    for r in rows:
      self.assertEqual(r['staleness/max'], 0.0)  # Sync: every batch comes from the current weights.
      self.assertIsNotNone(r['learner/critic/loss'])
    with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
      self.assertEqual(ckpt.all_steps(), [1, 2])
      data = ckpt.restore(2, items=('data',)).data
    self.assertEqual(data['prompts']['taken'], 16)

    # Resume to step 3: the same command with more steps continues at step 2 with the next prompts.
    # Its rows' wall time goes on from the last kept row's (set far ahead here, so carrying it is what we see),
    # and so do the run's totals (trajectories trained; dropped: set ahead too).
    path = os.path.join(workdir, metrics.METRICS_FILE)
    lines = [json.loads(line) for line in open(path, encoding='utf-8')]
    self.assertLess(lines[0]['time/wall_s'], lines[1]['time/wall_s'])
    lines[1]['time/wall_s'] = 1e6
    lines[1]['dropped/pack'] = 1000
    with open(path, 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in lines)
    summary = trainer.run(tiny_config(workdir, 'highest', mode='sync', num_steps=3))
    self.assertEqual(summary['steps'], 3)
    self.assertEqual(summary['trajectories'], 24)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [1, 2, 3])
    self.assertBetween(rows[2]['time/wall_s'], 1e6, 1e6 + summary['wall_s'])
    self.assertEqual([r['trajectories'] for r in rows], [8, 16, 24])
    self.assertEqual(rows[2]['dropped/pack'], 1000)
    with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
      self.assertEqual(ckpt.restore(3, items=('data',)).data['prompts']['taken'], 24)
    # A budget the run's carried training time (its wall time, 1e6 s, less its evals) has spent: no step on resume.
    summary = trainer.run(tiny_config(workdir, 'highest', mode='sync', num_steps=5, max_train_minutes=60.0))
    self.assertEqual((summary['steps'], summary['stopped_by_time_budget']), (3, True))
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2, 3])

    # A changed config is refused on resume, the differing field named (the workdir is left as it was).
    changed = tiny_config(workdir, 'highest', mode='sync', num_steps=4)
    changed.algo.eps_high = 3.0
    with self.assertRaisesRegex(ConfigError, 'algo.eps_high'):
      trainer.run(changed)
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2, 3])

    # The resumed step equals an uninterrupted run's step 3 (same data, same weights).
    straight = tempfile.mkdtemp()
    trainer.run(tiny_config(straight, 'highest', mode='sync', num_steps=3, checkpoint_every=0))
    a = metrics.read_metrics(workdir)[-1]
    b = metrics.read_metrics(straight)[-1]
    for key in ('reward_mean', 'learner/policy/loss', 'learner/critic/loss'):
      np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)

  def test_async_run_respects_the_staleness_bound(self):
    workdir = tempfile.mkdtemp()
    publish, ready = trainer.WeightPublisher.publish, []

    def spy(publisher, model, *, version):  # Whether the update that made `model` had run when it was published.
      ready.append(all(x.is_ready() for x in jax.tree.leaves(nnx.state(model))))
      return publish(publisher, model, version=version)

    with mock.patch.object(trainer.WeightPublisher, 'publish', spy):
      summary = trainer.run(tiny_config(workdir, mode='async', num_steps=3, max_staleness=1, queue_size=16,
                                        checkpoint_every=0))
    self.assertEqual(summary['steps'], 3)
    # Published once each update has run, never beside its temporaries (the initial weights, then 3 updates).
    self.assertEqual(ready, [True] * 4)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [1, 2, 3])
    for r in rows:
      self.assertLessEqual(r['staleness/max'], 1.0)
      # A step's time is idle or busy (with prefetch the queue wait overlaps the update: busy is not dt - wait).
      self.assertAlmostEqual(r['learner/busy_s'], (1 - r['learner/wait_fraction']) * r['perf/step_time_s'],
                             delta=1e-9)

  def test_run_validates_a_raw_config_once_and_a_validated_one_not_again(self):
    # No workdir and no checkpoints: the config validates, and the run stops right after (it needs a workdir).
    config = tiny_config('', checkpoint_every=0)
    with mock.patch.object(config_lib, 'validate', wraps=config_lib.validate) as validate:
      with self.assertRaisesRegex(ConfigError, 'the trainer needs a work directory'):
        trainer.run(config)
      self.assertEqual(validate.call_count, 1)
      resolved = config_lib.validate(config, for_run=True, log=False)  # As sao_jax.main does, before the run.
      with self.assertRaisesRegex(ConfigError, 'the trainer needs a work directory'):
        trainer.run(resolved, validated=True)
      self.assertEqual(validate.call_count, 2)  # Not again inside the run.
    config.algo.eps_low = 1.5  # A raw config is checked: the bad field is named before anything is built.
    with self.assertRaisesRegex(ConfigError, r'config\.algo\.eps_low=1\.5'):
      trainer.run(config)


if __name__ == '__main__':
  absltest.main()
