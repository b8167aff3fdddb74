"""The one config check, run by `--dry_run` and at the start of every run: a bad config fails here, naming the field.

`validate(config)` resolves the algorithm's preset (`learner.algo.resolve`) and composes every check:

1. the fields: every leaf of `configs/base.py` (`defaults()`, the knob list's one source) has the type of its
   default (`field_types`: bool / int / float / str / tuple; floats finite; `object` for `model.remat`, a policy
   name or the old bool), a leaf that base.py does not have is refused, and `FIELDS` adds a range or a choice where
   a field has one;
2. relations between fields (`max_seq_len > max_new_tokens`, the largest sequence bucket holds an episode, ...);
3. each module's own check, kept where its rule lives and shared with the module's constructor: the learner's
   (`learner.algo.check_config`), the optimizer's (`learner.optim.check_config`), the checkpointer's
   (`checkpoint.check_config`), multi-host (`parallel.distributed.check_config`), the task's
   (`envs.registry.validate_task_config`: name, limits, kwargs, data files that open);
4. the model (a named config or an HF directory, dtype, tokenizer) and the mesh: `parallel.make_mesh` over the
   devices present and `parallel.check_layout` (batch rows and attention heads divisible by their axes).

Layering: this module sits just below `main` / `trainer`; nothing it imports imports it (`ConfigError` lives in
`sao_jax.errors` and is re-exported here).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
from absl import logging

from configs import base as base_config
from sao_jax import checkpoint
from sao_jax import parallel
from sao_jax import workdir as workdir_lib
from sao_jax.envs import registry
from sao_jax.errors import ConfigError
from sao_jax.generate.config import WEIGHT_SWITCHES
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import optim as optim_lib
from sao_jax.losses.common import AGGREGATIONS
from sao_jax.losses.kl import KL_ESTIMATORS
from sao_jax.losses.policy import BEHAVIOR_CORRECTIONS
from sao_jax.losses.policy import CLIP_MODES
from sao_jax.models import config as model_config_lib
from sao_jax.models import hf_io
from sao_jax.parallel import distributed
from sao_jax.rollout.pack import PACKINGS
from sao_jax.tokenizers import CharTokenizer

__all__ = ['ConfigError', 'FIELDS', 'defaults', 'field_types', 'leaf_paths', 'validate']

TRAINER_MODES = ('sync', 'async')  # sync: generate then train (on-policy); async: sampler threads + queue.
HF_MODEL = 'hf'  # config.model.name of a model read from config.model.hf_dir.
TOKENIZERS = ('char', 'hf')  # Or a directory with tokenizer.json.
MATMUL_PRECISIONS = ('default', 'high', 'highest')  # config.model.matmul_precision: jax_default_matmul_precision.


# Sub-configs of `configs/base.py` that are one field each (type `Mapping`), their keys checked by their owner:
# `task.kwargs` by the task's options (`envs.registry.validate_task_config`).
OWNED_SUBCONFIGS = ('task.kwargs',)


def defaults() -> ml_collections.ConfigDict:
  """Every knob at its default: the repository's `configs/base.py` (the `configs` package is installed with
  `sao_jax`, pyproject). The package reads base.py here only: the validator's field types (`field_types`) and the
  checkpoint's config diff (a knob added since a checkpoint, at its default) come from this."""
  return base_config.get_config()


@functools.cache
def field_types() -> Mapping[str, type]:
  """Every field of `configs/base.py` (dotted path) -> the type of its default (a `placeholder(t)` carries t;
  `Mapping` for an owned sub-config, `OWNED_SUBCONFIGS`). A value passes as `_is_kind` says: `bool` only a bool,
  `int` no bool, `float` a finite float or int, `tuple` a tuple or list."""
  out = {}

  def walk(node: ml_collections.ConfigDict, prefix: str) -> None:
    for key in node.keys():
      path, kind = f'{prefix}{key}', node.get_type(key)
      if issubclass(kind, ml_collections.ConfigDict) and path not in OWNED_SUBCONFIGS:
        walk(node[key], path + '.')
      else:
        out[path] = Mapping if issubclass(kind, ml_collections.ConfigDict) else kind
  walk(defaults(), '')
  return types.MappingProxyType(out)


