"""Continuous batching: a fixed number of decode slots over a slot-major KV cache.

What the continuous episode runner (`sao_jax.rollout.continuous`) drives. A `SlotSampler` owns a cache of
`num_slots` rows (`decode.init_cache(..., per_row_index=True)`: every row is an independent sequence with its
own write slot and RoPE positions) and two kinds of jitted programs:

* **admit** `(weights, cache, rows[P], chunk[P, T]) -> (first tokens, cache)`: writes a right-padded chunk into
  P of the slots (a new episode's prompt into a reset slot, or the next turn of an episode: its pending last
  token followed by its observation tokens, appended to what the slot holds) and samples each row's first
  token of the turn. The P rows are gathered from the cache cut to the smallest of a few static windows
  (`admit_windows`) that holds their histories plus the chunk (on a tiny model the attention over the whole
  cache, not the matmuls, was most of an admission's cost), run through `decode.forward`, and the slots the
  chunk wrote go back. P is bucketed to a power of 4 (padding rows point past the cache and are dropped), T to
  `chunk_buckets` (one call per bucket: a short observation is not padded to a long prompt's length); chunks
  longer than the largest bucket are written in pieces (only the last piece samples). The rows admitted
  together become one padded call or, where a padding row costs more than a call (a CPU, a model of SmolLM2's
  size: `admission_rows`), calls of full row buckets;
* **decode** `(weights, cache, rows[R], last, active, ..., free_target) -> (tokens[R, n], log-probs, cache)`: a
  chunk of at most `n` single-token steps over the active slots, gathered into R rows (R bucketed as P: a slot
  that waits for an env step costs nothing), with a per-row active mask (a `lax.while_loop` that ends early
  when no row is active, or once `free_target` slots are free: newcomers are waiting for them). A row leaves
  the active set when its turn ends (stop token or budget); inactive rows write nothing that is ever read and
  do not advance. The loop runs on a copy of the R rows cut to a window (`windows`: a few static sizes, chosen
  per chunk to hold every active slot's history and chunk); the slots the chunk wrote go back once per chunk.
  The copy is written into buffers of the window's shape that the sampler keeps from one chunk to the next
  (donated in, returned): a fresh copy is a new allocation at every call, and on XLA:CPU a fresh allocation of
  hundreds of MB is fresh pages, faulted in and zeroed one by one by the kernel (SmolLM2, 16 rows at 616
  slots: 113k page faults a call, whose fixed part, less its steps, went from 328 to 38 ms with kept buffers);
* **fused admission** (`step`, `fuse_admissions`): a decode chunk whose first step also writes a newcomer's
  chunk of at most the smallest chunk bucket (a next turn's observation, or a prompt's rest past the shared
  prefix) into its row and samples its first token (`decode.forward_mixed`: the decode tokens and the chunk go
  through the projections and MLPs as one block, each part through its own attention). On a CPU an admission
  call costs about a decode step (both read all the weights; SmolLM2: ~100 ms); fused, it costs the chunk's
  extra FLOPs. One admission per chunk is fused; the others of a round, and longer chunks, get an admit call
  first. Every decode program of a fusing sampler carries its admission (a padding one, which writes nothing,
  when none is waiting): one program per (rows, window) either way, and a chunk without a newcomer pays the
  padding chunk's FLOPs in its first step (cheap next to the weight reads of the chunk's steps).
* **device refill** (`step`'s `queue`, `device_refill`): the decode program also takes a queue of new episodes
  (their prompts past the shared prefix, at most `queue_chunk` tokens, seeds, budgets). A row whose turn ends
  while it is marked as its episode's last (`Admission.final`: a single-turn episode's turn, a multi-turn
  episode's last) takes the next queued episode in the following step: the row is reset (empty, or the shared
  prefix's cache), its prompt is written by `decode.forward_mixed` alongside the other rows' decode step, and its
  first token sampled; between such steps the loop runs plain decode steps (an inner `while_loop`, not a
  `lax.cond` per step, which copied the window's cache every step on XLA:CPU). Without it, each finished
  episode ends its chunk and costs a host round trip: the device call's return, an admission call and the next
  chunk's call (dispatch, sync, the window's copy), which on a small model is several decode steps. The host
  splits a row's tokens between its episodes by the column each queued episode started at. The programs of
  windows too small for a queued prompt (`_queue_fits`) carry no queue.
* **row groups** (`row_groups`): a long-tailed batch's window is set by its longest rows, and attention over it
  is a large part of a step (SmolLM2's shapes at 616 slots: 146 ms in one group, 107 ms split). A decode program
  of R >= 4 rows may run its R / 4 longest rows (the host orders the rows by the slots they need) at the chunk's
  window and the others at the largest window of at most half of it (`_short_windows`; if it holds a queued
  episode when the program carries a queue): each group is cut from the cache to its own window and attends over
  it, the projections and MLPs run over all rows at once (`decode.forward_mixed` with a tuple of caches), and
  each group's written slots go back at the chunk's end.

So the number of compiled programs is fixed by the slot count: at most `len(P buckets) x len(chunk_buckets) x
len(admit_windows)` admit programs and `len(P buckets) x len(windows)` decode programs (with
`fuse_admissions`, each with its fused admission; with `device_refill`, each that fits one with its queue; with
`row_groups`, one more per (rows, window) program that has a short window); slots come and go without a
recompile. The programs are
module-level jitted functions keyed by their static settings and shapes, so every `SlotSampler` of a process
with the same model, slot count and lengths (two actor threads, a second trainer run) uses the same compiled
programs: each compiles once per process (and, with a persistent compilation cache, loads from disk in the next
one). A program compiles at its first use (`warmup` compiles them all up front);
`num_compiled` counts the programs an instance has used, `compiled_programs` those of the process. XLA:CPU maps
every compiled kernel's code on its own, and a process past the kernel's `vm.max_map_count` crashes while
compiling: `CODE_MAPS` checks each program new to the process first and raises an error that says what to change.

**Shared prefix.** New prompts usually begin with the same tokens (a chat template's system prompt and the user
turn's header: 24 of a 38-token SmolLM2 prompt). With `prefix_cache`, the sampler learns that head from the
prompts it admits (the longest common prefix of the distinct new prompts seen, at least `MIN_PREFIX` and at most
the largest chunk bucket of tokens; it only shrinks, and is dropped for good when prompts share less than
`MIN_PREFIX`), computes its cache once per weights snapshot (`_prefix_impl`, one program), and an admission of a
new prompt that starts with it copies that cache into slots [0, C) of its row and writes only the rest (a
14-token chunk instead of 38, padded to 16 instead of 64). The head's keys and values are those a whole-prompt
admission writes (causal attention: they depend on the head only), so the tokens are the same either way (tests
compare them).

Between chunks the host admits newcomers into free slots: a turn that ends frees nothing but its decode
row (the slot keeps the episode's history until the episode ends), so the next turn of another episode or a
new prompt starts without waiting for the rest of the batch.

Weights are read from a `WeightsSnapshot` source (the actor's `Sampler`, whose `update_weights` swaps it
atomically) once per device call: a swap takes effect at the next admit / decode chunk, between decode steps.
Every token comes back with the version of the snapshot that generated it, so an episode running across a
swap records the versions it saw.

Token semantics are exactly those of `sao_jax.generate.static` (tests compare the two): the same cached
forward pass, `sampling.select_tokens` keyed by (row seed, position of the drawn token), so a row's tokens do
not depend on the slot it runs in or on its neighbours; `logprobs` are temperature-1 policy log-probs and
`sampling_logprobs` those of the distribution actually sampled from.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import weakref
from typing import Callable, Hashable, Protocol, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax import parallel
from sao_jax.generate import sampling
from sao_jax.models.config import ModelConfig
from sao_jax.models.decode import DecodeCache, DecodeWeights, forward, forward_mixed, init_cache, last_logits
from sao_jax.generate.static import StaticSettings, WeightsSnapshot, decode_windows, is_stop
from sao_jax.generate.sampling import SamplingParams

Array = jax.Array
MIN_PREFIX = 8  # Tokens: a shorter shared prefix is not worth a cache of its own.
# A decode program's window buffers: per row group, (keys, values) with one array per layer, of the cache's
# layout cut to the group's rows and window (`_decode_impl`'s `windows`).
Windows = tuple[tuple[tuple[Array, ...], tuple[Array, ...]], ...]


@dataclasses.dataclass(frozen=True)
class CachePlacement:
  """Where a slot cache lives: its keys and values (`[rows, kv_heads, ...]`) on `kv`, the rest (`valid`, `index`,
  `positions`) on `rest`.

  A compiled program is keyed by its arguments' placement too, and a program's output placement is XLA's
  choice unless it is fixed: every program that returns a cache constrains it to the sampler's placement (and
  the sampler puts its fresh caches there), so each call's cache arrives where the last one's left it, and
  each program compiles once (`SlotSampler`'s `cache_sharding`)."""
  kv: jax.sharding.Sharding
  rest: jax.sharding.Sharding

  @classmethod
  def of(cls, kv: jax.sharding.Sharding) -> CachePlacement:
    rest = parallel.replicated(kv.mesh) if isinstance(kv, jax.sharding.NamedSharding) else kv
    return cls(kv, rest)

  def _apply(self, fn, cache: DecodeCache) -> DecodeCache:
    return DecodeCache(k=tuple(fn(x, self.kv) for x in cache.k), v=tuple(fn(x, self.kv) for x in cache.v),
                       valid=fn(cache.valid, self.rest), index=fn(cache.index, self.rest),
                       positions=fn(cache.positions, self.rest))

  def constrain(self, cache: DecodeCache) -> DecodeCache:
    """Inside a program: its output cache placed here."""
    return self._apply(jax.lax.with_sharding_constraint, cache)

  def constrain_kv(self, kv: Windows) -> Windows:
    """Inside a program: window buffers (`Windows`) placed as the cache's keys and values."""
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, self.kv), kv)

  def put(self, cache: DecodeCache) -> DecodeCache:
    return self._apply(jax.device_put, cache)


