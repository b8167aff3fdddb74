"""The slot engine: continuous batching over a fixed number of decode slots of one slot-major KV cache.

A `SlotSampler` keeps `num_slots` independent sequences (each slot its own write index and RoPE positions) and
runs the jitted programs of `sao_jax.generate.programs` over them: `admit` writes a chunk into free slots (a new
prompt, or an episode's next turn) and samples its first token; `step` / `decode` run a chunk of decode steps over
the active slots, and with a queue (`device_refill`) a slot whose episode ended takes the next waiting episode
inside the chunk. The host side here is the bookkeeping: which slot holds what, row and chunk buckets, attention
windows, the shared prompt prefix (learned from the prompts seen, its cache computed once per weights snapshot).

Rules the rest of the system relies on:
* tokens are exactly the static engine's (`sao_jax.generate.static`): the same cached forward pass and
  `sampling.select_tokens` keyed by (row seed, position of the drawn token), so a row's tokens depend neither on
  its slot nor on its neighbours (tests compare the two engines token for token);
* weights are read from the source's snapshot once per device call, and every token comes back with the version
  that generated it (a swap takes effect between decode chunks);
* the number of compiled programs is fixed by the slot count and lengths (row buckets x chunk buckets x windows),
  not by the traffic; `warmup` compiles them all.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import weakref
from typing import Sequence

from absl import logging
import jax
import numpy as np

from sao_jax import parallel
from sao_jax.generate import programs
from sao_jax.generate.code_maps import CODE_MAPS
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.prefix import SharedPrefix
from sao_jax.generate.programs import CachePlacement, Queue, Window
from sao_jax.generate.sampling import SamplingParams
from sao_jax.generate.static import StaticSettings, decode_windows
from sao_jax.generate.weights import SnapshotSource, WeightsSnapshot
from sao_jax.models.config import ModelConfig
from sao_jax.models.decode import DecodeCache, DecodeWeights


@dataclasses.dataclass
class Admission:
  """A chunk to write into a slot, after which the slot generates a turn.

  Attributes:
    slot: the slot (0 <= slot < num_slots).
    tokens: the chunk: a new episode's prompt, or the observation tokens of an episode's next turn (the
      slot's pending last token is put in front of them).
    new: the slot starts a new episode (its cache row is reset; `seed` is its sampling seed).
    budget: new tokens this turn may generate (>= 1).
    seed: the episode's sampling seed (used when `new`).
    final: this turn is the episode's last (its end ends the episode): with `device_refill`, the slot takes a
      queued episode as soon as the turn ends, in the same decode chunk.
  """
  slot: int
  tokens: Sequence[int]
  new: bool
  budget: int
  seed: int = 0
  final: bool = False


@dataclasses.dataclass
class NewEpisode:
  """A new episode that a decode chunk may start in a slot whose episode ended in it (`SlotSampler.step`'s
  `queue`, with `device_refill`).

  Attributes:
    tokens: its prompt.
    budget: new tokens its first turn may generate (>= 1).
    seed: its sampling seed.
    final: its first turn is its last (a single-turn episode).
  """
  tokens: Sequence[int]
  budget: int
  seed: int = 0
  final: bool = False


@dataclasses.dataclass
class SlotTokens:
  """Tokens a slot generated in one device call.

  Attributes:
    slot: the slot.
    ids: generated tokens (the turn's stop token included when it stopped on one).
    logprobs: temperature-1 policy log-probs `log pi(a)`.
    sampling_logprobs: log-probs under the distribution sampled from.
    version: the weights version that generated them (one snapshot per call).
    ended: the turn is over (stop token or budget); the slot stops decoding until its next admission.
    queued: None: the tokens of the episode the slot held; else the index (into `step`'s `queue`) of the new
      episode the slot took in the call, whose first turn they begin.
  """
  slot: int
  ids: list[int]
  logprobs: list[float]
  sampling_logprobs: list[float]
  version: int
  ended: bool
  queued: int | None = None


def exact_admissions(cfg: ModelConfig, chunk: int, platform: str) -> bool:
  """Whether admissions should be calls of full row buckets (`SlotSampler._admission_calls`), not one call padded
  to a row bucket: on a CPU, where a program's cost is its FLOPs, when a padding row's `chunk` tokens cost at
  least 1 GFLOP (2 per weight past the embedding; ~10 ms on a 2-core host, about a call's fixed cost: SmolLM2's
  16 tokens are 3.4 GFLOP, the tiny model's 2.4 MFLOP; docs/benchmarks/rollout.md). On an accelerator a small
  admission is bound by reading the weights, and a padding row is nearly free."""
  return platform == 'cpu' and 2 * cfg.num_params(include_embedding=False) * chunk >= 1e9


GRANULE = 64  # Slots of the cache and its windows come in multiples of this (aligned attention reads).
CHUNK_BUCKETS = (16, 32, 64)  # Admission chunks (`SlotSampler`'s default; a prompt is admitted in such pieces).


def cache_length(max_seq_len: int, chunk_buckets: Sequence[int] = CHUNK_BUCKETS) -> int:
  """Slots of a slot cache for episodes of `max_seq_len` tokens: a slot holds at most max_seq_len - 1 tokens (its
  last token is pending) and a chunk write reaches up to the largest bucket past it."""
  return -(-(int(max_seq_len) + max(chunk_buckets)) // GRANULE) * GRANULE


class SlotSampler:
  """Continuous batching over `num_slots` decode slots (see the module docstring).

  Args:
    source: where the decode-layout weights come from (`WeightsSource`: its `snapshot` is read once per call).
    num_slots: decode slots (rows of the cache and of every decode step).
    max_seq_len: longest episode (prompt + actions + observations), in tokens.
    stop_ids: tokens that end a turn.
    pad_id: token written after a row's end.
    chunk_buckets: admission chunk lengths (chunks are right-padded up to one; longer ones are split).
    decode_steps: decode steps per chunk (the host admits newcomers between chunks).
    num_windows: attention windows of the decode programs (the last one is the whole cache).
    num_admit_windows: attention windows of the admit programs (multiples of 64, the last one the whole cache):
      an admission reads the smallest that holds its rows' histories and chunk.
    prefix_cache: a new episode whose prompt starts with the prompts' shared head starts from that head's cache
      (module docstring) instead of prefilling it.
    device_refill: every decode program that can hold one carries a queue of new episodes (`step`'s `queue`): a
      slot whose episode's last turn ends in a decode chunk takes the next one in the chunk's following step,
      instead of the chunk ending for a host round trip (on a small model that costs several decode steps).
    queue_chunk: with `device_refill`, the longest prompt (past the shared prefix) a queued episode may have
      (the queue's static chunk length; default the smallest chunk bucket); longer ones are left to the caller.
    cache_sharding: where the cache's keys and values go (dims `[slots, kv_heads, ...]`; e.g. the kv heads
      over the actors' `tensor` axis, as `config.mesh.rules` split the weights' heads: the trainer passes that);
      the cache's other fields are replicated over its devices. None: where the weights are (`_placement`).
  """

  def __init__(self, source: SnapshotSource, *, num_slots: int, max_seq_len: int, stop_ids: Sequence[int],
               pad_id: int, chunk_buckets: Sequence[int] = CHUNK_BUCKETS, decode_steps: int = 16,
               num_windows: int = 8, num_admit_windows: int = 3, prefix_cache: bool = True,
               device_refill: bool = False, queue_chunk: int | None = None,
               cache_sharding: jax.sharding.Sharding | None = None):
    if num_slots < 1 or decode_steps < 1 or max_seq_len < 2:
      raise ValueError(f'SlotSampler: num_slots={num_slots}, decode_steps={decode_steps} and max_seq_len='
                       f'{max_seq_len} must be >= 1, 1 and 2.')
    self.source = source
    self.cfg: ModelConfig = source.cfg
    self.num_slots = int(num_slots)
    self.max_seq_len = int(max_seq_len)
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.pad_id = int(pad_id)
    self.chunk_buckets = tuple(sorted({int(x) for x in chunk_buckets}))
    if not self.chunk_buckets or self.chunk_buckets[0] < 1:
      raise ValueError(f'SlotSampler chunk_buckets must be positive, got {chunk_buckets!r}.')
    self.decode_steps = int(decode_steps)
    granule = GRANULE
    self.cache_len = cache_length(self.max_seq_len, self.chunk_buckets)
    self.windows = decode_windows(self.cache_len, granule=granule, max_segments=max(1, int(num_windows)))
    step = -(-self.cache_len // max(1, int(num_admit_windows)) // granule) * granule
    self.admit_windows = tuple(range(step, self.cache_len, step)) + (self.cache_len,)
    # Admission rows: powers of 4 up to the slot count (few programs; a partly filled admission is cheap).
    self.row_buckets = tuple(sorted({min(4 ** k, self.num_slots) for k in range(16) if 4 ** (k - 1) < self.num_slots}))
    # The queue of new episodes a decode chunk may start (`device_refill`): at most one per slot per chunk.
    self.device_refill = bool(device_refill)
    self.queue_rows = self.num_slots
    self.queue_chunk = int(queue_chunk) if queue_chunk else self.chunk_buckets[0]
    if not 1 <= self.queue_chunk <= self.max_seq_len:
      raise ValueError(f'SlotSampler queue_chunk={queue_chunk} must be in [1, max_seq_len={self.max_seq_len}].')
    self.placement = self._placement(cache_sharding)
    self._cache = self._placed(programs.cache_program(self.cfg, self.num_slots, self.cache_len, per_row_index=True))
    # Admission calls of full row buckets, or one padded call (`exact_admissions`; tests set either).
    platform = next(iter(self._cache.valid.devices())).platform
    self.exact_admissions = exact_admissions(self.cfg, self.chunk_buckets[0], platform)
    # The decode programs' window buffers (`programs._decode_impl`'s `window`), by (rows, window), kept from one
    # chunk to the next, the least recently used dropped past the cache's own size in all.
    self._windows: collections.OrderedDict[tuple[int, int], Window] = collections.OrderedDict()
    self._windows_budget = sum(x.nbytes for x in self._cache.k + self._cache.v)
    # The shared prefix (module docstring): its tokens (at most the largest chunk bucket, so one call computes
    # it), and its cache for one weights version, recomputed when the version or the tokens change.
    self.prefix_cache = bool(prefix_cache)
    self.prefix_slots = self.chunk_buckets[-1]
    self._shared = SharedPrefix(self.prefix_slots, enabled=self.prefix_cache)
    self._prefix_kv: tuple[tuple[weakref.ref, tuple[int, ...]], DecodeCache] | None = None
    self._no_prefix = self._placed(programs.cache_program(self.cfg, 1, self.prefix_slots, per_row_index=True))
    # (kind, static settings, row bucket, chunk bucket or decode steps) of every program this instance has run.
    self._used: set[tuple] = set()
    # What else tells a program apart in the process (`CODE_MAPS` checks a program at its first call there).
    self._program_shapes = (self.placement, self.num_slots, self.cache_len, self.prefix_slots)
    b = self.num_slots
    self.fill = np.zeros((b,), np.int64)  # Tokens each slot holds (host mirror of cache.index).
    self.pending = np.zeros((b,), np.int32)  # Last generated token, not in the cache yet.
    self.has_pending = np.zeros((b,), bool)
    self.last = np.zeros((b,), np.int32)
    self.active = np.zeros((b,), bool)
    self.lengths = np.zeros((b,), np.int32)  # Tokens of the current turn so far.
    self.budgets = np.zeros((b,), np.int32)
    self.seeds = np.zeros((b,), np.uint32)
    self.final = np.zeros((b,), bool)  # The slot's current turn is its episode's last (`Admission.final`).
    self.steps_run = 0  # Decode steps the device ran (all chunks; a counter for benchmarks).

  @classmethod
  def from_settings(cls, source: SnapshotSource, settings: GenerateConfig, *, num_slots: int,
                    stop_ids: Sequence[int], pad_id: int,
                    cache_sharding: jax.sharding.Sharding | None = None) -> SlotSampler:
    """The actors' slot engine: `settings`' lengths and decode steps, with the shared prefix's cache and device
    refill on (each measured faster and changes no token: docs/benchmarks/rollout.md)."""
    return cls(source, num_slots=num_slots, max_seq_len=settings.max_seq_len, stop_ids=stop_ids, pad_id=pad_id,
               decode_steps=settings.decode_steps, prefix_cache=True, device_refill=True,
               queue_chunk=settings.queue_chunk, cache_sharding=cache_sharding)

  def _placement(self, cache_sharding: jax.sharding.Sharding | None) -> CachePlacement | None:
    """The cache's placement (`CachePlacement`): `cache_sharding` for its keys and values, or, when None, where
    the weights are: on their device when they are committed to one, replicated over their mesh when they are
    spread over one, none (XLA's choice, uncommitted caches) when they are uncommitted.

    Left to XLA with committed weights, the cache and the empty prefix (made by a program without inputs) are
    uncommitted, a call's output cache is committed where XLA put it, and every program compiled a second
    time at its first call with an earlier call's cache (SmolLM2: ~50 programs, twice the warm-up, and the
    JIT's code memory ran out; a 2-device actor mesh: the same)."""
    if cache_sharding is not None:
      return CachePlacement.of(cache_sharding)
    leaf = jax.tree.leaves(self.source.snapshot.weights)[0]
    if not getattr(leaf, 'committed', False):
      return None
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):  # A weight's own spec may not fit the cache's ranks.
      return CachePlacement.of(parallel.replicated(sharding.mesh))
    if len(sharding.device_set) == 1:
      return CachePlacement.of(sharding)
    return None

  def _placed(self, cache: DecodeCache) -> DecodeCache:
    return cache if self.placement is None else self.placement.put(cache)

  # ---- Introspection.

  def num_compiled(self) -> dict[str, int]:
    """Distinct programs (static settings and shapes) this instance has run, per kind: what it compiled, or
    found compiled by another instance of the process (`compiled_programs` counts the process's)."""
    kinds = [key[0] for key in self._used]
    return {'admit': kinds.count('admit'), 'decode': kinds.count('decode'), 'prefix': kinds.count('prefix')}

  @property
  def version(self) -> int:
    return self.source.snapshot.version

  @property
  def any_active(self) -> bool:
    return bool(self.active.any())

  def chunk_bucket(self, length: int) -> int:
    return next(x for x in self.chunk_buckets if length <= x)

  def _static(self, params: SamplingParams, window: int) -> StaticSettings:
    return StaticSettings(self.cfg, params, self.stop_ids, self.pad_id, window)

  def _admission_calls(self, rows: list[int]) -> list[tuple[int, list[int]]]:
    """The calls that admit `rows` (admissions of one chunk bucket and piece, ordered by their histories): (row
    bucket, its rows) each. Padded: one call, its rows padded up to the next row bucket. Exact
    (`exact_admissions`): full row buckets only, the largest first (7 rows: 4 + 1 + 1 + 1), so that no padding
    row is computed."""
    if not self.exact_admissions:
      return [(next(x for x in self.row_buckets if len(rows) <= x), rows)]
    calls = []
    while rows:
      p = max(x for x in self.row_buckets if x <= len(rows))
      calls.append((p, rows[:p]))
      rows = rows[p:]
    return calls

  def _run_admit(self, st: StaticSettings, weights: DecodeWeights, rows: np.ndarray, chunk: np.ndarray, *args):
    return self._call(('admit', st, rows.shape[0], chunk.shape[1]), programs.admit_program, st, self.placement, weights,
                      self._cache, rows, chunk, *args)

  def _run_prefix(self, weights: DecodeWeights, tokens: Sequence[int]) -> DecodeCache:
    chunk = np.full((1, self.prefix_slots), self.pad_id, np.int32)
    chunk[0, :len(tokens)] = tokens
    return self._call(('prefix', self.cfg, self.prefix_slots), programs.prefix_program, self.cfg, self.placement,
                      weights, chunk, np.arange(self.prefix_slots)[None] < len(tokens))

  # ---- The shared prefix.

  @property
  def prefix(self) -> tuple[int, ...]:
    """The shared prefix of new prompts (`SharedPrefix`): what a new episode's slot starts from."""
    return self._shared.tokens

  def _prefix_for(self, snapshot: WeightsSnapshot) -> DecodeCache:
    """The shared prefix's cache under `snapshot`'s weights (computed once per snapshot and prefix)."""
    cached = self._prefix_kv
    if cached is None or cached[0][0]() is not snapshot or cached[0][1] != self.prefix:
      self._prefix_kv = cached = ((weakref.ref(snapshot), self.prefix),
                                  self._run_prefix(snapshot.weights, self.prefix))
    return cached[1]

  def _run_decode(self, st: StaticSettings, weights: DecodeWeights, rows: np.ndarray, *args):
    """A decode program's call (`programs._decode_impl`'s arguments after `rows`, its queue last), with the window
    buffers of its shape (kept ones, or new); returns its outputs but those."""
    queue = args[-1]
    key = ('decode', st, rows.shape[0], self.decode_steps, None if queue is None else queue.chunk.shape)
    shape = (rows.shape[0], st.window)
    window = self._windows.pop(shape, None)
    if window is None:
      window = self._new_window(*shape)
    *out, window = self._call(key, programs.decode_program, st, self.decode_steps, self.placement, weights,
                              self._cache, rows, *args, window)
    self._windows[shape] = window
    size = lambda kept: sum(x.nbytes for x in jax.tree.leaves(kept))
    while len(self._windows) > 1 and sum(map(size, self._windows.values())) > self._windows_budget:
      self._windows.popitem(last=False)
    return tuple(out)

  def _new_window(self, rows: int, window: int) -> Window:
    """Window buffers (`programs.Window`) of `rows` rows and `window` slots, placed as the cache."""
    empty = self._placed(programs.cache_program(self.cfg, rows, window, per_row_index=True))
    return empty.k, empty.v

  def _call(self, key: tuple, program, *args):
    """Runs a program (`key`: its kind, static settings and shapes) under the memory-map check (`CODE_MAPS`),
    and counts it as used once it ran."""
    with CODE_MAPS.compiling(key + self._program_shapes):
      out = program(*args)
    self._used.add(key)
    return out

  # ---- Warm-up.

  def warmup(self, params: SamplingParams) -> None:
    """Compiles every admit and decode program, and the prefix's (padding rows only: the slots are left as
    they were). Logs its progress every 30 s (SmolLM2 on a 2-core CPU: ~50 programs, minutes)."""
    snapshot = self.source.snapshot
    admits = [(p, t, w) for p in self.row_buckets for t in self.chunk_buckets for w in self.admit_windows if t <= w]
    decodes = [(r, w) for r in self.row_buckets for w in self.windows]
    total, done, t0 = len(admits) + len(decodes) + int(self.prefix_cache), 0, time.perf_counter()

    def progress():
      nonlocal done
      done += 1
      logging.log_every_n_seconds(logging.INFO, 'SlotSampler warm-up: %d of %d programs, %.0f s', 30, done, total,
                                  time.perf_counter() - t0)

    if self.prefix_cache:
      self._run_prefix(snapshot.weights, ())
      progress()
    for p, t, w in admits:
      rows = np.full((p,), self.num_slots, np.int32)
      zeros = np.zeros((p,), np.int32)
      self._cache, *_ = self._run_admit(self._static(params, w), snapshot.weights, rows,
                                        np.zeros((p, t), np.int32), np.zeros((p, t), bool), zeros,
                                        np.ones((p,), bool), zeros.astype(np.uint32), self._no_prefix,
                                        np.zeros((p,), bool))
      progress()
    for r, w in decodes:
      zeros = np.zeros((r,), np.int32)
      out = self._run_decode(self._static(params, w), snapshot.weights,
                             np.full((r,), self.num_slots, np.int32),
                             zeros, np.zeros((r,), bool), zeros, zeros, zeros.astype(np.uint32), np.int32(r + 1),
                             self._queue(w, [], np.zeros((r,), bool)))
      self._cache = out[0]
      progress()
    jax.block_until_ready(self._cache)
    logging.info('SlotSampler warm-up: %d programs in %.1f s', total, time.perf_counter() - t0)

  # ---- Admission and decoding.

  def admit(self, admissions: Sequence[Admission], params: SamplingParams) -> list[SlotTokens]:
    """Writes each admission's chunk into its slot and samples the turn's first token (one snapshot for the
    whole call). Returns one `SlotTokens` per admission (ended when the first token already ends the turn)."""
    if not admissions:
      return []
    return self._admit(admissions, *self._prepare(admissions), self.source.snapshot, params)

  def _prepare(self, admissions: Sequence[Admission]) -> tuple[list[list[int]], list[int]]:
    """Checks the admissions; returns each one's chunk (a next turn: the slot's pending token in front) and
    where its write starts in it (the shared prefix's length for a new prompt that starts with it, else 0)."""
    chunks = []
    slots = [a.slot for a in admissions]
    if len(set(slots)) != len(slots):
      raise ValueError(f'SlotSampler.admit: slots {slots} are not distinct.')
    for a in admissions:
      if not 0 <= a.slot < self.num_slots or self.active[a.slot]:
        raise ValueError(f'SlotSampler.admit: slot {a.slot} is not a free slot of {self.num_slots}.')
      if a.budget < 1:
        raise ValueError(f'SlotSampler.admit: slot {a.slot} has a budget of {a.budget} (needs >= 1).')
      chunk = [int(x) for x in a.tokens]
      if not a.new and self.has_pending[a.slot]:
        chunk = [int(self.pending[a.slot])] + chunk
      if not chunk:
        raise ValueError(f'SlotSampler.admit: slot {a.slot} has nothing to condition on.')
      fill = 0 if a.new else int(self.fill[a.slot])
      if fill + len(chunk) > self.max_seq_len:
        raise ValueError(f'SlotSampler.admit: slot {a.slot} would hold {fill + len(chunk)} tokens > max_seq_len='
                         f'{self.max_seq_len}.')
      chunks.append(chunk)
    # A new prompt that starts with the shared prefix starts from its cache: only the rest is written.
    for a, c in zip(admissions, chunks):
      if a.new:
        self._shared.learn(c)
    starts = [self._shared.start(c) if a.new else 0 for a, c in zip(admissions, chunks)]
    return chunks, starts

  def _admit(self, admissions: Sequence[Admission], chunks: list[list[int]], starts: list[int],
             snapshot: WeightsSnapshot, params: SamplingParams) -> list[SlotTokens]:
    prefix = self._prefix_for(snapshot) if any(starts) else self._no_prefix
    piece = self.chunk_buckets[-1]
    pieces = [[c[i:i + piece] for i in range(start, len(c), piece)] for c, start in zip(chunks, starts)]
    # Device calls per (piece round, chunk bucket) (`_admission_calls`): rows are padded to their own chunk
    # bucket only, and a call attends over the smallest admit window that holds its rows' histories plus the
    # chunk.
    calls = []
    for r in range(max(len(p) for p in pieces)):
      by_bucket: dict[int, list[int]] = {}
      for i, p in enumerate(pieces):
        if r < len(p):
          by_bucket.setdefault(self.chunk_bucket(len(p[r])), []).append(i)
      # Slots a row holds before piece r: its old fill (0 for a new episode, or the prefix's length) and its
      # earlier pieces.
      held = lambda i: (starts[i] if admissions[i].new else int(self.fill[admissions[i].slot])) + r * piece
      for t, rows_in_bucket in sorted(by_bucket.items()):
        for p_rows, part in self._admission_calls(sorted(rows_in_bucket, key=held)):
          before = max(map(held, part))
          window = next(w for w in self.admit_windows if before + t <= w)
          rows = np.full((p_rows,), self.num_slots, np.int32)
          chunk = np.full((p_rows, t), self.pad_id, np.int32)
          valid = np.zeros((p_rows, t), bool)
          lengths = np.zeros((p_rows,), np.int32)
          reset = np.zeros((p_rows,), bool)
          from_prefix = np.zeros((p_rows,), bool)
          seeds = np.zeros((p_rows,), np.uint32)
          for j, i in enumerate(part):
            a, c = admissions[i], pieces[i][r]
            rows[j], lengths[j], reset[j] = a.slot, len(c), a.new and r == 0
            from_prefix[j] = reset[j] and starts[i] > 0
            chunk[j, :len(c)], valid[j, :len(c)] = c, True
            seeds[j] = (a.seed % (1 << 32)) if a.new else self.seeds[a.slot]
          self._cache, tok, lp, slp = self._run_admit(self._static(params, window), snapshot.weights, rows, chunk,
                                                      valid, lengths, reset, seeds, prefix, from_prefix)
          calls.append((r, part, (tok, lp, slp)))
    first = {}
    for (r, part, _), (tok, lp, slp) in zip(calls, jax.device_get([c[2] for c in calls])):
      for j, i in enumerate(part):
        if r == len(pieces[i]) - 1:
          first[i] = (int(tok[j]), float(lp[j]), float(slp[j]))
    out = []
    for i, a in enumerate(admissions):
      s = a.slot
      tok, lp, slp = first[i]
      if a.new:
        self.seeds[s] = a.seed % (1 << 32)
        self.fill[s] = 0
      self.fill[s] += len(chunks[i])
      ended = tok in self.stop_ids or a.budget <= 1
      self.active[s], self.lengths[s], self.budgets[s], self.last[s] = not ended, 1, a.budget, tok
      self.final[s] = a.final
      self.pending[s], self.has_pending[s] = tok, True
      out.append(SlotTokens(s, [tok], [lp], [slp], snapshot.version, ended))
    return out

  def decode(self, params: SamplingParams, *, free_target: int | None = None) -> list[SlotTokens]:
    """One decode chunk (up to `decode_steps` tokens per active slot, one snapshot). Returns the tokens of
    every slot that was active.

    `free_target`: the chunk ends as soon as this many slots are inactive (the caller has newcomers waiting
    for them); None: it runs `decode_steps` steps or until no slot is active."""
    return self._decode(params, free_target, self.source.snapshot)

  def step(self, admissions: Sequence[Admission], params: SamplingParams, *, refill: int | None = None,
           queue: Sequence[NewEpisode] = ()) -> list[SlotTokens]:
    """Admits `admissions` (`admit`) and runs one decode chunk over them and the active slots (one snapshot).
    Returns a slot's tokens of the call in one `SlotTokens` (an admitted slot's first token first).
    `refill`: the chunk ends once this many more slots are idle than after the admissions (None: it runs
    `decode_steps` steps or until no slot is active).

    `queue` (with `device_refill`): new episodes, in order, that slots whose episode's last turn (`final`) ends
    in the chunk take, one a step (module docstring); those whose prompt past the shared prefix is longer than
    `queue_chunk` and those past `queue_rows` are not offered. A taken one's tokens come back in a `SlotTokens`
    of its own (`queued`: its index), after the slot's previous episode's; the others were not started."""
    snapshot = self.source.snapshot
    first = self._admit(admissions, *self._prepare(admissions), snapshot, params) if admissions else []
    free_target = None if refill is None else self.num_slots - int(self.active.sum()) + int(refill)
    first_of = {r.slot: r for r in first}
    out = []
    for r in self._decode(params, free_target, snapshot, self._queued(queue)):
      m = first_of.pop(r.slot, None) if r.queued is None else None
      if m is not None:  # Admitted above: its first token, then the chunk's.
        r = SlotTokens(r.slot, m.ids + r.ids, m.logprobs + r.logprobs, m.sampling_logprobs + r.sampling_logprobs,
                       r.version, r.ended)
      out.append(r)
    return out + list(first_of.values())  # Admitted, and the first token ended the turn.

  def _queued(self, queue: Sequence[NewEpisode]) -> list[tuple[int, NewEpisode, list[int], int]]:
    """The queue entries a decode chunk may take: (index in `queue`, entry, prompt, its start past the shared
    prefix) for those whose prompt past the prefix fits `queue_chunk`, the first `queue_rows` of them."""
    if not (self.device_refill and queue):
      return []
    out = []
    for k, e in enumerate(queue):
      prompt = [int(x) for x in e.tokens]
      if not prompt or len(prompt) > self.max_seq_len or e.budget < 1:
        raise ValueError(f'SlotSampler.step: queued episode {k} has {len(prompt)} prompt tokens (needs 1 to '
                         f'max_seq_len={self.max_seq_len}) and a budget of {e.budget} (needs >= 1).')
      self._shared.learn(prompt)
      out.append((k, e, prompt))
    fits = []
    for k, e, prompt in out:
      start = self._shared.start(prompt)
      if len(prompt) - start <= self.queue_chunk and len(fits) < self.queue_rows:
        fits.append((k, e, prompt, start))
    return fits

  @property
  def _queue_need(self) -> int:
    """Slots a queued episode may write in a decode chunk: the prefix's, its prompt's and a chunk's steps."""
    return self.prefix_slots + self.queue_chunk + self.decode_steps

  def _queue_fits(self, window: int) -> bool:
    """A decode program of this window carries the queue (`device_refill`): a taken episode's prefix, prompt and
    a chunk's steps fit in it."""
    return self.device_refill and self._queue_need <= window

  def _queue(self, window: int, entries: list[tuple[int, NewEpisode, list[int], int]], rows_final: np.ndarray,
             prefix: DecodeCache | None = None) -> Queue | None:
    """The decode program's `Queue` (None when the window's programs carry none): `entries` (`_queued`'s),
    padded to `queue_rows`."""
    if not self._queue_fits(window):
      return None
    q, t = self.queue_rows, self.queue_chunk
    chunk, valid = np.full((q, t), self.pad_id, np.int32), np.zeros((q, t), bool)
    from_prefix, seeds = np.zeros((q,), bool), np.zeros((q,), np.uint32)
    budgets, final = np.ones((q,), np.int32), np.zeros((q,), bool)
    for j, (_, e, prompt, start) in enumerate(entries):
      rest = prompt[start:]
      chunk[j, :len(rest)], valid[j, :len(rest)], from_prefix[j] = rest, True, start > 0
      seeds[j], budgets[j], final[j] = e.seed % (1 << 32), e.budget, e.final
    return Queue(chunk, valid, from_prefix, seeds, budgets, final, np.int32(len(entries)), rows_final,
                 self._no_prefix if prefix is None else prefix)

  def _decode(self, params: SamplingParams, free_target: int | None, snapshot: WeightsSnapshot,
              queued: list[tuple[int, NewEpisode, list[int], int]] = ()) -> list[SlotTokens]:
    was_active = self.active.copy()
    if not was_active.any():
      return []
    # The active slots in order of the slots they need (the chunk's window must hold every row's history and
    # chunk), gathered into a row bucket: padding rows (-1 here) point past the cache.
    needs = {s: min(int(self.fill[s]) + self.decode_steps, self.cache_len)
             for s in np.flatnonzero(was_active).tolist()}
    order = sorted(needs, key=lambda s: (needs[s], s))
    n, r = len(order), next(x for x in self.row_buckets if len(order) <= x)
    need = max(needs.values())
    if queued:  # A taken episode writes its prefix and prompt, then decodes.
      need = max(need, self._queue_need)
    window = next(w for w in self.windows if need <= w)
    if not self._queue_fits(window):
      queued = []
    order = order + [-1] * (r - n)
    perm = np.asarray(order, np.int64)
    rows = np.where(perm >= 0, perm, self.num_slots).astype(np.int32)
    gather = lambda a: np.where(perm >= 0, a[np.maximum(perm, 0)], 0).astype(a.dtype)
    # `free_target` counts free slots of all B; the chunk counts idle rows of its R (B - n are not in it).
    target = r + 1 if free_target is None else free_target - (self.num_slots - r)
    lengths_in = self.lengths.copy()
    queue = self._queue(window, queued, gather(self.final),
                        self._prefix_for(snapshot) if any(start for *_, start in queued) else None)
    out = self._run_decode(self._static(params, window), snapshot.weights, rows, gather(self.last),
                           gather(was_active), gather(lengths_in), gather(self.budgets), gather(self.seeds),
                           np.int32(target), queue)
    self._cache = out[0]
    tokens, lps, slps, active, lengths, last, steps, *taken = jax.device_get(out[1:])
    self.steps_run += int(steps)
    # A row's tokens, by episode: (queue entry or None, first column, turn length before the chunk) segments.
    segments = {j: [(None, 0, int(lengths_in[s]))] for j, s in enumerate(order) if s >= 0}
    ends = {}  # (row, segment index) -> the turn's length when it ended (the last segment's: `lengths`).
    if taken:
      taken_row, taken_at, taken_len = taken
      for k in range(len(queued)):
        j = int(taken_row[k])
        if j in segments:
          ends[(j, len(segments[j]) - 1)] = int(taken_len[k])
          segments[j].append((k, int(taken_at[k]), 0))
    results = []
    for j in sorted(segments, key=lambda j: order[j]):  # In slot order.
      s = order[j]
      for g, (k, col, l0) in enumerate(segments[j]):
        count = ends.get((j, g), int(lengths[j])) - l0
        last_one = g == len(segments[j]) - 1
        results.append(SlotTokens(s, tokens[j, col:col + count].tolist(), lps[j, col:col + count].tolist(),
                                  slps[j, col:col + count].tolist(), snapshot.version,
                                  not (last_one and bool(active[j])), None if k is None else queued[k][0]))
      k, _, _ = segments[j][-1]
      count = int(lengths[j]) - segments[j][-1][2]
      if k is not None:  # A queued episode: its prompt, then a step per token after the first.
        _, e, prompt, _ = queued[k]
        self.seeds[s], self.budgets[s], self.final[s] = e.seed % (1 << 32), e.budget, e.final
        self.fill[s] = len(prompt) + count - 1
        self.has_pending[s] = True
      else:
        self.fill[s] += count  # Each step wrote the slot's previous token.
      self.pending[s] = last[j]
      self.active[s], self.lengths[s], self.last[s] = bool(active[j]), lengths[j], last[j]
    return results

  def release(self, slot: int) -> None:
    """Frees a slot (its episode ended): the next admission into it must be `new`."""
    self.active[slot] = False
    self.has_pending[slot] = False
    self.fill[slot] = 0
    self.final[slot] = False