@dataclasses.dataclass(frozen=True)
class Check:
  """A condition on one field's value, with the reason shown when it fails (its type is checked first, from
  `field_types`)."""
  ok: Callable[[Any], bool]
  why: str

  def __call__(self, path: str, value: Any) -> None:
    if not self.ok(value):
      raise ConfigError(f'config.{path}={value!r}: {self.why}')


def _is_kind(value: Any, kind: type) -> bool:
  if kind is bool:
    return isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if kind is tuple:
    return isinstance(value, (tuple, list))
  if kind is Mapping:
    return isinstance(value, (Mapping, ml_collections.ConfigDict))
  return isinstance(value, kind)


def _bounds(ge=None, gt=None, le=None, lt=None, why: str = '') -> Check:
  """A number within bounds (each bound optional; `ge`/`le` closed, `gt`/`lt` open)."""
  parts = [f'>= {ge}' if ge is not None else '', f'> {gt}' if gt is not None else '',
           f'<= {le}' if le is not None else '', f'< {lt}' if lt is not None else '']
  rule = ' and '.join(p for p in parts if p)

  def ok(v):
    return ((ge is None or v >= ge) and (gt is None or v > gt) and (le is None or v <= le)
            and (lt is None or v < lt))
  return Check(ok, f'must be {rule}{". " + why if why else "."}')


def _lora_targets() -> Check:
  names = model_config_lib.LORA_TARGETS
  return Check(lambda v: isinstance(v, (tuple, list)) and len(v) > 0 and len(set(v)) == len(v) and set(v) <= set(names),
               f'is not a tuple of distinct names among {names}.')


def _choice(choices: Sequence[str]) -> Check:
  return Check(lambda v: v in choices, f'is not one of {list(choices)}.')


def _buckets() -> Check:
  return Check(lambda v: len(v) > 0 and all(_is_kind(b, int) and b >= 1 for b in v)
               and all(a < b for a, b in zip(v, v[1:])), 'must be positive ints in increasing order.')


