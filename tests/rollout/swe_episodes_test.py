"""swe episodes through the real episode runner: tool results are observation tokens, and the skip-observation
GAE of a recorded, packed batch jumps over them (its chains run over the model's tool calls only).

The oracle's replayed turns (static runner, terminal episodes), and a random tiny model through the trainer's
actor path (`benchmarks.swe.record`: the slot engine and the continuous runner, the trainer's packer, the SAO
step's chain, adaptive lambda and bootstrap, episodes cut at the turn limit with their last tool result kept).
"""


from absl.testing import absltest
import jax
import numpy as np

from configs import swe as swe_config
from sao_jax import config_lib
from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import sandbox as sandbox_lib
from sao_jax.benchmarks import swe as swe_bench
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

  def test_a_turn_out_of_budget_ends_the_episode_or_goes_to_the_env(self):
    """`budget_ends_turn`: a turn that ran out of its token budget (no stop token) gets an error observation and
    the episode goes on (here to the oracle's fix: reward 1); without it the episode is cut mid-turn."""
    if sandbox_lib.bwrap_problem() is not None:
      self.skipTest('swe needs bubblewrap')
    tok = CharTokenizer()
    for goes_on in (True, False):
      task = envs.get_task({'name': 'swe', 'max_turns': 8, 'eval_size': 0,
                            'kwargs': {'instructions': 'brief', 'budget_ends_turn': goes_on}})
      ex = task.train_examples()[0]
      turns = ['<tool_call>{"name": "view", "arguments": {"path": '] + swe.oracle_actions(ex)
      done = []

      def generate(context, budget, stop_ids, turns=turns, done=done):
        del context, budget, stop_ids
        text = turns[len(done)]
        done.append(text)
        ids = tok.encode(text) + ([] if len(done) == 1 else [tok.eos_id])  # The first turn runs out of budget.
        return ids, [-0.5] * len(ids)

      backend = rollout.ContextBackend(generate, tok.stop_ids)
      traj, = rollout.run_episodes(backend, tok, [task.make_env(ex)], limits=rollout.EpisodeLimits(8, 4096, 8192),
                                   decoding=SamplingParams(), seeds=[0])
      if not goes_on:
        self.assertEqual((traj.truncated, traj.info['cut_by'], len(traj.turn_versions)), (True, 'max_new_tokens', 1))
        continue
      self.assertEqual((traj.reward, traj.truncated, len(traj.turn_versions)), (1.0, False, len(turns)))
      first_end = int(np.flatnonzero(np.diff(traj.action_mask.astype(int)) == -1)[0]) + 1
      self.assertEqual(traj.tokens[first_end], tok.eos_id)  # The turn's closing token: an observation token ...
      rest = tok.decode(np.where(traj.action_mask, tok.pad_id, traj.tokens))
      self.assertIn('has no closing </tool_call>', rest)  # ... before the error that the unclosed call got.

  def test_tiny_model_episodes_through_the_actor_path(self):
    """Catches, beyond the oracle test: tool results taken as actions by the continuous runner (the trainer's
    default engine), the last tool result of an episode cut at the turn limit dropped or taken as an action, a TD
    chain through the observations (`gae_over='span'`) or a bootstrap from the wrong token in the SAO step."""
    if sandbox_lib.bwrap_problem() is not None:
      self.skipTest('swe needs bubblewrap')
    config = swe_config.get_config('runlocal')
    config_lib.override(config, {
        'task.max_turns': 2, 'task.kwargs.instructions': 'none', 'task.kwargs.score_at_turn_limit': False,
        'task.kwargs.budget_ends_turn': True,  # The random model's turns (no stop token) reach the env.
        'sampler.batch_size': 2, 'sampler.max_new_tokens': 12, 'sampler.max_seq_len': 1024,
        'trainer.batch_size': 2, 'trainer.seq_buckets': (1024,), 'algo.critic_warmup_steps': 0})
    self.assertTrue(config.sampler.continuous)
    figures = swe_bench.record(config, devices=jax.devices()[:1])
    self.assertEqual((figures['episodes'], figures['turns'], figures['truncated']), (2, 4, 2))
    # Random text calls no tool: each turn gets an error observation (the second kept by the turn-limit cut).
    self.assertEqual(figures['tool_results'], 4)
    self.assertGreater(figures['observation_tokens'], 4 * 50)
    self.assertLess(figures['gae_max_diff'], 1e-4)
    self.assertEqual(figures['observation_values_diff'], 0.0)
    self.assertGreater(figures['span_ablation_max_diff'], 1e-2)  # The check sees a chain through observations.


if __name__ == '__main__':
  absltest.main()
