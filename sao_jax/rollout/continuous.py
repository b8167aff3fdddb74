"""The continuous-batching episode runner: episodes stream through the slots of a `SlotSampler`.

    slots = SlotSampler(source, num_slots=16, max_seq_len=config.sampler.max_seq_len, stop_ids=..., pad_id=...)
    trajs = run_continuous(slots, tokenizer, envs, limits=..., decoding=..., seeds=seeds, group_ids=group_ids)

Every episode owns a slot from its first prompt token to its end (the static runner, `episodes.run_episodes`,
makes a batch wait for its longest generation and slowest env step instead). The host loop alternates:
1. harvest env steps that finished (a thread pool: they never block the other slots' decoding): an episode that
   goes on is queued for admission with its observation, one that ended becomes a `Trajectory` and frees its slot;
2. fill free slots with waiting episodes;
3. admit and decode (`SlotSampler.step`): queued chunks are written and each turn's first token sampled, then one
   decode chunk runs over all slots. While episodes wait, the chunk ends once `refill_rows` more slots are free;
   with the engine's `device_refill`, waiting episodes are offered to the chunk as a queue and a slot whose
   episode ends takes one inside it.

Rules:
* the per-episode steps (prompt, budgets, turns, env step, cuts, layout) are the static runner's
  (`episodes.start_episode`, `turn_budget`, `absorb`, `finish`): greedy episodes are token for token the same;
* weights: `follower.refresh()` runs before every device call; every token records its version
  (`Trajectory.info['token_versions']`), a turn's version is its oldest token's; with `per_episode_weights`, a
  newer version is taken only when no episode runs;
* `drop_older_than(version)` ends every running episode whose oldest token is older (its trajectory would be
  dropped as stale anyway) and returns their keys, so its slot goes to a fresh episode at once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from sao_jax import structs
from sao_jax.envs.base import Env
from sao_jax.generate.slots import Admission, NewEpisode, SlotSampler, SlotTokens
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout.backends import Generation
from sao_jax.rollout.episodes import Episode, EpisodeLimits, EpisodeRules, absorb, finish, start_episode, turn_budget
from sao_jax.tokenizers import Tokenizer


class WeightFollower(Protocol):
  """Where newer weights come from (the actor's publisher adapter)."""

  def newer(self) -> bool:
    """A newer version than the sampler's is available."""

  def refresh(self) -> None:
    """Takes the newest version (no-op when there is none)."""


@dataclasses.dataclass
class _Running:
  key: Hashable
  episode: Episode
  seed: int
  rules: EpisodeRules
  ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  policy_logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  oldest_version: int | None = None  # Of the episode's first token (versions only grow); None before it.


class ContinuousRunner:
  """Streams episodes through a `SlotSampler` (see the module docstring).

  Args:
    slots: the slot sampler (its stop ids must include the envs' stop texts).
    tokenizer: renders prompts / message observations, decodes actions.
    limits: episode budgets.
    decoding: greedy or sampling settings.
    step_timeout_s: wall-clock bound of one `env.step`.
    env_workers: threads stepping envs (default: one per slot).
    follower: newer weights (None: the sampler's weights never change here).
    per_episode_weights: take newer weights only between episodes (module docstring).
    refill_rows: while new episodes wait, a decode chunk ends as soon as this many more slots are free (they
      are admitted together in the next call); None: a quarter of the slots. 1 refills a slot at once; more
      rows per admission mean fewer device calls (each costs a fixed dispatch, sync and cache-window copy, and
      on a CPU a read of all the weights) for some idle slot-steps (`benchmarks.rollout --refill_rows=1,4`
      measures both).
  """

  def __init__(self, slots: SlotSampler, tokenizer: Tokenizer, *, limits: EpisodeLimits, decoding: SamplingParams,
               step_timeout_s: float | None = None, env_workers: int | None = None,
               follower: WeightFollower | None = None, per_episode_weights: bool = False,
               refill_rows: int | None = None):
    if limits.max_seq_len > slots.max_seq_len:
      raise ValueError(f'ContinuousRunner: limits.max_seq_len={limits.max_seq_len} exceeds the slot sampler\'s '
                       f'max_seq_len={slots.max_seq_len}.')
    self.slots = slots
    self.tokenizer = tokenizer
    self.limits = limits
    self.decoding = decoding
    self.step_timeout_s = step_timeout_s
    self.follower = follower
    self.per_episode_weights = per_episode_weights
    self.refill_rows = max(1, slots.num_slots // 4) if refill_rows is None else int(refill_rows)
    if self.refill_rows < 1:
      raise ValueError(f'ContinuousRunner: refill_rows={refill_rows} must be >= 1.')
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=env_workers or slots.num_slots,
                                                       thread_name_prefix='env')
    self._waiting: collections.deque[tuple[Hashable, Env, int, int, EpisodeRules]] = collections.deque()
    self._running: dict[int, _Running] = {}
    # Started episodes offered to the slots' device refill (`SlotSampler.device_refill`), not in a slot yet.
    self._staged: collections.deque[_Running] = collections.deque()
    # An env step's slot and episode: the slot may have gone to a queued episode meanwhile (a final turn).
    self._env_steps: dict[concurrent.futures.Future, tuple[int, _Running]] = {}
    self._admissions: list[Admission] = []
    self._draining = False
    self._dropped: dict[int, _Running] = {}  # Slots of dropped episodes whose env step is still running.

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)

  # ---- Streaming API.

  def submit(self, envs: Sequence[Env], *, seeds: Sequence[int], group_ids: Sequence[int] | None = None,
             keys: Sequence[Hashable] | None = None) -> None:
    """Queues fresh envs (reset when they get a slot); `keys` name them in `step`'s results."""
    group_ids = [-1] * len(envs) if group_ids is None else list(group_ids)
    keys = list(range(len(envs))) if keys is None else list(keys)
    if not len(seeds) == len(group_ids) == len(keys) == len(envs):
      raise ValueError(f'ContinuousRunner.submit: {len(seeds)} seeds, {len(group_ids)} group ids and {len(keys)} '
                       f'keys for {len(envs)} envs.')
    if not envs:
      return
    rules = EpisodeRules.make(self.slots.stop_ids, self.tokenizer, envs, limits=self.limits,
                              decoding=self.decoding, step_timeout_s=self.step_timeout_s)
    for key, env, seed, group_id in zip(keys, envs, seeds, group_ids):
      self._waiting.append((key, env, int(seed), int(group_id), rules))

  @property
  def pending(self) -> int:
    """Episodes submitted and not finished (waiting or running)."""
    return len(self._waiting) + len(self._staged) + len(self._running)

  @property
  def busy(self) -> bool:
    """Episodes are pending, or dropped ones' env steps still hold their slots (`step` frees them)."""
    return bool(self.pending or self._dropped)

  @property
  def free_slots(self) -> int:
    return (self.slots.num_slots - len(self._running) - len(self._dropped) - len(self._waiting)
            - len(self._staged))

  def drop(self, select: Callable[[Hashable, int | None], bool]) -> list[Hashable]:
    """Ends every waiting or running episode for which `select(key, oldest_version)` is true (`oldest_version`:
    the version of its first token, None before it has one) and returns their keys. A dropped episode's slot
    is free at once, or, while its env step runs, when that ends (its result is discarded)."""
    keys = []
    waiting, self._waiting = self._waiting, collections.deque()
    for item in waiting:
      if select(item[0], None):
        keys.append(item[0])
      else:
        self._waiting.append(item)
    staged, self._staged = self._staged, collections.deque()
    for run in staged:
      if select(run.key, None):
        keys.append(run.key)
      else:
        self._staged.append(run)
    doomed = [s for s, run in self._running.items() if select(run.key, run.oldest_version)]
    if not doomed:
      return keys
    stepping = {slot for slot, run in self._env_steps.values() if self._running.get(slot) is run}
    self._admissions = [a for a in self._admissions if a.slot not in doomed]
    for slot in doomed:
      run = self._running.pop(slot)
      keys.append(run.key)
      if slot in stepping:
        self._dropped[slot] = run
      else:
        self.slots.release(slot)
    return keys

  def drop_older_than(self, version: int) -> list[Hashable]:
    """Drops (`drop`) the running episodes whose first token came from a version below `version` (module
    docstring); returns their keys."""
    return self.drop(lambda key, oldest: oldest is not None and oldest < version)

  def step(self) -> list[tuple[Hashable, structs.Trajectory]]:
    """One round of the loop (harvest, fill, admit, decode); returns the episodes that finished in it."""
    done: list[tuple[Hashable, structs.Trajectory]] = []
    self._harvest(done, block=False)
    self._fill()
    admissions, self._admissions = self._admissions, []
    worked = bool(admissions) or self.slots.any_active
    if worked:  # One call: the admissions, then the decode chunk.
      busy = sorted({int(s) for s in self.slots.active.nonzero()[0]} | {a.slot for a in admissions})
      refill = None
      waiting = len(self._waiting) + len(self._staged)
      if waiting and not self._draining:  # Newcomers wait: end the chunk when `refill_rows` slots free up.
        refill = min(self.refill_rows, waiting)
      staged = [] if self._draining else list(self._staged)
      queue = [NewEpisode(run.episode.prompt_ids, turn_budget(run.episode, self.limits), run.seed,
                          final=_last_turn(run.episode)) for run in staged]
      self._device_call(lambda: self.slots.step(admissions, self.decoding, refill=refill, queue=queue), busy,
                        staged)
    if not worked and self._env_steps and not done:
      self._harvest(done, block=True)
    return done

  def run(self) -> list[tuple[Hashable, structs.Trajectory]]:
    """Steps until every submitted episode has finished; returns them in the order they finished."""
    out = []
    try:
      while self.pending:
        out += self.step()
    except BaseException:
      self.reset()
      raise
    return out

  def reset(self) -> None:
    """Drops every waiting and running episode (after an error) and frees their slots."""
    for fut in self._env_steps:
      fut.cancel()
    for slot in list(self._running):
      self.slots.release(slot)
    self._waiting.clear()
    self._staged.clear()
    self._running.clear()
    self._env_steps.clear()
    for slot in self._dropped:
      self.slots.release(slot)
    self._dropped.clear()
    self._admissions = []
    self._draining = False

  # ---- Internals.

  def _harvest(self, done: list, *, block: bool) -> None:
    if not self._env_steps:
      return
    if block:
      concurrent.futures.wait(list(self._env_steps), return_when=concurrent.futures.FIRST_COMPLETED)
    for fut in [f for f in self._env_steps if f.done()]:
      slot, run = self._env_steps.pop(fut)
      if self._dropped.get(slot) is run:  # Dropped while the env stepped: the result is not wanted.
        del self._dropped[slot]
        self.slots.release(slot)
        continue
      obs = fut.result()  # An error escaping `absorb` (a broken env contract) stops the run, as in run_episodes.
      holds_slot = self._running.get(slot) is run  # Else a queued episode took the slot when the last turn ended.
      if obs is None:
        if holds_slot:
          del self._running[slot]
          self.slots.release(slot)
        done.append((run.key, finish(run.episode, run.rules)))
      elif not holds_slot:
        raise RuntimeError(f'Episode {run.key!r}: its last turn (max_turns={run.episode.env.max_turns}) went on '
                           'to another; its slot was refilled when it ended.')
      else:
        self._admissions.append(Admission(slot, obs, new=False, budget=turn_budget(run.episode, self.limits),
                                          final=_last_turn(run.episode)))

  def _fill(self) -> None:
    if self.follower is not None and self.per_episode_weights:
      if self.follower.newer():
        if self._running:
          self._draining = True  # Hold new episodes back until the running ones finish.
        else:
          self.follower.refresh()
          self._draining = False
    if self._draining:
      return
    free = [s for s in range(self.slots.num_slots) if s not in self._running and s not in self._dropped]
    while free and (self._staged or self._waiting):
      run = self._staged.popleft() if self._staged else self._start(self._waiting.popleft())
      slot = free.pop(0)
      self._running[slot] = run
      ep = run.episode
      self._admissions.append(Admission(slot, ep.prompt_ids, new=True, budget=turn_budget(ep, self.limits),
                                        seed=run.seed, final=_last_turn(ep)))
    if self.slots.device_refill:  # Offer the next ones to slots whose episode ends in the coming chunk.
      while self._waiting and len(self._staged) < self.slots.queue_rows:
        self._staged.append(self._start(self._waiting.popleft()))

  @staticmethod
  def _start(item: tuple[Hashable, Env, int, int, EpisodeRules]) -> _Running:
    key, env, seed, group_id, rules = item
    return _Running(key, start_episode(env, group_id, rules), seed, rules)

  def _device_call(self, call: Callable[[], list[SlotTokens]], slots: Sequence[int],
                   staged: Sequence[_Running] = ()) -> None:
    if self.follower is not None and not self.per_episode_weights:
      self.follower.refresh()
    t0 = time.perf_counter()
    results = call()
    seconds = time.perf_counter() - t0
    for slot in slots:
      self._running[slot].episode.generate_seconds += seconds
    taken = set()
    for r in results:
      if r.queued is not None:  # A staged episode took the slot (its previous episode's turn ended above).
        run = staged[r.queued]
        run.episode.generate_seconds += seconds
        self._running[r.slot] = run
        taken.add(id(run))
      run = self._running[r.slot]
      if run.oldest_version is None:
        run.oldest_version = r.version
      run.ids += r.ids
      run.logprobs += r.sampling_logprobs
      run.policy_logprobs += r.logprobs
      run.versions += [r.version] * len(r.ids)
      if r.ended:
        self._end_turn(r.slot, run)
    if taken:
      self._staged = collections.deque(run for run in self._staged if id(run) not in taken)

  def _end_turn(self, slot: int, run: _Running) -> None:
    gen = Generation(run.ids, run.logprobs, run.policy_logprobs, min(run.versions))
    run.episode.info.setdefault('token_versions', []).extend(run.versions)
    run.ids, run.logprobs, run.policy_logprobs, run.versions = [], [], [], []
    fut = self._pool.submit(absorb, run.episode, gen, run.rules)
    self._env_steps[fut] = (slot, run)


