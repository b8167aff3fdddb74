"""Entry point: `python -m sao_jax.main --config=configs/arith.py [--config.algo.clip_mode=ppo] --workdir=DIR`.

Only parses flags, checks the config (`config_lib.validate`: the algorithm's preset filled in, every field, the
task, the learner, the optimizer, checkpoints and the mesh on the devices present) and hands it to the trainer.
`--dry_run` also builds the task and the tokenizer (no model), reads every data row the run will use
(`envs.data_check`), prints the resolved config, the learner's and actors' meshes and what the run would skip
(by file and row, with the reason), and exits; a file that cannot be read or has no usable row fails it in one
`FATAL bad config:` line, as every bad setting does.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from sao_jax import checkpoint
from sao_jax import config_lib
from sao_jax import metrics
from sao_jax import parallel
from sao_jax import tokenizers
from sao_jax import trainer
from sao_jax.envs import data_check
from sao_jax.envs import registry
from sao_jax.errors import RunError

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file, e.g. configs/arith.py (optionally `:arg`).', lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Output directory (checkpoints, metrics). Overrides config.workdir.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Check the config (building the mesh on the devices present, reading '
                             'every data row), print it resolved and what the run would skip, and exit.')

flags.mark_flags_as_required(['config'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  metrics.quiet_library_logs()
  config = _CONFIG.value
  if _WORKDIR.value is not None:
    with config.unlocked():
      config.workdir = _WORKDIR.value
  try:
    if not _DRY_RUN.value:
      parallel.initialize(config.distributed)  # Before anything touches a device (validate builds the mesh).
    config = config_lib.validate(config, for_run=True)
    report = check_data(config) if _DRY_RUN.value else None
  except config_lib.ConfigError as e:
    sys.exit(f'FATAL bad config: {e}')
  if _DRY_RUN.value:
    print(config)
    print(mesh_summary(config))
    print(report)
    return
  logging.info('Config:\n%s', config)
  try:
    trainer.run(config, validated=True)
  except config_lib.ConfigError as e:  # Refused at start-up (before the model build): a resume's changed config.
    sys.exit(f'FATAL bad config: {e}')
  except (RunError, checkpoint.CheckpointCorrupt) as e:  # What was saved is kept; the same command resumes.
    sys.exit(f'FATAL {" ".join(str(e).split())}')


def check_data(config) -> data_check.DataReport:
  """The data check of a validated config (`data_check.check_task_data` on its task and tokenizer; no model)."""
  task = registry.get_task(config.task)
  try:
    return data_check.check_task_data(config, task, tokenizers.get_tokenizer(config))
  finally:
    task.close()


def mesh_summary(config) -> str:
  """The learner's and the actors' meshes on the devices present (`config.mesh`, `config.mesh.actor_devices`)."""
  learner_devices, actor_devices = parallel.split_devices(config.mesh)
  mesh = parallel.make_mesh(config.mesh, learner_devices)
  lines = [f'learner mesh: {dict(mesh.shape)} over {len(learner_devices)} device(s) {[d.id for d in learner_devices]}']
  if actor_devices is None:
    lines.append("actor mesh: the learner's (shared by reference)")
  else:
    actor = parallel.make_actor_mesh(actor_devices)
    lines.append(f'actor mesh: {dict(actor.shape)} over {len(actor_devices)} device(s) '
                 f'{[d.id for d in actor_devices]} of this process')
  return '\n'.join(lines)


def _parse_flags(argv: list[str]) -> list[str]:
  """absl flag parsing; a config override naming no existing field becomes a one-line error naming it."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f'FATAL flags parsing error: {e}\nPass --helpshort or --helpfull to see help on flags.')
  except (AttributeError, KeyError) as e:  # ml_collections: override of a field that does not exist.
    while e.args and isinstance(e.args[0], BaseException):  # AttributeError(KeyError(...)) -> innermost.
      e = e.args[0]
    detail = ' '.join(str(e.args[0] if e.args else e).split())
    overrides = [a.split('=')[0] for a in argv[1:] if a.startswith('--config.')]
    bad = [o for o in overrides if detail.split()[0].strip('\'"') in o.split('.')]
    sys.exit(f'FATAL config override {bad[0] if bad else ""} names no config field: {detail}')


def run() -> None:
  app.run(main, flags_parser=_parse_flags)


if __name__ == '__main__':
  run()
