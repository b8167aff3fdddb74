"""Benchmark of skip-observation GAE: `python -m sao_jax.benchmarks.gae [--repeats=N]`.

Times, on one batch of B rows x T tokens (default 64 x 32768, float32, 30% observation tokens in contiguous
spans between turns, the reward on the last action token), the median wall time of
  - each jax implementation of `sao_jax.losses.advantages.skip_observation_gae` (`impl=` associative, scan,
    blocked), jitted, compile time excluded and printed apart;
  - the host numpy loop (`skip_observation_gae_numpy`, fewer repeats);
  - a memory-bound floor: one jitted elementwise pass that reads the same three `[B, T]` inputs and writes two
    `[B, T]` float32 outputs, the least any implementation must move;
and prints a table (median and min wall time, CPU time) with each one's ratio to the floor and which impl
'auto' resolves to on this backend. Every implementation's advantages are checked against the numpy loop (max|err|).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.benchmarks import common
from sao_jax.losses import advantages

_BATCH = flags.DEFINE_integer('batch', 64, 'Rows B.')
_LENGTH = flags.DEFINE_integer('length', 32768, 'Tokens per row T.')
_OBS_FRACTION = flags.DEFINE_float('obs_fraction', 0.3, 'Fraction of observation tokens per row.')
_TURNS = flags.DEFINE_integer('turns', 8, 'Action spans (turns) per row; observations sit before and between.')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per jax implementation (after one warm-up).')
_NUMPY_REPEATS = flags.DEFINE_integer('numpy_repeats', 3, 'Timed calls of the numpy loop (0 = skip it).')
_IMPLS = flags.DEFINE_list('impls', ['associative', 'scan', 'blocked'], 'jax implementations to time.')
_BLOCKS = flags.DEFINE_list('blocks', [], 'Extra impl=blocked settings to time, each "block" or "block/tile".')
_GAMMA = flags.DEFINE_float('gamma', 1.0, 'Discount.')
_LAM = flags.DEFINE_float('lam', 0.95, 'GAE lambda.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the synthetic batch.')


def make_batch(batch: int, length: int, obs_fraction: float, turns: int, seed: int = 0):
  """Synthetic multi-turn rows: obs (prompt), act, obs, act, ..., act; random span lengths.

  Returns numpy `(rewards, values, action_mask)`, float32 / float32 / bool `[batch, length]`.
  """
  rng = np.random.default_rng(seed)
  mask = np.zeros((batch, length), bool)
  n_obs = int(round(obs_fraction * length))
  for b in range(batch):
    obs_spans = rng.multinomial(n_obs, rng.dirichlet(np.ones(turns)))  # Prompt + observations after turns.
    act_spans = rng.multinomial(length - n_obs, rng.dirichlet(np.ones(turns)))
    t = 0
    for o, a in zip(obs_spans, act_spans):
      t += o
      mask[b, t:t + a] = True
      t += a
  rewards = np.zeros((batch, length), np.float32)
  for b in range(batch):
    idx = np.flatnonzero(mask[b])
    if idx.size:
      rewards[b, idx[-1]] = rng.choice([0.0, 1.0])
  values = rng.normal(0.5, 0.3, (batch, length)).astype(np.float32)
  return rewards, values, mask


def main(argv: Sequence[str]) -> None:
  del argv
  b, t = _BATCH.value, _LENGTH.value
  gamma, lam = _GAMMA.value, _LAM.value
  r_np, v_np, m_np = make_batch(b, t, _OBS_FRACTION.value, _TURNS.value, _SEED.value)
  r, v, m = (jax.device_put(x) for x in (r_np, v_np, m_np))
  print(f'skip-observation GAE: B={b} T={t} obs={1 - m_np.mean():.1%} float32, gamma={gamma} lam={lam}, '
        f'backend={jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}')

  ref_adv = None
  rows = []  # (name, (median, min) seconds, compile seconds, max |adv - numpy|)
  if _NUMPY_REPEATS.value > 0:
    numpy_fn = lambda: advantages.skip_observation_gae_numpy(r_np, v_np, m_np, gamma=gamma, lam=lam)
    ref_adv = numpy_fn()[0]
    rows.append(('numpy loop (host)', common.timings(numpy_fn, _NUMPY_REPEATS.value), 0.0, 0.0))

  @jax.jit
  def floor(r, v, m):
    adv = jnp.where(m, r + gamma * v, 0.0)
    return adv, jnp.where(m, adv - v, 0.0)

  candidates = [(impl, impl, {}) for impl in _IMPLS.value]
  for spec in _BLOCKS.value:  # 'block' or 'block/tile'
    block, _, tile = spec.partition('/')
    kw = {'block': int(block)} | ({'tile': int(tile)} if tile else {})
    candidates.append((f'blocked ({", ".join(f"{k}={x}" for k, x in kw.items())})', 'blocked', kw))
  for name, impl, kw in candidates:
    fn = jax.jit(lambda r, v, m, impl=impl, kw=kw: advantages.skip_observation_gae(
        r, v, m, gamma=gamma, lam=lam, impl=impl, **kw))
    start = time.perf_counter()
    adv, _ = jax.block_until_ready(fn(r, v, m))
    compile_s = time.perf_counter() - start
    err = float(np.max(np.abs(np.asarray(adv) - ref_adv))) if ref_adv is not None else float('nan')
    rows.append((name, common.timings(lambda: fn(r, v, m), _REPEATS.value), compile_s, err))
  jax.block_until_ready(floor(r, v, m))
  floor_s = common.timings(lambda: floor(r, v, m), _REPEATS.value)
  rows.append(('memory floor (3 reads, 2 writes)', floor_s, 0.0, float('nan')))

  default = advantages.default_gae_impl()
  print(f'\n{"implementation":34s} {"median ms":>10s} {"x floor":>8s} {"min ms":>8s} {"x floor":>8s} '
        f'{"cpu ms":>8s} {"x floor":>8s} {"compile s":>10s} {"max|err|":>9s}')
  for name, (med, best, cpu), compile_s, err in rows:
    tag = '  <- default (impl="auto")' if name == default else ''
    print(f'{name:34s} {med * 1e3:10.2f} {med / floor_s[0]:8.2f} {best * 1e3:8.2f} {best / floor_s[1]:8.2f} '
          f'{cpu * 1e3:8.2f} {cpu / floor_s[2]:8.2f} {compile_s:10.2f} {err:9.1e}{tag}')
  print(f'\nrepeats: {_REPEATS.value} (jax), {_NUMPY_REPEATS.value} (numpy), after one warm-up call, compile '
        'excluded. median / min: wall time; cpu: median process CPU time (all threads); each ratio is to the '
        "floor's figure of the same kind.")


if __name__ == '__main__':
  app.run(main)
