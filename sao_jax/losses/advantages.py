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

Packed rows (`segment_ids`, several trajectories in one row): each segment is its own chain, with its own lambda
and bootstrap. At the last token `e` of a segment the carried chains restart, `w_e <- bootstrap of the segment`
and `u_e <- 0` before step e (`a_e = 0` in the affine form), so no TD step and no advantage crosses a boundary.
A row without segment ids is one segment ending at T - 1 (the bootstrap enters there).
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


def _per_sequence(x, name, b, segment_ids, num_segments, fill):
  """A scalar, `[B]` (rows) or, with segment ids, `[B, S]` (segments) -> float32 per token `[B, T]`."""
  x = lax.stop_gradient(jnp.asarray(fill if x is None else x, jnp.float32))
  if x.ndim == 0:
    return x
  if segment_ids is None:
    if x.shape != (b,):
      raise ValueError(f'{name} must be a scalar or a [B]={b} array, got shape {x.shape}')
    return x[:, None]
  if x.shape != (b, num_segments):
    raise ValueError(f'{name} must be a scalar or a [B, S]=({b}, {num_segments}) array with segment_ids, got '
                     f'shape {x.shape}')
  return common.sequence_to_tokens(x, segment_ids)


def _prepare(rewards, values, action_mask, gamma, lam, bootstrap, segment_ids=None):
  """Validates shapes; returns float32 (r, v, bool m, gamma, lam [B, T], bootstrap [B, T], ends bool [B, T]),
  all stop-gradient'ed. `ends[b, t]`: t is the last token of its segment (always at T - 1); `bootstrap[b, t]`
  is the value after the segment's last action, read where `ends`; `lam[b, t]` the lambda of t's sequence."""
  chex.assert_rank([rewards, values, action_mask], 2)
  chex.assert_equal_shape([rewards, values, action_mask])
  chex.assert_type(values, float)
  b, t = rewards.shape
  r = lax.stop_gradient(jnp.asarray(rewards, jnp.float32))
  v = lax.stop_gradient(jnp.asarray(values, jnp.float32))
  m = jnp.asarray(action_mask) != 0
  gamma = lax.stop_gradient(jnp.asarray(gamma, jnp.float32))
  if gamma.ndim != 0:
    raise ValueError(f'gamma must be a scalar, got shape {gamma.shape}')
  num_segments = 1
  if segment_ids is not None:
    chex.assert_equal_shape([rewards, segment_ids])
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    shapes = [jnp.shape(x) for x in (lam, bootstrap) if x is not None and jnp.ndim(x) == 2]
    num_segments = shapes[0][1] if shapes else 1
  lam = jnp.broadcast_to(_per_sequence(lam, 'lam', b, segment_ids, num_segments, 0.0), (b, t))
  boot = jnp.broadcast_to(_per_sequence(bootstrap, 'bootstrap', b, segment_ids, num_segments, 0.0), (b, t))
  last = jnp.arange(t) == t - 1
  if segment_ids is None:
    ends = jnp.broadcast_to(last, (b, t))
  else:
    ends = common.segment_edges(segment_ids)[1]
  return r, v, m, gamma, lam, boot, ends


def _finish(adv, v, m):
  """Zeroes outside the mask and forms returns = A + V (float32, no gradient)."""
  adv = jnp.where(m, adv, 0.0)
  ret = jnp.where(m, adv + v, 0.0)
  return lax.stop_gradient(adv), lax.stop_gradient(ret)


