"""Packed rows (several trajectories per row, `segment_ids`) in the losses, against numpy loops over segments.

Each case lays random trajectories out packed and checks every function against the same formula applied to each
trajectory alone (the docs/design.md contracts). Mutations these catch: a GAE chain running across a segment
boundary (the next segment's first action value, or its advantage, leaking into the previous one); a segment's
bootstrap entering at the row's end instead of its own; lambda or a sequence statistic taken per row, not per
segment; group statistics over rows instead of group ids.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from sao_jax import losses
from sao_jax.losses import advantages

_IMPLS = (('associative', 'associative', 64, 0), ('scan', 'scan', 64, 0), ('blocked_3', 'blocked', 3, 0),
          ('blocked_2_tiles_5', 'blocked', 2, 5))
_GAMMA = 0.97


def _packed_case(seed, rows=4, t=40, max_segments=4):
  """Random packed rows: segments of 3..12 tokens (prompt, then mixed action / observation tokens), padding.

  Returns (rewards, values, mask, segment_ids, lam[B, S], boot[B, S], per-segment slices).
  """
  rng = np.random.default_rng(seed)
  r = rng.normal(size=(rows, t)).astype(np.float32)
  v = rng.normal(size=(rows, t)).astype(np.float32)
  m = np.zeros((rows, t), bool)
  seg = np.zeros((rows, t), np.int32)
  spans = []
  for b in range(rows):
    pos, s = 0, 0
    while s < max_segments:
      n = int(rng.integers(3, 13))
      if pos + n > t:
        break
      seg[b, pos:pos + n] = s + 1
      m[b, pos + 1:pos + n] = rng.random(n - 1) < 0.7
      m[b, pos + n - 1] = rng.random() < 0.5 or not m[b, pos + 1:pos + n].any()  # Ends on an action or an obs.
      spans.append((b, s, pos, pos + n))
      pos, s = pos + n, s + 1
  if rows > 1:  # One row that exactly fills its length with one segment.
    seg[-1], m[-1] = 1, rng.random(t) < 0.6
    m[-1, 0] = False
    spans = [x for x in spans if x[0] != rows - 1] + [(rows - 1, 0, 0, t)]
  lam = rng.uniform(0, 1, (rows, max_segments)).astype(np.float32)
  boot = rng.normal(size=(rows, max_segments)).astype(np.float32)
  return r, v, m, seg, lam, boot, spans


def _gae_alone(r, v, m, gamma, lam, boot):
  """The formula on one trajectory's 1-D arrays (float64): action positions, then the backward recursion."""
  idx = np.flatnonzero(m)
  adv = np.zeros(len(r))
  vals = [float(v[i]) for i in idx] + [float(boot)]
  a = 0.0
  for k in range(len(idx) - 1, -1, -1):
    a = r[idx[k]] + gamma * vals[k + 1] - vals[k] + gamma * lam * a
    adv[idx[k]] = a
  return adv


class SegmentedGaeTest(parameterized.TestCase):

  @parameterized.named_parameters(*_IMPLS)
  def test_each_segment_is_its_own_chain(self, impl, block, tile):
    for seed in range(3):
      r, v, m, seg, lam, boot, spans = _packed_case(seed)
      fn = jax.jit(lambda *a: advantages.skip_observation_gae(
          a[0], a[1], a[2], gamma=_GAMMA, lam=a[3], bootstrap=a[4], segment_ids=a[5], impl=impl, block=block,
          tile=tile))
      adv, ret = (np.asarray(x) for x in fn(r, v, m, lam, boot, seg))
      want = np.zeros_like(adv, np.float64)
      for b, s, i0, i1 in spans:
        want[b, i0:i1] = _gae_alone(r[b, i0:i1], v[b, i0:i1], m[b, i0:i1], _GAMMA, lam[b, s], boot[b, s])
      np.testing.assert_allclose(adv, want, atol=2e-5, rtol=1e-5)
      np.testing.assert_allclose(ret, np.where(m, want + v, 0.0), atol=2e-5, rtol=1e-5)

  def test_one_segment_per_row_equals_rows(self):
    rng = np.random.default_rng(3)
    r, v = rng.normal(size=(2, 2, 16)).astype(np.float32)
    m = rng.random((2, 16)) < 0.6
    seg = np.ones((2, 16), np.int32)
    seg[0, 12:] = 0  # Padding after the first row's trajectory.
    m[0, 12:] = False
    lam, boot = np.array([0.3, 0.9], np.float32), np.array([1.5, -2.0], np.float32)
    rows = advantages.skip_observation_gae(r, v, m, gamma=_GAMMA, lam=lam, bootstrap=boot)
    packed = advantages.skip_observation_gae(r, v, m, gamma=_GAMMA, lam=lam[:, None], bootstrap=boot[:, None],
                                             segment_ids=seg)
    for x, y in zip(rows, packed):
      np.testing.assert_allclose(x, y, atol=1e-6)

  def test_shapes_are_checked(self):
    r = np.zeros((2, 8), np.float32)
    with self.assertRaisesRegex(ValueError, r'\[B, S\]'):
      advantages.skip_observation_gae(r, r, r > 0, gamma=1.0, lam=np.zeros(2), bootstrap=np.zeros((2, 3)),
                                      segment_ids=np.ones((2, 8), np.int32))


