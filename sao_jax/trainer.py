"""The actor-learner loop: `run(config)` trains a policy with SAO (or a baseline) and returns its summary.

    python -m sao_jax.main --config=configs/arith.py --workdir=/tmp/sao_run

One flat function in sections, as big_vision's train.py: task and model -> learner -> checkpoint (resume) -> warm
start -> actors -> loop -> final eval and save (docs/design.md, Data flow). Rules it keeps:
- async mode: `sampler.num_threads` actor threads play with the newest computed weights and fill the bounded
  queue while the learner updates (the next batch drawn, packed and placed during the update); sync mode plays
  a batch with the current weights, then updates. The policy version is the learner step; new weights are
  published (resharded onto the actors' devices, `mesh.actor_devices`) after every update;
- every trajectory that is not trained on is counted: stale (`dropped/stale`, of which `stale_in_flight` ended
  early by the actors), unbootstrappable (`dropped/pack`), failed env or verifier (`failed/env_error`,
  `failed/env_timeout`, logged with its prompt); `learner/wait_fraction` is the share of time no update ran;
- several processes run the same loop on their own share of the prompts (`ProcessShard`) and local devices, each
  feeding `batch_size / P` rows of every global batch; a signal on any of them stops all at the same step;
- checkpoints (every `trainer.checkpoint_every` steps and at the end) hold the learner state, each process's data
  position and the config; a workdir with one resumes from it (a changed config refused, naming the fields, unless
  `trainer.allow_config_change`); `metrics.jsonl` has every step exactly once across resumes (and `eval/step<N>.jsonl`
  each eval's replies);
- SIGTERM / SIGINT finish the current step (an RL step, a warm-start step, a batch of eval episodes), save and
  return; one run per workdir (`workdir.WorkdirLock`); every start-up refusal comes before the model build; a
  checkpoint save that fails is retried, then stops the run (`RunError`) (docs/design.md, Faults).
"""

from __future__ import annotations

import collections
import json
import math
import signal
import threading
import time
from typing import Any

from absl import logging
import jax
from flax import nnx
import numpy as np

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import config_lib
from sao_jax import eval as eval_lib
from sao_jax import metrics as metrics_lib
from sao_jax import models
from sao_jax import parallel
from sao_jax import paths
from sao_jax import rollout
from sao_jax import sft
from sao_jax import workdir as workdir_lib
from sao_jax.envs import data_check
from sao_jax.envs import registry
from sao_jax.errors import ConfigError
from sao_jax.errors import RunError
from sao_jax.learner import Learner, LearnerConfig
from sao_jax.learner import state as state_lib
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.weights import WeightPublisher
from sao_jax.rollout import actor as actor_lib
from sao_jax.rollout import prompts as prompts_lib
from sao_jax.rollout import trajectory_queue
from sao_jax.tokenizers import get_tokenizer

EVAL_DIR = 'eval'  # <workdir>/eval/step<N>.jsonl: each eval's problems, replies and rewards (`eval.write_outputs`).
SUMMARY_FILE = 'run_summary.json'  # <workdir>/run_summary.json: the last process's summary (steps, why it stopped).
WARM_START_DIR = 'warm_start'  # <workdir>/warm_start: the warm start's own checkpoints and summary (sao_jax/sft.py).

# Running totals of a run's metrics rows (row key -> counter): a resumed run carries them on from its last
# kept row, as it does `time/wall_s`.
CARRIED_TOTALS = {'trajectories': 'trajectories', 'dropped/stale': 'dropped_stale',
                  'dropped/stale_in_flight': 'dropped_stale_in_flight', 'dropped/equal_reward': 'dropped_equal_reward',
                  'dropped/pack': 'dropped_pack', 'failed/env_error': 'env_error',
                  'failed/env_timeout': 'env_timeout'}


# ------------------------------------------------------------------------------------------------------------
# Several processes.


class _DoneClock:
  """When a dispatched learner step finished: a helper thread blocks on its outputs and notes the time, so the
  learner's idle time (between a step's end and the next dispatch) is known while the host draws ahead."""

  def __init__(self):
    self._thread = None
    self._t = 0.0

  def watch(self, outputs: Any) -> None:
    def wait():
      jax.block_until_ready(outputs)
      self._t = time.perf_counter()
    self._thread = threading.Thread(target=wait, name='learner-done', daemon=True)
    self._thread.start()

  def done_at(self) -> float:
    self._thread.join()
    return self._t


