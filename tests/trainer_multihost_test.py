"""A 2-process `jax.distributed` run (4 simulated CPU devices each, one global learner mesh of 8): the same
`trainer.run` on both, each process's actors on its local devices feeding its own rows of every global batch;
it trains, checkpoints, and the same command resumes it."""

import json
import os
import sys
import tempfile

from absl.testing import absltest

from tests import multiprocess
from tests import trainer_helpers


def _worker(port: str, process_id: str, out: str) -> None:
  """One process (run by the test through tests.multiprocess): 2 steps, then the same run resumed to 3."""
  import jax  # pylint: disable=g-import-not-at-top
  from configs import arith  # pylint: disable=g-import-not-at-top
  from sao_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from sao_jax import metrics  # pylint: disable=g-import-not-at-top
  from sao_jax import parallel  # pylint: disable=g-import-not-at-top
  from sao_jax import trainer  # pylint: disable=g-import-not-at-top

  def config(num_steps):
    c = arith.get_config()
    return trainer_helpers.apply(c, {
        **trainer_helpers.TINY, 'workdir': os.path.join(out, 'work'), 'trainer.mode': 'sync',
        'trainer.num_steps': num_steps, 'trainer.checkpoint_every': 1,
        'distributed.coordinator_address': f'127.0.0.1:{port}', 'distributed.num_processes': 2,
        'distributed.process_id': int(process_id)})

  assert parallel.initialize(config(2).distributed, timeout_s=300)
  assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
  first = trainer.run(config(2))
  second = trainer.run(config(3))  # The same command with one more step: resumes at step 2.
  workdir = os.path.join(out, 'work')
  with checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), keep=None) as ckpt:  # Every process.
    steps = ckpt.all_steps()
    data = ckpt.restore(3, items=('data',)).data
  if jax.process_index() == 0:
    with open(os.path.join(out, 'result.json'), 'w') as f:
      json.dump({'first': first['steps'], 'second': second['steps'], 'checkpoints': steps,
                 'rows': [r['step'] for r in metrics.read_metrics(workdir)],
                 'taken': [s['taken'] for s in data['prompts_by_process']]}, f)


class MultiHostTest(absltest.TestCase):

  # Known open defect (issue 10): on this CPU backend the two processes stall at their first step / first
  # checkpoint (observed 2026-12-01: no metrics row after 14 minutes, both processes spinning), so this test is
  # opt-in until that is found. Run it with SAO_MULTIHOST_TRAINER_TEST=1.
  @absltest.skipUnless(os.environ.get('SAO_MULTIHOST_TRAINER_TEST') == '1',
                       'known to stall (issue 10, open): opt in with SAO_MULTIHOST_TRAINER_TEST=1')
  def test_two_processes_train_checkpoint_and_resume(self):
    out = tempfile.mkdtemp()
    multiprocess.run_two_processes(self, 'tests.trainer_multihost_test worker', out, timeout_s=900,
                                   devices_per_process=4)
    with open(os.path.join(out, 'result.json')) as f:
      got = json.load(f)
    self.assertEqual(got['first'], 2)
    self.assertEqual(got['second'], 3)
    self.assertEqual(got['rows'], [1, 2, 3])  # Every step once (process 0 writes metrics.jsonl).
    self.assertContainsSubset([2, 3], got['checkpoints'])
    batch = trainer_helpers.TINY['trainer.batch_size']
    self.assertEqual(got['taken'], [3 * batch // 2] * 2)  # Each process fed half of every batch, resumed.


if __name__ == '__main__':
  if len(sys.argv) == 5 and sys.argv[1] == 'worker':
    _worker(*sys.argv[2:])
  else:
    absltest.main()
