"""The multi-process test harness stops what hangs: SIGTERM at the deadline, then SIGABRT (stacks), then SIGKILL."""

import signal
import sys
import tempfile
import time

from absl.testing import absltest

from tests import multiprocess

# A child that ignores SIGTERM (as a process stuck in a collective, or under jax's preemption notifier, does).
DEAF = 'import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint("up", flush=True)\ntime.sleep(600)\n'
DEAFER = DEAF.replace('signal.signal(signal.SIGTERM, signal.SIG_IGN)',
                      'signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGABRT, signal.SIG_IGN)')
QUICK = 'print("done")\n'


class WaitTest(absltest.TestCase):

  def test_a_hang_fails_at_the_deadline_and_is_killed(self):
    procs = multiprocess.start([sys.executable, '-c', DEAF], tempfile.mkdtemp())
    while not all(p.tail() for p in procs):  # Both have set SIG_IGN.
      time.sleep(0.05)
    t0 = time.monotonic()
    with self.assertRaisesRegex(AssertionError, r'2-process run: timed out after 1 s'):
      multiprocess.wait(self, procs, timeout_s=1, grace_s=0.5)
    self.assertLess(time.monotonic() - t0, 60)
    self.assertEqual([p.popen.returncode for p in procs], [-signal.SIGABRT] * 2)  # Ignored SIGTERM: aborted,
    for p in procs:
      self.assertIn('in <module>', p.tail())  # with the stack in its log (faulthandler).

  def test_a_child_deaf_to_abort_is_killed(self):
    procs = multiprocess.start([sys.executable, '-c', DEAFER], tempfile.mkdtemp())
    while not all(p.tail() for p in procs):
      time.sleep(0.05)
    with self.assertRaisesRegex(AssertionError, 'timed out'):
      multiprocess.wait(self, procs, timeout_s=0, grace_s=0.1)
    self.assertEqual([p.popen.returncode for p in procs], [-signal.SIGKILL] * 2)

  def test_one_failing_process_stops_the_other(self):
    out = tempfile.mkdtemp()
    procs = multiprocess.start([sys.executable, '-c', 'import os, sys, time\n'
                                'if os.environ["SAO_PROCESS_ID"] == "1": sys.exit(3)\ntime.sleep(600)\n'], out)
    with self.assertRaisesRegex(AssertionError, 'process 1 failed'):
      multiprocess.wait(self, procs, timeout_s=300, grace_s=5)
    self.assertEqual([p.popen.returncode for p in procs], [-15, 3])  # Process 0 took the SIGTERM.

  def test_both_exit_zero(self):
    procs = multiprocess.start([sys.executable, '-c', QUICK], tempfile.mkdtemp())
    multiprocess.wait(self, procs, timeout_s=300)
    self.assertEqual([p.tail().strip() for p in procs], ['done', 'done'])


if __name__ == '__main__':
  absltest.main()
