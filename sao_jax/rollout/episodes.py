"""The static episode runner: a batch of multi-turn episodes, turn by turn, on a generation `Backend`.

    trajs = run_episodes(backend, tokenizer, envs, limits=EpisodeLimits.from_config(config),
                         decoding=SamplingParams.from_config(config.sampler), seeds=seeds, group_ids=group_ids)

Every row plays `prompt -> action -> observation -> action -> ...` until its env ends the episode or a limit
cuts it; all running rows generate their next turn in one backend call (rows that finished take no part).
Each row becomes a `Trajectory` (layout: `sao_jax.rollout.layout`) carrying its group id, the behaviour
log-probs of the distribution actually sampled from (and the temperature-1 policy log-probs when the
backend knows them), the params version of every turn, and its generation / env wall time.

Budgets: per turn a row gets `min(max_new_tokens, max_seq_len - len(context))` tokens. How each kind of
cut ends the trajectory (the learner bootstraps a truncated row from the value after its LAST token, so that
state must be one from which the policy generates next, a state the critic is trained on):

* a turn that ends without a stop token (its budget ran out): `cut_by='max_new_tokens'`; the row ends
  mid-turn on an action token (the policy would go on from there);
* the env's turn limit (`info['truncated']` from the env, `cut_by='max_turns'`): the final observation is
  kept as non-action tokens (for 'message' observations they end with the tokens that open the next
  assistant turn), so the row ends where the next turn would start;
* an observation that would not fit in `max_seq_len` (after any turn, the last one included) cannot be kept:
  `cut_by='max_seq_len'`, `Trajectory.bootstrappable=False`; the row ends on a turn-closing stop token, a
  state the critic is never trained on, so `pack` drops it (counted). A turn-limit cut whose env gives no
  final observation is marked the same way (`bootstrappable=False`, `cut_by='max_turns'`).

The env steps of one turn run concurrently, one thread per row (`_absorb_rows`): tool calls that wait on a
sandbox or a remote service overlap, so a turn waits for its slowest tool call, not for their sum.
Env failures (`guarded_step`) end the episode with `info['error']` and reward 0. Greedy decoding
(temperature 0) marks the trajectories `greedy` (eval only: their behaviour log-probs are those of a point
mass, 0). `run_episode` plays one episode with a per-episode generate function (a `ContextBackend`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from sao_jax import structs
from sao_jax.envs.base import Env, Message, guarded_step
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout import layout
from sao_jax.rollout.backends import Backend, ContextBackend, GenerateFn, Generation
from sao_jax.tokenizers import Tokenizer


def episode_seed(seed: int, index: int, sample: int) -> int:
  """A uint32 sampling seed per (run seed, problem or prompt index, sample index >= -1; -1 = greedy).

  It depends on nothing else (not the batch, the actor or the order of calls), so an episode is reproducible.
  """
  return int(np.random.SeedSequence([int(seed) % (1 << 32), int(index), int(sample) + 1]).generate_state(1)[0])


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Budgets of one episode: `max_turns` model turns, `max_new_tokens` per turn, `max_seq_len` in all."""
  max_turns: int = 1
  max_new_tokens: int = 64
  max_seq_len: int = 256

  @classmethod
  def from_config(cls, config) -> EpisodeLimits:
    """From `config.task.max_turns`, `config.sampler.max_new_tokens` and `config.sampler.max_seq_len`."""
    return cls(max_turns=int(config.task.max_turns), max_new_tokens=int(config.sampler.max_new_tokens),
               max_seq_len=int(config.sampler.max_seq_len))


@dataclasses.dataclass
class Episode:
  """One running episode (host side), shared by the static runner here and the continuous one
  (`sao_jax.rollout.continuous`)."""
  env: Env
  messages: list[Message]
  prompt_ids: list[int]
  context: list[int]
  group_id: int
  turns: list[layout.Turn] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  truncated: bool = False
  bootstrappable: bool = True
  done: bool = False
  generate_seconds: float = 0.0
  env_seconds: float = 0.0
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def cut(self, cut_by: str, *, bootstrappable: bool = True) -> None:
    self.truncated, self.done, self.bootstrappable = True, True, bootstrappable
    self.info.update(truncated=True, cut_by=cut_by)