def _constrained(place: CachePlacement | None, cache: DecodeCache) -> DecodeCache:
  return cache if place is None else place.constrain(cache)


def _admit_impl(st: StaticSettings, place: CachePlacement | None, weights: DecodeWeights, cache: DecodeCache,
                rows: Array, chunk: Array, valid: Array, lengths: Array, reset: Array, seeds: Array,
                prefix: DecodeCache, from_prefix: Array):
  """Writes right-padded chunks [P, T] (`lengths` real tokens each) into cache rows `rows` [P] (rows >= B are
  padding: nothing is written back) and samples each row's next token. `reset` rows start empty, or, where
  `from_prefix`, holding the shared prefix (`prefix`: one row of C slots, `_prefix_impl`'s) in slots [0, C).

  The chunk runs on a copy of the P rows cut to `st.window` slots (which holds their histories and the chunk),
  and only the slots it can have written go back (a reset row's [0, C + T), another row's [index, index + T)):
  a copy of whole rows each way (SmolLM2 at 704 slots: 32 MB a row) cost an admission of one 16-token row as
  much as its FLOPs on a CPU."""
  c, t = prefix.max_len, chunk.shape[1]
  w = min(max(st.window, c), cache.max_len)  # A reset row's prefix slots are in the copy.
  sub = _start_rows(_cut(cache, rows, w), reset, from_prefix, prefix)
  start = jnp.where(reset, 0, sub.index)  # A row's first written slot.
  hidden, new = forward(st.cfg, weights, sub, chunk, valid, all_positions=True)  # [P, T, D]
  last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]  # [P, D]
  # The padding after the real tokens is overwritten by the row's next write.
  new = new.replace(index=sub.index + lengths)
  tok, lp, slp = sampling.select_tokens(last_logits(weights, last.T), seeds, new.positions, st.params)
  # A reset row's old history is gone: the slots past the window are marked empty here (those in it, by `new`).
  cache = cache.replace(valid=cache.valid.at[jnp.where(reset, rows, cache.batch_size)].set(False, mode='drop'))
  m = min(c + t, w)
  cache = _put_back(cache, new, rows, jnp.minimum(start, w - m), m)
  return _constrained(place, cache), tok, lp, slp


def _cut(cache: DecodeCache, rows: Array, w: int, into: tuple[tuple[Array, ...], tuple[Array, ...]] | None = None
         ) -> DecodeCache:
  """Cache rows `rows` [R] (rows >= B: clipped to the last row) cut to their first `w` slots: a gather of
  [1, ..., w] blocks (`take` then a slice would copy whole rows first). The keys and values are written into
  `into` (buffers of their shapes, donated by the caller: `_decode_impl`'s `windows`), or are fresh arrays."""
  window = lambda x, axis: jax.vmap(lambda r: jax.lax.dynamic_slice(
      x, (r,) + (0,) * (x.ndim - 1), (1,) + x.shape[1:axis] + (w,) + x.shape[axis + 1:])[0])(rows)
  # A whole-buffer update: XLA writes the gather straight into the donated buffer.
  write = lambda buf, x: x if buf is None else jax.lax.dynamic_update_slice(buf, x, (0,) * x.ndim)
  keys, values = into or ((None,) * len(cache.k), (None,) * len(cache.v))
  rows_of = lambda x: jnp.take(x, rows, axis=0, mode='clip')
  return DecodeCache(k=tuple(write(buf, window(x, 3)) for buf, x in zip(keys, cache.k)),
                     v=tuple(write(buf, window(x, 2)) for buf, x in zip(values, cache.v)),
                     valid=window(cache.valid, 1), index=rows_of(cache.index), positions=rows_of(cache.positions))


def _start_rows(rows: DecodeCache, reset: Array, from_prefix: Array, prefix: DecodeCache) -> DecodeCache:
  """Gathered cache rows [P] of which the `reset` ones start a new episode: empty, or, where `from_prefix`,
  holding the shared prefix (`prefix`: one row of C slots) in slots [0, C)."""
  c = prefix.max_len
  seeded = lambda x, px, axis: jax.lax.dynamic_update_slice_in_dim(  # Slots [0, C) from the prefix's row.
      x, jnp.where(from_prefix.reshape((-1,) + (1,) * (x.ndim - 1)), px, jax.lax.slice_in_dim(x, 0, c, axis=axis)),
      0, axis=axis)
  return DecodeCache(k=tuple(seeded(x, px, 3) for x, px in zip(rows.k, prefix.k)),
                     v=tuple(seeded(x, px, 2) for x, px in zip(rows.v, prefix.v)),
                     valid=seeded(jnp.where(reset[:, None], False, rows.valid), prefix.valid, 1),
                     index=jnp.where(reset, jnp.where(from_prefix, prefix.index[0], 0), rows.index),
                     positions=jnp.where(reset, jnp.where(from_prefix, prefix.positions[0], 0), rows.positions))


