"""Trajectories -> one learner `Batch` (host numpy arrays, right-padded, bucketed length), packed or not.

    packed = pack(trajs, seq_buckets=config.trainer.seq_buckets, pad_id=tokenizer.pad_id,
                  rows=config.trainer.batch_size, group_size=config.algo.group_size,
                  truncation=config.algo.truncation, packing=config.trainer.pack, ...)
    packed.batch, packed.dropped, packed.kept

`packing='none'`: row b of the batch is trajectory `kept[b]` (one segment per row, S = 1), right-padded to
T = the smallest of `seq_buckets` >= the longest row; padding rows (`segment_mask` 0) fill it up to `rows`.

`packing='ffd'` / `'fixed'`: several trajectories per row (at most `segments`), placed first-fit decreasing
(longest first, each into the first row with room), as contiguous segments numbered 1..S (`segment_ids`).
'ffd' tries every bucket length that holds the longest trajectory and keeps the (rows, T) of least area; 'fixed'
packs into rows of one length (`pack_len`, or the largest bucket). The row count is the smallest allowed one
that takes every trajectory (`allowed_rows`: a multiple of `row_multiple` from a sparse set, so few shapes
compile).

In every layout `rewards[b, t] = reward` exactly at a trajectory's last action token (0 elsewhere), and
`truncated`, `group_ids`, `policy_version` (the oldest turn version) and `segment_mask` are per segment `[B, S]`.

Dropped (counted in `dropped`, by reason): under `truncation='bootstrap'` a truncated row that cannot be
bootstrapped from a state the critic is trained on (`Trajectory.bootstrappable` False: 'not_bootstrappable'),
every truncated row under `truncation='drop'` ('truncated'), rows whose env failed ('env_error'), and, with
groups, every other row of a group that lost a row ('group_incomplete'): the group baselines need whole groups.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from sao_jax import structs

DROP_REASONS = ('not_bootstrappable', 'truncated', 'env_error', 'group_incomplete')
PACKINGS = ('none', 'ffd', 'fixed')


class Packed(NamedTuple):
  """What `pack` returns.

  Attributes:
    batch: the `Batch` of numpy arrays (`structs.BATCH_FIELDS` dtypes).
    kept: index (into the input) of each trajectory in the batch, in (row, segment) order.
    dropped: reason -> number of dropped trajectories (reasons in `DROP_REASONS`; only non-zero ones).
  """
  batch: structs.Batch
  kept: list[int]
  dropped: dict[str, int]


def _drop_reason(traj: structs.Trajectory, truncation: str) -> str | None:
  if 'error' in traj.info:
    return 'env_error'
  if traj.truncated and truncation == 'drop':
    return 'truncated'
  if traj.truncated and not traj.bootstrappable and truncation == 'bootstrap':
    return 'not_bootstrappable'
  return None


def _check_groups(trajectories: Sequence[structs.Trajectory], group_size: int) -> list[list[int]]:
  """Input indices by group: consecutive runs of `group_size` rows sharing a group id, each id used once."""
  if len(trajectories) % group_size:
    raise ValueError(f'{len(trajectories)} trajectories are not whole groups of config.algo.group_size='
                     f'{group_size}.')
  groups, seen = [], set()
  for start in range(0, len(trajectories), group_size):
    ids = [int(t.group_id) for t in trajectories[start:start + group_size]]
    if len(set(ids)) != 1 or (group_size > 1 and ids[0] in seen):
      raise ValueError(f'Trajectories {start}..{start + group_size - 1} are not one whole group (group ids '
                       f'{ids}); each prompt\'s config.algo.group_size={group_size} rollouts must be consecutive '
                       'and share a group id used by no other group.')
    seen.add(ids[0])
    groups.append(list(range(start, start + group_size)))
  return groups


def select(trajectories: Sequence[structs.Trajectory], *, group_size: int = 1,
           truncation: str = 'bootstrap') -> tuple[list[int], collections.Counter[str]]:
  """Which trajectories a batch can take: `(kept indices, reason -> dropped count)`.

  A group (`group_size` consecutive trajectories) is kept whole or dropped whole: a member with an env error,
  a truncation under `truncation='drop'`, or (under 'bootstrap') a truncation that cannot be bootstrapped drops its
  group (the others count as 'group_incomplete'). 'terminal' keeps every truncated trajectory.

  Raises:
    ValueError: a greedy (eval) trajectory, one without action tokens, or groups not contiguous / not whole.
  """
  if truncation not in ('bootstrap', 'drop', 'terminal'):
    raise ValueError(f"truncation={truncation!r}: expected 'bootstrap', 'drop' or 'terminal' "
                     '(config.algo.truncation).')
  if group_size < 1:
    raise ValueError(f'group_size={group_size} must be >= 1.')
  for i, t in enumerate(trajectories):
    if t.greedy:
      raise ValueError(f'Trajectory {i} was generated greedily (temperature 0): greedy episodes are for eval '
                       'only (their behaviour log-probs are those of a point mass).')
    if not t.action_mask.any():
      raise ValueError(f'Trajectory {i} has no action token: nothing to train on and nowhere to put its reward.')
  dropped: collections.Counter[str] = collections.Counter()
  kept: list[int] = []
  for group in _check_groups(trajectories, group_size):
    reasons = [_drop_reason(trajectories[i], truncation) for i in group]
    if all(r is None for r in reasons):
      kept += group
      continue
    for r in reasons:
      dropped[r or 'group_incomplete'] += 1
  return kept, dropped


def _first_fit_decreasing(lengths: Sequence[int], capacity: int, segments: int) -> list[list[int]]:
  """Bins (lists of indices into `lengths`) of total length <= `capacity` and at most `segments` items each:
  longest first, each into the first bin with room (ties by index: deterministic)."""
  bins: list[list[int]] = []
  room: list[int] = []
  for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
    for k, r in enumerate(room):
      if lengths[i] <= r and len(bins[k]) < segments:
        bins[k].append(i)
        room[k] -= lengths[i]
        break
    else:
      bins.append([i])
      room.append(capacity - lengths[i])
  return bins


def allowed_rows(needed: int, row_multiple: int) -> int:
  """The smallest `row_multiple * m` >= `needed` rows whose `m` has at most 4 significant binary digits (1..16,
  18, 20, .., 32, 36, ..): at most 8 row counts per doubling, so a run compiles few update shapes, and the rounding
  adds under 1/8 of the rows (a power of two can add 1/2: 26-39% padding on a long-tailed mix instead of 8-12%,
  docs/benchmarks/packing.md)."""
  m = -(-max(int(needed), 1) // max(1, int(row_multiple)))
  shift = max(0, m.bit_length() - 4)
  return ((m + (1 << shift) - 1) >> shift << shift) * max(1, int(row_multiple))


def plan_packing(lengths: Sequence[int], *, seq_buckets: Sequence[int], packing: str, segments: int,
                 row_multiple: int = 1, pack_len: int = 0) -> tuple[int, int, list[list[int]]]:
  """`(rows, T, bins)` for trajectories of `lengths` (see the module docstring); `bins[r]` = the trajectories of
  row r, in segment order. Raises ValueError if the longest does not fit the largest allowed length."""
  buckets = sorted(int(x) for x in seq_buckets)
  longest = max(lengths, default=1)
  if packing == 'fixed':
    candidates = [int(pack_len) or buckets[-1]]
  elif packing == 'ffd':
    candidates = [x for x in buckets if x >= longest]
  else:
    raise ValueError(f'packing={packing!r}: expected one of {PACKINGS} (config.trainer.pack).')
  candidates = [x for x in candidates if x >= longest]
  if not candidates:
    raise ValueError(f'A trajectory of {longest} tokens does not fit config.trainer.seq_buckets={tuple(buckets)}'
                     + (f' / config.trainer.pack_len={pack_len}' if packing == 'fixed' else '')
                     + ' (raise it to at least config.sampler.max_seq_len).')
  best = None
  for t_len in candidates:
    bins = _first_fit_decreasing(lengths, t_len, segments)
    rows = allowed_rows(len(bins), row_multiple)
    if best is None or rows * t_len < best[0] * best[1]:
      best = (rows, t_len, bins)
  return best


def pack(trajectories: Sequence[structs.Trajectory], *, seq_buckets: Sequence[int], pad_id: int,
         rows: int | None = None, group_size: int = 1, truncation: str = 'bootstrap', packing: str = 'none',
         segments: int = 1, row_multiple: int = 1, pack_len: int = 0) -> Packed:
  """Packs trajectories into a learner batch (see the module docstring).

  Args:
    trajectories: finished episodes, groups (when `group_size > 1`) as consecutive runs.
    seq_buckets: allowed batch lengths (`config.trainer.seq_buckets`).
    pad_id: token id of the padding.
    rows: number of rows of the batch (padding rows with `segment_mask=0` fill it); default: the kept
      trajectories ('none'), the plan's rows (packed; several processes agree on one count this way).
    group_size: rollouts per prompt (`config.algo.group_size`); 1 = no groups.
    truncation: `config.algo.truncation`: 'bootstrap' keeps bootstrappable truncated rows, 'drop' drops all,
      'terminal' keeps all.
    packing: 'none', 'ffd' or 'fixed' (`config.trainer.pack`).
    segments: packed: trajectories per row at most (S, `config.trainer.pack_segments`).
    row_multiple: packed: the row count is a multiple of this (`allowed_rows`; the data shards times the minibatches
      and microbatches of an update, so each splits evenly).
    pack_len: 'fixed': the row length (0 = the largest bucket).

  Returns:
    A `Packed` (batch, kept indices, drop counts).

  Raises:
    ValueError: a greedy (eval) trajectory, groups not contiguous / not whole, more kept rows than `rows`, a
      row longer than the largest bucket, a row without action tokens, or a reward off the action tokens.
  """
  buckets = sorted(int(x) for x in seq_buckets)
  if not buckets:
    raise ValueError('config.trainer.seq_buckets is empty.')
  kept, dropped = select(trajectories, group_size=group_size, truncation=truncation)
  lengths = [len(trajectories[i].tokens) for i in kept]
  if packing == 'none':
    b = len(kept) if rows is None else int(rows)
    if len(kept) > b:
      raise ValueError(f'{len(kept)} trajectories to pack into {b} rows.')
    if b % group_size:
      raise ValueError(f'rows={b} is not a multiple of config.algo.group_size={group_size}.')
    fits = [x for x in buckets if x >= max(lengths, default=0)]
    if not fits:
      raise ValueError(f'A trajectory of {max(lengths)} tokens does not fit config.trainer.seq_buckets='
                       f'{tuple(buckets)} (raise the largest bucket to at least config.sampler.max_seq_len).')
    t_len, s_len = fits[0], 1
    bins = [[j] for j in range(len(kept))] + [[] for _ in range(b - len(kept))]
  else:
    if segments < 1:
      raise ValueError(f'segments={segments} must be >= 1 (config.trainer.pack_segments).')
    b, t_len, bins = plan_packing(lengths, seq_buckets=buckets, packing=packing, segments=segments,
                                  row_multiple=row_multiple, pack_len=pack_len)
    if rows is not None:
      if int(rows) < len(bins) or int(rows) % max(1, int(row_multiple)):
        raise ValueError(f'rows={rows}: the trajectories need {len(bins)} packed rows, and the count must be a '
                         f'multiple of {row_multiple}.')
      b = int(rows)
    bins += [[] for _ in range(b - len(bins))]
    s_len = int(segments)

  host = {k: np.zeros(structs.Batch.field_shape(k, b, t_len, s_len), dtype)
          for k, (_, dtype) in structs.BATCH_FIELDS.items()}
  host['tokens'][:] = pad_id
  host['group_ids'][:] = -1
  order = []
  for row, members in enumerate(bins):
    start = 0
    for s, j in enumerate(members):
      i = kept[j]
      order.append(i)
      traj = trajectories[i]
      n = len(traj.tokens)
      span = slice(start, start + n)
      host['tokens'][row, span] = traj.tokens
      host['action_mask'][row, span] = traj.action_mask
      host['behavior_logprobs'][row, span] = np.where(traj.action_mask, traj.behavior_logprobs, 0.0)
      host['rewards'][row, start + traj.last_action_index] = traj.reward
      host['segment_ids'][row, span] = s + 1
      host['truncated'][row, s] = traj.truncated
      host['group_ids'][row, s] = traj.group_id
      host['segment_mask'][row, s] = 1.0
      host['policy_version'][row, s] = traj.policy_version
      start += n
  batch = structs.Batch.of_host(SimpleNamespace(**host))
  check_batch(batch)
  return Packed(batch, order, {k: v for k, v in dropped.items() if v})


def padding_fraction(batch: structs.Batch) -> float:
  """Share of the batch's token slots that hold no trajectory (padding), host side."""
  return float(np.mean(np.asarray(batch.segment_ids) == 0))


