"""Every config in `configs/` trains 2 steps with the tiny override (the folder is listed, so no config can rot).

The configs run one after another in ONE child process (1 CPU device, a persistent compilation cache), so the
programs of the shared tiny shapes compile once: the first config pays the compiles, the others reuse them (the
learner's numbers, which differ between configs, are inputs of its update, `Learner.hparams`; what still compiles
again is a config's own structure, e.g. calculator's tool stop tokens in the sampler). Tasks that need data files
run on the samples their configs ship; `code` runs its tests in the bubblewrap sandbox (with the tiny model's
8-token turns most episodes are cut before a test runs: this checks the wiring).
"""

import glob
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

from absl.testing import absltest

from sao_jax import config_lib
from tests import trainer_helpers

CONFIG_DIR = os.path.join(trainer_helpers.ROOT, 'configs')


def config_names() -> list[str]:
  return sorted(os.path.basename(f)[:-3] for f in glob.glob(os.path.join(CONFIG_DIR, '*.py'))
                if not os.path.basename(f).startswith('_'))


# Per-config additions to the tiny override: drift switches its rule every learner step, so the rows show the
# trainer driving a step-scheduled task (`Task.set_step`) and logging its metrics (`drift/phase`: 1 then 2); swe's
# prompts are the issues alone (its tool instructions do not fit the tiny 224-token episodes; the 8-token turns
# are cut before a tool runs, as code's: this checks the wiring).
EXTRA = {'drift': {'task.kwargs.unit': 'steps', 'task.kwargs.period': 1},
         'swe': {'task.kwargs.instructions': 'none'}}


def _worker(out_path: str, names: list[str] | None = None) -> None:
  """Child process: runs every config (or `names`) for 2 sync steps; writes {name: result or error} as JSON."""
  from absl import logging  # pylint: disable=g-import-not-at-top
  from sao_jax import metrics  # pylint: disable=g-import-not-at-top
  from sao_jax import trainer  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  results = {}
  for name in names or config_names():
    workdir = tempfile.mkdtemp()
    t0, c0 = time.perf_counter(), time.process_time()
    try:
      config = importlib.import_module(f'configs.{name}').get_config()
      config_lib.override(config, {**trainer_helpers.TINY, **EXTRA.get(name, {}), 'workdir': workdir,
                                     'trainer.mode': 'sync'})
      summary = trainer.run(config)
      rows = metrics.read_metrics(workdir)
      results[name] = {'steps': summary['steps'], 'rows': [r['step'] for r in rows],
                       'phases': [r.get('drift/phase') for r in rows],
                       'task': config.task.name, 'algo': config.algo.name,
                       'wall_s': time.perf_counter() - t0, 'cpu_s': time.process_time() - c0}
    except Exception:  # pylint: disable=broad-except  (reported per config by the test)
      results[name] = {'error': traceback.format_exc()[-3000:]}
    with open(out_path, 'w') as f:
      json.dump(results, f)


class AllConfigsTest(absltest.TestCase):

  def test_every_config_trains_two_steps(self):
    names = config_names()
    self.assertContainsSubset({'base', 'arith', 'calculator', 'code', 'drift', 'imo', 'math'}, names)
    out = os.path.join(tempfile.mkdtemp(), 'results.json')
    env = trainer_helpers.subprocess_env(devices=1)
    proc = subprocess.run([sys.executable, '-m', 'tests.trainer_configs_test', 'worker', out],
                          cwd=trainer_helpers.ROOT, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    with open(out) as f:
      results = json.load(f)
    self.assertEqual(sorted(results), names)
    for name in names:
      with self.subTest(config=name):
        got = results[name]
        self.assertNotIn('error', got, f'configs/{name}.py: {got.get("error")}')
        self.assertEqual(got['steps'], 2)
        self.assertEqual(got['rows'], [1, 2])
    self.assertEqual(results['drift']['phases'], [1.0, 2.0])


if __name__ == '__main__':
  if len(sys.argv) >= 3 and sys.argv[1] == 'worker':
    _worker(sys.argv[2], sys.argv[3:])
  else:
    absltest.main()