@dataclasses.dataclass(frozen=True)
class EpisodeRules:
  """What the per-episode steps (`start_episode`, `absorb`, `finish`) need; one per runner call."""
  tokenizer: Tokenizer
  limits: EpisodeLimits
  stop_ids: frozenset[int]  # The backend's: a turn that ends on one of them ended on a stop token.
  end_ids: frozenset[int]  # The tokenizer's end-of-turn ids.
  decoding: SamplingParams
  step_timeout_s: float | None = None

  @classmethod
  def make(cls, backend_stop_ids: Sequence[int], tokenizer: Tokenizer, envs: Sequence[Env], *,
           limits: EpisodeLimits, decoding: SamplingParams, step_timeout_s: float | None = None) -> EpisodeRules:
    """The rules of a call; refuses a backend that does not stop on the envs' stop texts."""
    need = set().union(*(layout.stop_ids_for(env, tokenizer) for env in envs)) if envs else set()
    if not need <= set(backend_stop_ids):
      raise ValueError(f'The backend does not stop on token(s) {sorted(need - set(backend_stop_ids))} that the '
                       f'{type(envs[0]).__name__} episodes need.')
    return cls(tokenizer, limits, frozenset(int(i) for i in backend_stop_ids), frozenset(tokenizer.stop_ids),
               decoding, step_timeout_s)


def start_episode(env: Env, group_id: int, rules: EpisodeRules) -> Episode:
  """Resets `env` and renders its prompt; refuses a prompt that does not fit `max_seq_len`."""
  messages = env.reset()
  prompt_ids, _ = rules.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
  prompt_ids = list(prompt_ids)
  if len(prompt_ids) >= rules.limits.max_seq_len:
    raise ValueError(f'A prompt of {len(prompt_ids)} tokens does not fit config.sampler.max_seq_len='
                     f'{rules.limits.max_seq_len}.')
  return Episode(env, messages, prompt_ids, list(prompt_ids), int(group_id))


def turn_budget(ep: Episode, limits: EpisodeLimits) -> int:
  """New tokens the episode's next turn may generate: `min(max_new_tokens, max_seq_len - len(context))`, and at
  most `env.turn_token_budget(turn_index)` for an env that has one (synthetic workloads that force turn
  lengths on a model that does not stop on its own: `sao_jax.benchmarks.rollout`)."""
  budget = min(limits.max_new_tokens, limits.max_seq_len - len(ep.context))
  cap = getattr(ep.env, 'turn_token_budget', None)
  return budget if cap is None else min(budget, int(cap(len(ep.turns))))


def absorb(ep: Episode, gen: Generation, rules: EpisodeRules) -> list[int] | None:
  """Records a generated turn, steps the env; returns the observation ids (None when the episode ended).

  Touches only `ep` (and its env): runners may call it for different episodes in different threads.
  """
  tokenizer, limits = rules.tokenizer, rules.limits
  turn = layout.Turn(gen.ids, gen.logprobs, policy_logprobs=gen.policy_logprobs, version=gen.version)
  ep.turns.append(turn)
  ep.context += gen.ids
  # An env with `budget_ends_turn` (synthetic workloads) takes a turn that used its budget as finished.
  if not (gen.ids and (gen.ids[-1] in rules.stop_ids or getattr(ep.env, 'budget_ends_turn', False))):
    ep.cut('max_new_tokens')  # Ends mid-turn, on an action token.
    return None
  action_text = layout.safe_decode(tokenizer, gen.ids)
  t0 = time.perf_counter()
  obs, reward, done, step_info = guarded_step(ep.env, action_text, timeout_s=rules.step_timeout_s)
  ep.env_seconds += time.perf_counter() - t0
  ep.info.update(step_info)
  ep.reward = reward
  limit_cut = done and bool(step_info.get('truncated', False))
  if done and not limit_cut:  # Terminal (or an env error).
    ep.done = True
    return None
  if obs is None:
    if limit_cut:  # No final observation to keep: the row ends on a turn-closing stop token.
      ep.cut(str(step_info.get('cut_by', 'max_turns')), bootstrappable=False)
      return None
    raise RuntimeError(f'{type(ep.env).__name__}.step returned no observation on a non-final turn.')
  if ep.env.observation_mode == 'inline':
    obs_ids = list(tokenizer.encode(obs))
  else:
    obs_ids = layout.message_observation_ids(tokenizer, ep.messages, action_text, gen.ids[-1] in rules.end_ids,
                                             {'role': ep.env.observation_role, 'content': obs})
    ep.messages = ep.messages + [{'role': 'assistant', 'content': action_text},
                                 {'role': ep.env.observation_role, 'content': obs}]
  if len(ep.context) + len(obs_ids) >= limits.max_seq_len:
    ep.cut('max_seq_len', bootstrappable=False)  # The observation cannot be kept.
    return None
  turn.observation_ids = obs_ids
  ep.context += obs_ids
  if limit_cut:  # The final observation is kept: the row ends where the next turn would start.
    ep.cut(str(step_info.get('cut_by', 'max_turns')))
    return None
  if len(ep.turns) >= max(ep.env.max_turns, 1):  # An env that does not enforce its own turn limit.
    ep.cut('max_turns')
    return None
  return obs_ids