def _start_row(rows: DecodeCache, row: Array, from_prefix: Array, prefix: DecodeCache) -> DecodeCache:
  """Cache rows of which row `row` (past the last: none) starts a new episode, in place: empty, or, where
  `from_prefix`, holding the shared prefix (`prefix`: one row of C slots) in slots [0, C). Its other slots keep
  their keys and values, marked empty. (`_start_rows` on a gathered copy of the row and a scatter back: a copy of
  its whole window each way, SmolLM2 at 616 slots 28 MB, in a decode chunk's step that takes a queued episode.)"""
  b, c = rows.batch_size, prefix.max_len
  real, at = row < b, jnp.minimum(row, b - 1)

  def seeded(x, px, axis):  # Slots [0, C) of the row from the prefix's row.
    corner = (at,) + (0,) * (x.ndim - 1)
    old = jax.lax.dynamic_slice(x, corner, (1,) + x.shape[1:axis] + (c,) + x.shape[axis + 1:])
    return jax.lax.dynamic_update_slice(x, jnp.where(real & from_prefix, px, old), corner)

  held = jnp.pad(prefix.valid & from_prefix, ((0, 0), (0, rows.max_len - c)))  # [1, S]
  valid = jax.lax.dynamic_update_slice(
      rows.valid, jnp.where(real, held, jax.lax.dynamic_slice_in_dim(rows.valid, at, 1)), (at, 0))
  put = lambda x, y: x.at[row].set(y, mode='drop')
  return DecodeCache(k=tuple(seeded(x, px, 3) for x, px in zip(rows.k, prefix.k)),
                     v=tuple(seeded(x, px, 2) for x, px in zip(rows.v, prefix.v)), valid=valid,
                     index=put(rows.index, jnp.where(from_prefix, prefix.index[0], 0)),
                     positions=put(rows.positions, jnp.where(from_prefix, prefix.positions[0], 0)))


def _prefix_impl(cfg: ModelConfig, place: CachePlacement | None, weights: DecodeWeights, tokens: Array,
                 valid: Array) -> DecodeCache:
  """The shared prefix's cache: one row of C slots holding `tokens` [1, C] (right-padded; `valid` marks the
  real ones), written from slot 0 at positions 0, 1, ... (what an admission of a whole prompt writes there)."""
  cache = init_cache(cfg, 1, tokens.shape[1], per_row_index=True)
  _, cache = forward(cfg, weights, cache, tokens, valid)
  return _constrained(place, cache.replace(index=jnp.sum(valid, axis=1, dtype=jnp.int32)))


def row_groups(rows: int, st: StaticSettings) -> list[tuple[int, int, int]]:
  """A decode program's row groups over its `rows` rows: (first row, end, window) each. With `st.split` =
  (R_a, W_a), rows [0, R_a) attend over W_a slots and the rest over `st.window`; else all over `st.window`."""
  ra, wa = st.split or (rows, st.window)
  return [(0, ra, wa)] + ([(ra, rows, st.window)] if ra < rows else [])


def _decode_impl(st: StaticSettings, num_steps: int, place: CachePlacement | None, weights: DecodeWeights,
                 cache: DecodeCache, rows: Array, last: Array, active: Array, lengths: Array, budgets: Array,
                 seeds: Array, free_target: Array, admit: Fused | None = None, queue: Queue | None = None,
                 windows: Windows | None = None):
  """Up to `num_steps` tokens for each of the cache rows `rows` [R] (the active slots, gathered; rows >= B are
  padding: inactive, nothing is written back): feeds `last`, samples, stops a row at a stop token or when
  `lengths` (tokens of the turn so far) reaches `budgets` (all [R]). The chunk ends early once `free_target`
  of the R rows are idle (inactive, and not about to take a queued episode: newcomers are waiting for their
  slots) or none is active.

  The loop runs on a copy of the R rows cut to `st.window` slots (with `st.split`, its first rows cut to a
  smaller window: two row groups, each attending over its own; attention then reads only those; a loop that
  writes into the whole donated cache instead measured ~1.5x slower a step on XLA:CPU, SmolLM2 at 400 slots),
  and only the slots the chunk can have written (`num_steps` from each row's index) are scattered back into the
  donated full cache: one copy of the rows' windows per chunk instead of one per step, and no work for the slots
  that wait for an env step (on a tiny model most slots wait, and a decode step's cost is proportional to its
  rows). Slots past the window and rows not gathered are left as they are.

  `admit` (a fused admission, `Fused`): the chunk's first step also writes newcomers' chunks into some of the R
  rows (inactive on entry) and samples each one's first token (`decode.forward_mixed`: one pass over the
  weights for both); those rows then decode with the others. Their `lengths` come in as 0, so the first token
  counts as the turn's first.

  `queue` (new episodes, `Queue`): a row whose turn ends while `queue.final` marks it as its episode's last
  takes the next queued episode in the following step (one per step; `forward_mixed` writes its prompt and
  samples its first token, the other rows decode alongside), without a return to the host. Returns, per queue
  entry, the row it went to (`R`: not taken), the column of its first token and the length of the turn it
  ended (so the host can split a row's tokens between its episodes).

  `windows` (donated): buffers the row groups' window copies are written into (the shapes of the groups' cuts,
  their contents ignored), returned after the outputs above for the next call (module docstring); None: the
  copies are fresh allocations."""
  b = last.shape[0]
  carry = dict(i=jnp.zeros((), jnp.int32), tokens=jnp.full((b, num_steps), st.pad_id, jnp.int32),
               lps=jnp.zeros((b, num_steps), jnp.float32), slps=jnp.zeros((b, num_steps), jnp.float32),
               active=active, lengths=lengths, last=last, seeds=seeds, budgets=budgets)
  if queue is not None:
    q = queue.chunk.shape[0]
    prompt_slots = queue.prefix.max_len + queue.chunk.shape[1]  # A taken episode's prefix and prompt: [0, this).
    carry.update(final=queue.rows_final, free=jnp.zeros((b,), bool), next=jnp.zeros((), jnp.int32),
                 taken_row=jnp.full((q,), b, jnp.int32), taken_at=jnp.zeros((q,), jnp.int32),
                 taken_len=jnp.zeros((q,), jnp.int32))
  waiting = lambda c: c['next'] < queue.count  # Queued episodes left.

  def decode_tokens(c):
    """One decode step of the active rows: (hidden [D, R], the row groups' caches after it)."""
    if len(c['cache']) > 1:  # Each group attends over its own window.
      hidden, _, new = forward_mixed(st.cfg, weights, c['cache'], c['last'], c['active'])
      return hidden, new
    (one,) = c['cache']
    hidden, new = forward(st.cfg, weights, one, c['last'][:, None], c['active'][:, None])
    return hidden, (new.replace(index=jnp.where(c['active'], one.index + 1, one.index)),)

  def plain(c):
    hidden, new = decode_tokens(c)
    tok, lp, slp = sampling.select_tokens(last_logits(weights, hidden), c['seeds'], _cat(new, 'positions'),
                                          st.params)
    return _advance(st, {**c, 'cache': new}, tok, lp, slp, c['active'])

  def can_take(c):
    return jnp.any(c['free']) & waiting(c) & (c['i'] < num_steps)

  def take(c):
    """The next queued episode into the first free row (`can_take` holds), with a decode step of the active
    rows."""
    k, row = c['next'], jnp.argmax(c['free'])
    entry = lambda x: jax.lax.dynamic_index_in_dim(x, k)  # [1, ...]
    c, tok, lp, slp, is_row = _mixed_step(st, weights, spans, c, row[None], jnp.ones((1,), bool),
                                          entry(queue.from_prefix), queue.prefix, entry(queue.chunk),
                                          entry(queue.valid), entry(queue.seeds), chunk_window=prompt_slots)
    c = {**c, 'lengths': jnp.where(is_row, 0, c['lengths']),
         'budgets': c['budgets'].at[row].set(entry(queue.budgets)[0]),
         'final': c['final'].at[row].set(entry(queue.final)[0]), 'free': c['free'] & ~is_row, 'next': k + 1,
         'taken_row': c['taken_row'].at[k].set(row), 'taken_at': c['taken_at'].at[k].set(c['i']),
         'taken_len': c['taken_len'].at[k].set(c['lengths'][row])}
    return _advance(st, c, tok, lp, slp, c['active'] | is_row)

  def running(c):
    go, idle = jnp.any(c['active']), ~c['active']
    if queue is not None:  # A free row takes a queued episode in the next step: it is not idle.
      refill = c['free'] & waiting(c)
      go, idle = go | jnp.any(refill), idle & ~refill
    return (c['i'] < num_steps) & go & (jnp.sum(idle) < free_target)

  spans = row_groups(b, st)
  if queue is not None and min(w for *_, w in spans) < prompt_slots + num_steps:
    raise ValueError(f'_decode_impl: row groups {spans} too small for the queue.')

  carry['cache'] = tuple(_cut(cache, rows[lo:hi], w, into)
                         for (lo, hi, w), into in zip(spans, windows or (None,) * len(spans)))
  start = _cat(carry['cache'], 'index')  # [R]: a row's chunk writes [start, start + num_steps) at most.
  n = num_steps
  if admit is not None:  # The first step writes the newcomers' chunks too (module docstring).
    carry, start = _fused_first_step(st, weights, spans, admit, carry)
    n += admit.chunk.shape[1] + admit.prefix.max_len  # A newcomer row writes from its prefix on.
  if queue is None:
    carry = jax.lax.while_loop(running, plain, carry)
  else:  # Plain steps until a row can take a queued episode, then the step that takes it; and again. (A
    # `lax.cond` between the two steps in one loop copied the window's cache every step on XLA:CPU: tiny model,
    # 16 rows, 176 slots: 0.76 ms a step against 0.47 for a plain loop.)
    plain_steps = lambda c: jax.lax.while_loop(lambda c: running(c) & ~can_take(c), plain, c)
    carry = jax.lax.while_loop(lambda c: running(c) & can_take(c), lambda c: plain_steps(take(c)),
                               plain_steps(carry))
  if queue is not None:  # A row that took a queued episode: its old history is gone (the window's copy says so
    # for the slots it holds; the rest of the row is marked empty here), the new one is in slots [0, m).
    took = jnp.zeros((b,), bool).at[carry['taken_row']].set(True, mode='drop')
    cache = cache.replace(valid=cache.valid.at[jnp.where(took, rows, cache.batch_size)].set(False, mode='drop'))
  for (lo, hi, w), small in zip(spans, carry['cache']):
    # Only the slots the chunk wrote go back (the rest of the window is what was gathered): [R, n] cells per row
    # and layer.
    m = min(n, w)
    first = jnp.minimum(start[lo:hi], w - m)  # A row that ended before the window's end wrote nothing past it.
    cache = _put_back(cache, small, rows[lo:hi], first, m)
    if queue is not None:
      m = min(prompt_slots + num_steps, w)
      cache = _put_back(cache, small, jnp.where(took[lo:hi], rows[lo:hi], cache.batch_size),
                        jnp.zeros((hi - lo,), jnp.int32), m)
  out = (carry['tokens'], carry['lps'], carry['slps'], carry['active'], carry['lengths'], carry['last'],
         carry['i'])
  if queue is not None:
    out += (carry['taken_row'], carry['taken_at'], carry['taken_len'])
  if windows is not None:
    kept = tuple((g.k, g.v) for g in carry['cache'])
    out += (kept if place is None else place.constrain_kv(kept),)
  return (_constrained(place, cache),) + out


