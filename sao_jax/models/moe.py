"""Mixture-of-experts MLP as pure functions: the router, the experts (dropless or with a capacity), balance statistics.

One implementation, run by the Decoder's MoE blocks (`llama.MoeMLP`) and by the cached forward (`decode`). For tokens
x [M, D] in rows, E routed experts, k of them per token (`ModelConfig`'s MoE fields):

  logits = x W_r                                              (float32; W_r [D, E])
  'softmax' router: s = softmax(logits),  c = s               (Qwen3-MoE)
  'sigmoid' router: s = sigmoid(logits),  c = s + b           (GLM-4.5 / DeepSeek-V3; b the correction bias, the
                                                               choice c only, never the weights)
  grouped top-k (G groups, keep g): group score = sum of the two largest c of the group; the experts outside the
                                    g best groups get c = -inf
  e_1..e_k = top_k(c);   w_j = s[e_j];   norm_topk_prob: w_j /= sum_j w_j (+ 1e-20, sigmoid);   w_j *= rsf
  y = sum_j w_j SwiGLU_{e_j}(x) + SwiGLU_shared(x),   SwiGLU_e(x) = (silu(x G_e) * (x U_e)) D_e

with rsf = routed_scaling_factor and the shared expert present when `num_shared_experts > 0`. Routing replay: given
`experts` [M, k], the choice is skipped and the weights are w_j = s[e_j] of the given experts (same normalisation).

Experts. 'dropless' (`experts_dropless`): the M k token-expert pairs are sorted by expert (stable: token order within
an expert), the tokens gathered in that order and every expert's rows multiplied by its weights, then unsorted and
combined with w. The grouped matmul (`cfg.moe_matmul`): `jax.lax.ragged_dot` (TPU / GPU), or on a CPU ('tiles', where
XLA expands ragged_dot into E dense products) each expert's first floor(M k / E) pairs in dense batched matmuls and
the rest (its overflow) by a loop over (expert, row tile) visits with its own backward (`grouped_matmul`). 'capacity'
(`experts_capacity`): the same sort, but expert e keeps only its first C = min(ceil(capacity_factor M k / E), M)
pairs in token order, in a dense [E, C, D] buffer (batched matmuls); a dropped pair contributes 0.

Statistics (`MoeAux`, over the valid tokens, N of them): `load[e]` = (1 / (N k)) #{(t, j): e_j(t) = e} (sums to 1);
P_e = mean_t p_t[e] with p the router's probabilities (softmax s; sigmoid s / sum_e s); the load-balancing loss
`aux_loss = E sum_e (k load[e]) P_e` (HF `load_balancing_loss_func` of one layer: k at perfect balance);
`dropped` = the share of the N k pairs a capacity dropped (0 dropless); `experts` the chosen ids (for a replay).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import swiglu

Array = jax.Array

# The parameters of one MoE layer, by name (model layout; `llama.MoeMLP` holds them, `decode` passes a dict):
#   router [D, E], router_bias [E] (router_bias only), gate_proj / up_proj [E, D, F], down_proj [E, F, D],
#   shared_gate_proj / shared_up_proj [D, Fs], shared_down_proj [Fs, D] (num_shared_experts > 0 only).
PARAM_NAMES = ('router', 'router_bias', 'gate_proj', 'up_proj', 'down_proj', 'shared_gate_proj', 'shared_up_proj',
               'shared_down_proj')


class Routing(NamedTuple):
  """The router's decision for M tokens: `experts` int32 [M, k], combine `weights` float32 [M, k] and the router's
  probabilities `probs` float32 [M, E] (of the load-balancing loss)."""
  experts: Array
  weights: Array
  probs: Array


class MoeAux(NamedTuple):
  """What an MoE layer reports beside its output (stacked over layers by the Decoder: a leading [L_moe] axis).

  Attributes:
    experts: int32 [..., k], each token's chosen experts (the token axes of the input: [B, T] in the Decoder).
    load: float32 [E], share of the valid token-expert pairs routed to each expert (sums to 1).
    aux_loss: float32 [], the load-balancing loss E sum_e (k load[e]) P_e (module docstring).
    dropped: float32 [], share of the valid pairs a capacity dropped (0 for 'dropless').
  """
  experts: Array
  load: Array
  aux_loss: Array
  dropped: Array


def route(cfg: ModelConfig, x: Array, router: Array, bias: Array | None = None,
          experts: Array | None = None) -> Routing:
  """The router of the module docstring: x [M, D], router [D, E], bias [E] (sigmoid with router_bias) -> `Routing`.

  `experts` int [M, k]: replay these choices (the weights still come from this router's scores)."""
  m, d = x.shape
  e, k = cfg.num_experts, cfg.num_experts_per_tok
  chex.assert_shape(router, (d, e))
  logits = jnp.einsum('md,de->me', x.astype(jnp.float32), router.astype(jnp.float32))
  if cfg.router_scoring == 'softmax':
    scores = jax.nn.softmax(logits, axis=-1)
    probs = choice = scores
  else:
    scores = jax.nn.sigmoid(logits)
    probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
  if experts is None:
    if cfg.moe_groups > 1:
      g = cfg.moe_groups
      group_scores = jnp.sum(jax.lax.top_k(choice.reshape(m, g, e // g), 2)[0], axis=-1)  # [M, G]
      _, kept = jax.lax.top_k(group_scores, cfg.moe_topk_groups)  # [M, g]
      keep = jnp.any(kept[:, :, None] == jnp.arange(g, dtype=kept.dtype), axis=1)  # [M, G]
      choice = jnp.where(jnp.repeat(keep, e // g, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
  chex.assert_shape(experts, (m, k))
  experts = experts.astype(jnp.int32)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.norm_topk_prob:
    eps = 1e-20 if cfg.router_scoring == 'sigmoid' else 0.0
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + eps)
  if cfg.routed_scaling_factor != 1.0:
    weights = weights * jnp.float32(cfg.routed_scaling_factor)
  return Routing(experts=experts, weights=weights, probs=probs)


def _sort_pairs(experts: Array, num_experts: int) -> tuple[Array, Array, Array]:
  """The M k (token, slot) pairs sorted by expert (stable): (order [M k] into the flat pairs, their experts
  [M k], group sizes int32 [E])."""
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, jnp.take(flat, order), sizes


def _combine(out_sorted: Array, order: Array, weights: Array) -> Array:
  """Unsorts the pairs' outputs [M k, D] and sums each token's k of them with its weights [M, k] -> [M, D]."""
  m, k = weights.shape
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
  out = jnp.take(out_sorted, inverse, axis=0).reshape(m, k, -1)
  return jnp.einsum('mkd,mk->md', out, weights.astype(out.dtype))


def gmm_tile(rows: int, num_experts: int) -> int:
  """Row tile of `grouped_matmul`'s 'tiles' form: a power of two near rows / (2 E), in [8, 128] (visits add at
  most E partial tiles: up to E tile / rows = 1/2 more rows than the pairs, in fewer, larger matmuls; at rows / (4 E)
  the benchmark's [8192, 512] x [128, 512, 384] grouped matmul took 198 ms, at rows / (2 E) 124 ms)."""
  target = max(rows // (2 * num_experts), 1)
  return int(min(128, max(8, 2 ** round(math.log2(target)))))


def _tile_visits(sizes: Array, rows: int, tile: int):
  """The (group, tile) intersections of groups of `sizes` laid out in order over `rows` rows cut in tiles: (group
  [V], tile [V], real [V] bool, group starts [E], ends [E]), V = tiles + E - 1 (a static bound; padding not real)."""
  e = sizes.shape[0]
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  first, last = starts // tile, (ends - 1) // tile
  count = jnp.where(sizes > 0, last - first + 1, 0)
  cum = jnp.cumsum(count)
  v = jnp.arange(-(-rows // tile) + e - 1, dtype=cum.dtype)
  group = jnp.minimum(jnp.searchsorted(cum, v, side='right'), e - 1)
  tile_of = jnp.take(first, group) + v - (jnp.take(cum, group) - jnp.take(count, group))
  return group, tile_of, v < cum[-1], starts, ends


def _gmm_tiles(lhs: Array, rhs: Array, sizes: Array, tile: int, transpose_rhs: bool = False) -> Array:
  """out[r] = lhs[r] @ rhs[g(r)] (`transpose_rhs`: @ rhs[g(r)]^T, rhs [E, N, K]) with g(r) the group of row r
  (groups of `sizes` in order): a loop over the (group, tile) visits, one [tile, K] x [K, N] matmul each, written
  into the group's rows of the tile."""
  r, kdim = lhs.shape
  n = rhs.shape[1 if transpose_rhs else 2]
  eq = 'tk,nk->tn' if transpose_rhs else 'tk,kn->tn'
  padded = -(-r // tile) * tile
  lhs = jnp.pad(lhs, ((0, padded - r), (0, 0)))
  group, tile_of, real, starts, ends = _tile_visits(sizes, r, tile)
  offsets = jnp.arange(tile)

  def body(i, out):
    g, at = group[i], tile_of[i] * tile
    y = jnp.einsum(eq, jax.lax.dynamic_slice_in_dim(lhs, at, tile), jax.lax.dynamic_index_in_dim(rhs, g, keepdims=False))
    inside = (at + offsets >= starts[g]) & (at + offsets < ends[g])
    cur = jax.lax.dynamic_slice_in_dim(out, at, tile)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(inside[:, None], y.astype(out.dtype), cur), at, 0)

  # The real visits only (a while loop: their count is known at run time; `_gmm` has its own backward).
  out = jax.lax.fori_loop(0, jnp.sum(real, dtype=jnp.int32), body, jnp.zeros((padded, n), lhs.dtype))
  return out[:r]


def _tgmm_tiles(lhs: Array, dout: Array, sizes: Array, tile: int) -> Array:
  """d rhs[g] = sum over the rows r of group g of lhs[r]^T dout[r] -> [E, K, N] (the weights' gradient of
  `_gmm_tiles`), by the same visits."""
  r, kdim = lhs.shape
  n, e = dout.shape[1], sizes.shape[0]
  padded = -(-r // tile) * tile
  lhs = jnp.pad(lhs, ((0, padded - r), (0, 0)))
  dout = jnp.pad(dout, ((0, padded - r), (0, 0)))
  group, tile_of, real, starts, ends = _tile_visits(sizes, r, tile)
  offsets = jnp.arange(tile)

  def body(i, acc):
    g, at = group[i], tile_of[i] * tile
    inside = (at + offsets >= starts[g]) & (at + offsets < ends[g])
    x = jnp.where(inside[:, None], jax.lax.dynamic_slice_in_dim(lhs, at, tile), 0)
    upd = jnp.einsum('tk,tn->kn', x, jax.lax.dynamic_slice_in_dim(dout, at, tile), preferred_element_type=jnp.float32)
    cur = jax.lax.dynamic_index_in_dim(acc, g, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(acc, cur + upd[None], g, 0)

  return jax.lax.fori_loop(0, jnp.sum(real, dtype=jnp.int32), body, jnp.zeros((e, kdim, n), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm(lhs: Array, rhs: Array, sizes: Array, tile: int) -> Array:
  return _gmm_tiles(lhs, rhs, sizes, tile)


def _gmm_fwd(lhs, rhs, sizes, tile):
  return _gmm_tiles(lhs, rhs, sizes, tile), (lhs, rhs, sizes)


def _gmm_bwd(tile, res, dout):
  lhs, rhs, sizes = res
  dlhs = _gmm_tiles(dout, rhs, sizes, tile, transpose_rhs=True)
  drhs = _tgmm_tiles(lhs, dout, sizes, tile).astype(rhs.dtype)
  return dlhs.astype(lhs.dtype), drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def grouped_matmul(lhs: Array, rhs: Array, sizes: Array, impl: str = 'auto') -> Array:
  """out[r] = lhs[r] @ rhs[g(r)]: lhs [R, K] sorted by group, rhs [E, K, N], sizes int32 [E] (sum = R) -> [R, N].

  impl: 'ragged_dot' (`jax.lax.ragged_dot`: a grouped matmul on TPU / GPU; XLA:CPU expands it into E masked dense
  products, about E times the work), 'tiles' (a loop over the (group, row tile) intersections, one small matmul each,
  with its own backward: the CPU form), or 'auto' (tiles on a CPU, ragged_dot elsewhere; decided when traced).
  """
  if impl == 'auto':
    impl = 'tiles' if jax.default_backend() == 'cpu' else 'ragged_dot'
  if impl == 'ragged_dot':
    return jax.lax.ragged_dot(lhs, rhs, sizes)
  if impl != 'tiles':
    raise ValueError(f'grouped_matmul impl={impl!r}: one of auto, ragged_dot, tiles.')
  return _gmm(lhs, rhs, sizes, gmm_tile(lhs.shape[0], rhs.shape[0]))


def experts_dropless(x: Array, routing: Routing, gate: Array, up: Array, down: Array, impl: str = 'auto') -> Array:
  """sum_j w_j SwiGLU_{e_j}(x) of every token, no pair dropped: x [M, D], gate/up [E, D, F], down [E, F, D]
  -> [M, D]. Sorted by expert, then with `impl` 'ragged_dot' one grouped matmul per projection; with 'tiles' each
  expert's first S = floor(M k / E) pairs (the mean load: no padding when balanced) through dense [E, S, D] batched
  matmuls and the pairs past S (each expert's overflow, packed in order) through `grouped_matmul`'s tiles."""
  m, d = x.shape
  e, _, f = gate.shape
  k = routing.experts.shape[1]
  chex.assert_shape([gate, up], (e, d, f))
  chex.assert_shape(down, (e, f, d))
  order, sorted_experts, sizes = _sort_pairs(routing.experts, e)
  xs = jnp.take(x, order // k, axis=0)  # [M k, D], grouped by expert.
  dt = x.dtype
  if impl == 'auto':
    impl = 'tiles' if jax.default_backend() == 'cpu' else 'ragged_dot'
  if impl == 'tiles':
    r, slots = m * k, (m * k) // e
    rank = jnp.arange(r, dtype=jnp.int32) - jnp.take(jnp.cumsum(sizes) - sizes, sorted_experts)
    over = rank >= slots
    out = jnp.zeros((r, d), dt)
    if slots:  # The dense part: as `experts_capacity` with C = S.
      out = _slotted(xs, sorted_experts, rank, ~over, slots, gate, up, down)
    dest = jnp.where(over, jnp.cumsum(over) - 1, r)  # The overflow packed in order; r: not overflow.
    packed = jnp.zeros_like(xs).at[dest].set(xs, mode='drop')
    over_sizes, tile = jnp.maximum(sizes - slots, 0).astype(jnp.int32), min(gmm_tile(r, e), 16)
    gmm = lambda a, w: _gmm(a, w, over_sizes, tile)  # noqa: E731
    y = gmm(swiglu(gmm(packed, gate.astype(dt)), gmm(packed, up.astype(dt))), down.astype(dt))
    out = out + jnp.where(over[:, None], jnp.take(y, jnp.minimum(dest, r - 1), axis=0), 0)
    return _combine(out, order, routing.weights)
  gmm = functools.partial(grouped_matmul, sizes=sizes, impl=impl)
  h = swiglu(gmm(xs, gate.astype(dt)), gmm(xs, up.astype(dt)))
  return _combine(gmm(h, down.astype(dt)), order, routing.weights)


def _slotted(xs: Array, sorted_experts: Array, rank: Array, keep: Array, slots: int, gate: Array, up: Array,
             down: Array) -> Array:
  """SwiGLU_e of the pairs xs [R, D] (sorted by expert; `rank` the place in its expert's queue) where `keep`,
  through each expert's dense buffer of `slots` rows (batched matmuls); 0 for the other pairs. -> [R, D]."""
  e, d, dt = gate.shape[0], xs.shape[1], xs.dtype
  slot = jnp.where(keep, sorted_experts * slots + rank, e * slots)  # e * slots: not kept (out of bounds).
  buf = jnp.zeros((e * slots, d), dt).at[slot].set(xs, mode='drop').reshape(e, slots, d)
  h = swiglu(jnp.einsum('ecd,edf->ecf', buf, gate.astype(dt)), jnp.einsum('ecd,edf->ecf', buf, up.astype(dt)))
  y = jnp.einsum('ecf,efd->ecd', h, down.astype(dt)).reshape(e * slots, d)
  return jnp.where(keep[:, None], jnp.take(y, jnp.minimum(slot, e * slots - 1), axis=0), 0)


def capacity(cfg: ModelConfig, num_tokens: int) -> int:
  """Slots C of each expert's buffer: min(ceil(capacity_factor M k / E), M) (an expert takes a token once)."""
  c = math.ceil(cfg.capacity_factor * num_tokens * cfg.num_experts_per_tok / cfg.num_experts)
  return max(1, min(c, num_tokens))


def experts_capacity(x: Array, routing: Routing, gate: Array, up: Array, down: Array,
                     slots: int) -> tuple[Array, Array]:
  """`experts_dropless` with at most `slots` pairs per expert (its first ones in token order; the others give 0):
  -> (y [M, D], kept bool [M, k])."""
  m, d = x.shape
  e, _, f = gate.shape
  k = routing.experts.shape[1]
  chex.assert_shape([gate, up], (e, d, f))
  chex.assert_shape(down, (e, f, d))
  order, sorted_experts, sizes = _sort_pairs(routing.experts, e)
  starts = jnp.cumsum(sizes) - sizes
  rank = jnp.arange(m * k, dtype=jnp.int32) - jnp.take(starts, sorted_experts)  # Place in its expert's queue.
  keep = rank < slots
  out = _slotted(jnp.take(x, order // k, axis=0), sorted_experts, rank, keep, slots, gate, up, down)
  kept = jnp.zeros((m * k,), bool).at[order].set(keep).reshape(m, k)
  return _combine(out, order, routing.weights), kept


def balance(routing: Routing, num_experts: int, mask: Array | None = None) -> tuple[Array, Array]:
  """(aux_loss [], load [E]) of the module docstring over the tokens where `mask` [M] (None: all)."""
  m, k = routing.experts.shape
  valid = jnp.ones((m,), jnp.float32) if mask is None else mask.astype(jnp.float32)
  n = jnp.maximum(jnp.sum(valid), 1.0)
  counts = jnp.sum(jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32) * valid[:, None, None],
                   axis=(0, 1))  # [E]
  mean_probs = jnp.sum(routing.probs * valid[:, None], axis=0) / n  # [E]
  aux_loss = num_experts * jnp.sum(counts / n * mean_probs)
  return aux_loss, counts / (n * k)


def moe_mlp(cfg: ModelConfig, x: Array, p: dict[str, Any], mask: Array | None = None,
            experts: Array | None = None) -> tuple[Array, MoeAux]:
  """One MoE layer's MLP (module docstring): x [M, D] (compute dtype), `p` its parameters (`PARAM_NAMES`), `mask`
  bool [M] the valid tokens (of the statistics only: every row is computed), `experts` int [M, k] to replay.

  Returns:
    (y [M, D] in x's dtype, `MoeAux` with `experts` [M, k]).
  """
  chex.assert_rank(x, 2)
  routing = route(cfg, x, p['router'], p.get('router_bias'), experts)
  w = [p[n] for n in ('gate_proj', 'up_proj', 'down_proj')]
  if cfg.moe_impl == 'capacity':
    y, kept = experts_capacity(x, routing, *w, slots=capacity(cfg, x.shape[0]))
    valid = jnp.ones(kept.shape[:1], bool) if mask is None else mask.astype(bool)
    pairs = jnp.maximum(jnp.sum(valid) * kept.shape[1], 1)
    dropped = jnp.sum(~kept & valid[:, None]) / pairs
  else:
    y = experts_dropless(x, routing, *w, impl=cfg.moe_matmul)
    dropped = jnp.zeros((), jnp.float32)
  if cfg.num_shared_experts:
    dt = x.dtype
    h = swiglu(x @ p['shared_gate_proj'].astype(dt), x @ p['shared_up_proj'].astype(dt))
    y = y + h @ p['shared_down_proj'].astype(dt)
  aux_loss, load = balance(routing, cfg.num_experts, mask)
  return y.astype(x.dtype), MoeAux(experts=routing.experts, load=load, aux_loss=aux_loss,
                                   dropped=dropped.astype(jnp.float32))
