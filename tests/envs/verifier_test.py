"""math-verify workers: an address-space limit, logs cut to size, and one timeout that decides."""

import time
from unittest import mock

from absl.testing import absltest

from sao_jax.envs import verifier


def _logged(logs, pid_filter='verifier worker') -> list[str]:
  return [r.getMessage() for r in logs.records if pid_filter in r.getMessage()]


class WorkerLimitsTest(absltest.TestCase):

  def test_a_worker_cannot_take_unbounded_memory(self):
    # One 1 MB reply reached 627 MB in a worker with no limit.
    pool = verifier.WorkerPool(bytearray, num_workers=1, timeout_s=20, memory_mb=256)
    try:
      with self.assertRaisesRegex(verifier.WorkerError, 'MemoryError'):
        pool.call(1 << 30)
      self.assertLen(pool.call(1 << 20), 1 << 20)  # The worker is still there, and useful.
    finally:
      pool.close()

  def test_worker_logs_are_cut_line_by_line(self):
    # On its own timeout math-verify logged the whole input to stderr (2.2 MB, lines of 1 MB).
    pool = verifier.WorkerPool(print, num_workers=1, timeout_s=20)  # In a worker, print goes to stderr.
    try:
      with self.assertLogs(level='WARNING') as logs:
        pool.call('x' * 1_000_000 + '\nshort line')
        deadline = time.monotonic() + 10
        while len(_logged(logs)) < 2 and time.monotonic() < deadline:
          time.sleep(0.01)  # The forwarding thread runs on its own: wait for its lines (bounded).
      lines = _logged(logs)
      self.assertLen(lines, 2, lines[:3])
      self.assertLess(len(lines[0]), verifier.MAX_LOG_CHARS + 100)
      self.assertTrue(lines[0].endswith('[...]'))
      self.assertTrue(lines[1].endswith('short line'))
    finally:
      pool.close()


class OneTimeoutTest(absltest.TestCase):

  def test_math_verify_own_timeouts_are_off(self):
    # The pool's 5 s timeout equalled math-verify's internal 5 s one: inputs near the limit came back either
    # as 0 (math-verify's timeout) or as an error (the pool's). Only the pool's may decide.
    import math_verify  # pylint: disable=g-import-not-at-top
    with mock.patch.object(math_verify, 'parse', wraps=math_verify.parse) as parse, \
        mock.patch.object(math_verify, 'verify', wraps=math_verify.verify) as verify:
      self.assertTrue(verifier.verify_answer('\\frac{1}{2}', '\\boxed{0.5}'))
    self.assertEqual(parse.call_count, 2)
    for call in parse.call_args_list:
      self.assertIsNone(call.kwargs.get('parsing_timeout', 5))
    self.assertIsNone(verify.call_args.kwargs.get('timeout_seconds', 5))

  def test_slow_check_meets_the_pool_timeout(self):
    v = verifier.MathVerifier(num_workers=1, timeout_s=1.0)
    try:
      v.check('1', '\\boxed{1}')  # Started: startup is not part of the timeout.
      t0 = time.monotonic()
      reward, info = v.check('1', '\\boxed{9^{9^{9^{9}}}}')
      self.assertLess(time.monotonic() - t0, 3.0)
      self.assertEqual(reward, 0.0)
      self.assertIn('verifier timeout', info['error'])
    finally:
      v.close()


class GoldProblemTest(absltest.TestCase):

  def test_usable_and_unusable_answers(self):
    for gold in ('204', '\\frac{1}{2}', '(0, 1]', '5\\sqrt{2}', '$x^2+1$'):
      self.assertIsNone(verifier.gold_problem(gold), gold)
    for gold in ('nan', 'NaN', '-inf', 'None', '\\frac{', '', '1' * 1001):
      self.assertIsNotNone(verifier.gold_problem(gold), gold)


if __name__ == '__main__':
  absltest.main()
