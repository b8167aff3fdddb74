"""Remat policies (`config.model.remat`, `config.model.critic_remat`): each one gives the loss and gradients of no
remat, is the `jax.checkpoint` policy it names, and the old bools still read (configs, checkpoints)."""

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax._src import core as jax_core

from configs import base
from sao_jax import checkpoint
from sao_jax import config_lib
from sao_jax.models import config as model_config
from sao_jax.models import llama, logprobs, value

POLICIES = model_config.REMAT_POLICIES


def _tiny(**kw):
  return model_config.get_model_config('tiny', **kw)


def _checkpoint_policies(fn, *args) -> list:
  """The `policy` of every `jax.checkpoint` equation in `fn`'s jaxpr (nested jaxprs included)."""
  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in ('remat2', 'checkpoint'):
        yield eqn.params['policy']
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          if isinstance(sub, jax_core.ClosedJaxpr):
            yield from walk(sub.jaxpr)
          elif isinstance(sub, jax_core.Jaxpr):
            yield from walk(sub)
  return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


class RematTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cfg = _tiny()
    cls.tokens = jax.random.randint(jax.random.key(0), (2, 12), 3, cfg.vocab_size, dtype=jnp.int32)
    cls._results = {}  # (value, grads) by config overrides: the no-remat references are computed once.

  def _value_and_grad(self, **kw):
    key = tuple(sorted(kw.items()))
    if key not in self._results:
      self._results[key] = self._compute_value_and_grad(**kw)
    return self._results[key]

  def _compute_value_and_grad(self, **kw):
    model = llama.Decoder(_tiny(attention_chunk=4, **kw), rngs=nnx.Rngs(3))
    tokens = self.tokens

    def loss(m):  # A policy-gradient-like loss through the learner's log-probs (and the chunked attention).
      return -jnp.mean(logprobs.token_logprobs(m, tokens) * jnp.linspace(-1.0, 1.0, tokens.shape[1]))

    return nnx.jit(nnx.value_and_grad(loss))(model)

  @parameterized.product(policy=POLICIES[1:], scan_layers=(True, False))
  def test_policy_gives_the_loss_and_gradients_of_no_remat(self, policy, scan_layers):
    want_value, want_grads = self._value_and_grad(remat='none', scan_layers=scan_layers)
    value_, grads = self._value_and_grad(remat=policy, scan_layers=scan_layers)
    # Float tolerance: remat recomputes the same ops, which XLA may fuse differently (on CPU they agree bit for bit).
    np.testing.assert_allclose(value_, want_value, rtol=1e-6)
    leaves, want = jax.tree.leaves(grads), jax.tree.leaves(want_grads)
    self.assertLen(leaves, len(want))
    for a, b in zip(leaves, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    self.assertGreater(max(float(jnp.abs(g).max()) for g in want), 1e-4)  # Non-vacuous: gradients flow.

  @parameterized.parameters(*POLICIES)
  def test_each_name_is_the_jax_checkpoint_policy_it_names(self, policy):
    model = llama.Decoder(_tiny(remat=policy), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    found = _checkpoint_policies(lambda s: nnx.merge(graphdef, s)(self.tokens), state)
    if policy == 'none':
      self.assertEqual(found, [])
    else:
      want = None if policy == 'full' else getattr(jax.checkpoint_policies, policy)
      self.assertEqual(found, [want])  # One checkpointed block body, run by the layer scan.

  def test_old_bools_read_as_policies_and_bad_names_fail(self):
    self.assertEqual(_tiny(remat=True).remat, 'full')
    self.assertEqual(_tiny(remat=False).remat, 'none')
    self.assertEqual(_tiny(remat=True), _tiny(remat='full'))
    self.assertEqual(hash(_tiny(remat=False)), hash(_tiny()))
    with self.assertRaisesRegex(ValueError, 'ModelConfig.remat=.fulll. is not one of'):
      _tiny(remat='fulll')
    with self.assertRaisesRegex(ValueError, 'ModelConfig.remat=1 is not one of'):
      _tiny(remat=1)
    # A checkpoint written before the policies holds a bool: its model config reads, and the run resumes (a remat
    # change is resumable: it changes what the backward pass recomputes, not the values).
    saved = checkpoint.manager.model_config_to_json(_tiny())
    saved['remat'] = True
    self.assertEqual(checkpoint.model_config_from_json(saved).remat, 'full')
    config, defaults = base.get_config(), config_lib.defaults()
    old = {k: v for k, v in checkpoint.flat_config(config).items() if k != 'model.critic_remat'}
    old['model.remat'] = False
    self.assertEqual(checkpoint.config_differences(old, config, defaults), [])
    config.model.remat, config.model.critic_remat = 'dots_saveable', 'full'
    self.assertEqual(checkpoint.config_differences(old, config, defaults), [])
    config.model.param_dtype = 'bfloat16'  # A storage dtype is a difference.
    self.assertEqual(checkpoint.config_differences(old, config, defaults), ['model.param_dtype'])

  def test_critic_takes_its_own_policy(self):
    policy = llama.Decoder(_tiny(remat='dots_saveable'), rngs=nnx.Rngs(0))
    same = value.ValueModel.from_policy(policy)
    own = value.ValueModel.from_policy(policy, remat='full')
    self.assertEqual(same.cfg.remat, 'dots_saveable')
    self.assertEqual(own.cfg.remat, 'full')
    self.assertEqual(own.backbone.cfg.remat, 'full')
    self.assertEqual(own.cfg.replace(remat='dots_saveable'), policy.cfg)  # Nothing else changes.
    graphdef, state = nnx.split(own)
    self.assertEqual(_checkpoint_policies(lambda s: nnx.merge(graphdef, s)(self.tokens), state), [None])
    np.testing.assert_array_equal(nnx.jit(lambda m: m(self.tokens))(own),
                                  nnx.jit(lambda m: m(self.tokens))(same))


if __name__ == '__main__':
  absltest.main()
