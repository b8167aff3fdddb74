"""Truncated rows: 'bootstrap' ends the GAE chain in V(state after the row's last real token), 'drop' removes
the row.

The bootstrap is checked against the critic's own forward on the unpadded row (`ValueModel.__call__`), not
against the step's helpers; 'drop' against the same step on the batch with the row deleted.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from sao_jax.learner import Learner, LearnerConfig
from sao_jax.learner import steps
from sao_jax.models import value as value_lib
from sao_jax.structs import Batch
from tests.learner import helpers as H

T = 16
PAD = H.MODEL.pad_id
# Row 0: prompt 3, action 4, observation 2, action 3, then the final observation (3 tokens) kept as
# non-action tokens after a turn-limit cut; then padding.
SEGMENTS = (('p', 3), ('a', 4), ('o', 2), ('a', 3), ('o', 3))
ROW0_LEN = sum(n for _, n in SEGMENTS)
ROW0_LAST_ACTION = 11


def _row(segments, rng):
  tokens = np.full(T, PAD, np.int32)
  action = np.zeros(T, np.float32)
  t = 0
  for kind, n in segments:
    tokens[t:t + n] = rng.integers(3, H.VOCAB, n)
    action[t:t + n] = kind == 'a'
    t += n
  return tokens, action


def _batch(rows_segments, truncated, rewards, row_mask, seed=0) -> Batch:
  rng = np.random.default_rng(seed)
  tokens, action = zip(*[_row(segs, rng) for segs in rows_segments])
  tokens, action = np.stack(tokens), np.stack(action)
  r = np.zeros_like(action)
  for b in range(len(tokens)):
    r[b, np.flatnonzero(action[b])[-1]] = rewards[b]
  blp = ((-np.log(H.VOCAB) + 0.1 * rng.standard_normal(action.shape)) * action).astype(np.float32)
  lengths = [sum(n for _, n in segs) for segs in rows_segments]
  return Batch.from_rows(tokens=tokens, action_mask=action, behavior_logprobs=blp, rewards=r, lengths=lengths,
                         truncated=truncated, row_mask=row_mask)


@functools.cache
def _models():
  policy = H.policy_fn()()
  critic = value_lib.ValueModel.from_policy(policy)
  critic.head.kernel[...] = jnp.linspace(-1.0, 1.0, H.MODEL.embed_dim)  # A non-zero head: V varies by state.
  critic.head.bias[...] = 0.3
  return policy, critic


def _learner(truncation: str, batch_size: int, **overrides) -> Learner:
  policy, critic = _models()
  config = H.config('sao', **{'algo.truncation': truncation, 'algo.gamma': 1.0, 'algo.lam_critic': 1.0,
                              'trainer.batch_size': batch_size, 'trainer.minibatch_size': 0,
                              'optim.optimizer': 'sgd', 'optim.grad_clip': 0.0, **overrides})
  return Learner(LearnerConfig.from_config(config), policy=policy, critic=critic, mesh=H.mesh(1, 1),
                 model_config=H.MODEL)


class BootstrapTest(absltest.TestCase):

  def test_truncated_row_bootstraps_from_the_state_after_its_final_observation(self):
    _, critic = _models()
    batch = _batch([SEGMENTS, (('p', 3), ('a', 4))], truncated=[True, False], rewards=[0.0, 1.0],
                   row_mask=[1.0, 0.0])
    row = batch.tokens[0, :ROW0_LEN]
    # V(tokens[:L]) from the critic's own forward on the unpadded row: values[t] = V(tokens[:t]).
    extended = jnp.asarray(np.concatenate([row, [7]])[None])
    v_end = float(critic(extended)[0, ROW0_LEN])
    v_after_last_action = float(critic(extended)[0, ROW0_LAST_ACTION + 1])
    v_after_padding = float(critic(jnp.asarray(np.concatenate([batch.tokens[0], [7]])[None]))[0, T])
    self.assertGreater(abs(v_end - v_after_last_action), 1e-2)  # The test can tell the two states apart.
    self.assertGreater(abs(v_end - v_after_padding), 1e-2)

    # The step's targets before its critic update: gamma = lambda_critic = 1 and reward 0 on row 0, the only
    # row with action tokens, so every return of the batch equals the bootstrap.
    learner = _learner('bootstrap', 2, **{'algo.critic_warmup_steps': 10})
    metrics = learner.update(batch)
    self.assertAlmostEqual(metrics['critic/return_mean'], v_end, delta=1e-5)


class DropTest(absltest.TestCase):

  def test_dropped_row_contributes_nothing(self):
    rows = [SEGMENTS, (('p', 2), ('a', 6)), (('p', 4), ('a', 2), ('o', 3), ('a', 5)), (('p', 3), ('a', 9))]
    batch = _batch(rows, truncated=[True, False, False, False], rewards=[0.0, 1.0, 0.0, 1.0],
                   row_mask=[1.0, 1.0, 1.0, 1.0])
    without = jax.tree.map(lambda x: x[1:], batch)  # The same batch with the truncated row deleted.
    learner = _learner('drop', 4, **{'algo.critic_warmup_steps': 0})
    init = H.host(learner.state)
    m_with = learner.update(batch)
    after_with = {k: H.leaves_with_paths(getattr(learner.state, k).params) for k in ('policy', 'critic')}
    learner.state = jax.device_put(init, learner.state_shardings)
    m_without = learner.update(without)
    after_without = {k: H.leaves_with_paths(getattr(learner.state, k).params) for k in ('policy', 'critic')}
    for name in ('policy', 'critic'):
      before = H.leaves_with_paths(getattr(init, name).params)
      moved = max(np.abs(after_with[name][k] - before[k]).max() for k in before)
      self.assertGreater(moved, 1e-4, f'{name} did not move: the comparison would be vacuous')
      for k in before:
        np.testing.assert_allclose(after_with[name][k], after_without[name][k], atol=1e-6, rtol=1e-5,
                                   err_msg=f'{name} {k}')
    self.assertEqual(m_with['batch/action_tokens'], m_without['batch/action_tokens'])
    for key in ('policy/loss', 'critic/loss', 'critic/return_mean', 'adv/mean', 'policy/entropy'):
      self.assertAlmostEqual(m_with[key], m_without[key], delta=1e-5 * max(1.0, abs(m_without[key])), msg=key)


if __name__ == '__main__':
  absltest.main()
