"""Actors: play episodes with the newest published weights and feed the trajectory queue.

    publisher = WeightPublisher()
    publisher.publish(learner.policy_model(), version=learner.step)      # after every learner update
    engine = make_engine(publisher, tokenizer, task, settings, group_size=G)   # settings: GenerateConfig
    actor = Actor(engine, tokenizer, task, prompts, publisher=publisher, settings=settings, limits=..., seed=...)
    items = actor.play()           # sync mode: one call of the episode runner, items of whole groups
    thread = ActorThread(actor, queue); thread.start()    # async mode: play -> queue.put, until stopped

The engine is a static batch backend (`SamplerBackend`) or a slot engine (`SlotSampler`, continuous batching:
its thread streams, a prompt entering when a slot frees and the queue has room). Rules:
* weights: an actor compares versions before every turn (`weight_switch='turn'`: an episode may go on with
  newer weights, each turn records its version) or before each batch of episodes ('episode'). An async actor
  (`wait_for_weights=False`) takes the newest *computed* version (`WeightPublisher.latest(computed=True)`), never
  one still in flight, whose read would stall it behind the learner's update; a sync actor takes the newest;
* staleness (async, continuous): between device calls the actor ends every episode the queue's staleness
  filter is bound to drop (started before the published version minus `max_staleness`; GRPO: its whole group)
  and counts it in `dropped_stale`, so its slot takes a fresh episode at once;
* prompts come from the shared `PromptSource` (`sao_jax.rollout.prompts`), numbered in the order taken; a
  prompt's G rollouts share its number as `group_id`, and episode seeds derive from (run seed, number, j).
"""

from __future__ import annotations

import threading

from absl import logging
import jax

from sao_jax import structs
from sao_jax.envs.base import Task
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.slots import SlotSampler
from sao_jax.generate.weights import WeightPublisher, WeightsSource
from sao_jax.rollout.backends import SamplerBackend, make_backend, task_stop_ids
from sao_jax.rollout.continuous import ContinuousRunner
from sao_jax.rollout.episodes import EpisodeLimits, episode_seed, run_episodes
from sao_jax.rollout.prompts import PromptSource
from sao_jax.rollout.trajectory_queue import QueueClosed, TrajectoryQueue
from sao_jax.tokenizers import Tokenizer

Engine = SamplerBackend | SlotSampler


def make_engine(publisher: WeightPublisher, tokenizer: Tokenizer, task: Task, settings: GenerateConfig, *,
                group_size: int = 1, cache_sharding: jax.sharding.Sharding | None = None) -> Engine:
  """An actor's engine over the newest published weights: a `SlotSampler` with `settings.continuous` (its
  cache's keys and values on `cache_sharding`; None: with the weights), else a static `SamplerBackend`; either
  holds `episodes_per_call(group_size)` episodes at once."""
  model, version = publisher.latest()
  rows = settings.episodes_per_call(group_size)
  if not settings.continuous:
    return make_backend(model, tokenizer, task, settings, batch_size=rows, version=version)
  return SlotSampler.from_settings(WeightsSource(model, version=version), settings, num_slots=rows,
                                   stop_ids=task_stop_ids(task, tokenizer), pad_id=tokenizer.pad_id,
                                   cache_sharding=cache_sharding)


class _Follower:
  """Takes newer published weights into an engine's `WeightsSource` (before a turn, or only before a batch);
  with `wait=False` the newest computed ones (`WeightPublisher.latest(computed=True)`), never waiting for an
  update. Over a static backend it is also the `Backend` the episode runner calls."""

  def __init__(self, source: WeightsSource, publisher: WeightPublisher, per_turn: bool, wait: bool = True,
               inner: SamplerBackend | None = None):
    self.source = source
    self.inner = inner
    self.publisher = publisher
    self.per_turn = per_turn
    self.wait = wait
    self.stop_ids = () if inner is None else inner.stop_ids

  def newer(self) -> bool:
    published = self.publisher.version if self.wait else self.publisher.computed_version
    return published > self.source.version

  def refresh(self) -> None:
    if self.newer():
      model, version = self.publisher.latest(computed=not self.wait)
      self.source.update_weights(model, version=version)

  def first_turn(self, prompts, budgets, *, decoding, seeds):
    self.refresh()
    return self.inner.first_turn(prompts, budgets, decoding=decoding, seeds=seeds)

  def next_turn(self, handle, observations, budgets, *, decoding):
    if self.per_turn:
      self.refresh()
    return self.inner.next_turn(handle, observations, budgets, decoding=decoding)


class Actor:
  """Plays batches of episodes: `settings.episodes_per_call(group_size)` rows, `group_size` rollouts a prompt.

  Args:
    engine: this actor's engine (`make_engine`; one per actor thread: engines are not shared): a `SlotSampler`
      plays through continuous batching, its slots refilled as episodes end (newer weights taken between decode
      chunks, or between episodes with `weight_switch='episode'`); a `SamplerBackend` plays static batches.
    tokenizer, task: the run's tokenizer and task.
    prompts: the shared `PromptSource`.
    publisher: where the newest weights come from.
    settings: the generation settings (`GenerateConfig.from_config(config)`).
    limits: episode budgets.
    seed: the run seed (episode seeds derive from it).
    group_size: rollouts per prompt (`config.algo.group_size`).
    step_timeout_s: wall-clock bound of one env step.
    max_staleness: continuous batching in async mode (`config.trainer.max_staleness`): episodes in flight that
      the staleness filter would drop are ended early and counted (module docstring); None: never.
    wait_for_weights: True (sync mode): newer published weights are taken at once, the next call waiting for
      the update that computes them; False (async mode): only once computed (module docstring).
  """

  def __init__(self, engine: Engine, tokenizer: Tokenizer, task: Task, prompts: PromptSource, *,
               publisher: WeightPublisher, settings: GenerateConfig, limits: EpisodeLimits, seed: int,
               group_size: int = 1, step_timeout_s: float | None = None, max_staleness: int | None = None,
               wait_for_weights: bool = True):
    continuous = isinstance(engine, SlotSampler)
    source = engine.source if continuous else engine.sampler.source
    self.backend = _Follower(source, publisher, per_turn=settings.weight_switch == 'turn', wait=wait_for_weights,
                             inner=None if continuous else engine)
    self.settings = settings
    self.tokenizer = tokenizer
    self.task = task
    self.prompts = prompts
    self.limits = limits
    self.decoding = settings.decoding
    self.seed = int(seed)
    self.group_size = int(group_size)
    self.prompts_per_call = settings.episodes_per_call(self.group_size) // self.group_size
    self.step_timeout_s = step_timeout_s
    self.generated_tokens = 0  # Action tokens generated so far (the trainer's actor tokens/s).
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self.compile_ahead = settings.compile_ahead
    self.dropped_stale = 0  # Trajectories ended in flight because they could only come back too stale.
    self.runner: ContinuousRunner | None = None
    if continuous:
      self.runner = ContinuousRunner(engine, tokenizer, limits=limits, decoding=self.decoding,
                                     step_timeout_s=step_timeout_s, follower=self.backend,
                                     per_episode_weights=settings.weight_switch == 'episode',
                                     refill_rows=settings.refill_rows)
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
