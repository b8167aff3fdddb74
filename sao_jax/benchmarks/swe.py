"""Benchmark of the swe environment: `python -m sao_jax.benchmarks.swe [--episodes=N --rows=1,2,4,8,16]`.

The oracle policy (`envs.swe.oracle_actions`: view, edit, test, submit) plays the shipped instances through the
real episode runner (`rollout.run_episodes`, a `ContextBackend` that replays its turns, so generation costs
nothing and every second is the environment's). For each number of rows (episodes at once: one runner call
plays that many; their tool calls overlap, one thread per row) it prints episodes per second, the wall time of
each kind of tool call (median, p90, max; `run`/`test`/the verdict each start a bubblewrap sandbox, the file
tools do not) and the reward (1.0 expected). Episodes at once stop paying when the sandbox's processes fill the
machine's cores: the speed-up column flattens and the sandboxed calls' latency grows with the rows (they queue
for CPU); the last line names the first row count at which the median verdict takes twice its time alone (the
sandbox admits `--max_concurrent` runs at once, set above the largest row count so that only the CPU limits). The load average is printed: on a shared host
other tenants take cores too.

`--record --config=configs/swe.py [--config.FIELD=...] [--record_out=F.npz]`: a recorded batch of a real model's
episodes instead. The model of `--config` (e.g. SmolLM2: `--config.model.hf_dir=DIR --config.model.tokenizer=hf`)
plays `config.trainer.batch_size` episodes through the trainer's actor path (`rollout.make_engine`: the slot
engine or the static sampler as `config.sampler.continuous` says, `rollout.Actor`, `rollout.play_rows`), with
every env step's observation recorded; the trajectories are packed as the trainer packs them (`trainer.
_pack_batch`) and `check_recorded_batch` checks the batch: each tool result the env returned is a run of
observation tokens (action mask 0) between the model's turns, and the SAO step's skip-observation GAE of the batch
(its TD chain, adaptive lambda and truncation bootstrap as `learner.steps.make_sao_step` builds them, on random
critic values) equals plain GAE over each trajectory's action tokens alone, whatever the values on the
observation tokens. It prints the episodes, turns, tool calls (parsed, malformed, none), rewards, token counts and
the check's largest difference (and, for contrast, the difference of the ablation `gae_over='span'`, whose chain
runs through the observations).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from sao_jax import envs
from sao_jax import losses
from sao_jax import rollout
from sao_jax import structs
from sao_jax.envs import swe
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout.layout import safe_decode
from sao_jax.tokenizers import CharTokenizer

_FLAGS: dict[str, Any] = {}


def _define_flags() -> None:
  """The command line's flags, defined when run as a program (imported, e.g. by the tests, it defines none: the
  `config` flag would clash with `sao_jax.main`'s)."""
  _FLAGS['episodes'] = flags.DEFINE_integer('episodes', 32, 'Episodes per row setting (whole runner calls of `rows` '
                                            'rows).')
  _FLAGS['rows'] = flags.DEFINE_list('rows', ['1', '2', '4', '8', '16'], 'Episodes at once (rows of one runner call).')
  _FLAGS['max_concurrent'] = flags.DEFINE_integer('max_concurrent', 32, 'Sandbox runs admitted at once (tools and '
                                                  'verdicts each).')
  _FLAGS['test_call'] = flags.DEFINE_bool('test_call', True, 'The oracle runs the repository tests before it '
                                          'submits.')
  _FLAGS['record'] = flags.DEFINE_bool('record', False, 'Record a batch of the --config model\'s episodes and check '
                                       'it (module docstring) instead of the oracle benchmark.')
  _FLAGS['config'] = config_flags.DEFINE_config_file('config', None, '--record: the run config (configs/swe.py and '
                                                     'its flags).')
  _FLAGS['record_out'] = flags.DEFINE_string('record_out', '', '--record: write the batch, its episodes\' turns and '
                                             'observations and the figures to this .npz ("" = none).')


