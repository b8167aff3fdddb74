"""Evaluation harness: a task's eval set through the KV-cache sampler; greedy accuracy, avg@k, pass@k.

    python -m sao_jax.eval --config=configs/arith.py --checkpoint=DIR [--step=N]
    python -m sao_jax.eval --config=configs/calculator.py --hf_model=DIR --num_samples=8 --temperature=1.0 \
        --output=results.jsonl --limit=32
    python -m sao_jax.eval --config=configs/smollm2_arith.py --checkpoint=DIR --eval_file=PROBLEMS.jsonl

For every problem of `task.eval_set()` (the first `--limit`), it plays one greedy episode (temperature 0;
`--nogreedy` skips it) and `--num_samples` sampled episodes, many episodes per sampler call
(`config.sampler.batch_size` or `--batch_size`), on the one episode runner `sao_jax.rollout.run_episodes`
(the trainer's actors use the same): multi-turn episodes go on from the sampler's KV cache.

`--eval_file=PATH` scores the `{"id", "problem", "answer"}` rows of PATH (JSONL, JSON, CSV or Parquet), all of
them, in place of the task's eval set, asked and scored by the task's own rule (`with_eval_file`: the task's
`eval_file` option, which `arith_words` and `math` have); a malformed row stops the run with an error naming it.

Scoring is `sao_jax.envs.evaluation`: greedy accuracy, avg@k = mean reward of the first k samples, and the
unbiased pass@k = 1 - C(n-c, k) / C(n, k) for n samples of which c are correct, averaged over problems;
problems with an env error are counted and left out. Per-problem results go to JSONL (`--output`), the
summary is printed as a table (and written next to the JSONL as `<output>.summary.json`).

`evaluate(model, tokenizer, task, EvalConfig.from_config(config), num_samples=..., greedy=...)` is the same run
as a function, for the trainer's periodic eval.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging
import numpy as np

from sao_jax import models
from sao_jax import paths
from sao_jax import rollout
from sao_jax import tokenizers
from sao_jax import structs
from sao_jax.envs import evaluation
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.sampling import SamplingParams
from sao_jax.tokenizers import Tokenizer

# ------------------------------------------------------------------------------------------------------------
# An eval run.


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """What an eval run takes from the run's config: the generation settings (default sampling, episodes per call,
  lengths), the episode limits and the seed episode seeds derive from."""
  settings: GenerateConfig
  limits: rollout.EpisodeLimits
  seed: int = 0

  @classmethod
  def from_config(cls, config: Any) -> EvalConfig:
    return cls(GenerateConfig.from_config(config), rollout.EpisodeLimits.from_config(config), int(config.seed))


class Interrupted(Exception):
  """`run_eval`'s `should_stop()` returned True (a signal): the eval stopped between two batches of episodes."""


@dataclasses.dataclass
class EvalRun:
  """Results of `run_eval`: per-problem results (eval-set order) and the summary metrics."""
  results: list[evaluation.ProblemResult]
  summary: dict[str, float]