def finish(ep: Episode, rules: EpisodeRules) -> structs.Trajectory:
  """The finished episode as a `Trajectory` (reward 0 after an env error)."""
  reward = 0.0 if 'error' in ep.info else ep.reward
  ep.info['num_turns'] = len(ep.turns)
  return layout.episode_to_trajectory(
      ep.prompt_ids, ep.turns, reward, truncated=ep.truncated, bootstrappable=ep.bootstrappable,
      group_id=ep.group_id, greedy=rules.decoding.greedy, generate_seconds=ep.generate_seconds,
      env_seconds=ep.env_seconds, info=ep.info)


def run_episodes(backend: Backend, tokenizer: Tokenizer, envs: Sequence[Env], *, limits: EpisodeLimits,
                 decoding: SamplingParams, seeds: Sequence[int], group_ids: Sequence[int] | None = None,
                 step_timeout_s: float | None = None) -> list[structs.Trajectory]:
  """Plays one episode per env, all rows together, with `backend` (see the module docstring).

  Args:
    backend: the generation backend (its `stop_ids` must include the envs' stop texts).
    tokenizer: renders prompts / message observations, decodes actions.
    envs: fresh envs, one per row (reset here).
    limits: episode budgets (the turn limit itself is the env's, `Env.max_turns`).
    decoding: greedy or sampling settings.
    seeds: one sampling seed per row.
    group_ids: one group id per row (rollouts of one prompt share it); default -1 (no groups).
    step_timeout_s: wall-clock bound of one `env.step`.

  Returns:
    One `Trajectory` per env, in order.

  Raises:
    ValueError: mismatched lengths, a backend that does not stop on the envs' stop texts, or a prompt that
      does not fit `config.sampler.max_seq_len`.
  """
  group_ids = [-1] * len(envs) if group_ids is None else [int(g) for g in group_ids]
  if len(seeds) != len(envs) or len(group_ids) != len(envs):
    raise ValueError(f'run_episodes: {len(seeds)} seeds and {len(group_ids)} group ids for {len(envs)} envs.')
  if not envs:
    return []
  rules = EpisodeRules.make(backend.stop_ids, tokenizer, envs, limits=limits, decoding=decoding,
                            step_timeout_s=step_timeout_s)
  episodes = [start_episode(env, group_id, rules) for env, group_id in zip(envs, group_ids)]

  def timed(call, *args, **kwargs):
    running = [ep for ep in episodes if not ep.done]
    t0 = time.perf_counter()
    gens, handle = call(*args, **kwargs)
    seconds = time.perf_counter() - t0
    for ep in running:
      ep.generate_seconds += seconds
    return gens, handle

  step_env = functools.partial(absorb, rules=rules)
  pool = _env_pool(len(episodes))
  try:
    gens, handle = timed(backend.first_turn, [ep.prompt_ids for ep in episodes],
                         [turn_budget(ep, limits) for ep in episodes], decoding=decoding, seeds=list(seeds))
    observations = _absorb_rows(pool, step_env, episodes, gens, [True] * len(episodes))
    while not all(ep.done for ep in episodes):
      running = [not ep.done for ep in episodes]
      gens, handle = timed(backend.next_turn, handle, observations,
                           [0 if ep.done else turn_budget(ep, limits) for ep in episodes], decoding=decoding)
      observations = _absorb_rows(pool, step_env, episodes, gens, running)
    del handle
  finally:
    if pool is not None:
      pool.shutdown(wait=True)
  return [finish(ep, rules) for ep in episodes]