def _cat(groups: tuple[DecodeCache, ...], field: str) -> Array:
  """A per-row field (`index`, `positions`) of row groups' caches, their rows in order."""
  return jnp.concatenate([getattr(g, field) for g in groups])


def _put_back(cache: DecodeCache, small: DecodeCache, rows: Array, start: Array, n: int) -> DecodeCache:
  """Slots `[start[r], start[r] + n)` of each window row `r` of `small` into cache row `rows[r]` (rows >= B:
  dropped), and the rows' `index` and `positions`.

  A loop over the rows written (their number is dynamic), each copying its blocks in place. (A scatter of all
  rows' blocks at once materialized them, transposed to the scatter's layout: SmolLM2, the rows of a decode
  chunk that took a queued episode, 96 slots of 16 rows: 71 MB of temporaries, fresh pages at every call.)"""
  b = cache.batch_size
  write = rows < b
  order = jnp.argsort(~write, stable=True)  # The rows written first.

  def body(j, kv):
    i = order[j]
    row, first = rows[i], start[i]
    block = lambda part, axis: jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(part, i, 1), first, n, axis)
    put = lambda full, part, axis: jax.lax.dynamic_update_slice(
        full, block(part, axis), tuple(row if d == 0 else first if d == axis else 0 for d in range(full.ndim)))
    keys, values, valid = kv
    return (tuple(put(f, x, 3) for f, x in zip(keys, small.k)), tuple(put(f, x, 2) for f, x in zip(values, small.v)),
            put(valid, small.valid, 1))

  keys, values, valid = jax.lax.fori_loop(0, jnp.sum(write, dtype=jnp.int32), body, (cache.k, cache.v, cache.valid))
  at = jnp.where(write, rows, b)
  return DecodeCache(k=keys, v=values, valid=valid, index=cache.index.at[at].set(small.index, mode='drop'),
                     positions=cache.positions.at[at].set(small.positions, mode='drop'))


def _advance(st: StaticSettings, c: dict, tok: Array, lp: Array, slp: Array, stepped: Array) -> dict:
  """The decode loop's carry after a step that sampled `tok` (and its log-probs) for the `stepped` rows [R]:
  tokens written at column `i`, turns that end (stop token, budget) leave the active set, and with a queue a
  row whose ended turn was its episode's last is free for the next queued episode."""
  i = c['i']
  tok = jnp.where(stepped, tok, st.pad_id)
  col = lambda x, v: jax.lax.dynamic_update_slice(x, v[:, None], (0, i))
  lengths = c['lengths'] + stepped.astype(jnp.int32)
  ended = stepped & (is_stop(st, tok) | (lengths >= c['budgets']))
  c = {**c, 'i': i + 1, 'tokens': col(c['tokens'], tok), 'lps': col(c['lps'], jnp.where(stepped, lp, 0.0)),
       'slps': col(c['slps'], jnp.where(stepped, slp, 0.0)), 'lengths': lengths, 'active': stepped & ~ended,
       'last': jnp.where(stepped, tok, c['last'])}
  if 'free' in c:
    c['free'] = c['free'] | (ended & c['final'])
  return c


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fused:
  """Newcomers' chunks written by a decode chunk's first step (`_decode_impl`'s `admit`).

  Attributes:
    rows: int32 [P]: the decode rows (indices into the chunk's R rows) they go into; R marks padding.
    chunk: int32 [P, T] right-padded chunks; `valid` bool [P, T] marks their real tokens.
    reset: bool [P]: the row starts a new episode (empty, or holding the prefix where `from_prefix`).
    from_prefix: bool [P].
    prefix: the shared prefix's cache (one row of C slots; `_prefix_impl`'s, or an empty one).
  """
  rows: Array
  chunk: Array
  valid: Array
  reset: Array
  from_prefix: Array
  prefix: DecodeCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Queue:
  """New episodes a decode chunk starts in rows whose episode ended in it (`_decode_impl`'s `queue`).

  Attributes:
    chunk: int32 [Q, T] right-padded prompts (past the shared prefix where `from_prefix`); `valid` bool [Q, T].
    from_prefix: bool [Q]: the episode starts from the shared prefix's cache.
    seeds: uint32 [Q] sampling seeds; budgets: int32 [Q] token budgets of their first turns.
    final: bool [Q]: the episode's first turn is its last (its row takes the next one when it ends).
    count: int32 scalar: the real entries (the first `count`; the rest is padding).
    rows_final: bool [R]: the chunk's rows whose current turn is their episode's last.
    prefix: the shared prefix's cache (one row of C slots; `_prefix_impl`'s, or an empty one).
  """
  chunk: Array
  valid: Array
  from_prefix: Array
  seeds: Array
  budgets: Array
  final: Array
  count: Array
  rows_final: Array
  prefix: DecodeCache


