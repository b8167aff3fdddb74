"""The MoE benchmark's programs: dropless and a capacity that drops nothing compute the same forward and gradients
on its batch (it compares like with like), and capacity 0.5 really drops."""

import jax
import numpy as np
from absl.testing import absltest

from sao_jax.benchmarks import moe as bench
from sao_jax.models.config import ModelConfig


class MoeBenchmarkTest(absltest.TestCase):

  def test_variants_agree_without_drops(self):
    cfg = ModelConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, mlp_dim=8,
                      num_experts=8, num_experts_per_tok=2, moe_mlp_dim=8, num_shared_experts=1)
    x, p = bench.make_layer(cfg, 40, np.float32)
    results = []
    for variant in (cfg, cfg.replace(moe_impl='capacity', capacity_factor=8.0)):
      fwd, grad = bench.programs(variant)
      y, aux = fwd(x, p)
      (dx, dp), _ = grad(x, p)
      self.assertEqual(float(aux.dropped), 0.0)
      results.append((y, dx, dp))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5), results[0], results[1])
    _, aux = bench.programs(cfg.replace(moe_impl='capacity', capacity_factor=0.5))[0](x, p)
    self.assertGreater(float(aux.dropped), 0.2)


if __name__ == '__main__':
  absltest.main()
