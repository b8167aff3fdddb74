"""The one config check (`config_lib.validate`) and the algorithm presets (`learner.algo`).

Every leaf of `configs/base.py` has a type (its default's) and only its leaves are fields; every bad config
measured on main is refused naming its field;
each algorithm name resolves to its own settings, and a changed defining setting is a recorded ablation.
"""

import importlib
import json
import math
import os
import tempfile
from collections.abc import Mapping

import jax
import ml_collections
from absl.testing import absltest
from absl.testing import parameterized

from configs import base
from sao_jax import checkpoint
from sao_jax import config_lib
from sao_jax.errors import ConfigError
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import optim as optim_lib
from sao_jax.learner import StepConfig
from sao_jax.models import get_model_config
from sao_jax.models.build import model_config_of

# Written from the papers / docs/design.md, independently of `algo.PRESETS`: (path -> value) each name must run with.
_EXPECTED = {
    'sao': {'algo.clip_mode': 'double_side', 'algo.eps_low': 0.3, 'algo.eps_high': 5.0, 'algo.agg': 'token_mean',
            'algo.lam_critic': 1.0, 'algo.lam_policy': -1.0, 'algo.adaptive_alpha': 1.5,
            'algo.advantages_from': 'updated_critic', 'algo.critic_epochs': 2, 'algo.critic_warmup_steps': 10,
            'optim.freeze_critic_attention': True, 'algo.gae_over': 'actions', 'algo.group_size': 1},
    'ppo': {'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.lam_critic': 0.95,
            'algo.lam_policy': 0.95, 'algo.advantages_from': 'pre_update', 'algo.critic_epochs': 1,
            'algo.critic_warmup_steps': 0, 'optim.freeze_critic_attention': False, 'algo.group_size': 1},
    'grpo': {'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.2, 'algo.agg': 'seq_mean_token_mean',
             'algo.group_std_normalize': True, 'algo.group_baseline': 'mean', 'algo.group_size': 8},
    'dr_grpo': {'algo.clip_mode': 'ppo', 'algo.agg': 'seq_mean_token_sum', 'algo.group_std_normalize': False,
                'algo.group_baseline': 'mean', 'algo.group_size': 8},
    'dapo': {'algo.clip_mode': 'ppo', 'algo.eps_low': 0.2, 'algo.eps_high': 0.28, 'algo.agg': 'token_mean',
             'algo.dynamic_sampling': True, 'algo.group_size': 8},
    'gspo': {'algo.clip_mode': 'gspo', 'algo.agg': 'seq_mean_token_mean', 'algo.group_size': 8},
    'rloo': {'algo.clip_mode': 'ppo', 'algo.group_baseline': 'leave_one_out', 'algo.group_size': 8},
}


def _get(config, path):
  node = config
  for part in path.split('.'):
    node = node[part]
  return node


def _set(config, path, value):
  *parents, leaf = path.split('.')
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def _config(name='base', **overrides):
  name, _, arg = name.partition(':')
  c = importlib.import_module(f'configs.{name}').get_config(arg or None)
  for path, value in overrides.items():
    _set(c, path.replace('__', '.'), value)
  return c


def _loose(config):
  """A copy without type safety, so a test can put a value of the wrong type into any field."""
  return ml_collections.ConfigDict(config.to_dict(), type_safe=False)


_WRONG = {bool: 'yes', int: 1.5, float: 'x', str: 3, tuple: 3}


