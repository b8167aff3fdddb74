"""Discrete-event simulator of the asynchronous actor-learner pipeline (pure Python + NumPy, no jax).

It models the data flow of docs/design.md at the granularity of whole episodes:

  N actor slots ──episode (turns: decode gen tokens at `tokens_per_s`, tool call, observation)──▶
  [GRPO: group buffer until all G members are done] ──▶ bounded queue (the slot waits while it is full) ──
  staleness filter ──▶ learner step on B trajectories (B/G whole groups) ──▶ version v+1 ──publish delay──▶
  actors (at their next turn if `turn_level_switch`, else at their next episode)

Events are one per episode (its end), one per learner step and one per sync round, kept in a heap; the
durations of a block of episodes (all their turns) are sampled at once with NumPy. The weights version a
turn used is not an event: publishing times are a sorted list, and when an episode ends every turn start
is in the past, so each turn's version is a `searchsorted` of its start time into that list (a publish
that has not happened yet lies after the episode's end, hence after all its turns).

Definitions (all measured over the window [warmup_s, duration_s]):
  version v                 number of learner steps completed; step v+1 trains on a batch with params v.
  staleness of a trajectory v_learner - (version of its oldest turn), at the start of the step that trains
                            it; `token_staleness` weights each turn's version by its generated tokens.
  filter                    a trajectory (GRPO: a group, by its stalest member) with staleness >
                            max_staleness is dropped — when it reaches the queue, and whenever the version
                            grows while it waits there. GRPO drops the WHOLE group: its advantages are
                            normalised within the group, so a group with a member cut out has another baseline
                            (and a smaller G); dropping the group counts all G trajectories as dropped.
  learner utilisation       time the learner is in a step / window.
  actor utilisation         time the slots hold an episode (decoding, tool calls, observation prefill) /
                            (N * window); `actor_blocked` is the time slots wait on a full queue.
  sync mode                 a round launches k*B episodes (k = sync_steps_per_round) with the published
                            weights; when all of them are done the learner takes k steps back to back (the
                            j-th one on data of staleness j); then the weights are published and, after the
                            delay, the next round starts. Actors are idle during the update, the learner
                            during generation. Closed form with constant episode time E, N >= k*B:
                            period = E + k * step_time + publish_delay.
  async mode                slots start a new episode as soon as they are free (and not blocked); the learner
                            starts a step as soon as the queue holds B trajectories.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import math
from typing import Any

import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.sim.dists import Dist

MODES = ('async', 'sync')

# Where an episode is at the end of the run; each episode is in exactly one of these.
RUNNING, GROUPING, BLOCKED, QUEUED, TRAINING, TRAINED, DROPPED = range(7)
FATES = ('running', 'grouping', 'blocked', 'queued', 'training', 'trained', 'dropped')

_DONE, _STEP_DONE, _ROUND_START = 0, 1, 2  # Event kinds.


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """The pipeline to simulate. Times in seconds, lengths in tokens."""
  num_slots: int = 8  # N actor slots (concurrent episodes).
  batch_size: int = 8  # B trajectories per learner step.
  group_size: int = 1  # G: 1 = SAO (single rollouts, taken as they arrive); G > 1 = GRPO (whole groups only).
  mode: str = 'async'  # 'async' | 'sync'.
  sync_steps_per_round: int = 1  # sync: learner steps per generation round (k*B episodes per round).
  tokens_per_s: float = 30.0  # Decode speed of one slot (generated tokens / s).
  prefill_tokens_per_s: float = math.inf  # Prefill speed of observation tokens in one slot (inf = free).
  prompt_tokens: float = 0.0  # Prompt length (counts in the step's tokens and the context cap).
  turns: Dist = Dist('constant', 1.0)  # Turns per episode (rounded, >= 1).
  gen_tokens: Dist = Dist('constant', 1000.0)  # Generated tokens per turn.
  obs_tokens: Dist = Dist('constant', 0.0)  # Observation (tool output) tokens after each turn but the last.
  tool_latency_s: Dist = Dist('constant', 0.0)  # Tool-call latency after each turn but the last.
  max_episode_tokens: float = math.inf  # Context cap: the episode is cut (truncated) where it reaches it.
  prompt_sigma: float = 0.0  # Per-prompt log-normal factor (mean 1) on gen tokens, shared by a group.
  step_time_s: Dist = Dist('constant', 1.0)  # Learner step time, fixed part (sampled per step).
  step_time_per_token_s: float = 0.0  # Learner step time per token of the batch (prompt + gen + obs).
  publish_delay_s: float = 0.0  # From the end of a step to its weights being usable by the actors.
  max_staleness: float = math.inf  # Staleness bound (inf = no bound).
  queue_capacity: int = 0  # Trajectories the queue holds; full -> the slot waits. 0 = 2B (sync: max(2, k) * B).
  turn_level_switch: bool = True  # Episodes take newer weights between turns (else at the next episode).
  duration_s: float = 3600.0  # Simulated time.
  warmup_s: float = 0.0  # Start of the measurement window.
  seed: int = 0

  @property
  def capacity(self) -> int:
    k = self.sync_steps_per_round if self.mode == 'sync' else 1
    return self.queue_capacity or max(2, k) * self.batch_size

  def validate(self) -> SimConfig:
    """Raises ConfigError naming the field; returns self."""
    def need(ok, field, why):
      if not ok:
        raise ConfigError(f'sim.{field}={getattr(self, field)!r}: {why}')
    need(self.mode in MODES, 'mode', f'must be one of {MODES}')
    need(self.num_slots >= 1, 'num_slots', 'must be >= 1')
    need(self.group_size >= 1, 'group_size', 'must be >= 1')
    need(self.batch_size >= 1 and self.batch_size % self.group_size == 0, 'batch_size',
         f'must be a positive multiple of group_size={self.group_size}')
    need(self.sync_steps_per_round >= 1, 'sync_steps_per_round', 'must be >= 1')
    need(self.tokens_per_s > 0, 'tokens_per_s', 'must be > 0')
    need(self.prefill_tokens_per_s > 0, 'prefill_tokens_per_s', 'must be > 0')
    need(self.max_staleness >= 0, 'max_staleness', 'must be >= 0 (inf = no bound)')
    need(self.queue_capacity == 0 or self.queue_capacity >= self.batch_size, 'queue_capacity',
         f'must be 0 (= 2 * batch_size) or >= batch_size={self.batch_size}')
    need(self.mode == 'async' or self.capacity >= self.sync_steps_per_round * self.batch_size, 'queue_capacity',
         'sync mode needs room for a whole round (sync_steps_per_round * batch_size)')
    need(self.duration_s > 0 and 0 <= self.warmup_s < self.duration_s, 'warmup_s', 'need 0 <= warmup_s < duration_s')
    need(self.prompt_sigma >= 0, 'prompt_sigma', 'must be >= 0')
    need(self.publish_delay_s >= 0, 'publish_delay_s', 'must be >= 0')
    need(self.step_time_per_token_s >= 0, 'step_time_per_token_s', 'must be >= 0')
    for f in ('turns', 'gen_tokens', 'obs_tokens', 'tool_latency_s', 'step_time_s'):
      getattr(self, f).validate(f'sim.{f}')
    return self

  def to_dict(self) -> dict[str, Any]:
    d = {}
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      d[f.name] = v.to_dict() if isinstance(v, Dist) else ('inf' if v == math.inf else v)
    return d

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> SimConfig:
    """Inverse of to_dict; distribution fields accept anything `Dist.of` reads, numbers accept 'inf'."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for k, v in d.items():
      if k not in names:
        raise ConfigError(f'sim.{k}: unknown field (known: {sorted(names)})')
      if k in ('turns', 'gen_tokens', 'obs_tokens', 'tool_latency_s', 'step_time_s'):
        kw[k] = Dist.of(v)
      elif v == 'inf':
        kw[k] = math.inf
      else:
        kw[k] = v
    return cls(**kw)