def check_batch(batch: structs.Batch) -> None:
  """Host check of the layout and reward contract of a packed batch (numpy or fetched arrays).

  Segments are contiguous runs numbered 1, 2, ... from the row's start, padding (0) only after the last; a
  segment is real (`segment_mask` 1) exactly when it has tokens; every real segment has an action token and starts
  with a prompt token (the critic's value at a segment's first token is the previous one's); a
  nonzero reward sits only on a real segment's LAST action token (never on a prompt, observation or padding
  token, nor on an earlier action token).

  Raises:
    ValueError: naming the first offending (row, position) or (row, segment).
  """
  seg = np.asarray(batch.segment_ids)
  mask = np.asarray(batch.action_mask) > 0
  rewards = np.asarray(batch.rewards)
  real = np.asarray(batch.segment_mask) > 0
  b, t = seg.shape
  s_len = real.shape[1]
  prev, nxt = seg[:, :-1], seg[:, 1:]
  ok = (nxt == prev) | ((prev > 0) & ((nxt == prev + 1) | (nxt == 0)))  # Same, next segment, or padding after.
  bad_rows = np.flatnonzero(~ok.all(axis=1) | (seg[:, 0] > 1) | (seg.max(axis=1) > s_len))
  if bad_rows.size:
    r = int(bad_rows[0])
    raise ValueError(f'Row {r}: segment ids {seg[r].tolist()[:64]} are not contiguous runs 1, 2, ... <= '
                     f'{s_len} followed by padding 0.')
  ids = np.arange(1, s_len + 1)
  has_tokens = (seg[:, :, None] == ids).any(axis=1)
  has_action = ((seg[:, :, None] == ids) & mask[:, :, None]).any(axis=1)
  wrong = np.argwhere(has_tokens != real)
  if wrong.size:
    r, s = wrong[0].tolist()
    raise ValueError(f'Row {r}, segment {s + 1}: segment_mask {int(real[r, s])} but it has '
                     f'{"tokens" if has_tokens[r, s] else "no tokens"}.')
  empty = np.argwhere(real & ~has_action)
  if empty.size:
    r, s = empty[0].tolist()
    raise ValueError(f'Row {r}, segment {s + 1} has no action token.' if s_len > 1 else
                     f'Row {r} has no action token.')
  first = (seg > 0) & np.concatenate([np.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
  opening = np.argwhere(first & mask)
  if opening.size:  # Its value would be the previous segment's last one (`steps.critic_values`): no prompt.
    r, p = opening[0].tolist()
    raise ValueError(f'Row {r}: the trajectory starting at position {p} starts with an action token (no prompt).')
  positions = np.arange(t)
  last = np.full((b, s_len + 1), -1)
  for s in range(1, s_len + 1):
    last[:, s] = np.max(np.where(mask & (seg == s), positions, -1), axis=1)
  last_of_token = np.take_along_axis(last, seg, axis=1)
  allowed = (seg > 0) & (positions[None, :] == last_of_token)
  bad = np.argwhere((rewards != 0) & ~allowed)
  if bad.size:
    r, p = bad[0].tolist()
    where = ('padding' if seg[r, p] == 0 else 'an earlier action token' if mask[r, p] else 'a non-action token')
    raise ValueError(f'Reward {rewards[r, p]} at (row {r}, position {p}) sits on {where}; rewards belong on '
                     'the last action token of a trajectory.')
