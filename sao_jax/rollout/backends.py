"""Generation backends of the episode runner: batched, multi-turn, with log-probs and weight versions.

A `Backend` generates one turn for a batch of episodes at a time: `first_turn` from the prompts, then
`next_turn` from each running row's observation tokens. Each row's turn comes back as a `Generation`:
its tokens, their behaviour log-probs (of the distribution actually sampled from), the temperature-1 policy
log-probs when known, and the params version that generated it.

* `SamplerBackend`: the static engine `sao_jax.generate.static.Sampler` (eval's backend, and the actors' for
  static batches; `make_backend` builds it for a task); a multi-turn episode goes on from the cache.
* `ContextBackend`: a per-episode function `generate(context_ids, max_new_tokens, stop_ids) -> (ids,
  logprobs)` on host-side contexts (tests, stubs, references).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sao_jax.envs.base import Task
from sao_jax.generate import static as sampler_lib
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout.layout import stop_ids_for
from sao_jax.tokenizers import Tokenizer

# `generate(context_ids, max_new_tokens, stop_ids) -> (generated ids, their behaviour log-probs)`.
GenerateFn = Callable[[list[int], int, tuple[int, ...]], tuple[Sequence[int], Sequence[float]]]


@dataclasses.dataclass
class Generation:
  """One row's generated turn.

  Attributes:
    ids: generated token ids (with the stop token when the turn stopped on one).
    logprobs: behaviour log-probs: `log q(a)` under the distribution sampled from (0 for greedy decoding).
    policy_logprobs: temperature-1 policy log-probs `log pi(a)`, or None when the backend does not know them.
    version: params version that generated the turn.
  """
  ids: list[int]
  logprobs: list[float]
  policy_logprobs: list[float] | None = None
  version: int = 0


class Backend(Protocol):
  """Batched generation of episodes turn by turn.

  `first_turn` starts a batch of episodes from their prompts and returns each row's first turn and a handle;
  `next_turn` appends each running row's observation tokens (None = the row has finished) and generates the
  next turn of those rows (None for finished rows). Budgets are per row; a row stops at a stop token or at
  its budget.
  """
  stop_ids: tuple[int, ...]

  def first_turn(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], *, decoding: SamplingParams,
                 seeds: Sequence[int]) -> tuple[list[Generation], Any]:
    ...

  def next_turn(self, handle: Any, observations: Sequence[Sequence[int] | None], budgets: Sequence[int], *,
                decoding: SamplingParams) -> tuple[list[Generation | None], Any]:
    ...


class SamplerBackend:
  """The KV-cache sampler (`sao_jax.generate.static.Sampler`) as a `Backend` (the one adapter to its API).

  Each call takes the sampler's weights snapshot once; the version it reports is stamped on the turn.

  Args:
    model: the policy `Decoder` (ignored when `sampler` is given, except to refresh its weights).
    stop_ids: tokens ending a turn (the tokenizer's end-of-turn ids plus the env's stop texts).
    pad_id: the tokenizer's pad id.
    max_total_len: cache preallocated for whole episodes (`config.sampler.max_seq_len`), so that
      continuations rarely need to grow it.
    prompt_buckets: `config.sampler.prompt_buckets`.
    min_rows: every call runs at least this many rows (idle rows fill a partial batch), so the last batch
      of a run reuses the programs compiled for full ones.
    sampler: an existing `Sampler` to reuse (keeps its compiled programs); its stop ids must include
      `stop_ids`.
    version: params version of `model` (when the sampler is built or refreshed here).
  """

  def __init__(self, model, *, stop_ids: Sequence[int], pad_id: int, max_total_len: int,
               prompt_buckets: Sequence[int] = (), min_rows: int = 1, sampler: sampler_lib.Sampler | None = None,
               version: int | None = None):
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.pad_id = int(pad_id)
    if sampler is None:
      sampler = sampler_lib.Sampler(model, stop_ids=self.stop_ids, pad_id=pad_id,
                                    prompt_buckets=tuple(prompt_buckets) or None, version=version or 0)
    else:
      missing = set(self.stop_ids) - set(sampler.stop_ids)
      if missing:
        raise ValueError(f'The given Sampler does not stop on token(s) {sorted(missing)} that this task needs '
                         f'(its stop_ids are {list(sampler.stop_ids)}).')
      self.stop_ids = tuple(sampler.stop_ids)
      if model is not None:
        sampler.update_weights(model, version=version)
    self.sampler = sampler
    self.max_total_len = int(max_total_len)
    self.min_rows = int(min_rows)

  def update_weights(self, model, *, version: int | None = None) -> None:
    """Uses `model`'s weights (policy `version`, default current + 1) from the next call on."""
    self.sampler.update_weights(model, version=version)

  def _fill(self, n: int) -> int:
    """Idle rows added so that every call has at least `min_rows` rows (a last, partial batch reuses the
    programs compiled for full ones); they have a budget of 0 and generate nothing."""
    return max(0, self.min_rows - n)

  @staticmethod
  def _rows(out: sampler_lib.SampleOutput, n: int) -> list[Generation]:
    return [Generation(out.tokens[b, :k].tolist(), out.sampling_logprobs[b, :k].tolist(),
                       out.logprobs[b, :k].tolist(), out.version)
            for b, k in enumerate(out.lengths[:n].tolist())]

  def first_turn(self, prompts, budgets, *, decoding, seeds):
    n, fill = len(prompts), self._fill(len(prompts))
    out = self.sampler.generate(
        [list(p) for p in prompts] + [[self.pad_id]] * fill, max_new_tokens=list(budgets) + [0] * fill,
        params=decoding, seeds=list(seeds) + [0] * fill, max_total_len=self.max_total_len,
        keep_state=True)
    return self._rows(out, n), out.state

  def next_turn(self, handle, observations, budgets, *, decoding):
    n = len(observations)
    fill = handle.batch_size - n
    out = self.sampler.continue_generation(
        handle, list(observations) + [None] * fill, max_new_tokens=list(budgets) + [0] * fill,
        params=decoding, keep_state=True)
    rows = self._rows(out, n)
    return [None if obs is None else row for obs, row in zip(observations, rows)], out.state


