"""Tests of sao_jax.metrics: metrics.jsonl rows once per step across resumes, TensorBoard scalars, meters."""

import errno
import glob
import json
import logging as logging_std
import math
import os
import struct
import tempfile

from absl.testing import absltest
import numpy as np
from tensorboardX.proto import event_pb2

from sao_jax import metrics
from sao_jax.errors import RunError
from tests import trainer_helpers


def _tb_scalars(logdir):
  """(tag, step, value) of every scalar in the event files under `logdir` (TFRecord framing, read by hand)."""
  out = []
  for path in sorted(glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))):
    with open(path, 'rb') as f:
      data = f.read()
    pos = 0
    while pos < len(data):
      (n,) = struct.unpack('<Q', data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + n])
      pos += 12 + n + 4
      for v in event.summary.value:
        out.append((v.tag, event.step, v.simple_value))
  return out


class FakeClock:

  def __init__(self):
    self.t = 100.0

  def __call__(self):
    return self.t


class MetricsWriterTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp()

  def test_rows_round_trip_with_non_finite_as_null(self):
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(1, {'loss': np.float32(0.5), 'n': np.int64(3), 'bad': float('nan'), 'inf': np.inf, 'ok': True})
    rows = metrics.read_metrics(self.dir)
    self.assertEqual(rows, [{'step': 1, 'loss': 0.5, 'n': 3, 'bad': None, 'inf': None, 'ok': True}])
    with open(os.path.join(self.dir, metrics.METRICS_FILE)) as f:
      json.loads(f.read())  # Valid JSON: no NaN literal.

  def test_resume_keeps_every_step_exactly_once(self):
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      for s in range(1, 6):
        w.write(s, {'x': s})
    with open(os.path.join(self.dir, metrics.METRICS_FILE), 'a') as f:
      f.write('{"step": 6, "x"')  # A row torn by a kill.
    with metrics.MetricsWriter(self.dir, resume_step=3, tensorboard=False) as w:
      for s in range(4, 8):
        w.write(s, {'x': 10 * s})
    rows = metrics.read_metrics(self.dir)
    self.assertEqual([r['step'] for r in rows], [1, 2, 3, 4, 5, 6, 7])
    self.assertEqual([r['x'] for r in rows], [1, 2, 3, 40, 50, 60, 70])

  def test_fresh_writer_appends(self):
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(1, {'x': 1})
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(2, {'x': 2})
    self.assertEqual([r['step'] for r in metrics.read_metrics(self.dir)], [1, 2])

  def test_a_row_the_disk_cannot_take_is_not_half_written(self):
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(1, {'x': 1})
      real = w._file  # pylint: disable=protected-access

      class FillingDisk:
        """A raw file on a disk that fills up: the first write lands 10 bytes, the next fails (ENOSPC)."""
        calls = 0

        def write(self, data):
          FillingDisk.calls += 1
          if FillingDisk.calls == 1:
            return real.write(bytes(data[:10]))
          raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
          return getattr(real, name)

      w._file = FillingDisk()  # pylint: disable=protected-access
      with self.assertRaisesRegex(RunError, r'metrics.jsonl: could not write the row of step 2: No space left'):
        w.write(2, {'x': 2})
      w._file = real  # pylint: disable=protected-access
    with open(os.path.join(self.dir, metrics.METRICS_FILE)) as f:
      self.assertEqual(f.read(), '{"step": 1, "x": 1}\n')  # (It used to keep the part written.)

  def test_a_torn_last_line_is_dropped_when_the_file_is_opened(self):
    with open(os.path.join(self.dir, metrics.METRICS_FILE), 'w') as f:
      f.write('{"step": 1, "x": 1}\n{"step": 2, "x"')
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(2, {'x': 2})
    with open(os.path.join(self.dir, metrics.METRICS_FILE)) as f:
      self.assertEqual(f.read().splitlines(), ['{"step": 1, "x": 1}', '{"step": 2, "x": 2}'])

  def test_on_a_full_tmpfs_the_run_stops_with_whole_rows_only(self):
    mount = trainer_helpers.tmpfs(self, 'size=64k')
    with metrics.MetricsWriter(mount, tensorboard=False) as w:
      with self.assertRaisesRegex(RunError, 'No space left on device'):
        for step in range(100000):
          w.write(step, {'payload': 'x' * 1000})
    with open(os.path.join(mount, metrics.METRICS_FILE), 'rb') as f:
      data = f.read()
    self.assertTrue(data.endswith(b'\n'))
    self.assertEqual([json.loads(line)['step'] for line in data.splitlines()], list(range(step)))

  def test_a_row_is_updated_in_place(self):
    with metrics.MetricsWriter(self.dir, tensorboard=False) as w:
      w.write(1, {'x': 1})
      w.write(2, {'x': 2})
      w.update(2, {'eval': 0.5})
      w.write(3, {'x': 3})
    self.assertEqual(metrics.read_metrics(self.dir), [{'step': 1, 'x': 1}, {'step': 2, 'x': 2, 'eval': 0.5},
                                                      {'step': 3, 'x': 3}])

  def test_tensorboard_scalars(self):
    with metrics.MetricsWriter(self.dir) as w:
      w.write(1, {'learner/loss': 0.25, 'reward_mean': 1.0, 'skip': None, 'name': 'x'})
      w.write(2, {'learner/loss': 0.125})
    got = _tb_scalars(os.path.join(self.dir, 'tensorboard'))
    self.assertCountEqual(got, [('learner/loss', 1, 0.25), ('reward_mean', 1, 1.0), ('learner/loss', 2, 0.125)])


