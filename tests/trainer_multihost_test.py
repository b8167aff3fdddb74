"""A 2-process `jax.distributed` run of `python -m sao_jax.main` (4 simulated CPU devices each: the actors on 1 of
them, the learner on a global mesh over the other 3 of both; each process feeds its rows of every global batch
from its own share of the prompts): it trains and checkpoints; the same command resumes it (the step counter, the
metrics rows and both processes' data positions go on); a SIGTERM reaching one process stops both at one step,
saved, exit 0. And `trainer.run` takes SIGTERM from its start (jax's preemption notifier swallows it otherwise).

Sync mode: every step takes exactly `batch_size / 2` prompts on each process, so the data positions are known at
every step (async actors run ahead of the learner by the queue's depth). Uneven compiles are what the trainer must
survive: on the CPU backend the first collective of a device group fails when one process arrives more than 30 s
after the other (gloo), so the trainer compiles its update ahead and meets at `parallel.sync` barriers with a
handshake over the learner's devices (see `sao_jax.parallel.sync`). No persistent compilation cache: it serves
process 0 only (the other's cache keys differ), and a resumed launch whose process 0 loaded its programs while
process 1 compiled them hung in its first update with the parameters sharded over the learner mesh
(`mesh.actor_devices=2`). The children compile with `multiprocess.FAST_COMPILE` and without XLA's fusion emitters
(about 2.5x less compile CPU).
A hang (e.g. processes entering collectives in different orders)
fails the test at its deadline: the workers get SIGTERM, then SIGABRT (their stacks in the failure message), then
SIGKILL (`tests.multiprocess`).
"""

import os
import signal
import tempfile
import time
from unittest import mock

from absl.testing import absltest

from configs import arith
from sao_jax import checkpoint as checkpoint_lib
from sao_jax import metrics
from sao_jax import models
from sao_jax import trainer
from tests import multiprocess
from sao_jax import config_lib
from tests import trainer_helpers

CONFIG = 'configs/arith.py'
# Each process: its actors on 1 of its 4 devices (single-device sampler programs: the cheapest to compile), the
# learner on the other 3 (a global learner mesh of 6, so a batch of 6: 3 rows per process).
BATCH = 6
ROWS = BATCH // 2  # Each process's rows of a global batch.
TIMEOUT_S = 600  # Per launch: only a hang reaches it (a healthy launch is compile-bound: about 40 s of CPU per
# process before FAST_COMPILE; 2 minutes of wall time at a load of 8 on 2 cores).


def command(workdir: str, num_steps: int, pack: str = 'none') -> list[str]:
  return trainer_helpers.main_command(CONFIG, workdir, {
      **trainer_helpers.TINY, 'mesh.actor_devices': 1, 'trainer.batch_size': BATCH, 'trainer.mode': 'sync',
      'trainer.num_steps': num_steps, 'trainer.checkpoint_every': 2, 'trainer.pack': pack})


def steps_written(workdir: str) -> list[int]:
  return [r['step'] for r in metrics.read_metrics(workdir)]


def data_at(workdir: str, step: int) -> list[dict]:
  """Both processes' prompt-stream states in checkpoint `step` (written once, by process 0)."""
  with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
    return ckpt.restore(step, items=('data',)).data['prompts_by_process']


class MultiHostTest(absltest.TestCase):

  def test_two_processes_train_checkpoint_resume_and_stop_on_sigterm(self):
    out = tempfile.mkdtemp()
    workdir = os.path.join(out, 'work')

    # Launch 1: steps 1-2, checkpoint 2 (the last step).
    first = multiprocess.start(command(workdir, 2), out, devices_per_process=4,
                               xla_flags=multiprocess.NO_FUSION_EMITTERS, name='first')
    multiprocess.wait(self, first, timeout_s=TIMEOUT_S)
    self.assertEqual(steps_written(workdir), [1, 2])
    self.assertEqual([s['taken'] for s in data_at(workdir, 2)], [2 * ROWS] * 2)

    # Launch 2: the same command with more steps and packed rows (the processes agree on each batch's packed
    # shape and compile it before the step's barrier) resumes at 2; once step 3 is written, SIGTERM reaches
    # process 1 only: both processes stop at the same step N, save it and exit 0.
    second = multiprocess.start(command(workdir, 1000, pack='ffd'), out, devices_per_process=4,
                                xla_flags=multiprocess.NO_FUSION_EMITTERS, name='second')
    deadline = time.monotonic() + TIMEOUT_S
    while max(steps_written(workdir), default=0) < 3:
      if time.monotonic() > deadline or any(p.popen.poll() is not None for p in second):
        multiprocess.wait(self, second, timeout_s=0)  # Fails with the logs.
        self.fail('the resumed run ended before step 3')
      time.sleep(0.1)
    second[1].popen.send_signal(signal.SIGTERM)
    multiprocess.wait(self, second, timeout_s=TIMEOUT_S)

    for p in second:
      self.assertIn(f'Resumed from step 2 ({2 * ROWS} prompts taken so far)', p.tail(10**6))
      self.assertIn(f'Compiled the learner update for batches of {BATCH} x 224 tokens (8 per row)', p.tail(10**6))
    self.assertIn('Received signal 15', second[1].tail(10**6))
    self.assertNotIn('Received signal', second[0].tail(10**6))
    steps = steps_written(workdir)
    n = steps[-1]
    self.assertEqual(steps, list(range(1, n + 1)))  # Every step once, across both launches.
    self.assertBetween(n, 3, 999)  # Stopped by the signal, not by num_steps.
    with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
      self.assertEqual(ckpt.latest_step(), n)  # Saved where the signal stopped both.
    self.assertEqual([s['taken'] for s in data_at(workdir, n)], [n * ROWS] * 2)  # Both streams went on.


class _Built(Exception):
  """Raised by the test's model build: the run needs to go no further."""


class SignalTest(absltest.TestCase):

  def test_run_catches_sigterm_before_the_model_is_built(self):
    # jax.distributed.initialize installs jax's preemption notifier, which catches SIGTERM and carries on; the
    # trainer's own handler must take over before the long build / compile / resume, not at the loop.
    notifier = []

    def swallow(*_):
      notifier.append('swallowed')

    def build(*args, **kwargs):
      del args, kwargs
      os.kill(os.getpid(), signal.SIGTERM)  # Handled at the next bytecode, in this (the main) thread.
      raise _Built()

    config = config_lib.override(arith.get_config(), {**trainer_helpers.TINY, 'workdir': tempfile.mkdtemp()})
    old = signal.signal(signal.SIGTERM, swallow)
    try:
      with mock.patch.object(models, 'build', build), self.assertLogs(level='WARNING') as logs, \
          self.assertRaises(_Built):
        trainer.run(config)
      self.assertEqual(notifier, [])  # The trainer's handler had it.
      self.assertIn('Received signal 15', '\n'.join(logs.output))
      self.assertIs(signal.getsignal(signal.SIGTERM), swallow)  # run() put the previous handler back.
    finally:
      signal.signal(signal.SIGTERM, old)

if __name__ == '__main__':
  absltest.main()
