"""Attention within segments (`models.attention`): the reference against a numpy oracle, flash and splash (Pallas
interpret mode on CPU) against the reference in values and gradients, no leak across segments, 'auto'."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.models import attention
from sao_jax.models import config as model_config
from sao_jax.models import llama, logprobs

KH, G, H = 2, 2, 16  # Key heads, query heads per key head, head width.


def _segments(t: int) -> np.ndarray:
  """int32 [3, t] of packed rows: row 0 several segments (boundaries inside blocks of 16/32/128) then right
  padding; row 1 left padding then one sequence; row 2 one segment filling the row."""
  seg = np.zeros((3, t), np.int32)
  a, b, c = int(0.3 * t) + 1, int(0.55 * t) + 3, int(0.9 * t)
  seg[0, :a], seg[0, a:b], seg[0, b:c] = 1, 2, 7  # c: trailing padding (segment 0).
  seg[1, t // 5:] = 1  # Left padding.
  seg[2] = 4
  return seg


def _inputs(t: int, dtype=jnp.float32, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(3, t, KH, G, H)), dtype)
  k = jnp.asarray(rng.normal(size=(3, t, KH, H)), dtype)
  v = jnp.asarray(rng.normal(size=(3, t, KH, H)), dtype)
  w = jnp.asarray(rng.normal(size=(3, t, KH, G, H)), jnp.float32)  # Cotangent: loss = sum(out * w).
  return q, k, v, jnp.asarray(_segments(t)), w


def _numpy_attention(q, k, v, seg):
  """The module docstring's formula, one query at a time (float64)."""
  q, k, v, seg = (np.asarray(x, np.float64) for x in (q, k, v, seg))
  b, t, kh, g, h = q.shape
  out = np.zeros(q.shape)
  for r in range(b):
    for i in range(t):
      allowed = (np.arange(t) <= i) & (seg[r] == seg[r, i])
      for c in range(kh):
        s = np.einsum('gh,sh->gs', q[r, i, c], k[r, :, c]) / np.sqrt(h)
        s = np.where(allowed, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[r, i, c] = (p / p.sum(-1, keepdims=True)) @ v[r, :, c]
  return out


def _value_and_grads(fn, q, k, v, seg, w):
  """(out, (dq, dk, dv)) of loss = sum(fn(q, k, v, seg) * w), jitted."""
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w)
  return jax.jit(fn)(q, k, v, seg), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _reference(q, k, v, seg):
  return attention.reference_attention(q, k, v, seg, chunk=16)


