"""`python -m sao_jax.main` killed and resumed: SIGKILL after a checkpoint, then the same command resumes at the
saved step with the data position continued and every step in metrics.jsonl exactly once; SIGTERM saves and
exits 0. The children share one persistent compilation cache (only the first one compiles)."""

import os
import signal
import subprocess
import tempfile
import time

from absl.testing import absltest

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import metrics
from tests import trainer_helpers

CONFIG = 'configs/arith.py'
BATCH = trainer_helpers.TINY['trainer.batch_size']


def run_flags(num_steps: int, checkpoint_every: int) -> dict:
  # Sync mode: each step takes exactly BATCH prompts, so the data position is known at every step.
  return {**trainer_helpers.TINY, 'trainer.mode': 'sync', 'trainer.num_steps': num_steps,
          'trainer.checkpoint_every': checkpoint_every}


def read_log(log: str) -> str:
  with open(log, errors='replace') as f:
    return f.read()[-4000:]


def wait_for(test, proc, log: str, condition, what: str, timeout_s: float = 600.0) -> None:
  """Polls `condition()` every 50 ms until it holds; fails if the child exits first or at the timeout."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    if proc.poll() is not None:
      test.fail(f'the run exited (rc {proc.returncode}) before {what}:\n{read_log(log)}')
    if time.monotonic() > deadline:
      proc.kill()
      test.fail(f'timed out waiting for {what}:\n{read_log(log)}')
    time.sleep(0.05)


def checkpoint_steps(workdir: str) -> list[int]:
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return []
  return sorted(int(d) for d in os.listdir(directory) if d.isdigit())  # Committed steps only (orbax renames).


def taken_at(workdir: str, step: int) -> int:
  with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:
    return int(ckpt.restore(step, items=('data',)).data['prompts']['taken'])


class KillTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.env = trainer_helpers.subprocess_env(devices=1)

  def test_sigkill_then_the_same_command_resumes_exactly(self):
    workdir = tempfile.mkdtemp()
    log = os.path.join(workdir, 'log.txt')
    flags = run_flags(num_steps=5, checkpoint_every=2)
    proc = trainer_helpers.popen_main(CONFIG, workdir, flags, env=self.env, log=log)
    # Killed once checkpoint 2 is committed and step 3 is in metrics.jsonl (a row past the checkpoint).
    wait_for(self, proc, log, lambda: 2 in checkpoint_steps(workdir) and len(metrics.read_metrics(workdir)) >= 3,
             'checkpoint 2 and step 3')
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = max(checkpoint_steps(workdir))
    self.assertIn(saved, (2, 4))
    self.assertGreater(len(metrics.read_metrics(workdir)), saved)  # Steps past the checkpoint: lost, redone.

    proc = trainer_helpers.popen_main(CONFIG, workdir, flags, env=self.env, log=log)
    self.assertEqual(proc.wait(timeout=600), 0, read_log(log))
    self.assertIn(f'Resumed from step {saved} ({saved * BATCH} prompts taken so far)', read_log(log))
    self.assertEqual([r['step'] for r in metrics.read_metrics(workdir)], [1, 2, 3, 4, 5])
    self.assertEqual(max(checkpoint_steps(workdir)), 5)
    self.assertEqual(taken_at(workdir, 5), 5 * BATCH)  # The data position went on from the checkpoint's.

  def test_sigterm_saves_and_exits_zero(self):
    workdir = tempfile.mkdtemp()
    log = os.path.join(workdir, 'log.txt')
    # No periodic checkpoint within reach: the only save is the one the signal triggers.
    proc = trainer_helpers.popen_main(CONFIG, workdir, run_flags(num_steps=1000, checkpoint_every=1000),
                                      env=self.env, log=log)
    wait_for(self, proc, log, lambda: len(metrics.read_metrics(workdir)) >= 1, 'step 1')
    proc.send_signal(signal.SIGTERM)
    self.assertEqual(proc.wait(timeout=300), 0, read_log(log))
    self.assertIn('Received signal 15', read_log(log))
    steps = [r['step'] for r in metrics.read_metrics(workdir)]
    self.assertEqual(steps, list(range(1, len(steps) + 1)))
    self.assertLess(steps[-1], 1000)
    self.assertEqual(checkpoint_steps(workdir), [steps[-1]])
    self.assertEqual(taken_at(workdir, steps[-1]), steps[-1] * BATCH)


if __name__ == '__main__':
  absltest.main()
