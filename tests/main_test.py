"""The command line: configs parse, print with --dry_run, and bad overrides fail naming the field."""

import os
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from configs import base
from sao_jax import config_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  return subprocess.run([sys.executable, '-m', 'sao_jax.main', *args], cwd=_ROOT, env=env,
                        capture_output=True, text=True, timeout=120, check=False)


class MainTest(parameterized.TestCase):

  def test_dry_run_prints_resolved_config(self):
    out = _main('--config=configs/base.py', '--config.algo.clip_mode=ppo', '--dry_run')
    self.assertEqual(out.returncode, 0, out.stderr)
    self.assertIn('clip_mode: ppo', out.stdout)
    self.assertIn('critic_epochs: 2', out.stdout)

  def test_misspelled_override_names_the_field(self):
    out = _main('--config=configs/base.py', '--config.algo.clip_mod=ppo', '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('--config.algo.clip_mod', out.stderr)
    self.assertIn('clip_mode', out.stderr)

  def test_invalid_value_names_the_field(self):
    out = _main('--config=configs/base.py', '--config.algo.eps_low=1.5', '--dry_run')
    self.assertNotEqual(out.returncode, 0)
    self.assertIn('config.algo.eps_low=1.5', out.stderr)


class ValidateTest(parameterized.TestCase):

  def test_base_config_is_valid(self):
    config_lib.validate(base.get_config())

  @parameterized.parameters(
      ('algo.clip_mode', 'ppo2', 'algo.clip_mode'),
      ('algo.agg', 'mean', 'algo.agg'),
      ('algo.critic_epochs', 0, 'algo.critic_epochs'),
      ('sampler.temperature', 0.7, 'sampler.temperature'),  # double_side needs temperature-1 log-probs.
      ('mesh.tensor', 0, 'mesh.tensor'),
      ('trainer.minibatch_size', 5, 'trainer.minibatch_size'),
      ('optim.schedule', 'linear', 'optim.schedule'),
  )
  def test_bad_value_is_named(self, path, value, named):
    config = base.get_config()
    section, field = path.split('.')
    config[section][field] = value
    with self.assertRaisesRegex(config_lib.ConfigError, f'config.{named}'):
      config_lib.validate(config)

  def test_group_algorithms_need_groups(self):
    config = base.get_config()
    config.algo.name = 'grpo'
    with self.assertRaisesRegex(config_lib.ConfigError, 'config.algo.group_size'):
      config_lib.validate(config)
    config.algo.group_size = 4
    config_lib.validate(config)


if __name__ == '__main__':
  absltest.main()
