"""The benchmarks' machine probes: the figures they print follow from their timings."""

import itertools

from absl.testing import absltest

from sao_jax.benchmarks import common


class MemoryBandwidthTest(absltest.TestCase):

  def test_bandwidth_is_twice_the_array_over_the_median_time(self):
    # Timed calls of 10, 40 and 20 ms (a clock read before and after each): the median is 20 ms; each call
    # reads and writes the 4 MiB array.
    ticks = iter(itertools.accumulate([0.0, 0.010, 1.0, 0.040, 1.0, 0.020]))
    gbps = common.memory_bandwidth(mib=4, reps=3, clock=lambda: next(ticks))
    self.assertAlmostEqual(gbps, 2 * 4 * 2 ** 20 / 0.020 / 1e9, places=6)

  def test_runs_for_real(self):
    gbps = common.memory_bandwidth(mib=1, reps=3)
    self.assertGreater(gbps, 0.0)
    self.assertLess(gbps, 1e5)  # Under 100 TB/s: the bytes and seconds are not mixed up by powers of 1000.


if __name__ == '__main__':
  absltest.main()