# Conditions on fields of `configs/base.py` (path -> check), run after the field's type (`field_types`); a field
# without one here needs only its type. Fields whose rule belongs to a module are checked by that module in
# `validate` (named in the comment), so each rule is written once.
FIELDS: dict[str, Check] = {
    'seed': _bounds(ge=0),
    # workdir: checkpoint.check_config (set when a run saves checkpoints).
    # ---- algo
    'algo.name': _choice(algo_lib.ALGOS),
    'algo.domain': _choice(algo_lib.DOMAINS),
    'algo.ablations': Check(lambda v: all(isinstance(x, str) for x in v), 'must be strings.'),
    'algo.clip_mode': _choice(CLIP_MODES),
    'algo.eps_low': _bounds(gt=0.0, lt=1.0, why='The band (1 - eps_low, 1 + eps_high) needs 0 < 1 - eps_low < 1.'),
    'algo.eps_high': _bounds(gt=0.0),
    'algo.dual_clip_c': _bounds(gt=1.0),
    'algo.agg': _choice(AGGREGATIONS),
    'algo.agg_max_len': _bounds(ge=0),
    'algo.behavior_correction': _choice(BEHAVIOR_CORRECTIONS),
    'algo.tis_cap': _bounds(gt=0.0),
    'algo.icepop_low': _bounds(ge=0.0, le=1.0, why='An on-policy token (weight 1) must be kept.'),
    'algo.icepop_high': _bounds(ge=1.0, why='An on-policy token (weight 1) must be kept.'),
    'algo.gamma': _bounds(ge=0.0, le=1.0),
    'algo.lam_critic': _bounds(ge=0.0, le=1.0),
    'algo.lam_policy': _bounds(le=1.0, why='A value < 0 selects the length-adaptive lambda.'),
    'algo.adaptive_alpha': _bounds(gt=0.0),
    'algo.advantages_from': _choice(algo_lib.ADVANTAGE_SOURCES),
    'algo.critic_epochs': _bounds(ge=1),
    'algo.critic_warmup_steps': _bounds(ge=0),
    'algo.value_clip_eps': _bounds(ge=0.0),
    'algo.truncation': _choice(algo_lib.TRUNCATIONS),
    'algo.gae_over': _choice(algo_lib.GAE_OVER),
    'algo.group_size': _bounds(ge=1),  # And algo.check_config (>= 2 for the group algorithms).
    'algo.group_baseline': _choice(algo_lib.GROUP_BASELINES),
    'algo.kl_coef': _bounds(ge=0.0),
    'algo.kl_estimator': _choice(KL_ESTIMATORS),
    'algo.entropy_coef': _bounds(ge=0.0),
    # ---- optim (optimizer, schedule and the cosine horizon: optim.check_config)
    'optim.actor_lr': _bounds(ge=0.0),
    'optim.critic_lr': _bounds(ge=0.0),
    'optim.warmup_steps': _bounds(ge=0),
    'optim.total_steps': _bounds(ge=0, why='0 = the whole run (sao_jax.learner.optimizer_horizons).'),
    'optim.end_lr_factor': _bounds(ge=0.0, le=1.0),
    'optim.b1': _bounds(ge=0.0, lt=1.0),
    'optim.b2': _bounds(ge=0.0, lt=1.0),
    'optim.eps': _bounds(gt=0.0),
    'optim.weight_decay': _bounds(ge=0.0),
    'optim.grad_clip': _bounds(ge=0.0, why='0 turns clipping off.'),
    'optim.max_consecutive_skips': _bounds(ge=1, why='It stops a run of non-finite updates; 0 would never stop it.'),
    'optim.state_dtype': _choice(optim_lib.STATE_DTYPES),
    # ---- model (name, hf_dir, dtype, tokenizer: _check_model)
    'model.param_dtype': _choice(model_config_lib.DTYPES),
    'model.remat': Check(lambda v: isinstance(v, bool) or v in model_config_lib.REMAT_POLICIES,
                         f'is not one of {list(model_config_lib.REMAT_POLICIES)} (or True = full, False = none).'),
    'model.critic_remat': Check(lambda v: v in ('', *model_config_lib.REMAT_POLICIES),
                                f"is not '' (the policy's remat) or one of {list(model_config_lib.REMAT_POLICIES)}."),
    'model.attention_impl': _choice(model_config_lib.ATTENTION_IMPLS),
    'model.matmul_precision': _choice(MATMUL_PRECISIONS),
    'model.lora.rank': _bounds(ge=0, why='0 = full fine-tuning.'),
    'model.lora.alpha': _bounds(gt=0.0),
    'model.lora.targets': _lora_targets(),
    'model.lora.critic_rank': _bounds(ge=0, why="0 = the policy's rank."),
    'model.lora.critic_targets': _lora_targets(),
    # ---- sampler
    'sampler.temperature': _bounds(gt=0.0),
    'sampler.top_p': _bounds(gt=0.0, le=1.0),
    'sampler.top_k': _bounds(ge=0, why='0 turns the top-k cut off.'),
    'sampler.max_new_tokens': _bounds(ge=1),
    'sampler.max_seq_len': _bounds(ge=2),
    'sampler.prompt_buckets': _buckets(),
    'sampler.batch_size': _bounds(ge=1),
    'sampler.num_threads': _bounds(ge=1),
    'sampler.decode_steps': _bounds(ge=1),
    'sampler.refill_rows': _bounds(ge=0),
    'sampler.queue_chunk': _bounds(ge=0),
    # ---- task (registry.validate_task_config: name, max_turns, eval_size, kwargs by the task's options)
    'task.step_timeout_s': _bounds(ge=0.0, why='0 = no bound.'),
    # ---- sft (the supervised warm start, sao_jax/sft.py)
    'sft.steps': _bounds(ge=0, why='0 = off.'),
    'sft.batch_size': _bounds(ge=1),
    'sft.lr': _bounds(gt=0.0),
    'sft.warmup_steps': _bounds(ge=0),
    'sft.schedule': _choice(('constant', 'cosine')),
    'sft.end_lr_factor': _bounds(ge=0.0, le=1.0),
    'sft.num_examples': _bounds(ge=0, why='0 = a fresh problem for every row.'),
    'sft.data_seed': _bounds(ge=0),
    'sft.log_every': _bounds(ge=0, why='0 = the first and last steps only.'),
    'sft.checkpoint_every': _bounds(ge=0, why='0 = only on a signal and at the end.'),
    # ---- mesh (sizes: parallel.mesh_shape / make_mesh; rules: parallel.rules_dict; layout: check_layout)
    'mesh.actor_devices': _bounds(ge=0, why='0 = the actors share the learner\'s devices.'),  # parallel.split_devices
    # ---- distributed (distributed.check_config)
    # ---- trainer (batch / minibatch / microbatch / policy_epochs: algo.check_config; keep: checkpoint)
    'trainer.mode': _choice(TRAINER_MODES),
    'trainer.batch_size': _bounds(ge=1),
    'trainer.minibatch_size': _bounds(ge=0, why='0 = the whole batch.'),
    'trainer.microbatch_size': _bounds(ge=0, why='0 = the whole minibatch.'),
    'trainer.num_steps': _bounds(ge=1),
    'trainer.max_staleness': _bounds(ge=0),
    'trainer.queue_size': _bounds(ge=1, why='The trajectory queue must hold at least one trajectory.'),
    'trainer.seq_buckets': _buckets(),
    'trainer.pack': _choice(PACKINGS),
    'trainer.pack_segments': _bounds(ge=1),
    'trainer.pack_len': _bounds(ge=0, why='0 = the largest of config.trainer.seq_buckets.'),
    'trainer.log_every': _bounds(ge=1),
    'trainer.eval_every': _bounds(ge=0, why='0 = off.'),
    'trainer.eval_batch_size': _bounds(ge=0, why='0 = sampler.batch_size.'),
    'trainer.max_train_minutes': _bounds(ge=0, why='0 = off.'),
    'trainer.checkpoint_every': _bounds(ge=0, why='0 = off.'),
    'trainer.save_retries': _bounds(ge=0, why='0 = a failed save stops the run at once.'),
    'trainer.save_retry_s': _bounds(ge=0.0),
    'trainer.weight_switch': _choice(WEIGHT_SWITCHES),
}


