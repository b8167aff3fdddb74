"""swe episodes through the real episode runner: tool results are observation tokens, and the skip-observation
GAE of a recorded, packed batch jumps over them (its chains run over the model's tool calls only)."""


from absl.testing import absltest
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import sandbox as sandbox_lib
from sao_jax.envs import swe
from sao_jax.generate.sampling import SamplingParams
from sao_jax.losses import advantages
from sao_jax.tokenizers import CharTokenizer
from tests.rollout import helpers

_ROWS = 3


def _gae_over_actions(r, v, gamma, lam):
  """Plain GAE on the action tokens alone (a compressed sequence, terminal)."""
  adv, next_v, next_a = np.zeros(len(r)), 0.0, 0.0
  for k in range(len(r) - 1, -1, -1):
    next_a = r[k] + gamma * next_v - v[k] + gamma * lam * next_a
    adv[k], next_v = next_a, v[k]
  return adv


class SweEpisodesTest(absltest.TestCase):

  def test_tool_results_are_observations_in_a_recorded_batch(self):
    if sandbox_lib.bwrap_problem() is not None:
      self.skipTest('swe needs bubblewrap')
    tok = CharTokenizer()
    task = envs.get_task({'name': 'swe', 'max_turns': 8, 'eval_size': 0,
                          'kwargs': {'instructions': 'brief', 'verdict_timeout_s': 30.0}})
    examples = task.train_examples()[:_ROWS]
    actions = [swe.oracle_actions(ex) for ex in examples]
    index = helpers.prompt_index(tok, examples)
    turns = [0] * _ROWS

    def generate(context, budget, stop_ids):
      del budget, stop_ids
      i, _ = helpers.problem_of(context, index)
      ids = tok.encode(actions[i][turns[i]]) + [tok.eos_id]
      turns[i] += 1
      return ids, [-0.5] * len(ids)

    backend = rollout.ContextBackend(generate, tok.stop_ids, version=7)
    trajs = rollout.run_episodes(backend, tok, [task.make_env(ex) for ex in examples],
                                 limits=rollout.EpisodeLimits(8, 4096, 8192), decoding=SamplingParams(),
                                 seeds=[0] * _ROWS)
    for traj, acts in zip(trajs, actions):
      self.assertEqual((traj.reward, traj.truncated, traj.turn_versions), (1.0, False, (7,) * len(acts)))
      self.assertEqual(tok.decode(traj.tokens[traj.action_mask]), ''.join(acts))  # The model's calls only ...
      self.assertTrue(traj.action_mask[-1])  # ... the row ends on the submit call's last token ...
      rest = tok.decode(np.where(traj.action_mask, tok.pad_id, traj.tokens))
      for text in ('edited ', 'passed, 0 failed'):
        self.assertIn(text, rest)  # ... and every tool result is an observation, in its own 'tool' message.
      self.assertEqual(int(np.sum(traj.tokens[~traj.action_mask] == tok.token_to_id('<|tool|>'))), len(acts) - 1)
      self.assertContainsSubset({'tests_passed', 'submitted'}, set(traj.info))

    packed = rollout.pack(trajs, seq_buckets=(4096, 8192), pad_id=tok.pad_id, rows=_ROWS)
    batch = packed.batch
    self.assertEqual(packed.kept, list(range(_ROWS)))
    values = np.random.default_rng(0).normal(size=batch.tokens.shape).astype(np.float32)
    adv, ret = advantages.skip_observation_gae(batch.rewards, values, batch.action_mask, gamma=1.0, lam=0.9)
    adv, ret = np.asarray(adv), np.asarray(ret)
    mask = np.asarray(batch.action_mask, bool)
    self.assertTrue(np.all(adv[~mask] == 0) and np.all(ret[~mask] == 0))
    for b in range(_ROWS):
      idx = np.flatnonzero(mask[b])
      self.assertGreater(np.diff(idx).max(), 50)  # The chain jumps over long tool results ...
      np.testing.assert_allclose(adv[b, idx], _gae_over_actions(batch.rewards[b, idx], values[b, idx], 1.0, 0.9),
                                 rtol=1e-4, atol=1e-4)  # ... exactly as GAE on the calls alone.
      self.assertEqual(batch.rewards[b, idx[-1]], 1.0)


if __name__ == '__main__':
  absltest.main()
