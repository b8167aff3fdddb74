r"""The actor-learner loop on an agentic-like workload: trained trajectories/s, learner idle, staleness.

  python -m sao_jax.benchmarks.loop [--rounds=2 --num_steps=12 --skip=3 --threads=1 --slots=32 --json=m.json]
  python -m sao_jax.benchmarks.loop --nocontinuous --threads=4 [--call_rows=8 ...]   # static actor calls

Runs the real trainer (`sao_jax.trainer.run`) on the tiny model with the `latency` task (`sao_jax/envs/latency.py`:
a geometric number of tool calls, mean 4, each sleeping a log-normal time of median 150 ms; turns as long as the
random policy's wait for one of 52 stop letters, cut at 64 tokens), in these settings, same config otherwise:

  sync       trainer.mode=sync: the loop plays the batch in static calls of `--call_rows` rows, then updates;
  async      trainer.mode=async: `--threads` actor threads, each keeping `--slots` episodes in flight (continuous
             batching, slot programs compiled ahead; `--nocontinuous`: static calls of `--call_rows`);
  grpo       async, algo.name=grpo with G=8 (whole groups), the same trajectories per step;
  sync_grpo  sync, GRPO as in grpo.

The queue bounds the trajectories in flight or queued (`threads * slots + batch`). The settings run interleaved,
`--rounds` times; a run's figures come from WORKDIR/metrics.jsonl without its first `--skip` steps (compiles):

  trajectories/s = rows * n / sum(step_time_s),   learner idle = sum(wait_fraction * step_time_s) / sum(step_time_s)

(a step runs from one update's dispatch to the next's; `learner/busy_s` is its part in which an update ran). A probe
first times `--probe_calls` sampler calls of the workload outside the trainer; with the runs it gives `--json`, the
measurements `python -m sao_jax.sim.calibrate` reads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from absl import app
from absl import flags
import jax
import numpy as np

from sao_jax import config_lib
from sao_jax import metrics as metrics_lib
from sao_jax import models
from sao_jax import rollout
from sao_jax import trainer
from sao_jax.generate.config import GenerateConfig
from sao_jax.envs import registry
from sao_jax.generate.sampling import SamplingParams
from sao_jax.tokenizers import get_tokenizer

SETTINGS = ('sync', 'async', 'grpo', 'sync_grpo')
NAMES = {'sync': 'sync/sao', 'async': 'async/sao', 'grpo': 'async/grpo', 'sync_grpo': 'sync/grpo'}  # Calibration's.
LETTERS = 'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'

_QUICK = flags.DEFINE_bool('quick', False, 'A couple of steps on a tiny workload (the test suite runs this).')
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Interleaved rounds of all settings.')
_STEPS = flags.DEFINE_integer('num_steps', 12, 'Learner steps per run.')
_SKIP = flags.DEFINE_integer('skip', 3, 'First steps of a run left out of the rates (compile, warm-up).')
_THREADS = flags.DEFINE_integer('threads', 1, 'Actor threads in async mode.')
_BATCH = flags.DEFINE_integer('batch_size', 16, 'Trajectories per learner step.')
_CALL = flags.DEFINE_integer('call_rows', 8, 'Episodes per sampler call (GRPO: one group of G = call_rows).')
_CONTINUOUS = flags.DEFINE_bool('continuous', True, 'Async settings: actors play through continuous batching '
                                '(sampler.continuous) with --slots decode slots each; --nocontinuous: static calls '
                                'of --call_rows episodes.')
_SLOTS = flags.DEFINE_integer('slots', 32, 'With --continuous: decode slots per actor thread (sampler.batch_size).')
_DECODE_STEPS = flags.DEFINE_integer('decode_steps', 16, 'With --continuous: decode steps per device call.')
_SETTINGS = flags.DEFINE_list('settings', list(SETTINGS), f'Which of {SETTINGS}.')
_PROBE = flags.DEFINE_integer('probe_calls', 5, 'Sampler calls of the timing probe (0 = no probe).')
_JSON = flags.DEFINE_string('json', '', 'Write the calibration measurements (sao_jax.sim.calibrate) here.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 2, 'Split a CPU host into this many XLA devices '
                                   '(jax_num_cpu_devices; other platforms ignore it), so that actors and learner '
                                   'can have devices of their own.')
_ACTOR_DEVICES = flags.DEFINE_integer('actor_devices', 1, 'config.mesh.actor_devices (0: the actors share the '
                                      "learner's device, whose programs then run one after another).")
_CACHE = flags.DEFINE_string('compile_cache', os.path.join(tempfile.gettempdir(), 'sao_jax_bench_cache'),
                             'JAX persistent compilation cache (actor threads compile the same programs).')


def bench_config(setting: str, *, quick: bool = False, threads: int = 1, batch: int = 16, call_rows: int = 8,
                 steps: int = 12, workdir: str = '', continuous: bool = True, slots: int = 32,
                 decode_steps: int = 16, actor_devices: int = 0):
  """The benchmark's trainer config for one of SETTINGS. `continuous`: the async settings' actors play through
  continuous batching with `slots` decode slots each (GRPO: whole groups of G = call_rows stream through them);
  sync mode keeps its static calls. `actor_devices`: `config.mesh.actor_devices` (every setting)."""
  if setting not in SETTINGS:
    raise ValueError(f'setting={setting!r} is not one of {SETTINGS}')
  c = config_lib.defaults()
  c.workdir = workdir
  c.model.name = 'tiny'
  c.task.name = 'latency'
  c.task.max_turns = 10
  c.task.eval_size = 4
  c.task.kwargs.stop_chars = LETTERS
  c.task.kwargs.mean_tool_calls = 4.0
  c.task.kwargs.latency_median_s = 0.15
  if quick:  # Milliseconds of tool time: the test checks the plumbing, not the figures.
    c.task.kwargs.latency_median_s = 0.002
    c.task.kwargs.latency_min_s = 0.001
    c.task.kwargs.latency_max_s = 0.005
    c.task.kwargs.mean_tool_calls = 1.0
  # Quick: turns cut at 16 tokens in a 128-token sequence: a shorter decode cache has fewer attention windows, so
  # the actors compile fewer slot programs (3 decode windows, not 7).
  c.sampler.max_new_tokens = 16 if quick else 64
  c.sampler.max_seq_len = 128 if quick else 384
  c.sampler.prompt_buckets = (64,)
  c.sampler.batch_size = call_rows
  c.sampler.num_threads = threads
  mode, algo = NAMES[setting].split('/')
  c.trainer.mode = mode
  c.trainer.batch_size = batch
  c.trainer.seq_buckets = (c.sampler.max_seq_len,)
  c.trainer.queue_size = threads * call_rows + batch  # Every thread can have a call in flight.
  c.sampler.continuous = False
  if continuous and mode == 'async':
    if slots < call_rows and algo == 'grpo':
      raise ValueError(f'slots={slots} < G={call_rows}: a GRPO group must fit in the slots.')
    c.sampler.continuous = True
    c.sampler.batch_size = slots
    c.sampler.decode_steps = decode_steps
    c.sampler.compile_ahead = not quick  # No compile stalls the slots during the measured steps.
    c.trainer.queue_size = threads * slots + batch  # Every slot of every thread can have an episode in flight.
  c.mesh.actor_devices = actor_devices
  c.trainer.num_steps = steps
  c.trainer.checkpoint_every = 0
  c.trainer.eval_every = 0
  c.trainer.tensorboard = False
  c.trainer.log_every = 1000
  if algo == 'grpo':
    c.algo.name = 'grpo'
    c.algo.group_size = call_rows
  else:
    c.algo.critic_warmup_steps = 0  # One learner program from the first step.
  return c


def summarize(rows: list[dict], summary: dict, *, batch: int, skip: int) -> dict:
  """The figures of one run from its metrics rows (the first `skip` steps left out)."""
  rows = [r for r in rows if r.get('perf/step_time_s') is not None]
  if len(rows) <= skip:
    raise ValueError(f'{len(rows)} steps ran; need more than --skip={skip}.')
  m = rows[skip:]
  dt = np.array([r['perf/step_time_s'] for r in m])
  wait = np.array([r['learner/wait_fraction'] for r in m]) * dt
  return {
      'steps': len(m), 'warmup_s': float(sum(r['perf/step_time_s'] for r in rows[:skip])),
      'trajectories_per_s': batch * len(m) / float(dt.sum()),
      'learner_idle_fraction': float(wait.sum() / dt.sum()),
      'step_time_s': float(dt.mean()),
      'learner_busy_s': [float(r['learner/busy_s']) for r in m],
      'staleness_mean': float(np.mean([r['staleness/mean'] for r in m])),
      'staleness_max': float(np.max([r['staleness/max'] for r in m])),
      'dropped_stale': int(rows[-1]['dropped/stale'] - (rows[skip - 1]['dropped/stale'] if skip else 0)),
      'generate_s': float(np.mean([r['episode/generate_s'] for r in m])),
      # Per-step median: robust to the first measured batches, generated while the actor threads compiled.
      'generate_s_median': float(np.median([r['episode/generate_s'] for r in m])),
      'env_s': float(np.mean([r['episode/env_s'] for r in m])),
      'reward_mean': float(np.mean([r['reward_mean'] for r in m])),
      'wall_s': float(summary['wall_s']),
  }


def run_setting(setting: str, *, skip: int, **kw) -> dict:
  """Runs the trainer on one setting (`bench_config(setting, **kw)`) in a fresh workdir; returns `summarize`'s
  figures."""
  workdir = tempfile.mkdtemp(prefix=f'loop_{setting}_')
  config = bench_config(setting, workdir=workdir, **kw)
  summary = trainer.run(config)
  return summarize(metrics_lib.read_metrics(workdir), summary, batch=int(config.trainer.batch_size), skip=skip)


class _TimedBackend:
  """A backend that records each generation call: wall time and the generated lengths of its running rows."""

  def __init__(self, inner):
    self.inner = inner
    self.stop_ids = inner.stop_ids
    self.calls: list[tuple[float, list[int]]] = []

  def _timed(self, fn, *args, **kwargs):
    t0 = time.perf_counter()
    gens, handle = fn(*args, **kwargs)
    self.calls.append((time.perf_counter() - t0, [len(g.ids) for g in gens if g is not None]))
    return gens, handle

  def first_turn(self, *args, **kwargs):
    return self._timed(self.inner.first_turn, *args, **kwargs)

  def next_turn(self, *args, **kwargs):
    return self._timed(self.inner.next_turn, *args, **kwargs)


def probe(config, calls: int, plans: int = 1000) -> dict:
  """Times `calls` sampler calls of the benchmark's workload outside the trainer (tool calls do not sleep here:
  their latencies are the task's plans, read from `plans` fresh envs), after one warm-up call.

  Returns the lock-step call primitives of `sao_jax.sim.calibrate` (`lockstep`): per-turn generated lengths,
  turns per episode, tool latencies, and `tokens_per_s` / `turn_overhead_s` from a least-squares fit of a
  generation call's time = turn_overhead_s + (longest row's tokens) / tokens_per_s; plus the mean generation
  seconds per trajectory (`generate_s`) and the call's host time outside generation and tools.
  """
  task = registry.get_task(config.task)
  task.sleep = lambda seconds: None
  tokenizer = get_tokenizer(config)
  policy, _ = models.build(config.model, seed=int(config.seed))
  rows = int(config.sampler.batch_size)
  backend = _TimedBackend(rollout.make_backend(policy, tokenizer, task, GenerateConfig.from_config(config),
                                              batch_size=rows, version=0))
  limits = rollout.EpisodeLimits.from_config(config)
  decoding = SamplingParams.from_config(config.sampler)
  examples = task.train_iterator(int(config.seed) + 1)
  gen_s, call_host_s, timed = [], [], []
  for call in range(calls + 1):
    backend.calls.clear()
    envs = [task.make_env(next(examples)) for _ in range(rows)]
    t0 = time.perf_counter()
    trajs = rollout.run_episodes(backend, tokenizer, envs, limits=limits, decoding=decoding,
                                 seeds=[rollout.episode_seed(7, call, j) for j in range(rows)])
    wall = time.perf_counter() - t0
    if call == 0:
      continue  # Compiles.
    gen_s += [t.generate_seconds for t in trajs]
    call_host_s.append(wall - sum(s for s, _ in backend.calls))
    timed += list(backend.calls)
  seconds = np.array([s for s, _ in timed])
  longest = np.array([max(lens) for _, lens in timed], float)
  slope, intercept = np.polyfit(longest, seconds, 1)
  if slope <= 0:  # The per-token term is lost in the noise (a busy machine, a tiny model): time per call only.
    slope, intercept = 0.0, float(seconds.mean())
  lengths = [n for _, lens in timed for n in lens]
  envs = [task.make_env(ex) for ex in task.eval_set()[:1] * plans]
  plan = [(env.reset(), env.plan)[1] for env in envs]
  return {
      'rows': rows,
      'gen_tokens': lengths,
      'turns': [len(p) + 1 for p in plan],
      'tool_latency_s': [x for p in plan for x in p],
      'tokens_per_s': float(1.0 / slope) if slope > 0 else 1e12,
      'turn_overhead_s': float(max(intercept, 0.0)),
      'call_overhead_s': float(np.median(call_host_s)),
      'generate_s': float(np.mean(gen_s)),
      'gen_calls': len(timed),
  }


def _load() -> str:
  try:
    return ' '.join(f'{x:.2f}' for x in os.getloadavg())
  except OSError:
    return '?'


def table(results: dict[str, list[dict]]) -> str:
  lines = ['| setting | run | trajectories/s | learner idle | step s | staleness mean / max | dropped stale | '
           'gen s / traj | env s / traj | warm-up s |', '|---|---|---:|---:|---:|---|---:|---:|---:|---:|']
  for s, runs in results.items():
    for i, r in enumerate(runs):
      lines.append(f"| {s} | {i + 1} | {r['trajectories_per_s']:.2f} | {r['learner_idle_fraction']:.1%} | "
                   f"{r['step_time_s']:.2f} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | "
                   f"{r['dropped_stale']} | {r['generate_s']:.2f} | {r['env_s']:.2f} | {r['warmup_s']:.1f} |")
  return '\n'.join(lines)


def run_benchmark(*, quick: bool = False, settings=SETTINGS, rounds: int = 2, threads: int = 1, batch: int = 16,
                  call_rows: int = 8, steps: int = 12, skip: int = 3, probe_calls: int = 5,
                  json_path: str = '', continuous: bool = True, slots: int = 32,
                  decode_steps: int = 16, actor_devices: int = 0) -> dict[str, list[dict]]:
  """Runs the settings interleaved `rounds` times, prints the table; returns {setting: [figures per run]}.
  `quick`: 2 threads, batch 8 (divisible by the tests' 8 simulated devices) of calls of 4 (continuous: 4 slots),
  3 steps (1 skipped), one round, ms tool times, no probe."""
  if quick:
    threads, batch, call_rows, steps, skip, rounds, probe_calls, slots = 2, 8, 4, 3, 1, 1, 0, 4
  kw = dict(quick=quick, threads=threads, batch=batch, call_rows=call_rows, steps=steps, continuous=continuous,
            slots=slots, decode_steps=decode_steps, actor_devices=actor_devices)
  unknown = set(settings) - set(SETTINGS)
  if unknown:
    raise ValueError(f'settings: {sorted(unknown)} not in {SETTINGS}')
  print(f'load before: {_load()}  ({os.cpu_count()} CPUs)  settings {list(settings)} x {rounds} rounds, {kw}, '
        f'skip {skip}')
  prb = None
  if probe_calls:
    t0 = time.perf_counter()
    prb = probe(bench_config('sync', **kw), probe_calls)
    decode = (f"{prb['tokens_per_s']:.0f} steps/s" if prb['tokens_per_s'] < 1e12 else
              'no per-step cost resolved (call times do not grow with the longest row)')
    print(f"probe ({time.perf_counter() - t0:.0f} s): {prb['gen_calls']} generation calls, decode {decode} of "
          f"{prb['rows']} rows + {prb['turn_overhead_s'] * 1e3:.0f} ms per call; "
          f"{np.mean(prb['gen_tokens']):.1f} tokens per turn (max {max(prb['gen_tokens'])}), "
          f"{np.mean(prb['turns']):.2f} turns per episode, tool {np.mean(prb['tool_latency_s']) * 1e3:.0f} ms mean; "
          f"gen {prb['generate_s']:.2f} s per trajectory; host {prb['call_overhead_s'] * 1e3:.0f} ms per call")
  results: dict[str, list[dict]] = {s: [] for s in settings}
  for rnd in range(rounds):
    for s in settings:
      r = run_setting(s, skip=skip, **kw)
      r['load'] = _load()
      results[s].append(r)
      print(f"round {rnd + 1} {s}: {r['trajectories_per_s']:.2f} trajectories/s, idle "
            f"{r['learner_idle_fraction']:.1%}, staleness {r['staleness_mean']:.2f} (load {r['load']})", flush=True)
  print(table(results))
  if 'sync' in results:
    for s in [x for x in settings if NAMES[x].startswith('async')]:
      ratios = [a['trajectories_per_s'] / b['trajectories_per_s'] for a, b in zip(results[s], results['sync'])]
      idle = [a['learner_idle_fraction'] for a in results[s]]
      print(f"{s} / sync trajectories/s per round: {', '.join(f'{x:.2f}x' for x in ratios)}; {s} learner idle: "
            f"{', '.join(f'{x:.1%}' for x in idle)}  (goal: >= 2.5x, idle < 15%)")
  print(f'load after: {_load()}')
  if json_path:
    write_measurements(json_path, results, prb, threads=threads, batch=batch, call_rows=call_rows,
                       continuous={'slots': slots, 'decode_steps': decode_steps} if continuous else None)
    print(f'measurements: {json_path}')
  return results


def main(argv):
  del argv
  if _CPU_DEVICES.value:
    jax.config.update('jax_num_cpu_devices', _CPU_DEVICES.value)  # Before the first use of the backend.
  if _CACHE.value:
    jax.config.update('jax_compilation_cache_dir', _CACHE.value)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  run_benchmark(quick=_QUICK.value, settings=tuple(_SETTINGS.value), rounds=_ROUNDS.value, threads=_THREADS.value,
                batch=_BATCH.value, call_rows=_CALL.value, steps=_STEPS.value, skip=_SKIP.value,
                probe_calls=_PROBE.value, json_path=_JSON.value, continuous=_CONTINUOUS.value, slots=_SLOTS.value,
                decode_steps=_DECODE_STEPS.value, actor_devices=_ACTOR_DEVICES.value)


def write_measurements(path: str, results: dict[str, list[dict]], prb: dict | None, *, threads: int, batch: int,
                       call_rows: int, continuous: dict | None = None) -> None:
  """The measurements file of `sao_jax.sim.calibrate` (its docstring has the format). `continuous`: the async
  settings' actors ran continuous batching ({'slots': ..., 'decode_steps': ...}), recorded as the file's
  `continuous` entry (the simulator's lock-step model describes static calls only)."""
  if prb is None:
    raise ValueError('--json needs the probe (--probe_calls > 0).')
  rows = call_rows

  def mean(s, key):
    return float(np.mean([r[key] for r in results[s]]))

  settings, measured = {}, {}
  for s, runs in results.items():
    busy = [x for r in runs for x in r['learner_busy_s']]
    settings[NAMES[s]] = {
        'num_slots': 1 if NAMES[s].startswith('sync') else threads,
        'step_time_s': {'samples': busy, 'kind': 'lognormal'},
        # Generation under this setting's CPU load: the loop's generation seconds per trajectory over the probe's.
        'lockstep': {'slowdown': mean(s, 'generate_s_median') / prb['generate_s']},
    }
    measured[NAMES[s]] = {'trajectories_per_s': mean(s, 'trajectories_per_s'),
                          'learner_idle_fraction': mean(s, 'learner_idle_fraction')}
  out = {
      'note': 'Measured by `python -m sao_jax.benchmarks.loop` on this machine (see the sim README).',
      'load': [r['load'] for runs in results.values() for r in runs],
      # The loop's queue bounds queued + in-flight trajectories at threads * rows + batch (bench_config); the
      # simulator's bounds the queued ones: batch // rows calls queued + one call in flight per thread.
      'config': {'batch_size': batch // rows, 'max_staleness': 4, 'queue_capacity': batch // rows,
                 'duration_s': 3600.0, 'warmup_s': 60.0},
      'lockstep': {k: prb[k] for k in ('rows', 'gen_tokens', 'turns', 'tool_latency_s', 'tokens_per_s',
                                         'turn_overhead_s', 'call_overhead_s')},
      'group_size': 1,
      'continuous': continuous,
      'settings': settings,
      'measured': measured,
  }
  with open(path, 'w') as f:
    json.dump(out, f)


if __name__ == '__main__':
  app.run(main)
