"""Advantage estimators: skip-observation GAE, length-adaptive lambda, group baselines, whitening.

Token alignment follows docs/design.md: `values[b, t]` is the value of the state in which token t was generated
and `action_mask[b, t]` marks the tokens the policy generated. Observation tokens (tool outputs, user turns,
prompt, padding) are not steps of the MDP: the Bellman chain jumps over them.

Skip-observation GAE. For the action positions `i_1 < ... < i_n` of a row, with `V_{n+1}` = bootstrap:

    delta_k = r[i_k] + gamma * V[i_{k+1}] - V[i_k]
    A_k     = delta_k + gamma * lam * A_{k+1},      A_{n+1} = 0
    R_k     = A_k + V[i_k]

Both chains are first-order linear recurrences over the full time axis once observation positions are made
to pass values through unchanged (`x_t = a_t * x_{t+1} + b_t`):

    next action value  w_t = V_t            if m_t else w_{t+1},   w_T = bootstrap   (a = 1 - m, b = m V)
                       V[i_{k+1}] = w_{i_k + 1}
    advantage          u_t = delta_t + gl u_{t+1} if m_t else u_{t+1},  u_T = 0   (a = gl^m, b = m delta)
                       A_k = u_{i_k}

and composing affine maps `x -> a x + b` is associative, so both run as `jax.lax.associative_scan` in
O(log T) depth (impl='associative', the accelerator default). impl='blocked' (the CPU default) solves them
sequentially inside short blocks, all blocks at once, then across blocks, tile by tile.
`skip_observation_gae_scan` is the plain sequential reference (impl='scan').
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sao_jax.losses import common

GaeImpl = Literal['auto', 'associative', 'scan', 'blocked']
GAE_IMPLS = ('auto', 'associative', 'scan', 'blocked')


def _prepare(rewards, values, action_mask, gamma, lam, bootstrap):
  """Validates shapes; returns float32 (r, v, bool m, gamma, lam[B], bootstrap[B]), all stop-gradient'ed."""
  chex.assert_rank([rewards, values, action_mask], 2)
  chex.assert_equal_shape([rewards, values, action_mask])
  chex.assert_type(values, float)
  b, _ = rewards.shape
  r = lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
  v = lax.stop_gradient(jnp.asarray(values, jnp.float32))
  m = jnp.asarray(action_mask) != 0
  lam = lax.stop_gradient(jnp.asarray(lam, jnp.float32))
  if lam.ndim == 0:
    lam = jnp.broadcast_to(lam, (b,))
  elif lam.shape != (b,):
    raise ValueError(f'lam must be a scalar or a [B]={b} array, got shape {lam.shape}')
  gamma = lax.stop_gradient(jnp.asarray(gamma, jnp.float32))
  if gamma.ndim != 0:
    raise ValueError(f'gamma must be a scalar, got shape {gamma.shape}')
  if bootstrap is None:
    boot = jnp.zeros((b,), jnp.float32)
  else:
    boot = lax.stop_gradient(jnp.asarray(bootstrap, jnp.float32))
    if boot.shape != (b,):
      raise ValueError(f'bootstrap must be None or a [B]={b} array, got shape {boot.shape}')
  return r, v, m, gamma, lam, boot


def _finish(adv, v, m):
  """Zeroes outside the mask and forms returns = A + V (float32, no gradient)."""
  adv = jnp.where(m, adv, 0.0)
  ret = jnp.where(m, adv + v, 0.0)
  return lax.stop_gradient(adv), lax.stop_gradient(ret)


