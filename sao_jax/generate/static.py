"""The static engine: batched generation with a KV cache, turn by turn (a jitted prefill and a jitted decode loop).

A `Sampler` reads decode-layout weights from a `WeightsSource` and runs two kinds of programs over a batch:
**chunk prefill** writes a left-padded chunk (a new prompt, or the previous turn's last token and a multi-turn
episode's observation) and samples the next token, so continuing never re-runs the history; **decode** is a
`lax.while_loop` that feeds one token per row until every row stops (stop token or budget), with no host sync.
The loop runs in segments over growing attention windows (`decode_windows`), each on the cache cut to its window.

Rules:
* the forward pass is `sao_jax.models.decode.forward`, the Decoder's own cached pass (tests compare log-probs
  with the plain forward and greedy tokens with uncached greedy decoding);
* shapes are bucketed (chunk lengths to `prompt_buckets`, new tokens and batch to powers of two), so a run
  compiles a handful of programs (`num_compiled`);
* a call reads the weights snapshot once and returns its version: a swap takes effect at the next call, and a
  continued episode may change weights between turns (turn-level partial rollout);
* outputs: `tokens[b, j]` is row b's j-th generated token, `logprobs[b, j]` its temperature-1 policy log-prob,
  `sampling_logprobs[b, j]` its log-prob under the distribution sampled from; past `lengths[b]`: `pad_id` / 0.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.generate import sampling
from sao_jax.models.decode import (DecodeCache, DecodeWeights, forward, init_cache,
                                   last_logits, resize_cache)
from sao_jax.models.config import ModelConfig
from sao_jax.generate.sampling import SamplingParams
from sao_jax.generate.weights import WeightsSnapshot, WeightsSource

Array = jax.Array


class StopReason(enum.IntEnum):
  """Why a row stopped generating."""
  NOT_DONE = 0  # Still running (never returned by `generate`).
  STOP_TOKEN = 1  # Produced one of the stop tokens (it is the row's last generated token).
  BUDGET = 2  # Used its budget of new tokens (or had a budget of 0).


# ---------------------------------------------------------------------------------------------------------
# Jitted programs (pure functions; `static` = hashable settings).


@dataclasses.dataclass(frozen=True)
class StaticSettings:
  """The hashable settings of one compiled sampler program (the static argument of the static sampler's and the
  continuous sampler's jitted programs)."""
  cfg: ModelConfig
  params: SamplingParams
  stop_ids: tuple[int, ...]
  pad_id: int
  window: int  # Attention window (slots) of this call's programs, see `decode.forward`.


def _select(st: StaticSettings, logits: Array, seeds: Array, key_pos: Array, n_generated: Array,
            min_new: Array) -> tuple[Array, Array, Array]:
  """`sampling.select_tokens` with the stop tokens banned for rows with n_generated < min_new."""
  banned = None
  if st.stop_ids:
    ban_row = n_generated < min_new  # [B]
    stop_cols = jnp.zeros((logits.shape[-1],), bool).at[jnp.asarray(st.stop_ids)].set(True)
    banned = ban_row[:, None] & stop_cols[None, :]
  # The ban is almost always off (min_new = 0): skip the [B, V] select when no row needs it.
  if banned is not None:
    return jax.lax.cond(
        jnp.any(ban_row),
        lambda: sampling.select_tokens(logits, seeds, key_pos, st.params, banned=banned),
        lambda: sampling.select_tokens(logits, seeds, key_pos, st.params))
  return sampling.select_tokens(logits, seeds, key_pos, st.params)


def is_stop(st: StaticSettings, tokens: Array) -> Array:
  """[B] bool: which of `tokens` [B] are stop tokens."""
  if not st.stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.any(tokens[:, None] == jnp.asarray(st.stop_ids, jnp.int32)[None, :], axis=-1)


def _prefill_impl(st: StaticSettings, weights: DecodeWeights, cache: DecodeCache, chunk: Array, chunk_valid: Array,
                  seeds: Array, budgets: Array, min_new: Array):
  """Writes the chunk, samples each row's first new token. Rows with budget 0 generate nothing."""
  hidden, cache = forward(st.cfg, weights, cache, chunk, chunk_valid, window=st.window)
  logits = last_logits(weights, hidden)
  zeros = jnp.zeros_like(budgets)
  tok, lp, slp = _select(st, logits, seeds, cache.positions, zeros, min_new)
  active = budgets > 0
  stop = is_stop(st, tok) & active
  reason = jnp.where(~active, int(StopReason.BUDGET),
                     jnp.where(stop, int(StopReason.STOP_TOKEN),
                               jnp.where(budgets <= 1, int(StopReason.BUDGET), int(StopReason.NOT_DONE))))
  tok = jnp.where(active, tok, st.pad_id)
  return cache, tok, jnp.where(active, lp, 0.0), jnp.where(active, slp, 0.0), reason.astype(jnp.int32)


def decode_windows(window: int, *, granule: int = 64, max_segments: int = 8) -> tuple[int, ...]:
  """Attention windows of the decode loop's segments: multiples of a granule (>= `granule`, at most
  `max_segments` segments), ending at `window`. E.g. 288 -> (64, 128, 192, 256, 288)."""
  g = max(granule, -(-window // max_segments))
  return tuple(range(g, window, g)) + (window,)


def _decode_impl(st: StaticSettings, num_steps: int, weights: DecodeWeights, cache: DecodeCache, first_tok: Array,
                 first_lp: Array, first_slp: Array, first_reason: Array, seeds: Array, budgets: Array,
                 min_new: Array):
  """The decode loop: up to `num_steps` tokens per row (column 0 comes from prefill)."""
  b = first_tok.shape[0]
  active = budgets > 0
  tokens = jnp.full((b, num_steps), st.pad_id, jnp.int32).at[:, 0].set(first_tok)
  lps = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(first_lp)
  slps = jnp.zeros((b, num_steps), jnp.float32).at[:, 0].set(first_slp)
  lengths = active.astype(jnp.int32)
  done = first_reason != int(StopReason.NOT_DONE)

  def step(carry):
    i, cache, tokens, lps, slps, lengths, done, reason, last = carry
    hidden, cache = forward(st.cfg, weights, cache, last[:, None], ~done[:, None])
    logits = last_logits(weights, hidden)
    tok, lp, slp = _select(st, logits, seeds, cache.positions, lengths, min_new)
    live = ~done
    tok = jnp.where(live, tok, st.pad_id)
    tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (0, i))
    lps = jax.lax.dynamic_update_slice(lps, jnp.where(live, lp, 0.0)[:, None], (0, i))
    slps = jax.lax.dynamic_update_slice(slps, jnp.where(live, slp, 0.0)[:, None], (0, i))
    lengths = lengths + live.astype(jnp.int32)
    stop = is_stop(st, tok) & live
    out_of_budget = live & ~stop & (lengths >= budgets)
    reason = jnp.where(stop, int(StopReason.STOP_TOKEN), jnp.where(out_of_budget, int(StopReason.BUDGET), reason))
    last = jnp.where(live, tok, last)
    return i + 1, cache, tokens, lps, slps, lengths, done | stop | out_of_budget, reason, last

  def running(carry):
    i, cache, done = carry[0], carry[1], carry[6]
    # A step writes slot `index` and attends over slots [0, index + 1): stop when the segment's cache is full.
    return (i < num_steps) & ~jnp.all(done) & (cache.index < cache.max_len)

  def segment(window, carry):
    """Decodes while the filled slots fit in `window`, on a copy of the cache cut to `window` slots (attention
    then reads only those; a slice of the full cache inside the loop would cost more than it saves)."""
    cache = carry[1]
    small = resize_cache(cache, window)
    carry = jax.lax.while_loop(running, step, (carry[0], small) + carry[2:])
    return (carry[0], resize_cache(carry[1], cache.max_len)) + carry[2:]

  carry = (jnp.ones((), jnp.int32), cache, tokens, lps, slps, lengths, done, first_reason, first_tok)
  windows = decode_windows(st.window)
  for window in windows[:-1]:  # Segments the episode has already passed (index >= window) are skipped.
    carry = jax.lax.cond(running(carry) & (carry[1].index < window), functools.partial(segment, window),
                         lambda c: c, carry)
  carry = segment(windows[-1], carry)  # Runs on the whole cache when the window is the whole cache.
  _, cache, tokens, lps, slps, lengths, _, reason, last = carry
  return cache, tokens, lps, slps, lengths, reason, last


# ---------------------------------------------------------------------------------------------------------
# Host API.


@dataclasses.dataclass
class EpisodeState:
  """What `Sampler.continue_generation` needs to extend an episode (device cache + host bookkeeping).

  Attributes:
    cache: the device cache (donated to the next call: do not reuse a state twice).
    seeds: uint32 `[Bp]` per-row seeds (padded batch).
    pending: int32 `[Bp]` the last generated token of each row; it is not in the cache yet.
    has_pending: bool `[Bp]`.
    batch_size: number of real rows.
  """
  cache: DecodeCache
  seeds: np.ndarray
  pending: np.ndarray
  has_pending: np.ndarray
  batch_size: int


@dataclasses.dataclass
class SampleOutput:
  """Result of one generation call (host numpy arrays, real rows only).

  Attributes:
    tokens: int32 `[B, N]` generated tokens (N = the new-token bucket), `pad_id` after `lengths[b]`.
    lengths: int32 `[B]` number of generated tokens (a stop token counts and is included).
    stop_reason: int32 `[B]` `StopReason` values.
    logprobs: float32 `[B, N]` log pi(token) under the policy at temperature 1; 0 after `lengths[b]`.
    sampling_logprobs: float32 `[B, N]` log-prob under the distribution sampled from (== logprobs when
      sampling at temperature 1 without top-p/top-k and without banned tokens).
    version: the policy version of the weights this call used (one snapshot for the whole call).
    state: an `EpisodeState` to continue from (when requested), else None.
    timings: seconds spent in `prefill` and in `decode` (prefill is synchronised only when timing).
  """
  tokens: np.ndarray
  lengths: np.ndarray
  stop_reason: np.ndarray
  logprobs: np.ndarray
  sampling_logprobs: np.ndarray
  version: int = 0
  state: EpisodeState | None = None
  timings: dict[str, float] = dataclasses.field(default_factory=dict)

  def token_lists(self) -> list[list[int]]:
    """The generated tokens of each row as Python lists."""
    return [self.tokens[b, :self.lengths[b]].tolist() for b in range(len(self.lengths))]


def _next_pow2(x: int, minimum: int = 1) -> int:
  return max(minimum, 1 << max(0, int(x) - 1).bit_length())


class Sampler:
  """Batched generation with a preallocated KV cache (see the module docstring).

  Args:
    model: where the weights come from: a `WeightsSource` (shared with whoever updates it), or a
      `sao_jax.models.llama.Decoder` (copied into decode layout; call `update_weights` after it changes).
    stop_ids: tokens that end a turn (default: `model.cfg.eos_ids`).
    pad_id: token written after a row's end (default: `model.cfg.pad_id`).
    prompt_buckets: allowed chunk lengths (prompts and continuation chunks are left-padded up to the next
      one); longer chunks use the next power of two. Default: powers of two >= 16.
    min_new_bucket: smallest new-token bucket (buckets are powers of two >= this).
    bucket_batch: pad the batch to a power of two (bounded compiles when batch sizes vary).
    version: policy version of `model`'s weights.
  """

  def __init__(self, model: nnx.Module | WeightsSource, *, stop_ids: Sequence[int] | None = None,
               pad_id: int | None = None, prompt_buckets: Sequence[int] | None = None, min_new_bucket: int = 16,
               bucket_batch: bool = True, version: int = 0):
    self.cfg: ModelConfig = model.cfg
    self.stop_ids = tuple(int(i) for i in (self.cfg.eos_ids if stop_ids is None else stop_ids))
    self.pad_id = int(self.cfg.pad_id if pad_id is None else pad_id)
    for name, ids in (('stop_ids', self.stop_ids), ('pad_id', (self.pad_id,))):
      bad = [i for i in ids if not 0 <= i < self.cfg.vocab_size]
      if bad:
        raise ValueError(f'Sampler {name} {bad} outside the vocabulary [0, {self.cfg.vocab_size}).')
    self.prompt_buckets = tuple(sorted(int(x) for x in prompt_buckets)) if prompt_buckets else ()
    if any(x <= 0 for x in self.prompt_buckets):
      raise ValueError(f'Sampler prompt_buckets must be positive, got {prompt_buckets!r}.')
    if min_new_bucket <= 0:
      raise ValueError(f'Sampler min_new_bucket must be positive, got {min_new_bucket}.')
    self.min_new_bucket = int(min_new_bucket)
    self.bucket_batch = bucket_batch
    # jax.jit caches compiled programs per Python function object: wrap each function in a fresh partial so
    # that `num_compiled` counts this sampler's programs only.
    fresh = functools.partial
    self._init_cache = jax.jit(fresh(init_cache), static_argnums=(0, 1, 2))
    self._resize = jax.jit(fresh(resize_cache), static_argnums=(1,))  # Copies: nothing to donate.
    self._prefill = jax.jit(fresh(_prefill_impl), static_argnums=(0,), donate_argnums=(2,))
    self._decode = jax.jit(fresh(_decode_impl), static_argnums=(0, 1), donate_argnums=(3,))
    self.source = model if isinstance(model, WeightsSource) else WeightsSource(model, version=version)

  def update_weights(self, model: nnx.Module, *, version: int | None = None) -> None:
    """Publishes `model`'s weights as the snapshot of policy `version` (default: the current version + 1;
    `WeightsSource.update_weights`): calls in flight finish on the snapshot they took; nothing recompiles."""
    self.source.update_weights(model, version=version)

  @property
  def snapshot(self) -> WeightsSnapshot:
    """The current (weights, version); a call reads it once."""
    return self.source.snapshot

  @property
  def version(self) -> int:
    return self.source.version

  def num_compiled(self) -> dict[str, int]:
    """Number of compiled programs per jitted function (prefill, decode, cache init/resize)."""
    return {'prefill': self._prefill._cache_size(), 'decode': self._decode._cache_size(),
            'init_cache': self._init_cache._cache_size(), 'resize_cache': self._resize._cache_size()}

  # ---- Bucketing.

  def chunk_bucket(self, length: int) -> int:
    """Padded length of a prompt / continuation chunk of `length` tokens."""
    for bucket in self.prompt_buckets:
      if length <= bucket:
        return bucket
    return _next_pow2(length, 16)

  def new_tokens_bucket(self, max_new_tokens: int) -> int:
    return _next_pow2(max_new_tokens, self.min_new_bucket)

  def batch_bucket(self, batch_size: int) -> int:
    return _next_pow2(batch_size) if self.bucket_batch else batch_size

  # ---- Generation.

  def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int],
               params: SamplingParams = SamplingParams(), seeds: int | Sequence[int] = 0,
               min_new_tokens: int = 0, max_total_len: int | None = None, keep_state: bool = False,
               time_prefill: bool = False) -> SampleOutput:
    """Generates a continuation of each prompt.

    Args:
      prompts: B token-id lists (non-empty; lengths may differ: they are left-padded).
      max_new_tokens: budget of new tokens, one int or one per row (0 = the row generates nothing).
      params: temperature / top-p / top-k (`SamplingParams`; static, one compiled program per setting).
      seeds: one int (row b uses seed + b) or one per row. Same seed and logits -> same token.
      min_new_tokens: the stop tokens are banned until a row has this many new tokens.
      max_total_len: preallocate the cache for an episode of this many tokens (prompt + every turn), so
        continuations do not need to grow it. Default: prompt bucket + new-token bucket.
      keep_state: return an `EpisodeState` for `continue_generation`.
      time_prefill: synchronise after prefill and report `timings['prefill']` (benchmarks).

    Returns:
      A `SampleOutput` (with the version of the weights snapshot it used).
    """
    snapshot = self.source.snapshot  # Read once: the whole call runs on these weights.
    prompts = [list(map(int, p)) for p in prompts]
    if not prompts:
      raise ValueError('generate: prompts is empty.')
    for i, p in enumerate(prompts):
      if not p:
        raise ValueError(f'generate: prompt {i} is empty (a prompt needs at least one token).')
    b = len(prompts)
    bp = self.batch_bucket(b)
    budgets = self._budgets(max_new_tokens, b)
    t = self.chunk_bucket(max(len(p) for p in prompts))
    n = self.new_tokens_bucket(max(int(budgets.max()), 1))
    s = t + n
    if max_total_len is not None:
      s = max(s, _next_pow2(max_total_len))
    seeds_np = self._seeds(seeds, b, bp)
    cache = self._init_cache(self.cfg, bp, s)
    chunk, valid = self._left_pad(prompts, bp, t)
    return self._run(snapshot, cache, chunk, valid, seeds_np, budgets, n, params, min_new_tokens, b, keep_state,
                     time_prefill, chunk_end=t, need=t + n)

  def continue_generation(self, state: EpisodeState, observations: Sequence[Sequence[int] | None], *,
                          max_new_tokens: int | Sequence[int], params: SamplingParams = SamplingParams(),
                          min_new_tokens: int = 0, keep_state: bool = False,
                          time_prefill: bool = False) -> SampleOutput:
    """Continues an episode: appends each row's observation tokens and generates the next turn.

    The previous turn's last generated token (not yet in the cache) and the observation tokens are written
    into the existing cache as one chunk; the history is not recomputed. A row whose observation is None
    takes no part (nothing is written, it generates nothing, its pending token stays pending).

    Args:
      state: the `EpisodeState` returned by the previous call (its cache is donated: do not reuse it).
      observations: one token list (may be empty) or None per row.
      max_new_tokens, params, min_new_tokens, keep_state, time_prefill: as in `generate`.

    Returns:
      A `SampleOutput`; its version is that of the snapshot current at this call (the cached history may come
      from an older one).
    """
    snapshot = self.source.snapshot  # Read once: the whole call runs on these weights.
    b = state.batch_size
    if len(observations) != b:
      raise ValueError(f'continue_generation: got {len(observations)} observations for a batch of {b}.')
    bp = state.cache.batch_size
    active = np.zeros((bp,), bool)
    chunks: list[list[int]] = [[] for _ in range(bp)]
    for i, obs in enumerate(observations):
      if obs is None:
        continue
      active[i] = True
      chunks[i] = ([int(state.pending[i])] if state.has_pending[i] else []) + [int(x) for x in obs]
    budgets = self._budgets(max_new_tokens, b)
    budgets[:b] = np.where(active[:b], budgets[:b], 0)
    empty_active = [i for i in range(b) if active[i] and not chunks[i] and budgets[i] > 0]
    if empty_active:
      raise ValueError(f'continue_generation: rows {empty_active} have nothing to condition on (no pending '
                       'token and an empty observation).')
    t = self.chunk_bucket(max(1, max(len(c) for c in chunks)))
    n = self.new_tokens_bucket(max(int(budgets.max()), 1))
    cache = state.cache
    index = int(jax.device_get(cache.index))
    need = index + t + n
    if need > cache.max_len:
      cache = self._resize(cache, _next_pow2(need))
    chunk, valid = self._left_pad(chunks, bp, t)
    out = self._run(snapshot, cache, chunk, valid, state.seeds, budgets, n, params, min_new_tokens, b, keep_state,
                    time_prefill, chunk_end=index + t, need=need)
    if out.state is not None:  # Rows that took no part keep their pending token.
      keep = ~active
      out.state.pending = np.where(keep, state.pending, out.state.pending)
      out.state.has_pending = np.where(keep, state.has_pending, out.state.has_pending)
    return out

  # ---- Internals.

  def _budgets(self, max_new_tokens: int | Sequence[int], b: int) -> np.ndarray:
    bp = self.batch_bucket(b)
    if np.ndim(max_new_tokens) == 0:
      per_row = np.full((b,), int(max_new_tokens), np.int32)
    else:
      per_row = np.asarray(max_new_tokens, np.int32)
      if per_row.shape != (b,):
        raise ValueError(f'max_new_tokens has shape {per_row.shape}, expected ({b},) or a scalar.')
    if (per_row < 0).any():
      raise ValueError(f'max_new_tokens must be >= 0, got {per_row.tolist()}.')
    out = np.zeros((bp,), np.int32)
    out[:b] = per_row
    return out

  @staticmethod
  def _seeds(seeds: int | Sequence[int], b: int, bp: int) -> np.ndarray:
    if np.ndim(seeds) == 0:
      per_row = int(seeds) + np.arange(b)
    else:
      per_row = np.asarray(seeds, np.int64)
      if per_row.shape != (b,):
        raise ValueError(f'seeds has shape {per_row.shape}, expected ({b},) or a scalar.')
    out = np.zeros((bp,), np.uint32)
    out[:b] = (per_row % (1 << 32)).astype(np.uint32)
    return out

  def _left_pad(self, chunks: Sequence[Sequence[int]], bp: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.full((bp, t), self.pad_id, np.int32)
    valid = np.zeros((bp, t), bool)
    for i, c in enumerate(chunks):
      if c:
        tokens[i, t - len(c):] = c
        valid[i, t - len(c):] = True
    return tokens, valid

  def _run(self, snapshot: WeightsSnapshot, cache, chunk, valid, seeds, budgets, n, params, min_new_tokens, b,
           keep_state, time_prefill, chunk_end, need):
    # Attention windows, bucketed (powers of two >= 32), at most the cache length: the prefill chunk attends over
    # the slots filled once it is written (`chunk_end`), the decode loop over those this call can fill (`need`).
    bucket = lambda slots: min(cache.max_len, _next_pow2(slots, 32))
    st_prefill = StaticSettings(self.cfg, params, self.stop_ids, self.pad_id, bucket(chunk_end))
    st = StaticSettings(self.cfg, params, self.stop_ids, self.pad_id, bucket(need))
    min_new = jnp.asarray(min_new_tokens, jnp.int32)
    seeds_d, budgets_d = jnp.asarray(seeds), jnp.asarray(budgets)
    t0 = time.perf_counter()
    cache, tok, lp, slp, reason = self._prefill(st_prefill, snapshot.weights, cache, jnp.asarray(chunk),
                                                jnp.asarray(valid), seeds_d, budgets_d, min_new)
    timings = {}
    if time_prefill:
      jax.block_until_ready(tok)
      timings['prefill'] = time.perf_counter() - t0
    t1 = time.perf_counter()
    cache, tokens, lps, slps, lengths, reason, last = self._decode(
        st, n, snapshot.weights, cache, tok, lp, slp, reason, seeds_d, budgets_d, min_new)
    tokens, lps, slps, lengths, reason, last = jax.device_get((tokens, lps, slps, lengths, reason, last))
    timings['decode'] = time.perf_counter() - t1
    timings['total'] = time.perf_counter() - t0
    state = None
    if keep_state:
      state = EpisodeState(cache=cache, seeds=seeds, pending=np.asarray(last, np.int32),
                           has_pending=np.asarray(lengths) > 0, batch_size=b)
    return SampleOutput(tokens=np.asarray(tokens[:b]), lengths=np.asarray(lengths[:b]),
                        stop_reason=np.asarray(reason[:b]), logprobs=np.asarray(lps[:b]),
                        sampling_logprobs=np.asarray(slps[:b]), version=snapshot.version, state=state,
                        timings=timings)
