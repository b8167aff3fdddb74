"""Test-wide setup: 8 simulated CPU devices (multi-device tests), before anything imports jax."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