class LibraryLogsTest(absltest.TestCase):

  def _record(self, pathname, level, exc=None, name='absl'):
    record = logging_std.LogRecord(name, level, pathname, 1, 'save failed: %s', ('step 4',),
                                   None if exc is None else (type(exc), exc, None))
    return record

  def test_orbax_info_is_dropped_and_its_tracebacks_become_one_line(self):
    f = metrics._LibraryInfoFilter(('orbax',))  # pylint: disable=protected-access
    orbax = '/x/site-packages/orbax/checkpoint/manager.py'
    self.assertFalse(f.filter(self._record(orbax, logging_std.INFO)))
    self.assertTrue(f.filter(self._record('/x/sao_jax/trainer.py', logging_std.INFO)))
    error = OSError(28, 'No space left on device')
    for record in (self._record(orbax, logging_std.ERROR, error),
                   self._record('/x/asyncio/base_events.py', logging_std.ERROR, error, name='asyncio')):
      if record.name == 'asyncio':
        record.msg, record.args = 'Task exception was never retrieved: coro at %s', ('/x/orbax/serialization.py',)
      self.assertTrue(f.filter(record))
      text = logging_std.Formatter().format(record)
      self.assertEqual(text.splitlines()[1:], ['OSError: [Errno 28] No space left on device'])  # No traceback.
    mine = self._record('/x/sao_jax/trainer.py', logging_std.ERROR, error)
    self.assertTrue(f.filter(mine))
    self.assertIsNotNone(mine.exc_info)  # Ours keep theirs.


class MetersTest(absltest.TestCase):

  def test_rate_meter_window(self):
    clock = FakeClock()
    m = metrics.RateMeter(window=10.0, clock=clock)
    clock.t += 5.0
    m.add(50)
    self.assertAlmostEqual(m.rate(), 10.0)  # 50 events over the 5 s since start.
    clock.t += 10.0
    m.add(30)
    self.assertAlmostEqual(m.rate(), 3.0)  # The first 50 left the 10 s window.
    self.assertEqual(m.total, 80)

  def test_progress_eta_from_recent_steps(self):
    clock = FakeClock()
    p = metrics.Progress(100, start_step=0, window=2, clock=clock)
    clock.t += 60.0  # A slow first step (compiles).
    p.line(1, {})
    for s in range(2, 5):
      clock.t += 2.0
      line = p.line(s, {'reward_mean': 0.5, 'eval_accuracy': float('nan')})
    self.assertAlmostEqual(p.seconds_per_step(), 2.0)  # The window forgot the slow step.
    self.assertIn('step 4/100', line)
    self.assertIn('reward 0.500', line)
    self.assertNotIn('acc', line)
    self.assertIn('ETA 3m12s', line)  # 96 steps x 2 s.
    clock.t += 2.0
    self.assertIn('ETA 1m05s', p.line(5, {}, time_left_s=65.0))  # A time budget ends the run sooner.
    clock.t += 2.0
    self.assertIn('ETA 3m08s', p.line(6, {}, time_left_s=1e6))

  def test_format_duration(self):
    self.assertEqual(metrics.format_duration(42), '42s')
    self.assertEqual(metrics.format_duration(185), '3m05s')
    self.assertEqual(metrics.format_duration(3720), '1h02m')
    self.assertEqual(metrics.format_duration(math.nan), '?')


if __name__ == '__main__':
  absltest.main()
