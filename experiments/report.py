"""An experiment's report from its runs' metrics: curves.csv, summary.md and a PNG (matplotlib).

    report.write(experiment, runs_dir, out_dir)   # runs_dir = RUNS/<experiment>, holding <arm>/seed<k>/

* `curves.csv`: one line per (arm, seed, metrics row): step, trajectories, wall_s (`time/wall_s`: the run's
  seconds, summed over resumes), eval_accuracy (empty where no eval ran), reward_mean and the experiment's panels.
* `summary.md`: per arm, over its finished seeds: accuracy at step 0 and at the end (mean, sample std, min-max),
  the best eval, steps, trajectories and wall time; for drift runs, steps to recover after each shift and a
  table per phase (accuracy at the shift, at the phase's end, the phase's mean).
* `<experiment>.png`: held-out accuracy against trajectories and against wall time (a thin line per seed, the
  seeds' mean thick), and each panel metric against the learner step.

Only finished runs (`done.json`) enter the summary; every run present enters the curves (marked `done`).

    report.restore(experiment, curves_csv, runs_dir)   # the finished runs of a committed report, back as runs

rebuilds the finished runs of a report's `curves.csv` that `runs_dir` lacks (a `metrics.jsonl` of the curve's
columns and a `done.json` each), so that new seeds or arms run on a fresh machine add to the committed report
instead of replacing it: the report written from the restored runs alone equals the one they came from.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from experiments import specs
from sao_jax import metrics as metrics_lib

DONE_FILE = 'done.json'  # In a run's workdir once it finished (`runner.run_one`, or `restore`).
BASE_COLUMNS = ('arm', 'seed', 'done', 'step', 'trajectories', 'wall_s', 'eval_accuracy', 'reward_mean')


def load_runs(exp: specs.Experiment, runs_dir: str) -> list[dict[str, Any]]:
  """[{'arm', 'seed', 'done', 'rows'}] of the runs present, in the experiment's arm order, then by seed."""
  runs = []
  for arm in exp.arms:
    arm_dir = os.path.join(runs_dir, arm.name)
    if not os.path.isdir(arm_dir):
      continue
    for name in sorted(os.listdir(arm_dir)):
      if not name.startswith('seed') or not name[4:].isdigit():
        continue
      workdir = os.path.join(arm_dir, name)
      rows = metrics_lib.read_metrics(workdir)
      if rows:
        runs.append({'arm': arm.name, 'seed': int(name[4:]), 'rows': rows,
                     'done': os.path.exists(os.path.join(workdir, DONE_FILE))})
  return runs


def _csv_value(text: str) -> int | float:
  return int(text) if text.lstrip('-').isdigit() else float(text)


def restore(exp: specs.Experiment, curves_csv: str, runs_dir: str) -> list[tuple[str, int]]:
  """Writes `runs_dir/<arm>/seed<k>/{metrics.jsonl,done.json}` for each finished run of `curves_csv` (a report
  of `exp`) whose workdir has no metrics yet; returns the (arm, seed) restored. Unfinished runs are not restored
  (they have no checkpoint to resume from: running them again starts them over), nor are arms `exp` lacks."""
  columns = {'wall_s': 'time/wall_s'}  # The report's short names of the metrics' keys.
  arms = {a.name for a in exp.arms}
  found: dict[tuple[str, int], list[dict[str, Any]]] = {}
  with open(curves_csv, newline='', encoding='utf-8') as f:
    for line in csv.DictReader(f):
      if line['done'] != '1' or line['arm'] not in arms:
        continue
      row = {columns.get(k, k): _csv_value(v) for k, v in line.items()
             if k not in ('arm', 'seed', 'done') and v not in ('', None)}
      found.setdefault((line['arm'], int(line['seed'])), []).append(row)
  restored = []
  for (arm, seed), rows in found.items():
    workdir = os.path.join(runs_dir, arm, f'seed{seed}')
    if os.path.exists(os.path.join(workdir, DONE_FILE)) or metrics_lib.read_metrics(workdir):
      continue  # A run present (finished or resumable) is never overwritten.
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, metrics_lib.METRICS_FILE), 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(r) + '\n' for r in rows)
    with open(os.path.join(workdir, DONE_FILE), 'w', encoding='utf-8') as f:
      json.dump({'experiment': exp.name, 'arm': arm, 'seed': seed, 'restored_from': curves_csv}, f, indent=1)
    restored.append((arm, seed))
  return restored


