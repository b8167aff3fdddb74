"""`GenerateConfig`: the generation wing's settings, typed and frozen, built once from the run's config."""

from __future__ import annotations

import dataclasses
from typing import Any

from sao_jax.generate.sampling import SamplingParams

WEIGHT_SWITCHES = ('turn', 'episode')  # When an actor takes newer weights: between turns, or between episodes.


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
  """How the actors generate (`configs/base.py`, section `sampler`, documents each field).

  Attributes:
    decoding: temperature / top-p / top-k of the rollouts.
    batch_size: episodes an actor plays together (static batches) or decode slots (continuous batching).
    max_seq_len: the longest episode (prompt + actions + observations), in tokens: the engines' cache length.
    prompt_buckets: static engine: chunk lengths prompts are padded to.
    continuous: play through the slot engine (continuous batching) instead of static batches.
    decode_steps: slot engine: decode steps per device call.
    refill_rows: slot engine: while episodes wait, a decode call ends once this many slots are free (None: a
      quarter of the slots).
    queue_chunk: slot engine: the longest prompt (past the shared prefix) a slot takes inside a decode call
      (None: the smallest admission chunk).
    compile_ahead: slot engine: compile every program before the first episode (else each at first use).
    weight_switch: 'turn' (an episode may go on with newer weights, turn-level partial rollout) or 'episode'.
  """
  decoding: SamplingParams = SamplingParams()
  batch_size: int = 16
  max_seq_len: int = 256
  prompt_buckets: tuple[int, ...] = ()
  continuous: bool = True
  decode_steps: int = 16
  refill_rows: int | None = None
  queue_chunk: int | None = None
  compile_ahead: bool = False
  weight_switch: str = 'turn'

  def __post_init__(self):
    if self.weight_switch not in WEIGHT_SWITCHES:
      raise ValueError(f'weight_switch={self.weight_switch!r} is not one of {WEIGHT_SWITCHES}.')
    if self.batch_size < 1 or self.decode_steps < 1 or self.max_seq_len < 2:
      raise ValueError(f'GenerateConfig: batch_size={self.batch_size}, decode_steps={self.decode_steps} and '
                       f'max_seq_len={self.max_seq_len} must be >= 1, 1 and 2.')

  @classmethod
  def from_config(cls, config: Any) -> GenerateConfig:
    """From a run's config (`config.sampler`, and `config.trainer.weight_switch`)."""
    s = config.sampler
    return cls(decoding=SamplingParams.from_config(s), batch_size=int(s.batch_size),
               max_seq_len=int(s.max_seq_len), prompt_buckets=tuple(int(x) for x in s.prompt_buckets),
               continuous=bool(s.continuous), decode_steps=int(s.decode_steps),
               refill_rows=int(s.refill_rows) or None, queue_chunk=int(s.queue_chunk) or None,
               compile_ahead=bool(s.compile_ahead), weight_switch=str(config.trainer.weight_switch))

  def episodes_per_call(self, group_size: int) -> int:
    """Episodes an actor plays together: `batch_size` rounded down to whole groups (at least one group)."""
    return max(group_size, self.batch_size // group_size * group_size)