def _any_process(flag: bool, name: str = 'stop') -> bool:
  """True on every process when `flag` is set on any (a signal reaching one host stops all at the same step).
  Through the coordination service (`parallel.process_max`), never behind programs running on the devices."""
  if jax.process_count() == 1:
    return flag
  return bool(parallel.process_max(name, int(flag)))


# ------------------------------------------------------------------------------------------------------------
# Batches.


def _pack_batch(trajs: list, tr: Any, *, pad_id: int, rows: int, group_size: int, truncation: str,
                row_multiple: int) -> rollout.Packed:
  """This process's trajectories packed as its part of one global batch (`config.trainer.pack`).

  Every process's part has the same shape. Unpacked: `rows` rows of the smallest bucket that holds every process's
  longest trajectory. Packed: each process plans its rows; the processes agree on the longest row length, re-plan
  at that length, and take the largest row count (a multiple of `row_multiple`), empty rows filling the rest.
  Group ids (each process numbers its own prompts) become `id * processes + process index`: the group baselines
  group by id over the global batch.
  """
  buckets = tuple(int(b) for b in tr.seq_buckets)
  processes = jax.process_count()
  if tr.pack == 'none':
    if processes > 1:  # One global batch, one length: the smallest bucket that fits every process's rows.
      longest = parallel.process_max('batch_length', max(len(t.tokens) for t in trajs))
      buckets = tuple(b for b in buckets if b >= longest) or buckets  # (None fits: pack names the long row.)
    packed = rollout.pack(trajs, seq_buckets=buckets, pad_id=pad_id, rows=rows, group_size=group_size,
                          truncation=truncation)
  else:
    plan = dict(seq_buckets=buckets, packing=tr.pack, segments=int(tr.pack_segments), row_multiple=row_multiple,
                pack_len=int(tr.pack_len))
    packed_rows = None
    if processes > 1:
      lengths = [len(t.tokens) for t in trajs]
      _, seq_len, _ = rollout.plan_packing(lengths, **plan)
      plan.update(packing='fixed', pack_len=parallel.process_max('pack_length', seq_len))
      packed_rows = parallel.process_max('pack_rows', rollout.plan_packing(lengths, **plan)[0])
    packed = rollout.pack(trajs, pad_id=pad_id, rows=packed_rows, group_size=group_size, truncation=truncation,
                          **plan)
  if processes == 1:
    return packed
  ids = packed.batch.group_ids
  unique = np.where(ids >= 0, ids * processes + jax.process_index(), ids).astype(ids.dtype)
  return packed._replace(batch=packed.batch.replace(group_ids=unique))


# ------------------------------------------------------------------------------------------------------------
# Failed episodes.


def _log_failures(trajectories: list) -> list[str]:
  """Logs each trajectory whose env or verifier failed (`info['error']`, set by the episode runner's guarded
  env step), with its prompt; returns one kind per failure: 'env_timeout' (a step or a verifier past its time
  limit) or 'env_error' (anything else). Such trajectories carry no reward and `rollout.select` drops them."""
  kinds = []
  for t in trajectories:
    error = t.info.get('error')
    if error is None:
      continue
    kinds.append('env_timeout' if 'timeout' in str(error).split(':')[0] else 'env_error')
    logging.warning('Episode of prompt %s (uid %s) failed, dropped: %s', t.info.get('prompt_number'),
                    t.info.get('uid'), error)
  return kinds


# ------------------------------------------------------------------------------------------------------------
# Signals.


class _StopFlag:
  """SIGTERM / SIGINT set a flag; the run saves at the end of the current step (a warm-start step, a batch of eval
  episodes) and returns.

  `run` installs it first thing, before the (long) model build, compilation, resume and warm start: a signal
  then stops the run at its first step check. It must not wait for the loop: `jax.distributed.initialize`
  installs jax's preemption notifier, which catches SIGTERM only to record it for jax's preemption sync point
  (unused here), so a multi-process run ignored SIGTERM until its loop started (a warm start or a long compile:
  minutes). The flag is read at step boundaries (RL steps, warm-start steps, eval batches), through `_any_process`:
  every process stops at the same one.
  """

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

  def any_process(self) -> bool:
    """Whether a signal reached any process (a collective when there are several: same calls on every one)."""
    return _any_process(self.set)

  def uninstall(self) -> None:
    for sig, old in self._old.items():
      signal.signal(sig, old)
    self._old = {}


