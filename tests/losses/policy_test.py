"""Tests of sao_jax.losses.policy: jax.grad of the loss w.r.t. log-probs is the algorithm (formulas in numpy)."""

import functools
import itertools

import jax
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sao_jax.losses import policy

_EPS_LOW, _EPS_HIGH, _DUAL_C = 0.2, 0.3, 1.5
_MODES = ('double_side', 'ppo', 'dual_clip', 'gspo')
_AGGS = ('token_mean', 'seq_mean_token_mean', 'seq_mean_token_sum')


def _inputs(seed=0, b=5, t=16, spread=0.6):
  """Random log-probs with ratios on both sides of the band, advantages of both signs, an empty row."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.1, 3.0, (b, t)).astype(np.float32)
  behavior = (logp + rng.uniform(-spread, spread, (b, t))).astype(np.float32)
  adv = rng.normal(size=(b, t)).astype(np.float32)
  mask = rng.random((b, t)) < 0.7
  mask[0] = False  # A padding row.
  mask[1, :3] = True
  # Off-mask junk that must not matter.
  logp = np.where(mask, logp, -40.0).astype(np.float32)
  adv = np.where(mask, adv, 1e3).astype(np.float32)
  proximal = (logp + rng.uniform(-spread, spread, (b, t))).astype(np.float32)
  return logp, behavior, adv, mask, proximal


def _agg_weights(mask, agg, max_len=0):
  """d loss / d per_token for each aggregation (numpy)."""
  m = mask.astype(np.float64)
  n_b = m.sum(1, keepdims=True)
  rows = max((n_b > 0).sum(), 1)
  if agg == 'token_mean':
    return m / max(m.sum(), 1)
  if agg == 'seq_mean_token_mean':
    return m / np.maximum(n_b, 1) / rows
  return m / (max_len or m.shape[1]) / rows


def _expected_grad(logp, behavior, adv, mask, mode, agg, proximal=None, correction='none', max_len=0):
  """The policy gradient of each mode, written from the formulas (float64 numpy): d loss / d logp."""
  logp, behavior, adv = (np.asarray(x, np.float64) for x in (logp, behavior, adv))
  ref = behavior if proximal is None else np.asarray(proximal, np.float64)
  lo, hi = 1 - _EPS_LOW, 1 + _EPS_HIGH
  if mode == 'gspo':
    m = mask.astype(np.float64)
    seq = np.exp(((logp - ref) * m).sum(1, keepdims=True) / np.maximum(m.sum(1, keepdims=True), 1))
    r = np.broadcast_to(seq, logp.shape)
  else:
    r = np.exp(logp - ref)
  if mode == 'double_side':
    g = -np.where((r > lo) & (r < hi), r, 0.0) * adv
  else:
    clipped_away = ((adv > 0) & (r > hi)) | ((adv < 0) & (r < lo))
    g = np.where(clipped_away, 0.0, -adv * r)
    if mode == 'dual_clip':
      g = np.where((adv < 0) & (r > _DUAL_C), 0.0, g)
  if proximal is not None:
    w = np.exp(ref - behavior)
    if correction == 'tis':
      w = np.minimum(w, 2.0)
    elif correction == 'icepop':
      w = np.where((w >= 0.5) & (w <= 2.0), w, 0.0)
    g = g * w
  return g * _agg_weights(mask, agg, max_len)


@functools.lru_cache(maxsize=None)
def _loss_and_grad(mode, agg, correction, with_proximal, max_len=0):
  def f(logp, behavior, adv, mask, proximal):
    return policy.policy_loss(logp, behavior, adv, mask, clip_mode=mode, eps_low=_EPS_LOW, eps_high=_EPS_HIGH,
                              agg=agg, dual_clip_c=_DUAL_C, agg_max_len=max_len,
                              proximal_logprobs=proximal if with_proximal else None,
                              behavior_correction=correction, tis_cap=2.0, icepop_low=0.5, icepop_high=2.0)
  return jax.jit(jax.value_and_grad(f, has_aux=True))


class PolicyGradientTest(parameterized.TestCase):

  @parameterized.parameters(*itertools.product(_MODES, _AGGS))
  def test_gradient_equals_formula(self, mode, agg):
    for seed in range(2):
      logp, behavior, adv, mask, proximal = _inputs(seed)
      (_, _), grad = _loss_and_grad(mode, agg, 'none', False)(logp, behavior, adv, mask, proximal)
      want = _expected_grad(logp, behavior, adv, mask, mode, agg)
      np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
      np.testing.assert_array_equal(np.asarray(grad)[~mask], 0.0)  # Masked tokens: no gradient.

  @parameterized.parameters(*itertools.product(('ppo', 'double_side'), ('none', 'tis', 'icepop')))
  def test_decoupled_ppo_gradient(self, mode, correction):
    logp, behavior, adv, mask, proximal = _inputs(3, spread=1.0)
    (_, metrics), grad = _loss_and_grad(mode, 'token_mean', correction, True)(logp, behavior, adv, mask, proximal)
    want = _expected_grad(logp, behavior, adv, mask, mode, 'token_mean', proximal, correction)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-7)
    w = np.exp(proximal.astype(np.float64) - behavior)[mask]
    if correction == 'icepop':
      self.assertAlmostEqual(float(metrics['behavior_masked_frac']), ((w < 0.5) | (w > 2.0)).mean(), places=6)
      self.assertGreater(float(metrics['behavior_masked_frac']), 0.0)  # The inputs exercise the mask.
    if correction == 'tis':
      self.assertGreater((w > 2.0).sum(), 0)  # ... and the cap.

  def test_max_len_divisor(self):
    logp, behavior, adv, mask, proximal = _inputs(1)
    (_, _), grad = _loss_and_grad('double_side', 'seq_mean_token_sum', 'none', False, 64)(
        logp, behavior, adv, mask, proximal)
    want = _expected_grad(logp, behavior, adv, mask, 'double_side', 'seq_mean_token_sum', max_len=64)
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)

  def test_inputs_cover_both_sides_of_the_band(self):
    logp, behavior, adv, mask, _ = _inputs(0)
    r = np.exp(logp - behavior)[mask]
    a = adv[mask]
    for side in (r <= 1 - _EPS_LOW, r >= 1 + _EPS_HIGH, (r > 1 - _EPS_LOW) & (r < 1 + _EPS_HIGH)):
      self.assertGreater((side & (a > 0)).sum(), 0)
      self.assertGreater((side & (a < 0)).sum(), 0)
    self.assertGreater((r > _DUAL_C).sum(), 0)

  def test_double_side_out_of_band_tokens_give_no_gradient(self):
    # One row, four tokens: ratio 0.5 (below), 1.1 (inside), 2.0 (above), 1.1 (inside, masked).
    behavior = np.zeros((1, 4), np.float32)
    logp = np.log(np.array([[0.5, 1.1, 2.0, 1.1]], np.float32))
    mask = np.array([[1, 1, 1, 0]], bool)
    for sign in (1.0, -1.0):
      adv = np.full((1, 4), sign, np.float32)
      (loss, metrics), grad = _loss_and_grad('double_side', 'token_mean', 'none', False)(
          logp, behavior, adv, mask, behavior)
      # token_mean divides by all 3 action tokens, the two cut ones included.
      np.testing.assert_allclose(grad, [[0.0, -sign * 1.1 / 3, 0.0, 0.0]], rtol=1e-6)
      np.testing.assert_allclose(loss, -sign * 1.1 * np.log(1.1) / 3, rtol=1e-5)
      self.assertAlmostEqual(float(metrics['clip_frac_low']), 1 / 3, places=6)
      self.assertAlmostEqual(float(metrics['clip_frac_high']), 1 / 3, places=6)

  def test_gspo_equals_sequence_level_gradient(self):
    # With a row-constant advantage and seq_mean_token_mean, the gradient is GSPO's
    # s_b A_b (1/|y_b|) grad sum_t logpi_t, zero for a clipped sequence.
    logp, behavior, _, mask, proximal = _inputs(2, spread=0.2)
    adv_row = np.array([0.0, 1.0, -2.0, 0.5, -0.3], np.float32)
    adv = np.broadcast_to(adv_row[:, None], logp.shape).astype(np.float32)
    (loss, _), grad = _loss_and_grad('gspo', 'seq_mean_token_mean', 'none', False)(
        logp, behavior, adv, mask, proximal)
    m = mask.astype(np.float64)
    n = m.sum(1)
    s = np.exp(((logp - behavior) * m).sum(1) / np.maximum(n, 1))
    clipped = ((adv_row > 0) & (s > 1 + _EPS_HIGH)) | ((adv_row < 0) & (s < 1 - _EPS_LOW))
    rows = (n > 0).sum()
    want = np.where(clipped, 0.0, -s * adv_row)[:, None] * m / np.maximum(n, 1)[:, None] / rows
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)
    surrogate = np.minimum(s * adv_row, np.clip(s, 1 - _EPS_LOW, 1 + _EPS_HIGH) * adv_row)
    np.testing.assert_allclose(loss, -(surrogate * (n > 0)).sum() / rows, rtol=1e-5)


class DoubleSideBandEdgeTest(parameterized.TestCase):
  """SAO's band is open: a token is kept iff `1 - eps_low < r < 1 + eps_high`, r = pi_theta / pi_behavior.

  eps_low = 0.5 and eps_high = 1.0 put the edges at 0.5 and 2.0, exact in float32; the log-ratios below are
  float32 numbers whose exp (as XLA computes it) is exactly the edge, and the policy log-probs are built as
  `behaviour + log-ratio` with every sum exact, so the loss sees the edge ratios bit for bit.
  """

  EPS_LOW, EPS_HIGH = 0.5, 1.0
  BEHAVIOR = (-0.25, -0.75, -0.5, -0.125)  # Multiples of 2^-24: behaviour + log-ratio is exact in float32.

  @staticmethod
  @functools.lru_cache(maxsize=None)
  def _loss_and_grad():
    def f(logp, behavior, adv, mask):
      return policy.policy_loss(logp, behavior, adv, mask, clip_mode='double_side',
                                eps_low=DoubleSideBandEdgeTest.EPS_LOW, eps_high=DoubleSideBandEdgeTest.EPS_HIGH)
    return jax.jit(jax.value_and_grad(f, has_aux=True))

  def _log_ratios(self, edge):
    """(x_edge, x_inside): float32 log-ratios with exp(x_edge) == edge exactly and exp(x_inside) just inside."""
    exp = jax.jit(jax.numpy.exp)
    x = np.float32(np.log(edge))
    neighbours = [x]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
      y = x
      for _ in range(6):
        y = np.nextafter(y, direction, dtype=np.float32)
        neighbours.append(y)
    values = {float(y): float(exp(y)) for y in neighbours}
    on_edge = [y for y, r in values.items() if r == edge]
    self.assertNotEmpty(on_edge, f'no float32 log-ratio near log({edge}) has exp == {edge}: {values}')
    inside = [y for y, r in values.items() if 0.5 < r < 2.0 and r != edge]
    x_in = min(inside, key=lambda y: abs(values[y] - edge))
    return np.float32(on_edge[0]), np.float32(x_in), values[x_in]

  def _row(self, log_ratios, exact=True):
    behavior = np.array([self.BEHAVIOR], np.float32)
    logp = (behavior + np.array([log_ratios], np.float32)).astype(np.float32)
    if exact:
      np.testing.assert_array_equal(logp - behavior, [log_ratios])  # The sums are exact.
    return logp, behavior

  @parameterized.parameters(1.0, -1.0)
  def test_ratio_exactly_on_an_edge_gives_no_gradient(self, sign):
    x_lo, x_lo_in, r_lo_in = self._log_ratios(0.5)
    x_hi, x_hi_in, r_hi_in = self._log_ratios(2.0)
    logp, behavior = self._row([x_lo, x_lo_in, x_hi, x_hi_in])
    adv = np.full((1, 4), sign, np.float32)
    mask = np.ones((1, 4), bool)
    (_, metrics), grad = self._loss_and_grad()(logp, behavior, adv, mask)
    # The loss saw exactly the edges (its ratio metrics are the ratios it masks with) ...
    self.assertEqual(float(metrics['ratio_min']), 0.5)
    self.assertEqual(float(metrics['ratio_max']), 2.0)
    # ... and cut both edge tokens (strict inequalities) while the tokens one ulp inside keep their gradient
    # -r A / N, N = 4 action tokens (the cut ones count).
    np.testing.assert_allclose(grad, [[0.0, -sign * r_lo_in / 4, 0.0, -sign * r_hi_in / 4]], rtol=1e-6)
    self.assertEqual(float(grad[0, 0]), 0.0)
    self.assertEqual(float(grad[0, 2]), 0.0)
    self.assertAlmostEqual(float(metrics['clip_frac_low']), 0.25)
    self.assertAlmostEqual(float(metrics['clip_frac_high']), 0.25)

  @parameterized.parameters(1.0, -1.0)
  def test_ratio_is_taken_to_the_behaviour_logprobs(self, sign):
    # Policy log-probs = behaviour log-probs + known offsets: ratios 0.3 (out), 0.8, 1.6 (in), 2.5 (out).
    ratios = np.array([0.3, 0.8, 1.6, 2.5])
    logp, behavior = self._row(np.log(ratios).astype(np.float32), exact=False)
    adv = (sign * np.array([[1.0, 2.0, 0.5, 1.5]])).astype(np.float32)
    mask = np.ones((1, 4), bool)
    (_, metrics), grad = self._loss_and_grad()(logp, behavior, adv, mask)
    r = np.exp(np.float64(logp) - behavior)
    want = np.where((r > 0.5) & (r < 2.0), -r * adv, 0.0) / 4
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad)[:, [0, 3]], 0.0)
    np.testing.assert_allclose(metrics['ratio_mean'], ratios.mean(), rtol=1e-6)
    # A ratio to the current policy (r = 1: nothing cut, weight 1) would be far from this.
    self.assertGreater(np.abs(-adv / 4 - grad).max(), 0.1)


class PolicyLossValueAndMetricsTest(parameterized.TestCase):

  def test_ppo_loss_value_and_metrics(self):
    logp, behavior, adv, mask, proximal = _inputs(4)
    (loss, metrics), _ = _loss_and_grad('ppo', 'token_mean', 'none', False)(logp, behavior, adv, mask, proximal)
    lr = (logp.astype(np.float64) - behavior)[mask]
    r, a = np.exp(lr), adv[mask].astype(np.float64)
    lo, hi = 1 - _EPS_LOW, 1 + _EPS_HIGH
    np.testing.assert_allclose(loss, -np.minimum(r * a, np.clip(r, lo, hi) * a).mean(), rtol=1e-5)
    want = {
        'clip_frac_low': ((r < lo) & (a < 0)).mean(), 'clip_frac_high': ((r > hi) & (a > 0)).mean(),
        'ratio_mean': r.mean(), 'ratio_max': r.max(), 'ratio_min': r.min(),
        'approx_kl': (np.exp(lr) - 1 - lr).mean(), 'num_action_tokens': mask.sum(),
    }
    self.assertEqual(set(want), set(metrics))
    for k, v in want.items():
      np.testing.assert_allclose(metrics[k], v, rtol=1e-5, err_msg=k)
      self.assertEqual(metrics[k].shape, (), k)

  def test_double_side_metrics(self):
    logp, behavior, adv, mask, proximal = _inputs(5)
    (loss, metrics), _ = _loss_and_grad('double_side', 'token_mean', 'none', False)(
        logp, behavior, adv, mask, proximal)
    r = np.exp(logp.astype(np.float64) - behavior)[mask]
    f = np.where((r > 1 - _EPS_LOW) & (r < 1 + _EPS_HIGH), r, 0.0)
    np.testing.assert_allclose(loss, -(f * adv[mask] * logp[mask]).mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics['clip_frac_low'], (r <= 1 - _EPS_LOW).mean(), rtol=1e-6)
    np.testing.assert_allclose(metrics['clip_frac_high'], (r >= 1 + _EPS_HIGH).mean(), rtol=1e-6)

  def test_dual_clip_fraction(self):
    logp, behavior, adv, mask, proximal = _inputs(6)
    (_, metrics), _ = _loss_and_grad('dual_clip', 'token_mean', 'none', False)(
        logp, behavior, adv, mask, proximal)
    r, a = np.exp(logp.astype(np.float64) - behavior)[mask], adv[mask]
    np.testing.assert_allclose(metrics['dual_clip_frac'], ((a < 0) & (r > _DUAL_C)).mean(), rtol=1e-6)

  def test_empty_mask_is_finite_zero(self):
    logp, behavior, adv, mask, proximal = _inputs(0)
    mask = np.zeros_like(mask)
    for mode in _MODES:
      (loss, metrics), grad = _loss_and_grad(mode, 'token_mean', 'none', False)(
          logp, behavior, adv, mask, proximal)
      self.assertEqual(float(loss), 0.0)
      np.testing.assert_array_equal(grad, 0.0)
      for k, v in metrics.items():
        self.assertTrue(np.isfinite(v), f'{mode} {k}')

  def test_extreme_log_ratios_stay_finite(self):
    logp = np.array([[0.0, -200.0, -1.0]], np.float32)
    behavior = np.array([[-200.0, 0.0, -1.0]], np.float32)
    adv = np.array([[-1.0, 1.0, 1.0]], np.float32)
    mask = np.ones((1, 3), bool)
    for mode in _MODES:
      (loss, metrics), grad = _loss_and_grad(mode, 'token_mean', 'none', False)(logp, behavior, adv, mask, logp)
      self.assertTrue(np.isfinite(loss), mode)
      self.assertTrue(np.all(np.isfinite(grad)), mode)
      self.assertTrue(all(np.isfinite(v) for v in metrics.values()), mode)

  def test_vmap(self):
    logps, behaviors, advs, masks, _ = zip(*[_inputs(s) for s in range(3)])
    f = lambda lp, b, a, m: policy.policy_loss(lp, b, a, m, clip_mode='ppo', eps_low=0.2, eps_high=0.3)[0]
    got = jax.jit(jax.vmap(f))(*map(np.stack, (logps, behaviors, advs, masks)))
    for i in range(3):
      np.testing.assert_allclose(got[i], jax.jit(f)(logps[i], behaviors[i], advs[i], masks[i]), rtol=1e-6)

  def test_sharded_matches_unsharded(self):
    mesh = Mesh(np.array(jax.devices()[:8]), ('data',))
    rows = NamedSharding(mesh, P('data', None))
    args = _inputs(7, b=8)
    for mode, agg in (('double_side', 'token_mean'), ('gspo', 'seq_mean_token_mean')):
      fn = _loss_and_grad(mode, agg, 'none', False)
      (loss, metrics), grad = fn(*args)
      (s_loss, s_metrics), s_grad = fn(*[jax.device_put(x, rows) for x in args])
      self.assertEqual(s_grad.sharding.spec, P('data', None))
      np.testing.assert_allclose(s_loss, loss, rtol=1e-6)
      np.testing.assert_allclose(s_grad, grad, rtol=1e-6, atol=1e-9)
      for k in metrics:
        np.testing.assert_allclose(s_metrics[k], metrics[k], rtol=1e-6, err_msg=k)

  def test_bad_arguments(self):
    logp, behavior, adv, mask, _ = _inputs(0)
    call = functools.partial(policy.policy_loss, logp, behavior, adv, mask, eps_low=0.2, eps_high=0.3)
    with self.assertRaisesRegex(ValueError, 'clip_mode'):
      call(clip_mode='clip')
    with self.assertRaisesRegex(ValueError, 'agg'):
      call(clip_mode='ppo', agg='mean')
    with self.assertRaisesRegex(ValueError, 'proximal_logprobs'):
      call(clip_mode='ppo', behavior_correction='tis')
    with self.assertRaisesRegex(ValueError, 'behavior_correction'):
      call(clip_mode='ppo', behavior_correction='is')
    with self.assertRaises(TypeError):  # An unknown option names itself.
      call(clip_mode='ppo', dual_clip=3.0)
    with self.assertRaises(AssertionError):  # chex: shapes.
      policy.policy_loss(logp, behavior[:, 1:], adv, mask, clip_mode='ppo', eps_low=0.2, eps_high=0.3)
    with self.assertRaises(AssertionError):  # chex: dtypes (integer log-probs are a bug upstream).
      policy.policy_loss(logp.astype(np.int32), behavior, adv, mask, clip_mode='ppo', eps_low=0.2, eps_high=0.3)


if __name__ == '__main__':
  absltest.main()