def _quantile(xs, q):
  return float(np.quantile(np.asarray(xs), q)) if xs else float('nan')


def run_setting(task, examples, rows: int, episodes: int, test_call: bool) -> dict:
  """Plays `episodes` oracle episodes, `rows` at a time, through `rollout.run_episodes`; returns the figures."""
  tok = CharTokenizer()
  latencies: dict[str, list[float]] = {}
  rewards = []
  wall = 0.0
  done = 0
  while done < episodes:
    n = min(rows, episodes - done)
    batch = [examples[(done + k) % len(examples)] for k in range(n)]
    scripts = {id(ex): swe.oracle_actions(ex, run_tests_first=test_call) for ex in batch}
    envs_ = [task.make_env(ex) for ex in batch]
    prompts = {}
    for env, ex in zip(envs_, batch):
      ids, _ = tok.apply_chat_template(ex.messages(), add_generation_prompt=True)
      prompts[tuple(ids)] = [0, scripts[id(ex)]]

    def generate(context, budget, stop_ids, prompts=prompts):
      del budget, stop_ids
      for m in range(len(context), 0, -1):
        state = prompts.get(tuple(context[:m]))
        if state is not None:
          text = state[1][state[0]]
          state[0] += 1
          ids = tok.encode(text) + [tok.eos_id]
          return ids, [0.0] * len(ids)
      raise AssertionError('unknown prompt')

    backend = rollout.ContextBackend(generate, tok.stop_ids)
    t0 = time.perf_counter()
    trajs = rollout.run_episodes(backend, tok, envs_, limits=rollout.EpisodeLimits(task.max_turns, 1 << 16, 1 << 20),
                                 decoding=SamplingParams(), seeds=[0] * n)
    wall += time.perf_counter() - t0
    rewards += [t.reward for t in trajs]
    for env in envs_:
      for tool, seconds in env.tool_seconds:
        latencies.setdefault(tool, []).append(seconds)
    done += n
  return {'rows': rows, 'episodes': done, 'wall_s': wall, 'eps_per_s': done / wall,
          'reward': float(np.mean(rewards)), 'latency': latencies}


# ------------------------------------------------------------------------------------------------------------
# --record: a real model's episodes, packed as the trainer packs them, checked.


def record_observations(task) -> list:
  """Makes `task.make_env` record every env it builds (returned list, in the order made) and each env's step
  observations (`env.recorded_observations`: the observation text of every step, None when a step gave none)."""
  made = []
  make_env = task.make_env

  def recording_make_env(example):
    env = make_env(example)
    env.recorded_observations = []
    step = env.step

    def recording_step(action_text):
      result = step(action_text)
      env.recorded_observations.append(result.observation)
      return result
    env.step = recording_step
    made.append(env)
    return env
  task.make_env = recording_make_env
  return made


def step_advantages(batch: structs.Batch, values, next_values, cfg) -> np.ndarray:
  """The policy advantages of the SAO step (`learner.steps.make_sao_step`, steps 4-5) on `batch` for the critic
  values `values` / `next_values` ([B, T]): its TD chain (the action tokens of real segments, or their span with
  `gae_over='span'`), its lambda (adaptive per trajectory when `lam_policy < 0`), its truncation bootstrap (V after
  a cut trajectory's last token) and `losses.skip_observation_gae` with the batch's segments."""
  from sao_jax.learner import steps  # pylint: disable=g-import-not-at-top  (the oracle benchmark needs no learner)
  f32 = jnp.float32
  seg = jnp.asarray(batch.segment_ids)
  real = jnp.asarray(batch.segment_mask, f32)
  truncated = jnp.asarray(batch.truncated, bool) & (real > 0)
  mask = jnp.asarray(batch.action_mask, f32) * losses.sequence_to_tokens(real, seg)
  if cfg.truncation == 'drop':
    mask = mask * losses.sequence_to_tokens((~truncated).astype(f32), seg)
  chain = mask if cfg.gae_over == 'actions' else losses.action_span_mask(mask, seg)
  lam = (losses.adaptive_lambda(mask, cfg.adaptive_alpha, seg, batch.num_segments) if cfg.lam_policy < 0
         else jnp.full(real.shape, cfg.lam_policy, f32))
  boot = (steps.truncation_bootstrap(jnp.asarray(next_values, f32), seg, truncated)
          if cfg.truncation == 'bootstrap' else None)
  adv, _ = losses.skip_observation_gae(jnp.asarray(batch.rewards, f32), jnp.asarray(values, f32), chain,
                                       gamma=cfg.gamma, lam=lam, bootstrap=boot, segment_ids=seg)
  return np.asarray(adv * mask)


