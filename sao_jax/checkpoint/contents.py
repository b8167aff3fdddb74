"""What a learner checkpoint holds, and the run's config in it.

    save_checkpoint(ckpt, learner, model_config, config, prompts)      # at the learner's step
    step = restore_checkpoint(ckpt, learner, config, prompts, defaults=config_lib.defaults())

Items (`manager.CheckpointState`): `policy` and `critic` the models' weights (`nnx.state`); `optimizer` the rest
of the learner state (each model's optimizer state and counters, the learner step); `data` the prompt stream's
position, every process's (`prompts_by_process`); `metadata` the policy's `ModelConfig` and the run's flat config.
A resume compares that config with the run's (`config_differences`): a changed one is refused with the differing
fields named unless `config.trainer.allow_config_change`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
from flax import nnx

from sao_jax import paths
from sao_jax.checkpoint import manager
from sao_jax.errors import ConfigError
from sao_jax.learner import Learner
from sao_jax.learner import state as state_lib

if TYPE_CHECKING:
  from sao_jax.rollout.prompts import PromptSource


# Config fields that may differ between a run and the checkpoint it resumes from.
# The remat policies change what the backward pass recomputes, not the values it computes (nor the state's tree),
# and an old checkpoint holds `model.remat` as a bool; the attention implementations compute the same values, and
# packing lays the same trajectories out in other rows for the same update (tests/learner/packing_test.py).
RESUMABLE_CHANGES = ('workdir', 'trainer.num_steps', 'trainer.max_train_minutes', 'trainer.allow_config_change',
                     'trainer.log_every', 'trainer.eval_every', 'trainer.eval_batch_size', 'trainer.checkpoint_every',
                     'trainer.export_hf',
                     'distributed.coordinator_address', 'distributed.process_id',  # Per process / per launch.
                     'model.remat', 'model.critic_remat', 'model.attention_impl',
                     'trainer.pack', 'trainer.pack_segments', 'trainer.pack_len',
                     'trainer.save_retries', 'trainer.save_retry_s', 'sft.checkpoint_every', 'sft.log_every')
# Knobs removed from `configs/base.py` that a checkpoint may still hold. Each changed how fast the actors ran,
# never which tokens they generated (tests compared the tokens both ways), so a saved value is no difference.
REMOVED_KNOBS = ('sampler.fuse_admissions', 'sampler.row_groups', 'sampler.admission_rows',
                 'sampler.device_refill', 'sampler.prefix_cache')


def flat_config(config: Any) -> dict[str, Any]:
  """`{dotted path: value}` of every leaf of `config` (JSON values: tuples become lists), as checkpoints and
  metrics rows keep it."""
  d = json.loads(config.to_json_best_effort()) if hasattr(config, 'to_json_best_effort') else dict(config)
  out = {}

  def walk(prefix, node):
    if isinstance(node, dict):
      for k, v in node.items():
        walk(f'{prefix}.{k}' if prefix else k, v)
    else:
      out[prefix] = node
  walk('', d)
  return out


def config_differences(saved: dict[str, Any], config: Any, defaults: Any) -> list[str]:
  """Fields (dotted paths) whose value differs between a saved flat config and `config`, minus the
  fields a resume may change (`RESUMABLE_CHANGES`), the knobs added since the checkpoint was written
  that are at their default in `defaults` (`configs/base.py`'s config, `config_lib.defaults()`: a new knob's
  default keeps the behaviour from before it: the rule for every knob added to `configs/base.py`), and the
  knobs removed since that changed no generated token (`REMOVED_KNOBS`)."""
  now, defaults = flat_config(config), flat_config(defaults)
  keys = sorted(set(saved) | set(now))
  added_at_default = lambda k: k not in saved and k in defaults and now.get(k) == defaults[k]
  removed = lambda k: k in REMOVED_KNOBS and k not in now
  return [k for k in keys if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)
          and not added_at_default(k) and not removed(k)]


def _optimizer_item(state: state_lib.LearnerState) -> dict[str, Any]:
  """Everything of the learner state but the models' weights (saved as the policy / critic items)."""
  def part(ts):
    if ts is None:
      return None
    return {'opt_state': ts.opt_state, 'step': ts.step, 'skipped': ts.skipped,
            'consecutive_skips': ts.consecutive_skips}
  out = {'policy': part(state.policy), 'learner_step': state.step}
  if state.critic is not None:
    out['critic'] = part(state.critic)
  return out


def _restore_train_state(spec: state_lib.ModelSpec, ts: state_lib.TrainState, base: Any, weights: Any,
                         opt: dict[str, Any]) -> state_lib.TrainState:
  model = state_lib.merge(spec, ts, base)
  nnx.update(model, weights)
  params, rest = state_lib.split_own(spec, model)
  return state_lib.TrainState(params, rest, opt['opt_state'], opt['step'], opt['skipped'],
                              opt['consecutive_skips'])


def _weights(learner: Learner) -> tuple[Any, Any]:
  """(policy, critic or None) states as a checkpoint holds them: without the shared base (LoRA: the adapters, and
  the critic's head), whole otherwise."""
  critic = learner.critic_model()
  return (state_lib.own_state(learner.policy_spec, learner.policy_model()),
          None if critic is None else state_lib.own_state(learner.critic_spec, critic))


def base_fingerprint(learner: Learner) -> str | None:
  """A digest of the learner's shared base (LoRA; None without one): a resume over another base is refused."""
  if learner.base is None:
    return None
  return manager.json_digest(manager.fingerprints(learner.base))


