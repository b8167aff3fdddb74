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
"""

from __future__ import annotations

import os
import time

from absl import app
from absl import flags
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import swe
from sao_jax.generate.sampling import SamplingParams
from sao_jax.tokenizers import CharTokenizer

_EPISODES = flags.DEFINE_integer('episodes', 32, 'Episodes per row setting (whole runner calls of `rows` rows).')
_ROWS = flags.DEFINE_list('rows', ['1', '2', '4', '8', '16'], 'Episodes at once (rows of one runner call).')
_MAX_CONCURRENT = flags.DEFINE_integer('max_concurrent', 32, 'Sandbox runs admitted at once (tools and verdicts '
                                       'each).')
_TEST_CALL = flags.DEFINE_bool('test_call', True, 'The oracle runs the repository tests before it submits.')


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


def main(argv):
  del argv
  task = envs.get_task({'name': 'swe', 'max_turns': 12, 'eval_size': 0,
                        'kwargs': {'instructions': 'brief', 'max_concurrent': _MAX_CONCURRENT.value}})
  examples = task.train_examples()
  print(f'swe oracle through rollout.run_episodes: {len(examples)} instances, {os.cpu_count()} CPUs, '
        f'isolation {task.sandboxes.verdict.isolation}, load average {os.getloadavg()[0]:.1f} at start')
  run_setting(task, examples, 1, 2, _TEST_CALL.value)  # Warm-up (imports, page cache).
  results = []
  for rows in (int(r) for r in _ROWS.value):
    res = run_setting(task, examples, rows, _EPISODES.value, _TEST_CALL.value)
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
  app.run(main)
