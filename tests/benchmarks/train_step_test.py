"""The train-step benchmark's step: gradient accumulation over microbatches == the whole batch at once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest
from flax import nnx

from sao_jax.benchmarks import train_step
from sao_jax.models import config as config_lib
from sao_jax.models import llama


class TrainStepTest(absltest.TestCase):

  def test_microbatched_step_equals_whole_batch_step(self):
    cfg = config_lib.get_model_config('tiny')
    tokens = jax.random.randint(jax.random.key(1), (4, 12), 0, cfg.vocab_size, jnp.int32)
    results = []
    for micro in (1, 2, 4):
      tx = optax.sgd(0.5)
      step, params = train_step.make_step(llama.Decoder(cfg, rngs=nnx.Rngs(0)), tx, 'full', micro)
      params, _, loss = step(params, tx.init(params), tokens)
      results.append((float(loss), params))
    for loss, params in results[1:]:
      self.assertAlmostEqual(loss, results[0][0], places=5)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), params, results[0][1])
    # The step moved the params (the comparison is not between untouched copies).
    init = nnx.state(llama.Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param)
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), results[0][1], init)
    self.assertGreater(max(jax.tree.leaves(moved)), 1e-4)


if __name__ == '__main__':
  absltest.main()