def skip_observation_gae_scan(rewards: jax.Array, values: jax.Array, action_mask: jax.Array, *,
                              gamma: float | jax.Array, lam: float | jax.Array,
                              bootstrap: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Skip-observation GAE with a reverse `lax.scan` over time: the readable reference.

  Walks t = T-1 .. 0 carrying, per row, the value of the next action token (`next_v`, initially the
  bootstrap) and its advantage (`next_a`, initially 0). At an action token:
  `A_t = r_t + gamma next_v - V_t + gamma lam next_a`, then `next_v, next_a = V_t, A_t`; observation tokens
  leave the carry unchanged. Same contract as `skip_observation_gae`.
  """
  r, v, m, gamma, lam, boot = _prepare(rewards, values, action_mask, gamma, lam, bootstrap)
  gl = gamma * lam

  def step(carry, x):
    next_v, next_a = carry
    r_t, v_t, m_t = x
    a_t = r_t + gamma * next_v - v_t + gl * next_a
    return (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a)), a_t

  _, adv = lax.scan(step, (boot, jnp.zeros_like(boot)), (r.T, v.T, m.T), reverse=True)
  return _finish(adv.T, v, m)


def _compose(later, earlier):
  """Composition of affine maps for a reverse recurrence.

  `earlier` maps x_T to x_{t+1} (x_{t+1} = A1 x_T + B1); `later` is step t (x_t = a x_{t+1} + b).
  Result: x_t = (a A1) x_T + (a B1 + b). Associative (composition of affine maps).
  """
  a, b = later
  a1, b1 = earlier
  return a * a1, a * b1 + b


def _linear_recurrence_associative(a: jax.Array, b: jax.Array, init: jax.Array) -> jax.Array:
  """x_t = a_t x_{t+1} + b_t along axis 1 (reverse), x_T = init[B]; O(log T) depth."""
  # With reverse=True, jax scans the flipped sequence: fn(x, y) gets x = the part nearer the end of time.
  p, q = lax.associative_scan(lambda x, y: _compose(y, x), (a, b), reverse=True, axis=1)
  return q + p * init[:, None]


def _gae_blocked_tile(r, v, m, gamma, lam, next_v, next_a, block):
  """Skip-observation GAE of one `[B, T]` tile given what follows it, in one pass over short blocks.

  `next_v` / `next_a` `[B]` are the value and advantage of the first action token after the tile (bootstrap
  and 0 after the last tile). The tile is put once in a time-major block layout `[L, B, nb]` (L = `block`);
  one scan of L steps solves every block at once as if nothing followed it, keeping how the result depends
  on the two unknowns to its right, W (next action value) and U (next advantage), which enter linearly:
    `w_t = wl_t + P1_t W`                       (P1_t = 1 iff no action token in [t, block end))
    `delta_t = dl_t + gamma P1_{t+1} W`         (dl_t = r_t + gamma wl_{t+1} - V_t)
    `u_t = ul_t + C_t W + P2_t U`               (ul, C: the advantage chain over dl and gamma P1_{t+1};
                                                 P2_t = gl^(action tokens in [t, block end)))
  A scan over the nb blocks (last first) then finds each block's W, U, and one elementwise pass applies them.

  Returns:
    `(adv, w_start, u_start)`: adv `[B, T]` (valid at action tokens) and the two chains at the tile's first
    position (the `next_v`, `next_a` of the tile before it).
  """
  bsz, t = r.shape
  nb = -(-t // block)
  pad = nb * block - t
  if pad:  # Padded tokens are observations: they pass the chains through unchanged.
    r, v, m = (jnp.pad(x, ((0, 0), (0, pad))) for x in (r, v, m))

  def time_major(x):  # [B, nb * L] -> [L, B, nb]
    return jnp.transpose(x.reshape(bsz, nb, block), (2, 0, 1))

  gl = (gamma * lam)[:, None]  # [B, 1] against [B, nb] slabs.

  def inner(carry, x):  # Carries hold the local chains at t + 1.
    wl, p1, ul, c, p2 = carry
    r_t, v_t, m_t = x
    a_t = jnp.where(m_t, gl, 1.0)
    ul = a_t * ul + jnp.where(m_t, r_t + gamma * wl - v_t, 0.0)
    c = a_t * c + jnp.where(m_t, gamma * p1, 0.0)
    p2 = a_t * p2
    wl = jnp.where(m_t, v_t, wl)
    p1 = jnp.where(m_t, 0.0, p1)
    return (wl, p1, ul, c, p2), (ul, c, p2)

  zeros = jnp.zeros((bsz, nb), jnp.float32)
  ones = jnp.ones_like(zeros)
  (wl0, p10, ul0, c0, p20), (ul, c, p2) = lax.scan(
      inner, (zeros, ones, zeros, zeros, ones), (time_major(r), time_major(v), time_major(m)), reverse=True)

  def across(carry, x):  # Carries: W, U at the start of block j + 1; emits them as block j's right side.
    w_right, u_right = carry
    wl0_j, p10_j, ul0_j, c0_j, p20_j = x
    w_start = wl0_j + p10_j * w_right
    u_start = ul0_j + c0_j * w_right + p20_j * u_right
    return (w_start, u_start), (w_right, u_right)

  (w_start, u_start), (w_right, u_right) = lax.scan(
      across, (next_v, next_a), tuple(x.T for x in (wl0, p10, ul0, c0, p20)), reverse=True)
  adv = ul + c * w_right.T[None] + p2 * u_right.T[None]  # [L, B, nb]
  adv = jnp.transpose(adv, (1, 2, 0)).reshape(bsz, nb * block)[:, :t]
  return adv, w_start, u_start


def _gae_blocked(r, v, m, gamma, lam, boot, block, tile):
  """Blocked skip-observation GAE over tiles of `tile` time steps, last tile first (a short scan).

  Tiles keep the layout changes of `_gae_blocked_tile` inside the cache; the carry between tiles is the value
  and advantage of the next action token. `tile` <= 0 or >= T: one tile.
  """
  bsz, t = r.shape
  if tile <= 0 or tile >= t:
    return _gae_blocked_tile(r, v, m, gamma, lam, boot, jnp.zeros_like(boot), block)[0]
  n = -(-t // tile)
  pad = n * tile - t
  if pad:
    r, v, m = (jnp.pad(x, ((0, 0), (0, pad))) for x in (r, v, m))

  def tiles(x):  # [B, n * tile] -> [n, B, tile]: moves contiguous runs of `tile` elements.
    return jnp.transpose(x.reshape(bsz, n, tile), (1, 0, 2))

  def step(carry, x):
    adv, w0, u0 = _gae_blocked_tile(*x, gamma, lam, *carry, block)
    return (w0, u0), adv

  _, adv = lax.scan(step, (boot, jnp.zeros_like(boot)), (tiles(r), tiles(v), tiles(m)), reverse=True)
  return jnp.transpose(adv, (1, 0, 2)).reshape(bsz, n * tile)[:, :t]


def _gae_via_recurrences(r, v, m, gamma, lam, boot, recurrence):
  """Skip-observation GAE as two linear recurrences (see module docstring)."""
  w = recurrence(jnp.where(m, 0.0, 1.0), jnp.where(m, v, 0.0), boot)
  next_v = jnp.concatenate([w[:, 1:], boot[:, None]], axis=1)
  delta = r + gamma * next_v - v
  gl = (gamma * lam)[:, None]
  u = recurrence(jnp.where(m, gl, 1.0), jnp.where(m, delta, 0.0), jnp.zeros_like(boot))
  return _finish(u, v, m)


def default_gae_impl(backend: str | None = None) -> str:
  """The `impl` that 'auto' resolves to on `backend` (default: jax's default backend).

  Why: XLA:CPU pays per while-loop iteration and for layout changes of large arrays; 'blocked' keeps both small,
  while the log-depth scan moves the whole array ~2 log2(T) times (docs/benchmarks/gae.md). On GPU / TPU the
  associative scan is the parallel one.
  """
  backend = backend or jax.default_backend()
  return 'blocked' if backend == 'cpu' else 'associative'


def skip_observation_gae(rewards: jax.Array, values: jax.Array, action_mask: jax.Array, *,
                         gamma: float | jax.Array, lam: float | jax.Array,
                         bootstrap: jax.Array | None = None, impl: GaeImpl = 'auto',
                         block: int = 8, tile: int = 1024) -> tuple[jax.Array, jax.Array]:
  """Skip-observation GAE over the action tokens of each row (docs/design.md contract).

  For the action positions `i_1 < ... < i_n` of a row (observation tokens are skipped):
  `delta_k = r[i_k] + gamma V[i_{k+1}] - V[i_k]` with `V[i_{n+1}]` = bootstrap (0 when None: terminal),
  `A_k = delta_k + gamma lam A_{k+1}` (`A_{n+1} = 0`), `returns_k = A_k + V[i_k]`.

  Args:
    rewards: `[B, T]`; only action positions are read (the scalar reward sits on the last action token).
    values: `[B, T]` critic values, aligned with the tokens.
    action_mask: `[B, T]` bool / 0-1, True where the policy generated the token.
    gamma: discount (scalar).
    lam: GAE lambda, a scalar or a per-row `[B]` array (e.g. `adaptive_lambda`).
    bootstrap: `[B]` value after the last action of each row (truncated episodes), or None (terminal).
    impl: 'associative' (`lax.associative_scan`, O(log T) depth), 'scan' (sequential `lax.scan`),
      'blocked' (sequential inside blocks of `block` steps, all blocks at once, then across blocks), or
      'auto' = `default_gae_impl()` for the current backend. Static.
    block: block length of impl='blocked' (static).
    tile: impl='blocked' works through the time axis in tiles of this many steps, last first (static;
      <= 0 = one tile). Tiles keep its layout changes in cache.

  Returns:
    `(advantages, returns)`, float32 `[B, T]`, 0 outside the action mask, with no gradient.
  """
  if impl not in GAE_IMPLS:
    raise ValueError(f'impl must be one of {GAE_IMPLS}, got {impl!r}')
  if impl == 'auto':
    impl = default_gae_impl()
  if impl == 'scan':
    return skip_observation_gae_scan(rewards, values, action_mask, gamma=gamma, lam=lam, bootstrap=bootstrap)
  r, v, m, gamma, lam, boot = _prepare(rewards, values, action_mask, gamma, lam, bootstrap)
  if impl == 'associative':
    rec = _linear_recurrence_associative
    return _gae_via_recurrences(r, v, m, gamma, lam, boot, rec)
  if not isinstance(block, int) or block < 1:
    raise ValueError(f'block must be a positive int, got {block!r}')
  if not isinstance(tile, int):
    raise ValueError(f'tile must be an int, got {tile!r}')
  return _finish(_gae_blocked(r, v, m, gamma, lam, boot, block, tile), v, m)


def adaptive_lambda(action_mask: jax.Array, alpha: float | jax.Array = 1.5) -> jax.Array:
  """Length-adaptive GAE lambda of SAO: `lam_b = clip(1 - 1 / (alpha * l_b), 0, 1)`.

  `l_b` = number of action tokens of row b. A row without action tokens gets 0 (its lambda is unused).

  Args:
    action_mask: `[B, T]`.
    alpha: the scale alpha (> 0), SAO uses 1.5.

  Returns:
    float32 `[B]`.
  """
  chex.assert_rank(action_mask, 2)
  n = common.masked_sum(jnp.ones(action_mask.shape, jnp.float32), action_mask, axis=1)
  lam = 1.0 - 1.0 / (jnp.asarray(alpha, jnp.float32) * jnp.maximum(n, 1.0))
  return jnp.where(n > 0, jnp.clip(lam, 0.0, 1.0), 0.0)


def action_span_mask(action_mask: jax.Array) -> jax.Array:
  """The tokens from a row's first action token to its last, observations between them included.

  `span[b, t] = 1` iff `any(m[b, :t+1] > 0) and any(m[b, t:] > 0)`. GAE over this mask instead of the action
  mask runs the TD chain *through* the observation tokens (each one a step with reward 0 and its own value):
  the ablation of SAO's skip-observation GAE. On a single-turn row it equals the action mask.

  Args:
    action_mask: `[B, T]`.

  Returns:
    float32 `[B, T]`.
  """
  chex.assert_rank(action_mask, 2)
  acted = (action_mask > 0).astype(jnp.int32)
  after_first = jnp.cumsum(acted, axis=1) > 0
  before_last = jnp.cumsum(acted[:, ::-1], axis=1)[:, ::-1] > 0
  return (after_first & before_last).astype(jnp.float32)


def _group_mean(rewards: jax.Array) -> jax.Array:
  """Row mean `[P, 1]` computed as `r_0 + mean(r - r_0)`: exact when a group's rewards are all equal."""
  first = rewards[:, :1]
  return first + jnp.mean(rewards - first, axis=1, keepdims=True)


def group_advantages(rewards: jax.Array, *, std_normalize: bool = True, eps: float = 1e-6) -> jax.Array:
  """GRPO / Dr.GRPO group-relative advantages of G rollouts of P prompts.

  `A_{p,i} = (R_{p,i} - mean_j R_{p,j}) / (std_j R_{p,j} + eps)` (GRPO, `std` with Bessel's correction as
  in GRPO's reference code; a group of one has std 0), or `R_{p,i} - mean_j R_{p,j}` (Dr.GRPO,
  `std_normalize=False`). A group whose rewards are all equal gets exactly 0.

  Args:
    rewards: `[P, G]` scalar reward of each rollout.
    std_normalize: divide by the group's std (static).
    eps: added to the std.

  Returns:
    float32 `[P, G]`; broadcast to tokens with `broadcast_to_tokens`.
  """
  chex.assert_rank(rewards, 2)
  r = lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
  centered = r - _group_mean(r)
  if not std_normalize:
    return centered
  g = r.shape[1]
  std = jnp.sqrt(jnp.sum(jnp.square(centered), axis=1, keepdims=True) / max(g - 1, 1))
  return centered / (std + eps)


def leave_one_out_advantages(rewards: jax.Array) -> jax.Array:
  """RLOO: `A_{p,i} = R_{p,i} - (1/(G-1)) sum_{j != i} R_{p,j} = G/(G-1) (R_{p,i} - mean_j R_{p,j})`.

  Args:
    rewards: `[P, G]` with G >= 2.

  Returns:
    float32 `[P, G]`.
  """
  chex.assert_rank(rewards, 2)
  g = rewards.shape[1]
  if g < 2:
    raise ValueError(f'leave-one-out needs a group size G >= 2, got rewards of shape {rewards.shape}')
  r = lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
  return (r - _group_mean(r)) * (g / (g - 1))


def broadcast_to_tokens(advantages: jax.Array, action_mask: jax.Array) -> jax.Array:
  """Puts a per-trajectory advantage `[B]` on every action token of its row: `A[b, t] = A_b m[b, t]`."""
  chex.assert_rank(advantages, 1)
  chex.assert_rank(action_mask, 2)
  chex.assert_axis_dimension(action_mask, 0, advantages.shape[0])
  return jnp.where(jnp.asarray(action_mask) != 0, jnp.asarray(advantages, jnp.float32)[:, None], 0.0)


def whiten(advantages: jax.Array, action_mask: jax.Array, *, shift_mean: bool = True,
           eps: float = 1e-8) -> jax.Array:
  """Masked whitening over all action tokens of the batch: `(A - mu) / sqrt(var + eps)`, 0 off the mask.

  `mu` and `var` are the mean and (population) variance of A over the masked tokens of the whole batch
  (a global reduction, so under data parallelism it spans every shard). With `shift_mean=False` the mean
  is kept: `A / sqrt(var + eps)`.
  """
  chex.assert_rank([advantages, action_mask], 2)
  chex.assert_equal_shape([advantages, action_mask])
  a = lax.stop_gradient(jnp.asarray(advantages, jnp.float32))
  mean = common.masked_mean(a, action_mask)
  var = common.masked_var(a, action_mask)
  out = (a - mean) if shift_mean else a
  return jnp.where(jnp.asarray(action_mask) != 0, out * lax.rsqrt(var + eps), 0.0)


def skip_observation_gae_numpy(rewards, values, action_mask, *, gamma, lam, bootstrap=None):
  """Host numpy version (benchmark baseline): a reverse loop over time, vectorised over rows, float32."""
  r = np.asarray(rewards, np.float32)
  v = np.asarray(values, np.float32)
  m = np.asarray(action_mask) != 0
  bsz, t = r.shape
  gamma = np.float32(gamma)
  gl = gamma * np.broadcast_to(np.asarray(lam, np.float32), (bsz,))
  next_v = np.zeros(bsz, np.float32) if bootstrap is None else np.asarray(bootstrap, np.float32).copy()
  next_a = np.zeros(bsz, np.float32)
  adv = np.zeros_like(r)
  for i in range(t - 1, -1, -1):
    m_i = m[:, i]
    a_i = r[:, i] + gamma * next_v - v[:, i] + gl * next_a
    adv[:, i] = np.where(m_i, a_i, 0.0)
    next_v = np.where(m_i, v[:, i], next_v)
    next_a = np.where(m_i, a_i, next_a)
  return adv, np.where(m, adv + v, 0.0).astype(np.float32)