class FieldTableTest(parameterized.TestCase):

  def test_the_field_types_are_the_leaves_of_base(self):
    types = config_lib.field_types()
    self.assertEqual(list(types), config_lib.leaf_paths(base.get_config()))
    self.assertContainsSubset(set(types.values()), {bool, int, float, str, tuple, Mapping, object})
    self.assertEqual([p for p, kind in types.items() if kind is object], ['model.remat'])  # A name or the old bool.
    self.assertIs(types['task.kwargs'], Mapping)  # Owned by the task: one field, its keys checked by the task.
    self.assertIs(types['algo.eps_low'], float)  # A placeholder carries its type.
    self.assertIs(types['algo.group_std_normalize'], bool)
    self.assertIs(types['mesh.rules'], tuple)

  def test_every_condition_and_resumable_change_names_a_leaf_of_base(self):
    leaves = set(config_lib.leaf_paths(base.get_config()))
    self.assertEmpty(set(config_lib.FIELDS) - leaves, 'conditions on fields that configs/base.py does not have')
    self.assertEmpty(set(checkpoint.RESUMABLE_CHANGES) - leaves,
                     'resumable changes of fields that configs/base.py does not have')

  def test_every_field_refuses_a_value_of_the_wrong_type(self):
    resolved = config_lib.validate(base.get_config(), log=False)
    for path, kind in config_lib.field_types().items():
      c = _loose(resolved)
      _set(c, path, _WRONG.get(kind, 3))
      if path == 'algo.ablations':  # An output of the check: recomputed, whatever was there.
        self.assertEqual(config_lib.validate(c, log=False).algo.ablations, ())
        continue
      with self.assertRaisesRegex(ConfigError, rf'config\.{path}\b', msg=path):
        config_lib.validate(c, log=False)

  def test_every_float_field_refuses_inf_and_nan(self):
    resolved = config_lib.validate(base.get_config(), log=False)
    floats = [p for p, kind in config_lib.field_types().items() if kind is float]
    self.assertGreater(len(floats), 20)
    for path in floats:
      for bad in (math.inf, -math.inf, math.nan):
        c = _loose(resolved)
        _set(c, path, bad)
        with self.assertRaisesRegex(ConfigError, rf'config\.{path}=', msg=f'{path}={bad}'):
          config_lib.validate(c, log=False)

  def test_int_fields_refuse_bools(self):
    c = _loose(config_lib.validate(base.get_config(), log=False))
    c.trainer.num_steps = True
    with self.assertRaisesRegex(ConfigError, r'config\.trainer\.num_steps=True has type bool; expected int'):
      config_lib.validate(c, log=False)

  def test_unknown_field_is_refused(self):
    c = base.get_config()
    c.algo.new_knob = 1
    with self.assertRaisesRegex(ConfigError, r'config\.algo\.new_knob is not a known field'):
      config_lib.validate(c, log=False)
    c = base.get_config()
    c.new_section = ml_collections.ConfigDict({'knob': 1.0})
    with self.assertRaisesRegex(ConfigError, r'config\.new_section\.knob is not a known field'):
      config_lib.validate(c, log=False)

  def test_a_float_field_takes_an_int_and_a_tuple_field_a_list(self):
    c = _loose(config_lib.validate(base.get_config(), log=False))
    c.algo.eps_high, c.trainer.seq_buckets = 2, [128, 256, 512, 1024]
    config_lib.validate(c, log=False)
    c.trainer.seq_buckets = 'x'
    with self.assertRaisesRegex(ConfigError, r'config\.trainer\.seq_buckets=.x. has type str; expected tuple'):
      config_lib.validate(c, log=False)

  def test_task_kwargs_is_one_field_checked_by_the_task(self):
    c = _loose(config_lib.validate(base.get_config(), log=False))
    c.task.kwargs = 3
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs=3 has type int; expected Mapping'):
      config_lib.validate(c, log=False)

  def test_memory_knobs_reach_the_model_config(self):
    # config.model.remat takes a policy name or the old bool (True = full, False = none), from a config file or
    # the command line (where `--config.model.remat=True` parses to the bool).
    for remat, want in ((True, 'full'), (False, 'none'), ('dots_with_no_batch_dims_saveable',) * 2):
      c = base.get_config()
      c.model.remat = remat
      c.model.param_dtype = 'bfloat16'
      c.model.critic_remat = 'full'
      c.optim.state_dtype = 'bfloat16'
      config_lib.validate(c, log=False)
      cfg = model_config_of(c.model)
      self.assertEqual((cfg.remat, cfg.param_dtype), (want, 'bfloat16'))

  @parameterized.parameters('base', 'arith', 'calculator', 'code', 'drift', 'imo', 'imo:long', 'math')
  def test_shipped_configs_validate_without_ablations(self, name):
    c = _config(name)
    resolved = config_lib.validate(c, log=False)
    self.assertEqual(resolved.algo.ablations, ())
    self.assertIsNone(c.algo.clip_mode)  # The input is not changed.