def leaf_paths(config: ml_collections.ConfigDict, prefix: str = '') -> list[str]:
  """Dotted paths of the config's leaves; an owned sub-config (`OWNED_SUBCONFIGS`: `task.kwargs`) is one leaf."""
  out = []
  for key, value in config.items():
    path = f'{prefix}{key}'
    if isinstance(value, ml_collections.ConfigDict) and path not in OWNED_SUBCONFIGS:
      out.extend(leaf_paths(value, path + '.'))
    else:
      out.append(path)
  return out


def override(config: ml_collections.ConfigDict, values: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """Sets `config.<path> = value` for each item (as `--config.<path>=value` does; the config is unlocked for it,
  so a new leaf may be added); returns `config`."""
  with config.unlocked():
    for path, value in values.items():
      *parents, leaf = path.split('.')
      node = config
      for part in parents:
        node = node[part]
      node[leaf] = value
  return config


def override_flags(values: Mapping[str, Any]) -> list[str]:
  """The same `config.<path>` values as `--config.<path>=value` command-line flags (`override`'s inverse through
  `sao_jax.main`: tuples as `(a,b)` / `(a,)`, which ml_collections parses back)."""
  def text(v: Any) -> str:
    if isinstance(v, tuple):
      return '(' + ','.join(str(x) for x in v) + (',)' if len(v) == 1 else ')')
    return str(v)
  return [f'--config.{k}={text(v)}' for k, v in values.items()]


def _get(config: Any, path: str) -> Any:
  node = config
  for part in path.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f'config.{path} is missing.')
    node = node[part]
  return node


def _check_field(path: str, value: Any) -> None:
  """The field's type (`field_types`), then its condition in `FIELDS` if it has one."""
  kind = field_types()[path]
  if not _is_kind(value, kind):
    raise ConfigError(f'config.{path}={value!r} has type {type(value).__name__}; expected {kind.__name__}.')
  if path in FIELDS:
    FIELDS[path](path, value)


def _check_fields(config: ml_collections.ConfigDict) -> None:
  known = field_types()
  for path in leaf_paths(config):
    if path not in known:
      raise ConfigError(f'config.{path} is not a known field (every knob has its default in configs/base.py).')
  for path in known:
    _check_field(path, _get(config, path))