# ------------------------------------------------------------------------------------------------------------
# The run.


def run(config: Any, *, validated: bool = False) -> dict[str, Any]:
  """Trains as `config` says and returns the final summary.

  The config is checked and its algorithm preset resolved here (`config_lib.validate(config, for_run=True)`),
  unless `validated`: `config` is already that call's result (`sao_jax.main` validates before the run, to fail
  with a one-line error, and passes it on: validated once). On several processes, `parallel.initialize` must
  have run first (`sao_jax.main` does it). SIGTERM / SIGINT from the start of the call on: the run stops at its
  next step boundary (`_StopFlag`).
  """
  stop = _StopFlag()
  stop.install()
  precision = jax.config.jax_default_matmul_precision  # _run sets the run's (config.model.matmul_precision).
  try:
    return _run(config, stop, validated=validated)
  finally:
    stop.uninstall()
    jax.config.update('jax_default_matmul_precision', precision)


def _run(config: Any, stop: _StopFlag, *, validated: bool) -> dict[str, Any]:
  t_start = time.perf_counter()
  if not validated:
    config = config_lib.validate(config, for_run=True, log=False)
  if not config.workdir:
    raise ConfigError("config.workdir='': the trainer needs a work directory (--workdir).")
  # Every start-up refusal comes before the model build, in one line: a workdir this run cannot write (checked by
  # `validate(for_run=True)`), one that another run holds, a checkpoint (or a warm start's state) of a run with
  # another config.
  lock = workdir_lib.WorkdirLock.for_run(config.workdir)  # Before this run writes anything there.
  try:
    defaults = config_lib.defaults()
    checkpoint_lib.check_resume_config(checkpoint_lib.CheckpointConfig.from_config(config).directory, config,
                                       defaults=defaults)
    checkpoint_lib.check_resume_config(paths.join(config.workdir, WARM_START_DIR, sft.STATE_DIR), config,
                                       defaults=defaults)
    return _train(config, stop, t_start)
  finally:
    lock.release()


