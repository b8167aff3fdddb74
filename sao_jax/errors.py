"""Errors shared by every part of the package. Imports nothing of the package (no import cycles)."""


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field (e.g. `config.algo.eps_low=1.5: ...`)."""


class RunError(RuntimeError):
  """A fault that stops a run cleanly, with what was saved kept: `sao_jax.main` prints the message in one line and
  exits 1 (the workdir held by another run, a checkpoint that could not be saved, metrics that could not be
  written). The same command, once the cause is gone, resumes from the newest checkpoint."""
