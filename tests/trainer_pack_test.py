"""The trainer with packed rows (`trainer.pack`): a run trains on them, and processes agree on one batch shape.

The learner's math on packed rows is pinned in tests/learner/packing_test.py; this covers the loop around it.
"""

import tempfile
import threading
from unittest import mock

import jax
import ml_collections
import numpy as np
from absl.testing import absltest

from sao_jax import metrics
from sao_jax import parallel
from sao_jax import rollout
from sao_jax import structs
from sao_jax import trainer
from tests.trainer_test import tiny_config


def _trajectories(lengths, seed):
  """Groups of 2 numbered 0, 1, ... (as each process numbers its own prompts)."""
  rng = np.random.default_rng(seed)
  return [structs.Trajectory(tokens=rng.integers(3, 50, n), action_mask=np.arange(n) >= n // 2,
                             behavior_logprobs=np.where(np.arange(n) >= n // 2, -1.0, 0.0), reward=1.0,
                             group_id=i // 2)
          for i, n in enumerate(lengths)]


class PackedRunTest(absltest.TestCase):

  def test_a_packed_run_trains_on_packed_rows(self):
    workdir = tempfile.mkdtemp()
    config = tiny_config(workdir, mode='sync', pack='ffd', pack_segments=4, checkpoint_every=0)
    config.trainer.seq_buckets = (48, 96)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 2, 2  # Rows split in 2 (8 would make 8 rows).
    config.mesh.actor_devices = 4
    dispatched = []
    dispatch = trainer.Learner.dispatch

    def spy(learner, batch):
      dispatched.append(batch)
      return dispatch(learner, batch)

    with mock.patch.object(trainer.Learner, 'dispatch', spy):
      summary = trainer.run(config)
    self.assertEqual((summary['steps'], summary['trajectories']), (2, 16))
    for batch in dispatched:  # 8 arithmetic episodes (prompt + 6 tokens) share rows: fewer rows than episodes.
      self.assertEqual(int(np.asarray(batch.segment_mask).sum()), 8)
      self.assertLess(batch.shape[0], 8)
      self.assertEqual(batch.num_segments, 4)
    rows = metrics.read_metrics(workdir)
    self.assertEqual([r['step'] for r in rows], [1, 2])
    for row in rows:
      self.assertLess(row['learner/batch/padding_frac'], 0.5)
      self.assertTrue(np.isfinite(row['learner/policy/loss']))


class ProcessAgreementTest(absltest.TestCase):
  """Two processes' packing, each in a thread, exchanging through a stand-in for `parallel.process_max`."""

  def test_processes_pack_to_one_shape(self):
    tr = ml_collections.ConfigDict(dict(seq_buckets=(64, 128, 256), pack='ffd', pack_segments=4, pack_len=0))
    # Process 0: short replies (alone it would pack 2 rows of 128); process 1: one long reply (rows of 256).
    parts = [_trajectories([60, 50, 40, 40, 30, 20], 0), _trajectories([200, 30, 30, 20, 20, 10], 1)]
    alone = [rollout.pack(p, seq_buckets=tr.seq_buckets, pad_id=0, packing='ffd', segments=4, row_multiple=2)
             for p in parts]
    self.assertNotEqual(alone[0].batch.shape, alone[1].batch.shape)  # The case needs agreeing.
    barrier = threading.Barrier(2)
    posted: dict = {}

    def process_max(name, value):  # Both call it in the same order: one exchange per call.
      del name
      posted[threading.get_ident()] = value
      barrier.wait()
      got = max(posted.values())
      barrier.wait()  # Both have read before either posts its next value.
      return got

    out = [None, None]
    index = threading.local()

    def run(i):
      index.value = i
      out[i] = trainer._pack_batch(parts[i], tr, pad_id=0, rows=6, group_size=2, truncation='bootstrap',  # pylint: disable=protected-access
                                   row_multiple=2)

    with mock.patch.object(jax, 'process_count', return_value=2), \
         mock.patch.object(jax, 'process_index', lambda: index.value), \
         mock.patch.object(parallel, 'process_max', process_max):
      threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
      for t in threads:
        t.start()
      for t in threads:
        t.join(timeout=60)
    shapes = {(p.batch.shape, p.batch.num_segments) for p in out}
    self.assertEqual(len(shapes), 1, shapes)
    (rows, seq_len), _ = shapes.pop()
    self.assertEqual(seq_len, 256)  # The longest reply's bucket, on both.
    self.assertEqual(rows % 2, 0)
    for p in out:
      self.assertEqual(sorted(p.kept), list(range(6)))
      rollout.check_batch(p.batch)
    # Both processes numbered their groups 0, 1, 2: the global batch's ids are distinct, each group whole.
    ids = [np.asarray(p.batch.group_ids)[np.asarray(p.batch.segment_mask) > 0] for p in out]
    self.assertEqual(sorted(ids[0].tolist()), [0, 0, 2, 2, 4, 4])
    self.assertEqual(sorted(ids[1].tolist()), [1, 1, 3, 3, 5, 5])


if __name__ == '__main__':
  absltest.main()
