"""The attention benchmark's programs: the scan-under-checkpoint alternative (what flash's custom VJP was measured
against) is the same attention, and every implementation's op program gives the same value and gradients."""

import jax
import numpy as np
from absl.testing import absltest

from sao_jax.benchmarks import attention_programs
from sao_jax.models import config as config_lib


class AttentionBenchmarkTest(absltest.TestCase):

  def test_op_programs_agree(self):
    cfg = config_lib.get_model_config('tiny', attention_chunk=16)
    results = {}
    for impl in ('reference', 'flash', 'scan_remat'):
      fn, args = attention_programs.op_program(cfg, impl, 2, 64)
      results[impl] = jax.tree.map(np.asarray, fn(*args))
    for impl in ('flash', 'scan_remat'):
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5), results[impl],
                   results['reference'])


if __name__ == '__main__':
  absltest.main()
