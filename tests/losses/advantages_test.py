"""Tests of sao_jax.losses.advantages: skip-observation GAE, adaptive lambda, group baselines, whitening."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sao_jax.losses import advantages

# (name, impl, (block, tile)): every jax implementation; blocked with blocks and tiles that do not divide T,
# one block, one tile.
_IMPLS = (('associative', 'associative', (64, 0)), ('scan', 'scan', (64, 0)), ('blocked_3', 'blocked', (3, 0)),
          ('blocked_2_tiles_5', 'blocked', (2, 5)))
_IMPLS_RANDOM = _IMPLS + (('blocked_64', 'blocked', (64, 0)), ('blocked_4_tiles_16', 'blocked', (4, 16)))
_B, _T, _GAMMA = 8, 40, 0.97  # Shape and discount of the random cases (one compile per impl, reused).


@functools.lru_cache(maxsize=None)
def _jitted(impl, block_tile, gamma):
  block, tile = block_tile
  return jax.jit(lambda r, v, m, lam, boot: advantages.skip_observation_gae(
      r, v, m, gamma=gamma, lam=lam, bootstrap=boot, impl=impl, block=block, tile=tile))


def _gae(impl, block, r, v, m, *, gamma, lam=1.0, boot=None):
  """Jitted skip_observation_gae (one compile per impl, block, gamma and shapes)."""
  return _jitted(impl, block, gamma)(r, v, m, jnp.asarray(lam, jnp.float32), boot)


def _gae_from_formula(rewards, values, mask, gamma, lam, bootstrap=None):
  """docs/design.md formula, literally: loop over the action positions i_1 < ... < i_n of each row (float64)."""
  r, v = np.asarray(rewards, np.float64), np.asarray(values, np.float64)
  bsz = r.shape[0]
  lam = np.broadcast_to(np.asarray(lam, np.float64), (bsz,))
  boot = np.zeros(bsz) if bootstrap is None else np.asarray(bootstrap, np.float64)
  adv = np.zeros_like(r)
  for b in range(bsz):
    idx = np.flatnonzero(mask[b])
    n = len(idx)
    v_act = [v[b, i] for i in idx] + [boot[b]]  # V[i_{n+1}] = bootstrap
    a_next = 0.0
    for k in range(n - 1, -1, -1):
      delta = r[b, idx[k]] + gamma * v_act[k + 1] - v_act[k]
      a_next = delta + gamma * lam[b] * a_next
      adv[b, idx[k]] = a_next
  ret = np.where(mask, adv + v, 0.0)
  return adv, ret


def _random_inputs(seed, b=_B, t=_T, p_action=0.6):
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(b, t)).astype(np.float32)
  v = rng.normal(size=(b, t)).astype(np.float32)
  m = rng.random((b, t)) < p_action
  m[0] = False  # An all-observation row.
  m[1, :] = True  # An all-action row.
  lam = rng.uniform(0, 1, size=b).astype(np.float32)
  lam[2], lam[3] = 0.0, 1.0
  boot = rng.normal(size=b).astype(np.float32)
  return r, v, m, lam, boot


class SkipObservationGaeTest(parameterized.TestCase):

  def _hand_case(self):
    # Prompt (obs), action, action, tool output (obs, obs), action, padding. Rewards off actions are ignored.
    r = np.array([[7.0, 0.0, 0.0, 100.0, -3.0, 1.0, 50.0]], np.float32)
    v = np.array([[9.0, 0.5, 0.6, 9.0, 9.0, 0.8, 9.0]], np.float32)
    m = np.array([[0, 1, 1, 0, 0, 1, 0]], bool)
    return r, v, m

  @parameterized.named_parameters(*_IMPLS)
  def test_observations_between_turns(self, impl, block):
    r, v, m = self._hand_case()
    adv, ret = _gae(impl, block, r, v, m, gamma=0.9, lam=0.5)
    # delta_3 = 1 - 0.8 = 0.2; delta_2 = 0.9*0.8 - 0.6 = 0.12; delta_1 = 0.9*0.6 - 0.5 = 0.04; gl = 0.45.
    want_adv = [0.0, 0.04 + 0.45 * 0.21, 0.12 + 0.45 * 0.2, 0.0, 0.0, 0.2, 0.0]
    want_ret = [0.0, 0.5 + 0.1345, 0.6 + 0.21, 0.0, 0.0, 1.0, 0.0]
    np.testing.assert_allclose(adv[0], want_adv, atol=1e-6)
    np.testing.assert_allclose(ret[0], want_ret, atol=1e-6)
    self.assertEqual(adv.dtype, jnp.float32)
    self.assertEqual(ret.dtype, jnp.float32)

  @parameterized.named_parameters(*_IMPLS)
  def test_bootstrap(self, impl, block):
    r, v, m = self._hand_case()
    adv, ret = _gae(impl, block, r, v, m, boot=np.array([2.0], np.float32), gamma=0.9, lam=0.5)
    # delta_3 = 1 + 0.9*2 - 0.8 = 2.0; A_2 = 0.12 + 0.45*2 = 1.02; A_1 = 0.04 + 0.45*1.02 = 0.499.
    np.testing.assert_allclose(adv[0], [0, 0.499, 1.02, 0, 0, 2.0, 0], atol=1e-6)
    np.testing.assert_allclose(ret[0], [0, 0.999, 1.62, 0, 0, 2.8, 0], atol=1e-6)

  @parameterized.named_parameters(*_IMPLS)
  def test_all_observation_row_is_zero(self, impl, block):
    r = np.ones((2, 9), np.float32)
    v = np.full((2, 9), 3.0, np.float32)
    m = np.zeros((2, 9), bool)
    m[1, 4] = True
    adv, ret = _gae(impl, block, r, v, m, boot=np.array([5.0, 5.0], np.float32), gamma=1.0, lam=1.0)
    np.testing.assert_array_equal(adv[0], 0.0)
    np.testing.assert_array_equal(ret[0], 0.0)
    # The other row's only action: delta = 1 + 5 - 3.
    np.testing.assert_allclose(adv[1], np.where(m[1], 3.0, 0.0))

  @parameterized.named_parameters(*_IMPLS_RANDOM)
  def test_matches_formula_on_random_inputs(self, impl, block):
    for seed in range(3):
      r, v, m, lam, boot = _random_inputs(seed)
      want_adv, want_ret = _gae_from_formula(r, v, m, _GAMMA, lam, boot)
      adv, ret = _gae(impl, block, r, v, m, lam=lam, boot=boot, gamma=_GAMMA)
      np.testing.assert_allclose(adv, want_adv, atol=2e-5, rtol=1e-5)
      np.testing.assert_allclose(ret, want_ret, atol=2e-5, rtol=1e-5)
      np.testing.assert_array_equal(np.asarray(adv)[~m], 0.0)
      np.testing.assert_array_equal(np.asarray(ret)[~m], 0.0)

  def test_implementations_agree(self):
    r, v, m, lam, boot = _random_inputs(7, p_action=0.8)
    ref = _gae('scan', (64, 0), r, v, m, lam=lam, boot=boot, gamma=_GAMMA)
    for impl, block in (('associative', (64, 0)), ('blocked', (64, 0)), ('blocked', (4, 16))):
      out = _gae(impl, block, r, v, m, lam=lam, boot=boot, gamma=_GAMMA)
      for got, want in zip(out, ref):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=f'{impl} {block}')
    np.testing.assert_allclose(ref[0], advantages.skip_observation_gae_numpy(r, v, m, gamma=_GAMMA, lam=lam,
                                                                             bootstrap=boot)[0], atol=1e-5)

  def test_per_row_lambda_equals_rows_run_alone(self):
    r, v, m, lam, boot = _random_inputs(3)
    adv, _ = _gae('auto', (64, 0), r, v, m, lam=lam, boot=boot, gamma=0.9)
    for b in range(r.shape[0]):
      one = slice(b, b + 1)
      row, _ = _gae('auto', (64, 0), r[one], v[one], m[one], lam=float(lam[b]), boot=boot[one], gamma=0.9)
      np.testing.assert_allclose(adv[b], row[0], atol=1e-6)

  @parameterized.named_parameters(*_IMPLS)
  def test_outputs_carry_no_gradient(self, impl, block):
    r, v, m, lam, boot = _random_inputs(1)

    def f(r, v, boot):
      adv, ret = advantages.skip_observation_gae(r, v, m, gamma=0.9, lam=lam, bootstrap=boot, impl=impl,
                                                 block=block[0], tile=block[1])
      return jnp.sum(adv * 3.0 + ret ** 2)

    grads = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(r, v, boot)
    for g in grads:
      np.testing.assert_array_equal(g, 0.0)

  @parameterized.named_parameters(*_IMPLS[1:])
  def test_vmap(self, impl, block):
    rs, vs, ms = zip(*[_random_inputs(seed)[:3] for seed in range(3)])
    f = lambda r, v, m: advantages.skip_observation_gae(r, v, m, gamma=_GAMMA, lam=1.0, impl=impl,
                                                        block=block[0], tile=block[1])
    adv, _ = jax.jit(jax.vmap(f))(np.stack(rs), np.stack(vs), np.stack(ms))
    for i in range(3):
      np.testing.assert_allclose(adv[i], _gae(impl, block, rs[i], vs[i], ms[i], gamma=_GAMMA)[0], atol=1e-6)

  def test_sharded_matches_unsharded(self):
    mesh = Mesh(np.array(jax.devices()[:8]), ('data',))
    rows = NamedSharding(mesh, P('data', None))
    vec = NamedSharding(mesh, P('data'))
    r, v, m, lam, boot = _random_inputs(5)
    args = (r, v, m, lam, boot)
    for impl in ('associative', 'scan', 'blocked'):
      f = jax.jit(lambda r, v, m, lam, boot, impl=impl: advantages.skip_observation_gae(
          r, v, m, gamma=0.95, lam=lam, bootstrap=boot, impl=impl, block=4, tile=16))
      want = f(*args)
      placed = [jax.device_put(x, rows if x.ndim == 2 else vec) for x in args]
      got = f(*placed)
      self.assertEqual(got[0].sharding.spec, P('data', None))
      for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-6)

  def test_bad_arguments(self):
    r, v, m, _, _ = _random_inputs(0)
    with self.assertRaisesRegex(ValueError, 'impl'):
      advantages.skip_observation_gae(r, v, m, gamma=1.0, lam=1.0, impl='fast')
    with self.assertRaisesRegex(ValueError, 'lam'):
      advantages.skip_observation_gae(r, v, m, gamma=1.0, lam=np.ones(3))
    with self.assertRaisesRegex(ValueError, 'bootstrap'):
      advantages.skip_observation_gae(r, v, m, gamma=1.0, lam=1.0, bootstrap=np.ones((5, 1)))
    with self.assertRaises(AssertionError):  # chex: shapes differ.
      advantages.skip_observation_gae(r, v[:, :-1], m, gamma=1.0, lam=1.0)

  def test_default_impl(self):
    self.assertEqual(advantages.default_gae_impl('cpu'), 'blocked')
    self.assertEqual(advantages.default_gae_impl('gpu'), 'associative')
    self.assertEqual(advantages.default_gae_impl('tpu'), 'associative')


class ActionSpanMaskTest(absltest.TestCase):

  def test_matches_first_to_last_action_loop(self):
    rng = np.random.default_rng(3)
    m = (rng.random((6, 17)) < 0.3).astype(np.float32)
    m[0] = 0.0  # A row without actions: empty span.
    m[1] = 0.0
    m[1, [2, 3, 4]] = 1.0  # One turn: the span is the action mask itself.
    want = np.zeros_like(m)
    for b in range(len(m)):
      acted = np.flatnonzero(m[b])
      if len(acted):
        want[b, acted[0]:acted[-1] + 1] = 1.0
    got = np.asarray(advantages.action_span_mask(jnp.asarray(m)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], m[1])
    self.assertGreater((got > m).sum(), 0)  # Observation gaps were filled.


class AdaptiveLambdaTest(absltest.TestCase):

  def test_values(self):
    m = np.zeros((4, 12), bool)
    m[1, 3] = True
    m[2, :3] = True
    m[3, 2:12] = True
    lam = jax.jit(advantages.adaptive_lambda)(m)
    np.testing.assert_allclose(lam, [0.0, 1 - 1 / 1.5, 1 - 1 / 4.5, 1 - 1 / 15], rtol=1e-6)
    self.assertEqual(lam.shape, (4,))

  def test_clipped_to_unit_interval(self):
    m = np.zeros((2, 5), bool)
    m[0, 0] = True
    m[1] = True
    np.testing.assert_allclose(advantages.adaptive_lambda(m, alpha=0.5), [0.0, 1 - 1 / 2.5], rtol=1e-6)


class GroupAdvantagesTest(parameterized.TestCase):

  def test_grpo_matches_formula(self):
    rng = np.random.default_rng(0)
    rew = rng.normal(size=(3, 5)).astype(np.float32)
    got = advantages.group_advantages(rew)
    want = (rew - rew.mean(1, keepdims=True)) / (rew.std(1, ddof=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

  def test_dr_grpo_is_centered_only(self):
    rew = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]], np.float32)
    got = advantages.group_advantages(rew, std_normalize=False)
    np.testing.assert_allclose(got, [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]], atol=1e-7)

  @parameterized.parameters(True, False)
  def test_equal_rewards_give_exactly_zero(self, std_normalize):
    rew = np.array([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.3, 0.3, 0.3]], np.float32)
    got = advantages.group_advantages(rew, std_normalize=std_normalize)
    np.testing.assert_array_equal(got, 0.0)
    np.testing.assert_array_equal(advantages.leave_one_out_advantages(rew), 0.0)

  def test_rloo_matches_leave_one_out_loop(self):
    rng = np.random.default_rng(1)
    rew = rng.normal(size=(2, 4)).astype(np.float32)
    want = np.array([[rew[p, i] - np.delete(rew[p], i).mean() for i in range(4)] for p in range(2)])
    np.testing.assert_allclose(advantages.leave_one_out_advantages(rew), want, rtol=1e-5, atol=1e-6)
    with self.assertRaisesRegex(ValueError, 'G >= 2'):
      advantages.leave_one_out_advantages(rew[:, :1])

  def test_broadcast_to_tokens(self):
    m = np.array([[0, 1, 1, 0], [1, 0, 0, 0]], bool)
    got = advantages.broadcast_to_tokens(np.array([2.0, -1.0], np.float32), m)
    np.testing.assert_array_equal(got, [[0, 2, 2, 0], [-1, 0, 0, 0]])


class WhitenTest(absltest.TestCase):

  def test_global_over_action_tokens(self):
    rng = np.random.default_rng(0)
    a = rng.normal(3.0, 2.0, size=(3, 10)).astype(np.float32)
    m = rng.random((3, 10)) < 0.6
    a_off = np.where(m, a, 1e6).astype(np.float32)  # Values off the mask must not leak in.
    got = np.asarray(jax.jit(advantages.whiten)(a_off, m))
    sel = a[m]
    np.testing.assert_allclose(got[m], (sel - sel.mean()) / np.sqrt(sel.var() + 1e-8), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[~m], 0.0)
    self.assertAlmostEqual(float(got[m].mean()), 0.0, places=5)
    self.assertAlmostEqual(float(got[m].std()), 1.0, places=4)
    kept = np.asarray(advantages.whiten(a, m, shift_mean=False))
    np.testing.assert_allclose(kept[m], sel / np.sqrt(sel.var() + 1e-8), rtol=1e-5)


if __name__ == '__main__':
  absltest.main()
