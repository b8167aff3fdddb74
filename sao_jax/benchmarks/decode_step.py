r"""The slot engine's decode step at several attention windows.

  python -m sao_jax.benchmarks.decode_step [--model=smollm2-135m --rows=16 --steps=8 --windows=176,352,616]

Each window runs the jitted decode program (`generate.programs.decode_program`, the one `SlotSampler` runs,
sampling at temperature 1, no queue, its window buffers kept between calls) for `--steps` steps over `--rows`
rows of random weights and a 704-slot cache, and prints milliseconds a step (the best of `--repeats` calls,
after a first call that compiles). A step's attention reads rows x window slots: on a CPU, a large part of its
cost at long windows. Reports: docs/benchmarks/rollout.md.
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.generate import programs
from sao_jax.models import decode
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder
from sao_jax.generate.static import StaticSettings
from sao_jax.generate.sampling import SamplingParams

_MODEL = flags.DEFINE_string('model', 'smollm2-135m', 'Named model config (random weights).')
_ROWS = flags.DEFINE_integer('rows', 16, 'Decode rows.')
_STEPS = flags.DEFINE_integer('steps', 8, 'Decode steps per call.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed calls per case (the best is printed).')
_WINDOWS = flags.DEFINE_list('windows', ['176', '352', '616'], 'Attention windows (slots), one case each.')
_CACHE = 704  # Slots of the cache the rows are cut from (SmolLM2's rollout benchmark: 607-token episodes).


def main(argv):
  del argv
  cfg = get_model_config(_MODEL.value)
  weights = jax.jit(decode.decode_weights)(Decoder(cfg, rngs=nnx.Rngs(0)))
  r = _ROWS.value
  rows, zeros = np.arange(r, dtype=np.int32), np.zeros((r,), np.int32)

  def cache():  # Every row holds 40 tokens; the step's cost depends on the windows, not on the histories.
    c = decode.init_cache(cfg, r, _CACHE, per_row_index=True)
    return jax.block_until_ready(c.replace(valid=c.valid.at[:, :40].set(True), index=jnp.full((r,), 40, jnp.int32),
                                           positions=jnp.full((r,), 40, jnp.int32)))

  print(f'# {_MODEL.value} (random weights), {r} rows, {_STEPS.value} steps a call, cache {_CACHE} slots; '
        f'{jax.devices()[0].platform}')
  print('| rows at window | ms a step | first call s |')
  print('|---|---:|---:|')
  for window in (int(w) for w in _WINDOWS.value):
    st = StaticSettings(cfg, SamplingParams(), (), 0, window)
    init = decode.init_cache(cfg, r, window)
    kept = [(init.k, init.v)]  # The window buffers, kept from one call to the next as `SlotSampler` keeps them.

    def run(c, st=st):
      *_, kept[0] = jax.block_until_ready(programs.decode_program(
          st, _STEPS.value, None, weights, c, rows, zeros, np.ones((r,), bool), zeros,
          np.full((r,), 10 ** 6, np.int32), zeros.astype(np.uint32), np.int32(r + 1), None, kept[0]))

    t0 = time.perf_counter()
    run(cache())
    first = time.perf_counter() - t0
    best = float('inf')
    for _ in range(_REPEATS.value):
      c = cache()
      t0 = time.perf_counter()
      run(c)
      best = min(best, time.perf_counter() - t0)
    print(f'| {r} rows at {window} | {best / _STEPS.value * 1e3:.3g} | {first:.1f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