# ---- Concurrent env steps: the rows of one turn step their envs at once (tool calls that wait on a sandbox or
# a remote service overlap), so a turn waits for its slowest tool call, not for the sum of them.


def _env_pool(rows: int) -> concurrent.futures.ThreadPoolExecutor | None:
  """A thread per row (threads start lazily, on first use); None for a single row."""
  return None if rows <= 1 else concurrent.futures.ThreadPoolExecutor(max_workers=rows,
                                                                      thread_name_prefix='env-step')


def _absorb_rows(pool, absorb, episodes, gens, running) -> list[list[int] | None]:
  """`absorb(ep, gen)` for the running rows (None for the others), concurrently on `pool` when given. Each
  call touches only its own episode; the first exception (in row order) is raised, as a plain loop would."""
  if pool is None:
    return [absorb(ep, g) if run else None for ep, g, run in zip(episodes, gens, running)]
  futures = [pool.submit(absorb, ep, g) if run else None for ep, g, run in zip(episodes, gens, running)]
  return [None if f is None else f.result() for f in futures]


def run_episode(env: Env, tokenizer: Tokenizer, generate: GenerateFn, *, limits: EpisodeLimits,
                group_id: int = -1, version: int = 0, step_timeout_s: float | None = None) -> structs.Trajectory:
  """One episode with `generate(context_ids, max_new_tokens, stop_ids) -> (action_ids, logprobs)`: the batched
  runner on one row of a `ContextBackend` (the generator returns the tokens it sampled, with the stop token
  when it stopped on one, and their behaviour log-probs; every turn is stamped with `version`)."""
  backend = ContextBackend(generate, layout.stop_ids_for(env, tokenizer), version=version)
  return run_episodes(backend, tokenizer, [env], limits=limits, decoding=SamplingParams(), seeds=[0],
                      group_ids=[group_id], step_timeout_s=step_timeout_s)[0]


def replay_episode(env: Env, tokenizer: Tokenizer, actions: Sequence[str], *, limits: EpisodeLimits,
                   group_id: int = -1) -> structs.Trajectory:
  """The episode that a model writing `actions` (the text of each turn, in order) plays on `env`: the one runner
  (`run_episode`) with the env's own observations, so a reference episode (the warm start's rows,
  `sao_jax.sft`) is laid out exactly as a sampled one, `action_mask` on the turns' tokens only.

  A turn's tokens are `tokenizer.encode(text)`, plus the end-of-turn token `tokenizer.eos_id` unless the text
  already ends on one of the turn's stop tokens (an inline tool call's `</calc>`): what a model that wrote the
  text generates, stop token included. Behaviour log-probs are 0. A turn longer than its budget is cut as a
  sampled one is (`truncated`, `cut_by='max_new_tokens'`).

  Raises:
    ValueError: the env asked for more turns than `actions` has, or ended the episode before using them all.
  """
  queue = list(actions)

  def generate(context, budget, stop_ids):
    del context, budget  # The backend cuts a turn at its budget.
    if not queue:
      raise ValueError(f'replay_episode: the {type(env).__name__} episode wants a turn after the {len(actions)} '
                       'given actions.')
    ids = list(tokenizer.encode(queue.pop(0)))
    if not ids or ids[-1] not in stop_ids:
      ids.append(tokenizer.eos_id)
    return ids, [0.0] * len(ids)

  traj = run_episode(env, tokenizer, generate, limits=limits, group_id=group_id)
  if queue:
    raise ValueError(f'replay_episode: the {type(env).__name__} episode ended after {len(actions) - len(queue)} '
                     f'of the {len(actions)} given actions ({traj.info}).')
  return traj