def run_eval(backend: rollout.Backend, tokenizer: Tokenizer, task, config: EvalConfig, *, num_samples: int = 0,
             greedy: bool = True, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, limit: int | None = None, batch_size: int | None = None,
             seed: int | None = None, ks: Sequence[int] | None = None, step_timeout_s: float | None = None,
             progress: bool = True, should_stop: Callable[[], bool] | None = None) -> EvalRun:
  """Plays the eval set with `backend` and scores it (see the module docstring).

  Args:
    backend: generation backend (`rollout.make_backend(...)` for the static engine).
    tokenizer: the model's tokenizer.
    task: a `sao_jax.envs` task (`get_task(config.task)`).
    config: the eval settings (`EvalConfig.from_config(run_config)`).
    num_samples: k, sampled episodes per problem (0 = none).
    greedy: also play one greedy (temperature 0) episode per problem.
    temperature, top_p, top_k: sampling settings (default `config.settings.decoding`).
    limit: evaluate the first `limit` problems only (None = all).
    batch_size: episodes per sampler call (default `config.settings.batch_size`).
    seed: sampling seed (default `config.seed`); each episode's seed depends only on (seed, problem, sample).
    ks: the k of pass@k / avg@k (default 1, 2, 4, ... up to num_samples, and num_samples).
    step_timeout_s: wall-clock bound of one env step.
    progress: show a tqdm progress bar (on stderr) and log the rate.
    should_stop: polled before each batch of episodes (the same number of calls on every process: it may be a
      collective); True raises `Interrupted` (a signal stops a long eval within one batch).

  Returns:
    An `EvalRun`.

  Raises:
    Interrupted: `should_stop()` returned True.
  """
  if num_samples < 0:
    raise ValueError(f'num_samples={num_samples} must be >= 0.')
  if not greedy and num_samples == 0:
    raise ValueError('Nothing to evaluate: greedy is off and num_samples is 0.')
  sampling = dataclasses.replace(
      config.settings.decoding, **{k: v for k, v in (('temperature', temperature), ('top_p', top_p),
                                                          ('top_k', top_k)) if v is not None})
  if num_samples and sampling.greedy:
    raise ValueError('num_samples > 0 needs a sampling temperature > 0 (greedy samples would all be equal; '
                     'the greedy episode is played anyway).')
  batch_size = int(config.settings.batch_size if batch_size is None else batch_size)
  if batch_size < 1:
    raise ValueError(f'batch_size={batch_size} must be >= 1.')
  seed = int(config.seed if seed is None else seed)
  limits = config.limits
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
    groups.append((SamplingParams(temperature=0.0), [(i, -1) for i in range(len(examples))]))
  if num_samples:
    groups.append((sampling, [(i, j) for i in range(len(examples)) for j in range(num_samples)]))
  total = sum(len(jobs) for _, jobs in groups)
  trajs: dict[tuple[int, int], structs.Trajectory] = {}
  bar = _progress(total, f'eval {task.name}', progress)
  t0 = time.perf_counter()
  gen_tokens = 0
  try:
    for decoding, jobs in groups:
      for start in range(0, len(jobs), batch_size):
        if should_stop is not None and should_stop():
          raise Interrupted(f'eval of {task.name} stopped after {len(trajs)} of {total} episodes')
        chunk = jobs[start:start + batch_size]
        envs = [task.make_env(examples[i]) for i, _ in chunk]
        seeds = [rollout.episode_seed(seed, i, j) for i, j in chunk]
        out = rollout.run_episodes(backend, tokenizer, envs, limits=limits, decoding=decoding, seeds=seeds,
                                   step_timeout_s=step_timeout_s)
        for job, traj in zip(chunk, out):
          trajs[job] = traj
          gen_tokens += int(traj.action_mask.sum())
        bar.update(len(chunk))
  finally:
    bar.close()
  seconds = time.perf_counter() - t0

  decode = lambda ids: rollout.safe_decode(tokenizer, ids)
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


