"""Tests of sao_jax.losses.common: the log-ratio clamp and the split of an aggregation into parts."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from sao_jax.losses import common


def _aggregate_reference(per_token, mask, agg, max_len):
  """numpy float64 `aggregate` from its formula (rows without tokens left out of row means)."""
  m = mask.astype(bool)
  rows = [b for b in range(m.shape[0]) if m[b].any()]
  if agg == 'token_mean':
    return per_token[m].sum() / max(m.sum(), 1)
  div = {'seq_mean_token_mean': lambda b: m[b].sum(), 'seq_mean_token_sum': lambda b: max_len or m.shape[1]}[agg]
  return sum(per_token[b][m[b]].sum() / div(b) for b in rows) / max(len(rows), 1)


class ClampTest(absltest.TestCase):

  def test_clamp_log_ratio(self):
    x = np.array([-1e9, -20.5, -3.0, 0.0, 19.9, 20.0, 1e30, -np.inf, np.inf], np.float32)
    got = jax.jit(common.clamp_log_ratio)(x)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_array_equal(got, np.minimum(np.maximum(x, -20.0), 20.0))
    self.assertTrue(np.all(np.isfinite(np.exp(np.asarray(got)))))
    self.assertEqual(common.LOG_RATIO_CLAMP, 20.0)
    # Clamped entries get no gradient; the others pass it through.
    g = jax.grad(lambda v: jnp.sum(common.clamp_log_ratio(v)))(jnp.array([-30.0, 1.0, 30.0]))
    np.testing.assert_array_equal(g, [0.0, 1.0, 0.0])
    self.assertEqual(common.clamp_log_ratio(jnp.array([1.0], jnp.bfloat16)).dtype, jnp.float32)


class AggregateSplitTest(parameterized.TestCase):

  @parameterized.parameters('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum')
  def test_parts_weighted_by_their_counts_give_the_whole(self, agg):
    rng = np.random.default_rng(0)
    per_token = rng.normal(size=(8, 12)).astype(np.float32)
    mask = np.zeros((8, 12), bool)
    for b, n in enumerate((12, 1, 7, 0, 11, 2, 12, 0)):
      mask[b, :n] = True
    whole = float(common.aggregate(jnp.asarray(per_token), jnp.asarray(mask), agg, 10))
    np.testing.assert_allclose(whole, _aggregate_reference(per_token.astype(np.float64), mask, agg, 10), rtol=1e-5)
    want_count = mask.sum() if agg == 'token_mean' else mask.any(1).sum()
    self.assertEqual(float(common.aggregate_count(mask, agg)), want_count)
    for parts in (2, 4):  # Interleaved parts, rows {m * parts + i}, as the learner's microbatches.
      total = 0.0
      for i in range(parts):
        p, m = per_token[i::parts], mask[i::parts]
        w = float(common.aggregate_count(m, agg)) / want_count
        total += w * float(common.aggregate(jnp.asarray(p), jnp.asarray(m), agg, 10))
      np.testing.assert_allclose(total, whole, rtol=1e-5)
    with self.assertRaisesRegex(ValueError, 'agg must be one of'):
      common.aggregate_count(mask, 'token_sum')


if __name__ == '__main__':
  absltest.main()
