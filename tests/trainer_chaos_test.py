"""The chaos test: `python -m sao_jax.main` on the demo config (sync mode, with its warm start) killed at random
moments, kill -9 and SIGTERM, in the warm start, in RL steps, in checkpoint saves and in evals, and restarted each
time with the same command, ends with the same parameters, bit for bit, as one uninterrupted run with the same seed,
and `metrics.jsonl` has every step exactly once with the same values (README, Resume).

Why bitwise: every restart loads the same compiled programs (the suite's persistent compilation cache), the
warm start and the RL loop resume their exact states (parameters, optimizer states, data positions), and every
episode's sampling seed is a function of (run seed, prompt number, sample): nothing depends on when a process died.
"""

import glob
import os
import random
import signal
import subprocess
import tempfile
import time

from absl.testing import absltest

from sao_jax import metrics
from tests import trainer_helpers

CONFIG = 'configs/arith.py'
FLAGS = {
    **trainer_helpers.TINY,
    'sampler.max_seq_len': 40, 'sampler.prompt_buckets': (40,), 'trainer.seq_buckets': (40,),  # arith's own.
    'sampler.max_new_tokens': 21,
    'trainer.mode': 'sync', 'trainer.num_steps': 8, 'trainer.checkpoint_every': 2, 'trainer.eval_every': 4,
    'task.eval_size': 16,  # Two batches of 8 episodes: an eval can be stopped between them.
    'sft.steps': 20, 'sft.batch_size': 8, 'sft.checkpoint_every': 5, 'sft.log_every': 1,  # 4 warm-start saves.
}
STEPS = 8
COMPARED = ('reward_mean', 'learner/policy/loss', 'learner/critic/loss', 'eval_accuracy', 'trajectories',
            'sft/loss_first', 'sft/loss_last', 'sft/eval_accuracy', 'sft/eval_accuracy_before')


def _log_has(log: str, text: str) -> bool:
  with open(log, errors='replace') as f:
    return text in f.read()


def _saving(workdir: str) -> bool:
  """An orbax save is being written (its temporary directory exists), RL's or the warm start's."""
  return bool(glob.glob(os.path.join(workdir, '**', '*.orbax-checkpoint-tmp*'), recursive=True))


def _rows(workdir: str) -> int:
  return len(metrics.read_metrics(workdir))


# (what to wait for, its description): a kill lands there, after a random delay of 0-0.3 s (none for saves).
# The moments of a restarted run: its own log (a fresh file per attempt) and the workdir's files.
MOMENTS = (
    (lambda w, log: _log_has(log, 'sft step 3/'), 'in the warm start'),
    (lambda w, log: _saving(w), 'in a warm-start save'),
    (lambda w, log: _log_has(log, 'sft step 2'), 'in the warm start'),
    (lambda w, log: _log_has(log, f"Warm start: {FLAGS['sft.steps']} steps"), 'in the step-0 eval'),
    (lambda w, log: _rows(w) >= 2, 'in an RL step'),
    (lambda w, log: _saving(w) and _rows(w) >= 2, 'in an RL save'),
    (lambda w, log: _rows(w) >= 4, 'in an RL step or the step-4 eval'),
    (lambda w, log: _rows(w) >= 5, 'in an RL step'),
    (lambda w, log: _saving(w) and _rows(w) >= 6, 'in an RL save'),
    (lambda w, log: _rows(w) >= 8, 'in the step-8 eval or the last save'),
)


class ChaosTest(absltest.TestCase):

  def test_killed_at_random_moments_it_ends_as_one_uninterrupted_run(self):
    env = trainer_helpers.subprocess_env(devices=1)
    root = tempfile.mkdtemp()
    whole = os.path.join(root, 'whole')
    proc = trainer_helpers.popen_main(CONFIG, whole, FLAGS, env=env, log=os.path.join(root, 'whole.log'))
    self.assertEqual(proc.wait(timeout=900), 0, _tail(os.path.join(root, 'whole.log')))

    workdir = os.path.join(root, 'chaos')
    rng = random.Random(0)
    kills = []
    for attempt, (moment, where) in enumerate(MOMENTS):
      log = os.path.join(root, f'chaos{attempt}.log')
      sig = signal.SIGKILL if rng.random() < 0.5 or 'save' in where else signal.SIGTERM
      proc = trainer_helpers.popen_main(CONFIG, workdir, FLAGS, env=env, log=log)
      deadline = time.monotonic() + 600
      while not moment(workdir, log) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
      if proc.poll() is not None:  # It finished (or failed) first: a moment of a restarted run that went past it.
        self.assertEqual(proc.returncode, 0, _tail(log))
        kills.append((where, 'none: done first'))
        continue
      if 'save' not in where:
        time.sleep(rng.uniform(0.0, 0.3))
      proc.send_signal(sig)
      rc = proc.wait(timeout=600)
      kills.append((where, signal.Signals(sig).name, rc))
      if sig == signal.SIGTERM:  # A signal is honoured: saved, exit 0, in every phase.
        self.assertEqual(rc, 0, _tail(log))
    log = os.path.join(root, 'chaos_last.log')
    proc = trainer_helpers.popen_main(CONFIG, workdir, FLAGS, env=env, log=log)
    self.assertEqual(proc.wait(timeout=900), 0, _tail(log))
    print('Kills:', kills)
    self.assertGreaterEqual(sum(k[1] != 'none: done first' for k in kills), 8, str(kills))

    self.assertEqual(trainer_helpers.checkpoint_fingerprints(workdir, STEPS),
                     trainer_helpers.checkpoint_fingerprints(whole, STEPS), str(kills))  # Bit for bit.
    got, want = metrics.read_metrics(workdir), metrics.read_metrics(whole)
    self.assertEqual([r['step'] for r in got], list(range(STEPS + 1)), str(kills))
    for g, w in zip(got, want):
      for key in COMPARED:
        self.assertEqual(g.get(key), w.get(key), str((g['step'], key, kills)))


def _tail(log: str) -> str:
  with open(log, errors='replace') as f:
    return f.read()[-6000:]


if __name__ == '__main__':
  absltest.main()