def curve_rows(exp: specs.Experiment, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  out = []
  for run in runs:
    for r in run['rows']:
      line = {'arm': run['arm'], 'seed': run['seed'], 'done': int(run['done']), 'step': r['step'],
              'trajectories': r.get('trajectories'), 'wall_s': r.get('time/wall_s'),
              'eval_accuracy': r.get('eval_accuracy'), 'reward_mean': r.get('reward_mean')}
      line.update({k: r.get(k) for k in exp.panels})
      out.append(line)
  return out


def _evals(rows: Sequence[dict[str, Any]]) -> list[tuple[int, float]]:
  return [(r['step'], float(r['eval_accuracy'])) for r in rows if r.get('eval_accuracy') is not None]


def recovery_steps(rows: Sequence[dict[str, Any]], key: str = 'drift/phase') -> list[int | None]:
  """Per shift of `key` (a change between consecutive rows): learner steps from the shift until held-out
  accuracy is back at its level at the last eval before the shift (None: not within the run)."""
  evals = dict(_evals(rows))
  out = []
  for prev, row in zip(rows, rows[1:]):
    if prev.get(key) is None or row.get(key) is None or prev[key] == row[key]:
      continue
    before = [a for s, a in evals.items() if s <= prev['step']]
    if not before:
      continue
    level = before[-1]
    back = [s for s, a in sorted(evals.items()) if s >= row['step'] and a >= level]
    out.append(back[0] - prev['step'] if back else None)
  return out


def phase_segments(rows: Sequence[dict[str, Any]], key: str = 'drift/phase') -> list[dict[str, Any]]:
  """The run cut into its phases (maximal runs of rows with one value of `key`), each with the held-out evals
  inside it: {'phase', 'first_step', 'last_step', 'at_shift' (the first eval: the policy trained on the phase
  before, scored on this phase's held-out set), 'end' (the last eval), 'mean' (of its evals)}; a segment without
  evals has None for the three. Rows before the first that has `key` (step 0: the trainer logs the phase from
  the first learner step on) belong to the first phase. The row of a step ending at a shift already has the new
  phase (the task moves on after the update), so its eval is the new phase's at the shift; at the run's last step
  that makes a one-row segment: the trained policy on the next phase's set."""
  out: list[dict[str, Any]] = []
  lead = []  # Rows before the first with the key (step 0's eval, before any learner step): the first phase's.
  for r in rows:
    if r.get(key) is None:
      if not out:
        lead.append(r)
      continue
    if not out:
      out.append({'phase': r[key], 'first_step': (lead or [r])[0]['step'], 'evals': []})
      for x in lead:
        if x.get('eval_accuracy') is not None:
          out[-1]['evals'].append(float(x['eval_accuracy']))
    elif out[-1]['phase'] != r[key]:
      out.append({'phase': r[key], 'first_step': r['step'], 'evals': []})
    out[-1]['last_step'] = r['step']
    if r.get('eval_accuracy') is not None:
      out[-1]['evals'].append(float(r['eval_accuracy']))
  for seg in out:
    evals = seg.pop('evals')
    seg.update(at_shift=evals[0] if evals else None, end=evals[-1] if evals else None,
               mean=float(np.mean(evals)) if evals else None)
  return out


def _phase_table(exp: specs.Experiment, runs: Sequence[dict[str, Any]]) -> list[str]:
  """Per phase segment and arm: held-out accuracy at the shift -> at the end of the phase, and the phase's mean
  (means over finished seeds)."""
  per_arm = {a.name: [phase_segments(r['rows']) for r in runs if r['arm'] == a.name and r['done']]
             for a in exp.arms}
  per_arm = {a: segs for a, segs in per_arm.items() if segs}
  if not per_arm:
    return []
  n = min(len(s) for segs in per_arm.values() for s in segs)
  lines = ['', 'Per phase (held-out accuracy on the phase\'s own set, mean over seeds): at the shift -> at the end '
           'of the phase (mean over the phase).', '',
           '| phase (steps) | ' + ' | '.join(per_arm) + ' |', '|---|' + '---|' * len(per_arm)]

  def mean(segs, i, k):
    v = [s[i][k] for s in segs if s[i][k] is not None]
    return f'{np.mean(v):.3f}' if v else '—'

  for i in range(n):
    first = next(iter(per_arm.values()))[0][i]
    cells = [f'{mean(segs, i, "at_shift")} -> {mean(segs, i, "end")} ({mean(segs, i, "mean")})'
             for segs in per_arm.values()]
    lines.append(f'| {first["phase"]:g} ({first["first_step"]}-{first["last_step"]}) | ' + ' | '.join(cells) + ' |')
  return lines


def _stats(values: Sequence[float]) -> str:
  if not values:
    return '—'
  v = np.asarray(values, float)
  spread = f' ± {v.std(ddof=1):.3f}' if len(v) > 1 else ''
  return f'{v.mean():.3f}{spread}' + (f' [{v.min():.3f}, {v.max():.3f}]' if len(v) > 1 else '')


def summary_table(exp: specs.Experiment, runs: Sequence[dict[str, Any]]) -> str:
  lines = [f'# {exp.title}', '',
           f'`{exp.config}`, {len(exp.arms)} arms; finished runs only (mean ± sample std [min, max] over seeds).',
           '', '| arm | seeds | accuracy at step 0 | accuracy at the end | best | steps | trajectories | wall s |',
           '|---|---:|---|---|---|---:|---:|---:|']
  drift = 'drift/phase' in exp.panels
  recoveries = {}
  for arm in exp.arms:
    done = [r for r in runs if r['arm'] == arm.name and r['done']]
    if not done:
      lines.append(f'| {arm.name} | 0 | — | — | — | — | — | — |')
      continue
    evals = [_evals(r['rows']) for r in done]
    start = [e[0][1] for e in evals if e and e[0][0] == 0]
    end = [e[-1][1] for e in evals if e]
    best = [max(a for _, a in e) for e in evals if e]
    last = [r['rows'][-1] for r in done]
    walls = [x['time/wall_s'] for x in last if x.get('time/wall_s') is not None]
    steps = int(np.mean([x['step'] for x in last]))
    trajectories = int(np.mean([x.get('trajectories', 0) for x in last]))
    wall = f'{np.mean(walls):.0f}' if walls else '—'
    lines.append(f'| {arm.name} | {len(done)} | {_stats(start)} | {_stats(end)} | {_stats(best)} | {steps} | '
                 f'{trajectories} | {wall} |')
    if drift:
      recoveries[arm.name] = [recovery_steps(r['rows']) for r in done]
  if drift:
    lines += ['', 'Steps to recover the pre-shift held-out accuracy after each shift (per seed; — = not in the run):',
              '']
    for arm, per_seed in recoveries.items():
      text = '; '.join(', '.join('—' if s is None else str(s) for s in seed) or 'no shift' for seed in per_seed)
      lines.append(f'- {arm}: {text}')
    lines += _phase_table(exp, runs)
  return '\n'.join(lines) + '\n'


def plot(exp: specs.Experiment, runs: Sequence[dict[str, Any]], path: str) -> bool:
  """Writes the PNG; False when matplotlib is missing."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  panels = (('trajectories', 'eval_accuracy'), ('time/wall_s', 'eval_accuracy'),
            *(('step', k) for k in exp.panels))
  cols = min(3, len(panels))
  rows_n = math.ceil(len(panels) / cols)
  fig, axes = plt.subplots(rows_n, cols, figsize=(4.8 * cols, 3.4 * rows_n), squeeze=False)
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for ax, (x, y) in zip(axes.flat, panels):
    for i, arm in enumerate(exp.arms):
      mine = [r for r in runs if r['arm'] == arm.name]
      color = colors[i % len(colors)]
      curves = []
      for run in mine:
        pts = [(r[x], r[y]) for r in run['rows'] if r.get(x) is not None and r.get(y) is not None]
        if pts:
          ax.plot(*zip(*pts), color=color, alpha=0.35, linewidth=0.8)
          curves.append(dict(pts))
      if len(curves) > 1 and x != 'time/wall_s':  # Seeds share the x grid of steps / trajectories.
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ax.plot(xs, [np.mean([c[v] for c in curves]) for v in xs], color=color, linewidth=2, label=arm.name)
      elif curves:
        ax.plot([], [], color=color, linewidth=2, label=arm.name)
    ax.set_xlabel({'time/wall_s': 'wall time (s)'}.get(x, x))
    ax.set_ylabel(y)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis('off')
  axes.flat[0].legend(fontsize=8)
  fig.suptitle(exp.title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def write(exp: specs.Experiment, runs_dir: str, out_dir: str) -> dict[str, Any]:
  """Writes curves.csv, summary.md and the PNG of `exp` into `out_dir`; returns what it found."""
  os.makedirs(out_dir, exist_ok=True)
  runs = load_runs(exp, runs_dir)
  lines = curve_rows(exp, runs)
  with open(os.path.join(out_dir, 'curves.csv'), 'w', newline='', encoding='utf-8') as f:
    w = csv.DictWriter(f, fieldnames=[*BASE_COLUMNS, *exp.panels])
    w.writeheader()
    w.writerows(lines)
  with open(os.path.join(out_dir, 'summary.md'), 'w', encoding='utf-8') as f:
    f.write(summary_table(exp, runs))
  plotted = plot(exp, runs, os.path.join(out_dir, f'{exp.name}.png')) if runs else False
  with open(os.path.join(out_dir, 'runs.json'), 'w', encoding='utf-8') as f:
    json.dump([{'arm': r['arm'], 'seed': r['seed'], 'done': r['done'], 'steps': r['rows'][-1]['step']}
               for r in runs], f, indent=1)
  return {'runs': len(runs), 'curve_rows': len(lines), 'plotted': plotted}
