"""Predicted vs measured: `python -m sao_jax.sim.calibrate --measurements=m.json [--table=table.md]`.

Takes what the loop benchmark measures on a machine (generation speed per slot, tool latencies, step time —
numbers, distributions, or raw samples that `Dist.fit` turns into a distribution) and the figures it measured
(trained trajectories/s, learner idle fraction), simulates the same loop in the four settings sync/async x
SAO/GRPO, and prints the side-by-side table. A rate is `within` when |predicted - measured| <= TOLERANCE *
|measured|. A fraction f (FRACTIONS: the learner idle fraction) is one measurement with two faces, f and 1 - f
(the learner's busy fraction), and the relative error of the larger one says little: a fraction is `within` when
both are, |p - m| <= TOLERANCE * min(m, 1 - m), and the table gives both errors.

The learner idle fraction is the trainer's `learner/wait_fraction` (time-weighted over the measured steps): the
share of the time between update dispatches in which no update ran. The simulator's is 1 - its learner
utilisation (steps' durations over time), so the step time it is given must be the update's time, dispatch to
done: the trainer's `learner/busy_s` (= step time x (1 - wait fraction)), whether or not the host waited on the
queue while the update ran (async prefetch) — not the step time less the queue wait.

The JSON file:

  {
    "config": {...},          # SimConfig fields of the measured loop (SimConfig.from_dict); its group_size is
                              # ignored: SAO runs with 1, GRPO with "group_size"
    "group_size": 4,          # G of the GRPO settings (batch_size must be a multiple)
    "duration_s": 3600,       # optional: simulated time (default: the config's), and warm-up left out
    "warmup_s": 300,
    "measured": {             # any subset of SETTINGS x METRICS; missing ones are predicted only
      "sync/sao":   {"trajectories_per_s": ..., "learner_idle_fraction": ...},
      "async/sao":  {...}, "sync/grpo": {...}, "async/grpo": {...}
    }
  }

e.g. "config": {"num_slots": 8, "batch_size": 8, "tokens_per_s": 41.0, "gen_tokens": {"samples": [...],
"kind": "lognormal"}, "tool_latency_s": {"kind": "lognormal", "mean": 0.8, "sigma": 0.6}, "step_time_s": 2.4}.

Optional, for a loop whose actors play lock-stepped batched calls (`sao_jax.rollout.run_episodes`: a call of R
rows generates turn k of all its running rows in one batched decode that runs until the longest row stops, then
steps their envs concurrently, and releases its R trajectories together when its last row ends):

    "lockstep": {"rows": R, "gen_tokens": [...], "turns": [...], "tool_latency_s": [...],   # measured samples
                 "tokens_per_s": ..., "turn_overhead_s": ..., "call_overhead_s": ...},
    "settings": {"async/sao": {"num_slots": 6, "step_time_s": {...}, "lockstep": {"slowdown": 1.4}}, ...}

A simulator slot is then one actor thread and its episode one call (`lockstep_call_durations`, with the
setting's `slowdown` of generation: CPU shared with the other actor threads and the learner); `batch_size` counts
calls per learner step, and the predicted trajectories/s is the simulator's calls/s x R. "settings" overrides
`config` fields per setting (e.g. one slot in sync mode, where the loop itself plays the batch's calls in turn,
and each setting's measured learner step times).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from absl import app
from absl import flags
import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.sim import simulator
from sao_jax.sim.dists import Dist
from sao_jax.sim.simulator import SimConfig

SETTINGS = ('sync/sao', 'async/sao', 'sync/grpo', 'async/grpo')
METRICS = ('trajectories_per_s', 'learner_idle_fraction')
FRACTIONS = ('learner_idle_fraction',)  # Metrics in [0, 1]: compared on both faces (module docstring).
TOLERANCE = 0.2

_MEASUREMENTS = flags.DEFINE_string('measurements', None, 'JSON file of the measured loop (see module docstring).')
_TABLE = flags.DEFINE_string('table', None, 'Also write the markdown table to this file.')


def setting_config(base: SimConfig, setting: str, group_size: int) -> SimConfig:
  """`base` in one of SETTINGS ('<mode>/<sao|grpo>')."""
  mode, algo = setting.split('/')
  if algo not in ('sao', 'grpo'):
    raise ConfigError(f'calibrate: setting {setting!r} must be one of {SETTINGS}')
  return dataclasses.replace(base, mode=mode, group_size=1 if algo == 'sao' else group_size).validate()


def lockstep_call_durations(lockstep: dict[str, Any], n: int, *, slowdown: float = 1.0,
                            seed: int = 0) -> np.ndarray:
  """Wall times (s) of `n` batched calls of `rows` lock-stepped episodes (see the module docstring):

    T = call_overhead_s + sum_{k=1..K} [ slowdown * (turn_overhead_s + max_{i: n_i >= k} g_ik / tokens_per_s)
                                         + max_{i: n_i > k} L_ik ],   K = max_i n_i,

  row i of a call having n_i turns (resampled from `turns`), turn k generating g_ik tokens (from `gen_tokens`)
  and, but on its last turn, calling a tool for L_ik seconds (from `tool_latency_s`): a turn's decode runs until
  its longest running row stops, and its env steps run concurrently (it waits for the slowest tool call).
  """
  rng = np.random.default_rng(seed)
  rows = int(lockstep['rows'])
  turns = rng.choice(np.asarray(lockstep['turns'], np.int64), size=(n, rows))
  k_max = int(turns.max())
  gen = rng.choice(np.asarray(lockstep['gen_tokens'], float), size=(n, rows, k_max))
  tool = rng.choice(np.asarray(lockstep['tool_latency_s'], float), size=(n, rows, k_max))
  k = np.arange(k_max)
  active = k[None, None, :] < turns[:, :, None]  # Row i generates turn k.
  calls_tool = k[None, None, :] < turns[:, :, None] - 1  # ... and calls a tool after it.
  decode = np.max(np.where(active, gen, 0.0), axis=1) / float(lockstep['tokens_per_s'])
  turn_exists = active.any(axis=1)
  generate = np.sum(np.where(turn_exists, float(lockstep['turn_overhead_s']) + decode, 0.0), axis=1)
  wait = np.sum(np.max(np.where(calls_tool, tool, 0.0), axis=1), axis=1)
  return float(lockstep.get('call_overhead_s', 0.0)) + slowdown * generate + wait


def _lockstep_config(cfg: SimConfig, lockstep: dict[str, Any], slowdown: float, n: int = 4096) -> SimConfig:
  """`cfg` whose slots are actor threads and whose episodes are batched calls (durations as samples)."""
  durations = lockstep_call_durations(lockstep, n, slowdown=slowdown, seed=cfg.seed)
  return dataclasses.replace(cfg, tokens_per_s=1.0, gen_tokens=Dist('cycle', values=tuple(durations.tolist())),
                             turns=Dist('constant', 1.0), obs_tokens=Dist('constant', 0.0),
                             tool_latency_s=Dist('constant', 0.0), prompt_tokens=0.0)


def predict(base: SimConfig, group_size: int, *, settings: dict[str, dict[str, Any]] | None = None,
            lockstep: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
  """{setting: {metric: predicted}} for every setting (`settings`/`lockstep`: see the module docstring)."""
  out = {}
  for setting in SETTINGS:
    over = dict((settings or {}).get(setting, {}))
    step = dict(over.pop('lockstep', {}))
    cfg = _override(base, over)
    per_episode = 1
    if lockstep is not None:
      cfg = _lockstep_config(cfg, lockstep, float(step.get('slowdown', 1.0)))
      per_episode = int(lockstep['rows'])
    r = simulator.simulate(setting_config(cfg, setting, group_size))
    out[setting] = {'trajectories_per_s': r.trained_per_s * per_episode,
                    'learner_idle_fraction': 1.0 - r.learner_utilisation,
                    'staleness_mean': float(r.staleness.mean()) if r.staleness.size else math.nan}
  return out


def _override(base: SimConfig, over: dict[str, Any]) -> SimConfig:
  """`base` with the SimConfig fields of `over` (read as `SimConfig.from_dict` reads them)."""
  if not over:
    return base
  parsed = SimConfig.from_dict(over)
  return dataclasses.replace(base, **{k: getattr(parsed, k) for k in over})


def _rel_error(p: float, m: float) -> float:
  """(p - m) / |m|; 0 or inf at m = 0."""
  if m == 0:
    return 0.0 if p == 0 else math.inf
  return (p - m) / abs(m)


def compare(measurements: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per (setting, metric): predicted, measured (None if not given), rel_error, within; for FRACTIONS
  also complement_rel_error, the relative error of 1 - the fraction (None otherwise)."""
  base = SimConfig.from_dict(measurements['config'])
  over = {k: float(measurements[k]) for k in ('duration_s', 'warmup_s') if k in measurements}
  base = dataclasses.replace(base, **over)
  measured = measurements.get('measured', {})
  unknown = set(measured) - set(SETTINGS)
  if unknown:
    raise ConfigError(f'calibrate: measured settings {sorted(unknown)} not in {SETTINGS}')
  unknown = set(measurements.get('settings', {})) - set(SETTINGS)
  if unknown:
    raise ConfigError(f'calibrate: settings {sorted(unknown)} not in {SETTINGS}')
  predicted = predict(base, int(measurements.get('group_size', 4)), settings=measurements.get('settings'),
                      lockstep=measurements.get('lockstep'))
  rows = []
  for setting in SETTINGS:
    for metric in METRICS:
      p = predicted[setting][metric]
      m = measured.get(setting, {}).get(metric)
      fraction = metric in FRACTIONS
      row = {'setting': setting, 'metric': metric, 'predicted': p, 'measured': m, 'rel_error': math.nan,
             'complement_rel_error': math.nan if fraction else None, 'within': None}
      if m is not None:
        row['rel_error'] = _rel_error(p, m)
        scale = abs(m)
        if fraction:
          row['complement_rel_error'] = _rel_error(1.0 - p, 1.0 - m)
          scale = min(abs(m), abs(1.0 - m))
        row['within'] = abs(p - m) <= TOLERANCE * scale
      rows.append(row)
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """Markdown table of `compare`'s rows."""
  lines = ['| setting | metric | predicted | measured | error | error of 1 - fraction | within 20% |',
           '|---|---|---:|---:|---:|---:|---|']
  for r in rows:
    meas = '—' if r['measured'] is None else f"{r['measured']:.4g}"
    err = '—' if r['measured'] is None else f"{100 * r['rel_error']:+.1f}%"
    comp = '' if r['complement_rel_error'] is None else (
        '—' if r['measured'] is None else f"{100 * r['complement_rel_error']:+.1f}%")
    ok = '—' if r['within'] is None else ('yes' if r['within'] else 'no')
    lines.append(f"| {r['setting']} | {r['metric']} | {r['predicted']:.4g} | {meas} | {err} | {comp} | {ok} |")
  return '\n'.join(lines)


def main(argv):
  del argv
  if not _MEASUREMENTS.value:
    raise app.UsageError('--measurements=path.json is required')
  with open(_MEASUREMENTS.value) as f:
    table = format_table(compare(json.load(f)))
  print(table)
  if _TABLE.value:
    with open(_TABLE.value, 'w') as f:
      f.write(table + '\n')


if __name__ == '__main__':
  app.run(main)