class BadConfigTest(parameterized.TestCase):
  """Each config measured on main to pass `--dry_run` (issues 9 and 14) is refused, naming the field."""

  @parameterized.named_parameters(
      ('policy_epochs_0', {'trainer.policy_epochs': 0}, 'trainer.policy_epochs'),
      ('cosine_total_le_warmup', {'optim.schedule': 'cosine', 'optim.warmup_steps': 100, 'optim.total_steps': 100},
       'optim.total_steps'),
      ('cosine_run_le_warmup', {'optim.schedule': 'cosine', 'optim.total_steps': 0, 'optim.warmup_steps': 2000},
       'optim.total_steps'),
      ('keep_checkpoints_0', {'trainer.keep_checkpoints': 0}, 'trainer.keep_checkpoints'),
      ('mesh_fsdp_3_on_8', {'mesh.fsdp': 3}, 'mesh.fsdp'),
      ('mesh_tensor_0', {'mesh.tensor': 0}, 'mesh.tensor'),
      ('eps_low_1', {'algo.eps_low': 1.0}, 'algo.eps_low'),
      ('actor_lr_inf', {'optim.actor_lr': math.inf}, 'optim.actor_lr'),
      ('b2_1_5', {'optim.b2': 1.5}, 'optim.b2'),
      ('eps_negative', {'optim.eps': -1e-8}, 'optim.eps'),
      ('weight_decay_negative', {'optim.weight_decay': -0.1}, 'optim.weight_decay'),
      ('warmup_negative', {'optim.warmup_steps': -1}, 'optim.warmup_steps'),
      ('kl_coef_negative', {'algo.kl_coef': -0.1}, 'algo.kl_coef'),
      ('entropy_coef_negative', {'algo.entropy_coef': -0.01}, 'algo.entropy_coef'),
      ('tis_cap_negative', {'algo.tis_cap': -1.0}, 'algo.tis_cap'),
      ('value_clip_negative', {'algo.value_clip_eps': -0.1}, 'algo.value_clip_eps'),
      ('checkpoint_every_negative', {'trainer.checkpoint_every': -1}, 'trainer.checkpoint_every'),
      ('num_steps_negative', {'trainer.num_steps': -1}, 'trainer.num_steps'),
      ('max_consecutive_skips_0', {'optim.max_consecutive_skips': 0}, 'optim.max_consecutive_skips'),
      ('queue_size_0', {'trainer.queue_size': 0}, 'trainer.queue_size'),
      ('max_seq_len_lt_new_tokens', {'sampler.max_seq_len': 32, 'sampler.max_new_tokens': 64},
       'sampler.max_seq_len'),
      ('sampler_batch_0', {'sampler.batch_size': 0}, 'sampler.batch_size'),
      ('refill_rows_negative', {'sampler.refill_rows': -1}, 'sampler.refill_rows'),
      ('weight_switch', {'trainer.weight_switch': 'some'}, 'trainer.weight_switch'),
      ('icepop_low_gt_high', {'algo.icepop_low': 1.0, 'algo.icepop_high': 1.0}, 'algo.icepop_low'),
      ('icepop_high_lt_1', {'algo.icepop_low': 0.5, 'algo.icepop_high': 0.8}, 'algo.icepop_high'),
      ('num_processes_0', {'distributed.num_processes': 0}, 'distributed.num_processes'),
      ('process_id_out_of_range', {'distributed.num_processes': 2, 'distributed.process_id': 2,
                                   'distributed.coordinator_address': 'localhost:1234'}, 'distributed.process_id'),
      ('process_id_negative', {'distributed.process_id': -1}, 'distributed.process_id'),
      ('model_gpt5', {'model.name': 'gpt5'}, 'model.name'),
      ('model_dtype', {'model.dtype': 'float16'}, 'model.dtype'),
      ('param_dtype', {'model.param_dtype': 'float16'}, 'model.param_dtype'),
      ('remat_name', {'model.remat': 'everything'}, 'model.remat'),
      ('remat_int', {'model.remat': 1}, 'model.remat'),
      ('critic_remat', {'model.critic_remat': 'none '}, 'model.critic_remat'),
      ('state_dtype', {'optim.state_dtype': 'float16'}, 'optim.state_dtype'),
      ('matmul_precision', {'model.matmul_precision': 'tf32'}, 'model.matmul_precision'),
      ('tokenizer_sentencepiece', {'model.tokenizer': 'sentencepiece'}, 'model.tokenizer'),
      ('tokenizer_hf_without_dir', {'model.tokenizer': 'hf'}, 'model.hf_dir'),
      ('hf_dir_missing', {'model.hf_dir': '/no/such/dir'}, 'model.hf_dir'),
      ('clip_mode', {'algo.clip_mode': 'ppo2'}, 'algo.clip_mode'),
      ('agg', {'algo.agg': 'mean'}, 'algo.agg'),
      ('critic_epochs_0', {'algo.critic_epochs': 0}, 'algo.critic_epochs'),
      ('minibatch_not_dividing', {'trainer.minibatch_size': 5}, 'trainer.minibatch_size'),
      ('microbatch_not_dividing', {'trainer.minibatch_size': 8, 'trainer.microbatch_size': 3},
       'trainer.microbatch_size'),
      ('schedule', {'optim.schedule': 'linear'}, 'optim.schedule'),
      ('optimizer', {'optim.optimizer': 'lion'}, 'optim.optimizer'),
      ('grpo_group_1', {'algo.name': 'grpo', 'algo.group_size': 1}, 'algo.group_size'),
      ('batch_not_whole_groups', {'algo.name': 'grpo', 'trainer.batch_size': 12}, 'trainer.batch_size'),
      ('batch_not_split_over_mesh', {'trainer.batch_size': 12}, 'trainer.batch_size'),
      ('seq_buckets_too_short', {'trainer.seq_buckets': (64, 128)}, 'trainer.seq_buckets'),
      ('seq_buckets_unordered', {'trainer.seq_buckets': (512, 256)}, 'trainer.seq_buckets'),
      ('pack', {'trainer.pack': 'bfd'}, 'trainer.pack'),
      ('pack_segments_0', {'trainer.pack': 'ffd', 'trainer.pack_segments': 0}, 'trainer.pack_segments'),
      ('pack_len_too_short', {'trainer.pack': 'fixed', 'trainer.pack_len': 128}, 'trainer.pack_len'),
      ('algo_name', {'algo.name': 'a2c'}, 'algo.name'),
      ('algo_domain', {'algo.domain': 'vision'}, 'algo.domain'),
      ('task_name', {'task.name': 'chess'}, 'task.name'),
      ('mesh_rules_unknown_axis', {'mesh.rules': (('batch', 'pipeline'),)}, 'mesh.rules'),
  )
  def test_refused_naming_the_field(self, overrides, field):
    self.assertEqual(jax.device_count(), 8)
    c = base.get_config()
    for path, value in overrides.items():
      _set(c, path, value)
    with self.assertRaisesRegex(ConfigError, rf'config\.{field}\b'):
      config_lib.validate(c, log=False)

  @parameterized.parameters('math', 'code')
  def test_data_files_are_settable_and_must_open(self, name):
    for field in ('data_file', 'eval_file'):
      c = _config(name)
      c.task.kwargs[field] = '/no/such/file.jsonl'  # A declared field: --config.task.kwargs.<field> sets it.
      with self.assertRaisesRegex(ConfigError, rf'config\.task\.kwargs\.{field}=.*no such file'):
        config_lib.validate(c, log=False)
    c = _config(name)
    c.task.kwargs.data_file = tempfile.mkdtemp()  # A directory does not open as a file.
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.data_file='):
      config_lib.validate(c, log=False)

  @absltest.skipIf(os.geteuid() == 0, 'root reads any file')
  def test_unreadable_data_file(self):
    path = os.path.join(tempfile.mkdtemp(), 'p.jsonl')
    with open(path, 'w') as f:
      f.write('{}\n')
    os.chmod(path, 0)
    c = _config('math')
    c.task.kwargs.data_file = path
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.data_file=.*does not open'):
      config_lib.validate(c, log=False)

  def test_a_run_needs_a_workdir_when_it_checkpoints(self):
    c = base.get_config()
    config_lib.validate(c, log=False)  # A check of the config alone (eval) needs no workdir.
    with self.assertRaisesRegex(ConfigError, r"config\.workdir=''"):
      config_lib.validate(c, for_run=True, log=False)
    c.trainer.checkpoint_every = 0
    config_lib.validate(c, for_run=True, log=False)
    c.trainer.checkpoint_every = 10
    c.workdir = tempfile.mkdtemp()
    config_lib.validate(c, for_run=True, log=False)
    c.workdir = os.path.join(c.workdir, 'file')
    open(c.workdir, 'w').close()
    with self.assertRaisesRegex(ConfigError, r'config\.workdir=.*not a directory'):
      config_lib.validate(c, for_run=True, log=False)

  def test_mesh_is_built_on_the_given_devices(self):
    c = base.get_config()
    c.mesh.fsdp = 3
    with self.assertRaisesRegex(ConfigError, r'config\.mesh\.fsdp=3 .* covers 3 of the 8'):
      config_lib.validate(c, log=False)
    c.trainer.batch_size = 12
    config_lib.validate(c, devices=jax.devices()[:3], log=False)

  def test_hf_model_directory(self):
    hf_dir = tempfile.mkdtemp()
    c = base.get_config()
    c.model.name, c.model.hf_dir = 'hf', hf_dir
    with self.assertRaisesRegex(ConfigError, r'config\.model\.hf_dir=.*config\.json'):
      config_lib.validate(c, log=False)
    cfg = get_model_config('tiny', num_heads=6, num_kv_heads=3)
    with open(os.path.join(hf_dir, 'config.json'), 'w') as f:
      json.dump(cfg.to_hf_config(), f)
    with self.assertRaisesRegex(ConfigError, r'num_heads=6 is not divisible by config\.mesh\.tensor=4'):
      c.mesh.fsdp, c.mesh.tensor = 2, 4  # The model read from the directory is what the layout is checked on.
      config_lib.validate(c, log=False)
    c.mesh.fsdp, c.mesh.tensor = 8, 1
    config_lib.validate(c, log=False)
    c.model.tokenizer = 'hf'  # The directory has no tokenizer.json.
    with self.assertRaisesRegex(ConfigError, r'config\.model\.hf_dir=.*has no tokenizer\.json'):
      config_lib.validate(c, log=False)
    c.model.tokenizer = tempfile.mkdtemp()
    with self.assertRaisesRegex(ConfigError, r'config\.model\.tokenizer=.*has no tokenizer\.json'):
      config_lib.validate(c, log=False)

  def test_heads_must_split_over_tensor(self):
    c = base.get_config()  # tiny: 4 heads, 2 kv heads.
    c.mesh.fsdp, c.mesh.tensor = 2, 4
    with self.assertRaisesRegex(ConfigError, r'num_kv_heads=2 is not divisible by config\.mesh\.tensor=4'):
      config_lib.validate(c, log=False)

  def test_multi_process_mesh_is_checked_from_one_process(self):
    c = base.get_config()
    c.distributed.num_processes, c.distributed.coordinator_address = 2, 'localhost:1'
    c.mesh.fsdp = 8  # 2 processes x 8 local devices = 16 devices: 8 covers half.
    with self.assertRaisesRegex(ConfigError, r'covers 8 of the 16 devices'):
      config_lib.validate(c, log=False)
    c.mesh.fsdp = 16
    config_lib.validate(c, log=False)

  def test_module_checks_are_the_ones_validate_runs(self):
    """The modules' constructors refuse what validate refuses (one rule each, shared)."""
    c = base.get_config()
    c.optim.schedule, c.optim.total_steps, c.optim.warmup_steps = 'cosine', 10, 10
    with self.assertRaisesRegex(ConfigError, r'config\.optim\.total_steps=10'):
      optim_lib.make_schedule(c.optim, 1e-3)
    c = base.get_config()
    c.trainer.keep_checkpoints = 0
    with self.assertRaisesRegex(ConfigError, r'config\.trainer\.keep_checkpoints=0'):
      checkpoint.CheckpointConfig.from_config(c, directory=tempfile.mkdtemp())
    c = base.get_config()
    c.trainer.policy_epochs = 0
    with self.assertRaisesRegex(ConfigError, r'config\.trainer\.policy_epochs=0'):
      StepConfig.from_config(c)

  def test_double_side_at_temperature_is_allowed(self):
    c = base.get_config()
    c.sampler.temperature, c.sampler.top_p = 0.7, 0.9
    with self.assertLogs('absl', 'INFO') as logs:
      config_lib.validate(c)
    self.assertTrue(any('distribution actually sampled from' in line for line in logs.output))


