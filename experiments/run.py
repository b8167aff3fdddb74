r"""Runs an experiment of `experiments/specs.py` (every arm x seed not yet done) and writes its report.

  python -m experiments.run --experiment=algos_arith [--arms=sao,grpo] [--seeds=0,1,2] [--quick]
      [--runs=/tmp/sao_experiments] [--results=experiments/results] [--report_only] [--norestore]

Each run is the trainer's own command line (`python -m sao_jax.main ...`, printed) in a child process, with the
workdir `RUNS/<experiment>/<arm>/seed<k>`: the same command resumes a killed run, and a finished one (`done.json`)
is not run again. Runs go one after another (their wall times compare), share `RUNS/compile_cache`, and start
after every arm of the experiment validates. First, the finished runs of the committed report
(RESULTS/<experiment>/curves.csv) that RUNS lacks are restored from it (`report.restore`; `--norestore`: RUNS
alone), so new seeds add to the report; after every run the report is rewritten (`experiments.report`).

`--quick` validates every arm of every experiment, then runs the first two arms for one seed with `specs.QUICK`
(a tiny model, 2 steps) into a scratch directory: the test suite runs it (its numbers mean nothing).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from absl import app
from absl import flags

from experiments import runner
from experiments import specs

_EXPERIMENT = flags.DEFINE_string('experiment', None, f'One of {sorted(specs.EXPERIMENTS)}.')
_ARMS = flags.DEFINE_list('arms', [], 'Arms to run (default: all).')
_SEEDS = flags.DEFINE_list('seeds', [], "Seeds to run (default: the experiment's).")
_QUICK = flags.DEFINE_bool('quick', False, 'Two arms, one seed, a tiny model, 2 steps (the suite runs this).')
_RUNS = flags.DEFINE_string('runs', '/tmp/sao_experiments', 'Workdirs of the runs (checkpoints, metrics).')
_RESULTS = flags.DEFINE_string('results', os.path.join(runner.ROOT, 'experiments', 'results'),
                               'Report directory (curves.csv, summary.md, PNGs per experiment).')
_REPORT_ONLY = flags.DEFINE_bool('report_only', False, 'Only rewrite the report from the runs present.')
_RESTORE = flags.DEFINE_bool('restore', True, "First rebuild the committed report's finished runs missing from "
                             '--runs (so they stay in the report and are not rerun).')
_TIMEOUT = flags.DEFINE_float('timeout_s', 0.0, 'Stop a run after this many seconds (0 = no limit) and go '
                               'on with the next: the next call resumes it from its last checkpoint.')


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if _EXPERIMENT.value not in specs.EXPERIMENTS:
    raise app.UsageError(f'--experiment={_EXPERIMENT.value!r}: one of {sorted(specs.EXPERIMENTS)}')
  # Quick (the suite): every arm of every experiment must validate; a real run checks its own experiment.
  names = sorted(specs.EXPERIMENTS) if _QUICK.value else [_EXPERIMENT.value]
  runner.split_cpu(max(specs.EXPERIMENTS[n].cpu_devices for n in names))  # Their meshes need the devices.
  runner.validate(names, quick=_QUICK.value)
  runs, results = _RUNS.value, _RESULTS.value
  if _QUICK.value:  # Never mixes with real runs or results.
    runs, results = os.path.join(runs, 'quick'), os.path.join(runs, 'quick', 'results')
  out = runner.run_experiment(_EXPERIMENT.value, arms=_ARMS.value, seeds=[int(s) for s in _SEEDS.value],
                              quick=_QUICK.value, runs=runs, results=results, report_only=_REPORT_ONLY.value,
                              timeout_s=_TIMEOUT.value, restore=_RESTORE.value)
  with open(os.path.join(out, 'summary.md'), encoding='utf-8') as f:
    print(f.read())


if __name__ == '__main__':
  app.run(main)