def _mixed_step(st: StaticSettings, weights: DecodeWeights, spans: list[tuple[int, int, int]], c: dict, rows: Array,
                reset: Array, from_prefix: Array, prefix: DecodeCache, chunk: Array, valid: Array,
                seeds: Array | None = None, chunk_window: int | None = None) -> tuple[dict, Array, Array, Array, Array]:
  """A decode step of the active rows that also writes chunks [P, T] into rows `rows` [P] (R: padding) and
  samples each one's first token (`decode.forward_mixed`: one pass over the weights). The `reset` rows [P] start
  a new episode first: empty, or holding the shared prefix (`prefix`, one row of C slots) in slots [0, C) where
  `from_prefix`; `seeds` [P] are their sampling seeds (None: the rows keep theirs). `chunk_window` (static): the
  chunks attend over slots [0, chunk_window) only (`forward_mixed`'s). Returns the carry with the row groups'
  caches (`spans`: (first row, end, window) of each) and seeds after it, the tokens and log-probs of all R rows
  (a chunk row's: its first token), and which rows took a chunk."""
  r = c['last'].shape[0]

  def start(group, lo):  # The group's reset rows start their new episode.
    at = jnp.where(reset & (rows >= lo) & (rows < lo + group.batch_size), rows - lo, group.batch_size)
    for j in range(rows.shape[0]):
      group = _start_row(group, at[j], from_prefix[j], prefix)
    return group

  groups = tuple(start(g, lo) for g, (lo, _, _) in zip(c['cache'], spans))
  hidden, chunk_hidden, groups = forward_mixed(st.cfg, weights, groups, c['last'], c['active'], rows, chunk,
                                               valid, chunk_window=chunk_window)
  put = lambda x, y: x.at[rows].set(y, mode='drop')
  of_rows = lambda x: jnp.take(x, rows, axis=0, mode='clip')
  all_seeds = c['seeds'] if seeds is None else put(c['seeds'], seeds)
  logits = last_logits(weights, jnp.concatenate([hidden, chunk_hidden], axis=1))  # [R + P, V]
  positions = _cat(groups, 'positions')  # A chunk row's: its first token's.
  tok, lp, slp = sampling.select_tokens(logits, jnp.concatenate([all_seeds, of_rows(all_seeds)]),
                                        jnp.concatenate([positions, of_rows(positions)]), st.params)
  pick = lambda x: put(x[:r], x[r:])
  took = put(jnp.zeros((r,), bool), jnp.ones(rows.shape, bool))
  return {**c, 'cache': groups, 'seeds': all_seeds}, pick(tok), pick(lp), pick(slp), took


def _fused_first_step(st: StaticSettings, weights: DecodeWeights, spans: list[tuple[int, int, int]], admit: Fused,
                      c: dict) -> tuple[dict, Array]:
  """The decode loop's first step with the newcomers' chunks (`_mixed_step`): returns the loop's carry after it
  and each row's first written slot (a new episode's row: 0)."""
  (small,), r = c['cache'], c['last'].shape[0]  # One row group (`SlotSampler` splits no fusing program).
  start = jnp.where(jnp.zeros((r,), bool).at[admit.rows].set(admit.reset, mode='drop'), 0, small.index)
  c, tok, lp, slp, newcomer = _mixed_step(st, weights, spans, c, admit.rows, admit.reset, admit.from_prefix,
                                          admit.prefix, admit.chunk, admit.valid)
  return _advance(st, c, tok, lp, slp, c['active'] | newcomer), start


# The programs, shared by every SlotSampler of the process (module docstring): one compiled program per static
# settings (model, sampling, window; decode steps; cache placement) and argument shapes (slot count, row and chunk
# buckets).
_admit = jax.jit(_admit_impl, static_argnums=(0, 1), donate_argnums=(3,))
_prefix = jax.jit(_prefix_impl, static_argnums=(0, 1))
_decode = jax.jit(_decode_impl, static_argnums=(0, 1, 2), donate_argnums=(4, 14))
_init_cache = jax.jit(init_cache, static_argnums=(0, 1, 2), static_argnames=('per_row_index',))


def memory_maps() -> tuple[int, int] | None:
  """(memory maps this process holds, the kernel's limit `vm.max_map_count`), or None where /proc has neither."""
  try:
    with open('/proc/sys/vm/max_map_count', encoding='ascii') as f:
      limit = int(f.read())
    with open('/proc/self/maps', 'rb') as f:
      used = sum(1 for _ in f)
  except (OSError, ValueError):
    return None
  return used, limit


class CodeMaps:
  """Keeps XLA:CPU's compiled code under the kernel's memory-map limit: a clear error instead of a crash.

  XLA:CPU maps each compiled kernel's code and data on their own (SmolLM2's decode program: ~200 kernels, ~610
  maps; its decode programs with a queue, more), and a process past `vm.max_map_count` (65530 by default) dies
  in LLVM (`Cannot allocate memory`, then a segfault) halfway through a warm-up. Before a program new to the
  process compiles, `compiling` checks that the maps held plus twice the most a program has added so far stay
  under the limit, and raises a `RuntimeError` that says what to change otherwise (the program is not run: the
  sampler's cache is not donated). `read` gives (maps held, limit) or None (no /proc: no check); tests pass a
  fake one."""

  def __init__(self, read: Callable[[], tuple[int, int] | None] = memory_maps):
    self.read = read
    self.per_program = 0  # The most maps one program has added.
    self._seen: set[Hashable] = set()
    self._lock = threading.Lock()

  @contextlib.contextmanager
  def compiling(self, key: Hashable):
    """Around the call of the program `key` (static settings, shapes, placement): checked at its first call."""
    with self._lock:
      new = key not in self._seen
    counts = self.read() if new else None
    if counts is not None:
      used, limit = counts
      if used + 2 * self.per_program >= limit:
        raise RuntimeError(
            f'SlotSampler: the next slot program may pass the kernel\'s memory-map limit (vm.max_map_count = '
            f'{limit}; this process holds {used} maps and a program added up to {self.per_program}): XLA:CPU maps '
            'each compiled program\'s code, and past the limit it crashes while compiling. Raise the limit '
            '(`sysctl -w vm.max_map_count=262144`) or use fewer slot programs (config.sampler.row_groups=False, '
            'then device_refill=False; README, Benchmarks).')
    yield
    if new:
      with self._lock:
        self._seen.add(key)
      after = self.read() if counts is not None else None
      if after is not None:
        self.per_program = max(self.per_program, after[0] - counts[0])


