"""Errors shared by every part of the package. Imports nothing of the package (no import cycles)."""


class ConfigError(ValueError):
  """A config value that cannot work; the message names the field (e.g. `config.algo.eps_low=1.5: ...`)."""
