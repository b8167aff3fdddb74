"""Per-token log-probabilities with the DESIGN alignment, memory-light.

Alignment (DESIGN "Token alignment"): for tokens[B, T],

  out[b, 0] = 0,   out[b, t] = log pi(tokens[b, t] | tokens[b, :t]) = z[b, t-1, tokens[b, t]] - logsumexp(z[b, t-1])

with z = logits / temperature. `token_logprobs` never materialises the float32 [B, T, V] logits at once:
it runs the backbone to the final hidden states [B, T, D] and then, chunk by chunk over T (a `lax.map`
whose body is rematerialised), projects C positions to the vocabulary, takes logsumexp and gathers the
target logit. Peak extra memory is one [B, C, V] float32 block in the forward and in the backward pass.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from sao_jax import losses
from sao_jax.models import loops
from sao_jax.models.llama import Decoder, project_to_vocab

Array = jax.Array


def _shift_pad(x: Array) -> Array:
  """[B, T-1] -> [B, T] with a zero column in front (the DESIGN alignment)."""
  return jnp.pad(x, ((0, 0), (1, 0)))


def token_logprobs_from_logits(logits: Array, tokens: Array, *, temperature: float = 1.0) -> Array:
  """log_softmax(logits[:, t-1] / temperature)[tokens[:, t]] for t >= 1, 0 at t = 0. float32 [B, T]."""
  chex.assert_rank(logits, 3)
  chex.assert_equal_shape_prefix((logits, tokens), 2)
  # Work on all T positions (target of position t: tokens[t + 1]; the last one is dropped afterwards) rather
  # than on logits[:, :-1]: slicing would copy the [B, T, V] logits (and pad them again in the backward pass).
  z = logits.astype(jnp.float32) / temperature
  nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
  lp = jnp.take_along_axis(z, nxt[..., None], axis=-1)[..., 0] - jax.nn.logsumexp(z, axis=-1)
  return _shift_pad(lp[:, :-1])


def logprobs_from_hidden(hidden: Array, unembedding: Array, layout: str, tokens: Array, *,
                         temperature: float = 1.0, chunk_size: int = 128,
                         return_entropy: bool = False) -> Array | tuple[Array, Array]:
  """Aligned log-probs (and optionally entropies) from final hidden states, chunked over positions.

  Args:
    hidden: [B, T, D] final-norm hidden states.
    unembedding: the lm-head weight ([V, D] for layout 'vd', [D, V] for 'dv'), see `Decoder.unembedding`.
    layout: 'vd' or 'dv'.
    tokens: int[B, T].
    temperature: logits are divided by it.
    chunk_size: positions per vocabulary projection (peak memory B * chunk_size * V floats).
    return_entropy: also return entropy[b, t] of the distribution that generated token t (0 at t = 0),
      `sao_jax.losses.entropy_from_logits` of the tempered logits.

  Returns:
    float32 [B, T] log-probs (and [B, T] entropies) with the DESIGN alignment.
  """
  chex.assert_rank(hidden, 3)
  chex.assert_equal_shape_prefix((hidden, tokens), 2)
  b, t, d = hidden.shape
  n = t - 1
  if n <= 0:
    zeros = jnp.zeros((b, t), jnp.float32)
    return (zeros, zeros) if return_entropy else zeros
  c = max(1, min(chunk_size, n))
  num_chunks = -(-n // c)
  pad = num_chunks * c - n
  h = jnp.pad(hidden[:, :-1], ((0, 0), (0, pad), (0, 0)))
  tgt = jnp.pad(tokens[:, 1:], ((0, 0), (0, pad)))
  h = h.reshape(b, num_chunks, c, d).swapaxes(0, 1)  # [n_chunks, B, C, D]
  tgt = tgt.reshape(b, num_chunks, c).swapaxes(0, 1)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def chunk(args):
    h_c, t_c = args
    z = project_to_vocab(h_c, unembedding, layout) / temperature  # [B, C, V] float32
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = jnp.take_along_axis(z, t_c[..., None], axis=-1)[..., 0] - lse
    if not return_entropy:
      return lp, jnp.zeros_like(lp)
    return lp, losses.entropy_from_logits(z)

  lp, ent = loops.map(chunk, (h, tgt))
  lp = _shift_pad(lp.swapaxes(0, 1).reshape(b, -1)[:, :n])
  if not return_entropy:
    return lp
  return lp, _shift_pad(ent.swapaxes(0, 1).reshape(b, -1)[:, :n])


def token_logprobs(model: Decoder, tokens: Array, *, positions: Array | None = None,
                   attention_mask: Array | None = None, segment_ids: Array | None = None,
                   temperature: float = 1.0, chunk_size: int = 128,
                   return_entropy: bool = False) -> Array | tuple[Array, Array]:
  """log pi(tokens[b, t] | tokens[b, :t]) under `model` (DESIGN alignment, out[:, 0] = 0), float32 [B, T].

  Differentiable (use inside `nnx.grad`); memory-light (see the module docstring). Positions after the
  last real token of a right-padded row hold garbage log-probs: mask them with the action mask. With
  `segment_ids` (packed rows) the first token of each segment is conditioned on nothing of the previous one,
  so its log-prob is garbage too (it is a prompt token, never an action).
  """
  hidden = model.hidden(tokens, positions=positions, attention_mask=attention_mask, segment_ids=segment_ids)
  w, layout = model.unembedding()
  return logprobs_from_hidden(hidden, w, layout, tokens, temperature=temperature, chunk_size=chunk_size,
                              return_entropy=return_entropy)