class _Episodes:
  """Episode k of the run (k = launch order), sampled in blocks with NumPy.

  Episode k is the same in every mode for a given seed (the block stream does not depend on the schedule).
  """

  def __init__(self, cfg: SimConfig, rng: np.random.Generator, block: int = 4096):
    self.cfg, self.rng = cfg, rng
    self.block = max(block // cfg.group_size, 1) * cfg.group_size
    self.drawn = collections.Counter()  # Samples drawn per distribution (for `cycle`).
    self.base = 0  # Episode index of the current block's first episode.
    self._new_block()

  def _draw(self, name: str, n: int) -> np.ndarray:
    x = getattr(self.cfg, name).sample(self.rng, n, self.drawn[name])
    self.drawn[name] += n
    return x

  def _new_block(self) -> None:
    cfg, m = self.cfg, self.block
    turns = np.maximum(np.rint(self._draw('turns', m)), 1).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(turns)[:-1]])
    n = int(turns.sum())
    ep = np.repeat(np.arange(m), turns)
    gen = self._draw('gen_tokens', n)
    obs = self._draw('obs_tokens', n)
    tool = self._draw('tool_latency_s', n)
    if cfg.prompt_sigma > 0:
      s = cfg.prompt_sigma
      scale = np.exp(-0.5 * s * s + s * self.rng.standard_normal(m // cfg.group_size))
      gen = gen * np.repeat(scale, cfg.group_size)[ep]
    last = np.zeros(n, bool)
    last[first + turns - 1] = True
    obs[last] = 0.0
    tool[last] = 0.0
    if cfg.max_episode_tokens < math.inf:  # Cut the episode where its context reaches the cap.
      ctx = gen + obs
      csum = np.cumsum(ctx)
      before = csum - ctx - np.repeat(csum[first] - ctx[first], turns)  # Context before the turn, in the episode.
      room = cfg.max_episode_tokens - cfg.prompt_tokens - before
      full = room > gen  # The turn's generation completes under the cap: its tool call happens.
      gen = np.clip(room, 0.0, gen)
      obs = np.where(full, np.clip(room - gen, 0.0, obs), 0.0)
      tool = np.where(full, tool, 0.0)
    turn_time = gen / cfg.tokens_per_s + tool + obs / cfg.prefill_tokens_per_s
    csum = np.cumsum(turn_time)
    offset = csum - turn_time - np.repeat(csum[first] - turn_time[first], turns)  # Turn start - episode start.
    self.duration = np.add.reduceat(turn_time, first).tolist()
    self.tokens = (cfg.prompt_tokens + np.add.reduceat(gen + obs, first)).tolist()
    self.first, self.turns = first.tolist(), turns.tolist()
    self.offset, self.gen = offset.tolist(), gen.tolist()

  def get(self, k: int) -> int:
    """Index of episode k in the current block (samples the next block when k passes its end)."""
    i = k - self.base
    if i >= self.block:
      self.base += self.block
      self._new_block()
      i = k - self.base
    return i


@dataclasses.dataclass
class SimResult:
  """What the run measured. Rates are per hour over the window [warmup_s, duration_s]."""
  config: SimConfig
  window_s: float
  learner_utilisation: float
  actor_utilisation: float
  actor_blocked: float
  generated_per_hour: float  # Episodes completed.
  trained_per_hour: float  # Trajectories in learner steps completed.
  dropped_per_hour: float
  steps: int  # Learner steps completed in the window.
  staleness: np.ndarray  # int, one per trained trajectory in the window.
  token_staleness: np.ndarray  # float, per trained trajectory: v_learner - token-weighted mean turn version.
  queue_wait_s: np.ndarray  # Per trained trajectory: start of its step - entry into the queue.
  group_wait_s: np.ndarray  # Per trained trajectory: entry into the queue - its own end (GRPO group barrier).
  counts: dict[str, int]  # Whole run: started, completed, trained, dropped, queue_max and each end-of-run fate.
  fates: np.ndarray  # int8 [started]: fate of each episode at the end of the run (FATES).
  trained_ids: np.ndarray  # Episode ids of every trained trajectory, in training order (whole run).
  end_time: np.ndarray  # [started] episode end times (nan while running).
  enqueue_time: np.ndarray  # [started] time of entry into the queue (nan if never).

  @property
  def trained_per_s(self) -> float:
    return self.trained_per_hour / 3600.0

  def staleness_percentiles(self, qs=(50, 90, 99, 100)) -> dict[str, float]:
    if self.staleness.size == 0:
      return {f'p{q}': math.nan for q in qs}
    return {f'p{q}': float(np.percentile(self.staleness, q)) for q in qs}

  def staleness_histogram(self) -> dict[int, int]:
    return {i: int(c) for i, c in enumerate(np.bincount(self.staleness)) if c} if self.staleness.size else {}

  def summary(self) -> dict[str, Any]:
    """Scalars of the run (JSON-friendly)."""
    def mean(x):
      return float(x.mean()) if x.size else math.nan
    def p90(x):
      return float(np.percentile(x, 90)) if x.size else math.nan
    out = {
        'learner_utilisation': self.learner_utilisation,
        'learner_idle_fraction': 1.0 - self.learner_utilisation,
        'actor_utilisation': self.actor_utilisation,
        'actor_blocked': self.actor_blocked,
        'generated_per_hour': self.generated_per_hour,
        'trained_per_hour': self.trained_per_hour,
        'dropped_per_hour': self.dropped_per_hour,
        'dropped_fraction': self.dropped_per_hour / max(self.dropped_per_hour + self.trained_per_hour, 1e-300),
        'steps': self.steps,
        'staleness_mean': mean(self.staleness),
        'token_staleness_mean': mean(self.token_staleness),
        'queue_wait_mean_s': mean(self.queue_wait_s),
        'queue_wait_p90_s': p90(self.queue_wait_s),
        'group_wait_mean_s': mean(self.group_wait_s),
        'group_wait_p90_s': p90(self.group_wait_s),
    }
    out.update({f'staleness_{k}': v for k, v in self.staleness_percentiles().items()})
    return out


def simulate(cfg: SimConfig) -> SimResult:
  """Runs the pipeline of `cfg` for `cfg.duration_s` simulated seconds; see the module docstring."""
  cfg.validate()
  n_slots, batch, g, cap = cfg.num_slots, cfg.batch_size, cfg.group_size, cfg.capacity
  t_end, t_w = cfg.duration_s, cfg.warmup_s
  sync = cfg.mode == 'sync'
  round_size = cfg.sync_steps_per_round * batch
  max_st = cfg.max_staleness
  ep_seed, step_seed = np.random.SeedSequence(cfg.seed).spawn(2)
  episodes = _Episodes(cfg, np.random.default_rng(ep_seed))
  step_rng = np.random.default_rng(step_seed)

  heap: list[tuple[float, int, int, int]] = []
  seq = 0  # Tie-break of the heap: events at the same time run in the order they were scheduled.
  pub_t, pub_v = [0.0], [0]  # Publishing times (sorted) and versions: weights version pub_v[i] from pub_t[i].
  version = 0
  free = n_slots
  budget = round_size if sync else math.inf  # Episodes the slots may still launch (sync: this round).
  round_left = round_size  # sync: round episodes not yet in the queue (or dropped).
  round_steps = 0
  learner_busy = False
  queue: collections.deque[tuple[list[int], int]] = collections.deque()  # (episode ids, oldest version).
  q_len = q_max = 0  # Trajectories in the queue now, and the most it held.
  blocked: collections.deque[tuple[list[int], float]] = collections.deque()  # (item, since) of waiting slots.
  groups: dict[int, list[int]] = {}  # GRPO: done members of incomplete groups.
  training: list[int] = []
  switch = cfg.turn_level_switch and not sync  # Sync rounds publish only between rounds: no switch to make.
  turn_data: dict[int, tuple[list[float], list[float]]] = {}  # Running multi-turn episodes (when `switch`).

  start, end, ver_min, ver_tok, tokens, enq, fate = [], [], [], [], [], [], []
  trained_ids: list[int] = []
  st_win, tst_win, qw_win, gw_win = [], [], [], []
  busy_actor = busy_learner = blocked_time = 0.0
  gen_win = trained_win = dropped_win = steps_win = 0
  n_trained = n_dropped = n_started = 0  # n_started: learner steps started.

  def clip(a, b):  # Length of [a, b] inside the window.
    return max(0.0, min(b, t_end) - max(a, t_w))

  def launch(t):
    nonlocal free, budget, seq, busy_actor
    while free > 0 and budget > 0:
      k = len(start)
      i = episodes.get(k)
      dur = episodes.duration[i]
      start.append(t)
      end.append(math.nan)
      ver_min.append(0)
      ver_tok.append(0.0)
      tokens.append(episodes.tokens[i])
      enq.append(math.nan)
      fate.append(RUNNING)
      if switch:  # The turn start offsets and generated tokens, for the versions at the episode's end.
        a, n = episodes.first[i], episodes.turns[i]
        if n > 1:
          turn_data[k] = (episodes.offset[a:a + n], episodes.gen[a:a + n])
      busy_actor += clip(t, t + dur)
      heapq.heappush(heap, (t + dur, seq, _DONE, k))
      seq += 1
      free -= 1
      budget -= 1

  def versions(k, t0):
    """(oldest, token-weighted mean) weights version of episode k's turns; started at t0."""
    v0 = pub_v[bisect.bisect_right(pub_t, t0) - 1]
    turns = turn_data.pop(k, None) if switch else None
    if turns is None or pub_t[-1] <= t0:  # One turn, no switching, or no publish since the start.
      return v0, float(v0)
    offsets, gens = turns
    vw = s = 0.0
    for o, w in zip(offsets, gens):  # A few turns: plain bisect beats a NumPy call.
      vw += w * pub_v[bisect.bisect_right(pub_t, t0 + o) - 1]
      s += w
    return v0, vw / s if s > 0 else float(v0)

  def put(item, t):
    """A done trajectory (GRPO: a whole group) enters the queue, or is dropped if stale."""
    nonlocal q_len, q_max, round_left, n_dropped, dropped_win
    oldest = min(ver_min[k] for k in item)
    round_left -= len(item)
    if version - oldest > max_st:
      for k in item:
        fate[k] = DROPPED
      n_dropped += len(item)
      if t >= t_w:
        dropped_win += len(item)
      return
    for k in item:
      fate[k] = QUEUED
      enq[k] = t
    queue.append((item, oldest))
    q_len += len(item)
    q_max = max(q_max, q_len)

  def unblock(t):
    nonlocal free, blocked_time
    while blocked and q_len + len(blocked[0][0]) <= cap:
      item, since = blocked.popleft()
      blocked_time += clip(since, t)
      put(item, t)
      free += 1
    launch(t)

  def try_learn(t):
    nonlocal learner_busy, q_len, seq, busy_learner, n_started
    if learner_busy or q_len < batch or (sync and round_left > 0):
      return
    training.clear()
    while len(training) < batch:
      item, _ = queue.popleft()
      training.extend(item)
    q_len -= batch
    n_tok = 0.0
    for k in training:
      fate[k] = TRAINING
      n_tok += tokens[k]
    dt = float(cfg.step_time_s.sample(step_rng, 1, n_started)[0]) + cfg.step_time_per_token_s * n_tok
    n_started += 1
    if t >= t_w:  # Statistics of the data this step trains on.
      for k in training:
        st_win.append(version - ver_min[k])
        tst_win.append(version - ver_tok[k])
        qw_win.append(t - enq[k])
        gw_win.append(enq[k] - end[k])
    busy_learner += clip(t, t + dt)
    learner_busy = True
    heapq.heappush(heap, (t + dt, seq, _STEP_DONE, 0))
    seq += 1
    unblock(t)

  launch(0.0)
  while heap:
    t, _, kind, k = heapq.heappop(heap)
    if t > t_end:
      break
    if kind == _DONE:
      end[k] = t
      ver_min[k], ver_tok[k] = versions(k, start[k])
      if t >= t_w:
        gen_win += 1
      free += 1
      item = None
      if g == 1:
        item = [k]
      else:
        members = groups.setdefault(k // g, [])
        members.append(k)
        fate[k] = GROUPING
        if len(members) == g:
          item = groups.pop(k // g)
      if item is not None:
        if q_len + len(item) > cap:  # The slot waits with its trajectory (group) until there is room.
          free -= 1
          blocked.append((item, t))
          for j in item:
            fate[j] = BLOCKED
        else:
          put(item, t)
      launch(t)
      try_learn(t)
    elif kind == _STEP_DONE:
      learner_busy = False
      version += 1
      n_trained += len(training)
      trained_ids.extend(training)
      for j in training:
        fate[j] = TRAINED
      if t >= t_w:
        trained_win += len(training)
        steps_win += 1
      training.clear()
      if max_st < math.inf and queue:  # The new version may make waiting data too stale.
        keep = collections.deque()
        for item, oldest in queue:
          if version - oldest > max_st:
            for j in item:
              fate[j] = DROPPED
            n_dropped += len(item)
            q_len -= len(item)
            if t >= t_w:
              dropped_win += len(item)
          else:
            keep.append((item, oldest))
        queue.clear()
        queue.extend(keep)
      if sync:
        round_steps += 1
        if round_steps == cfg.sync_steps_per_round or q_len < batch:  # Round over: publish, then a new round.
          round_steps = 0
          pub_t.append(t + cfg.publish_delay_s)
          pub_v.append(version)
          heapq.heappush(heap, (t + cfg.publish_delay_s, seq, _ROUND_START, 0))
          seq += 1
        else:
          try_learn(t)
      else:
        pub_t.append(t + cfg.publish_delay_s)
        pub_v.append(version)
        unblock(t)
        try_learn(t)
    else:  # _ROUND_START
      budget = round_size
      round_left = round_size
      launch(t)

  for item, since in blocked:
    blocked_time += clip(since, t_end)
  fates = np.asarray(fate, np.int8)
  counts = {'started': len(start), 'completed': int(np.sum(fates != RUNNING)), 'trained_total': n_trained,
            'dropped_total': n_dropped, 'queue_max': q_max}
  counts.update({name: int(np.sum(fates == code)) for code, name in enumerate(FATES)})
  window = t_end - t_w
  hours = window / 3600.0
  return SimResult(
      config=cfg, window_s=window,
      learner_utilisation=busy_learner / window,
      actor_utilisation=busy_actor / (n_slots * window),
      actor_blocked=blocked_time / (n_slots * window),
      generated_per_hour=gen_win / hours, trained_per_hour=trained_win / hours, dropped_per_hour=dropped_win / hours,
      steps=steps_win,
      staleness=np.asarray(st_win, np.int64), token_staleness=np.asarray(tst_win, np.float64),
      queue_wait_s=np.asarray(qw_win, np.float64), group_wait_s=np.asarray(gw_win, np.float64),
      counts=counts, fates=fates, trained_ids=np.asarray(trained_ids, np.int64),
      end_time=np.asarray(end, np.float64), enqueue_time=np.asarray(enq, np.float64))


def sample_episodes(cfg: SimConfig, n: int) -> tuple[np.ndarray, np.ndarray]:
  """(durations_s, tokens) of the first `n` episodes a run of `cfg` would launch (same seed, same episodes)."""
  cfg.validate()
  episodes = _Episodes(cfg, np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(2)[0]))
  dur, tok = np.empty(n), np.empty(n)
  for k in range(n):
    i = episodes.get(k)
    dur[k], tok[k] = episodes.duration[i], episodes.tokens[i]
  return dur, tok
