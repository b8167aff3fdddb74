"""Predicted vs measured: `python -m sao_jax.sim.calibrate --measurements=m.json [--table=table.md]`.

Takes what the loop benchmark measures on a machine (generation speed per slot, tool latencies, step time —
numbers, distributions, or raw samples that `Dist.fit` turns into a distribution) and the figures it measured
(trained trajectories/s, learner idle fraction), simulates the same loop in the four settings sync/async x
SAO/GRPO, and prints the side-by-side table. A prediction is `within` when |predicted - measured| <=
TOLERANCE * |measured| (the issue's 20%).

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
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from absl import app
from absl import flags

from sao_jax.errors import ConfigError
from sao_jax.sim import simulator
from sao_jax.sim.simulator import SimConfig

SETTINGS = ('sync/sao', 'async/sao', 'sync/grpo', 'async/grpo')
METRICS = ('trajectories_per_s', 'learner_idle_fraction')
TOLERANCE = 0.2

_MEASUREMENTS = flags.DEFINE_string('measurements', None, 'JSON file of the measured loop (see module docstring).')
_TABLE = flags.DEFINE_string('table', None, 'Also write the markdown table to this file.')


def setting_config(base: SimConfig, setting: str, group_size: int) -> SimConfig:
  """`base` in one of SETTINGS ('<mode>/<sao|grpo>')."""
  mode, algo = setting.split('/')
  if algo not in ('sao', 'grpo'):
    raise ConfigError(f'calibrate: setting {setting!r} must be one of {SETTINGS}')
  return dataclasses.replace(base, mode=mode, group_size=1 if algo == 'sao' else group_size).validate()


def predict(base: SimConfig, group_size: int) -> dict[str, dict[str, float]]:
  """{setting: {metric: predicted}} for every setting."""
  out = {}
  for setting in SETTINGS:
    r = simulator.simulate(setting_config(base, setting, group_size))
    out[setting] = {'trajectories_per_s': r.trained_per_s, 'learner_idle_fraction': 1.0 - r.learner_utilisation}
  return out


def compare(measurements: dict[str, Any]) -> list[dict[str, Any]]:
  """One row per (setting, metric): predicted, measured (None if not given), rel_error, within."""
  base = SimConfig.from_dict(measurements['config'])
  over = {k: float(measurements[k]) for k in ('duration_s', 'warmup_s') if k in measurements}
  base = dataclasses.replace(base, **over)
  measured = measurements.get('measured', {})
  unknown = set(measured) - set(SETTINGS)
  if unknown:
    raise ConfigError(f'calibrate: measured settings {sorted(unknown)} not in {SETTINGS}')
  predicted = predict(base, int(measurements.get('group_size', 4)))
  rows = []
  for setting in SETTINGS:
    for metric in METRICS:
      p = predicted[setting][metric]
      m = measured.get(setting, {}).get(metric)
      if m is None:
        rel = math.nan
      elif m == 0:
        rel = 0.0 if p == 0 else math.inf
      else:
        rel = (p - m) / abs(m)
      rows.append({'setting': setting, 'metric': metric, 'predicted': p, 'measured': m, 'rel_error': rel,
                   'within': None if m is None else abs(p - m) <= TOLERANCE * abs(m)})
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """Markdown table of `compare`'s rows."""
  lines = ['| setting | metric | predicted | measured | error | within 20% |', '|---|---|---:|---:|---:|---|']
  for r in rows:
    meas = '—' if r['measured'] is None else f"{r['measured']:.4g}"
    err = '—' if r['measured'] is None else f"{100 * r['rel_error']:+.1f}%"
    ok = '—' if r['within'] is None else ('yes' if r['within'] else 'no')
    lines.append(f"| {r['setting']} | {r['metric']} | {r['predicted']:.4g} | {meas} | {err} | {ok} |")
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
