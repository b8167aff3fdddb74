"""Trajectories -> one learner `Batch` (host numpy arrays, right-padded, bucketed length).

    packed = pack(trajs, seq_buckets=config.trainer.seq_buckets, pad_id=tokenizer.pad_id,
                  rows=config.trainer.batch_size, group_size=config.algo.group_size,
                  truncation=config.algo.truncation)
    packed.batch, packed.dropped, packed.kept

Row b of the batch is trajectory `kept[b]`: its tokens, action mask and behaviour log-probs, right-padded to
T = the smallest of `seq_buckets` >= the longest row; `rewards[b, t] = reward` exactly at the row's last action
token (0 elsewhere); `truncated`, `group_ids`, `policy_version` (the oldest turn version) per row; `row_mask`
1 on real rows and 0 on the padding rows added up to `rows`.

Dropped (counted in `dropped`, by reason): a truncated row that cannot be bootstrapped from a state the
critic is trained on (`Trajectory.bootstrappable` False: 'not_bootstrappable'), every truncated row under
`truncation='drop'` ('truncated'), rows whose env failed ('env_error'), and, with groups, every other row of
a group that lost a row ('group_incomplete'): the group baselines need whole groups.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

from sao_jax import structs

DROP_REASONS = ('not_bootstrappable', 'truncated', 'env_error', 'group_incomplete')


class Packed(NamedTuple):
  """What `pack` returns.

  Attributes:
    batch: the `Batch` of numpy arrays (`structs.BATCH_FIELDS` dtypes).
    kept: index (into the input) of the trajectory in each real row, in row order.
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
  if traj.truncated and not traj.bootstrappable:
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
  a truncation under `truncation='drop'`, or a truncation that cannot be bootstrapped drops its group (the
  others count as 'group_incomplete').

  Raises:
    ValueError: a greedy (eval) trajectory, one without action tokens, or groups not contiguous / not whole.
  """
  if truncation not in ('bootstrap', 'drop'):
    raise ValueError(f"truncation={truncation!r}: expected 'bootstrap' or 'drop' (config.algo.truncation).")
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


def pack(trajectories: Sequence[structs.Trajectory], *, seq_buckets: Sequence[int], pad_id: int,
         rows: int | None = None, group_size: int = 1, truncation: str = 'bootstrap') -> Packed:
  """Packs trajectories into a learner batch (see the module docstring).

  Args:
    trajectories: finished episodes, groups (when `group_size > 1`) as consecutive runs.
    seq_buckets: allowed batch lengths (`config.trainer.seq_buckets`).
    pad_id: token id of the padding.
    rows: number of rows of the batch (padding rows with `row_mask=0` fill it); default: the kept rows.
    group_size: rollouts per prompt (`config.algo.group_size`); 1 = no groups.
    truncation: `config.algo.truncation`: 'bootstrap' keeps bootstrappable truncated rows, 'drop' drops all.

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
  b = len(kept) if rows is None else int(rows)
  if len(kept) > b:
    raise ValueError(f'{len(kept)} trajectories to pack into {b} rows.')
  if b % group_size:
    raise ValueError(f'rows={b} is not a multiple of config.algo.group_size={group_size}.')
  longest = max((len(trajectories[i].tokens) for i in kept), default=0)
  fits = [x for x in buckets if x >= longest]
  if not fits:
    raise ValueError(f'A trajectory of {longest} tokens does not fit config.trainer.seq_buckets={tuple(buckets)} '
                     '(raise the largest bucket to at least config.sampler.max_seq_len).')
  t_len = fits[0]

  host = {k: np.zeros((b,) + ((t_len,) if rank == 2 else ()), dtype) for k, (rank, dtype) in
          structs.BATCH_FIELDS.items()}
  host['tokens'][:] = pad_id
  host['group_ids'][:] = -1
  for row, i in enumerate(kept):
    traj = trajectories[i]
    n = len(traj.tokens)
    host['tokens'][row, :n] = traj.tokens
    host['action_mask'][row, :n] = traj.action_mask
    host['behavior_logprobs'][row, :n] = np.where(traj.action_mask, traj.behavior_logprobs, 0.0)
    host['rewards'][row, traj.last_action_index] = traj.reward
    host['truncated'][row] = traj.truncated
    host['group_ids'][row] = traj.group_id
    host['row_mask'][row] = 1.0
    host['policy_version'][row] = traj.policy_version
  batch = structs.Batch.of_host(SimpleNamespace(**host))
  check_batch(batch)
  return Packed(batch, kept, {k: v for k, v in dropped.items() if v})


def check_batch(batch: structs.Batch) -> None:
  """Host check of the reward contract of a packed batch (numpy or fetched arrays).

  Every real row (`row_mask` 1) has an action token; a nonzero reward sits only on a real row's LAST action
  token (never on a prompt, observation or padding token, nor on an earlier action token).

  Raises:
    ValueError: naming the first offending (row, position).
  """
  mask = np.asarray(batch.action_mask) > 0
  rewards = np.asarray(batch.rewards)
  real = np.asarray(batch.row_mask) > 0
  empty = np.flatnonzero(real & ~mask.any(axis=1))
  if empty.size:
    raise ValueError(f'Row {int(empty[0])} has no action token.')
  positions = np.arange(mask.shape[1])
  last = np.max(np.where(mask, positions, -1), axis=1)
  allowed = real[:, None] & (positions[None, :] == last[:, None])
  bad = np.argwhere((rewards != 0) & ~allowed)
  if bad.size:
    r, t = bad[0].tolist()
    where = 'a padding row' if not real[r] else ('an earlier action token' if mask[r, t] else 'a non-action token')
    raise ValueError(f'Reward {rewards[r, t]} at (row {r}, position {t}) sits on {where}; rewards belong on '
                     'the last action token of a row.')