class SegmentedStatisticsTest(absltest.TestCase):

  def test_sequence_sum_and_back(self):
    seg = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    sums = losses.sequence_sum(x, seg, 3)
    np.testing.assert_array_equal(sums, [[1, 9, 0], [51, 0, 0]])
    np.testing.assert_array_equal(losses.sequence_to_tokens(sums, seg), [[1, 1, 9, 9, 9, 0], [51] * 6])

  def test_action_span_per_segment(self):
    _, _, m, seg, _, _, spans = _packed_case(3)
    want = np.zeros(m.shape, np.float32)
    for b, _, i0, i1 in spans:  # From a segment's first action token to its last; never across a boundary.
      acted = i0 + np.flatnonzero(m[b, i0:i1])
      if acted.size:
        want[b, acted[0]:acted[-1] + 1] = 1.0
    got = np.asarray(losses.action_span_mask(jnp.asarray(m, jnp.float32), jnp.asarray(seg)))
    np.testing.assert_array_equal(got, want)
    self.assertGreater(((got > 0) & ~m).sum(), 0)  # Observation gaps were filled.

  def test_adaptive_lambda_per_segment(self):
    _, _, m, seg, _, _, spans = _packed_case(1)
    lam = np.asarray(losses.adaptive_lambda(m, 1.5, seg, 4))
    for b, s, i0, i1 in spans:
      n = m[b, i0:i1].sum()
      want = np.clip(1 - 1 / (1.5 * n), 0, 1) if n else 0.0
      self.assertAlmostEqual(float(lam[b, s]), want, places=6)

  def test_sequence_aggregations_and_gspo_per_segment(self):
    r, v, m, seg, _, _, spans = _packed_case(2)
    for agg in losses.common.AGGREGATIONS:
      got = float(losses.aggregate(r, m, agg, 0, seg, 4))
      per_seq = [(r[b, i0:i1] * m[b, i0:i1]).sum() / (m[b, i0:i1].sum() if agg == 'seq_mean_token_mean' else 40)
                 for b, _, i0, i1 in spans if m[b, i0:i1].any()]
      want = (r * m).sum() / m.sum() if agg == 'token_mean' else np.mean(per_seq)
      self.assertAlmostEqual(got, float(want), places=5, msg=agg)
      count = float(losses.aggregate_count(m, agg, seg, 4))
      self.assertEqual(count, m.sum() if agg == 'token_mean' else len(per_seq))
    # GSPO: the ratio of a token is the geometric mean over its own segment's action tokens.
    logp, blp = r * 0.1, v * 0.1
    grads = jax.grad(lambda lp: losses.policy_loss(lp, blp, np.ones_like(r), m, clip_mode='gspo', eps_low=10.0,
                                                   eps_high=10.0, segment_ids=seg, num_segments=4)[0])(logp)
    total = m.sum()
    for b, _, i0, i1 in spans:
      mm = m[b, i0:i1]
      if mm.any():
        s = np.exp((logp[b, i0:i1] - blp[b, i0:i1])[mm].mean())
        np.testing.assert_allclose(np.asarray(grads)[b, i0:i1][mm], -s / total, rtol=1e-5)

  def test_group_advantages_by_id_equal_contiguous_groups(self):
    rng = np.random.default_rng(4)
    rew = rng.normal(size=(3, 4)).astype(np.float32)
    rew[2] = 0.7  # Equal rewards: exactly 0.
    order = rng.permutation(12)
    flat, ids = rew.reshape(-1)[order], np.repeat(np.arange(3), 4)[order]
    # Shuffled into a [4, 4] layout with 4 padding entries (ids that collide with real groups on purpose).
    r2 = np.concatenate([flat, np.full(4, 9.0, np.float32)]).reshape(4, 4)
    g2 = np.concatenate([ids, np.zeros(4, np.int32)]).reshape(4, 4)
    ok = np.concatenate([np.ones(12), np.zeros(4)]).reshape(4, 4)
    for baseline, norm, want in (('mean', True, advantages.group_advantages(rew)),
                                 ('mean', False, advantages.group_advantages(rew, std_normalize=False)),
                                 ('leave_one_out', True, advantages.leave_one_out_advantages(rew))):
      got = np.asarray(losses.group_advantages_by_id(r2, g2, ok, baseline=baseline, std_normalize=norm))
      np.testing.assert_allclose(got.reshape(-1)[:12], np.asarray(want).reshape(-1)[order], rtol=1e-5, atol=1e-6)
      np.testing.assert_array_equal(got.reshape(-1)[12:], 0.0)
      np.testing.assert_array_equal(got.reshape(-1)[:12][ids == 2], 0.0)


if __name__ == '__main__':
  absltest.main()
