"""`decode.forward_mixed` (a decode step fused with chunk writes) against the decoder's plain forward pass."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.models import config as config_lib
from sao_jax.models import decode, llama


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


class ForwardMixedTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('plain_tied', {}, None),
      ('bias_qknorm_untied', {'qkv_bias': True, 'qk_norm': True, 'tie_embeddings': False}, None),
      ('chunk_window', {}, 11))
  def test_decode_rows_and_chunks_match_the_plain_forward(self, kw, chunk_window):
    """Rows 0 and 2 decode a token, row 1 takes a 4-token continuation, row 3 (empty) a 6-token prompt, one
    chunk entry is padding; every output and every key / value written equals the uncached forward's.
    `chunk_window` 11: just row 1's chunk's end (3 + 8 slots); row 2's decode token (at slot 12) still attends
    over its whole history."""
    cfg = config_lib.get_model_config('tiny', **kw)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
    if cfg.qkv_bias:  # Non-zero biases so the test sees them.
      model.layers.attn.k_bias[...] = 0.1 * jax.random.normal(jax.random.key(5), model.layers.attn.k_bias.shape)
    weights = decode.decode_weights(model)
    rng = np.random.default_rng(0)
    history = [5, 3, 12, 0]
    adds = [1, 4, 1, 6]  # Tokens each row gets in the fused step.
    seqs = [rng.integers(3, cfg.vocab_size, size=h + a + 1).tolist() for h, a in zip(history, adds)]
    r, t = 4, 8
    cache = decode.init_cache(cfg, r, 32, per_row_index=True)
    hist = np.zeros((r, max(history)), np.int32)
    hist_valid = np.zeros_like(hist, bool)
    for i, h in enumerate(history):
      hist[i, :h], hist_valid[i, :h] = seqs[i][:h], True
    _, cache = decode.forward(cfg, weights, cache, hist, hist_valid)
    cache = cache.replace(index=jnp.asarray(history, jnp.int32))  # Right padding is overwritten by the next write.

    active = np.array([True, False, True, False])
    tokens = np.array([seqs[i][history[i]] if active[i] else 0 for i in range(r)], np.int32)
    chunk_rows = np.array([3, r, 1], np.int32)  # Row 3's prompt, a padding entry, row 1's continuation.
    chunk = np.zeros((3, t), np.int32)
    chunk_valid = np.zeros((3, t), bool)
    for j, row in enumerate(chunk_rows):
      if row < r:
        chunk[j, :adds[row]] = seqs[row][history[row]:history[row] + adds[row]]
        chunk_valid[j, :adds[row]] = True
    mixed = functools.partial(jax.jit(decode.forward_mixed, static_argnums=0,
                                      static_argnames=('window', 'chunk_window')), chunk_window=chunk_window)
    hidden, chunk_hidden, cache = mixed(cfg, weights, cache, tokens, active, chunk_rows, chunk, chunk_valid,
                                        window=16)
    got = {i: decode.last_logits(weights, hidden)[i] for i in (0, 2)}
    got.update({3: decode.last_logits(weights, chunk_hidden)[0], 1: decode.last_logits(weights, chunk_hidden)[2]})
    longest = max(len(seq) for seq in seqs)  # Right padding: causal attention, the real positions are unchanged.
    full = _logits(model, jnp.asarray([seq + [0] * (longest - len(seq)) for seq in seqs]))
    for i in range(r):
      np.testing.assert_allclose(got[i], full[i][history[i] + adds[i] - 1], atol=2e-5, rtol=1e-5, err_msg=f'row {i}')
    np.testing.assert_array_equal(cache.index, np.add(history, adds))
    np.testing.assert_array_equal(cache.positions, np.add(history, adds))
    # What the step wrote is what the plain forward would have: every row's next token decodes right.
    last = np.array([seq[-1] for seq in seqs], np.int32)[:, None]
    step, _ = decode.forward(cfg, weights, cache, last, np.ones((r, 1), bool), window=16)
    for i in range(r):
      np.testing.assert_allclose(decode.last_logits(weights, step)[i], full[i][len(seqs[i]) - 1], atol=2e-5, rtol=1e-5,
                                 err_msg=f'row {i} after the step')


if __name__ == '__main__':
  absltest.main()
