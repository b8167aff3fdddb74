"""The two data types that cross part boundaries.

`Trajectory` is what an episode produces on the host (numpy, one row, unpadded); `Batch` is what the
learner consumes on devices (padded `[B, T]` arrays, a pytree). Alignment follows DESIGN.md: token t was
generated from the state `tokens[:t]`; `action_mask[t] = 1` exactly where the policy generated token t;
`behavior_logprobs[t] = log pi_behavior(tokens[t] | tokens[:t])` on action tokens, 0 elsewhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import numpy as np


@dataclasses.dataclass
class Trajectory:
  """One finished episode on the host, unpadded.

  Attributes:
    tokens: int32 `[L]` prompt, actions and observations, in order.
    action_mask: bool `[L]`, True on tokens the policy generated.
    behavior_logprobs: float32 `[L]`, the sampler's log-prob (temperature 1) of each action token; 0 elsewhere.
    reward: scalar reward of the episode; it sits on the last action token.
    truncated: True when a length or turn limit cut the episode (not terminal: bootstrap or drop).
    policy_version: version of the params that generated it (the oldest one, for multi-turn episodes).
    group_id: prompt index for group baselines (rollouts of one prompt share it); -1 when unused.
    sampling_logprobs: optional float32 `[L]` log-prob under the distribution actually sampled from
      (temperature / top-p / top-k), when that differs from the temperature-1 policy.
    info: task metadata (task name, drift phase, verifier details, errors).
  """
  tokens: np.ndarray
  action_mask: np.ndarray
  behavior_logprobs: np.ndarray
  reward: float
  truncated: bool = False
  policy_version: int = 0
  group_id: int = -1
  sampling_logprobs: np.ndarray | None = None
  info: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.tokens = np.asarray(self.tokens, np.int32)
    self.action_mask = np.asarray(self.action_mask, bool)
    self.behavior_logprobs = np.asarray(self.behavior_logprobs, np.float32)
    n = self.tokens.shape
    if self.tokens.ndim != 1 or self.action_mask.shape != n or self.behavior_logprobs.shape != n:
      raise ValueError(
          f'Trajectory arrays must be 1-D of one length: tokens {self.tokens.shape}, action_mask '
          f'{self.action_mask.shape}, behavior_logprobs {self.behavior_logprobs.shape}.')
    if self.sampling_logprobs is not None:
      self.sampling_logprobs = np.asarray(self.sampling_logprobs, np.float32)
      if self.sampling_logprobs.shape != n:
        raise ValueError(f'sampling_logprobs {self.sampling_logprobs.shape} != tokens {n}.')

  @property
  def num_action_tokens(self) -> int:
    return int(self.action_mask.sum())

  @property
  def last_action_index(self) -> int:
    """Index of the last action token (where the reward sits); -1 if there is none."""
    idx = np.flatnonzero(self.action_mask)
    return int(idx[-1]) if idx.size else -1


# The one list of `Batch` fields: name -> (rank, host dtype). Packing, device placement and shardings use it.
BATCH_FIELDS: dict[str, tuple[int, type]] = {
    'tokens': (2, np.int32),
    'action_mask': (2, np.float32),
    'behavior_logprobs': (2, np.float32),
    'rewards': (2, np.float32),
    'truncated': (1, np.bool_),
    'group_ids': (1, np.int32),
    'row_mask': (1, np.float32),
    'policy_version': (1, np.int32),
}


@flax.struct.dataclass
class Batch:
  """A padded learner batch; every field has leading dim B (rows), `[B, T]` ones are right-padded.

  Attributes:
    tokens: int32 `[B, T]`.
    action_mask: float32 `[B, T]`, 1 on policy-generated tokens (0 on prompt, observations, padding).
    behavior_logprobs: float32 `[B, T]`.
    rewards: float32 `[B, T]`, the episode reward on its last action token, 0 elsewhere.
    truncated: bool `[B]`, the episode was cut by a limit (bootstrap from the last value).
    group_ids: int32 `[B]`, rows sharing a prompt (group baselines); -1 when unused.
    row_mask: float32 `[B]`, 0 for padding rows added to fill a bucket.
    policy_version: int32 `[B]`.
  """
  tokens: jax.Array
  action_mask: jax.Array
  behavior_logprobs: jax.Array
  rewards: jax.Array
  truncated: jax.Array
  group_ids: jax.Array
  row_mask: jax.Array
  policy_version: jax.Array

  @property
  def shape(self) -> tuple[int, int]:
    return self.tokens.shape

  @classmethod
  def of_host(cls, batch: Any) -> Batch:
    """A `Batch` of numpy arrays with the dtypes of `BATCH_FIELDS`, from any object with those attributes."""
    return cls(**{k: np.asarray(getattr(batch, k), dtype) for k, (_, dtype) in BATCH_FIELDS.items()})

  @classmethod
  def map_fields(cls, fn) -> Batch:
    """A `Batch` whose field `k` is `fn(k, rank)` (e.g. one sharding per field)."""
    return cls(**{k: fn(k, rank) for k, (rank, _) in BATCH_FIELDS.items()})