def skip_observation_gae_scan(rewards: jax.Array, values: jax.Array, action_mask: jax.Array, *,
                              gamma: float | jax.Array, lam: float | jax.Array,
                              bootstrap: jax.Array | None = None,
                              segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Skip-observation GAE with a reverse `lax.scan` over time: the readable reference.

  Walks t = T-1 .. 0 carrying, per row, the value of the next action token (`next_v`) and its advantage
  (`next_a`); at the last token of a segment (of the row) they restart at (bootstrap, 0). At an action token:
  `A_t = r_t + gamma next_v - V_t + gamma lam next_a`, then `next_v, next_a = V_t, A_t`; observation tokens
  leave the carry unchanged. Same contract as `skip_observation_gae`.
  """
  r, v, m, gamma, lam, boot, ends = _prepare(rewards, values, action_mask, gamma, lam, bootstrap, segment_ids)

  def step(carry, x):
    next_v, next_a = carry
    r_t, v_t, m_t, lam_t, boot_t, end_t = x
    next_v = jnp.where(end_t, boot_t, next_v)
    next_a = jnp.where(end_t, 0.0, next_a)
    a_t = r_t + gamma * next_v - v_t + gamma * lam_t * next_a
    return (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a)), a_t

  zeros = jnp.zeros((r.shape[0],), jnp.float32)
  _, adv = lax.scan(step, (zeros, zeros), (r.T, v.T, m.T, lam.T, boot.T, ends.T), reverse=True)
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


def _gae_blocked_tile(r, v, m, gamma, lam, boot, ends, next_v, next_a, block):
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
  At a segment's last token (`ends`) the local chains restart from known values (W = its bootstrap, U = 0), so
  they stop depending on what lies to the right: `wl = boot, ul = 0, P1 = C = P2 = 0`.

  Returns:
    `(adv, w_start, u_start)`: adv `[B, T]` (valid at action tokens) and the two chains at the tile's first
    position (the `next_v`, `next_a` of the tile before it).
  """
  bsz, t = r.shape
  nb = -(-t // block)
  pad = nb * block - t
  if pad:  # Padded tokens are observations: they pass the chains through unchanged.
    r, v, m, lam, boot, ends = (jnp.pad(x, ((0, 0), (0, pad))) for x in (r, v, m, lam, boot, ends))

  def time_major(x):  # [B, nb * L] -> [L, B, nb]
    return jnp.transpose(x.reshape(bsz, nb, block), (2, 0, 1))

  def inner(carry, x):  # Carries hold the local chains at t + 1.
    wl, p1, ul, c, p2 = carry
    r_t, v_t, m_t, lam_t, boot_t, end_t = x
    wl, ul = jnp.where(end_t, boot_t, wl), jnp.where(end_t, 0.0, ul)
    p1, c, p2 = (jnp.where(end_t, 0.0, y) for y in (p1, c, p2))
    a_t = jnp.where(m_t, gamma * lam_t, 1.0)
    ul = a_t * ul + jnp.where(m_t, r_t + gamma * wl - v_t, 0.0)
    c = a_t * c + jnp.where(m_t, gamma * p1, 0.0)
    p2 = a_t * p2
    wl = jnp.where(m_t, v_t, wl)
    p1 = jnp.where(m_t, 0.0, p1)
    return (wl, p1, ul, c, p2), (ul, c, p2)

  zeros = jnp.zeros((bsz, nb), jnp.float32)
  ones = jnp.ones_like(zeros)
  (wl0, p10, ul0, c0, p20), (ul, c, p2) = lax.scan(
      inner, (zeros, ones, zeros, zeros, ones), tuple(time_major(x) for x in (r, v, m, lam, boot, ends)),
      reverse=True)

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


def _gae_blocked(r, v, m, gamma, lam, boot, ends, block, tile):
  """Blocked skip-observation GAE over tiles of `tile` time steps, last tile first (a short scan).

  Tiles keep the layout changes of `_gae_blocked_tile` inside the cache; the carry between tiles is the value
  and advantage of the next action token (zeros after the last tile: its last token ends a segment, where the
  bootstrap enters). `tile` <= 0 or >= T: one tile.
  """
  bsz, t = r.shape
  zeros = jnp.zeros((bsz,), jnp.float32)
  if tile <= 0 or tile >= t:
    return _gae_blocked_tile(r, v, m, gamma, lam, boot, ends, zeros, zeros, block)[0]
  n = -(-t // tile)
  pad = n * tile - t
  if pad:
    r, v, m, lam, boot, ends = (jnp.pad(x, ((0, 0), (0, pad))) for x in (r, v, m, lam, boot, ends))

  def tiles(x):  # [B, n * tile] -> [n, B, tile]: moves contiguous runs of `tile` elements.
    return jnp.transpose(x.reshape(bsz, n, tile), (1, 0, 2))

  def step(carry, x):
    r_i, v_i, m_i, lam_i, boot_i, ends_i = x
    adv, w0, u0 = _gae_blocked_tile(r_i, v_i, m_i, gamma, lam_i, boot_i, ends_i, *carry, block)
    return (w0, u0), adv

  _, adv = lax.scan(step, (zeros, zeros), tuple(tiles(x) for x in (r, v, m, lam, boot, ends)), reverse=True)
  return jnp.transpose(adv, (1, 0, 2)).reshape(bsz, n * tile)[:, :t]


def _gae_via_recurrences(r, v, m, gamma, lam, boot, ends, recurrence):
  """Skip-observation GAE as two linear recurrences (see module docstring); a segment's last token restarts
  both (`a = 0`, the bootstrap entering the value chain there)."""
  zeros = jnp.zeros((r.shape[0],), jnp.float32)
  w = recurrence(jnp.where(m | ends, 0.0, 1.0), jnp.where(m, v, jnp.where(ends, boot, 0.0)), zeros)
  next_v = jnp.where(ends, boot, jnp.concatenate([w[:, 1:], zeros[:, None]], axis=1))
  delta = r + gamma * next_v - v
  u = recurrence(jnp.where(ends, 0.0, jnp.where(m, gamma * lam, 1.0)), jnp.where(m, delta, 0.0), zeros)
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
                         block: int = 8, tile: int = 1024,
                         segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """Skip-observation GAE over the action tokens of each sequence (docs/design.md contract).

  A sequence is a row, or with `segment_ids` each segment of a packed row. For the action positions
  `i_1 < ... < i_n` of a sequence (observation tokens are skipped):
  `delta_k = r[i_k] + gamma V[i_{k+1}] - V[i_k]` with `V[i_{n+1}]` = bootstrap (0 when None: terminal),
  `A_k = delta_k + gamma lam A_{k+1}` (`A_{n+1} = 0`), `returns_k = A_k + V[i_k]`.

  Args:
    rewards: `[B, T]`; only action positions are read (the scalar reward sits on the last action token).
    values: `[B, T]` critic values, aligned with the tokens.
    action_mask: `[B, T]` bool / 0-1, True where the policy generated the token.
    gamma: discount (scalar).
    lam: GAE lambda, a scalar, a per-row `[B]` array, or with `segment_ids` a per-segment `[B, S]` one (e.g.
      `adaptive_lambda`).
    bootstrap: value after the last action of each row `[B]` (or segment, `[B, S]`) for truncated episodes, 0
      for a terminal one; None = all terminal.
    impl: 'associative' (`lax.associative_scan`, O(log T) depth), 'scan' (sequential `lax.scan`),
      'blocked' (sequential inside blocks of `block` steps, all blocks at once, then across blocks), or
      'auto' = `default_gae_impl()` for the current backend. Static.
    block: block length of impl='blocked' (static).
    tile: impl='blocked' works through the time axis in tiles of this many steps, last first (static;
      <= 0 = one tile). Tiles keep its layout changes in cache.
    segment_ids: int `[B, T]`, the trajectories packed into each row (1..S in order, 0 = padding; each
      segment one contiguous run), or None: one sequence per row.

  Returns:
    `(advantages, returns)`, float32 `[B, T]`, 0 outside the action mask, with no gradient.
  """
  if impl not in GAE_IMPLS:
    raise ValueError(f'impl must be one of {GAE_IMPLS}, got {impl!r}')
  if impl == 'auto':
    impl = default_gae_impl()
  if impl == 'scan':
    return skip_observation_gae_scan(rewards, values, action_mask, gamma=gamma, lam=lam, bootstrap=bootstrap,
                                     segment_ids=segment_ids)
  r, v, m, gamma, lam, boot, ends = _prepare(rewards, values, action_mask, gamma, lam, bootstrap, segment_ids)
  if impl == 'associative':
    return _gae_via_recurrences(r, v, m, gamma, lam, boot, ends, _linear_recurrence_associative)
  if not isinstance(block, int) or block < 1:
    raise ValueError(f'block must be a positive int, got {block!r}')
  if not isinstance(tile, int):
    raise ValueError(f'tile must be an int, got {tile!r}')
  return _finish(_gae_blocked(r, v, m, gamma, lam, boot, ends, block, tile), v, m)


def adaptive_lambda(action_mask: jax.Array, alpha: float | jax.Array = 1.5, segment_ids: jax.Array | None = None,
                    num_segments: int = 1) -> jax.Array:
  """Length-adaptive GAE lambda of SAO: `lam_q = clip(1 - 1 / (alpha * l_q), 0, 1)`.

  `l_q` = number of action tokens of trajectory q: row b, or with `segment_ids` segment s of row b. One
  without action tokens gets 0 (its lambda is unused).

  Args:
    action_mask: `[B, T]`.
    alpha: the scale alpha (> 0), SAO uses 1.5.
    segment_ids: `[B, T]` int, packed trajectories (1..S, 0 = padding), or None.
    num_segments: S (static).

  Returns:
    float32 `[B]`, or `[B, S]` with segment ids.
  """
  chex.assert_rank(action_mask, 2)
  n = common.sequence_sum(common.as_float_mask(action_mask), segment_ids, num_segments)
  lam = 1.0 - 1.0 / (jnp.asarray(alpha, jnp.float32) * jnp.maximum(n, 1.0))
  lam = jnp.where(n > 0, jnp.clip(lam, 0.0, 1.0), 0.0)
  return lam[:, 0] if segment_ids is None else lam


def action_span_mask(action_mask: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
  """The tokens from a sequence's first action token to its last, observations between them included.

  `span[b, t] = 1` iff an action token of t's sequence lies at or before t and one at or after t (a sequence:
  the row, or with `segment_ids` t's segment). GAE over this mask instead of the action mask runs the TD chain
  *through* the observation tokens (each one a step with reward 0 and its own value): the ablation of SAO's
  skip-observation GAE. On a single-turn sequence it equals the action mask.

  Args:
    action_mask: `[B, T]`.
    segment_ids: `[B, T]` int, packed sequences (contiguous runs), or None.

  Returns:
    float32 `[B, T]`.
  """
  chex.assert_rank(action_mask, 2)
  acted = (action_mask > 0).astype(jnp.int32)
  if segment_ids is None:
    after_first = jnp.cumsum(acted, axis=1) > 0
    before_last = jnp.cumsum(acted[:, ::-1], axis=1)[:, ::-1] > 0
    return (after_first & before_last).astype(jnp.float32)
  seg = jnp.asarray(segment_ids, jnp.int32)
  t = seg.shape[1]
  idx = jnp.arange(t, dtype=jnp.int32)
  starts, ends = common.segment_edges(seg)
  c = jnp.cumsum(acted, axis=1)
  first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)  # Start of t's segment.
  last = jax.lax.cummin(jnp.where(ends, idx, t - 1), axis=1, reverse=True)  # Its end.
  before = jnp.take_along_axis(c - acted, first, axis=1)  # Actions before the segment.
  upto_end = jnp.take_along_axis(c, last, axis=1)
  after_first = c - before > 0
  before_last = upto_end - (c - acted) > 0
  return (after_first & before_last & (seg > 0)).astype(jnp.float32)


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


def group_advantages_by_id(rewards: jax.Array, group_ids: jax.Array, valid: jax.Array, *,
                           baseline: str = 'mean', std_normalize: bool = True, eps: float = 1e-6) -> jax.Array:
  """Group-relative advantages of trajectories laid out in any order (packed rows): group = equal `group_ids`.

  For trajectory i with group `g_i = {j valid : id_j = id_i}` of size G_i:
    - baseline 'mean':          `A_i = (R_i - mean_g R) / (std_g R + eps)` (std with Bessel's correction, 0 for
      G_i = 1) or, `std_normalize=False`, `R_i - mean_g R` (Dr.GRPO);
    - baseline 'leave_one_out': `A_i = R_i - (1/(G_i - 1)) sum_{j in g, j != i} R_j` (RLOO; 0 for G_i = 1).
  The centred reward is computed as `-(1/G_i) sum_j (R_j - R_i)`: exactly 0 when a group's rewards are equal.
  Same values as `group_advantages` / `leave_one_out_advantages` on contiguous groups. Invalid entries get 0.

  Args:
    rewards, group_ids, valid: any equal shapes (e.g. `[B, S]`): reward, group id, 1 for a real trajectory.
    baseline: 'mean' or 'leave_one_out' (static).
    std_normalize: divide by the group's std ('mean' only; static).
    eps: added to the std.

  Returns:
    float32, the shape of `rewards`.
  """
  chex.assert_equal_shape([rewards, group_ids, valid])
  shape = jnp.shape(rewards)
  r = lax.stop_gradient(jnp.asarray(rewards, jnp.float32)).reshape(-1)
  g = jnp.asarray(group_ids).reshape(-1)
  ok = (jnp.asarray(valid) != 0).reshape(-1)
  same = ((g[:, None] == g[None, :]) & ok[:, None] & ok[None, :]).astype(jnp.float32)  # [N, N]
  count = jnp.maximum(jnp.sum(same, axis=1), 1.0)
  centered = -jnp.sum(same * (r[None, :] - r[:, None]), axis=1) / count
  if baseline == 'leave_one_out':
    adv = centered * count / jnp.maximum(count - 1.0, 1.0)
  elif baseline == 'mean':
    adv = centered
    if std_normalize:
      dev = r[None, :] - (r - centered)[:, None]
      std = jnp.sqrt(jnp.sum(same * jnp.square(dev), axis=1) / jnp.maximum(count - 1.0, 1.0))
      adv = centered / (std + eps)
  else:
    raise ValueError(f"baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
  return jnp.where(ok, adv, 0.0).reshape(shape)


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
