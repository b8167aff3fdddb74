"""Tests of sao_jax.losses.kl: estimators against exact expectations, entropy against its definition."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from sao_jax.losses import kl


def _categoricals(seed, v=7, closeness=1.0):
  rng = np.random.default_rng(seed)
  logits_p = rng.normal(size=v)
  logits_q = logits_p + closeness * rng.normal(size=v)
  p = np.exp(logits_p) / np.exp(logits_p).sum()
  q = np.exp(logits_q) / np.exp(logits_q).sum()
  return p, q


class KlEstimatorTest(parameterized.TestCase):

  @parameterized.parameters(0, 1, 2)
  def test_exact_expectations(self, seed):
    # Enumerate every token a of the vocabulary: E_p[k(a)] = sum_a p(a) k(a), no sampling noise.
    p, q = _categoricals(seed)
    exact_kl = np.sum(p * (np.log(p) - np.log(q)))
    logp = jnp.asarray(np.log(p), jnp.float32)[None]
    logq = jnp.asarray(np.log(q), jnp.float32)[None]
    k1, k2, k3 = (np.asarray(kl.kl_estimate(logp, logq, e))[0] for e in ('k1', 'k2', 'k3'))
    np.testing.assert_allclose(np.sum(p * k1), exact_kl, rtol=1e-5)  # Unbiased.
    np.testing.assert_allclose(np.sum(p * k3), exact_kl, rtol=1e-5)  # Unbiased.
    self.assertTrue(np.all(k3 >= 0))
    np.testing.assert_allclose(np.sum(p * k2), 0.5 * np.sum(p * np.log(p / q) ** 2), rtol=1e-5)

  def test_k2_is_close_for_close_policies(self):
    p, q = _categoricals(3, closeness=0.05)
    exact_kl = np.sum(p * np.log(p / q))
    k2 = np.asarray(kl.kl_estimate(np.log(p)[None], np.log(q)[None], 'k2'))[0]
    np.testing.assert_allclose(np.sum(p * k2), exact_kl, rtol=0.05)

  def test_masked_kl_and_gradient(self):
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.1, 2, (3, 6)).astype(np.float32)
    ref = -rng.uniform(0.1, 2, (3, 6)).astype(np.float32)
    mask = rng.random((3, 6)) < 0.5
    got = kl.masked_kl(logp, ref, mask, 'k3')
    lr = (ref - logp)[mask]
    np.testing.assert_allclose(got, (np.exp(lr) - 1 - lr).mean(), rtol=1e-5)
    # d k3 / d logp = 1 - exp(log ref - log p).
    grad = jax.grad(lambda x: kl.masked_kl(x, ref, mask, 'k3'))(logp)
    np.testing.assert_allclose(grad, np.where(mask, 1 - np.exp(ref - logp), 0) / mask.sum(), rtol=1e-5, atol=1e-8)
    with self.assertRaisesRegex(ValueError, 'estimator'):
      kl.kl_estimate(logp, ref, 'k4')


class EntropyTest(absltest.TestCase):

  def test_matches_definition(self):
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 5, 11)).astype(np.float32)
    logits[0, 0] += 1e4  # Large offsets are fine (shift invariance, no overflow).
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    want = -(p * np.log(p)).sum(-1)
    got = jax.jit(kl.entropy_from_logits)(logits, mask)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, np.where(mask, want, 0.0), rtol=1e-4, atol=1e-5)

  def test_gradient(self):
    """dH/dz_v = -p_v (log p_v + H), the entropy bonus's gradient."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, (3, 9)).astype(np.float32)
    logits[1] += 50.0
    z = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
    h = -(p * np.log(p)).sum(-1, keepdims=True)
    got = jax.jit(jax.grad(lambda x: jnp.sum(kl.entropy_from_logits(x))))(logits)
    np.testing.assert_allclose(got, -p * (np.log(p) + h), rtol=1e-4, atol=1e-6)

  def test_bfloat16_logits_and_extremes(self):
    logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]], jnp.bfloat16)
    got = kl.entropy_from_logits(logits)
    self.assertEqual(got.dtype, jnp.float32)
    np.testing.assert_allclose(got, [[np.log(4.0), 0.0]], atol=1e-5)


if __name__ == '__main__':
  absltest.main()
