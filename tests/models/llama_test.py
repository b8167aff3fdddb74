"""Tests of the decoder itself: KV-cache path, padding, layer execution modes, params metadata, log-probs."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.models import config as config_lib
from sao_jax.models import llama, logprobs


def _tiny(**kw):
  return config_lib.get_model_config('tiny', **kw)


def _tokens(cfg, shape, seed=0):
  return jax.random.randint(jax.random.key(seed), shape, 3, cfg.vocab_size, dtype=jnp.int32)


@nnx.jit
def _forward(model, tokens, mask):
  return model(tokens, attention_mask=mask)


@nnx.jit
def _step(model, tokens, mask, cache):
  return model(tokens, attention_mask=mask, cache=cache)


class DecoderTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('plain_tied', {}), ('bias_qknorm_untied', {'qkv_bias': True, 'qk_norm': True, 'tie_embeddings': False}))
  def test_cache_prefill_decode_and_continuation_match_full_forward(self, kw):
    cfg = _tiny(**kw)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
    if cfg.qkv_bias:  # Non-zero biases so the test sees them.
      model.layers.attn.q_bias[...] = 0.1 * jax.random.normal(jax.random.key(5), model.layers.attn.q_bias.shape)
    b, t = 3, 14
    toks = _tokens(cfg, (b, t))
    full = _forward(model, toks, None)
    cache = model.init_cache(b, 24)
    # Prefill 5, decode 3 single tokens, then a continuation chunk of 6 ("observation" tokens).
    l0, cache = _step(model, toks[:, :5], None, cache)
    outs = [l0]
    for i in range(5, 8):
      li, cache = _step(model, toks[:, i:i + 1], None, cache)
      outs.append(li)
    l2, cache = _step(model, toks[:, 8:], None, cache)
    outs.append(l2)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=2e-5, rtol=1e-5)
    self.assertEqual(int(cache.index), t)
    np.testing.assert_array_equal(cache.positions, [t] * b)

  def test_ragged_prompts_left_and_right_padding_in_cache(self):
    cfg = _tiny()
    model = llama.Decoder(cfg, rngs=nnx.Rngs(1))
    lens = [6, 3, 5]
    toks = _tokens(cfg, (3, 9), seed=1)
    refs = _forward(model, toks, None)  # Causal: row i's first n+3 logits are those of that prefix alone.
    for side in ('left', 'right'):
      rows, masks = [], []
      for i, n in enumerate(lens):
        pad = 6 - n
        row, m = toks[i, :n], jnp.ones((n,), bool)
        if side == 'left':
          rows.append(jnp.concatenate([jnp.zeros((pad,), jnp.int32), row]))
          masks.append(jnp.concatenate([jnp.zeros((pad,), bool), m]))
        else:
          rows.append(jnp.concatenate([row, jnp.zeros((pad,), jnp.int32)]))
          masks.append(jnp.concatenate([m, jnp.zeros((pad,), bool)]))
      prompt, mask = jnp.stack(rows), jnp.stack(masks)
      cache = model.init_cache(3, 16)
      logits, cache = _step(model, prompt, mask, cache)
      np.testing.assert_array_equal(cache.positions, lens)
      self.assertEqual(int(cache.index), 6)
      for i, n in enumerate(lens):
        got = logits[i, 6 - n:] if side == 'left' else logits[i, :n]
        np.testing.assert_allclose(got, refs[i][:n], atol=2e-5, rtol=1e-5, err_msg=side)
      # Three decode steps; row 2 is "finished" at the 2nd step (masked: it must not advance).
      for j in range(3):
        nxt = jnp.stack([toks[i, lens[i] + j] for i in range(3)])[:, None]
        m = jnp.array([True, True, j != 1])[:, None]
        out, cache = _step(model, nxt, m, cache)
        for i, n in enumerate(lens):
          if i == 2 and j == 2:  # After its masked step the row continues where it was.
            continue
          if bool(m[i, 0]):
            np.testing.assert_allclose(out[i, 0], refs[i][n + j], atol=2e-5, rtol=1e-5, err_msg=f'{side} {i} {j}')
      np.testing.assert_array_equal(cache.positions, [lens[0] + 3, lens[1] + 3, lens[2] + 2])
      self.assertEqual(int(cache.index), 9)

  def test_right_padded_batch_equals_rows_alone(self):
    cfg = _tiny(num_kv_heads=1)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(2))
    toks = _tokens(cfg, (2, 10), seed=2)
    mask = jnp.arange(10)[None] < jnp.array([[10], [4]])
    batch = _forward(model, toks, mask)
    alone = _forward(model, toks[1:, :4], None)
    np.testing.assert_allclose(batch[1, :4], alone[0], atol=2e-5, rtol=1e-5)
    # Causal attention in query blocks (skipping blocks above the diagonal) is the same function.
    blocked = llama.Decoder(cfg.replace(attention_chunk=3), rngs=nnx.Rngs(2))
    np.testing.assert_allclose(_forward(blocked, toks, mask), batch, atol=2e-5, rtol=1e-5)
    # Left padding with explicit positions (no cache): the real tokens see only themselves.
    left = jnp.concatenate([jnp.zeros((1, 6), jnp.int32), toks[1:, :4]], axis=1)
    lmask = jnp.arange(10)[None] >= 6
    pos = jnp.maximum(jnp.arange(10) - 6, 0)[None]
    out = nnx.jit(lambda m, t, a, p: m(t, attention_mask=a, positions=p))(model, left, lmask, pos)
    np.testing.assert_allclose(out[0, 6:], alone[0], atol=2e-5, rtol=1e-5)

  def test_packed_segments_equal_sequences_alone(self):
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 3, 3, 0]], jnp.int32)
    np.testing.assert_array_equal(llama.segment_positions(seg), [[0, 1, 2, 3, 0, 1, 2, 0, 1, 0]])
    cfg = _tiny(num_kv_heads=1)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(4))
    toks = _tokens(cfg, (1, 10), seed=4)
    packed = nnx.jit(lambda m, t, s: m(t, segment_ids=s))(model, toks, seg)
    for start, stop in ((0, 4), (4, 7), (7, 9)):
      alone = _forward(model, toks[:, start:stop], None)
      np.testing.assert_allclose(packed[0, start:stop], alone[0], atol=2e-5, rtol=1e-5, err_msg=f'{start}:{stop}')

  def test_scan_unrolled_and_remat_agree_in_value_and_grad(self):
    toks = _tokens(_tiny(), (2, 8))

    def loss(model):
      return jnp.mean(model(toks) ** 2)

    results = []
    for kw in ({}, {'scan_layers': False}, {'remat': True}, {'attention_chunk': 3}):
      model = llama.Decoder(_tiny(**kw), rngs=nnx.Rngs(3))
      value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
      results.append((value, grads))
    for value, grads in results[1:]:
      np.testing.assert_allclose(value, results[0][0], rtol=1e-5)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4), grads, results[0][1])

  def test_swiglu_custom_gradient_equals_autodiff(self):
    g, u, w = (jax.random.normal(jax.random.key(i), (3, 5, 7)) * 3 for i in range(3))
    fused = jax.grad(lambda g, u: jnp.sum(llama.swiglu(g, u) * w), argnums=(0, 1))(g, u)
    plain = jax.grad(lambda g, u: jnp.sum(jax.nn.silu(g) * u * w), argnums=(0, 1))(g, u)
    np.testing.assert_allclose(llama.swiglu(g, u), jax.nn.silu(g) * u, rtol=1e-6, atol=1e-6)
    for a, b in zip(fused, plain):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

  def test_bfloat16_compute_keeps_float32_params_and_logits(self):
    cfg32, cfg16 = _tiny(), _tiny(dtype='bfloat16')
    m32, m16 = llama.Decoder(cfg32, rngs=nnx.Rngs(4)), llama.Decoder(cfg16, rngs=nnx.Rngs(4))
    self.assertTrue(all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(m16, nnx.Param))))
    toks = _tokens(cfg32, (2, 8))
    l32, l16 = _forward(m32, toks, None), _forward(m16, toks, None)
    self.assertEqual(l16.dtype, jnp.float32)
    self.assertEqual(m16.init_cache(2, 4).dtype, jnp.bfloat16)
    np.testing.assert_allclose(l16, l32, atol=0.1)
    # The cached path in bfloat16 (prefill 5, then one token at a time) stays as close to float32.
    cache, outs = m16.init_cache(2, 8), []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 8)):
      out, cache = _step(m16, toks[:, lo:hi], None, cache)
      outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), l32, atol=0.1)
    self.assertGreater(float(jnp.abs(l16 - l32).max()), 0.0)  # bf16 actually used.

  def test_every_param_has_logical_axes_and_attn_filter_selects_attention(self):
    model = llama.Decoder(_tiny(qkv_bias=True, qk_norm=False, tie_embeddings=False), rngs=nnx.Rngs(0))
    allowed = {'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'norm', 'layers'}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
      names = var.get_metadata()['out_sharding']
      self.assertLen(names, var.get_value().ndim, msg=str(path))
      self.assertContainsSubset(set(names), allowed)
    attn = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.PathContains('attn')))}
    self.assertEqual(attn, {f'layers/attn/{n}' for n in
                            ('q_proj', 'k_proj', 'v_proj', 'o_proj', 'q_bias', 'k_bias', 'v_bias')})
    model3 = llama.Decoder(_tiny(qk_norm=True), rngs=nnx.Rngs(0))
    attn3 = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model3, nnx.PathContains('attn')))}
    self.assertIn('layers/attn/q_norm/scale', attn3)
    self.assertNotIn('layers/attn_norm/scale', attn3)

  def test_named_configs_param_counts(self):
    expected = {'smollm2-135m': 134_515_008, 'qwen2.5-0.5b': 494_032_768, 'qwen3-0.6b': 596_049_920,
                'llama3.2-1b': 1_235_814_400}
    for name in config_lib.MODEL_NAMES:
      cfg = config_lib.get_model_config(name)
      abstract = nnx.eval_shape(lambda cfg=cfg: llama.Decoder(cfg, rngs=nnx.Rngs(0)))
      self.assertEqual(llama.count_params(abstract), cfg.num_params(), msg=name)
      if name in expected:
        self.assertEqual(cfg.num_params(), expected[name], msg=name)
    self.assertBetween(config_lib.get_model_config('bench-25m').num_params(), 22e6, 28e6)

  def test_hf_config_round_trip_and_errors(self):
    for name in config_lib.MODEL_NAMES:
      cfg = config_lib.get_model_config(name)
      back = config_lib.ModelConfig.from_hf_config(cfg.to_hf_config(), name=name)
      self.assertEqual(back, cfg)
      hash(back)
    with self.assertRaisesRegex(ValueError, 'hidden_act'):
      config_lib.ModelConfig.from_hf_config(dict(config_lib.get_model_config('tiny').to_hf_config(),
                                                 hidden_act='gelu'))
    with self.assertRaisesRegex(ValueError, 'num_kv_heads'):
      _tiny(num_kv_heads=3)
    with self.assertRaisesRegex(ValueError, 'Unknown model config'):
      config_lib.get_model_config('gpt5')


class LogprobsTest(parameterized.TestCase):

  @parameterized.parameters((0.7, 4, False), (1.0, 64, True))
  def test_chunked_logprobs_equal_naive_in_value_and_grad(self, temperature, chunk, tied):
    cfg = _tiny(tie_embeddings=tied)
    model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
    toks = _tokens(cfg, (2, 11))
    mask = jnp.arange(11)[None] < jnp.array([[11], [7]])

    def naive(model):
      logits = model(toks, attention_mask=mask) / temperature
      lp = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1], -1), toks[:, 1:, None], -1)[..., 0]
      return jnp.pad(lp, ((0, 0), (1, 0)))

    def chunked(model):
      return logprobs.token_logprobs(model, toks, attention_mask=mask, temperature=temperature, chunk_size=chunk)

    ref, got = nnx.jit(naive)(model), nnx.jit(chunked)(model)
    np.testing.assert_array_equal(got[:, 0], 0.0)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
    from_logits = logprobs.token_logprobs_from_logits(_forward(model, toks, mask), toks, temperature=temperature)
    np.testing.assert_allclose(from_logits, ref, atol=1e-5, rtol=1e-5)
    if tied:  # Gradients: checked once (untied, several chunks); compiling them dominates this test.
      return
    w = jnp.where(mask, 1.0, 0.0).at[:, 0].set(0.0)
    g_ref = nnx.jit(nnx.grad(lambda m: jnp.sum(naive(m) * w)))(model)
    g_got = nnx.jit(nnx.grad(lambda m: jnp.sum(chunked(m) * w)))(model)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), g_got, g_ref)

  def test_entropy(self):
    cfg = _tiny()
    model = llama.Decoder(cfg, rngs=nnx.Rngs(0))
    toks = _tokens(cfg, (2, 6))
    lp, ent = logprobs.token_logprobs(model, toks, chunk_size=4, return_entropy=True)
    logits = _forward(model, toks, None)
    p = jax.nn.softmax(logits, -1)
    ref = -jnp.sum(p * jax.nn.log_softmax(logits, -1), -1)
    np.testing.assert_allclose(ent[:, 1:], ref[:, :-1], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(lp, logprobs.token_logprobs_from_logits(logits, toks), atol=1e-5)


if __name__ == '__main__':
  absltest.main()