class AttentionTest(parameterized.TestCase):

  def assertClose(self, got, want, tol, msg=''):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    self.assertEqual(got.shape, want.shape, msg)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=msg)

  def test_reference_matches_numpy(self):
    """The reference, chunked and whole, is the formula (a wrong mask in both would pass every other test)."""
    q, k, v, seg, _ = _inputs(37)
    want = _numpy_attention(q, k, v, seg)
    self.assertClose(attention.reference_attention(q, k, v, seg, chunk=0), want, 1e-5)
    self.assertClose(attention.reference_attention(q, k, v, seg, chunk=8), want, 1e-5)

  @parameterized.named_parameters(
      ('blocks_of_16_t_100', 100, 16),  # T not a multiple of the block; boundaries inside blocks.
      ('blocks_of_32_t_96', 96, 32),    # T a multiple of the block.
      ('one_block', 40, 64),            # T <= block: one (padded-free) block.
  )
  def test_flash_matches_reference(self, t, block):
    """Flash equals the reference to 1e-5 in values and in gradients w.r.t. q, k and v (float32)."""
    self.assertMatchesReference(lambda q, k, v, s: attention.flash_attention(q, k, v, s, block=block), t)

  def assertMatchesReference(self, fn, t):  # pylint: disable=invalid-name
    """`fn(q, k, v, segment_ids)` equals the reference to 1e-5 in values and q/k/v gradients on `_inputs(t)`."""
    q, k, v, seg, w = _inputs(t)
    want, want_grads = _value_and_grads(_reference, q, k, v, seg, w)
    got, got_grads = _value_and_grads(fn, q, k, v, seg, w)
    self.assertClose(got, want, 1e-5, 'values')
    for name, g, r in zip('qkv', got_grads, want_grads):
      self.assertClose(g, r, 1e-5, f'd{name}')

  def test_flash_bfloat16(self):
    """bfloat16 inputs: bfloat16 outputs and gradients, within bfloat16 rounding of the float32 reference."""
    q, k, v, seg, w = _inputs(72)
    want, want_grads = _value_and_grads(_reference, q, k, v, seg, w)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got, got_grads = _value_and_grads(
        lambda q, k, v, s: attention.flash_attention(q, k, v, s, block=16), qb, kb, vb, seg, w)
    self.assertEqual(got.dtype, jnp.bfloat16)
    self.assertClose(got, want, 5e-2, 'values')
    for name, g, r in zip('qkv', got_grads, want_grads):
      self.assertEqual(g.dtype, jnp.bfloat16)
      self.assertClose(g, r, 0.15, f'd{name}')

  def test_splash_interpret_matches_reference(self):
    """The Pallas splash kernel (interpret mode) equals the reference to 1e-5 in values and gradients, with
    segment ids; T = 300 is padded to 384: three blocks of 128."""
    self.assertMatchesReference(lambda q, k, v, s: attention.splash_attention(q, k, v, s, interpret=True), 300)

  def test_splash_under_mesh(self):
    """Under the learner's mesh (`use_abstract_mesh`), splash runs on each device's rows and key heads in
    `shard_map` (data 2 x fsdp 2 x tensor 2): the reference's values."""
    q, k, v, seg, _ = _inputs(130)
    q, k, v, seg = (jnp.concatenate([x, x[:1]]) for x in (q, k, v, seg))  # 4 rows: one per (data, fsdp) pair.
    mesh = jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(('data', 'fsdp')))

    @jax.jit
    def fn(q, k, v, seg):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return attention.splash_attention(q, k, v, seg, interpret=True)

    got = fn(*(jax.device_put(x, rows) for x in (q, k, v, seg)))
    self.assertClose(got, _reference(q, k, v, seg), 1e-5)

  @parameterized.named_parameters(
      ('reference', lambda q, k, v, s: attention.reference_attention(q, k, v, s, chunk=16)),
      ('flash', lambda q, k, v, s: attention.flash_attention(q, k, v, s, block=16)),
      ('splash', lambda q, k, v, s: attention.splash_attention(q, k, v, s, interpret=True)),
  )
  def test_no_leak_across_segments(self, fn):
    """Changing the keys and values of one segment changes no output of another segment (nor the gradient
    reaching another segment's queries), in every implementation."""
    q, k, v, seg, w = _inputs(100)
    other = np.asarray(seg) != 2  # Row 0's segment 2 is perturbed; everything else must not move.
    noise = jnp.asarray(np.where(other, 0.0, 3.0)[..., None, None], jnp.float32)
    out, grads = _value_and_grads(fn, q, k, v, seg, w)
    out2, grads2 = _value_and_grads(fn, q, k + noise, v - noise, seg, w)
    self.assertGreater(float(jnp.abs(out2 - out)[0, ~other[0]].max()), 1e-2)  # The perturbation is seen...
    self.assertClose(np.asarray(out2)[other], np.asarray(out)[other], 1e-6, 'outputs')  # ...by segment 2 only.
    self.assertClose(np.asarray(grads2[0])[other], np.asarray(grads[0])[other], 1e-6, 'dq')

  def test_resolve_impl(self):
    """'auto' is flash on CPU and splash for a TPU program (an abstract mesh of TPU devices); a bad name raises."""
    self.assertEqual(attention.resolve_impl('auto'), 'flash')
    for impl in ('reference', 'flash', 'splash'):
      self.assertEqual(attention.resolve_impl(impl), impl)
    tpu = jax.sharding.AbstractMesh((1,), ('data',), abstract_device=jax.sharding.AbstractDevice(
        device_kind='TPU v5 lite', num_cores=1, platform='tpu'))
    with jax.sharding.use_abstract_mesh(tpu):
      self.assertEqual(attention.resolve_impl('auto'), 'splash')
    with self.assertRaisesRegex(ValueError, 'dense'):
      attention.resolve_impl('dense')
    with self.assertRaisesRegex(ValueError, 'attention_impl'):
      model_config.get_model_config('tiny', attention_impl='dense')

  def test_decoder_flash_matches_reference(self):
    """The decoder with flash attention: the learner's log-probs and their parameter gradients on packed rows
    equal the reference's (float32)."""
    cfg = model_config.get_model_config('tiny', attention_chunk=16)
    seg = jnp.asarray(_segments(70))
    tokens = jax.random.randint(jax.random.key(0), seg.shape, 3, cfg.vocab_size, dtype=jnp.int32)
    results = []
    for impl in ('reference', 'flash'):
      graphdef, params = nnx.split(llama.Decoder(cfg.replace(attention_impl=impl), rngs=nnx.Rngs(3)), nnx.Param)

      def loss(params):
        lp = logprobs.token_logprobs(nnx.merge(graphdef, params), tokens, segment_ids=seg)
        return jnp.sum(lp * jnp.linspace(-1.0, 1.0, lp.shape[1])), lp

      results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
    (_, lp_ref), g_ref = results[0]
    (_, lp_flash), g_flash = results[1]
    self.assertClose(lp_flash, lp_ref, 1e-5, 'log-probs')
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_flash), jax.tree.leaves(g_ref)):
      self.assertClose(a, b, 1e-5, jax.tree_util.keystr(path))


if __name__ == '__main__':
  absltest.main()
