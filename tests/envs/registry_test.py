"""Task registry and task configs: names, kwargs and files fail at start naming the config field."""

import importlib
import subprocess
import sys

from absl.testing import absltest
from absl.testing import parameterized

from sao_jax import config_lib
from sao_jax import envs
from sao_jax import rollout
from sao_jax.errors import ConfigError
from sao_jax.envs import base
from sao_jax.envs import sandbox
from sao_jax.tokenizers import CharTokenizer

_TASK_CONFIGS = ('arith', 'calculator', 'code', 'math', 'drift', 'imo')


class RegistryTest(parameterized.TestCase):

  def test_unknown_task_names_the_field(self):
    with self.assertRaisesRegex(ConfigError, r"config\.task\.name='chess' is not a registered task.*arith"):
      envs.get_task({'name': 'chess', 'max_turns': 1, 'eval_size': 1, 'kwargs': {}})

  def test_limits(self):
    with self.assertRaisesRegex(ConfigError, r'config\.task\.max_turns=0'):
      envs.get_task({'name': 'arith', 'max_turns': 0, 'eval_size': 1, 'kwargs': {}})
    with self.assertRaisesRegex(ConfigError, r'config\.task\.eval_size=-1'):
      envs.get_task({'name': 'arith', 'max_turns': 1, 'eval_size': -1, 'kwargs': {}})

  def test_names(self):
    self.assertContainsSubset({'arith', 'calculator', 'code', 'math', 'drift'}, envs.task_names())

  def test_custom_task_registration(self):
    import dataclasses  # pylint: disable=g-import-not-at-top

    @dataclasses.dataclass(frozen=True)
    class Opts:
      x: int = 1

    class Fixed(envs.Task):

      def __init__(self, opts, **kw):
        super().__init__(**kw)
        self.opts = opts

      def train_iterator(self, seed):
        return base.ShuffledIterator(self.eval_set(), seed)

      def eval_set(self):
        return [envs.Example(str(i), 'p', str(self.opts.x)) for i in range(self.eval_size)]

      def make_env(self, example):
        raise NotImplementedError

    @envs.register_task('unit_test_task', Opts)
    def _make(opts, *, max_turns, eval_size):
      return Fixed(opts, max_turns=max_turns, eval_size=eval_size)

    task = envs.get_task({'name': 'unit_test_task', 'max_turns': 2, 'eval_size': 3, 'kwargs': {'x': 3}})
    self.assertEqual((task.name, task.max_turns, task.opts), ('unit_test_task', 2, Opts(3)))
    self.assertEqual([e.answer for e in task.eval_set()], ['3'] * 3)
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.x=.*wrong type'):
      envs.get_task({'name': 'unit_test_task', 'kwargs': {'x': 'three'}})


class TaskConfigTest(parameterized.TestCase):

  @parameterized.parameters(*_TASK_CONFIGS)
  def test_config_validates_and_builds(self, name):
    config = importlib.import_module(f'configs.{name}').get_config()
    if name == 'code' and sandbox.bwrap_problem() is not None:
      config.task.kwargs.isolation = 'rlimits'  # bwrap is required by default; here only the build is tested.
    config_lib.validate(config)
    envs.validate_task_config(config)
    task = envs.get_task(config.task)
    self.assertLen(task.eval_set(), config.task.eval_size)
    tok = CharTokenizer()
    longest = 0
    for ex in task.eval_set() + [next(task.train_iterator(config.seed))]:
      messages = task.make_env(ex).reset()
      self.assertEqual(messages[-1]['role'], 'user')
      ids, _ = tok.apply_chat_template(messages, add_generation_prompt=True)  # Encodable by the char tokenizer.
      longest = max(longest, len(ids))
    self.assertLess(longest + config.sampler.max_new_tokens, config.sampler.max_seq_len + 1)  # A turn fits.
    task.close()

  @parameterized.parameters('math', 'code', 'imo')
  def test_data_files_are_declared_so_flags_can_set_them(self, name):
    config = importlib.import_module(f'configs.{name}').get_config()
    config.lock()  # As main locks it: a flag can only set a declared field.
    for field in ('data_file', 'eval_file'):
      self.assertIn(field, config.task.kwargs)
      config.task.kwargs[field] = config.task.kwargs.data_file
    envs.validate_task_config(config)

  def test_episode_limits_from_config(self):
    config = importlib.import_module('configs.calculator').get_config()
    self.assertEqual(rollout.EpisodeLimits.from_config(config), rollout.EpisodeLimits(4, 20, 128))

  def test_validate_names_task_fields(self):
    config = importlib.import_module('configs.math').get_config()
    config.task.kwargs.data_file = '/missing.jsonl'
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.data_file=.*no such file'):
      envs.validate_task_config(config)
    config = importlib.import_module('configs.arith').get_config()
    config.task.name = 'nope'
    with self.assertRaisesRegex(ConfigError, r'config\.task\.name'):
      envs.validate_task_config(config)

  def test_dry_run_command_line(self):
    r = subprocess.run([sys.executable, '-m', 'sao_jax.main', '--config=configs/arith.py:3', '--dry_run',
                        '--config.trainer.checkpoint_every=0'],
                       capture_output=True, text=True, timeout=120, check=False)
    self.assertEqual(r.returncode, 0, r.stderr[-2000:])
    self.assertIn('max_digits: 3', r.stdout)


if __name__ == '__main__':
  absltest.main()
