"""The shared head of new prompts (a chat template's system prompt and user header), learned from the prompts.

A new episode whose prompt starts with the head starts from the head's cache (computed once per weights
snapshot) and writes only the rest. The head's keys and values are those a whole-prompt admission writes there
(causal attention: they depend on the head only), so the tokens are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_PREFIX = 8  # Tokens: a shorter shared head is not worth a cache of its own.


class SharedPrefix:
  """The longest common prefix of the distinct new prompts seen so far, at most `max_len` tokens and shorter than
  each prompt compared with it: set by the first two distinct prompts, then it only shrinks; under `MIN_PREFIX`
  tokens it is dropped for good (prompts without a common head). `enabled=False`: always empty."""

  def __init__(self, max_len: int, *, enabled: bool = True):
    self.max_len = int(max_len)
    self.tokens: tuple[int, ...] = ()
    self._state = 'unknown' if enabled else 'off'  # 'unknown' until two distinct prompts; then 'on' or 'off'.
    self._first: tuple[int, ...] | None = None

  def learn(self, prompt: Sequence[int]) -> None:
    """Takes a new prompt into account."""
    prompt = tuple(prompt)
    if self._state == 'off':
      return
    if self._first is None or (self._state == 'unknown' and prompt == self._first):
      self._first = prompt  # The first prompt, or the same again (a group): nothing to compare yet.
      return
    ref = self.tokens if self._state == 'on' else self._first
    if self._state == 'on' and len(prompt) > len(ref) and prompt[:len(ref)] == ref:
      return
    n, limit = 0, min(len(ref), len(prompt) - 1, self.max_len)
    while n < limit and ref[n] == prompt[n]:
      n += 1
    self.tokens = ref[:n] if n >= MIN_PREFIX else ()
    self._state = 'on' if self.tokens else 'off'

  def start(self, prompt: Sequence[int]) -> int:
    """Where a new prompt's write starts: past the shared head when it starts with it (and is longer), else 0."""
    n = len(self.tokens)
    return n if n and len(prompt) > n and tuple(prompt[:n]) == self.tokens else 0
