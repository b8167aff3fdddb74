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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from sao_jax import eval as eval_lib
from sao_jax import losses
from sao_jax import parallel
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


@dataclasses.dataclass(frozen=True)
class SftConfig:
  """The warm start's settings, read from a run's config once (`from_config`; `configs/base.py`, `sft` section,
  for each field's meaning).

  Attributes:
    steps, batch_size, lr, warmup_steps, schedule, end_lr_factor, num_examples, log_every: `config.sft`'s.
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

  @classmethod
  def from_config(cls, config: Any) -> SftConfig:
    s = config.sft
    return cls(steps=int(s.steps), batch_size=int(s.batch_size), lr=float(s.lr), warmup_steps=int(s.warmup_steps),
               schedule=str(s.schedule), end_lr_factor=float(s.end_lr_factor), num_examples=int(s.num_examples),
               log_every=int(s.log_every), data_seed=int(config.seed) + int(s.data_seed),
               seq_buckets=tuple(int(b) for b in config.trainer.seq_buckets),
               limits=rollout.EpisodeLimits.from_config(config), optim=optim_lib.OptimConfig.from_config(config),
               eval=eval_lib.EvalConfig.from_config(config))


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


def make_sft_step(spec: state_lib.ModelSpec, shardings: state_lib.TrainState, mesh
                  ) -> Callable[[state_lib.TrainState, dict[str, Any]], tuple[state_lib.TrainState, Metrics]]:
  """`(train state, rows) -> (train state, metrics)`: one guarded optimizer update on `sft_loss` (jitted,
  state donated, rows sharded over the data axes). Metrics: loss, nll, tokens, grad_norm, skipped."""
  objective = sft_objective()

  def step(ts, rows):
    return steps_lib.run_updates(spec, ts, rows, objective, epochs=1, minibatch_size=0, mesh=mesh)

  rows_sh = {'tokens': parallel.batch_sharding(mesh, 2), 'mask': parallel.batch_sharding(mesh, 2)}
  return jax.jit(step, in_shardings=(shardings, rows_sh), out_shardings=(shardings, parallel.replicated(mesh)),
                 donate_argnums=(0,))


# ------------------------------------------------------------------------------------------------------------
# The warm start.


def _reset_critic(learner: Learner) -> None:
  """The critic re-initialised from the current policy (backbone copied, zero head), fresh optimizer state."""
  if learner.critic_spec is None:
    return
  spec = learner.critic_spec
  critic = learner_lib.default_critic(learner.policy_model(), learner.settings.seed + 1, learner.settings.critic_remat)
  _, ts, _ = state_lib.create_train_state(critic, spec.tx, learner.mesh, learner.settings.rules,
                                          trainable=spec.trainable)
  learner.state = learner.state.replace(critic=ts)


def warm_start(learner: Learner, task: envs_base.Task, tokenizer: Tokenizer, settings: SftConfig, *,
               evaluate: bool = True) -> dict[str, float]:
  """Runs `settings.steps` supervised steps on the learner's policy (see the module docstring).

  Args:
    learner: the fresh learner (step 0); its policy is updated in place and its critic re-initialised from it.
    task: the task (`Task.solution_actions` gives the reference turns).
    tokenizer: the policy's tokenizer.
    settings: the warm start's settings (`SftConfig.from_config(config)`).
    evaluate: greedy eval accuracy on the task's eval set before and after (`sao_jax.eval.evaluate`).

  Returns:
    `{'sft/steps', 'sft/examples', 'sft/loss_first', 'sft/loss_last', 'sft/wall_s', 'sft/tokens_per_s'}` and,
    with `evaluate`, `'sft/eval_accuracy_before'` and `'sft/eval_accuracy'` (after).
  """
  steps = settings.steps
  t0 = time.perf_counter()
  out: dict[str, float] = {}
  backend = None

  def accuracy() -> float:
    nonlocal backend
    model = learner.policy_model()
    if backend is None:
      backend = rollout.make_backend(model, tokenizer, task, settings.eval.settings, version=0)
    summary = eval_lib.evaluate(model, tokenizer, task, settings.eval, backend=backend, version=0, progress=False)
    return float(summary['greedy_accuracy'])

  if evaluate:
    out['sft/eval_accuracy_before'] = accuracy()
  spec, ts, shardings = state_lib.create_train_state(learner.policy_model(), sft_optimizer(settings), learner.mesh,
                                                     learner.settings.rules)
  step_fn = make_sft_step(spec, shardings, learner.mesh)
  data = SolutionStream(task, tokenizer, seed=settings.data_seed, batch_size=settings.batch_size,
                        num_examples=settings.num_examples, seq_buckets=settings.seq_buckets, limits=settings.limits)
  first = last = float('nan')
  tokens = 0
  t_steps = time.perf_counter()
  for i in range(steps):
    rows = next(data)
    tokens += rows['tokens'].size
    ts, metrics = step_fn(ts, state_lib.place(rows, {k: parallel.batch_sharding(learner.mesh, 2) for k in rows}))
    if i == 0 or i == steps - 1 or (settings.log_every and (i + 1) % settings.log_every == 0):
      m = {k: float(v) for k, v in parallel.to_host(metrics).items()}
      first = m['loss'] if i == 0 else first
      last = m['loss']
      logging.info('sft step %d/%d | loss %.4f | grad norm %.3f', i + 1, steps, m['loss'], m['grad_norm'])
  jax.block_until_ready(ts)
  step_s = time.perf_counter() - t_steps
  policy = learner.state.policy.replace(params=ts.params, rest=ts.rest)
  learner.state = learner.state.replace(policy=policy)
  _reset_critic(learner)
  if evaluate:
    out['sft/eval_accuracy'] = accuracy()
  out.update({'sft/steps': float(steps), 'sft/examples': float(steps * settings.batch_size),
              'sft/loss_first': first, 'sft/loss_last': last, 'sft/wall_s': time.perf_counter() - t0,
              'sft/tokens_per_s': tokens / max(step_s, 1e-9)})
  logging.info('Warm start: %d steps (%d examples) in %.1fs; loss %.4f -> %.4f; eval accuracy %s -> %s.', steps,
               steps * settings.batch_size, out['sft/wall_s'], first, last,
               out.get('sft/eval_accuracy_before', 'n/a'), out.get('sft/eval_accuracy', 'n/a'))
  return out
