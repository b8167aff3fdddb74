"""Tests of sao_jax.sim.plan: a compiler plan's figures -> SimConfig, malformed plans, `run --plan`."""

import copy
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

import sao_jax
from sao_jax.errors import ConfigError
from sao_jax.sim import plan as plan_lib
from sao_jax.sim import pod
from sao_jax.sim.dists import Dist

# A plan as `python -m sao_jax.tools.aot --json=...` writes it (the fields the mapping reads, plausible values):
# 64 chips, actors on each 4-chip host's chips (16 processes), 2 threads of 16 slots each.
_PLAN = {
    'topology': 'v5e-64 (v5e:8x8)', 'num_devices': 64, 'model': 'qwen3-8b', 'chip': {'key': 'v5e'},
    'programs': [
        {'name': 'update (sao)', 'total_bytes_per_chip': 1, 'hbm_bytes_per_chip': 2, 'fits': True, 'roofline_s': 40.96},
        {'name': 'update (grpo)', 'total_bytes_per_chip': 1, 'hbm_bytes_per_chip': 2, 'fits': True,
         'roofline_s': 20.48},
        {'name': 'publish', 'total_bytes_per_chip': 3, 'hbm_bytes_per_chip': 2, 'fits': False, 'roofline_s': 0.5},
    ],
    'run': {
        'learner_devices': 64, 'actor_devices_per_process': 4, 'actors_share_learner': True,
        'batch': '128 x 5120 tokens', 'learner_step_s': 40.96, 'decode_step_s': 0.04, 'decode_rows': 16,
        'rollout_tokens_per_s_per_actor_chip': 2 * 16 / 0.04 / 4, 'publish_s': 0.5,
    },
}


def _without(path):
  """_PLAN with the field at `path` (a tuple of keys) removed."""
  p = copy.deepcopy(_PLAN)
  d = p
  for k in path[:-1]:
    d = d[k]
  del d[path[-1]]
  return p


class ConfigFromPlanTest(parameterized.TestCase):

  def test_mapping(self):
    cfg = plan_lib.config_from_plan(_PLAN)
    self.assertAlmostEqual(cfg.tokens_per_s, 25.0)  # 1 / 0.04 s per step, one token per slot per step.
    self.assertEqual(cfg.num_slots, 16 * 2 * 16)  # Rows x threads x (64 / 4 processes).
    self.assertEqual(cfg.batch_size, 128)
    self.assertEqual(cfg.step_time_s, Dist('constant', 0.0))
    self.assertAlmostEqual(cfg.step_time_per_token_s, 40.96 / (128 * 5120))  # 62.5 us.
    self.assertEqual(cfg.publish_delay_s, 0.5)
    # The imo workload: one turn, no tools, generation cut at max_new_tokens 4096 after a 300-token prompt.
    self.assertEqual(cfg.turns, Dist('constant', 1.0))
    self.assertEqual((cfg.prompt_tokens, cfg.max_episode_tokens), (300.0, 4396.0))
    self.assertEqual(cfg.tool_latency_s.mean, 0.0)
    self.assertEqual((cfg.group_size, cfg.mode, cfg.duration_s, cfg.warmup_s), (1, 'async', 86400.0, 7200.0))

  def test_separate_actor_chips(self):
    p = copy.deepcopy(_PLAN)
    p['run'].update(learner_devices=48, actors_share_learner=False)  # 16 actor chips: 4 processes of 4.
    self.assertEqual(plan_lib.config_from_plan(p).num_slots, 16 * 2 * 4)

  def test_agentic_update_and_overrides(self):
    cfg = plan_lib.config_from_plan(_PLAN, 'agentic', update='grpo', group_size=8, max_staleness=8)
    self.assertEqual((cfg.turns, cfg.obs_tokens, cfg.max_episode_tokens), (pod.POD.turns, pod.POD.obs_tokens,
                                                                            pod.POD.max_episode_tokens))
    self.assertAlmostEqual(cfg.tokens_per_s, 25.0)
    self.assertAlmostEqual(cfg.step_time_per_token_s, 20.48 / (128 * 5120))  # The 'update (grpo)' program's.
    self.assertEqual((cfg.group_size, cfg.max_staleness), (8, 8))
    self.assertEqual(plan_lib.unfit_programs(_PLAN), ['publish'])

  @parameterized.parameters(
      (('num_devices',), 'plan.num_devices'),
      (('run',), 'plan.run'),
      (('run', 'decode_step_s'), 'plan.run.decode_step_s'),
      (('run', 'decode_rows'), 'plan.run.decode_rows'),
      (('run', 'learner_step_s'), 'plan.run.learner_step_s'),
      (('run', 'batch'), 'plan.run.batch'),
      (('run', 'publish_s'), 'plan.run.publish_s'),
      (('run', 'actor_devices_per_process'), 'plan.run.actor_devices_per_process'),
      (('run', 'actors_share_learner'), 'plan.run.actors_share_learner'),
      (('run', 'rollout_tokens_per_s_per_actor_chip'), 'plan.run.rollout_tokens_per_s_per_actor_chip'),
  )
  def test_missing_field_named(self, path, name):
    with self.assertRaisesRegex(ConfigError, f'^{name}.*missing'):
      plan_lib.config_from_plan(_without(path))

  @parameterized.parameters(
      ('learner_step_s', math.nan), ('decode_step_s', 0.0), ('batch', '128 tokens'), ('publish_s', -1.0),
      ('actor_devices_per_process', 3), ('rollout_tokens_per_s_per_actor_chip', 150.0))
  def test_bad_field_named(self, name, value):
    p = copy.deepcopy(_PLAN)
    p['run'][name] = value
    with self.assertRaisesRegex(ConfigError, f'^plan.run.{name}'):
      plan_lib.config_from_plan(p)

  def test_bad_update_and_workload(self):
    with self.assertRaisesRegex(ConfigError, r"update \(ppo\)"):
      plan_lib.config_from_plan(_PLAN, update='ppo')
    with self.assertRaisesRegex(ConfigError, 'workload'):
      plan_lib.config_from_plan(_PLAN, 'chat')


class RunTest(absltest.TestCase):

  def test_cli_plan(self):
    tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, tmp)
    plan_path, out = os.path.join(tmp, 'plan.json'), os.path.join(tmp, 'out.json')
    with open(plan_path, 'w') as f:
      json.dump(_PLAN, f)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(sao_jax.__file__))))
    proc = subprocess.run(
        [sys.executable, '-m', 'sao_jax.sim.run', f'--plan={plan_path}', '--set=group_size=8',
         '--set=max_staleness=8', '--set=duration_s=3600', '--set=warmup_s=600', f'--json={out}'],
        env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr)
    self.assertIn('512 slots at 25 tokens/s', proc.stdout)
    self.assertIn("do not fit their chips: ['publish']", proc.stdout)
    with open(out) as f:
      result = json.load(f)
    self.assertEqual((result['config']['num_slots'], result['config']['group_size']), (512, 8))
    self.assertGreater(result['counts']['trained_total'], 0)


if __name__ == '__main__':
  absltest.main()
