"""The slot engine's jitted programs: pure functions over a slot-major KV cache (`per_row_index=True`).

* `_admit`: writes right-padded chunks into P slots (a new prompt into a reset slot, or a next turn's pending
  token and observation appended to what a slot holds) and samples each one's first token;
* `_decode`: a chunk of at most `num_steps` single-token steps over R gathered slots (a `lax.while_loop` that
  ends when no row is active, or once `free_target` rows are idle), optionally with a `Queue` of new episodes
  that rows whose episode ended take inside the chunk (`decode.forward_mixed` writes the prompt beside the other
  rows' decode step);
* `_prefix`: the cache of the prompts' shared head, copied into a new episode's slots instead of recomputed.

Every program runs on a copy of its rows cut to a static attention window and writes back only the slots it
can have written. The programs are module-level jits keyed by their static settings and shapes, so every
`SlotSampler` of a process shares them (each compiles once per process).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from sao_jax import parallel
from sao_jax.generate import sampling
from sao_jax.generate.static import StaticSettings, is_stop
from sao_jax.models.config import ModelConfig
from sao_jax.models.decode import DecodeCache, DecodeWeights, forward, forward_mixed, init_cache, last_logits

Array = jax.Array
# A decode program's window buffers: (keys, values), one array per layer, of the cache's layout cut to the
# program's rows and window (`_decode_impl`'s `window`).
Window = tuple[tuple[Array, ...], tuple[Array, ...]]


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

  def constrain_kv(self, kv: Window) -> Window:
    """Inside a program: window buffers (`Window`) placed as the cache's keys and values."""
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


