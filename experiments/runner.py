"""The experiments' runner as a library (the command line is `experiments/run.py`): validate arms, run or resume
one arm x seed through `python -m sao_jax.main` in a child process, run what is missing of an experiment and
write its report. See `experiments/run.py` for the behaviour."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from absl import logging
import jax

from experiments import report
from experiments import specs
from sao_jax import config_lib
from sao_jax import metrics as metrics_lib
from sao_jax import parallel
from sao_jax import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_overrides(exp: specs.Experiment, arm: specs.Arm, seed: int, *, quick: bool) -> dict[str, Any]:
  """Every `config.<path>` a run sets: the experiment's, the arm's, the seed, and (quick) the tiny ones."""
  return {**exp.overrides, **arm.overrides, 'seed': seed, **(specs.QUICK if quick else {})}


def command(exp: specs.Experiment, overrides: Mapping[str, Any], workdir: str) -> list[str]:
  return [sys.executable, '-m', 'sao_jax.main', f'--config={exp.config}', f'--workdir={workdir}',
          *config_lib.override_flags(overrides)]


def load_config(exp: specs.Experiment, overrides: Mapping[str, Any]):
  """The run's config, as `sao_jax.main` would build it (the file, its `:arg`, then the overrides)."""
  path, _, arg = exp.config.partition(':')
  module = importlib.import_module(os.path.splitext(path)[0].replace('/', '.'))
  return config_lib.override(module.get_config(arg or None), overrides)


def split_cpu(n: int) -> None:
  """Splits this process's CPU into `n` XLA devices (`Experiment.cpu_devices`; before jax's backend starts), so
  that validating an arm builds its mesh on the devices its run will have. Nothing when `n` is 0 or the CPU is
  already split at least as far (XLA_FLAGS --xla_force_host_platform_device_count, as the test suite does)."""
  forced = re.search(r'--xla_force_host_platform_device_count=(\d+)', os.environ.get('XLA_FLAGS', ''))
  if n > (int(forced.group(1)) if forced else 1):
    jax.config.update('jax_num_cpu_devices', n)


def validate(names: Sequence[str], *, quick: bool = False) -> None:
  """Every arm of the experiments `names` passes `config_lib.validate`, or ValueError names the arm. An
  experiment that splits the CPU (`cpu_devices`) is checked on the first that many devices (`split_cpu`), the
  ones its runs will have (a process split further, like the test suite's 8, has more)."""
  for exp in (specs.EXPERIMENTS[n] for n in names):
    for arm in exp.arms:
      overrides = run_overrides(exp, arm, exp.seeds[0], quick=quick)
      try:
        config = load_config(exp, overrides)
        devices = None
        if exp.cpu_devices and jax.default_backend() == 'cpu':
          devices = jax.devices()[parallel.actor_device_count(config.mesh):exp.cpu_devices]  # The learner's.
        config_lib.validate(config, devices=devices, log=False)
      except Exception as e:
        raise ValueError(f'experiment {exp.name}, arm {arm.name}: {e}') from e


def run_one(exp: specs.Experiment, arm: specs.Arm, seed: int, *, runs: str, quick: bool,
            timeout_s: float = 0.0) -> dict[str, Any] | None:
  """Runs (or resumes) one arm x seed; returns its done record (also written to `done.json`), or None when
  `timeout_s` ran out first or the run exited before its last step (a signal): it is not done, and the next
  call resumes it from its last checkpoint."""
  workdir = os.path.join(runs, exp.name, arm.name, f'seed{seed}')
  done_path = os.path.join(workdir, report.DONE_FILE)
  if os.path.exists(done_path):
    with open(done_path, encoding='utf-8') as f:
      return json.load(f)
  os.makedirs(workdir, exist_ok=True)
  overrides = run_overrides(exp, arm, seed, quick=quick)
  cmd = command(exp, overrides, workdir)
  logging.info('%s / %s / seed %d: %s', exp.name, arm.name, seed, ' '.join(cmd))
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=os.path.join(runs, 'compile_cache'),
             PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get('PYTHONPATH', '')) if p))
  if exp.cpu_devices and not quick:
    env['JAX_NUM_CPU_DEVICES'] = str(exp.cpu_devices)
  t0 = time.perf_counter()
  with open(os.path.join(workdir, 'log.txt'), 'ab') as log:
    try:
      proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=False,
                            timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
      logging.warning('%s / %s / seed %d: stopped after --timeout_s=%g s; it resumes from its last checkpoint '
                      'on the next call.', exp.name, arm.name, seed, timeout_s)
      return None
  if proc.returncode != 0:
    with open(os.path.join(workdir, 'log.txt'), encoding='utf-8', errors='replace') as f:
      tail = f.read()[-3000:]
    raise RuntimeError(f'{exp.name} / {arm.name} / seed {seed} failed (exit {proc.returncode}); the log '
                       f'({workdir}/log.txt) ends with:\n{tail}')
  # SIGTERM / SIGINT end a run early with exit 0 (after a checkpoint): done only once it reached its last step or
  # spent its training time (`trainer.max_train_minutes`; the trainer's summary file says which).
  num_steps = int(load_config(exp, overrides).trainer.num_steps)
  last = max((int(r['step']) for r in metrics_lib.read_metrics(workdir)), default=0)
  summary_path = os.path.join(workdir, trainer.SUMMARY_FILE)
  out_of_time = False
  if os.path.exists(summary_path):
    with open(summary_path, encoding='utf-8') as f:
      out_of_time = bool(json.load(f).get('stopped_by_time_budget'))
  if last < num_steps and not out_of_time:
    logging.warning('%s / %s / seed %d: exited at step %d of %d (stopped by a signal?); it resumes from its last '
                    'checkpoint on the next call.', exp.name, arm.name, seed, last, num_steps)
    return None
  record = {'experiment': exp.name, 'arm': arm.name, 'seed': seed, 'command': cmd,
            'process_wall_s': time.perf_counter() - t0, 'load_avg': os.getloadavg()[0]}
  with open(done_path, 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=1)
  return record


def run_experiment(name: str, *, arms: Sequence[str] = (), seeds: Sequence[int] = (), quick: bool = False,
                   runs: str, results: str, report_only: bool = False, timeout_s: float = 0.0,
                   restore: bool = True) -> str:
  """Runs what is missing of experiment `name` and writes its report; returns the report directory. With
  `restore`, the finished runs of the report already in `results` that `runs` lacks are rebuilt first
  (`report.restore`), so the new report keeps them (and they are not run again)."""
  exp = specs.EXPERIMENTS[name]
  chosen = [exp.arm(a) for a in arms] if arms else list(exp.arms[:2] if quick else exp.arms)
  seeds = list(seeds) or list(exp.seeds[:1] if quick else exp.seeds)
  out = os.path.join(results, name)
  committed = os.path.join(out, 'curves.csv')
  if restore and os.path.exists(committed):
    restored = report.restore(exp, committed, os.path.join(runs, name))
    if restored:
      logging.info('Restored %d finished runs from %s: %s', len(restored), committed,
                   ', '.join(f'{a}/seed{s}' for a, s in restored))
  if not report_only:
    for i, (arm, seed) in enumerate((a, s) for s in seeds for a in chosen):  # Seed-major: arms interleave.
      logging.info('Run %d of %d.', i + 1, len(chosen) * len(seeds))
      run_one(exp, arm, seed, runs=runs, quick=quick, timeout_s=timeout_s)  # None: stopped, goes on.
      report.write(exp, os.path.join(runs, name), out)
  report.write(exp, os.path.join(runs, name), out)
  return out