def _last_turn(ep: Episode) -> bool:
  """The episode's next turn is its last (`absorb` ends it after that turn whatever the env says)."""
  return len(ep.turns) + 1 >= max(ep.env.max_turns, 1)


def run_continuous(slots: SlotSampler, tokenizer: Tokenizer, envs: Sequence[Env], *, limits: EpisodeLimits,
                   decoding: SamplingParams, seeds: Sequence[int], group_ids: Sequence[int] | None = None,
                   step_timeout_s: float | None = None, env_workers: int | None = None,
                   follower: WeightFollower | None = None,
                   per_episode_weights: bool = False, refill_rows: int | None = None) -> list[structs.Trajectory]:
  """Plays one episode per env through the slots (module docstring); the same arguments and result as
  `run_episodes` (one `Trajectory` per env, in order), plus the runner's options (`ContinuousRunner`)."""
  runner = ContinuousRunner(slots, tokenizer, limits=limits, decoding=decoding, step_timeout_s=step_timeout_s,
                            env_workers=env_workers, follower=follower, per_episode_weights=per_episode_weights,
                            refill_rows=refill_rows)
  try:
    runner.submit(envs, seeds=seeds, group_ids=group_ids)
    done = dict(runner.run())
  finally:
    runner.close()
  return [done[i] for i in range(len(envs))]