def _decode_impl(st: StaticSettings, num_steps: int, place: CachePlacement | None, weights: DecodeWeights,
                 cache: DecodeCache, rows: Array, last: Array, active: Array, lengths: Array, budgets: Array,
                 seeds: Array, free_target: Array, queue: Queue | None = None, window: Window | None = None):
  """Up to `num_steps` tokens for each of the cache rows `rows` [R] (the active slots, gathered; rows >= B are
  padding: inactive, nothing is written back): feeds `last`, samples, stops a row at a stop token or when
  `lengths` (tokens of the turn so far) reaches `budgets` (all [R]). The chunk ends early once `free_target`
  of the R rows are idle (inactive, and not about to take a queued episode: newcomers are waiting for their
  slots) or none is active.

  The loop runs on a copy of the R rows cut to `st.window` slots, and only the slots the chunk can have written
  (`num_steps` from each row's index) go back into the donated full cache: one copy of the rows' windows per
  chunk, not per step, and no work for slots that wait for an env step.

  `queue` (`Queue`): a row whose turn ends while `queue.final` marks it as its episode's last takes the next
  queued episode in the following step (one per step; `forward_mixed` writes its prompt and samples its first
  token, the other rows decode alongside), without a return to the host. Returns, per queue entry, the row it
  went to (`R`: not taken), the column of its first token and the length of the turn it ended (so the host can
  split a row's tokens between its episodes).

  `window` (donated): buffers of the window copy's keys and values (contents ignored), returned after the
  outputs above for the next call: on XLA:CPU a fresh allocation of the copy is fresh pages, faulted in at
  every call (docs/benchmarks/rollout.md). None: the copy is a fresh allocation."""
  b = last.shape[0]
  carry = dict(i=jnp.zeros((), jnp.int32), tokens=jnp.full((b, num_steps), st.pad_id, jnp.int32),
               lps=jnp.zeros((b, num_steps), jnp.float32), slps=jnp.zeros((b, num_steps), jnp.float32),
               active=active, lengths=lengths, last=last, seeds=seeds, budgets=budgets)
  if queue is not None:
    q = queue.chunk.shape[0]
    prompt_slots = queue.prefix.max_len + queue.chunk.shape[1]  # A taken episode's prefix and prompt: [0, this).
    if st.window < prompt_slots + num_steps:
      raise ValueError(f'_decode_impl: window {st.window} too small for the queue ({prompt_slots} + {num_steps}).')
    carry.update(final=queue.rows_final, free=jnp.zeros((b,), bool), next=jnp.zeros((), jnp.int32),
                 taken_row=jnp.full((q,), b, jnp.int32), taken_at=jnp.zeros((q,), jnp.int32),
                 taken_len=jnp.zeros((q,), jnp.int32))
  waiting = lambda c: c['next'] < queue.count  # Queued episodes left.

  def plain(c):
    """One decode step of the active rows."""
    rows_cache = c['cache']
    hidden, new = forward(st.cfg, weights, rows_cache, c['last'][:, None], c['active'][:, None])
    new = new.replace(index=jnp.where(c['active'], rows_cache.index + 1, rows_cache.index))
    tok, lp, slp = sampling.select_tokens(last_logits(weights, hidden), c['seeds'], new.positions, st.params)
    return _advance(st, {**c, 'cache': new}, tok, lp, slp, c['active'])

  def can_take(c):
    return jnp.any(c['free']) & waiting(c) & (c['i'] < num_steps)

  def take(c):
    """The next queued episode into the first free row (`can_take` holds), with a decode step of the active
    rows."""
    k, row = c['next'], jnp.argmax(c['free'])
    entry = lambda x: jax.lax.dynamic_index_in_dim(x, k)  # [1, ...]
    c, tok, lp, slp, is_row = _mixed_step(st, weights, c, row[None], jnp.ones((1,), bool),
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

  carry['cache'] = _cut(cache, rows, st.window, window)
  start = carry['cache'].index  # [R]: a row's chunk writes [start, start + num_steps) at most.
  if queue is None:
    carry = jax.lax.while_loop(running, plain, carry)
  else:  # Plain steps until a row can take a queued episode, then the step that takes it; and again. (A
    # `lax.cond` between the two kinds of step in one loop copied the window's cache every step on XLA:CPU.)
    plain_steps = lambda c: jax.lax.while_loop(lambda c: running(c) & ~can_take(c), plain, c)
    carry = jax.lax.while_loop(lambda c: running(c) & can_take(c), lambda c: plain_steps(take(c)),
                               plain_steps(carry))
  small, w = carry['cache'], st.window
  if queue is not None:  # A row that took a queued episode: its old history is gone (the window's copy says so
    # for the slots it holds; the rest of the row is marked empty here), the new one is in slots [0, m).
    took = jnp.zeros((b,), bool).at[carry['taken_row']].set(True, mode='drop')
    cache = cache.replace(valid=cache.valid.at[jnp.where(took, rows, cache.batch_size)].set(False, mode='drop'))
  # Only the slots the chunk wrote go back (the rest of the window is what was gathered): [R, n] cells per row
  # and layer; a row that ended before the window's end wrote nothing past it.
  m = min(num_steps, w)
  cache = _put_back(cache, small, rows, jnp.minimum(start, w - m), m)
  if queue is not None:
    m = min(prompt_slots + num_steps, w)
    cache = _put_back(cache, small, jnp.where(took, rows, cache.batch_size), jnp.zeros((b,), jnp.int32), m)
  out = (carry['tokens'], carry['lps'], carry['slps'], carry['active'], carry['lengths'], carry['last'],
         carry['i'])
  if queue is not None:
    out += (carry['taken_row'], carry['taken_at'], carry['taken_len'])
  if window is not None:
    kept = (small.k, small.v)
    out += (kept if place is None else place.constrain_kv(kept),)
  return (_constrained(place, cache),) + out


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


def _mixed_step(st: StaticSettings, weights: DecodeWeights, c: dict, rows: Array, reset: Array,
                from_prefix: Array, prefix: DecodeCache, chunk: Array, valid: Array, seeds: Array | None = None,
                chunk_window: int | None = None) -> tuple[dict, Array, Array, Array, Array]:
  """A decode step of the active rows that also writes chunks [P, T] into rows `rows` [P] (R: padding) and
  samples each one's first token (`decode.forward_mixed`: one pass over the weights). The `reset` rows [P] start
  a new episode first: empty, or holding the shared prefix (`prefix`, one row of C slots) in slots [0, C) where
  `from_prefix`; `seeds` [P] are their sampling seeds (None: the rows keep theirs). `chunk_window` (static): the
  chunks attend over slots [0, chunk_window) only (`forward_mixed`'s). Returns the carry with the rows' cache and
  seeds after it, the tokens and log-probs of all R rows (a chunk row's: its first token), and which rows took a
  chunk."""
  r = c['last'].shape[0]
  rows_cache = c['cache']
  at = jnp.where(reset, rows, rows_cache.batch_size)
  for j in range(rows.shape[0]):
    rows_cache = _start_row(rows_cache, at[j], from_prefix[j], prefix)
  hidden, chunk_hidden, rows_cache = forward_mixed(st.cfg, weights, rows_cache, c['last'], c['active'], rows, chunk,
                                                   valid, chunk_window=chunk_window)
  put = lambda x, y: x.at[rows].set(y, mode='drop')
  of_rows = lambda x: jnp.take(x, rows, axis=0, mode='clip')
  all_seeds = c['seeds'] if seeds is None else put(c['seeds'], seeds)
  logits = last_logits(weights, jnp.concatenate([hidden, chunk_hidden], axis=1))  # [R + P, V]
  positions = rows_cache.positions  # A chunk row's: its first token's.
  tok, lp, slp = sampling.select_tokens(logits, jnp.concatenate([all_seeds, of_rows(all_seeds)]),
                                        jnp.concatenate([positions, of_rows(positions)]), st.params)
  pick = lambda x: put(x[:r], x[r:])
  took = put(jnp.zeros((r,), bool), jnp.ones(rows.shape, bool))
  return {**c, 'cache': rows_cache, 'seeds': all_seeds}, pick(tok), pick(lp), pick(slp), took


# The programs, shared by every SlotSampler of the process: one compiled program per static
# settings (model, sampling, window; decode steps; cache placement) and argument shapes (slot count, row and chunk
# buckets).
admit_program = jax.jit(_admit_impl, static_argnums=(0, 1), donate_argnums=(3,))
prefix_program = jax.jit(_prefix_impl, static_argnums=(0, 1))
decode_program = jax.jit(_decode_impl, static_argnums=(0, 1, 2), donate_argnums=(4, 13))
cache_program = jax.jit(init_cache, static_argnums=(0, 1, 2), static_argnames=('per_row_index',))


def compiled_programs() -> dict[str, int]:
  """Programs of this process's SlotSamplers together (admit, decode, prefix): the jits' dispatch entries, one
  per compiled program, and one more for a new placement of the same arguments that lowers to a program compiled
  already (tests count lowerings, `tests/rollout/helpers.lowerings`, to tell the two apart)."""
  size = lambda program: program._cache_size()  # pylint: disable=protected-access
  return {'admit': size(admit_program), 'decode': size(decode_program), 'prefix': size(prefix_program)}

