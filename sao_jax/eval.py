"""Evaluation harness: a task's eval set through the KV-cache sampler; greedy accuracy, avg@k, pass@k.

    python -m sao_jax.eval --config=configs/arith.py --checkpoint=DIR [--step=N]
    python -m sao_jax.eval --config=configs/calculator.py --hf_model=DIR --num_samples=8 --temperature=1.0 \
        --output=results.jsonl --limit=32

For every problem of `task.eval_set()` (the first `--limit`), it plays one greedy episode (temperature 0;
`--nogreedy` skips it) and `--num_samples` sampled episodes, many episodes per sampler call
(`config.sampler.batch_size` or `--batch_size`). Multi-turn episodes go on from the sampler's KV cache: after
each turn the env's observation tokens are appended to the cache and the rows that are still running
generate their next turn (`Sampler.continue_generation`), so a history is never recomputed. The budgets and
the episode layout are those of `sao_jax.envs.run_episode` (the reference single-episode driver; tests check
that the batched driver here produces the same trajectories).

Scoring is `sao_jax.envs.evaluation`: greedy accuracy, avg@k = mean reward of the first k samples, and the
unbiased pass@k = 1 - C(n-c, k) / C(n, k) for n samples of which c are correct, averaged over problems;
problems with an env error are counted and left out. Per-problem results go to JSONL (`--output`), the
summary is printed as a table (and written next to the JSONL as `<output>.summary.json`).

`evaluate(model, tokenizer, task, config, num_samples=..., greedy=...)` is the same run as a function, for the
trainer's periodic eval.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

from absl import logging
import numpy as np

from sao_jax import types
from sao_jax.envs import base
from sao_jax.envs import evaluation
from sao_jax.models import sampling as sampling_lib

# ------------------------------------------------------------------------------------------------------------
# Generation backends: batched, multi-turn.


@dataclasses.dataclass
class Generation:
  """One row's generated turn: token ids (with the stop token when it stopped on one) and their log-probs."""
  ids: list[int]
  logprobs: list[float]


# How tokens are chosen (temperature 0 = greedy; top_p 1 / top_k 0 = no cut): the sampler's own static,
# validated parameters, so every backend receives exactly what the sampler runs.
Decoding = sampling_lib.SamplingParams


class Backend(Protocol):
  """Batched generation of episodes turn by turn.

  `first_turn` starts a batch of episodes from their prompts and returns each row's first turn and a handle;
  `next_turn` appends each running row's observation tokens (None = the row has finished) and generates the
  next turn of those rows. Budgets are per row; a row stops at a stop token or at its budget.
  """
  stop_ids: tuple[int, ...]

  def first_turn(self, prompts: Sequence[Sequence[int]], budgets: Sequence[int], *, decoding: Decoding,
                 seeds: Sequence[int]) -> tuple[list[Generation], Any]:
    ...

  def next_turn(self, handle: Any, observations: Sequence[Sequence[int] | None], budgets: Sequence[int], *,
                decoding: Decoding) -> tuple[list[Generation | None], Any]:
    ...