def _check_relations(config: ml_collections.ConfigDict) -> None:
  a, s, tr = config.algo, config.sampler, config.trainer
  if a.icepop_low >= a.icepop_high:
    raise ConfigError(f'config.algo.icepop_low={a.icepop_low}: must be < config.algo.icepop_high={a.icepop_high}.')
  if s.max_seq_len <= s.max_new_tokens:
    raise ConfigError(f'config.sampler.max_seq_len={s.max_seq_len}: must exceed config.sampler.max_new_tokens='
                      f'{s.max_new_tokens} (an episode holds the prompt and at least one turn).')
  if max(tr.seq_buckets) < s.max_seq_len:
    raise ConfigError(f'config.trainer.seq_buckets={tuple(tr.seq_buckets)}: the largest must be >= '
                      f'config.sampler.max_seq_len={s.max_seq_len} (a whole episode is packed into one row).')
  if tr.pack == 'fixed' and tr.pack_len and tr.pack_len < s.max_seq_len:
    raise ConfigError(f'config.trainer.pack_len={tr.pack_len}: must be >= config.sampler.max_seq_len='
                      f'{s.max_seq_len} (a whole episode is packed into one row), or 0.')
  per_call = max(a.group_size, s.batch_size // a.group_size * a.group_size)
  if tr.queue_size < per_call:
    raise ConfigError(f'config.trainer.queue_size={tr.queue_size}: must hold one sampler call\'s episodes '
                      f'(config.sampler.batch_size={s.batch_size} in whole groups of {a.group_size} = {per_call}); '
                      'actors reserve room before they generate.')


def _check_lora(config: ml_collections.ConfigDict) -> None:
  """A LoRA critic whose attention is frozen has no attention adapters (they would be zeros that never train)."""
  lora = config.model.lora
  frozen = set(lora.critic_targets) & set(model_config_lib.LORA_ATTENTION_TARGETS)
  if lora.rank and config.optim.freeze_critic_attention and frozen:
    raise ConfigError(f'config.model.lora.critic_targets={tuple(lora.critic_targets)!r} adapts the critic\'s '
                      f'attention ({sorted(frozen)}) but config.optim.freeze_critic_attention is on: drop them, or '
                      'unfreeze the attention.')


def _check_model(config: ml_collections.ConfigDict) -> model_config_lib.ModelConfig:
  """The policy's `ModelConfig` from `config.model` (a named config, or `hf` read from `hf_dir`), checked."""
  m = config.model
  names = (*model_config_lib.MODEL_NAMES, HF_MODEL)
  if m.name not in names:
    raise ConfigError(f'config.model.name={m.name!r} is not one of {list(names)}.')
  if (m.name == HF_MODEL or m.tokenizer == 'hf') and not m.hf_dir:
    raise ConfigError(f"config.model.hf_dir='' but config.model.name={m.name!r} / config.model.tokenizer="
                      f'{m.tokenizer!r} read it: set it to an HF model directory.')
  if m.hf_dir and not os.path.isdir(m.hf_dir):
    raise ConfigError(f'config.model.hf_dir={m.hf_dir!r}: no such directory.')
  try:
    if m.name == HF_MODEL:
      try:
        hf = hf_io.read_hf_config(m.hf_dir)
      except (OSError, ValueError) as e:
        raise ConfigError(f'config.model.hf_dir={m.hf_dir!r}: {e}') from e
      model_cfg = model_config_lib.ModelConfig.from_hf_config(hf, dtype=m.dtype, param_dtype=m.param_dtype,
                                                              remat=m.remat, attention_impl=m.attention_impl)
    else:
      model_cfg = model_config_lib.get_model_config(m.name, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                                                    attention_impl=m.attention_impl)
  except ValueError as e:  # The only override a named config can refuse is the dtype (FIELDS checked the others).
    raise ConfigError(f'config.model.dtype={m.dtype!r} (config.model.name={m.name!r}): {e}') from e
  if model_cfg.is_moe:  # The models load, decode and export; the run's other parts do not take them yet.
    field = 'hf_dir' if m.name == HF_MODEL else 'name'
    raise ConfigError(f'config.model.{field}={getattr(m, field)!r} is a mixture-of-experts model: runs on MoE models '
                      "are not wired yet (the publisher's decode layout, the samplers, the learner's balance loss; "
                      'sao_jax.models runs, loads and exports them).')
  if m.tokenizer == 'char':
    vocab = CharTokenizer().vocab_size
    if vocab > model_cfg.vocab_size:
      raise ConfigError(f"config.model.tokenizer='char' has {vocab} tokens but config.model.name={m.name!r} "
                        f'only {model_cfg.vocab_size} embeddings.')
  elif m.tokenizer not in TOKENIZERS and not os.path.isdir(m.tokenizer):
    raise ConfigError(f'config.model.tokenizer={m.tokenizer!r} is not one of {list(TOKENIZERS)} or a directory.')
  else:
    directory = m.hf_dir if m.tokenizer == 'hf' else m.tokenizer
    if not os.path.isfile(os.path.join(directory, 'tokenizer.json')):
      field = 'hf_dir' if m.tokenizer == 'hf' else 'tokenizer'
      raise ConfigError(f'config.model.{field}={directory!r} has no tokenizer.json.')
  return model_cfg


def _check_mesh(config: ml_collections.ConfigDict, model_cfg: Any, devices: Sequence[jax.Device] | None) -> None:
  """Builds the mesh on the devices present (or, for a multi-process run checked from one process, its shape over
  `num_processes * local devices`) and checks the rules and the layout on it."""
  num = distributed.num_processes(config)
  if devices is None and num != jax.process_count():
    local = jax.local_device_count() - parallel.actor_device_count(config.mesh)
    if local < 1:
      raise ConfigError(f'config.mesh.actor_devices={parallel.actor_device_count(config.mesh)}: leaves no learner '
                        f'device of the {jax.local_device_count()} of each process.')
    shape = dict(zip(parallel.MESH_AXES, parallel.mesh_shape(config.mesh, num * local)))
    parallel.rules_dict(config.mesh.rules)
    parallel.check_layout(config, shape, model_cfg)
    return
  if devices is None:
    devices, _ = parallel.split_devices(config.mesh)  # The learner's share (config.mesh.actor_devices).
  mesh = parallel.make_mesh(config.mesh, devices)
  parallel.rules_dict(config.mesh.rules, mesh)
  parallel.check_layout(config, mesh, model_cfg)


def validate(config: ml_collections.ConfigDict, *, for_run: bool = False,
             devices: Sequence[jax.Device] | None = None, log: bool = True) -> ml_collections.ConfigDict:
  """Resolves the algorithm's preset and runs every check; returns the resolved config (`config` is not changed).

  Args:
    config: a config from `configs/*.py` (flags applied).
    for_run: also check what only a training run needs (a `workdir` when it saves checkpoints); `main` sets it.
    devices: the devices the mesh must cover (default: all devices of all processes).
    log: log the algorithm's ablations (a warning) and other notes.

  Raises:
    ConfigError: naming the first field whose value cannot work.
  """
  for path in ('algo.name', 'algo.domain'):
    _check_field(path, _get(config, path))
  resolved, ablations = algo_lib.resolve(config)
  _check_fields(resolved)
  _check_relations(resolved)
  algo_lib.check_config(resolved)
  optim_lib.check_config(resolved)
  checkpoint.check_config(resolved, need_workdir=for_run and resolved.trainer.checkpoint_every > 0)
  if for_run and resolved.workdir:
    workdir_lib.check_writable(resolved.workdir)  # One line, before any model is built.
  distributed.check_config(resolved)
  model_cfg = _check_model(resolved)
  _check_lora(resolved)
  registry.validate_task_config(resolved)
  _check_mesh(resolved, model_cfg, devices)
  if log:
    algo_lib.log_resolution(resolved, ablations, algo_lib.unused_settings(config))
    s = resolved.sampler
    if resolved.algo.clip_mode == 'double_side' and (s.temperature, s.top_p, s.top_k) != (1.0, 1.0, 0):
      logging.info('clip_mode=double_side with sampler temperature=%s top_p=%s top_k=%s: the ratio is taken to '
                   'the log-probs of the distribution actually sampled from (recorded by the sampler); the learner '
                   'trains the policy at that temperature (logits / %s), top-p/top-k not applied.',
                   s.temperature, s.top_p, s.top_k, s.temperature)
    o = resolved.optim
    if resolved.model.param_dtype == 'bfloat16':
      logging.warning('config.model.param_dtype=bfloat16: an update smaller than ~2^-8 of a weight rounds away (no '
                      'float32 master copy); an AdamW step is about lr, so weights with |w| > 2^9 lr never move: '
                      '|w| > %.2g for the policy (optim.actor_lr=%g), > %.2g for the critic (optim.critic_lr=%g). '
                      'See sao_jax/learner/optim.py.', 512 * o.actor_lr, o.actor_lr, 512 * o.critic_lr, o.critic_lr)
  return resolved
