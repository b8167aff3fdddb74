"""Supervised warm start (`config.sft`): a few jitted cross-entropy steps on task-generated solutions, before RL.

    summary = sft.warm_start(learner, task, tokenizer, SftConfig.from_config(config))  # a fresh run only

Each row is the reference episode of one training problem of the task (its own stream, seed
`config.seed + config.sft.data_seed`; the eval set is excluded by the task's iterator): the task's reference
turns (`Task.solution_actions`: the single reply `Task.solution` of a single-turn task; a tool call, then the
answer, for calculator) played through the task's real env by the rollout's one episode runner
(`rollout.replay_episode`), within the run's episode limits. So a row is laid out exactly as a sampled episode:
the prompt with its generation prompt, each turn's tokens with its stop token, and the env's observations
between turns (inline text, or a chat message with the template's turn-closing and -opening tokens). Its
action mask m marks the turns' tokens only, never the prompt's or an observation's; the loss is the token-mean
cross-entropy on them:

    loss = - sum_{b,t} m[b,t] log pi(tokens[b,t] | tokens[b,:t]) / max(sum_{b,t} m[b,t], 1)

The update is the learner's own machinery (`learner.steps.run_updates`: guarded AdamW/SGD update, gradient
clipping) on a train state of the policy with its own optimizer (`config.optim` with peak lr
`config.sft.lr`, linear warmup over `config.sft.warmup_steps`, then constant or a cosine decay); the RL
optimizer's state is not touched. Afterwards the policy's weights go back into the learner, and the critic is
re-initialised from the warm-started policy (SAO: the value model starts as the policy's backbone with a zero
head), with a fresh optimizer state.

Resumable (`directory`, the trainer's `<workdir>/warm_start`): its state (the policy's train state with its optimizer
state, the problems' stream position, the losses and the accuracy before) is checkpointed every
`config.sft.checkpoint_every` steps, when `should_stop()` turns true (a signal: it stops within one step, or within
one batch of episodes of an eval, saves and returns None) and at its last step; a later call resumes where it
stopped and ends with the same weights as one uninterrupted warm start. Once done, `summary.json` there holds its
result: a rerun (a run killed before its first RL checkpoint) restores the final state without training or
evaluating again.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from sao_jax import checkpoint as checkpoint_lib
from sao_jax import eval as eval_lib
from sao_jax import losses
from sao_jax import parallel
from sao_jax import paths
from sao_jax import rollout
from sao_jax.envs import base as envs_base
from sao_jax.learner import Learner
from sao_jax.learner import learner as learner_lib
from sao_jax.learner import optim as optim_lib
from sao_jax.learner import state as state_lib
from sao_jax.learner import steps as steps_lib
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.tokenizers import Tokenizer

Metrics = dict[str, jax.Array]
STATE_DIR = 'state'  # Under the warm start's directory: its checkpoints (one kept).
SUMMARY_FILE = 'summary.json'  # Under the warm start's directory: the result of a finished warm start.


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """The warm start's settings, read from a run's config once (`from_config`; `configs/base.py`, `sft` section,
  for each field's meaning).

  Attributes:
    steps, batch_size, lr, warmup_steps, schedule, end_lr_factor, num_examples, log_every, checkpoint_every:
      `config.sft`'s.
    data_seed: the seed of the problems' stream, `config.seed + config.sft.data_seed`.
    seq_buckets: the padded row lengths allowed (`config.trainer.seq_buckets`).
    limits: the run's episode budgets (`EpisodeLimits.from_config(config)`): a reference episode must fit them.
    optim: the run's optimizer settings (`OptimConfig`), whose schedule the warm start replaces (`sft_optimizer`).
    eval: the eval settings of the accuracy before and after (`eval.EvalConfig`).
  """
  steps: int
  batch_size: int
  lr: float
  warmup_steps: int
  schedule: str
  end_lr_factor: float
  num_examples: int
  log_every: int
  data_seed: int
  seq_buckets: tuple[int, ...]
  limits: rollout.EpisodeLimits
  optim: optim_lib.OptimConfig
  eval: eval_lib.EvalConfig
  checkpoint_every: int = 0

  @classmethod
  def from_config(cls, config: Any) -> SftConfig:
    s = config.sft
    return cls(steps=int(s.steps), batch_size=int(s.batch_size), lr=float(s.lr), warmup_steps=int(s.warmup_steps),
               schedule=str(s.schedule), end_lr_factor=float(s.end_lr_factor), num_examples=int(s.num_examples),
               log_every=int(s.log_every), data_seed=int(config.seed) + int(s.data_seed),
               seq_buckets=tuple(int(b) for b in config.trainer.seq_buckets),
               limits=rollout.EpisodeLimits.from_config(config), optim=optim_lib.OptimConfig.from_config(config),
               eval=eval_lib.EvalConfig.from_config(config), checkpoint_every=int(s.checkpoint_every))


# ------------------------------------------------------------------------------------------------------------
# Data.


def solution_rows(task: envs_base.Task, tokenizer: Tokenizer, examples: Sequence[envs_base.Example], *,
                  seq_buckets: Sequence[int], limits: rollout.EpisodeLimits | None = None
                  ) -> dict[str, np.ndarray]:
  """Rows `{'tokens': int32 [B, T], 'mask': float32 [B, T]}` of the examples' reference episodes.

  Each row is `rollout.replay_episode(task.make_env(ex), tokenizer, task.solution_actions(ex))`: its tokens, and
  its action mask as the loss mask (the turns' tokens, each turn with its stop token). Rows are right-padded with
  `tokenizer.pad_id` to T = the smallest of `seq_buckets` that holds the longest row.

  Args:
    task: gives the reference turns (`Task.solution_actions`) and the env that answers them.
    tokenizer: the policy's tokenizer.
    examples: the problems.
    seq_buckets: the padded lengths allowed (`config.trainer.seq_buckets`).
    limits: the episode budgets (`EpisodeLimits.from_config(config)`: a reference episode must fit what the
      sampler allows); default: a budget of the largest bucket for a turn and for the episode.

  Raises:
    ValueError: a reference episode that a limit cut, that the env ended with an error, or that did not earn the
      full reward 1 (a wrong reference); a row longer than the largest bucket.
  """
  longest_bucket = max(seq_buckets)
  if limits is None:
    limits = rollout.EpisodeLimits(max_turns=task.max_turns, max_new_tokens=longest_bucket,
                                   max_seq_len=longest_bucket)
  rows = []
  for ex in examples:
    actions = task.solution_actions(ex)
    traj = rollout.replay_episode(task.make_env(ex), tokenizer, actions, limits=limits)
    if traj.truncated or 'error' in traj.info or traj.reward != 1.0:
      raise ValueError(f'The reference episode of {ex.uid!r} ({actions!r}) got reward '
                       f'{traj.reward} (cut by {traj.info.get("cut_by")}, error {traj.info.get("error")}): a '
                       'warm start needs correct episodes that fit config.sampler.max_new_tokens / max_seq_len '
                       'and config.task.max_turns.')
    rows.append((traj.tokens, traj.action_mask))
  longest = max(len(ids) for ids, _ in rows)
  fits = [b for b in sorted(seq_buckets) if b >= longest]
  if not fits:
    raise ValueError(f'A warm-start row of {longest} tokens does not fit config.trainer.seq_buckets='
                     f'{tuple(seq_buckets)}.')
  t = fits[0]
  tokens = np.full((len(rows), t), tokenizer.pad_id, np.int32)
  loss_mask = np.zeros((len(rows), t), np.float32)
  for b, (ids, mask) in enumerate(rows):
    tokens[b, :len(ids)] = ids
    loss_mask[b, :len(mask)] = mask
  return {'tokens': tokens, 'mask': loss_mask}


class SolutionStream:
  """Batches of `solution_rows` from the task's training stream (seed `seed`): `num_examples` problems cycled
  in order, or a fresh problem for every row (`num_examples=0`)."""

  def __init__(self, task: envs_base.Task, tokenizer: Tokenizer, *, seed: int, batch_size: int,
               num_examples: int, seq_buckets: Sequence[int], limits: rollout.EpisodeLimits | None = None):
    self._task, self._tokenizer = task, tokenizer
    self._limits = limits
    self._it = task.train_iterator(seed)
    self._batch_size = batch_size
    self._buckets = tuple(seq_buckets)
    self._pool = [next(self._it) for _ in range(num_examples)]
    self._pos = 0

  def _next_example(self) -> envs_base.Example:
    if not self._pool:
      return next(self._it)
    ex = self._pool[self._pos % len(self._pool)]
    self._pos += 1
    return ex

  def state(self) -> dict[str, Any]:
    """The stream's position (JSON): the next batch after `restore(state)` on a new stream of the same
    arguments is the one this stream would give next."""
    return {'pos': self._pos, 'iterator': self._it.state()}

  def restore(self, state: dict[str, Any]) -> None:
    self._pos = int(state['pos'])
    self._it.restore(state['iterator'])

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    examples = [self._next_example() for _ in range(self._batch_size)]
    return solution_rows(self._task, self._tokenizer, examples, seq_buckets=self._buckets, limits=self._limits)


# ------------------------------------------------------------------------------------------------------------
# Loss and the jitted step.


def sft_loss(logprobs: jax.Array, mask: jax.Array) -> tuple[jax.Array, Metrics]:
  """Token-mean negative log-likelihood of the masked tokens: `-sum(m * logp) / max(sum(m), 1)`.

  `logprobs[b, t] = log pi(tokens[b, t] | tokens[b, :t])` (DESIGN alignment); `mask` float `[B, T]`.
  """
  nll = -losses.masked_mean(logprobs, mask)
  return nll, {'nll': nll, 'tokens': mask.sum()}


def sft_objective() -> steps_lib.Objective:
  """`sft_loss` as a learner `Objective` (split at the model, so `run_updates` can microbatch it)."""

  def forward(model, rows, _):
    return {'logprobs': logprobs_lib.token_logprobs(model, rows['tokens'])}

  def loss(out, rows, scale):
    value, metrics = sft_loss(out['logprobs'], rows['mask'])
    return scale('token_mean') * value, metrics

  return steps_lib.Objective(forward, loss)


def sft_optimizer(settings: SftConfig):
  """The warm start's optimizer: the run's (`settings.optim`: optimizer, betas, clipping, ...) at peak lr
  `settings.lr`, linear warmup over `settings.warmup_steps` optimizer steps, then constant or
  (`schedule='cosine'`) a cosine decay to `lr * end_lr_factor` at step `settings.steps` (`optim.make_schedule`)."""
  o = dataclasses.replace(settings.optim, schedule=settings.schedule, warmup_steps=settings.warmup_steps,
                          total_steps=max(settings.steps, settings.warmup_steps + 1),
                          end_lr_factor=settings.end_lr_factor)
  return optim_lib.make_optimizer(o, settings.lr)


def make_sft_step(spec: state_lib.ModelSpec, shardings: state_lib.TrainState, mesh, base: Any = None,
                  base_shardings: Any = None
                  ) -> Callable[[state_lib.TrainState, dict[str, Any]], tuple[state_lib.TrainState, Metrics]]:
  """`(train state, rows) -> (train state, metrics)`: one guarded optimizer update on `sft_loss` (jitted,
  state donated, rows sharded over the data axes). Metrics: loss, nll, tokens, grad_norm, skipped. `base`: the
  learner's shared base (LoRA: the train state holds the adapters), an input of the step, not donated."""
  objective = sft_objective()

  def step(ts, rows, base):
    new, metrics = steps_lib.run_updates(spec, state_lib.with_base(spec, ts, base), rows, objective, epochs=1,
                                         minibatch_size=0, mesh=mesh)
    return new.replace(rest=ts.rest), metrics

  rows_sh = {'tokens': parallel.batch_sharding(mesh, 2), 'mask': parallel.batch_sharding(mesh, 2)}
  jitted = jax.jit(step, in_shardings=(shardings, rows_sh, base_shardings),
                   out_shardings=(shardings, parallel.replicated(mesh)), donate_argnums=(0,))
  return lambda ts, rows: jitted(ts, rows, base)


# ------------------------------------------------------------------------------------------------------------
# The warm start.


def _reset_critic(learner: Learner) -> None:
  """The critic re-initialised from the current policy (backbone copied, zero head), fresh optimizer state. With
  LoRA its backbone is the shared base (the policy's warm-started adapters are not the critic's) and its adapters
  fresh."""
  if learner.critic_spec is None:
    return
  spec = learner.critic_spec
  critic = learner_lib.default_critic(learner.policy_model(), learner.settings.seed + 1, learner.settings.critic_remat,
                                      learner.settings.critic_lora if learner.lora else (0, ()))
  _, ts, _ = state_lib.create_train_state(critic, spec.tx, learner.mesh, learner.settings.rules,
                                          trainable=spec.trainable, shared=spec.shared, base_prefix=spec.base_prefix)
  learner.state = learner.state.replace(critic=ts)


def warm_start(learner: Learner, task: envs_base.Task, tokenizer: Tokenizer, settings: SftConfig, *,
               evaluate: bool = True, directory: str | None = None, should_stop: Callable[[], bool] | None = None,
               config: Any = None) -> dict[str, float] | None:
  """Runs `settings.steps` supervised steps on the learner's policy (see the module docstring).

  Args:
    learner: the fresh learner (step 0); its policy is updated in place and its critic re-initialised from it.
    task: the task (`Task.solution_actions` gives the reference turns).
    tokenizer: the policy's tokenizer.
    settings: the warm start's settings (`SftConfig.from_config(config)`).
    evaluate: greedy eval accuracy on the task's eval set before and after (`sao_jax.eval.evaluate`).
    directory: where its state is checkpointed and its result kept (None: not resumable).
    should_stop: polled before each step and each batch of eval episodes (the same number of calls on every
      process: it may be a collective); when it returns True the state is saved and None returned.
    config: the run's config, saved with the state (a resume with another one is refused as the trainer's is).

  Returns:
    `{'sft/steps', 'sft/examples', 'sft/loss_first', 'sft/loss_last', 'sft/wall_s', 'sft/tokens_per_s'}` and,
    with `evaluate`, `'sft/eval_accuracy_before'` and `'sft/eval_accuracy'` (after); None when stopped.
  """
  steps = settings.steps
  should_stop = should_stop or (lambda: False)
  t0 = time.perf_counter()
  backend = None

  def accuracy() -> float | None:
    nonlocal backend
    model = learner.policy_model()
    if backend is None:
      backend = rollout.make_backend(model, tokenizer, task, settings.eval.settings, version=0)
    try:
      summary = eval_lib.evaluate(model, tokenizer, task, settings.eval, backend=backend, version=0,
                                  progress=False, should_stop=should_stop)
    except eval_lib.Interrupted:
      return None
    return float(summary['greedy_accuracy'])

  # The policy's own split: with LoRA the warm start trains the adapters over the learner's shared base.
  spec, ts, shardings = state_lib.create_train_state(learner.policy_model(), sft_optimizer(settings), learner.mesh,
                                                     learner.settings.rules, trainable=learner.policy_spec.trainable,
                                                     shared=learner.policy_spec.shared)
  data = SolutionStream(task, tokenizer, seed=settings.data_seed, batch_size=settings.batch_size,
                        num_examples=settings.num_examples, seq_buckets=settings.seq_buckets, limits=settings.limits)
  # Carried across resumes: the accuracy before, the losses, the tokens and the seconds spent so far.
  out: dict[str, float] = {'sft/loss_first': float('nan'), 'sft/loss_last': float('nan'), 'tokens': 0.0,
                           'step_s': 0.0, 'wall_s': 0.0}
  ckpt = None
  done = 0
  if directory is not None:
    ckpt = checkpoint_lib.Checkpointer(paths.join(directory, STATE_DIR), keep=1)
  try:
    if ckpt is not None and ckpt.latest_step() is not None:
      got = ckpt.restore(None, target=_target(ts, shardings), set_aside_damaged=True)
      ts = _from_item(got)
      data.restore(got.data['stream'])
      out.update(got.data['out'])
      done = int(got.step)
      logging.info('Warm start: resumed at step %d of %d from %s.', done, steps, ckpt.directory)

    def save(step: int) -> None:
      if ckpt is None or step in ckpt.all_steps():
        return
      carried = {**out, 'wall_s': out['wall_s'] + time.perf_counter() - t0}
      ckpt.save(checkpoint_lib.CheckpointState(
          step=step, policy=ts.params, optimizer=_optimizer_item(ts),
          data={'stream': data.state(), 'out': carried},
          metadata={'config': {} if config is None else checkpoint_lib.flat_config(config)}), force=True)
      ckpt.wait()  # Committed before the run goes on (a signal's save is the last thing the run does).

    def install() -> None:
      policy = learner.state.policy.replace(params=ts.params, rest=ts.rest)
      learner.state = learner.state.replace(policy=policy)
      _reset_critic(learner)

    summary_path = None if directory is None else paths.join(directory, SUMMARY_FILE)
    if done == steps and summary_path is not None and paths.exists(summary_path):
      install()
      result = json.loads(paths.read_text(summary_path))
      logging.info('Warm start: done before (%s), its final state restored.', summary_path)
      return result

    if evaluate and 'sft/eval_accuracy_before' not in out and done == 0:
      before = accuracy()
      if before is None:
        return None  # Nothing trained yet: nothing to save.
      out['sft/eval_accuracy_before'] = before
    step_fn = make_sft_step(spec, shardings, learner.mesh, learner.base,
                            None if learner.base is None else jax.tree.map(lambda x: x.sharding, learner.base))
    t_steps = time.perf_counter()
    for i in range(done, steps):
      if should_stop():
        save(i)
        logging.warning('Warm start stopped at step %d of %d (saved; the same command resumes it).', i, steps)
        return None
      rows = next(data)
      out['tokens'] += rows['tokens'].size
      ts, metrics = step_fn(ts, state_lib.place(rows, {k: parallel.batch_sharding(learner.mesh, 2) for k in rows}))
      if i == 0 or i == steps - 1 or (settings.log_every and (i + 1) % settings.log_every == 0):
        m = {k: float(v) for k, v in parallel.to_host(metrics).items()}
        if i == 0:
          out['sft/loss_first'] = m['loss']
        out['sft/loss_last'] = m['loss']
        logging.info('sft step %d/%d | loss %.4f | grad norm %.3f', i + 1, steps, m['loss'], m['grad_norm'])
      if settings.checkpoint_every and (i + 1) % settings.checkpoint_every == 0 and i + 1 < steps:
        save(i + 1)
    jax.block_until_ready(ts)
    out['step_s'] += time.perf_counter() - t_steps
    save(steps)  # The final state: a run killed from here on restores it instead of training again.
    install()
    result = {}
    if evaluate:
      after = accuracy()
      if after is None:
        return None
      result['sft/eval_accuracy_before'] = out['sft/eval_accuracy_before']
      result['sft/eval_accuracy'] = after
    wall = out['wall_s'] + time.perf_counter() - t0
    result.update({'sft/steps': float(steps), 'sft/examples': float(steps * settings.batch_size),
                   'sft/loss_first': out['sft/loss_first'], 'sft/loss_last': out['sft/loss_last'], 'sft/wall_s': wall,
                   'sft/tokens_per_s': out['tokens'] / max(out['step_s'], 1e-9)})
    if summary_path is not None and jax.process_index() == 0:
      paths.write_text(summary_path, json.dumps(result, indent=1, sort_keys=True))
    logging.info('Warm start: %d steps (%d examples) in %.1fs; loss %.4f -> %.4f; eval accuracy %s -> %s.', steps,
                 steps * settings.batch_size, wall, result['sft/loss_first'], result['sft/loss_last'],
                 result.get('sft/eval_accuracy_before', 'n/a'), result.get('sft/eval_accuracy', 'n/a'))
    return result
  finally:
    if ckpt is not None:
      ckpt.close()


def _optimizer_item(ts: state_lib.TrainState) -> dict[str, Any]:
  """A warm-start checkpoint's `optimizer` item: the train state but its parameters (saved as `policy`)."""
  return {'rest': ts.rest, 'opt_state': ts.opt_state, 'step': ts.step, 'skipped': ts.skipped,
          'consecutive_skips': ts.consecutive_skips}


def _target(ts: state_lib.TrainState, shardings: state_lib.TrainState) -> checkpoint_lib.CheckpointState:
  """The abstract target of a warm-start checkpoint (the train state's shapes on its shardings)."""
  return checkpoint_lib.CheckpointState(
      step=0, policy=checkpoint_lib.abstract_target(ts.params, shardings.params),
      optimizer=checkpoint_lib.abstract_target(_optimizer_item(ts), _optimizer_item(shardings)))


def _from_item(got: checkpoint_lib.CheckpointState) -> state_lib.TrainState:
  o = got.optimizer
  return state_lib.TrainState(got.policy, o['rest'], o['opt_state'], o['step'], o['skipped'], o['consecutive_skips'])
