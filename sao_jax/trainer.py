"""The actor-learner loop: `run(config)` trains a policy with SAO (or a baseline) and returns its summary.

    python -m sao_jax.main --config=configs/arith.py --workdir=/tmp/sao_run

One flat function in sections, as big_vision's train.py: task and model -> learner -> checkpoint (resume) ->
actors -> loop -> final eval and save. The pieces (docs/design.md, Data flow):

- actors (`sao_jax.rollout.actor`): `sampler.num_threads` threads in `trainer.mode='async'`, each with its own
  KV-cache sampler, play whole episodes with the newest published weights and put finished trajectories (one,
  or one prompt's whole group) into the bounded `TrajectoryQueue`; in `'sync'` mode the loop itself plays the
  batch with the current weights, then updates (the same actor, no thread);
- the learner draws `trainer.batch_size` trajectories (stale ones dropped and counted by the queue), packs them
  (`rollout.pack`: bucketed lengths, unbootstrappable truncations dropped and counted) and runs one jitted
  update; the policy version is the learner step; the new weights are published after every update;
- every `trainer.checkpoint_every` steps and at the end: learner state, data position and the run's config
  (`checkpoint.Checkpointer`); a workdir that holds a checkpoint resumes from it (a changed config is refused
  with the differing fields named unless `trainer.allow_config_change`);
- `WORKDIR/metrics.jsonl` (one row per step, exactly once across resumes), TensorBoard, a progress line;
- SIGTERM / SIGINT finish the current step, save and return.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from typing import Any

from absl import logging
import numpy as np
from flax import nnx

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import config_lib
from sao_jax import eval as eval_lib
from sao_jax import metrics as metrics_lib
from sao_jax import models
from sao_jax import parallel
from sao_jax import rollout
from sao_jax.envs import registry
from sao_jax.errors import ConfigError
from sao_jax.learner import Learner
from sao_jax.learner import state as state_lib
from sao_jax.learner import steps as steps_lib
from sao_jax.models.sampling import SamplingParams
from sao_jax.rollout import actor as actor_lib
from sao_jax.rollout import trajectory_queue
from sao_jax.tokenizers import get_tokenizer

# Config fields that may differ between a run and the checkpoint it resumes from.
RESUMABLE_CHANGES = ('workdir', 'trainer.num_steps', 'trainer.allow_config_change', 'trainer.log_every',
                     'trainer.eval_every', 'trainer.checkpoint_every', 'trainer.export_hf')


# ------------------------------------------------------------------------------------------------------------
# Config <-> checkpoint.


def _flat(config: Any) -> dict[str, Any]:
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


def config_differences(saved: dict[str, Any], config: Any) -> list[str]:
  """Fields (dotted paths) whose value differs between a saved flat config and `config`, minus the
  fields a resume may change (`RESUMABLE_CHANGES`)."""
  now = _flat(config)
  keys = sorted(set(saved) | set(now))
  return [k for k in keys if k not in RESUMABLE_CHANGES and saved.get(k) != now.get(k)]


def _optimizer_item(state: steps_lib.LearnerState) -> dict[str, Any]:
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


def _restore_train_state(spec: state_lib.ModelSpec, ts: state_lib.TrainState, weights: Any,
                         opt: dict[str, Any]) -> state_lib.TrainState:
  model = state_lib.merge(spec, ts)
  nnx.update(model, weights)
  _, params, rest = nnx.split(model, spec.trainable, ...)
  return state_lib.TrainState(params, rest, opt['opt_state'], opt['step'], opt['skipped'],
                              opt['consecutive_skips'])


def save_checkpoint(ckpt: checkpoint_lib.Checkpointer, learner: Learner, model_config: Any, config: Any,
                    prompts: actor_lib.PromptSource) -> None:
  state = learner.state
  critic = learner.critic_model()
  ckpt.save(checkpoint_lib.CheckpointState(
      step=learner.step, policy=nnx.state(learner.policy_model()),
      critic=None if critic is None else nnx.state(critic), optimizer=_optimizer_item(state),
      data={'prompts': prompts.state()},
      metadata=checkpoint_lib.policy_metadata(model_config, config=_flat(config), version=learner.step)),
      force=True)


def restore_checkpoint(ckpt: checkpoint_lib.Checkpointer, learner: Learner, config: Any,
                       prompts: actor_lib.PromptSource) -> int:
  """Restores the newest intact checkpoint into `learner` and `prompts`; returns its step.

  Raises:
    ConfigError: the checkpoint's run had another config (the differing fields named), unless
      `config.trainer.allow_config_change`.
  """
  state = learner.state
  critic = learner.critic_model()
  target = checkpoint_lib.CheckpointState(
      step=0, policy=checkpoint_lib.abstract_target(nnx.state(learner.policy_model())),
      critic=None if critic is None else checkpoint_lib.abstract_target(nnx.state(critic)),
      optimizer=checkpoint_lib.abstract_target(_optimizer_item(state)))
  got = ckpt.restore(None, target=target)  # The newest intact step (a damaged newer one is reported, skipped).
  step = int(got.step)
  saved = (got.metadata or {}).get('config', {})
  diff = config_differences(saved, config)
  if diff and not config.trainer.allow_config_change:
    now = _flat(config)
    detail = '; '.join(f'{k}: {saved.get(k)!r} -> {now.get(k)!r}' for k in diff[:10])
    raise ConfigError(f'config.workdir={config.workdir!r} holds a checkpoint (step {step}) of a run with another '
                      f'config ({detail}). Use a fresh --workdir, or set --config.trainer.allow_config_change=True.')
  if diff:
    logging.warning('Resuming step %d with a changed config (allowed): %s', step, diff)
  policy = _restore_train_state(learner.policy_spec, state.policy, got.policy, got.optimizer['policy'])
  critic_ts = None
  if state.critic is not None:
    critic_ts = _restore_train_state(learner.critic_spec, state.critic, got.critic, got.optimizer['critic'])
  learner.state = steps_lib.LearnerState(policy=policy, critic=critic_ts, step=got.optimizer['learner_step'])
  prompts.restore(got.data['prompts'])
  logging.info('Resumed from step %d (%d prompts taken so far).', step, prompts.taken)
  return step


# ------------------------------------------------------------------------------------------------------------
# Signals.


class _StopFlag:
  """SIGTERM / SIGINT set a flag; the loop saves at the end of the current step and returns."""

  def __init__(self):
    self.set = False
    self._old = {}

  def install(self) -> None:
    if threading.current_thread() is not threading.main_thread():
      return
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    logging.warning('Received signal %d: finishing this step, then saving and exiting.', signum)
    self.set = True

  def uninstall(self) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}


# ------------------------------------------------------------------------------------------------------------
# The run.


def run(config: Any) -> dict[str, Any]:
  """Trains as `config` says and returns the final summary.

  The config is checked and its algorithm preset resolved here (`config_lib.validate(config, for_run=True)`,
  idempotent); on several processes, `parallel.initialize` must have run first (`sao_jax.main` does it).
  """
  t_start = time.perf_counter()
  config = config_lib.validate(config, for_run=True, log=False)
  tr = config.trainer
  if not config.workdir:
    raise ConfigError("config.workdir='': the trainer needs a work directory (--workdir).")
  os.makedirs(config.workdir, exist_ok=True)

  # ---- Task, tokenizer, mesh, model, learner.
  task = registry.get_task(config.task)
  tokenizer = get_tokenizer(config)
  mesh = parallel.make_mesh(config.mesh)
  policy, model_config = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=int(config.seed))
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(f'config.model: the tokenizer has {tokenizer.vocab_size} tokens but the model only '
                      f'{model_config.vocab_size} embeddings (config.model.tokenizer={config.model.tokenizer!r}).')
  learner = Learner(config, policy=policy, mesh=mesh, model_config=model_config)
  cfg = learner.step_config
  group_size = cfg.group_size
  logging.info('Model %s: %.1fM parameters; algorithm %s (group size %d); mode %s.', model_config.name,
               model_config.num_params() / 1e6, cfg.name, group_size, tr.mode)

  # ---- Checkpoint: resume when the workdir holds one.
  prompts = actor_lib.PromptSource(task.train_iterator(int(config.seed)))
  ckpt = checkpoint_lib.Checkpointer.from_config(config)
  start = 0
  if ckpt.latest_step() is not None:
    start = restore_checkpoint(ckpt, learner, config, prompts)

  # ---- Actors.
  publisher = actor_lib.WeightPublisher()
  publisher.publish(learner.policy_model(), version=learner.step)
  limits = rollout.EpisodeLimits.from_config(config)
  decoding = SamplingParams.from_config(config.sampler)
  episodes_per_call = max(group_size, int(config.sampler.batch_size) // group_size * group_size)

  def make_actor() -> actor_lib.Actor:
    model, version = publisher.latest()
    backend = eval_lib.make_backend(model, tokenizer, task, config, batch_size=episodes_per_call, version=version)
    return actor_lib.Actor(backend, tokenizer, task, prompts, publisher=publisher, limits=limits,
                           decoding=decoding, seed=int(config.seed), group_size=group_size,
                           episodes_per_call=episodes_per_call, weight_switch=str(tr.weight_switch),
                           # Continuous batching (hook added by the `cb` helper, issue 15).
                           continuous=bool(config.sampler.continuous),
                           decode_steps=int(config.sampler.decode_steps))

  queue = trajectory_queue.TrajectoryQueue(
      int(tr.queue_size), group_size=group_size, max_staleness=int(tr.max_staleness),
      dynamic_sampling=bool(config.algo.dynamic_sampling))
  threads: list[actor_lib.ActorThread] = []
  sync_actor = None
  if tr.mode == 'async':
    for i in range(int(config.sampler.num_threads)):
      threads.append(actor_lib.ActorThread(make_actor(), queue, index=i))
      threads[-1].start()
  else:
    sync_actor = make_actor()
  restarts = 0
  actor_tokens = metrics_lib.RateMeter()  # Generated (action) tokens of all actors, per second.

  def actors() -> list[actor_lib.Actor]:
    return [sync_actor] if sync_actor is not None else [th.actor for th in threads]

  def check_actors() -> None:
    nonlocal restarts
    for i, th in enumerate(threads):
      if th.is_alive():
        continue
      restarts += 1
      if restarts > 3 * len(threads):
        raise RuntimeError(f'Actor threads keep failing ({restarts} restarts); last error: {th.error!r}') \
            from th.error
      logging.warning('Restarting %s (it stopped: %r).', th.name, th.error)
      threads[i] = actor_lib.ActorThread(th.actor, queue, index=i)
      threads[i].start()

  # ---- Eval.
  eval_backend = None

  def evaluate(step: int) -> dict[str, float]:
    nonlocal eval_backend
    model = learner.policy_model()
    if eval_backend is None:
      eval_backend = eval_lib.make_backend(model, tokenizer, task, config, version=step)
    summary = eval_lib.evaluate(model, tokenizer, task, config, backend=eval_backend, progress=False,
                                policy_version=step)
    return {'eval_accuracy': summary['greedy_accuracy'], 'eval/greedy_reward': summary['greedy_reward'],
            'eval/truncated_fraction': summary['truncated_fraction']}

  # ---- Loop.
  writer = metrics_lib.MetricsWriter(config.workdir, resume_step=start, tensorboard=bool(tr.tensorboard),
                                     wandb_project=str(tr.wandb_project), config=_flat(config))
  progress = metrics_lib.Progress(int(tr.num_steps), start_step=start)
  stop = _StopFlag()
  stop.install()
  rows = int(tr.batch_size)
  counts = {'dropped_stale': 0, 'dropped_equal_reward': 0, 'dropped_pack': 0}
  trajectories_trained = 0
  first_eval = None
  last_eval = None
  step = start
  try:
    if start == 0 and tr.eval_every:
      first_eval = last_eval = evaluate(0)
      writer.write(0, {**first_eval, 'trajectories': 0})
      logging.info('step 0: eval accuracy %.3f', first_eval['eval_accuracy'])
    while step < int(tr.num_steps) and not stop.set:
      t0 = time.perf_counter()
      # Draw a batch: rows trajectories that pass the staleness filter and pack into the batch.
      trajs: list = []
      staleness: list[int] = []
      wait_s = 0.0
      dropped_pack: collections.Counter[str] = collections.Counter()
      while len(trajs) < rows:
        need = rows - len(trajs)
        if sync_actor is not None:
          tw = time.perf_counter()
          got = actor_lib.play_rows(sync_actor, need)
          wait_s += time.perf_counter() - tw
        else:
          draw = queue.get_batch(need, learner.step, timeout=5.0)
          wait_s += draw.wait_s
          counts['dropped_stale'] += draw.dropped_stale
          counts['dropped_equal_reward'] += draw.dropped_equal_reward
          got = draw.trajectories
          check_actors()
        # Unusable trajectories (env errors, unbootstrappable truncations) are dropped, whole groups at a time.
        kept, dropped = rollout.select(got, group_size=group_size, truncation=cfg.truncation)
        dropped_pack.update(dropped)
        trajs += [got[i] for i in kept]
        staleness += [trajectory_queue.staleness([got[i]], learner.step) for i in kept]
      packed = rollout.pack(trajs, seq_buckets=tuple(tr.seq_buckets), pad_id=tokenizer.pad_id, rows=rows,
                            group_size=group_size, truncation=cfg.truncation)
      counts['dropped_pack'] += sum(dropped_pack.values())
      actor_tokens.add(sum(a.generated_tokens for a in actors()) - actor_tokens.total)
      learner_metrics = learner.update(packed.batch)
      step = learner.step
      publisher.publish(learner.policy_model(), version=step)
      trajectories_trained += rows
      dt = time.perf_counter() - t0
      row = {
          'reward_mean': learner_metrics.get('batch/reward_mean'),
          **{f'learner/{k}': v for k, v in learner_metrics.items()},
          'staleness/mean': float(np.mean(staleness)), 'staleness/max': float(np.max(staleness)),
          'queue/depth': float(len(queue)), 'trajectories': trajectories_trained,
          'dropped/stale': counts['dropped_stale'], 'dropped/equal_reward': counts['dropped_equal_reward'],
          'dropped/pack': counts['dropped_pack'],
          **{f'dropped/pack_{k}': v for k, v in dropped_pack.items()},
          'actor/failures': sum(th.failures for th in threads), 'actor/restarts': restarts,
          'learner/wait_fraction': wait_s / dt if dt > 0 else 0.0, 'perf/step_time_s': dt,
          'learner/tokens_per_s': learner_metrics.get('perf/tokens_per_s'),
          'actor/tokens_per_s': actor_tokens.rate(),
          'learner/version': step,
      }
      if tr.eval_every and (step % int(tr.eval_every) == 0 or step == int(tr.num_steps)):
        last_eval = evaluate(step)
        row.update(last_eval)
      writer.write(step, row)
      if step % int(tr.log_every) == 0 or step == int(tr.num_steps):
        logging.info(progress.line(step, row))
      else:
        progress.line(step, row)
      if tr.checkpoint_every and step % int(tr.checkpoint_every) == 0:
        save_checkpoint(ckpt, learner, model_config, config, prompts)
    if tr.checkpoint_every and step > start and step not in ckpt.all_steps():
      save_checkpoint(ckpt, learner, model_config, config, prompts)  # The last step, or where a signal stopped.
  finally:
    stop.uninstall()
    queue.close()
    for th in threads:
      th.stop()
    for th in threads:
      th.join(timeout=60)
    ckpt.close()
    writer.close()
  if tr.export_hf and not stop.set:
    from sao_jax.models import hf_io  # pylint: disable=g-import-not-at-top
    hf_io.save_hf(learner.policy_model(), model_config, str(tr.export_hf),
                  tokenizer_dir=config.model.hf_dir or None)
  wall = time.perf_counter() - t_start
  summary = {'steps': step, 'trajectories': trajectories_trained, 'wall_s': wall,
             'start_accuracy': None if first_eval is None else first_eval['eval_accuracy'],
             'end_accuracy': None if last_eval is None else last_eval['eval_accuracy'],
             'stopped_by_signal': stop.set}
  logging.info('Run summary: %s', summary)
  return summary