class ContextBackend:
  """A `Backend` over a per-episode function `generate(context_ids, max_new_tokens, stop_ids) -> (ids,
  logprobs)`: host-side contexts, no cache, `decoding` and seeds ignored (the function decides). The
  log-probs it returns are the behaviour log-probs; `version` is stamped on every turn."""

  def __init__(self, generate: GenerateFn, stop_ids: Sequence[int], *, version: int = 0):
    self._generate = generate
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.version = int(version)

  def _one(self, context: list[int], budget: int) -> Generation:
    ids, logprobs = self._generate(list(context), int(budget), self.stop_ids)
    ids = [int(i) for i in ids][:budget]
    return Generation(ids, [float(x) for x in logprobs][:len(ids)], None, self.version)

  def first_turn(self, prompts, budgets, *, decoding, seeds):
    del decoding, seeds
    contexts = [list(p) for p in prompts]
    outs = [self._one(c, n) for c, n in zip(contexts, budgets)]
    for c, o in zip(contexts, outs):
      c += o.ids
    return outs, contexts

  def next_turn(self, handle, observations, budgets, *, decoding):
    del decoding
    outs: list[Generation | None] = []
    for c, obs, n in zip(handle, observations, budgets):
      if obs is None:
        outs.append(None)
        continue
      c += list(obs)
      out = self._one(c, n)
      c += out.ids
      outs.append(out)
    return outs, handle


def task_stop_ids(task: Task, tokenizer: Tokenizer) -> tuple[int, ...]:
  """The tokens that end a turn of `task`'s episodes: the tokenizer's end-of-turn ids and the env's stop texts."""
  examples = task.eval_set()
  return stop_ids_for(task.make_env(examples[0]), tokenizer) if examples else tuple(tokenizer.stop_ids)


def make_backend(model, tokenizer: Tokenizer, task: Task, settings: GenerateConfig, *,
                 sampler: sampler_lib.Sampler | None = None, batch_size: int | None = None,
                 version: int | None = None) -> SamplerBackend:
  """The static engine's backend for `task`'s episodes (stop ids `task_stop_ids`; calls padded to `batch_size`
  rows, default `settings.batch_size`; `model`'s weights are policy `version`)."""
  cfg = getattr(model, 'cfg', None)
  vocab = getattr(tokenizer, 'vocab_size', None)
  if cfg is not None and vocab is not None and vocab > cfg.vocab_size:
    raise ValueError(f'The tokenizer has {vocab} tokens but the model only {cfg.vocab_size} embeddings '
                     '(wrong tokenizer for this model? see config.model.tokenizer).')
  return SamplerBackend(model, stop_ids=task_stop_ids(task, tokenizer), pad_id=tokenizer.pad_id,
                        max_total_len=settings.max_seq_len, prompt_buckets=settings.prompt_buckets,
                        min_rows=int(batch_size or settings.batch_size), sampler=sampler, version=version)
