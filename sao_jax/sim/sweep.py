"""Pod-scale sweeps of the design argument: `python -m sao_jax.sim.sweep [--out=sao_jax/sim/results] [--hours=24]`.

On the pod workload of `sao_jax.sim.pod` (1024 slots, B=128, 32K-128K-token heavy-tailed episodes), async
unless said otherwise, it simulates
  1. group size G in GROUPS (G=1 is SAO), unbounded staleness and max_staleness=8;
  2. the tail weight of the generated tokens per turn: log-normal sigma in SIGMAS and Pareto alpha in ALPHAS
     (the mean fixed), SAO vs GRPO G=8;
  3. max_staleness in BOUNDS, SAO vs GRPO G=8;
  4. learner and actor utilisation of SAO vs GRPO G=8 in sync (k=1: B episodes per round; k=8: one round fills
     all 1024 slots, 8 steps on it) and async (unbounded, max_staleness=8);
and writes `tables.md` (markdown), `results.json` (every summary) and small PNG plots (matplotlib, optional)
into --out. Prints the tables and the seconds it took.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from absl import app
from absl import flags
from absl import logging

from sao_jax.sim import pod
from sao_jax.sim import simulator
from sao_jax.sim.dists import Dist

GROUPS = (1, 4, 8, 16)
SIGMAS = (0.25, 0.5, 1.0, 1.5, 2.0)
ALPHAS = (3.0, 2.0, 1.5, 1.2)
BOUNDS = (0, 1, 2, 4, 8, math.inf)
GRPO_G = 8

_OUT = flags.DEFINE_string('out', 'sao_jax/sim/results', 'Directory of tables.md, results.json and the PNGs.')
_HOURS = flags.DEFINE_float('hours', 24.0, 'Simulated hours per run (the first 2 h are warm-up, left out).')
_PLOTS = flags.DEFINE_bool('plots', True, 'Write PNG plots (needs matplotlib).')


def _run(**overrides) -> dict[str, Any]:
  cfg = pod.pod_config(duration_s=_HOURS.value * 3600.0, warmup_s=min(7200.0, _HOURS.value * 3600.0 / 4),
                       **overrides)
  t = time.perf_counter()
  s = simulator.simulate(cfg).summary()
  logging.info('%s: %.1f s', overrides, time.perf_counter() - t)
  return s


def _fmt(v: Any) -> str:
  if isinstance(v, float):
    if math.isnan(v):
      return '—'
    if math.isinf(v):
      return 'inf'
    return f'{v:.3g}' if abs(v) < 100 else f'{v:.0f}'
  return str(v)


_COLUMNS = (('trained/h', 'trained_per_hour'), ('generated/h', 'generated_per_hour'),
            ('dropped', 'dropped_fraction'), ('learner util', 'learner_utilisation'),
            ('actor util', 'actor_utilisation'), ('staleness mean', 'staleness_mean'),
            ('p50', 'staleness_p50'), ('p99', 'staleness_p99'), ('max', 'staleness_p100'),
            ('token staleness', 'token_staleness_mean'), ('group wait mean s', 'group_wait_mean_s'),
            ('group wait p90 s', 'group_wait_p90_s'))


def _table(title: str, keys: Sequence[str], rows: Sequence[tuple[Sequence[Any], dict[str, Any]]]) -> str:
  head = list(keys) + [c for c, _ in _COLUMNS]
  lines = [f'### {title}', '', '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for key, s in rows:
    lines.append('| ' + ' | '.join([_fmt(k) for k in key] + [_fmt(s[f]) for _, f in _COLUMNS]) + ' |')
  return '\n'.join(lines)


def sweeps() -> dict[str, list[tuple[list[Any], dict[str, Any]]]]:
  """{name: [(key values, summary), ...]} of the four sweeps."""
  out: dict[str, list] = {'group': [], 'tail': [], 'bound': [], 'util': []}
  for bound in (math.inf, 8):
    for g in GROUPS:
      out['group'].append(([g, bound], _run(group_size=g, max_staleness=bound)))
  for g in (1, GRPO_G):
    for sigma in SIGMAS:
      out['tail'].append(([g, f'lognormal sigma={sigma}'],
                          _run(group_size=g, gen_tokens=Dist('lognormal', 3000.0, sigma=sigma))))
    for alpha in ALPHAS:
      out['tail'].append(([g, f'pareto alpha={alpha}'],
                          _run(group_size=g, gen_tokens=Dist('pareto', 3000.0, alpha=alpha))))
  for g in (1, GRPO_G):
    for bound in BOUNDS:
      out['bound'].append(([g, bound], _run(group_size=g, max_staleness=bound)))
  for g in (1, GRPO_G):
    for name, kw in (('sync k=1', dict(mode='sync')), ('sync k=8', dict(mode='sync', sync_steps_per_round=8)),
                     ('async', dict()), ('async max_staleness=8', dict(max_staleness=8))):
      out['util'].append(([g, name], _run(group_size=g, **kw)))
  return out


def tables(res) -> str:
  return '\n\n'.join([
      _table('Throughput and staleness vs group size G (async; G=1 is SAO)', ['G', 'max_staleness'], res['group']),
      _table(f'vs the tail weight of generated tokens per turn (async, unbounded; mean 3000 tokens)',
             ['G', 'distribution'], res['tail']),
      _table(f'vs max_staleness (async; SAO and GRPO G={GRPO_G})', ['G', 'max_staleness'], res['bound']),
      _table(f'Utilisation: SAO vs GRPO G={GRPO_G}, sync vs async', ['G', 'schedule'], res['util']),
  ])


def _plot(res, out_dir: str) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top  (optional dependency, only for the plots)
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  paths = []

  def save(fig, name):
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    paths.append(path)

  def panels(rows, xs_of: Callable, series, xlabel, name, xlog=False):
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
    for i, (label, sel) in enumerate(series):
      pts = [(xs_of(k), s) for k, s in rows if sel(k)]
      xs, c = [p[0] for p in pts], f'C{i}'
      axes[0].plot(xs, [p[1]['trained_per_hour'] for p in pts], 'o-', color=c, label=label)
      axes[1].plot(xs, [p[1]['staleness_mean'] for p in pts], 'o-', color=c, label=f'{label} mean')
      axes[1].plot(xs, [p[1]['staleness_p99'] for p in pts], 's--', color=c, label=f'{label} p99')
      axes[2].plot(xs, [p[1]['learner_utilisation'] for p in pts], 'o-', color=c, label=label)
    for ax, ylabel in zip(axes, ('trained trajectories / h', 'staleness (steps)', 'learner utilisation')):
      ax.set_xlabel(xlabel)
      ax.set_ylabel(ylabel)
      ax.grid(alpha=0.3)
      if xlog:
        ax.set_xscale('log', base=2)
      ax.legend(fontsize=7)
    save(fig, name)

  panels(res['group'], lambda k: k[0], [('unbounded', lambda k: k[1] == math.inf),
                                        ('max_staleness=8', lambda k: k[1] == 8)], 'group size G', 'vs_group.png',
         xlog=True)
  sig = [r for r in res['tail'] if 'sigma' in r[0][1]]
  panels(sig, lambda k: float(k[1].split('=')[1]), [('SAO', lambda k: k[0] == 1),
                                                    (f'GRPO G={GRPO_G}', lambda k: k[0] == GRPO_G)],
         'log-normal sigma of generated tokens per turn', 'vs_tail.png')
  bound_x = lambda k: 16 if k[1] == math.inf else k[1]  # inf drawn at 16.
  panels(res['bound'], bound_x, [('SAO', lambda k: k[0] == 1), (f'GRPO G={GRPO_G}', lambda k: k[0] == GRPO_G)],
         'max_staleness (16 = unbounded)', 'vs_bound.png')
  fig, ax = plt.subplots(figsize=(7, 3.2))
  names = [k[1] for k, _ in res['util'] if k[0] == 1]
  for i, (g, label) in enumerate(((1, 'SAO'), (GRPO_G, f'GRPO G={GRPO_G}'))):
    vals = [s['learner_utilisation'] for k, s in res['util'] if k[0] == g]
    ax.bar([j + 0.4 * i for j in range(len(names))], vals, width=0.4, label=label)
  ax.set_xticks([j + 0.2 for j in range(len(names))], names, fontsize=8)
  ax.set_ylabel('learner utilisation')
  ax.legend()
  save(fig, 'utilisation.png')
  return paths


def main(argv):
  del argv
  t = time.perf_counter()
  res = sweeps()
  os.makedirs(_OUT.value, exist_ok=True)
  text = tables(res)
  with open(os.path.join(_OUT.value, 'tables.md'), 'w') as f:
    f.write(text + '\n')
  with open(os.path.join(_OUT.value, 'results.json'), 'w') as f:
    json.dump({k: [[[_fmt(x) for x in key], s] for key, s in v] for k, v in res.items()}, f, indent=1)
  print(text)
  if _PLOTS.value:
    try:
      print('plots:', ', '.join(_plot(res, _OUT.value)))
    except ImportError:
      print('matplotlib is not installed: tables only')
  print(f'{sum(len(v) for v in res.values())} runs of {_HOURS.value:g} simulated hours in '
        f'{time.perf_counter() - t:.0f} s')


if __name__ == '__main__':
  app.run(main)
