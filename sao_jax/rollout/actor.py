"""Actors: play episodes with the latest published weights and feed the trajectory queue.

    publisher = WeightPublisher()
    publisher.publish(learner.policy_model(), version=learner.step)      # after every learner update
    actor = Actor(backend, tokenizer, task, prompts, publisher=publisher, limits=..., decoding=..., ...)
    items = actor.play()           # sync mode: one call of the episode runner, items of whole groups
    thread = ActorThread(actor, queue); thread.start()    # async mode: play -> queue.put, until stopped

With `continuous=True` (`config.sampler.continuous`) the actor plays through continuous batching
(`sao_jax.rollout.continuous`): `episodes_per_call` decode slots refilled as episodes end; in async mode its
thread streams (a prompt enters when a slot frees and the queue has room; an item is put when its episodes end).
With `max_staleness` (async mode) the thread also ends, between device calls, every episode in flight that the
queue's staleness filter is bound to drop (its first token's version is below the published version minus
`max_staleness`: versions only grow) and counts it in `dropped_stale`: its slot takes a fresh episode at once
instead of finishing doomed turns and tool calls (GRPO: the whole group goes, as the queue would drop it).
The slot sampler's programs compile at their first use, or all before the first episode with `compile_ahead`
(`config.sampler.compile_ahead`); they are shared by every actor of the process.

Weights. `WeightPublisher.publish` copies the learner's policy state onto the actors' sharding (one jitted
copy, dispatched asynchronously: the learner does not wait for it, and the copy survives the learner donating
its own buffers at the next update). An actor compares versions at every turn (`weight_switch='turn'`,
turn-level partial rollout: a multi-turn episode may go on with newer weights, every turn records its version)
or only before each batch of episodes (`'episode'`: one version per episode) and converts the new weights to
the sampler's decode layout in its own thread. The trainer publishes right after dispatching an update, so the
published arrays are futures of that update: an async actor (`wait_for_weights=False`) takes the newest
computed version (`WeightPublisher.latest(computed=True)`), never one in flight: taking that would stall its
next device call behind the whole update, even on devices of its own (a program waits for its inputs), and
leave the actors idle for every update. A sync actor waits: it must play the newest.

Prompts come from the shared `PromptSource` (`sao_jax.rollout.prompts`), numbered in the order taken.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from absl import logging
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sao_jax import structs
from sao_jax.envs.base import Task
from sao_jax.generate.slots import SlotSampler
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout.backends import SamplerBackend
from sao_jax.rollout.continuous import ContinuousRunner
from sao_jax.rollout.episodes import EpisodeLimits, episode_seed, run_episodes
from sao_jax.rollout.prompts import PromptSource
from sao_jax.rollout.trajectory_queue import QueueClosed, TrajectoryQueue
from sao_jax.tokenizers import Tokenizer

WEIGHT_SWITCHES = ('turn', 'episode')


class _FollowingBackend:
  """A `SamplerBackend` that takes newer published weights before a turn (or only before a batch); with
  `wait=False` the newest computed ones (`WeightPublisher.latest(computed=True)`), never waiting for an update."""

  def __init__(self, inner: SamplerBackend, publisher: WeightPublisher, per_turn: bool, wait: bool = True):
    self.inner = inner
    self.publisher = publisher
    self.per_turn = per_turn
    self.wait = wait
    self.stop_ids = inner.stop_ids

  def newer(self) -> bool:
    published = self.publisher.version if self.wait else self.publisher.computed_version
    return published > self.inner.sampler.version

  def refresh(self) -> None:
    if self.newer():
      model, version = self.publisher.latest(computed=not self.wait)
      self.inner.update_weights(model, version=version)

  def first_turn(self, prompts, budgets, *, decoding, seeds):
    self.refresh()
    return self.inner.first_turn(prompts, budgets, decoding=decoding, seeds=seeds)

  def next_turn(self, handle, observations, budgets, *, decoding):
    if self.per_turn:
      self.refresh()
    return self.inner.next_turn(handle, observations, budgets, decoding=decoding)


class Actor:
  """Plays batches of episodes: `episodes_per_call` rows, `group_size` rollouts per prompt.

  Args:
    backend: this actor's KV-cache sampler backend (one per actor thread: samplers are not shared).
    tokenizer, task: the run's tokenizer and task.
    prompts: the shared `PromptSource`.
    publisher: where the newest weights come from.
    limits: episode budgets.
    decoding: sampling settings (`SamplingParams.from_config(config.sampler)`).
    seed: the run seed (episode seeds derive from it).
    group_size: rollouts per prompt (`config.algo.group_size`).
    episodes_per_call: rows of one call of the episode runner (`config.sampler.batch_size`, rounded down to
      whole groups).
    weight_switch: 'turn' or 'episode' (see the module docstring).
    step_timeout_s: wall-clock bound of one env step.
    continuous: play through continuous batching (`config.sampler.continuous`): `episodes_per_call` decode
      slots of a `SlotSampler` over the backend's sampler (same weights), refilled as episodes end; newer
      weights are taken between decode chunks ('turn') or between episodes ('episode').
    decode_steps: decode steps per continuous chunk (`config.sampler.decode_steps`).
    refill_rows: continuous: free slots a decode chunk waits for while episodes wait
      (`config.sampler.refill_rows`, see `ContinuousRunner`; None: a quarter of the slots).
    prefix_cache: continuous: new episodes start from the cache of their prompts' shared prefix
      (`config.sampler.prefix_cache`, see `SlotSampler`).
    fuse_admissions: continuous: short admissions are written by the decode chunk's first step
      (`config.sampler.fuse_admissions`, see `SlotSampler.step`).
    device_refill: continuous: a slot whose episode's last turn ends takes the next episode inside the decode
      chunk (`config.sampler.device_refill`, see `SlotSampler`).
    queue_chunk: continuous, `device_refill`: the longest prompt past the shared prefix taken that way
      (`config.sampler.queue_chunk`; None: the smallest chunk bucket).
    row_groups: continuous: decode chunks may run their shorter-history slots at a smaller attention window
      (`config.sampler.row_groups`, see `SlotSampler`).
    admission_rows: continuous: 'auto', 'exact' or 'padded' (`config.sampler.admission_rows`, see `SlotSampler`).
    slot_sampler: an existing `SlotSampler` over `backend.sampler` to reuse.
    cache_sharding: continuous: where the slot cache's keys and values go (`SlotSampler`'s `cache_sharding`;
      the trainer's: kv heads split over the actors' mesh as `config.mesh.rules` say); None: with the weights.
    max_staleness: continuous batching in async mode (`config.trainer.max_staleness`): episodes in flight that
      the staleness filter would drop are ended early and counted (module docstring); None: never.
    compile_ahead: continuous batching: `warmup` compiles every slot program (`config.sampler.compile_ahead`);
      otherwise each compiles at its first use.
    wait_for_weights: True (sync mode): newer published weights are taken at once, the next call waiting for
      the update that computes them; False (async mode): only once computed, so the actor never stalls behind
      the learner's update (module docstring).
  """

  def __init__(self, backend: SamplerBackend, tokenizer: Tokenizer, task: Task, prompts: PromptSource, *,
               publisher: WeightPublisher, limits: EpisodeLimits, decoding: SamplingParams, seed: int,
               group_size: int = 1, episodes_per_call: int = 16, weight_switch: str = 'turn',
               step_timeout_s: float | None = None, continuous: bool = False, decode_steps: int = 16,
               refill_rows: int | None = None, prefix_cache: bool = True, fuse_admissions: bool = False,
               device_refill: bool = False, queue_chunk: int | None = None, row_groups: bool = False,
               admission_rows: str = 'auto',
               slot_sampler: SlotSampler | None = None, cache_sharding: jax.sharding.Sharding | None = None,
               max_staleness: int | None = None, compile_ahead: bool = False, wait_for_weights: bool = True):
    if weight_switch not in WEIGHT_SWITCHES:
      raise ValueError(f'weight_switch={weight_switch!r} is not one of {WEIGHT_SWITCHES}.')
    self.backend = _FollowingBackend(backend, publisher, per_turn=weight_switch == 'turn', wait=wait_for_weights)
    self.tokenizer = tokenizer
    self.task = task
    self.prompts = prompts
    self.limits = limits
    self.decoding = decoding
    self.seed = int(seed)
    self.group_size = int(group_size)
    self.prompts_per_call = max(1, int(episodes_per_call) // self.group_size)
    self.step_timeout_s = step_timeout_s
    self.generated_tokens = 0  # Action tokens generated so far (the trainer's actor tokens/s).
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self.compile_ahead = bool(compile_ahead)
    self.dropped_stale = 0  # Trajectories ended in flight because they could only come back too stale.
    self.runner: ContinuousRunner | None = None
    if continuous:
      slots = slot_sampler or SlotSampler(backend.sampler, num_slots=self.prompts_per_call * self.group_size,
                          max_seq_len=limits.max_seq_len, stop_ids=backend.stop_ids, pad_id=backend.pad_id,
                          decode_steps=decode_steps, prefix_cache=prefix_cache,
                          fuse_admissions=fuse_admissions, device_refill=device_refill,
                          queue_chunk=queue_chunk, row_groups=row_groups, admission_rows=admission_rows,
                          cache_sharding=cache_sharding)
      self.runner = ContinuousRunner(slots, tokenizer, limits=limits, decoding=decoding,
                                     step_timeout_s=step_timeout_s, follower=self.backend,
                                     per_episode_weights=weight_switch == 'episode', refill_rows=refill_rows)
    self._groups: dict[int, list[structs.Trajectory]] = {}

  @property
  def continuous(self) -> bool:
    return self.runner is not None

  def _episodes(self, taken):
    envs, seeds, group_ids = [], [], []
    for number, example in taken:
      for j in range(self.group_size):
        envs.append(self.task.make_env(example))
        seeds.append(episode_seed(self.seed, number, j))
        group_ids.append(number)
    return envs, seeds, group_ids

  def _done(self, t: structs.Trajectory, number: int, uid: str) -> None:
    t.info.setdefault('prompt_number', number)
    t.info.setdefault('uid', uid)
    self.generated_tokens += t.num_action_tokens

  def play(self, num_prompts: int | None = None) -> list[list[structs.Trajectory]]:
    """One call of the episode runner on `num_prompts` prompts (default: a full call); returns items (one
    trajectory, or one prompt's whole group), in prompt order. (Continuous: the call's episodes stream through
    the slots and the call ends when all of them have; `submit` / `collect` stream across calls.)"""
    taken = self.prompts.take(self.prompts_per_call if num_prompts is None else int(num_prompts))
    envs, seeds, group_ids = self._episodes(taken)
    if self.runner is not None:
      self.runner.submit(envs, seeds=seeds, group_ids=group_ids, keys=list(range(len(envs))))
      done = dict(self.runner.run())
      trajs = [done[i] for i in range(len(envs))]
    else:
      trajs = run_episodes(self.backend, self.tokenizer, envs, limits=self.limits, decoding=self.decoding,
                           seeds=seeds, group_ids=group_ids, step_timeout_s=self.step_timeout_s)
    for t, (number, example) in zip(trajs, [x for x in taken for _ in range(self.group_size)]):
      self._done(t, number, example.uid)
    g = self.group_size
    return [trajs[i:i + g] for i in range(0, len(trajs), g)]

  # ---- Streaming (continuous batching; `ActorThread` drives these).

  def room(self) -> int:
    """Prompts (whole groups) the continuous runner can start now without leaving a slot idle."""
    return max(0, self.runner.free_slots) // self.group_size

  def submit(self, num_prompts: int) -> None:
    """Takes `num_prompts` prompts and queues their episodes in the continuous runner."""
    taken = self.prompts.take(num_prompts)
    envs, seeds, group_ids = self._episodes(taken)
    keys = [(number, example.uid) for number, example in taken for _ in range(self.group_size)]
    self.runner.submit(envs, seeds=seeds, group_ids=group_ids, keys=keys)

  def collect(self) -> list[list[structs.Trajectory]]:
    """One step of the continuous runner; returns the items (whole groups) completed by it."""
    items = []
    for (number, uid), t in self.runner.step():
      self._done(t, number, uid)
      group = self._groups.setdefault(number, [])
      group.append(t)
      if len(group) == self.group_size:
        items.append(self._groups.pop(number))
    return items

  def drop_stale(self) -> int:
    """Ends the episodes in flight that the staleness filter is bound to drop (module docstring); returns how
    many trajectories will not come (whole groups), also added to `dropped_stale`."""
    if self.max_staleness is None or self.runner is None:
      return 0
    floor = self.backend.publisher.version - self.max_staleness
    keys = self.runner.drop_older_than(floor)
    if not keys:
      return 0
    n = len(keys)
    if self.group_size > 1:  # The group's other rollouts (waiting, running or finished) go with it.
      numbers = {number for number, _ in keys}
      n += len(self.runner.drop(lambda key, oldest: key[0] in numbers))
      n += sum(len(self._groups.pop(number, [])) for number in numbers)
    self.dropped_stale += n
    logging.info('%d episode(s) in flight ended: they started before version %d, past trainer.max_staleness=%d '
                 'of the published version %d.', n, floor, self.max_staleness, floor + self.max_staleness)
    return n

  def warmup(self) -> None:
    """With `compile_ahead`: compiles the continuous runner's programs (every slot-row bucket and window), so
    that none compiles while episodes run (a compile stalls every slot of the actor). Otherwise nothing: each
    compiles at its first use."""
    if self.compile_ahead:
      self.runner.slots.warmup(self.decoding)

  def abandon(self) -> int:
    """Drops every episode in flight (after a failure); returns how many trajectories will not come."""
    n = self.runner.pending + sum(len(g) for g in self._groups.values())  # Reserved, not put.
    self.runner.reset()
    self._groups.clear()
    return n


class ActorThread(threading.Thread):
  """Runs `actor.play()` and puts its items into `queue` until `stop()` or the queue closes.

  A failing call (an exception escaping the episode runner: env failures inside a step are already caught
  and scored there) is logged with its prompts, counted, and the loop goes on; after `max_consecutive_failures`
  failures in a row the thread ends and keeps the last error in `error` (the trainer restarts it or stops).
  """

  def __init__(self, actor: Actor, queue: TrajectoryQueue, *, index: int = 0, max_consecutive_failures: int = 3):
    super().__init__(name=f'actor-{index}', daemon=True)
    self.actor = actor
    self.queue = queue
    self.max_consecutive_failures = int(max_consecutive_failures)
    self._stop_event = threading.Event()
    self.failures = 0
    self.error: BaseException | None = None

  def stop(self) -> None:
    self._stop_event.set()

  def _failed(self, error: Exception, what: str, consecutive: int) -> bool:
    """Logs and counts a failure; True when this thread should stop (too many in a row)."""
    self.failures += 1
    self.error = error
    logging.exception('%s: %s failed (%d in a row): %s', self.name, what, consecutive, error)
    if consecutive >= self.max_consecutive_failures:
      logging.error('%s: stopping after %d consecutive failures.', self.name, consecutive)
      return True
    return False

  def _put_all(self, items) -> bool:
    """Puts finished items into their reserved room; False once the queue is closed (the thread ends)."""
    try:
      for item in items:
        self.queue.put(item, reserved=True)
    except QueueClosed:
      return False
    return True

  def run(self) -> None:
    if self.actor.continuous:
      self._run_continuous()
      return
    consecutive = 0
    n = self.actor.prompts_per_call * self.actor.group_size
    while not self._stop_event.is_set():
      try:
        if not self.queue.reserve(n, timeout=1.0):  # Room for what this call will generate (bounds staleness).
          continue
      except QueueClosed:
        return
      try:
        items = self.actor.play()
      except Exception as e:  # pylint: disable=broad-except  (logged, counted; the loop goes on)
        self.queue.release(n)
        consecutive += 1
        if self._failed(e, 'a batch of episodes', consecutive):
          return
        continue
      consecutive = 0
      if not self._put_all(items):
        return

  def _run_continuous(self) -> None:
    """Continuous batching: prompts enter as slots free up (each reserving its room in the queue first) and
    items are put as their episodes finish; no call boundary, so no slot waits for a batch to drain. The slot
    sampler's programs are compiled first with `compile_ahead` (`Actor.warmup`)."""
    actor, g = self.actor, self.actor.group_size
    consecutive = 0
    try:
      actor.warmup()
    except Exception as e:  # pylint: disable=broad-except  (as a failed call: logged, counted; the loop goes on)
      consecutive += 1
      if self._failed(e, 'the continuous sampler warm-up', consecutive):
        return
    while not self._stop_event.is_set():
      try:
        dropped = actor.drop_stale()  # Doomed episodes give back their room (counted by the actor).
        if dropped:
          self.queue.release(dropped)
        while actor.room() > 0 and self.queue.reserve(g, timeout=0.0 if actor.runner.busy else 1.0):
          actor.submit(1)
        if not actor.runner.busy:
          continue
        items = actor.collect()
      except QueueClosed:
        return
      except Exception as e:  # pylint: disable=broad-except  (logged, counted; the loop goes on)
        self.queue.release(actor.abandon())
        consecutive += 1
        if self._failed(e, 'continuous episodes', consecutive):
          return
        continue
      if items:
        consecutive = 0
      if not self._put_all(items):
        return


def play_rows(actor: Actor, rows: int) -> list[structs.Trajectory]:
  """Sync mode: exactly `rows` trajectories (whole groups) from calls of at most one full call each."""
  if rows % actor.group_size:
    raise ValueError(f'rows={rows} is not a multiple of group_size={actor.group_size}.')
  out: list[structs.Trajectory] = []
  while len(out) < rows:
    prompts = min(actor.prompts_per_call, (rows - len(out)) // actor.group_size)
    for item in actor.play(prompts):
      out.extend(item)
  return out