def _runs(mask: np.ndarray) -> list[tuple[bool, int, int]]:
  """(value, start, end) of the maximal runs of equal values of a bool array."""
  edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
  bounds = [0, *edges.tolist(), len(mask)]
  return [(bool(mask[a]), a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _gae_alone(r, v, boot, gamma, lam):
  """Plain GAE over one trajectory's action tokens alone (a compressed sequence), `boot` after the last."""
  adv, next_v, next_a = np.zeros(len(r)), float(boot), 0.0
  for k in range(len(r) - 1, -1, -1):
    next_a = r[k] + gamma * next_v - v[k] + gamma * lam * next_a
    adv[k], next_v = next_a, v[k]
  return adv


def _turn_kind(text: str, max_calls: int) -> str:
  calls, _ = swe.parse_tool_calls(text, max_calls)
  if not calls:
    return 'no_call'
  if all(isinstance(c, str) for c in calls):
    return 'malformed'
  return 'parsed' if all(isinstance(c, dict) for c in calls) else 'parsed_and_malformed'


def check_recorded_batch(tokenizer, trajs: Sequence[structs.Trajectory], made: Sequence, packed: rollout.Packed,
                         cfg, *, seed: int = 0, max_calls: int = 4) -> dict[str, Any]:
  """Checks a batch packed from `trajs` (played by the envs `made`, in order, with `record_observations`) and
  returns its figures; raises AssertionError when a check fails:

  * every tool result the env returned (its step observations, the last one only when the episode was cut and
    kept it) is decoded from a run of observation tokens right after the model's turn, in order, and no action
    token lies outside the model's turns (the prompt and every observation have action mask 0 in the batch);
  * the SAO step's advantages (`step_advantages`, random critic values) equal plain GAE over each trajectory's
    action tokens alone, and do not change when the values on the non-action tokens are redrawn.
  """
  assert len(trajs) == len(made), (len(trajs), len(made))
  batch = packed.batch
  tokens, amask, segs = (np.asarray(batch.tokens), np.asarray(batch.action_mask) > 0, np.asarray(batch.segment_ids))
  rng = np.random.default_rng(seed)
  next_values = rng.normal(size=tokens.shape).astype(np.float32)
  values = np.concatenate([np.zeros_like(next_values[:, :1]), next_values[:, :-1]], axis=1)
  adv = step_advantages(batch, values, next_values, cfg)
  redrawn = np.where(amask, values, rng.normal(size=tokens.shape).astype(np.float32))
  adv_redrawn = step_advantages(batch, redrawn, next_values, cfg)
  figures = dict.fromkeys(('episodes', 'turns', 'truncated', 'submitted', 'prompt_tokens', 'action_tokens',
                            'observation_tokens', 'tool_results'), 0)
  kinds, tools, rewards = collections.Counter(), collections.Counter(), []
  max_diff, obs_diff = 0.0, float(np.max(np.abs(adv_redrawn - adv)))
  assert np.all(adv[~amask] == 0), 'advantages off the action tokens'
  located = {}  # trajectory index -> (row, start)
  for b in range(tokens.shape[0]):
    for s in range(1, int(segs[b].max(initial=0)) + 1):
      pos = np.flatnonzero(segs[b] == s)
      located[packed.kept[len(located)]] = (b, int(pos[0]))
  for i, (row, start) in located.items():
    t, env = trajs[i], made[i]
    assert t.info.get('uid') in (None, env.example.uid), (t.info.get('uid'), env.example.uid)
    n = len(t.tokens)
    span = slice(start, start + n)
    assert np.array_equal(tokens[row, span], t.tokens) and np.array_equal(amask[row, span], t.action_mask)
    runs = _runs(t.action_mask)
    assert not runs[0][0], 'the prompt holds action tokens'
    actions = [(a, e) for is_action, a, e in runs if is_action]
    gaps = [(a, e) for is_action, a, e in runs[1:] if not is_action]  # After the first turn: observations.
    kept_obs = [o for o in env.recorded_observations if o is not None]
    if not t.truncated:  # A terminal episode's last step gave no observation (the verdict ran instead).
      assert env.recorded_observations[-1] is None, 'a terminal episode ended on an observation'
    assert len(actions) == len(t.turn_versions), (len(actions), t.turn_versions)
    assert len(gaps) == len(kept_obs), f'{len(gaps)} observation runs for {len(kept_obs)} tool results'
    for (a, e), obs in zip(gaps, kept_obs):
      text = safe_decode(tokenizer, t.tokens[a:e])
      assert obs.strip() in text, f'tool result not in its observation tokens: {obs[:80]!r} / {text[:120]!r}'
      figures['observation_tokens'] += e - a
    for a, e in actions:
      text = safe_decode(tokenizer, t.tokens[a:e])
      kinds[_turn_kind(text, max_calls)] += 1
      for call in swe.parse_tool_calls(text, max_calls)[0]:
        if isinstance(call, dict):
          tools[call['name']] += 1
    figures['episodes'] += 1
    figures['turns'] += len(actions)
    figures['truncated'] += int(t.truncated)
    figures['submitted'] += int(bool(t.info.get('submitted')))
    figures['action_tokens'] += int(t.action_mask.sum())
    figures['prompt_tokens'] += runs[0][2]
    figures['tool_results'] += len(kept_obs)
    rewards.append(t.reward)
    # The step's advantages against plain GAE over the action tokens alone.
    idx = np.flatnonzero(t.action_mask)
    r = np.zeros(len(idx))
    r[-1] = t.reward
    boot = next_values[row, start + n - 1] if (t.truncated and cfg.truncation == 'bootstrap') else 0.0
    lam = float(np.clip(1 - 1 / (cfg.adaptive_alpha * len(idx)), 0, 1)) if cfg.lam_policy < 0 else cfg.lam_policy
    ref = _gae_alone(r, values[row, start + idx], boot, cfg.gamma, lam)
    max_diff = max(max_diff, float(np.max(np.abs(adv[row, start + idx] - ref))))
  assert max_diff < 1e-3, f'the step\'s GAE differs from GAE over the action tokens alone by {max_diff}'
  assert obs_diff == 0.0, f'the values on observation tokens moved the advantages by {obs_diff}'
  span_adv = step_advantages(batch, values, next_values, dataclasses.replace(cfg, gae_over='span'))
  return {**figures, 'turn_kinds': dict(kinds), 'tools': dict(tools), 'rewards': rewards,
          'batch_shape': tuple(tokens.shape), 'gae_max_diff': max_diff, 'observation_values_diff': obs_diff,
          'span_ablation_max_diff': float(np.max(np.abs(span_adv - adv)))}


def record(config, out: str = '', devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
  """`--record`: `config.trainer.batch_size` episodes of `config`'s model through the trainer's actor path, packed
  as the trainer packs them, checked (`check_recorded_batch`); prints and returns the figures (and writes the
  batch, the episodes' turns and observations and the figures to `out`, an .npz, when given). `devices`: those
  the model is placed on (default: all, as the trainer's)."""
  # pylint: disable=g-import-not-at-top  (the oracle benchmark needs none of these)
  from sao_jax import config_lib
  from sao_jax import models
  from sao_jax import parallel
  from sao_jax import trainer
  from sao_jax.generate.config import GenerateConfig
  from sao_jax.generate.weights import WeightPublisher
  from sao_jax.learner import algo as algo_lib
  from sao_jax.rollout import actor as actor_lib
  from sao_jax.rollout import prompts as prompts_lib
  from sao_jax.tokenizers import get_tokenizer
  config = config_lib.validate(config, devices=devices)
  jax.config.update('jax_default_matmul_precision', config.model.matmul_precision)
  cfg = algo_lib.StepConfig.from_config(config)
  task = envs.get_task(config.task)
  made = record_observations(task)
  tokenizer = get_tokenizer(config)
  mesh = parallel.make_mesh(config.mesh, parallel.split_devices(config.mesh, devices)[0])
  t0 = time.perf_counter()
  policy, model_config = models.build(config.model, mesh=mesh, rules=config.mesh.rules, seed=int(config.seed))
  publisher = WeightPublisher(None, config.mesh.rules)
  publisher.publish(policy, version=0)
  settings = GenerateConfig.from_config(config)
  engine = actor_lib.make_engine(publisher, tokenizer, task, settings, group_size=cfg.group_size)
  actor = actor_lib.Actor(engine, tokenizer, task, prompts_lib.PromptSource(task.train_iterator(int(config.seed))),
                          publisher=publisher, settings=settings, limits=rollout.EpisodeLimits.from_config(config),
                          seed=int(config.seed), group_size=cfg.group_size,
                          step_timeout_s=float(config.task.step_timeout_s) or None)
  build_s = time.perf_counter() - t0
  rows = int(config.trainer.batch_size)
  t0 = time.perf_counter()
  made.clear()  # Envs built for the engine's set-up (its stop ids) played no episode.
  trajs = actor_lib.play_rows(actor, rows)
  play_s = time.perf_counter() - t0
  packed = trainer._pack_batch(trajs, config.trainer, pad_id=tokenizer.pad_id, rows=rows,  # pylint: disable=protected-access
                               group_size=cfg.group_size, truncation=cfg.truncation, row_multiple=1)
  figures = check_recorded_batch(tokenizer, trajs, made, packed, cfg, seed=int(config.seed),
                                 max_calls=int(config.task.kwargs.get('max_calls_per_turn', 4)))
  figures.update(model=model_config.name, params_m=model_config.num_params() / 1e6, build_s=build_s, play_s=play_s,
                 generated_tokens=sum(t.num_action_tokens for t in trajs), dropped=packed.dropped,
                 tool_seconds=float(sum(s for env in made for _, s in env.tool_seconds)))
  if out:
    episodes = [{'uid': env.example.uid, 'reward': t.reward, 'truncated': t.truncated, 'info': t.info,
                 'turns': [safe_decode(tokenizer, t.tokens[a:e]) for v, a, e in _runs(t.action_mask) if v],
                 'observations': env.recorded_observations} for t, env in zip(trajs, made)]
    np.savez(out, **{k: np.asarray(getattr(packed.batch, k)) for k in structs.BATCH_FIELDS},
             kept=np.asarray(packed.kept), episodes=json.dumps(episodes, default=str),
             figures=json.dumps(figures, default=str))
  print(f'swe --record: {figures["episodes"]} episodes of {model_config.name} ({figures["params_m"]:.1f}M), '
        f'{figures["turns"]} turns; packed batch {figures["batch_shape"]} (dropped {packed.dropped or "none"})')
  print(f'  turns: {figures["turn_kinds"]}; tool calls: {figures["tools"] or "none"}; submitted '
        f'{figures["submitted"]}, truncated {figures["truncated"]}; rewards {figures["rewards"]}')
  print(f'  tokens: prompt {figures["prompt_tokens"]}, action {figures["action_tokens"]}, observation '
        f'{figures["observation_tokens"]} ({figures["tool_results"]} tool results, every one a run of action-mask-0 '
        'tokens after its turn)')
  print(f'  SAO step GAE vs GAE over the action tokens alone: max |diff| {figures["gae_max_diff"]:.2e}; values on '
        f'observation tokens redrawn: max |change| {figures["observation_values_diff"]:.2e}; the ablation '
        f'gae_over=span differs by {figures["span_ablation_max_diff"]:.3f}')
  print(f'  time: build {build_s:.1f} s, episodes {play_s:.1f} s ({figures["generated_tokens"]} generated tokens, '
        f'{figures["tool_seconds"]:.1f} s in tools and verdicts)')
  first = next((safe_decode(tokenizer, t.tokens[a:e]) for t in trajs for v, a, e in _runs(t.action_mask) if v), '')
  print(f'  the first turn: {first[:300]!r}{"..." if len(first) > 300 else ""}')
  if out:
    print(f'  recorded: {out}')
  task.close()
  return figures


def main(argv):
  del argv
  f = {k: v.value for k, v in _FLAGS.items()}
  if f['record']:
    if f['config'] is None:
      raise app.UsageError('--record needs --config (e.g. configs/swe.py).')
    record(f['config'], f['record_out'])
    return
  task = envs.get_task({'name': 'swe', 'max_turns': 12, 'eval_size': 0,
                        'kwargs': {'instructions': 'brief', 'max_concurrent': f['max_concurrent']}})
  examples = task.train_examples()
  print(f'swe oracle through rollout.run_episodes: {len(examples)} instances, {os.cpu_count()} CPUs, '
        f'isolation {task.sandboxes.verdict.isolation}, load average {os.getloadavg()[0]:.1f} at start')
  run_setting(task, examples, 1, 2, f['test_call'])  # Warm-up (imports, page cache).
  results = []
  for rows in (int(r) for r in f['rows']):
    res = run_setting(task, examples, rows, f['episodes'], f['test_call'])
    results.append(res)
    print(f'  rows {rows}: {res["eps_per_s"]:.2f} episodes/s (load {os.getloadavg()[0]:.1f})', flush=True)
  base = results[0]['eps_per_s']
  print('\n| episodes at once | episodes/s | speed-up vs 1 | reward | verdict median / p90 / max (s) | '
        'test call median / p90 (s) | run-free tools median (ms) |')
  print('|---|---|---|---|---|---|---|')
  for res in results:
    lat = res['latency']
    verdict, test = lat.get('verdict', []), lat.get('test', [])
    files = lat.get('view', []) + lat.get('edit', []) + lat.get('create', [])
    print(f'| {res["rows"]} | {res["eps_per_s"]:.2f} | {res["eps_per_s"] / base:.2f}x | {res["reward"]:.2f} | '
          f'{_quantile(verdict, .5):.3f} / {_quantile(verdict, .9):.3f} / {max(verdict or [float("nan")]):.3f} | '
          f'{_quantile(test, .5):.3f} / {_quantile(test, .9):.3f} | {1e3 * _quantile(files, .5):.3f} |')
  best = max(results, key=lambda r: r['eps_per_s'])
  solo = _quantile(results[0]['latency'].get('verdict', []), .5)
  queued = next((r for r in results if _quantile(r['latency'].get('verdict', []), .5) > 2 * solo), None)
  print(f'\nBest {best["eps_per_s"]:.2f} episodes/s at {best["rows"]} at once. The median verdict (one sandbox run) '
        f'takes {solo:.3f} s alone; '
        + (f'it more than doubles from {queued["rows"]} episodes at once: there the sandbox runs wait for the '
           f'{os.cpu_count()} cores (the bottleneck).' if queued else 'it never doubles in the rows tried.')
        + f' Load average at the end {os.getloadavg()[0]:.1f}.')

if __name__ == '__main__':
  _define_flags()
  app.run(main)