CODE_MAPS = CodeMaps()  # The process's: the programs are the process's (module-level jits).


def compiled_programs() -> dict[str, int]:
  """Programs of this process's SlotSamplers together (admit, decode, prefix): the jits' dispatch entries, one
  per compiled program, and one more for a new placement of the same arguments that lowers to a program compiled
  already (tests count lowerings, `tests/rollout/helpers.lowerings`, to tell the two apart)."""
  return {'admit': _admit._cache_size(), 'decode': _decode._cache_size(), 'prefix': _prefix._cache_size()}


class SnapshotSource(Protocol):
  """Where the weights come from: anything with a `snapshot` (e.g. `sao_jax.generate.static.Sampler`)."""
  cfg: ModelConfig

  @property
  def snapshot(self) -> WeightsSnapshot:
    ...


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


ADMISSION_ROWS = ('auto', 'exact', 'padded')  # `SlotSampler`'s `admission_rows`.


def exact_admissions(cfg: ModelConfig, chunk: int, platform: str) -> bool:
  """Whether admissions should be calls of full row buckets (`SlotSampler`'s `admission_rows='auto'`): on a CPU,
  where a program's cost is its FLOPs, when a padding row's `chunk` tokens cost at least 1 GFLOP (2 per weight
  past the embedding; ~10 ms on a 2-core host, about a call's fixed cost: SmolLM2-135M's 16 tokens are 3.4 GFLOP,
  the tiny model's 2.4 MFLOP). On an accelerator a small admission is bound by reading the weights, and a
  padding row is nearly free."""
  return platform == 'cpu' and 2 * cfg.num_params(include_embedding=False) * chunk >= 1e9


def _next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


