"""Tests of the value model: zero head, DESIGN alignment, copy from the policy, frozen-attention filter."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx

from sao_jax.models import config as config_lib
from sao_jax.models import llama, value


class ValueModelTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.cfg = config_lib.get_model_config('tiny', tie_embeddings=False)
    self.policy = llama.Decoder(self.cfg, rngs=nnx.Rngs(0))
    self.toks = jax.random.randint(jax.random.key(0), (2, 7), 3, self.cfg.vocab_size)

  def test_from_policy_copies_backbone_has_zero_head_and_no_lm_head(self):
    critic = value.ValueModel.from_policy(self.policy, rngs=nnx.Rngs(1))
    self.assertFalse(hasattr(critic.backbone, 'lm_head'))
    np.testing.assert_array_equal(critic(self.toks), 0.0)
    pol = dict(nnx.to_flat_state(nnx.state(self.policy, nnx.Param)))
    crit = dict(nnx.to_flat_state(nnx.state(critic.backbone, nnx.Param)))
    self.assertEqual(set(crit), set(pol) - {('lm_head',)})
    for k, v in crit.items():
      np.testing.assert_array_equal(v.get_value(), pol[k].get_value())
      self.assertIsNot(v.get_value(), pol[k].get_value())  # A copy: donating policy buffers is safe.
    hid = self.policy.hidden(self.toks)
    np.testing.assert_allclose(critic.backbone.hidden(self.toks), hid, atol=1e-6)

  def test_alignment_values_t_come_from_hidden_t_minus_1(self):
    critic = value.ValueModel.from_policy(self.policy)
    w = jax.random.normal(jax.random.key(3), (self.cfg.embed_dim,))
    critic.head.kernel[...] = w
    critic.head.bias[...] = jnp.float32(0.5)
    mask = jnp.arange(7)[None] < jnp.array([[7], [5]])
    values = nnx.jit(lambda m, t, a: m(t, attention_mask=a))(critic, self.toks, mask)
    hid = self.policy.hidden(self.toks, attention_mask=mask)
    expected = jnp.einsum('btd,d->bt', hid, w) + 0.5
    self.assertEqual(values.shape, (2, 7))
    self.assertEqual(values.dtype, jnp.float32)
    np.testing.assert_array_equal(values[:, 0], 0.0)
    np.testing.assert_allclose(values[:, 1:], expected[:, :-1], atol=1e-5, rtol=1e-5)

  def test_critic_attention_filter_freezes_exactly_the_attention(self):
    critic = value.ValueModel(self.cfg, rngs=nnx.Rngs(0))
    frozen = {p for p, _ in nnx.to_flat_state(nnx.state(critic, value.CRITIC_ATTENTION))}
    trainable = {p for p, _ in nnx.to_flat_state(nnx.state(critic, value.CRITIC_TRAINABLE))}
    self.assertEqual({p[-1] for p in frozen}, {'q_proj', 'k_proj', 'v_proj', 'o_proj'})
    self.assertTrue(all(p[:3] == ('backbone', 'layers', 'attn') for p in frozen))
    self.assertIn(('head', 'kernel'), trainable)
    self.assertIn(('backbone', 'layers', 'mlp', 'up_proj'), trainable)
    self.assertIn(('backbone', 'layers', 'attn_norm', 'scale'), trainable)
    self.assertEqual(frozen & trainable, set())
    self.assertEqual(frozen | trainable, {p for p, _ in nnx.to_flat_state(nnx.state(critic, nnx.Param))})

    # Gradients w.r.t. the trainable part only: the zero head still gets a gradient at init.
    def loss(trainable_state, rest):
      m = nnx.merge(graphdef, trainable_state, rest)
      return jnp.mean((m(self.toks) - 1.0) ** 2)

    graphdef, train_state, rest = nnx.split(critic, value.CRITIC_TRAINABLE, ...)
    grads = jax.grad(loss)(train_state, rest)
    self.assertGreater(float(jnp.abs(grads['head']['kernel'][...]).sum()), 0.0)


if __name__ == '__main__':
  absltest.main()
