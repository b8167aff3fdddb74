"""The attention benchmark's programs (`sao_jax.benchmarks.attention`), kept apart from its command-line flags so
tests can import them: benchmarks share flag names (--model, --batch), and absl refuses a flag defined twice in one
process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sao_jax.models import attention
from sao_jax.models import config as config_lib
from sao_jax.models import llama, logprobs


def two_segments(b: int, t: int) -> jax.Array:
  """Two packed sequences per row: segment 1 on the first 3/5 of the row, segment 2 on the rest."""
  return jnp.broadcast_to(jnp.where(jnp.arange(t) < 3 * t // 5, 1, 2).astype(jnp.int32), (b, t))


def scan_remat_attention(q, k, v, seg, *, block: int):
  """Flash's forward as scans under `jax.checkpoint`, differentiated by JAX (T a multiple of `block`)."""
  b, t, kh, g, h = q.shape
  n, f32 = t // block, jnp.float32
  kb, vb, sb = (jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0) for x in (k, v, seg))

  @jax.checkpoint
  def query_block(_, xs):
    i, q_i, seg_i = xs

    @jax.checkpoint
    def key_block(carry, ys):
      m, l, acc = carry
      j, k_j, v_j, seg_j = ys
      s = jnp.einsum('btkgh,bskh->bkgts', q_i, k_j, preferred_element_type=f32) * h ** -0.5
      mask = attention.segment_mask(seg_i, seg_j, q_offset=(i - j) * block)[:, None, None]
      s = jnp.where(mask, s, -1e30)  # Before the exp: no inf in a masked entry's gradient.
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      return (m_new, l * corr + p.sum(-1), acc * corr[..., None] + jnp.einsum('bkgts,bskh->bkgth', p, v_j)), None

    init = (jnp.full((b, kh, g, block), -1e30, f32), jnp.zeros((b, kh, g, block), f32),
            jnp.zeros((b, kh, g, block, h), f32))
    (_, l, acc), _ = jax.lax.scan(key_block, init, (jnp.arange(n), kb, vb, sb))
    return None, jnp.einsum('bkgth->btkgh', acc / l[..., None])

  qb = jnp.moveaxis(q.reshape(b, n, block, kh, g, h), 1, 0)
  _, out = jax.lax.scan(query_block, None, (jnp.arange(n), qb, sb))
  return jnp.moveaxis(out, 0, 1).reshape(q.shape)


def op_program(cfg: config_lib.ModelConfig, impl: str, b: int, t: int):
  """(jitted fn, args): value and gradients (q, k, v) of sum(attention(q, k, v) * w)."""
  kh, g, h = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, kh, g, h), jnp.float32)
  k, v = (jax.random.normal(key, (b, t, kh, h), jnp.float32) for key in keys[1:3])
  w = jax.random.normal(keys[3], q.shape, jnp.float32)
  chunk = cfg.attention_chunk

  def loss(q, k, v, seg, w):
    if impl == 'scan_remat':
      return jnp.sum(scan_remat_attention(q, k, v, seg, block=chunk) * w)
    return jnp.sum(attention.attention(q, k, v, seg, chunk=chunk, impl=impl) * w)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))), (q, k, v, two_segments(b, t), w)


def step_program(cfg: config_lib.ModelConfig, impl: str, b: int, t: int):
  """(jitted fn, args): loss and parameter gradients of one learner forward + backward."""
  model = llama.Decoder(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.vocab_size, jnp.int32)

  def loss(params, tokens, seg):
    lp = logprobs.token_logprobs(nnx.merge(graphdef, params), tokens, segment_ids=seg)
    return -jnp.mean(lp)

  return jax.jit(jax.value_and_grad(loss)), (params, tokens, two_segments(b, t))
