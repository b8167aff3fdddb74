"""The latency task: tool-call count and latency distributions, turns, reward; no real sleeping (fake sleep)."""

import math

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import latency


def _task(max_turns=6, **kwargs):
  task = envs.get_task(ml_collections.ConfigDict(
      {'name': 'latency', 'max_turns': max_turns, 'eval_size': 4, 'kwargs': kwargs}))
  slept = []
  task.sleep = slept.append  # No real time passes: the env calls this with each latency.
  return task, slept


class PlanTest(parameterized.TestCase):

  def test_latency_is_a_clipped_lognormal(self):
    opts = latency.LatencyOptions(latency_median_s=0.08, latency_sigma=0.8, latency_min_s=0.02,
                                  latency_max_s=0.5, mean_tool_calls=4.0)
    rng = np.random.default_rng(0)
    x = np.array([v for _ in range(4000) for v in latency.plan_episode(rng, opts, max_turns=1000)])
    self.assertGreater(len(x), 10_000)
    self.assertGreaterEqual(x.min(), 0.02)
    self.assertLessEqual(x.max(), 0.5)
    self.assertAlmostEqual(float(np.median(x)), 0.08, delta=0.004)
    # The clip masses: P[X < 0.02] = Phi((ln 0.02 - ln 0.08) / 0.8), P[X > 0.5] = 1 - Phi((ln 0.5 - ln 0.08) / 0.8).
    phi = lambda z: 0.5 * (1 + math.erf(z / math.sqrt(2)))
    self.assertAlmostEqual(float(np.mean(x == 0.02)), phi(math.log(0.25) / 0.8), delta=0.01)
    self.assertAlmostEqual(float(np.mean(x == 0.5)), 1 - phi(math.log(6.25) / 0.8), delta=0.01)

  @parameterized.parameters((0.0, 5), (1.0, 1000), (2.0, 1000), (2.0, 3))
  def test_tool_calls_are_geometric_and_capped(self, mean, max_turns):
    opts = latency.LatencyOptions(mean_tool_calls=mean)
    rng = np.random.default_rng(1)
    n = np.array([len(latency.plan_episode(rng, opts, max_turns=max_turns)) for _ in range(20_000)])
    self.assertLessEqual(n.max(), max_turns - 1)
    q = mean / (1 + mean)
    for k in range(min(max_turns - 1, 4)):  # P[n = k] = (1 - q) q^k below the cap.
      self.assertAlmostEqual(float(np.mean(n == k)), (1 - q) * q ** k, delta=0.01)
    if max_turns == 1000:
      self.assertAlmostEqual(float(n.mean()), mean, delta=0.05)
    else:  # The cap holds the whole tail: P[n = max_turns - 1] = q^(max_turns - 1).
      self.assertAlmostEqual(float(np.mean(n == max_turns - 1)), q ** (max_turns - 1), delta=0.01)

  def test_bad_options_name_the_field(self):
    for kwargs, field in (({'latency_min_s': 0.6}, 'latency_min_s'), ({'latency_sigma': -1.0}, 'latency_sigma'),
                          ({'stop_chars': '3'}, 'stop_chars'), ({'stop_chars': ''}, 'stop_chars'),
                          ({'format_reward': 1.0}, 'format_reward'), ({'mean_tool_calls': -1.0}, 'mean_tool_calls')):
      with self.assertRaisesRegex(ConfigError, field):
        _task(**kwargs)


class EnvTest(absltest.TestCase):

  def test_episode_sleeps_each_planned_latency_then_scores(self):
    task, slept = _task(mean_tool_calls=3.0, obs_chars=5)
    example = task.eval_set()[0]
    for _ in range(20):
      env = task.make_env(example)
      env.reset()
      plan = list(env.plan)
      slept.clear()
      for k, latency_s in enumerate(plan):
        obs, reward, done, info = env.step('x;')
        self.assertFalse(done)
        self.assertEqual(reward, 0.0)
        self.assertRegex(obs, r'^<result>\d{5}</result>$')
        self.assertEqual(slept, plan[:k + 1])
        self.assertEqual(info['tool_latencies_s'], plan[:k + 1])
      obs, reward, done, info = env.step(f'is {example.answer}')
      self.assertTrue(done)
      self.assertIsNone(obs)
      self.assertEqual(reward, 1.0)
      self.assertEqual(env.turn, len(plan) + 1)
      self.assertEqual(slept, plan)  # The answer turn does not wait.
      self.assertEqual(info['planned_tool_calls'], len(plan))

  def test_reward(self):
    opts = latency.LatencyOptions(format_reward=0.25)
    self.assertEqual(latency.score('a7b', '7', opts), 1.0)
    self.assertEqual(latency.score('a8b', '7', opts), 0.25)
    self.assertEqual(latency.score('ab;', '7', opts), 0.0)

  def test_plans_are_reproducible_and_differ_between_envs(self):
    plans = []
    for _ in range(2):
      task, _ = _task(mean_tool_calls=3.0)
      ex = task.eval_set()[0]
      plans.append([(e.reset(), e.plan)[1] for e in (task.make_env(ex) for _ in range(10))])
    self.assertEqual(plans[0], plans[1])
    self.assertGreater(len({tuple(p) for p in plans[0]}), 5)

  def test_stop_texts_and_inline_observations(self):
    task, _ = _task(stop_chars='ab;')
    env = task.make_env(task.eval_set()[0])
    self.assertEqual(env.stop_texts, ('a', 'b', ';'))
    self.assertEqual(env.observation_mode, 'inline')
    self.assertLen({ex.uid for ex in task.eval_set()}, 4)


if __name__ == '__main__':
  absltest.main()
