"""`decode.forward_mixed` (a decode step fused with chunk writes) against the decoder's plain forward pass; the
attention's two formulations (float32 copies of the cache on a CPU, float32 accumulation of its own dtype elsewhere)
against a numpy reference and, compiled for a TPU, by the bytes they access."""

import functools
import re
from unittest import mock

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
      ('chunk_window', {}, 11),
      ('key_blocks', {}, None, 4))
  def test_decode_rows_and_chunks_match_the_plain_forward(self, kw, chunk_window, key_block=None):
    """Rows 0 and 2 decode a token, row 1 takes a 4-token continuation, row 3 (empty) a 6-token prompt, one
    chunk entry is padding; every output and every key / value written equals the uncached forward's.
    `chunk_window` 11: just row 1's chunk's end (3 + 8 slots); row 2's decode token (at slot 12) still attends
    over its whole history. `key_block`: every chunk attends over the cache in key blocks of that many slots (the
    long-history prefill), the history's prefill and the chunks of the fused step alike."""
    if key_block:
      for name, value in (('PREFILL_DENSE_SCORES', 0), ('PREFILL_KEY_BLOCK', key_block)):
        patch = mock.patch.object(decode, name, value)
        patch.start()
        self.addCleanup(patch.stop)
    cfg = config_lib.get_model_config('tiny', **kw)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
    if cfg.qkv_bias:  # Non-zero biases so the test sees them.
      model.layers.attn.k_bias[...] = 0.1 * jax.random.normal(jax.random.key(5), model.layers.attn.k_bias.shape)
    weights = decode.decode_weights(model)
    # Jitted, as the samplers run it (op by op, the first case compiled 200+ single-op programs: 17 s of its 19):
    # fresh function objects, for jit keeps one trace per function and arguments, whatever the module's constants.
    forward = jax.jit(functools.partial(decode.forward), static_argnums=0,
                      static_argnames=('window', 'all_positions'))
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
    _, cache = forward(cfg, weights, cache, hist, hist_valid)
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
    mixed = functools.partial(jax.jit(functools.partial(decode.forward_mixed), static_argnums=0,
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
    step, _ = forward(cfg, weights, cache, last, np.ones((r, 1), bool), window=16)
    for i in range(r):
      np.testing.assert_allclose(decode.last_logits(weights, step)[i], full[i][len(seqs[i]) - 1], atol=2e-5, rtol=1e-5,
                                 err_msg=f'row {i} after the step')


class AttentionFormulationTest(absltest.TestCase):

  @staticmethod
  def _inputs(t, dtype):
    """Attention inputs whose values are bfloat16 numbers, in `dtype`."""
    b, k, g, h, w = 2, 2, 3, 16, 40
    r = np.random.default_rng(t)
    value = lambda *shape: jnp.asarray(r.normal(size=shape), jnp.bfloat16).astype(dtype)
    mask = jnp.asarray(r.random((b, t, w)) < 0.7).at[..., 0].set(True)
    return value(b, t, k, g, h), value(b, k, h, w), value(b, k, w, h), mask

  @staticmethod
  def _reference(q, kc, vc, mask, scale):
    """softmax(q . k * scale over the valid slots), rounded to q's dtype, times v: float64 from the inputs' values."""
    f = lambda x: np.asarray(x.astype(jnp.float32), np.float64)
    scores = np.einsum('btkgh,bkhs->btkgs', f(q), f(kc)) * scale
    scores = np.where(np.asarray(mask)[:, :, None, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = f(jnp.asarray(probs / probs.sum(-1, keepdims=True), jnp.float32).astype(q.dtype))
    return np.einsum('btkgs,bksh->btkgh', probs, f(vc))

  def test_both_formulations_compute_the_attention(self):
    # XLA:CPU runs no bfloat16 dot into float32: the TPU formulation runs here on float32 inputs (bfloat16 values),
    # the same subscripts, masking and rounding order; the CPU one on bfloat16 inputs as a CPU run has them.
    scale = 16 ** -0.5
    for platform, dtype in (('cpu', jnp.bfloat16), ('tpu', jnp.float32)):
      with self.subTest(platform):
        with decode.attention_for(platform):
          # Fresh function objects: jit keeps one trace per function and arguments, whatever the formulation.
          one_fn = jax.jit(functools.partial(decode._attend_one), static_argnums=4)  # pylint: disable=protected-access
          chunk_fn = jax.jit(functools.partial(decode._attend_chunk),  # pylint: disable=protected-access
                             static_argnums=4)
          q, kc, vc, mask = self._inputs(1, dtype)
          one = one_fn(q[:, 0], kc, vc, mask[:, 0], scale)
          q5, kc5, vc5, mask5 = self._inputs(5, dtype)
          chunk = chunk_fn(q5, kc5, vc5, mask5, scale)
        self.assertEqual((one.dtype, chunk.dtype), (dtype, dtype))
        tol = 2 ** -7 if dtype == jnp.bfloat16 else 1e-5
        for got, args in ((one[:, None], (q, kc, vc, mask)), (chunk, (q5, kc5, vc5, mask5))):
          np.testing.assert_allclose(np.asarray(got, np.float64), self._reference(*args, scale), rtol=tol, atol=tol)

  def test_key_blocks_compute_the_same_attention(self):
    scale = 16 ** -0.5
    q, kc, vc, mask = self._inputs(5, jnp.float32)
    mask = mask.at[0, 1].set(False)  # A padding query: no valid slot (dense: the mean of the values).
    dense = decode._attend_chunk(q, kc, vc, mask, scale)  # pylint: disable=protected-access
    for block in (8, 20, 40):
      blocked = decode._attend_chunk(q, kc, vc, mask, scale, key_block=block)  # pylint: disable=protected-access
      np.testing.assert_allclose(blocked, dense, rtol=1e-5, atol=1e-6, err_msg=f'block {block}')
    np.testing.assert_allclose(dense[:, 2:], self._reference(q[:, 2:], kc, vc, mask[:, 2:], scale), rtol=1e-5,
                               atol=1e-6)
    self.assertEqual(decode.chunk_key_block(1024, 1024), None)  # A prompt against its own slots: one pass.
    self.assertEqual(decode.chunk_key_block(512, 32768), decode.PREFILL_KEY_BLOCK)

  def test_on_a_tpu_the_cache_is_not_copied_to_float32(self):
    from jax.experimental import topologies  # pylint: disable=g-import-not-at-top  # libtpu: a test requirement.
    chip = topologies.get_topology_desc(topology_name='v5e:2x2', platform='tpu').devices[0]
    cache = jax.config.jax_enable_compilation_cache  # Not the suite's CPU cache: no client to load TPU programs.
    jax.config.update('jax_enable_compilation_cache', False)
    self.addCleanup(jax.config.update, 'jax_enable_compilation_cache', cache)
    b, k, g, h, w = 8, 2, 4, 128, 4096
    here = jax.sharding.SingleDeviceSharding(chip)
    on = lambda shape, dt=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dt, sharding=here)
    f32_cache = re.compile(r'f32\[8,2,(128,4096|4096,128)\]')  # A float32 buffer of the keys' or the values' shape.
    one = (on((b, k, g, h)), on((b, k, h, w)), on((b, k, w, h)), on((b, w), bool))
    chunk = (on((b, 4, k, g, h)), on((b, k, h, w)), on((b, k, w, h)), on((b, 4, w), bool))
    # The single-token attention's float32 upcast is what the TPU compiler keeps (its chunk dots fuse it).
    attend_one, attend_chunk = decode._attend_one, decode._attend_chunk  # pylint: disable=protected-access
    for fn, args, platform, copied in ((attend_one, one, 'cpu', True), (attend_one, one, 'tpu', False),
                                       (attend_chunk, chunk, 'tpu', False)):
      with self.subTest(f'{fn.__name__} as on a {platform}'), decode.attention_for(platform):
        text = jax.jit(functools.partial(fn), static_argnums=4).lower(*args, h ** -0.5).compile().as_text()
        self.assertEqual(bool(f32_cache.search(text)), copied)


if __name__ == '__main__':
  absltest.main()
