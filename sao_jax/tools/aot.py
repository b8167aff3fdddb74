"""The ahead-of-time plan of a run: every program compiled for a TPU topology on this host, nothing allocated.

    python -m sao_jax.tools.aot --config=configs/imo.py --topology=v5e-64 --config.model.name=qwen3-8b \
        [--config.*=...] [--json=plan.json]

Every state is abstract (`jax.ShapeDtypeStruct`s with the run's shardings: `Learner(..., abstract=True)`), so a
32B model is planned on a small host; `libtpu` (`scripts/setup.sh --tpu`) gives the real TPU compiler the devices
of a named topology (`jax.experimental.topologies`), `--topology=cpu:8` the host's own. The programs: the learner
update (the run's algorithm, and GRPO beside SAO), the weight publish (learner -> the actors' layout, in decode
layout and compute dtype), the slot engine's admission and decode chunk and the static engine's prefill and
decode (each with its KV cache). Per program the compiler's per-chip bytes (`memory_analysis`) with what the
run keeps resident on the same chips meanwhile, against the chip's HBM, its FLOPs and bytes accessed
(`cost_analysis`) and a roofline time; for the run, the learner step time, the actors' tokens/s and the MFU.

XLA's cost analysis counts a loop's body once, so FLOPs and bytes come from separate compiles of the same program
with its loops unrolled (`models.loops.unrolled_loops`, `scan_layers=False`) at 1 and 2 layers, extrapolated to the
model's depth (exact for identical layers): the time figures are rooflines of the compiler's counts, not
measurements. The JSON's `programs` entries carry at least `name`, `total_bytes_per_chip` and `hbm_bytes_per_chip`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Sequence

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Run config (configs/*.py).', lock_config=False)
_TOPOLOGY = flags.DEFINE_string('topology', 'v5e-64', "TPU slice ('v5e-64', 'v5p-128', 'v6e-16', 'v4-32', or a "
                                'libtpu topology such as v5e:8x8), or cpu:N (N host devices).')
_JSON = flags.DEFINE_string('json', '', 'Write the plan here as JSON.')
_GRPO = flags.DEFINE_bool('grpo', True, "Also plan GRPO's update beside an algorithm with a critic (two more compiles).")
_ENGINES = flags.DEFINE_enum('engines', 'run', ['run', 'both'], "Plan the sampler programs of the run's engine "
                              '(config.sampler.continuous: slot, else static) or of both.')
_SEQ_LEN = flags.DEFINE_integer('seq_len', 0, 'Learner batch length (0: the largest of config.trainer.seq_buckets).')


def main(argv: Sequence[str]) -> None:
  del argv
  from sao_jax.tools import aot_plan  # pylint: disable=g-import-not-at-top  # After the environment is set.
  result = aot_plan.plan(_CONFIG.value, _TOPOLOGY.value, seq_len=_SEQ_LEN.value, grpo=_GRPO.value,
                         engines=_ENGINES.value)
  print(result.table())
  if _JSON.value:
    with open(_JSON.value, 'w') as f:  # With the command that made it (its settings).
      json.dump({'command': ' '.join(['python -m sao_jax.tools.aot', *sys.argv[1:]]), **result.to_json()}, f, indent=1)
    print(f'Wrote {_JSON.value}.')


def _prepare_environment(argv: Sequence[str]) -> None:
  """Before jax starts: the platform is the host's (a TPU topology is only compiled for), and `cpu:N` gets N
  host devices."""
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')  # libtpu's one-process lock: plans may run side by side.
  for arg in argv:
    m = re.fullmatch(r'--topology=cpu:(\d+)', arg)
    if m and '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
      os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                                 f' --xla_force_host_platform_device_count={m.group(1)}').strip()


if __name__ == '__main__':
  _prepare_environment(sys.argv)
  flags.mark_flag_as_required('config')
  app.run(main)