class SlotSampler:
  """Continuous batching over `num_slots` decode slots (see the module docstring).

  Args:
    source: where the decode-layout weights come from (`Sampler`: its `snapshot` is read once per call).
    num_slots: decode slots (rows of the cache and of every decode step).
    max_seq_len: longest episode (prompt + actions + observations), in tokens.
    stop_ids: tokens that end a turn.
    pad_id: token written after a row's end.
    chunk_buckets: admission chunk lengths (chunks are right-padded up to one; longer ones are split).
    decode_steps: decode steps per chunk (the host admits newcomers between chunks).
    num_windows: attention windows of the decode programs (the last one is the whole cache).
    num_admit_windows: attention windows of the admit programs (multiples of 64, the last one the whole cache):
      an admission reads the smallest that holds its rows' histories and chunk.
    prefix_cache: reuse the shared prefix of new prompts (module docstring): a new episode's slot starts from
      its cache instead of prefilling it.
    fuse_admissions: `step` writes a short admission (past the prefix, at most the smallest chunk bucket; one
      per call) in the decode chunk's first step instead of a device call of its own (module docstring); every
      decode program then carries one (padding when none waits). Off by default: a fused program compiles
      ~2x slower than a plain one (tiny model: 11.4 vs 4.9 s; SmolLM2's warm-up: 968 s vs 265 s for the 52
      programs), for little speed: SmolLM2 multi-turn rollouts 0.99x / 1.12x the unfused in two runs (a fused
      admission added 58-120 ms to its chunk, one of its own took 146-181 ms; README, Benchmarks).
    device_refill: every decode program carries a queue of new episodes (`step`'s `queue`): a slot whose
      episode's last turn ends in a decode chunk takes the next one in the chunk's following step (its prompt
      written and its first token sampled along with the other rows' decode step, `decode.forward_mixed`),
      instead of the chunk ending and the host admitting it. On a small model a host round trip (an admission
      call and a decode call: dispatch, sync, the window's copy) costs several decode steps.
    queue_chunk: with `device_refill`, the longest prompt (past the shared prefix) a queued episode may have
      (the queue's static chunk length; default the smallest chunk bucket); longer ones are left to the caller.
    row_groups: a decode program of R >= 4 rows may split them into two groups (`decode.forward_mixed`): its
      R / 4 longest-history rows attend over the chunk's window, the others over the largest window of at most
      half of it (`_short_windows`), so a long-tailed batch's step reads far fewer slots than R x its longest
      row's. More decode programs (one per window that has a short one); not with `fuse_admissions`.
    admission_rows: how the rows of an admission round become calls (`_admission_calls`): 'padded' (one call,
      the rows padded to the next row bucket: fewest calls), 'exact' (calls of full row buckets only, largest
      first: no padding row is computed) or 'auto' (`exact_admissions`: 'exact' on a CPU for a model whose
      padding row costs more than a call, 'padded' elsewhere).
    cache_sharding: where the cache's keys and values go (dims `[slots, kv_heads, ...]`; e.g. the kv heads
      over the actors' `tensor` axis, as `config.mesh.rules` split the weights' heads: the trainer passes that);
      the cache's other fields are replicated over its devices. None: where the weights are (`_placement`).
  """

  def __init__(self, source: SnapshotSource, *, num_slots: int, max_seq_len: int, stop_ids: Sequence[int],
               pad_id: int, chunk_buckets: Sequence[int] = (16, 32, 64), decode_steps: int = 16,
               num_windows: int = 8, num_admit_windows: int = 3, prefix_cache: bool = True,
               fuse_admissions: bool = False, device_refill: bool = False, queue_chunk: int | None = None,
               row_groups: bool = False, admission_rows: str = 'auto',
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
    # A slot holds at most max_seq_len - 1 tokens (its last token is pending); a chunk write reaches up to
    # the largest bucket past it. Granule 64 keeps the attention reads aligned.
    granule = 64
    self.cache_len = -(-(self.max_seq_len + self.chunk_buckets[-1]) // granule) * granule
    self.windows = decode_windows(self.cache_len, granule=granule, max_segments=max(1, int(num_windows)))
    step = -(-self.cache_len // max(1, int(num_admit_windows)) // granule) * granule
    self.admit_windows = tuple(range(step, self.cache_len, step)) + (self.cache_len,)
    # Admission rows: powers of 4 up to the slot count (few programs; a partly filled admission is cheap).
    self.row_buckets = tuple(sorted({min(4 ** k, self.num_slots) for k in range(16) if 4 ** (k - 1) < self.num_slots}))
    # Fused admissions per decode chunk (`step`): one (the others of a round get an admission call): a fused
    # program compiles ~2x slower than a plain one, and admissions mostly come one at a time.
    self.fuse_admissions = bool(fuse_admissions)
    self.fused_rows = (1,)
    # The queue of new episodes a decode chunk may start (`device_refill`): at most one per slot per chunk.
    self.device_refill = bool(device_refill)
    self.queue_rows = self.num_slots
    self.queue_chunk = int(queue_chunk) if queue_chunk else self.chunk_buckets[0]
    if not 1 <= self.queue_chunk <= self.max_seq_len:
      raise ValueError(f'SlotSampler queue_chunk={queue_chunk} must be in [1, max_seq_len={self.max_seq_len}].')
    # Row groups (`row_groups`): the decode programs of R >= 4 rows may run their R / 4 longest rows at the
    # chunk's window and the others at the largest one of at most half of it (`_short_windows`).
    self.row_groups = bool(row_groups)
    self.placement = self._placement(cache_sharding)
    self._cache = self._placed(_init_cache(self.cfg, self.num_slots, self.cache_len, per_row_index=True))
    if admission_rows not in ADMISSION_ROWS:
      raise ValueError(f'SlotSampler admission_rows={admission_rows!r} must be one of {ADMISSION_ROWS}.')
    platform = next(iter(self._cache.valid.devices())).platform
    self.exact_admissions = (exact_admissions(self.cfg, self.chunk_buckets[0], platform)
                             if admission_rows == 'auto' else admission_rows == 'exact')
    # The decode programs' window buffers (`_decode_impl`'s `windows`), by shape, kept from one chunk to the
    # next, the least recently used dropped past the cache's own size in all.
    self._windows: collections.OrderedDict[tuple[tuple[int, int], ...], Windows] = collections.OrderedDict()
    self._windows_budget = sum(x.nbytes for x in self._cache.k + self._cache.v)
    # The shared prefix (module docstring): its tokens (at most the largest chunk bucket, so one call computes
    # it), and its cache for one weights version, recomputed when the version or the tokens change.
    self.prefix_cache = bool(prefix_cache)
    self.prefix_slots = self.chunk_buckets[-1]
    self.prefix: tuple[int, ...] = ()
    self._prefix_state = 'unknown' if self.prefix_cache else 'off'  # 'unknown' until two distinct prompts.
    self._first_prompt: tuple[int, ...] | None = None
    self._prefix_kv: tuple[tuple[weakref.ref, tuple[int, ...]], DecodeCache] | None = None
    self._no_prefix = self._placed(_init_cache(self.cfg, 1, self.prefix_slots, per_row_index=True))
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

  def _static(self, params: SamplingParams, window: int, split: tuple[int, int] | None = None) -> StaticSettings:
    return StaticSettings(self.cfg, params, self.stop_ids, self.pad_id, window, split)

  def _short_windows(self, rows: int, window: int) -> tuple[int, int] | None:
    """The row groups a decode program of `rows` rows and `window` slots may have (`row_groups`): its split
    (`StaticSettings.split`: the short group's rows and window), or None. Its R / 4 longest rows attend over `window`,
    the others over the largest window of at most half of it (a second group costs ops of its own: on the tiny
    model 16 rows at 352 slots and 12 at 176 with 4 at 352 take the same 0.3 ms a step, SmolLM2's shapes 97 and
    86 ms; at 616 slots, 0.5 against 0.3 ms and 146 against 107 ms, `benchmarks.decode_step`), if it holds a
    queued episode when the program carries a queue. One short window per window: every program is compiled code
    in the process (XLA:CPU maps each one's code; SmolLM2 with a choice of short windows, 70 slot programs in one
    process, ran out of memory maps at `vm.max_map_count` 65530)."""
    long = rows // 4 if self.row_groups and not self.fuse_admissions else 0
    floor = self._queue_need if self._queue_fits(window) else 0
    short = [w for w in self.windows if 2 * w <= window and w >= floor] if long else []
    return (rows - long, short[-1]) if short else None

  def _admission_calls(self, rows: list[int]) -> list[tuple[int, list[int]]]:
    """The calls that admit `rows` (admissions of one chunk bucket and piece, ordered by their histories): (row
    bucket, its rows) each. Padded: one call, its rows padded up to the next row bucket. Exact
    (`exact_admissions`): full row buckets only, the largest first (7 rows: 4 + 1 + 1 + 1), so that no padding
    row is computed (SmolLM2 on a 2-core CPU, 16-token chunks: a call of 1 row 53 ms, of 4 rows 140 ms, so 2 rows
    padded to 4 cost 140 ms against 106, and 7 padded to 16 ~900 ms against ~300)."""
    if not self.exact_admissions:
      return [(next(x for x in self.row_buckets if len(rows) <= x), rows)]
    calls = []
    while rows:
      p = max(x for x in self.row_buckets if x <= len(rows))
      calls.append((p, rows[:p]))
      rows = rows[p:]
    return calls

  def _run_admit(self, st: StaticSettings, weights: DecodeWeights, rows: np.ndarray, chunk: np.ndarray, *args):
    return self._call(('admit', st, rows.shape[0], chunk.shape[1]), _admit, st, self.placement, weights,
                      self._cache, rows, chunk, *args)

  def _run_prefix(self, weights: DecodeWeights, tokens: Sequence[int]) -> DecodeCache:
    chunk = np.full((1, self.prefix_slots), self.pad_id, np.int32)
    chunk[0, :len(tokens)] = tokens
    return self._call(('prefix', self.cfg, self.prefix_slots), _prefix, self.cfg, self.placement, weights, chunk,
                      np.arange(self.prefix_slots)[None] < len(tokens))

  # ---- The shared prefix.

  def _learn_prefix(self, prompt: tuple[int, ...]) -> None:
    """Keeps `prefix` the longest common prefix of the distinct new prompts seen so far (at most
    `prefix_slots` tokens, shorter than each prompt): set by the first two distinct prompts, then it only
    shrinks; under `MIN_PREFIX` tokens it is dropped for good (prompts without a common head)."""
    if self._prefix_state == 'off':
      return
    if self._first_prompt is None or (self._prefix_state == 'unknown' and prompt == self._first_prompt):
      self._first_prompt = prompt  # The first prompt, or the same again (a group): nothing to compare yet.
      return
    ref = self.prefix if self._prefix_state == 'on' else self._first_prompt
    if self._prefix_state == 'on' and len(prompt) > len(ref) and prompt[:len(ref)] == ref:
      return
    n, limit = 0, min(len(ref), len(prompt) - 1, self.prefix_slots)
    while n < limit and ref[n] == prompt[n]:
      n += 1
    self.prefix = ref[:n] if n >= MIN_PREFIX else ()
    self._prefix_state = 'on' if self.prefix else 'off'

  def _prefix_for(self, snapshot: WeightsSnapshot) -> DecodeCache:
    """The shared prefix's cache under `snapshot`'s weights (computed once per snapshot and prefix)."""
    cached = self._prefix_kv
    if cached is None or cached[0][0]() is not snapshot or cached[0][1] != self.prefix:
      self._prefix_kv = cached = ((weakref.ref(snapshot), self.prefix),
                                  self._run_prefix(snapshot.weights, self.prefix))
    return cached[1]

  def _run_decode(self, st: StaticSettings, weights: DecodeWeights, rows: np.ndarray, *args):
    """A decode program's call (`_decode_impl`'s arguments after `rows`), with the window buffers of its
    shapes (kept ones, or new); returns its outputs but those."""
    fused, queue = args[-2:]
    key = ('decode', st, rows.shape[0], self.decode_steps, None if fused is None else fused.chunk.shape,
           None if queue is None else queue.chunk.shape)
    shapes = tuple((hi - lo, w) for lo, hi, w in row_groups(rows.shape[0], st))  # (rows, window) of each group.
    windows = self._windows.pop(shapes, None)
    if windows is None:
      windows = tuple(self._new_windows(r, w) for r, w in shapes)
    *out, windows = self._call(key, _decode, st, self.decode_steps, self.placement, weights, self._cache, rows,
                               *args, windows)
    self._windows[shapes] = windows
    size = lambda kept: sum(x.nbytes for x in jax.tree.leaves(kept))
    while len(self._windows) > 1 and sum(map(size, self._windows.values())) > self._windows_budget:
      self._windows.popitem(last=False)
    return tuple(out)

  def _new_windows(self, rows: int, window: int) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
    """A row group's window buffers (`Windows`), placed as the cache."""
    empty = self._placed(_init_cache(self.cfg, rows, window, per_row_index=True))
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
    decodes = [(r, p, w, split) for r in self.row_buckets
               for p in (self.fused_rows if self.fuse_admissions else (None,)) for w in self.windows
               for split in dict.fromkeys((None, self._short_windows(r, w)))]
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
    t = self.chunk_buckets[0]
    for r, p, w, split in decodes:
      admit = None if p is None else Fused(np.full((p,), r, np.int32), np.zeros((p, t), np.int32),
                                           np.zeros((p, t), bool), np.zeros((p,), bool), np.zeros((p,), bool),
                                           self._no_prefix)
      zeros = np.zeros((r,), np.int32)
      out = self._run_decode(self._static(params, w, split), snapshot.weights,
                             np.full((r,), self.num_slots, np.int32),
                             zeros, np.zeros((r,), bool), zeros, zeros, zeros.astype(np.uint32), np.int32(r + 1),
                             admit, self._queue(w, [], np.zeros((r,), bool)))
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
        self._learn_prefix(tuple(c))
    n_prefix = len(self.prefix)
    starts = [n_prefix if a.new and n_prefix and len(c) > n_prefix and tuple(c[:n_prefix]) == self.prefix else 0
              for a, c in zip(admissions, chunks)]
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
    return self._decode(params, free_target, self.source.snapshot, [])

  def step(self, admissions: Sequence[Admission], params: SamplingParams, *, refill: int | None = None,
           queue: Sequence[NewEpisode] = ()) -> list[SlotTokens]:
    """Admits `admissions` and runs one decode chunk over them and the active slots (one snapshot).

    With `fuse_admissions`, up to `max(fused_rows)` (one) admissions whose chunk (past the shared prefix) fits
    the smallest chunk bucket are written by the chunk's first step (`decode.forward_mixed`: one pass over the
    weights for the decode step and the chunks, no device call of their own); the others are admitted first
    (`admit`). Returns a slot's tokens of the call in one `SlotTokens` (an admitted slot's first token first).
    `refill`: the chunk ends once this many more slots are idle than after the admissions (None: it runs
    `decode_steps` steps or until no slot is active).

    `queue` (with `device_refill`): new episodes, in order, that slots whose episode's last turn (`final`) ends
    in the chunk take, one a step (module docstring); those whose prompt past the shared prefix is longer than
    `queue_chunk` and those past `queue_rows` are not offered. A taken one's tokens come back in a `SlotTokens`
    of its own (`queued`: its index), after the slot's previous episode's; the others were not started."""
    snapshot = self.source.snapshot
    chunks, starts = self._prepare(admissions) if admissions else ([], [])
    fused, rest = [], []
    for a, c, start in zip(admissions, chunks, starts):
      fits = self.fuse_admissions and len(fused) < self.fused_rows[-1] and len(c) - start <= self.chunk_buckets[0]
      (fused if fits else rest).append((a, c, start))
    first = self._admit([x[0] for x in rest], [x[1] for x in rest], [x[2] for x in rest], snapshot,
                        params) if rest else []
    busy = int(self.active.sum()) + len(fused)
    free_target = None if refill is None else self.num_slots - busy + int(refill)
    first_of = {r.slot: r for r in first}
    out = []
    for r in self._decode(params, free_target, snapshot, fused, self._queued(queue)):
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
      self._learn_prefix(tuple(prompt))
      out.append((k, e, prompt))
    n_prefix = len(self.prefix)
    fits = []
    for k, e, prompt in out:
      start = n_prefix if n_prefix and len(prompt) > n_prefix and tuple(prompt[:n_prefix]) == self.prefix else 0
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
              fused: list[tuple[Admission, list[int], int]],
              queued: list[tuple[int, NewEpisode, list[int], int]] = ()) -> list[SlotTokens]:
    was_active = self.active.copy()
    if not was_active.any() and not fused:
      return []
    newcomer = {a.slot: (a, c, start) for a, c, start in fused}
    # Tokens a row holds before the chunk (a newcomer: its history past the admission, the chunk included).
    base = {s: (0 if a.new else int(self.fill[s])) + len(c) for s, (a, c, _) in newcomer.items()}
    # The active slots and the fused newcomers in order of the slots they need (the chunk's window must hold
    # every row's history and chunk), gathered into a row bucket: padding rows (-1 here) point past the cache.
    needs = {s: min(base.get(s, int(self.fill[s])) + self.decode_steps, self.cache_len)
             for s in set(np.flatnonzero(was_active).tolist()) | set(newcomer)}
    order = sorted(needs, key=lambda s: (needs[s], s))
    n, r = len(order), next(x for x in self.row_buckets if len(order) <= x)
    need = max(needs.values())
    if queued:  # A taken episode writes its prefix and prompt, then decodes.
      need = max(need, self._queue_need)
    window = next(w for w in self.windows if need <= w)
    if not self._queue_fits(window):
      queued = []
    # Row groups: the longest rows last (the long group, at `window`), the others and the padding first, at the
    # short group's window when one holds them.
    split = self._short_windows(r, window)
    long = r - split[0] if split else 0
    if not (split and n > long and needs[order[n - long - 1]] <= split[1]):
      split = None
    order = order[:n - long] + [-1] * (r - n) + order[n - long:] if split else order + [-1] * (r - n)
    perm = np.asarray(order, np.int64)
    rows = np.where(perm >= 0, perm, self.num_slots).astype(np.int32)
    gather = lambda a: np.where(perm >= 0, a[np.maximum(perm, 0)], 0).astype(a.dtype)
    # `free_target` counts free slots of all B; the chunk counts idle rows of its R (B - n are not in it).
    target = r + 1 if free_target is None else free_target - (self.num_slots - r)
    lengths_in = self.lengths.copy()
    seeds, budgets, final = self.seeds.copy(), self.budgets.copy(), self.final.copy()
    admit = None
    if self.fuse_admissions:  # Every decode program of a fusing sampler has its admission (padding when none).
      t, p = self.chunk_buckets[0], next(x for x in self.fused_rows if len(fused) <= x)
      pos = {s: j for j, s in enumerate(order)}
      f_rows = np.full((p,), r, np.int32)
      chunk = np.full((p, t), self.pad_id, np.int32)
      valid = np.zeros((p, t), bool)
      reset, from_prefix = np.zeros((p,), bool), np.zeros((p,), bool)
      for j, (a, c, start) in enumerate(fused):
        part = c[start:]
        f_rows[j], reset[j], from_prefix[j] = pos[a.slot], a.new, a.new and start > 0
        chunk[j, :len(part)], valid[j, :len(part)] = part, True
        lengths_in[a.slot], budgets[a.slot], final[a.slot] = 0, a.budget, a.final
        if a.new:
          seeds[a.slot] = a.seed % (1 << 32)
      prefix = self._prefix_for(snapshot) if from_prefix.any() else self._no_prefix
      admit = Fused(f_rows, chunk, valid, reset, from_prefix, prefix)
    queue = self._queue(window, queued, gather(final),
                        self._prefix_for(snapshot) if any(start for *_, start in queued) else None)
    out = self._run_decode(self._static(params, window, split), snapshot.weights, rows, gather(self.last),
                           gather(was_active), gather(lengths_in), gather(budgets), gather(seeds),
                           np.int32(target), admit, queue)
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
      elif s in newcomer:  # Its chunk, then a step per token after the first (each wrote the token before it).
        self.seeds[s], self.budgets[s], self.final[s] = seeds[s], budgets[s], final[s]
        self.fill[s] = base[s] + count - 1
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
