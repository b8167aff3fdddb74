"""Tests of sao_jax.losses.value: masked 0.5 MSE, clipped variant, metrics."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from sao_jax.losses import value


def _inputs(seed=0, b=4, t=10):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(b, t)).astype(np.float32)
  returns = rng.normal(size=(b, t)).astype(np.float32)
  old = (values + rng.normal(0, 0.5, (b, t))).astype(np.float32)
  mask = rng.random((b, t)) < 0.7
  mask[0] = False
  returns = np.where(mask, returns, 1e4).astype(np.float32)  # Off-mask junk must not matter.
  return values, returns, old, mask


class ValueLossTest(parameterized.TestCase):

  def test_plain_mse_value_and_gradient(self):
    v, ret, _, m = _inputs()
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        lambda v: value.value_loss(v, ret, m), has_aux=True))(v)
    n = m.sum()
    np.testing.assert_allclose(loss, 0.5 * ((v - ret)[m] ** 2).mean(), rtol=1e-6)
    np.testing.assert_allclose(grad, np.where(m, (v - ret) / n, 0.0), rtol=1e-5, atol=1e-8)
    res = (ret - v)[m]
    np.testing.assert_allclose(metrics['explained_variance'], 1 - res.var() / ret[m].var(), rtol=1e-5)
    np.testing.assert_allclose(metrics['value_mean'], v[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics['return_mean'], ret[m].mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics['value_error'], (res ** 2).mean(), rtol=1e-5)

  def test_clipped_value_and_gradient(self):
    v, ret, old, m = _inputs(1)
    eps = 0.2
    (loss, metrics), grad = jax.jit(jax.value_and_grad(
        lambda v: value.value_loss(v, ret, m, old_values=old, clip_eps=eps), has_aux=True))(v)
    v64, ret64, old64 = (x.astype(np.float64) for x in (v, ret, old))
    v_clip = old64 + np.clip(v64 - old64, -eps, eps)
    e1, e2 = (v64 - ret64) ** 2, (v_clip - ret64) ** 2
    np.testing.assert_allclose(loss, 0.5 * np.maximum(e1, e2)[m].mean(), rtol=1e-5)
    # Gradient: from the unclipped term where it is the larger one; from the clipped term (zero once clipped).
    inside = np.abs(v64 - old64) < eps
    g = np.where(e1 >= e2, v64 - ret64, np.where(inside, v_clip - ret64, 0.0)) / m.sum()
    np.testing.assert_allclose(grad, np.where(m, g, 0.0), rtol=1e-5, atol=1e-8)
    frac = (~inside & (e2 > e1))[m].mean()
    self.assertGreater(frac, 0.0)
    np.testing.assert_allclose(metrics['value_clip_frac'], frac, rtol=1e-6)

  def test_seq_mean_aggregation(self):
    v, ret, _, m = _inputs(2)
    loss, _ = value.value_loss(v, ret, m, agg='seq_mean_token_mean')
    err = 0.5 * (v - ret) ** 2
    rows = [err[b][m[b]].mean() for b in range(len(m)) if m[b].any()]
    np.testing.assert_allclose(loss, np.mean(rows), rtol=1e-5)

  def test_constant_returns_give_zero_explained_variance(self):
    v, _, _, m = _inputs(3)
    _, metrics = value.value_loss(v, np.ones_like(v), m)
    self.assertEqual(float(metrics['explained_variance']), 0.0)

  def test_half_clip_arguments_fail(self):
    v, ret, old, m = _inputs()
    with self.assertRaisesRegex(ValueError, 'old_values and clip_eps'):
      value.value_loss(v, ret, m, old_values=old)
    with self.assertRaisesRegex(ValueError, 'old_values and clip_eps'):
      value.value_loss(v, ret, m, clip_eps=0.2)

  def test_perfect_critic(self):
    v, _, _, m = _inputs(4)
    loss, metrics = value.value_loss(jnp.asarray(v), v, m)
    self.assertEqual(float(loss), 0.0)
    self.assertAlmostEqual(float(metrics['explained_variance']), 1.0, places=6)


class ExplainedVarianceTest(absltest.TestCase):

  def test_matches_numpy_formula(self):
    v, ret, _, m = _inputs(3)
    got = jax.jit(value.explained_variance)(v, ret, m)
    r, res = ret[m].astype(np.float64), (ret - v)[m].astype(np.float64)
    np.testing.assert_allclose(got, 1 - res.var() / r.var(), rtol=1e-5)
    self.assertEqual(float(value.explained_variance(v, ret, np.zeros_like(m))), 0.0)  # Empty mask.
    np.testing.assert_allclose(value.explained_variance(ret, ret, m), 1.0, rtol=1e-6)
    np.testing.assert_allclose(value.explained_variance(ret + 3.0, ret, m), 1.0, rtol=1e-5)  # A constant offset.
    np.testing.assert_allclose(value.explained_variance(np.zeros_like(ret), ret, m), 0.0, atol=1e-6)

  def test_constant_returns_up_to_rounding_give_zero(self):
    # Equal returns but for float32 rounding (a batch without a reward): undefined, reported as 0, not ~-1e15.
    v, _, _, m = _inputs(5)
    ret = np.full(v.shape, 0.1, np.float32)
    ret[np.nonzero(m)[0][0], np.nonzero(m)[1][0]] = np.nextafter(np.float32(0.1), np.float32(1.0))
    self.assertEqual(float(value.explained_variance(v, ret, m)), 0.0)
    # No reward at all: GAE's returns are 0 up to the rounding of the values they were computed from (SmolLM2's
    # run logged -4e16 here).
    ret0 = (np.random.default_rng(0).standard_normal(v.shape) * 4e-9).astype(np.float32)
    self.assertEqual(float(value.explained_variance(np.full(v.shape, 0.05, np.float32) + 0.01 * v, ret0, m)), 0.0)
    ret[np.nonzero(m)[0][0], np.nonzero(m)[1][0]] = 1.1  # One real reward among them: defined again.
    r, res = ret[m].astype(np.float64), (ret - v)[m].astype(np.float64)
    np.testing.assert_allclose(value.explained_variance(v, ret, m), 1 - res.var() / r.var(), rtol=1e-5)


if __name__ == '__main__':
  absltest.main()