class PresetTest(parameterized.TestCase):

  @parameterized.parameters(*_EXPECTED)
  def test_each_name_resolves_to_its_settings(self, name):
    resolved = config_lib.validate(_config(**{'algo.name': name}), log=False)
    for path, value in _EXPECTED[name].items():
      self.assertEqual(_get(resolved, path), value, f'{name}: {path}')
    self.assertEqual(resolved.algo.ablations, ())
    cfg = StepConfig.from_config(_config(**{'algo.name': name}))  # The learner resolves by itself too.
    for path, value in _EXPECTED[name].items():
      if path.startswith('algo.'):
        self.assertEqual(getattr(cfg, path[len('algo.'):], value), value, f'{name}: {path}')
    self.assertEqual(cfg.uses_critic, name in ('sao', 'ppo'))

  def test_ppo_is_not_sao(self):
    sao = StepConfig.from_config(_config(**{'algo.name': 'sao'}))
    ppo = StepConfig.from_config(_config(**{'algo.name': 'ppo'}))
    self.assertEqual((sao.clip_mode, ppo.clip_mode), ('double_side', 'ppo'))
    self.assertLess(sao.lam_policy, 0.0)  # Length-adaptive.
    self.assertBetween(ppo.lam_policy, 0.0, 1.0)  # Fixed.
    self.assertEqual((sao.critic_epochs, ppo.critic_epochs), (2, 1))
    self.assertEqual((sao.critic_warmup_steps, ppo.critic_warmup_steps), (10, 0))
    self.assertEqual((sao.advantages_from, ppo.advantages_from), ('updated_critic', 'pre_update'))
    freeze = [config_lib.validate(_config(**{'algo.name': n}), log=False).optim.freeze_critic_attention
              for n in ('sao', 'ppo')]
    self.assertEqual(freeze, [True, False])
    self.assertNotEqual((sao.eps_low, sao.eps_high), (ppo.eps_low, ppo.eps_high))

  def test_domain_picks_saos_agentic_band(self):
    for name, band in (('calculator', (0.8, 3.0)), ('code', (0.8, 3.0)), ('arith', (0.3, 5.0))):
      cfg = StepConfig.from_config(_config(name))
      self.assertEqual((cfg.eps_low, cfg.eps_high), band, name)
    ppo = StepConfig.from_config(_config('calculator', **{'algo.name': 'ppo'}))  # A task's domain keeps PPO PPO.
    self.assertEqual((ppo.clip_mode, ppo.eps_low, ppo.eps_high), ('ppo', 0.2, 0.2))

  def test_ablation_is_logged_and_recorded(self):
    c = _config(**{'algo.name': 'ppo', 'algo.eps_high': 0.28, 'algo.critic_epochs': 2})
    with self.assertLogs('absl', 'WARNING') as logs:
      resolved = config_lib.validate(c)
    self.assertEqual(resolved.algo.ablations, ('algo.eps_high: 0.2 -> 0.28', 'algo.critic_epochs: 1 -> 2'))
    self.assertTrue(any('ABLATION' in line and 'algo.eps_high: 0.2 -> 0.28' in line for line in logs.output))
    self.assertIn('algo.critic_epochs: 1 -> 2', str(resolved))  # Saved with the run's config.
    cfg = StepConfig.from_config(c)
    self.assertEqual((cfg.clip_mode, cfg.eps_high, cfg.critic_epochs), ('ppo', 0.28, 2))

  def test_setting_the_preset_value_is_not_an_ablation(self):
    c = _config(**{'algo.name': 'dapo', 'algo.eps_high': 0.28, 'algo.agg': 'token_mean'})
    self.assertEqual(algo_lib.resolve(c)[1], ())

  def test_measured_on_main_now_run_their_algorithm(self):
    """gspo with the base config ran double_side on main; dr_grpo with agg=token_mean was refused by the learner
    only. Now gspo resolves to its ratio, and the dr_grpo change is an ablation both the check and the learner
    accept."""
    self.assertEqual(StepConfig.from_config(_config(**{'algo.name': 'gspo'})).clip_mode, 'gspo')
    c = _config(**{'algo.name': 'dr_grpo', 'algo.agg': 'token_mean'})
    self.assertEqual(config_lib.validate(c, log=False).algo.ablations,
                     ("algo.agg: 'seq_mean_token_sum' -> 'token_mean'",))
    self.assertEqual(StepConfig.from_config(c).agg, 'token_mean')

  def test_sao_with_groups_is_an_ablation(self):
    """SAO's step reads no group ids: G rollouts per prompt with a critic works (a multi-sample SAO), so it is
    allowed and recorded, not refused."""
    c = _config(**{'algo.name': 'sao', 'algo.group_size': 4})
    resolved = config_lib.validate(c, log=False)
    self.assertEqual(resolved.algo.ablations, ('algo.group_size: 1 -> 4',))
    self.assertEqual(StepConfig.from_config(c).group_size, 4)

  def test_settings_an_algorithm_does_not_read_are_not_ablations(self):
    c = _config(**{'algo.name': 'grpo', 'algo.critic_epochs': 3})
    resolved, ablations = algo_lib.resolve(c)
    self.assertEqual(ablations, ())
    self.assertEqual(algo_lib.unused_settings(c), ('algo.critic_epochs=3',))
    self.assertEqual(resolved.algo.critic_epochs, 3)

  def test_resolve_is_idempotent_and_pure(self):
    c = _config(**{'algo.name': 'rloo', 'algo.eps_low': 0.1})
    once, ablations = algo_lib.resolve(c)
    twice, again = algo_lib.resolve(once)
    self.assertEqual(ablations, again)
    self.assertEqual(once.to_dict(), twice.to_dict())
    self.assertIsNone(c.algo.clip_mode)
    self.assertEqual(c.algo.ablations, ())

  def test_every_defining_field_is_a_placeholder_in_base(self):
    c = base.get_config()
    for path in algo_lib.DEFINING_FIELDS:
      self.assertIsNone(_get(c, path), path)
    for name in algo_lib.ALGOS:  # Every preset gives every defining field a value that passes the checks.
      self.assertEqual(set(algo_lib.preset(name)), set(algo_lib.DEFINING_FIELDS))

  def test_names_come_from_the_preset_table(self):
    for name in algo_lib.ALGOS:
      config_lib.FIELDS['algo.name']('algo.name', name)
    with self.assertRaisesRegex(ConfigError, 'config.algo.name'):
      config_lib.FIELDS['algo.name']('algo.name', 'a2c')


if __name__ == '__main__':
  absltest.main()