def evaluate(model, tokenizer: Tokenizer, task, config: EvalConfig, *, num_samples: int = 0, greedy: bool = True,
             output: str | None = None, sampler=None, backend: rollout.Backend | None = None,
             version: int | None = None, **kwargs: Any) -> dict[str, float]:
  """Evaluates `model` on `task`'s eval set; returns the summary dict (what the trainer logs).

  Args:
    model: the policy `Decoder` (may be None when `backend` is given).
    tokenizer, task, config: as in `run_eval`.
    num_samples: k sampled episodes per problem (avg@k, pass@k); 0 = greedy only.
    greedy: play the greedy episode (greedy_accuracy).
    output: write per-problem results to this JSONL path (and the summary to `<output>.summary.json`).
    sampler: a `Sampler` to reuse (its weights are refreshed from `model`).
    backend: a ready `Backend`; default: a new KV-cache sampler over `model` (which compiles its programs).
      For periodic evals build `backend = rollout.make_backend(model, tokenizer, task, config.settings)` once and
      pass it with the current model each time: its weights are refreshed from `model`, its programs reused.
    version: policy version of `model` (the learner step), stamped on the trajectories' turns.
    **kwargs: `run_eval` options (temperature, top_p, top_k, limit, batch_size, seed, ks, progress, ...).

  Returns:
    Summary metrics: num_problems, num_errors, greedy_accuracy, greedy_reward, avg@k, pass@k, num_samples,
    num_episodes, truncated_fraction, mean_turns, mean_action_tokens, episodes_per_second.
  """
  if backend is None:
    if model is None:
      raise ValueError('evaluate needs a model (or a backend).')
    backend = rollout.make_backend(model, tokenizer, task, config.settings, sampler=sampler,
                                   batch_size=kwargs.get('batch_size'), version=version)
  elif model is not None and hasattr(backend, 'update_weights'):
    backend.update_weights(model, version=version)
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
  paths.write_text(f'{output}.summary.json', json.dumps(run.summary, indent=1, sort_keys=True))
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
  """The policy and its tokenizer from a checkpoint directory or an HF model directory (exactly one).

  A checkpoint holds its own model config; an HF directory is built by `models.build` (as the trainer does)
  with `config.model.hf_dir` set to it. The tokenizer is `tokenizers.get_tokenizer(config.model)`, switched to
  the directory's tokenizer.json when there is one.
  """
  if bool(checkpoint) == bool(hf_model):
    raise ValueError('Pass exactly one of --checkpoint=DIR (a sao_jax checkpoint directory) or '
                     '--hf_model=DIR (an HF model directory with config.json and *.safetensors).')
  model_config = config.model.copy_and_resolve_references()
  if checkpoint:
    from sao_jax import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top  # orbax: heavy.
    nested = paths.join(checkpoint, 'checkpoints')
    if paths.isdir(nested) and not any(d.isdigit() for d in paths.listdir(checkpoint)):
      checkpoint = nested  # A trainer workdir was given: its checkpoints live in <workdir>/checkpoints.
    model, cfg = checkpoint_lib.load_policy(checkpoint, step, dtype=config.model.dtype)
  else:
    if not os.path.isdir(hf_model):
      raise FileNotFoundError(f'--hf_model={hf_model!r} is not a directory.')
    model_config.hf_dir = hf_model
    if os.path.exists(os.path.join(hf_model, 'tokenizer.json')):
      model_config.tokenizer = 'hf'
    model, cfg = models.build(model_config)
  tokenizer = tokenizers.get_tokenizer(model_config)
  logging.info('Model %s: %.1fM parameters; tokenizer %s (%d tokens).', cfg.name or '(unnamed)',
               cfg.num_params() / 1e6, type(tokenizer).__name__, tokenizer.vocab_size)
  return model, tokenizer


def with_eval_file(config, path: str):
  """A copy of `config` whose task takes its eval set from `path`, all rows (`config.task.kwargs.eval_file`,
  `config.task.eval_size=0`); a task without an `eval_file` option fails validation naming that field."""
  config = config.copy_and_resolve_references()
  with config.unlocked():
    config.task.kwargs.eval_file = str(path)
    config.task.eval_size = 0
  return config


def main(argv: Sequence[str]) -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from sao_jax import config_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import registry  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  f = _FLAGS
  config = f['config'].value
  if bool(f['checkpoint'].value) == bool(f['hf_model'].value):
    sys.exit('FATAL pass exactly one of --checkpoint=DIR (a sao_jax checkpoint directory) or --hf_model=DIR '
             '(an HF model directory).')
  if f['eval_file'].value:
    config = with_eval_file(config, f['eval_file'].value)
  try:
    config_lib.validate(config)
    task = registry.get_task(config.task)  # Before the model: a bad --eval_file row fails at once.
  except config_lib.ConfigError as e:
    sys.exit(f'FATAL bad config: {e}')
  try:
    model, tokenizer = load_model_and_tokenizer(
        config, checkpoint=f['checkpoint'].value, hf_model=f['hf_model'].value, step=f['step'].value)
  except (FileNotFoundError, ValueError, config_lib.ConfigError) as e:
    task.close()
    sys.exit(f'FATAL cannot load the model: {e}')
  jax.config.update('jax_default_matmul_precision', config.model.matmul_precision)  # As the trainer's run.
  output = f['output'].value or f'eval_{task.name}.jsonl'
  try:
    settings = EvalConfig.from_config(config)
    backend = rollout.make_backend(model, tokenizer, task, settings.settings, batch_size=f['batch_size'].value or None)
    run = run_eval(
        backend, tokenizer, task, settings,
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
  _FLAGS['eval_file'] = flags.DEFINE_string(
      'eval_file', None, 'Score the {"id", "problem", "answer"} rows of this file (JSONL/JSON/CSV/Parquet) in place '
      "of the task's eval set, with the task's prompt and answer rule (tasks with an eval_file option).")
  flags.mark_flags_as_required(['config'])


def run() -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  _define_flags()
  app.run(main)


if __name__ == '__main__':
  run()
