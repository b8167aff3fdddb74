"""Expert parallelism: an MoE Decoder with its experts split over an `expert` mesh axis (config.mesh.rules
('expert', 'expert')) computes what one device computes: the forward over expert 4, and loss + gradients over
expert 4 x fsdp 2 on the 8 simulated devices."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs import base
from sao_jax import parallel
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder

_RULES = tuple(r for r in base.get_config().mesh.rules if r[0] != 'expert') + (('expert', 'expert'),)
_CFG = get_model_config('tiny', num_layers=3, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=32, first_k_dense=1,
                        router_scoring='sigmoid', router_bias=True, moe_groups=2, moe_topk_groups=1,
                        num_shared_experts=1)


def _mesh(fsdp: int, expert: int):
  devices = jax.devices()[:fsdp * expert]
  return jax.make_mesh((1, fsdp, expert, 1), parallel.MOE_MESH_AXES, devices=devices,
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)


def _loss(model: Decoder, tokens):
  """Mean next-token NLL + 0.01 x the MoE layers' mean balance loss (what a learner step differentiates)."""
  logits, aux = model(tokens, return_aux=True)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  return nll + 0.01 * jnp.mean(aux.aux_loss)


def _sharded(model, mesh):
  graphdef, state = nnx.split(model)
  state = jax.device_put(state, parallel.tree_shardings(state, mesh, _RULES))
  return graphdef, state


class ExpertParallelTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.model = Decoder(_CFG, rngs=nnx.Rngs(0))
    cls.tokens = jnp.asarray(np.random.RandomState(0).randint(3, 500, (4, 16)), jnp.int32)

  def test_forward_over_expert_axis_equals_one_device(self):
    mesh = _mesh(fsdp=1, expert=4)
    graphdef, state = _sharded(self.model, mesh)
    gate = state['moe_layers']['moe']['gate_proj'].get_value()
    self.assertEqual(gate.sharding.spec, P(None, 'expert', None, None))  # [L, E, D, F]: experts split 4 ways.
    self.assertEqual(gate.addressable_shards[0].data.shape[1], 2)
    ref = nnx.jit(lambda m, t: m(t))(self.model, self.tokens)
    with jax.set_mesh(mesh):
      out = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, self.tokens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=0)

  def test_loss_and_grads_over_expert_4_fsdp_2_equal_one_device(self):
    mesh = _mesh(fsdp=2, expert=4)
    graphdef, state = _sharded(self.model, mesh)
    self.assertEqual(state['moe_layers']['moe']['down_proj'].get_value().sharding.spec,
                     P(None, 'expert', None, 'fsdp'))  # [L, E, F, D]: experts x fsdp.
    params = nnx.state(self.model, nnx.Param)

    def loss_fn(params, rest, tokens):
      return _loss(nnx.merge(graphdef, params, rest), tokens)

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    _, ref_params, ref_rest = nnx.split(self.model, nnx.Param, ...)
    ref_loss, ref_grads = grad_fn(ref_params, ref_rest, self.tokens)
    _, sh_params, sh_rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    with jax.set_mesh(mesh):
      tokens = jax.device_put(self.tokens, NamedSharding(mesh, P(('data', 'fsdp'))))
      loss, grads = grad_fn(sh_params, sh_rest, tokens)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    flat, ref_flat = dict(nnx.to_flat_state(grads)), dict(nnx.to_flat_state(ref_grads))
    self.assertEqual(set(flat), set(ref_flat))
    self.assertEqual(len(ref_flat), len(jax.tree.leaves(params)))
    for path, g in flat.items():
      ref = np.asarray(ref_flat[path].get_value())
      np.testing.assert_allclose(np.asarray(g.get_value()), ref, atol=1e-6 + 1e-4 * np.abs(ref).max(), rtol=0,
                                 err_msg='/'.join(map(str, path)))
    self.assertGreater(float(jnp.abs(ref_flat[('moe_layers', 'moe', 'router')].get_value()).max()), 0.0)


if __name__ == '__main__':
  absltest.main()