def _train(config: Any, stop: _StopFlag, t_start: float) -> dict[str, Any]:
  # Process-wide, not a `with` block: the actors' threads trace their programs too (jax's contexts are per thread).
  jax.config.update('jax_default_matmul_precision', config.model.matmul_precision)
  tr = config.trainer
  paths.makedirs(config.workdir)  # A local directory or a URI (gs://bucket/run): every file goes through `paths`.

  # ---- Task, tokenizer, mesh, model, learner.
  task = registry.get_task(config.task)
  tokenizer = get_tokenizer(config)
  data_check.check_task_data(config, task, tokenizer)  # Rows the run cannot use: dropped, named, counted.
  learner_devices, actor_devices = parallel.split_devices(config.mesh)
  mesh = parallel.make_mesh(config.mesh, learner_devices)
  actor_mesh = None if actor_devices is None else parallel.make_actor_mesh(actor_devices)
  logging.info('Learner mesh %s on %d device(s); actors %s.', dict(mesh.shape), len(learner_devices),
               "share the learner's mesh" if actor_mesh is None else
               f'on their own mesh {dict(actor_mesh.shape)} (devices {[d.id for d in actor_devices]})')
  policy, model_config = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=int(config.seed))
  if tokenizer.vocab_size > model_config.vocab_size:
    raise ConfigError(f'config.model: the tokenizer has {tokenizer.vocab_size} tokens but the model only '
                      f'{model_config.vocab_size} embeddings (config.model.tokenizer={config.model.tokenizer!r}).')
  learner = Learner(LearnerConfig.from_config(config), policy=policy, mesh=mesh, model_config=model_config)
  del policy  # The learner placed its own copy (and, with LoRA, its base): the built arrays can go now.
  cfg = learner.step_config
  group_size = cfg.group_size
  if int(tr.batch_size) % (jax.process_count() * group_size):
    raise ConfigError(f'config.trainer.batch_size={tr.batch_size}: each of the {jax.process_count()} process(es) '
                      f'feeds its own rows in whole groups of {group_size}; it must be a multiple of '
                      f'{jax.process_count() * group_size}.')
  adapters = state_lib.num_elements(learner.state.policy.params) if learner.lora else 0
  logging.info('Model %s: %.1fM parameters%s; algorithm %s (group size %d); mode %s.', model_config.name,
               model_config.num_params() / 1e6,
               f', LoRA rank {model_config.lora_rank} ({adapters / 1e6:.2f}M trained)' if adapters else '',
               cfg.name, group_size, tr.mode)
  if jax.process_count() > 1 and tr.pack == 'none':
    # Every bucket length's update compiled now, not inside `Learner.dispatch`: the first update (the first
    # collective of the learner's devices) then starts right after the loop's `parallel.sync('step')` on every
    # process, however uneven the compiles were (gloo's 30 s window, `parallel.sync`).
    learner.compile_update(int(tr.batch_size), tuple(tr.seq_buckets))

  # ---- Checkpoint: resume when the workdir holds one.
  stream = task.train_iterator(int(config.seed))
  if jax.process_count() > 1:
    stream = prompts_lib.ProcessShard(stream, jax.process_index(), jax.process_count())
  prompts = prompts_lib.PromptSource(stream)
  # After uneven compile work. Orbax's first barrier, a restore's fingerprints and a warm start run collectives
  # next: the handshake sets up the learner devices' (and the process gathers') gloo contexts first.
  parallel.sync('checkpointer', meshes=(mesh,))
  ckpt = checkpoint_lib.Checkpointer.from_settings(checkpoint_lib.CheckpointConfig.from_config(config))
  start = 0
  warm_dir = paths.join(config.workdir, WARM_START_DIR)
  if ckpt.latest_step() is not None:
    start = checkpoint_lib.restore_checkpoint(ckpt, learner, config, prompts, defaults=config_lib.defaults())
    state_dir = paths.join(warm_dir, sft.STATE_DIR)
    if parallel.is_main_process() and paths.isdir(state_dir):  # Superseded by the RL checkpoint (its summary stays).
      logging.info('Removing the warm start state %s: the run resumes from RL step %d.', state_dir, start)
      paths.rmtree(state_dir, missing_ok=True)

  def stopped_early(phase: str) -> dict[str, Any]:
    ckpt.close()
    task.close()
    logging.warning('Stopped by a signal during %s; the same command resumes the run.', phase)
    return {'steps': start, 'trajectories': 0, 'wall_s': time.perf_counter() - t_start, 'start_accuracy': None,
            'end_accuracy': None, 'stopped_by_signal': True, 'generated_tokens': 0, 'tokens_per_s': 0.0}

  # ---- Supervised warm start (config.sft, sao_jax/sft.py): a fresh run only, before the actors start; resumable
  # (its own checkpoints in <workdir>/warm_start). Its metrics (eval accuracy before / after it, losses) go into the
  # step-0 row and the run summary.
  warm = {}
  if stop.any_process():
    return stopped_early('the start-up')
  if start == 0 and int(config.sft.steps) > 0:
    warm = sft.warm_start(learner, task, tokenizer, sft.SftConfig.from_config(config), evaluate=bool(tr.eval_every),
                          directory=warm_dir, should_stop=stop.any_process, config=config)
    if warm is None:
      return stopped_early('the warm start')

  # ---- Actors.
  publisher = WeightPublisher(actor_mesh, config.mesh.rules)
  publisher.publish(learner.policy_model(), version=learner.step)
  limits = rollout.EpisodeLimits.from_config(config)
  settings = GenerateConfig.from_config(config)
  # The slot cache's keys and values: kv heads split over the actors' devices as the weights' are (a cache
  # placed explicitly keeps every slot program at one compile, `SlotSampler`'s `cache_sharding`).
  actors_mesh = mesh if actor_mesh is None else actor_mesh
  cache_sharding = jax.sharding.NamedSharding(actors_mesh, parallel.logical_to_spec(
      (None, 'kv_heads'), (settings.episodes_per_call(group_size), model_config.num_kv_heads), actors_mesh,
      config.mesh.rules, name="the actors' slot cache"))

  def make_actor() -> actor_lib.Actor:
    engine = actor_lib.make_engine(publisher, tokenizer, task, settings, group_size=group_size,
                                   cache_sharding=cache_sharding)
    # Async: episodes bound to come back too stale end in flight (counted), and newer weights are taken once
    # their update has run (the actors never wait for it).
    return actor_lib.Actor(engine, tokenizer, task, prompts, publisher=publisher, settings=settings, limits=limits,
                           seed=int(config.seed), group_size=group_size,
                           step_timeout_s=float(config.task.step_timeout_s) or None,
                           max_staleness=int(tr.max_staleness) if tr.mode == 'async' else None,
                           wait_for_weights=tr.mode != 'async')

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
  eval_config = eval_lib.EvalConfig.from_config(config)
  eval_batch = int(tr.eval_batch_size) or None  # (None: the sampler's batch size.)

  def evaluate(step: int) -> dict[str, float] | None:
    """The eval row values at `step`; None when a signal stopped it (within one batch of episodes)."""
    nonlocal eval_backend
    t_eval = time.perf_counter()
    model, _ = publisher.latest()  # On the actors' devices (this process's own, on several processes).
    if eval_backend is None:
      eval_backend = rollout.make_backend(model, tokenizer, task, settings, batch_size=eval_batch, version=step)
    try:
      summary = eval_lib.evaluate(model, tokenizer, task, eval_config, backend=eval_backend, progress=False,
                                  version=step, batch_size=eval_batch, should_stop=stop.any_process,
                                  output=paths.join(config.workdir, EVAL_DIR, f'step{step}.jsonl'))
    except eval_lib.Interrupted as e:
      logging.warning('Eval at step %d stopped by a signal (%s).', step, e)
      return None
    finally:
      eval_seconds[0] += time.perf_counter() - t_eval
    return {'eval_accuracy': summary['greedy_accuracy'], 'eval/greedy_reward': summary['greedy_reward'],
            'eval/truncated_fraction': summary['truncated_fraction']}

  def eval_due(step: int, last: bool = False) -> bool:
    return bool(tr.eval_every) and (step % int(tr.eval_every) == 0 or step == int(tr.num_steps) or last)

  # ---- Loop.
  # A fresh run (no checkpoint) drops every row an earlier attempt wrote: each step's row is written exactly once.
  writer = metrics_lib.MetricsWriter(config.workdir, resume_step=start if start else -1,
                                     tensorboard=bool(tr.tensorboard), wandb_project=str(tr.wandb_project),
                                     config=checkpoint_lib.flat_config(config))
  progress = metrics_lib.Progress(int(tr.num_steps), start_step=start)
  # `time/wall_s` of a row: seconds since the run began, summed over a resumed run's earlier processes (the last
  # kept row's value carries on), so curves can be drawn against wall time across a kill and resume; so do the
  # run's running totals (`CARRIED_TOTALS`: trajectories trained, dropped, failed).
  kept_rows = metrics_lib.read_metrics(config.workdir) if start else []
  carried = lambda key: next((r[key] for r in reversed(kept_rows) if r.get(key) is not None), 0)
  wall_before = float(carried('time/wall_s'))
  eval_seconds = [float(carried('time/eval_s'))]  # Spent in evals, over the run's processes (`evaluate` adds).

  def wall_s() -> float:
    return wall_before + time.perf_counter() - t_start

  max_train_s = 60.0 * float(tr.max_train_minutes)

  def budget_spent() -> bool:
    """The run's training time (its wall time less its evals) reached `trainer.max_train_minutes`, on any process."""
    return bool(max_train_s) and _any_process(wall_s() - eval_seconds[0] >= max_train_s, 'time_budget')

  rows = int(tr.batch_size) // jax.process_count()  # This process's rows of each global batch.
  # Packed: the global row count splits into data shards x minibatches x microbatches (`steps.split_sizes`).
  splits = parallel.batch_divisor(mesh) * cfg.minibatches * cfg.microbatches
  row_multiple = splits // math.gcd(splits, jax.process_count())
  counts = {kind: int(carried(key)) for key, kind in CARRIED_TOTALS.items()}
  in_flight_seen = 0  # Of this process's actors (their counter starts at 0 here).
  trajectories_trained = counts.pop('trajectories')
  first_eval = last_eval = None
  step = start
  stopped = False
  out_of_time = False
  save_retries, save_retry_s = int(tr.save_retries), float(tr.save_retry_s)

  def save(final: bool = False) -> None:
    """A checkpoint of the learner's step, committed or retried: a failed save (its own error, or the previous
    async save's surfacing now) is tried again, synchronously, after save_retry_s, 2 save_retry_s, ...; past
    `trainer.save_retries` the run stops (`RunError`). Every process agrees on each outcome. `final`: waited for
    (the run's last save is committed before it returns)."""
    for attempt in range(save_retries + 1):
      error = None
      try:
        writer.flush()  # The rows up to the checkpoint are in the workdir first (a remote one's: uploaded).
        if learner.step not in ckpt.all_steps():
          checkpoint_lib.save_checkpoint(ckpt, learner, model_config, config, prompts)
        if attempt or final:
          ckpt.wait()
      except RunError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (orbax / tensorstore / the OS raise anything)
        error = e
      if not _any_process(error is not None, 'save_failed'):
        return
      what = f'{type(error).__name__}: {str(error).splitlines()[0][:300]}' if error else 'on another process'
      if attempt == save_retries:
        raise RunError(f'Checkpoint of step {learner.step} could not be saved in {ckpt.directory} '
                       f'({attempt + 1} tries): {what}') from error
      wait_s = save_retry_s * 2 ** attempt
      logging.error('A checkpoint save failed (%s); saving step %d again in %.0fs (retry %d of %d).', what,
                    learner.step, wait_s, attempt + 1, save_retries)
      time.sleep(wait_s)
      ckpt.remove_interrupted_saves()

  def check_saves() -> None:
    """An async save that failed since the last step is taken again now (`save`)."""
    error = None
    try:
      ckpt.check()
    except Exception as e:  # pylint: disable=broad-except
      error = e
    if _any_process(error is not None, 'save_check'):
      logging.error('An earlier checkpoint save failed (%s): saving step %d now.', error, learner.step)
      ckpt.remove_interrupted_saves()
      save()

  try:
    if start and eval_due(start) and kept_rows and kept_rows[-1].get('step') == start \
        and 'eval_accuracy' not in kept_rows[-1]:
      # A signal stopped the eval of the restored step: its row was written without it; evaluated and filled in now.
      last_eval = evaluate(start)
      if last_eval is None:
        stopped = True
      else:
        writer.update(start, last_eval)
    if start == 0 and tr.eval_every:
      first_eval = last_eval = evaluate(0)
      if first_eval is None:
        stopped = True  # Nothing written: the rerun evaluates step 0 again (the warm start's state is kept).
      else:
        writer.write(0, {**first_eval, 'trajectories': 0, **warm, 'time/wall_s': wall_s()})
        logging.info('step 0: eval accuracy %.3f', first_eval['eval_accuracy'])

    def draw(version: int) -> tuple[rollout.Packed, list[int], float, collections.Counter[str], dict[str, float]]:
      """`rows` trajectories that pass the staleness filter (for a step at `version`), packed; with their
      staleness, the time waited for them, what was dropped, and their episodes' mean timing."""
      nonlocal in_flight_seen
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
          got_draw = queue.get_batch(need, version, timeout=5.0)
          wait_s += got_draw.wait_s
          counts['dropped_stale'] += got_draw.dropped_stale
          ended = sum(a.dropped_stale for a in actors())  # Ended in flight, bound to be stale (continuous).
          counts['dropped_stale'] += ended - in_flight_seen
          counts['dropped_stale_in_flight'] += ended - in_flight_seen
          in_flight_seen = ended
          counts['dropped_equal_reward'] += got_draw.dropped_equal_reward
          got = got_draw.trajectories
          check_actors()
        # Unusable trajectories (env errors, unbootstrappable truncations) are dropped, whole groups at a time.
        kept, dropped = rollout.select(got, group_size=group_size, truncation=cfg.truncation)
        for kind in _log_failures(got):
          counts[kind] += 1
        dropped_pack.update(dropped)
        trajs += [got[i] for i in kept]
        staleness += [trajectory_queue.staleness([got[i]], version) for i in kept]
      packed = _pack_batch(trajs, tr, pad_id=tokenizer.pad_id, rows=rows, group_size=group_size,
                           truncation=cfg.truncation, row_multiple=row_multiple)
      if jax.process_count() > 1 and tr.pack != 'none':  # A new packed shape compiles before the step's sync.
        local_rows, seq_len = packed.batch.shape
        learner.compile_update(local_rows * jax.process_count(), (seq_len,), packed.batch.num_segments)
      counts['dropped_pack'] += sum(dropped_pack.values())
      # Episode timing of the batch (the loop benchmark's calibration of sao_jax.sim reads these).
      timing = {'episode/generate_s': float(np.mean([t.generate_seconds for t in trajs])),
                'episode/env_s': float(np.mean([t.env_seconds for t in trajs]))}
      return packed, staleness, wait_s, dropped_pack, timing

    # Async mode prefetches: the next batch is drawn, packed and placed while the update runs (JAX dispatch is
    # asynchronous; nothing blocks on the step's results before that). Sync mode draws after each update: its
    # batches come from the newest weights.
    prefetch = sync_actor is None and bool(tr.prefetch)
    done_clock = _DoneClock()
    last_done = last_dispatch = time.perf_counter()
    upcoming = None
    out_of_time = bool(start) and budget_spent()  # (Checked after each step: a fresh run makes at least one.)
    while not stopped and not out_of_time and step < int(tr.num_steps) and not (stopped := stop.any_process()):
      if upcoming is None:
        upcoming = draw(step)
      packed, staleness, wait_s, dropped_pack, timing = upcoming
      upcoming = None
      parallel.sync('step')  # After each process's own draw (the first one compiles its samplers).
      actor_tokens.add(sum(a.generated_tokens for a in actors()) - actor_tokens.total)
      t_dispatch = time.perf_counter()
      idle_s = max(0.0, t_dispatch - last_done)  # No update ran since the previous one finished.
      idle = idle_s / max(t_dispatch - last_dispatch, 1e-9)
      pending = learner.dispatch(packed.batch)
      done_clock.watch(pending[2:])  # The step's metrics and counters (ready when it has run).
      step += 1  # The policy version once this update lands (host-side: reading the device step would block).
      out_of_time = budget_spent()  # Then this step is the last: evaluated and checkpointed.
      if prefetch and step < int(tr.num_steps) and not out_of_time:
        upcoming = draw(step)
        upcoming = (upcoming[0]._replace(batch=learner.put_batch(upcoming[0].batch)), *upcoming[1:])
      learner_metrics = learner.collect(pending)
      # Published once the update has run on every device (`collect` reads replicated metrics from one): the
      # copy is not allocated beside the update's temporaries, so chips the actors share hold one published
      # version during an update (docs/design.md, Devices). The actors take computed versions only: they see
      # it no later than before.
      policy = learner.policy_model()
      jax.block_until_ready(nnx.state(policy))
      publisher.publish(policy, version=step)
      task.set_step(step)  # Step-scheduled tasks (drift with unit='steps') move on with the learner.
      last_done = done_clock.done_at()
      dt, last_dispatch = t_dispatch - last_dispatch, t_dispatch
      trajectories_trained += int(tr.batch_size)
      row = {
          'reward_mean': learner_metrics.get('batch/reward_mean'),
          **{f'learner/{k}': v for k, v in learner_metrics.items()},
          'staleness/mean': float(np.mean(staleness)), 'staleness/max': float(np.max(staleness)),
          'queue/depth': float(len(queue)), 'trajectories': trajectories_trained,
          'dropped/stale': counts['dropped_stale'], 'dropped/stale_in_flight': counts['dropped_stale_in_flight'],
          'dropped/equal_reward': counts['dropped_equal_reward'],
          'dropped/pack': counts['dropped_pack'],
          **{f'dropped/pack_{k}': v for k, v in dropped_pack.items()},
          'failed/env_error': counts['env_error'], 'failed/env_timeout': counts['env_timeout'],
          'actor/failures': sum(th.failures for th in threads), 'actor/restarts': restarts,
          'learner/wait_fraction': idle, 'queue/wait_s': wait_s, 'perf/step_time_s': dt,
          'learner/tokens_per_s': learner_metrics.get('perf/tokens_per_s'),
          'actor/tokens_per_s': actor_tokens.rate(),
          'learner/version': step,
          # The rest of the step's time: the previous update ran (dispatch to done). Not dt - wait_s: with prefetch
          # the queue wait overlaps the update, and that difference is only the host's own time.
          **timing, 'learner/busy_s': dt - idle_s,
          **task.metrics(),  # E.g. drift/phase.
      }
      if eval_due(step, last=out_of_time):
        now = evaluate(step)  # (None: a signal stopped it; the resumed run evaluates this step and fills its row.)
        if now is not None:
          last_eval = now
          row.update(now)
      row['time/wall_s'] = wall_s()
      row['time/eval_s'] = eval_seconds[0]
      writer.write(step, row)
      time_left = max_train_s - (wall_s() - eval_seconds[0]) if max_train_s else None
      if step % int(tr.log_every) == 0 or step == int(tr.num_steps):
        logging.info(progress.line(step, row, time_left))
      else:
        progress.line(step, row, time_left)
      if tr.checkpoint_every and step % int(tr.checkpoint_every) == 0:
        save()
      elif tr.checkpoint_every:
        check_saves()
      if out_of_time:
        logging.info('Training time budget spent (trainer.max_train_minutes=%s): stopping after step %d.',
                     tr.max_train_minutes, step)
        break
    if out_of_time and step == start:
      logging.info('Training time budget already spent (trainer.max_train_minutes=%s): no step run.',
                   tr.max_train_minutes)
    if tr.checkpoint_every and step > start:  # The last step, or a signal's: committed before the run returns.
      save(final=True)
  finally:
    queue.close()
    for th in threads:
      th.stop()
    for th in threads:
      th.join(timeout=60)
    try:
      ckpt.close()
    except Exception as e:  # pylint: disable=broad-except  (a save that failed after the last check)
      logging.error('Checkpoint: the last save failed: %s', e)
    writer.close()
    task.close()
  if tr.export_hf and not stopped:
    # The learner's final weights (save_hf writes them in float32), gathered by every process (collective).
    graphdef, final = nnx.split(learner.policy_model())
    final = nnx.merge(graphdef, parallel.to_host(final))
    if parallel.is_main_process():
      from sao_jax.models import hf_io  # pylint: disable=g-import-not-at-top
      with paths.StagedDir(str(tr.export_hf)) as export:  # A URI: written locally, then uploaded.
        hf_io.save_hf(final, model_config, export.local, tokenizer_dir=config.model.hf_dir or None)
        if model_config.lora_rank:  # The merged model above; the adapters alone, for PEFT over the base, here.
          hf_io.save_peft_adapter(final, paths.join(export.local, 'adapter'), base_model=config.model.hf_dir)
  wall = time.perf_counter() - t_start
  summary = {'steps': step, 'trajectories': trajectories_trained, 'wall_s': wall,
             'start_accuracy': None if first_eval is None else first_eval['eval_accuracy'],
             'end_accuracy': None if last_eval is None else last_eval['eval_accuracy'],
             'stopped_by_signal': stopped, 'stopped_by_time_budget': out_of_time,
             'generated_tokens': int(actor_tokens.total),
             'tokens_per_s': actor_tokens.total / wall if wall > 0 else 0.0}  # Actors' tokens over the whole run.
  if 'sft/eval_accuracy' in warm:  # start = before the warm start; sft = after it (step 0).
    summary.update(start_accuracy=warm['sft/eval_accuracy_before'], sft_accuracy=warm['sft/eval_accuracy'])
  logging.info('Run summary: %s', summary)
  if parallel.is_main_process():  # Rewritten by each process of a resumed run: why the last one stopped.
    paths.write_text(paths.join(config.workdir, SUMMARY_FILE), json.dumps(summary, indent=1))
  return summary
