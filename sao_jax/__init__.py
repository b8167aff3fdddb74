"""sao_jax: Single-rollout Asynchronous Optimization (SAO) for RL of language models, in JAX."""

import glob as _glob
import importlib.util as _importlib_util
import os as _os

__version__ = '0.1.0'


def _host_platforms() -> None:
  """libtpu installed (for the ahead-of-time plan, `sao_jax.tools.aot`) on a host without TPU chips: jax would try
  a TPU backend at start-up and print libtpu's errors, so the host's own platforms are named (`JAX_PLATFORMS`, only
  when unset). A TPU VM shows its chips as /dev/accel* (v4, v5e) or /dev/vfio/* (v5p, v6e)."""
  if 'JAX_PLATFORMS' in _os.environ or _importlib_util.find_spec('libtpu') is None:
    return
  if _glob.glob('/dev/accel*') or _glob.glob('/dev/vfio/[0-9]*'):
    return
  cuda = any(_importlib_util.find_spec(p) for p in ('jax_cuda12_plugin', 'jax_cuda13_plugin'))
  _os.environ['JAX_PLATFORMS'] = 'cuda,cpu' if cuda else 'cpu'


_host_platforms()