class SamplerBackend:
  """The KV-cache sampler (`sao_jax.models.sampler.Sampler`) as a `Backend` (the one adapter to its API).

  Args:
    model: the policy `Decoder` (ignored when `sampler` is given, except to refresh its weights).
    stop_ids: tokens ending a turn (the tokenizer's end-of-turn ids plus the env's stop texts).
    pad_id: the tokenizer's pad id.
    max_total_len: cache preallocated for whole episodes (`config.sampler.max_seq_len`), so that
      continuations rarely need to grow it.
    prompt_buckets: `config.sampler.prompt_buckets`.
    min_rows: every call runs at least this many rows (idle rows fill a partial batch), so the last batch
      of a run reuses the programs compiled for full ones.
    sampler: an existing `Sampler` to reuse across evals (keeps its compiled programs); its stop ids must
      include `stop_ids`.
  """

  def __init__(self, model, *, stop_ids: Sequence[int], pad_id: int, max_total_len: int,
               prompt_buckets: Sequence[int] = (), min_rows: int = 1, sampler=None):
    from sao_jax.models import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.pad_id = int(pad_id)
    if sampler is None:
      sampler = sampler_lib.Sampler(model, stop_ids=self.stop_ids, pad_id=pad_id,
                                    prompt_buckets=tuple(prompt_buckets) or None)
    else:
      missing = set(self.stop_ids) - set(sampler.stop_ids)
      if missing:
        raise ValueError(f'The given Sampler does not stop on token(s) {sorted(missing)} that this task needs '
                         f'(its stop_ids are {list(sampler.stop_ids)}).')
      self.stop_ids = tuple(sampler.stop_ids)
      if model is not None:
        sampler.update_weights(model)
    self.sampler = sampler
    self.max_total_len = int(max_total_len)
    self.min_rows = int(min_rows)

  def update_weights(self, model) -> None:
    """Uses `model`'s current weights from now on (same config; compiled programs are kept)."""
    self.sampler.update_weights(model)

  def _fill(self, n: int) -> int:
    """Idle rows added so that every call has at least `min_rows` rows (a last, partial batch reuses the
    programs compiled for full ones); they have a budget of 0 and generate nothing."""
    return max(0, self.min_rows - n)

  @staticmethod
  def _rows(out, n: int) -> list[Generation]:
    return [Generation(out.tokens[b, :k].tolist(), out.logprobs[b, :k].tolist())
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
  logprobs)` (the `run_episode` signature): host-side contexts, no cache. For tests, stubs and references."""

  def __init__(self, generate: base.GenerateFn, stop_ids: Sequence[int]):
    self._generate = generate
    self.stop_ids = tuple(int(i) for i in stop_ids)

  def _one(self, context: list[int], budget: int) -> Generation:
    ids, logprobs = self._generate(list(context), int(budget), self.stop_ids)
    ids = list(ids)[:budget]
    return Generation(ids, list(logprobs)[:len(ids)])

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


# ------------------------------------------------------------------------------------------------------------
# The batched episode driver.


@dataclasses.dataclass
class _Episode:
  env: base.Env
  messages: list[dict]
  prompt_ids: list[int]
  context: list[int]
  turns: list[base.Turn] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  truncated: bool = False
  done: bool = False
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _safe_decode(tokenizer: base.Tokenizer, ids: Sequence[int]) -> str:
  """`tokenizer.decode`, dropping ids outside the tokenizer's vocabulary (an untrained model with a larger
  embedding table than the tokenizer emits them); they still count as generated tokens."""
  vocab = getattr(tokenizer, 'vocab_size', None)
  if vocab is not None:
    kept = [i for i in ids if 0 <= i < vocab]
    if len(kept) != len(ids):
      logging.log_first_n(logging.WARNING, 'Model generated token ids outside the tokenizer vocabulary '
                          '(size %d); they decode to nothing.', 1, vocab)
      ids = kept
  return tokenizer.decode(ids)


def run_episodes(backend: Backend, tokenizer: base.Tokenizer, envs: Sequence[base.Env], *,
                 limits: base.EpisodeLimits, decoding: Decoding, seeds: Sequence[int],
                 step_timeout_s: float | None = None, policy_version: int = 0) -> list[types.Trajectory]:
  """Plays one episode per env, all rows together, with `backend`; same semantics as `base.run_episode`.

  Per turn, a row gets `min(max_new_tokens, max_seq_len - len(context))` tokens; a turn that ends without a
  stop token, or an observation that would overflow `max_seq_len`, truncates the episode; the env's turn
  limit and failures (`guarded_step`) end it too. Rows that finish take no part in later turns.

  Args:
    backend: the generation backend (its `stop_ids` must include the env's stop texts).
    tokenizer: renders prompts / message observations, decodes actions.
    envs: fresh envs, one per row (reset here).
    limits: episode budgets.
    decoding: greedy or sampling settings.
    seeds: one sampling seed per row.
    step_timeout_s: wall-clock bound of one `env.step`.
    policy_version: stamped on the trajectories.

  Returns:
    One `Trajectory` per env, in order.
  """
  if len(seeds) != len(envs):
    raise ValueError(f'run_episodes: {len(seeds)} seeds for {len(envs)} envs.')
  if not envs:
    return []
  need = set().union(*(base.stop_ids_for(env, tokenizer) for env in envs))
  if not need <= set(backend.stop_ids):
    raise ValueError(f'The backend does not stop on token(s) {sorted(need - set(backend.stop_ids))} that the '
                     f'{type(envs[0]).__name__} episodes need.')
  stop_ids = set(backend.stop_ids)
  end_ids = set(tokenizer.stop_ids)
  episodes = []
  for env in envs:
    messages = env.reset()
    prompt_ids, _ = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    prompt_ids = list(prompt_ids)
    if len(prompt_ids) >= limits.max_seq_len:
      raise ValueError(f'A prompt of {len(prompt_ids)} tokens does not fit config.sampler.max_seq_len='
                       f'{limits.max_seq_len}.')
    episodes.append(_Episode(env, messages, prompt_ids, list(prompt_ids)))

  def budget(ep: _Episode) -> int:
    return min(limits.max_new_tokens, limits.max_seq_len - len(ep.context))

  def absorb(ep: _Episode, gen: Generation) -> list[int] | None:
    """Records a generated turn, steps the env; returns the observation ids (None when the episode ended)."""
    turn = base.Turn(gen.ids, gen.logprobs)
    ep.turns.append(turn)
    ep.context += gen.ids
    if not (gen.ids and gen.ids[-1] in stop_ids):
      ep.truncated, ep.done = True, True
      ep.info.update(truncated=True, cut_by='max_new_tokens')
      return None
    action_text = _safe_decode(tokenizer, gen.ids)
    obs, reward, done, step_info = base.guarded_step(ep.env, action_text, timeout_s=step_timeout_s)
    ep.info.update(step_info)
    ep.reward = reward
    if done:
      ep.truncated, ep.done = bool(step_info.get('truncated', False)), True
      return None
    if obs is None:
      raise RuntimeError(f'{type(ep.env).__name__}.step returned no observation on a non-final turn.')
    if ep.env.observation_mode == 'inline':
      obs_ids = list(tokenizer.encode(obs))
    else:
      obs_ids = base.message_observation_ids(tokenizer, ep.messages, action_text, gen.ids[-1] in end_ids,
                                             {'role': ep.env.observation_role, 'content': obs})
      ep.messages = ep.messages + [{'role': 'assistant', 'content': action_text},
                                   {'role': ep.env.observation_role, 'content': obs}]
    if len(ep.context) + len(obs_ids) >= limits.max_seq_len:
      ep.truncated, ep.done = True, True
      ep.info.update(truncated=True, cut_by='max_seq_len')
      return None
    turn.observation_ids = obs_ids
    ep.context += obs_ids
    return obs_ids

  gens, handle = backend.first_turn([ep.prompt_ids for ep in episodes], [budget(ep) for ep in episodes],
                                    decoding=decoding, seeds=list(seeds))
  observations = [absorb(ep, g) for ep, g in zip(episodes, gens)]
  max_turns = max(max(ep.env.max_turns, 1) for ep in episodes)
  for _ in range(max_turns - 1):
    if all(ep.done for ep in episodes):
      break
    gens, handle = backend.next_turn(handle, observations, [0 if ep.done else budget(ep) for ep in episodes],
                                     decoding=decoding)
    observations = [None if ep.done else absorb(ep, g) for ep, g in zip(episodes, gens)]
  del handle
  out = []
  for ep in episodes:
    if not ep.done:  # Defensive: an env that neither ended nor cut the episode at its own turn limit.
      ep.truncated = True
      ep.info.update(truncated=True, cut_by='max_turns')
    reward = 0.0 if 'error' in ep.info else ep.reward
    ep.info['num_turns'] = len(ep.turns)
    out.append(base.episode_to_trajectory(ep.prompt_ids, ep.turns, reward, truncated=ep.truncated,
                                          policy_version=policy_version, info=ep.info))
  return out


# ------------------------------------------------------------------------------------------------------------
# An eval run.


def episode_seed(seed: int, problem: int, sample: int) -> int:
  """A uint32 seed per (run seed, problem index, sample index >= -1, -1 = greedy); independent of batching."""
  return int(np.random.SeedSequence([int(seed) % (1 << 32), problem, sample + 1]).generate_state(1)[0])


@dataclasses.dataclass
class EvalRun:
  """Results of `run_eval`: per-problem results (eval-set order) and the summary metrics."""
  results: list[evaluation.ProblemResult]
  summary: dict[str, float]


def make_backend(model, tokenizer: base.Tokenizer, task, config, *, sampler=None,
                 batch_size: int | None = None) -> SamplerBackend:
  """The KV-cache sampler backend for `task`'s episodes (stop ids: tokenizer end-of-turn + env stop texts;
  calls padded to `batch_size` rows, default `config.sampler.batch_size`)."""
  cfg = getattr(model, 'cfg', None)
  vocab = getattr(tokenizer, 'vocab_size', None)
  if cfg is not None and vocab is not None and vocab > cfg.vocab_size:
    raise ValueError(f'The tokenizer has {vocab} tokens but the model only {cfg.vocab_size} embeddings '
                     '(wrong tokenizer for this model? see config.model.tokenizer).')
  examples = task.eval_set()
  stop_ids = (base.stop_ids_for(task.make_env(examples[0]), tokenizer) if examples
              else tuple(tokenizer.stop_ids))
  return SamplerBackend(model, stop_ids=stop_ids, pad_id=tokenizer.pad_id,
                        max_total_len=int(config.sampler.max_seq_len),
                        prompt_buckets=tuple(config.sampler.prompt_buckets),
                        min_rows=int(batch_size or config.sampler.batch_size), sampler=sampler)


def run_eval(backend: Backend, tokenizer: base.Tokenizer, task, config, *, num_samples: int = 0,
             greedy: bool = True, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, limit: int | None = None, batch_size: int | None = None,
             seed: int | None = None, ks: Sequence[int] | None = None, step_timeout_s: float | None = None,
             progress: bool = True, policy_version: int = 0) -> EvalRun:
  """Plays the eval set with `backend` and scores it (see the module docstring).

  Args:
    backend: generation backend (`make_backend(...)` for the KV-cache sampler).
    tokenizer: the model's tokenizer.
    task: a `sao_jax.envs` task (`get_task(config.task)`).
    config: the run config (`config.task.max_turns`, `config.sampler.*`, `config.seed`).
    num_samples: k, sampled episodes per problem (0 = none).
    greedy: also play one greedy (temperature 0) episode per problem.
    temperature, top_p, top_k: sampling settings (default `config.sampler.*`).
    limit: evaluate the first `limit` problems only (None = all).
    batch_size: episodes per sampler call (default `config.sampler.batch_size`).
    seed: sampling seed (default `config.seed`); each episode's seed depends only on (seed, problem, sample).
    ks: the k of pass@k / avg@k (default 1, 2, 4, ... up to num_samples, and num_samples).
    step_timeout_s: wall-clock bound of one env step.
    progress: show a tqdm progress bar (on stderr) and log the rate.
    policy_version: stamped on the trajectories (the learner step).

  Returns:
    An `EvalRun`.
  """
  if num_samples < 0:
    raise ValueError(f'num_samples={num_samples} must be >= 0.')
  if not greedy and num_samples == 0:
    raise ValueError('Nothing to evaluate: greedy is off and num_samples is 0.')
  s = config.sampler
  sampling = Decoding(temperature=float(s.temperature if temperature is None else temperature),
                      top_p=float(s.top_p if top_p is None else top_p),
                      top_k=int(s.top_k if top_k is None else top_k))
  if num_samples and sampling.greedy:
    raise ValueError('num_samples > 0 needs a sampling temperature > 0 (greedy samples would all be equal; '
                     'the greedy episode is played anyway).')
  batch_size = int(s.batch_size if batch_size is None else batch_size)
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be >= 1.')
  seed = int(config.seed if seed is None else seed)
  limits = base.EpisodeLimits.from_config(config)
  examples = task.eval_set()
  if limit is not None:
    if limit < 1:
      raise ValueError(f'limit={limit} must be >= 1.')
    examples = examples[:limit]
  if not examples:
    raise ValueError(f'Task {task.name!r} has an empty eval set.')

  # Jobs: (problem, sample index or -1 for greedy); greedy and sampled jobs are batched separately.
  groups = []
  if greedy:
    groups.append((Decoding(temperature=0.0), [(i, -1) for i in range(len(examples))]))
  if num_samples:
    groups.append((sampling, [(i, j) for i in range(len(examples)) for j in range(num_samples)]))
  total = sum(len(jobs) for _, jobs in groups)
  trajs: dict[tuple[int, int], types.Trajectory] = {}
  bar = _progress(total, f'eval {task.name}', progress)
  t0 = time.perf_counter()
  gen_tokens = 0
  try:
    for decoding, jobs in groups:
      for start in range(0, len(jobs), batch_size):
        chunk = jobs[start:start + batch_size]
        envs = [task.make_env(examples[i]) for i, _ in chunk]
        seeds = [episode_seed(seed, i, j) for i, j in chunk]
        out = run_episodes(backend, tokenizer, envs, limits=limits, decoding=decoding, seeds=seeds,
                           step_timeout_s=step_timeout_s, policy_version=policy_version)
        for job, traj in zip(chunk, out):
          trajs[job] = traj
          gen_tokens += int(traj.action_mask.sum())
        bar.update(len(chunk))
  finally:
    bar.close()
  seconds = time.perf_counter() - t0

  decode = lambda ids: _safe_decode(tokenizer, ids)
  results = []
  for i, ex in enumerate(examples):
    g = trajs.get((i, -1))
    samples = [trajs[(i, j)] for j in range(num_samples)]
    r = evaluation.problem_result(ex, greedy=g, samples=samples, decode=decode)
    if g is not None:
      r.info.update(greedy_num_turns=int(g.info.get('num_turns', 0)), greedy_truncated=bool(g.truncated))
    if samples:
      r.info.update(num_truncated=sum(bool(t.truncated) for t in samples),
                    num_turns=[int(t.info.get('num_turns', 0)) for t in samples])
    results.append(r)
  summary = evaluation.summarize(results, ks=ks)
  all_trajs = list(trajs.values())
  summary['num_episodes'] = float(len(all_trajs))
  summary['truncated_fraction'] = float(np.mean([t.truncated for t in all_trajs]))
  summary['mean_turns'] = float(np.mean([t.info.get('num_turns', 0) for t in all_trajs]))
  summary['mean_action_tokens'] = gen_tokens / len(all_trajs)
  summary['episodes_per_second'] = len(all_trajs) / max(seconds, 1e-9)
  logging.info('Eval %s: %d episodes (%d problems) in %.1fs, %.1f generated tokens/s.', task.name,
               len(all_trajs), len(examples), seconds, gen_tokens / max(seconds, 1e-9))
  return EvalRun(results, summary)


def evaluate(model, tokenizer: base.Tokenizer, task, config, *, num_samples: int = 0, greedy: bool = True,
             output: str | None = None, sampler=None, backend: Backend | None = None,
             **kwargs: Any) -> dict[str, float]:
  """Evaluates `model` on `task`'s eval set; returns the summary dict (what the trainer logs).

  Args:
    model: the policy `Decoder` (may be None when `backend` is given).
    tokenizer, task, config: as in `run_eval`.
    num_samples: k sampled episodes per problem (avg@k, pass@k); 0 = greedy only.
    greedy: play the greedy episode (greedy_accuracy).
    output: write per-problem results to this JSONL path (and the summary to `<output>.summary.json`).
    sampler: a `Sampler` to reuse (its weights are refreshed from `model`).
    backend: a ready `Backend`; default: a new KV-cache sampler over `model` (which compiles its programs).
      For periodic evals build `backend = make_backend(model, tokenizer, task, config)` once and pass it with
      the current model each time: its weights are refreshed from `model` and its compiled programs reused.
    **kwargs: `run_eval` options (temperature, top_p, top_k, limit, batch_size, seed, ks, progress, ...).

  Returns:
    Summary metrics: num_problems, num_errors, greedy_accuracy, greedy_reward, avg@k, pass@k, num_samples,
    num_episodes, truncated_fraction, mean_turns, mean_action_tokens, episodes_per_second.
  """
  if backend is None:
    if model is None:
      raise ValueError('evaluate needs a model (or a backend).')
    backend = make_backend(model, tokenizer, task, config, sampler=sampler, batch_size=kwargs.get('batch_size'))
  elif model is not None and hasattr(backend, 'update_weights'):
    backend.update_weights(model)
  run = run_eval(backend, tokenizer, task, config, num_samples=num_samples, greedy=greedy, **kwargs)
  if output:
    write_outputs(output, run)
  return run.summary


def write_outputs(output: str, run: EvalRun) -> None:
  """Per-problem JSONL at `output`, the summary at `<output>.summary.json` (process 0 only)."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.process_index() != 0:
    return
  n = evaluation.write_jsonl(output, run.results)
  with open(f'{output}.summary.json', 'w', encoding='utf-8') as f:
    json.dump(run.summary, f, indent=1, sort_keys=True)
  logging.info('Wrote %d problem results to %s.', n, output)


class _NoBar:
  def update(self, n: int) -> None:
    del n

  def close(self) -> None:
    pass


def _progress(total: int, desc: str, enabled: bool):
  if not enabled:
    return _NoBar()
  from tqdm import auto as tqdm  # pylint: disable=g-import-not-at-top
  return tqdm.tqdm(total=total, desc=desc, unit='ep', file=sys.stderr, dynamic_ncols=True)


# ------------------------------------------------------------------------------------------------------------
# Command line.


def load_model_and_tokenizer(config, *, checkpoint: str | None, hf_model: str | None, step: int | None = None):
  """The policy and its tokenizer from a checkpoint directory or an HF model directory (exactly one)."""
  from sao_jax import tokenizers  # pylint: disable=g-import-not-at-top
  if bool(checkpoint) == bool(hf_model):
    raise ValueError('Pass exactly one of --checkpoint=DIR (a sao_jax checkpoint directory) or '
                     '--hf_model=DIR (an HF model directory with config.json and *.safetensors).')
  if checkpoint:
    from sao_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
    nested = os.path.join(checkpoint, 'checkpoints')
    if os.path.isdir(nested) and not any(d.isdigit() for d in os.listdir(checkpoint)):
      checkpoint = nested  # A trainer workdir was given: its checkpoints live in <workdir>/checkpoints.
    model, cfg = checkpoint_lib.load_policy(checkpoint, step, dtype=config.model.dtype)
    tokenizer = tokenizers.get_tokenizer(config)
  else:
    from sao_jax.models import hf_io  # pylint: disable=g-import-not-at-top
    if not os.path.isdir(hf_model):
      raise FileNotFoundError(f'--hf_model={hf_model!r} is not a directory.')
    model, cfg = hf_io.load_hf(hf_model, dtype=config.model.dtype)
    if os.path.exists(os.path.join(hf_model, 'tokenizer.json')):
      tokenizer = tokenizers.HFTokenizer.from_dir(hf_model)
    else:
      tokenizer = tokenizers.get_tokenizer(config)
  logging.info('Model %s: %.1fM parameters; tokenizer %s (%d tokens).', cfg.name or '(unnamed)',
               cfg.num_params() / 1e6, type(tokenizer).__name__, tokenizer.vocab_size)
  return model, tokenizer


def main(argv: Sequence[str]) -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  from sao_jax import config_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import registry  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  f = _FLAGS
  config = f['config'].value
  if bool(f['checkpoint'].value) == bool(f['hf_model'].value):
    sys.exit('FATAL pass exactly one of --checkpoint=DIR (a sao_jax checkpoint directory) or --hf_model=DIR '
             '(an HF model directory).')
  try:
    config_lib.validate(config)
  except config_lib.ConfigError as e:
    sys.exit(f'FATAL bad config: {e}')
  try:
    model, tokenizer = load_model_and_tokenizer(
        config, checkpoint=f['checkpoint'].value, hf_model=f['hf_model'].value, step=f['step'].value)
  except (FileNotFoundError, ValueError, config_lib.ConfigError) as e:
    sys.exit(f'FATAL cannot load the model: {e}')
  task = registry.get_task(config.task)
  output = f['output'].value or f'eval_{task.name}.jsonl'
  try:
    run = run_eval(
        make_backend(model, tokenizer, task, config, batch_size=f['batch_size'].value or None), tokenizer,
        task, config,
        num_samples=f['num_samples'].value, greedy=f['greedy'].value, temperature=f['temperature'].value,
        top_p=f['top_p'].value, top_k=f['top_k'].value, limit=f['limit'].value or None,
        batch_size=f['batch_size'].value or None, seed=f['seed'].value)
  except ValueError as e:
    sys.exit(f'FATAL {e}')
  finally:
    task.close()
  write_outputs(output, run)
  source = f['checkpoint'].value or f['hf_model'].value
  print(evaluation.format_table(run.summary, title=f'{task.name} eval of {source} -> {output}'))


_FLAGS: dict[str, Any] = {}


def _define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  _FLAGS['config'] = config_flags.DEFINE_config_file(
      'config', None, 'Config file, e.g. configs/arith.py (task, sampler budgets, model dtype/tokenizer).')
  _FLAGS['checkpoint'] = flags.DEFINE_string('checkpoint', None, 'sao_jax checkpoint directory (the policy).')
  _FLAGS['step'] = flags.DEFINE_integer('step', None, 'Checkpoint step to load (default: the latest).')
  _FLAGS['hf_model'] = flags.DEFINE_string('hf_model', None, 'HF model directory (config.json, safetensors).')
  _FLAGS['num_samples'] = flags.DEFINE_integer('num_samples', 0, 'k: sampled episodes per problem (pass@k).')
  _FLAGS['greedy'] = flags.DEFINE_bool('greedy', True, 'Play one greedy (temperature 0) episode per problem.')
  _FLAGS['temperature'] = flags.DEFINE_float('temperature', None, 'Sampling temperature (default: config).')
  _FLAGS['top_p'] = flags.DEFINE_float('top_p', None, 'Sampling top-p (default: config.sampler.top_p).')
  _FLAGS['top_k'] = flags.DEFINE_integer('top_k', None, 'Sampling top-k (default: config.sampler.top_k).')
  _FLAGS['limit'] = flags.DEFINE_integer('limit', 0, 'Evaluate the first N problems only (0 = all).')
  _FLAGS['batch_size'] = flags.DEFINE_integer('batch_size', 0, 'Episodes per sampler call (0 = config).')
  _FLAGS['seed'] = flags.DEFINE_integer('seed', None, 'Sampling seed (default: config.seed).')
  _FLAGS['output'] = flags.DEFINE_string('output', '', 'Per-problem JSONL (default eval_<task>.jsonl).')
  flags.mark_flags_as_required(['config'])


def run() -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)


if __name__ == '__main__':
  run()
