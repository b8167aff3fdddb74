"""Sequence packing (`trainer.pack`): one learner step on packed rows == the same step on one trajectory per row.

The same eight trajectories go through `rollout.pack` unpacked (8 rows of 24 tokens), packed first-fit decreasing
into rows of 24 (4 rows of up to 4 segments) and packed into fixed rows of 48; one SAO step (policy and critic,
K=2 critic epochs) and one GRPO step with plain SGD (a parameter's change is its gradient, so a wrong term shows
directly) must give the same parameters. The trajectories cover what packing could get wrong: multi-turn rows
(observations inside a segment), truncated rows bootstrapped from the critic (mid-turn and after a final
observation), a trajectory exactly as long as a row, rows of very different lengths.

What breaks it (each tried, tests red of 5): attention across a segment boundary (4), the critic's GAE across a
boundary (2), a truncated segment bootstrapped from its row's end instead of its own (1), GRPO group statistics
over consecutive rows instead of group ids (2). Positions that do not restart per segment change nothing here:
RoPE scores depend on relative positions only (`llama.segment_positions` is pinned in tests/models).
"""

import functools

import numpy as np
from absl.testing import absltest, parameterized

from sao_jax import rollout
from sao_jax import structs
from sao_jax.learner import Learner, LearnerConfig
from tests.learner import helpers as H

T = 24
SGD = {'optim.optimizer': 'sgd', 'optim.grad_clip': 0.0, 'optim.actor_lr': 0.5, 'optim.critic_lr': 0.5,
       'algo.critic_warmup_steps': 0}
REL_TOL = 1e-4  # Of the largest parameter change.

# (prompt, then alternating action / observation lengths, truncated, reward). Lengths: 12 8 24 7 4 8 8 14.
_SHAPES = (
    ((3, 4, 2, 3), False, 1.0),  # Multi-turn: action, observation, action.
    ((2, 6), True, 0.0),  # Cut mid-turn (bootstrappable).
    ((4, 20), False, 1.0),  # Exactly fills a row of T tokens.
    ((2, 3, 2), True, 0.0),  # Cut after its final observation (kept: bootstrappable).
    ((2, 2), False, 0.0),
    ((3, 5), False, 1.0),
    ((2, 3, 1, 2), False, 0.0),
    ((5, 9), False, 1.0),
)


def _trajectories(truncation: bool) -> list[structs.Trajectory]:
  rng = np.random.default_rng(0)
  out = []
  for i, (spans, truncated, reward) in enumerate(_SHAPES):
    mask = np.concatenate([np.full(n, k % 2 == 1) for k, n in enumerate(spans)])
    n = mask.size
    logp = np.where(mask, -np.log(H.VOCAB) + 0.3 * rng.standard_normal(n), 0.0)
    truncated = truncated and truncation
    out.append(structs.Trajectory(tokens=rng.integers(3, H.VOCAB, n), action_mask=mask, behavior_logprobs=logp,
                                  reward=0.0 if truncated else reward, truncated=truncated, group_id=i // 2))
  return out


@functools.cache
def _policy():
  return H.policy_fn()()


@functools.cache
def _step(algo: str, layout: str):
  """Parameters (policy, critic) before and after one step on `layout`'s batch, and the batch."""
  trajs = _trajectories(truncation=algo == 'sao')
  group = 1 if algo == 'sao' else 2
  kw = dict(pad_id=0, group_size=group, truncation='bootstrap')
  if layout == 'rows':
    packed = rollout.pack(trajs, seq_buckets=(T,), rows=len(trajs), **kw)
  elif layout == 'ffd':
    packed = rollout.pack(trajs, seq_buckets=(8, T), packing='ffd', segments=4, **kw)
  else:
    packed = rollout.pack(trajs, seq_buckets=(T,), packing='fixed', pack_len=2 * T, segments=6, **kw)
  learner = Learner(LearnerConfig.from_config(H.config(algo, **SGD)), policy=_policy(), mesh=H.mesh(1, 1),
                    model_config=H.MODEL)
  params = lambda: {name: H.leaves_with_paths(getattr(learner.state, name).params)
                    for name in ('policy', 'critic') if getattr(learner.state, name) is not None}
  before = params()
  metrics = learner.update(packed.batch)
  return before, params(), packed, metrics


class PackedEqualsUnpackedTest(parameterized.TestCase):

  def test_the_layouts_are_what_they_claim(self):
    rows, ffd, fixed = (_step('sao', layout)[2] for layout in ('rows', 'ffd', 'fixed'))
    self.assertEqual((rows.batch.shape, rows.batch.num_segments), ((8, T), 1))
    self.assertEqual((ffd.batch.shape, ffd.batch.num_segments), ((4, T), 4))
    self.assertEqual((fixed.batch.shape, fixed.batch.num_segments), ((2, 2 * T), 6))
    full = np.asarray(ffd.batch.segment_ids)
    self.assertTrue((full == 1).all(axis=1).any(), 'no row is one trajectory exactly filling it')
    self.assertGreater(int((full.max(axis=1) > 1).sum()), 1, 'too few rows hold several trajectories')
    self.assertEqual(int(np.asarray(ffd.batch.truncated).sum()), 2)
    for packed in (rows, ffd, fixed):
      self.assertEqual(sorted(packed.kept), list(range(8)))
      self.assertEqual(int(np.asarray(packed.batch.segment_mask).sum()), 8)
    self.assertLess(rollout.padding_fraction(ffd.batch), rollout.padding_fraction(rows.batch))

  @parameterized.product(algo=('sao', 'grpo'), layout=('ffd', 'fixed'))
  def test_packed_step_equals_the_unpacked_step(self, algo, layout):
    before, want, _, m_rows = _step(algo, 'rows')
    _, got, _, m_packed = _step(algo, layout)
    for name in want:
      moved = max(np.abs(want[name][k] - before[name][k]).max() for k in want[name])
      self.assertGreater(moved, 1e-3, f'{name} did not move: the comparison would be vacuous')
      for k in want[name]:
        np.testing.assert_allclose(got[name][k], want[name][k], rtol=0, atol=REL_TOL * moved, err_msg=f'{name} {k}')
    for key in ('policy/loss', 'critic/loss', 'batch/action_tokens'):
      if key in m_rows:
        np.testing.assert_allclose(m_packed[key], m_rows[key], rtol=1e-5, atol=1e-6, err_msg=key)


if __name__ == '__main__':
  absltest.main()