def save_checkpoint(ckpt: manager.Checkpointer, learner: Learner, model_config: Any, config: Any,
                    prompts: PromptSource) -> None:
  """Saves `learner`'s state, every process's prompt position and the run's flat config at the learner's step."""
  policy, critic = _weights(learner)
  ckpt.save(manager.CheckpointState(
      step=learner.step, policy=policy, critic=critic, optimizer=_optimizer_item(learner.state),
      data={'prompts': prompts.state(), 'prompts_by_process': _all_process_states(prompts.state())},
      metadata=manager.policy_metadata(model_config, config=flat_config(config), version=learner.step,
                                       base_fingerprint=base_fingerprint(learner))),
      force=True)


def restore_checkpoint(ckpt: manager.Checkpointer, learner: Learner, config: Any, prompts: PromptSource, *,
                       defaults: Any) -> int:
  """Restores the newest intact checkpoint into `learner` and `prompts`; returns its step.

  `defaults`: every knob at its default (`config_lib.defaults()`), for `config_differences`.

  Raises:
    ConfigError: the checkpoint's run had another config (the differing fields named), unless
      `config.trainer.allow_config_change`.
  """
  state = learner.state
  policy, critic = _weights(learner)
  target = manager.CheckpointState(
      step=0, policy=manager.abstract_target(policy),
      critic=None if critic is None else manager.abstract_target(critic),
      optimizer=manager.abstract_target(_optimizer_item(state)))
  # The newest intact step; a damaged newer one is reported and moved aside (the steps after it are retrained).
  got = ckpt.restore(None, target=target, set_aside_damaged=True)
  step = int(got.step)
  _check_saved_config((got.metadata or {}).get('config', {}), step, config, defaults, log=True)
  saved_base = (got.metadata or {}).get('base_fingerprint')
  if saved_base != base_fingerprint(learner):
    raise ConfigError(f'config.workdir={config.workdir!r} holds a checkpoint (step {step}) whose LoRA adapters were '
                      'trained over another base model (the base weights\' fingerprints differ): resume over the '
                      'same config.model.hf_dir (and seed), or use a fresh --workdir.')
  policy = _restore_train_state(learner.policy_spec, state.policy, learner.base, got.policy,
                                got.optimizer['policy'])
  critic_ts = None
  if state.critic is not None:
    critic_ts = _restore_train_state(learner.critic_spec, state.critic, learner.base, got.critic,
                                     got.optimizer['critic'])
  learner.state = state_lib.LearnerState(policy=policy, critic=critic_ts, step=got.optimizer['learner_step'])
  by_process = got.data.get('prompts_by_process') or [got.data['prompts']]
  if len(by_process) != jax.process_count():
    raise ConfigError(f'The checkpoint of step {step} holds the data positions of {len(by_process)} process(es); '
                      f'this run has {jax.process_count()} (config.distributed.num_processes).')
  prompts.restore(by_process[jax.process_index()])
  logging.info('Resumed from step %d (%d prompts taken so far).', step, prompts.taken)
  return step


def _check_saved_config(saved: dict[str, Any], step: int, config: Any, defaults: Any, *, log: bool) -> None:
  """Refuses (`ConfigError`, the differing fields named) a config that differs from the checkpoint's run's, unless
  `config.trainer.allow_config_change` (then, with `log`, a warning names them)."""
  diff = config_differences(saved, config, defaults)
  if diff and not config.trainer.allow_config_change:
    now = flat_config(config)
    detail = '; '.join(f'{k}: {saved.get(k)!r} -> {now.get(k)!r}' for k in diff[:10])
    raise ConfigError(f'config.workdir={config.workdir!r} holds a checkpoint (step {step}) of a run with another '
                      f'config ({detail}). Use a fresh --workdir, or set --config.trainer.allow_config_change=True.')
  if diff and log:
    logging.warning('Resuming step %d with a changed config (allowed): %s', step, diff)


def check_resume_config(checkpoint_dir: str, config: Any, *, defaults: Any) -> int | None:
  """The resume's config check before anything is built: the newest step whose saved config reads (its
  `metadata` JSON, read as a file: no orbax, no device) is compared with `config` (`ConfigError` as
  `restore_checkpoint` raises). Returns that step, or None when the directory holds no readable one (a fresh run;
  a damaged step is left for `restore_checkpoint` to report)."""
  if not paths.isdir(checkpoint_dir):
    return None
  for step in sorted((int(n) for n in paths.listdir(checkpoint_dir) if n.isdigit()), reverse=True):
    try:
      meta = json.loads(paths.read_text(paths.join(checkpoint_dir, str(step), 'metadata', 'metadata')))
      saved = meta['config']
    except (OSError, ValueError, KeyError, TypeError):
      continue
    _check_saved_config(saved, step, config, defaults, log=False)
    return step
  return None


def _all_process_states(state: dict[str, Any]) -> list[dict[str, Any]]:
  """Every process's JSON-able `state`, in process order, on every process (one small all-gather; one process:
  `[state]`). Checkpoints keep them all: the JSON items are written by process 0 only."""
  if jax.process_count() == 1:
    return [state]
  data = json.dumps(state).encode()
  size = int(np.max(multihost_utils.process_allgather(np.int32(len(data)))))
  buf = np.zeros((size,), np.uint8)
  buf[:len(data)] = np.frombuffer(data, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(jax.process_count(), size)
  return [json.loads(bytes(r).rstrip(b'\0').decode()) for r in rows]

