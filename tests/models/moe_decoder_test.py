"""The Decoder with MoE layers (sao_jax.models.llama): its stacked aux and routing replay, the unrolled, rematerialised
and bfloat16 forms of the same function, and the critic of an MoE policy."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.models import value
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder


class MoeDecoderTest(absltest.TestCase):

  def test_decoder_aux_and_replay(self):
    """A Decoder of 2 MoE layers (no dense stack): aux stacked over them, padding outside the load, replaying its own
    choices gives the same logits, replaying others changes them."""
    cfg = get_model_config('tiny', num_layers=2, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32,
                           router_scoring='sigmoid', router_bias=True)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    self.assertFalse(hasattr(model, 'layers'))  # No dense layer: no dense stack.
    self.assertEqual(model.moe_layers.moe.gate_proj.shape[:2], (2, 8))
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 500, (2, 7)), jnp.int32)
    mask = jnp.arange(7)[None] < jnp.array([[7], [4]])
    run = nnx.jit(lambda m, routing: m(tokens, attention_mask=mask, return_aux=True, routing=routing))
    logits, aux = run(model, None)
    self.assertEqual(aux.experts.shape, (2, 2, 7, 2))
    np.testing.assert_allclose(np.asarray(aux.load.sum(-1)), 1.0, rtol=1e-6)
    counts = np.zeros((2, 8))
    for layer in range(2):
      for b, t in zip(*np.nonzero(np.asarray(mask))):
        counts[layer, np.asarray(aux.experts[layer, b, t])] += 1
    np.testing.assert_allclose(np.asarray(aux.load), counts / (11 * 2), rtol=1e-6)
    same = run(model, aux.experts)[0]
    np.testing.assert_allclose(np.asarray(same), np.asarray(logits), atol=1e-6)
    other = run(model, (aux.experts + 1) % 8)[0]
    self.assertGreater(float(jnp.abs(other - logits).max()), 1e-3)


_VARIANT_REF = {}


def _run(cfg, tokens):
  """((loss, (logits, aux)), gradients) of a Decoder of `cfg` (seed 0): loss = mean logsumexp + mean balance loss."""
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    logits, aux = nnx.merge(graphdef, params, rest)(tokens, return_aux=True)
    return jnp.mean(jax.nn.logsumexp(logits, -1)) + jnp.mean(aux.aux_loss), (logits, aux)

  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


class MoeDecoderVariantsTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('unrolled', dict(scan_layers=False), 1e-5),
      ('remat_full', dict(remat='full'), 1e-5),
      ('bfloat16', dict(dtype='bfloat16'), 0.05),
  )
  def test_same_function(self, overrides, atol):
    """The unrolled layers (forward) and a rematerialised scan (forward and gradients) compute the scanned forward's
    logits, aux and gradients. bfloat16
    compute replays float32's experts (routing replay): unreplayed, 1 of 48 choices flips at a near tie on this
    batch and that position's logits move by 0.47; replayed, every logit is within 0.05."""
    cfg = get_model_config('tiny', num_layers=2, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32,
                           first_k_dense=1, router_scoring='sigmoid', router_bias=True, num_shared_experts=1)
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 500, (2, 6)), jnp.int32)
    if 'ref' not in _VARIANT_REF:  # The scanned float32 forward and gradients, once for the three cases.
      _VARIANT_REF['ref'] = _run(cfg, tokens)
    if 'dtype' in overrides or 'scan_layers' in overrides:  # The forward only (one compile less each).
      model = Decoder(cfg.replace(**overrides), rngs=nnx.Rngs(0))
      ref_logits, ref_aux = _VARIANT_REF['ref'][0][1]
      replay = ref_aux.experts if 'dtype' in overrides else None
      logits, aux = nnx.jit(lambda m, r: m(tokens, routing=r, return_aux=True))(model, replay)
      np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(ref_logits), atol=atol)
      np.testing.assert_array_equal(np.asarray(aux.experts), np.asarray(ref_aux.experts))
      return

    (_, (ref_logits, ref_aux)), ref_grads = _VARIANT_REF['ref']
    (_, (logits, aux)), grads = _run(cfg.replace(**overrides), tokens)
    np.testing.assert_allclose(np.asarray(logits, np.float32), np.asarray(ref_logits), atol=atol)
    np.testing.assert_array_equal(np.asarray(aux.experts), np.asarray(ref_aux.experts))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4), grads, ref_grads)


class MoeValueModelTest(absltest.TestCase):

  def test_critic_of_an_moe_policy(self):
    """The critic's backbone is the MoE policy's (dense and MoE stacks, router bias included, copied); frozen attention
    covers both stacks' attention; the router and experts train, the correction bias is no Param (never trained)."""
    cfg = get_model_config('tiny', num_layers=2, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32,
                           first_k_dense=1, router_scoring='sigmoid', router_bias=True, tie_embeddings=False)
    policy = Decoder(cfg, rngs=nnx.Rngs(0))
    policy.moe_layers.moe.router_bias[...] = jnp.arange(8.0).reshape(1, 8) / 10
    critic = value.ValueModel.from_policy(policy, rngs=nnx.Rngs(1))
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 500, (2, 7)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(critic.backbone.moe_layers.moe.router_bias.get_value()),
                                  np.asarray(policy.moe_layers.moe.router_bias.get_value()))
    hidden = nnx.jit(lambda m, t: m.hidden(t))
    np.testing.assert_allclose(np.asarray(hidden(critic.backbone, tokens)), np.asarray(hidden(policy, tokens)),
                               atol=1e-6)
    frozen = {p for p, _ in nnx.to_flat_state(nnx.state(critic, value.CRITIC_ATTENTION))}
    trainable = {p for p, _ in nnx.to_flat_state(nnx.state(critic, value.CRITIC_TRAINABLE))}
    self.assertEqual({p[:3] for p in frozen}, {('backbone', 'layers', 'attn'), ('backbone', 'moe_layers', 'attn')})
    self.assertIn(('backbone', 'moe_layers', 'moe', 'router'), trainable)
    self.assertIn(('backbone', 'moe_layers', 'moe', 'gate_proj'), trainable)
    self.assertNotIn(('backbone', 'moe_layers', 'moe', 'router_bias'), trainable | frozen)


if __name__ == '__main__':
  absltest.main()
