"""LoRA in the learner: one frozen base shared by policy and critic, adapters (and the critic's head) the only
trained leaves with optimizer states, checkpoints of adapters only that refuse another base, and the policy loaded
back from such a checkpoint. (The step's math against the reference: `reference_test.SaoLoraReferenceStepTest`.)"""

import tempfile

import jax
import numpy as np
from absl.testing import absltest
from flax import nnx

from sao_jax import config_lib
from sao_jax.checkpoint import contents
from sao_jax.checkpoint import manager
from sao_jax.errors import ConfigError
from sao_jax.learner import Learner, LearnerConfig
from sao_jax.learner import state as state_lib
from sao_jax.models import Decoder
from sao_jax.models import lora
from tests.learner import helpers as H

MODEL = H.MODEL.replace(lora_rank=4, lora_targets=lora.TARGETS)


class _Prompts:
  """The part of a `PromptSource` a checkpoint reads and writes."""
  taken = 0

  def state(self):
    return {'taken': 0}

  def restore(self, state):
    del state


def _config(**overrides):
  return H.config('sao', **{'model.lora.rank': MODEL.lora_rank, 'trainer.checkpoint_every': 1, **overrides})


def _learner(seed=0, config=None):
  config = config or _config()
  return Learner(LearnerConfig.from_config(config), policy=lambda: Decoder(MODEL, rngs=nnx.Rngs(seed)),
                 mesh=H.mesh(2, 2), model_config=MODEL)


def _size(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


class LoraLearnerTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.learner = _learner()
    cls.base_before = H.host(cls.learner.base)
    cls.adapters_before = H.host(cls.learner.state.policy.params)
    cls.metrics = [cls.learner.update(H.batch(i)) for i in range(2)]  # Step 2: the policy's first (warmup 1).

  def test_only_adapters_and_the_head_train(self):
    learner = self.learner
    policy_paths = [p for p, _ in nnx.to_flat_state(learner.state.policy.params)]
    self.assertLen(policy_paths, 2 * len(lora.TARGETS))
    self.assertTrue(all(str(p[-2]).endswith('_lora') for p in policy_paths), policy_paths)
    critic_paths = {'/'.join(map(str, p)) for p, _ in nnx.to_flat_state(learner.state.critic.params)}
    self.assertEqual(critic_paths, {'head/kernel', 'head/bias'} | {
        f'backbone/layers/mlp/{lora.suffix(t)}/{ab}' for t in lora.MLP_TARGETS for ab in 'ab'})
    self.assertEmpty(jax.tree.leaves(learner.state.policy.rest))
    self.assertEmpty(jax.tree.leaves(learner.state.critic.rest))
    # AdamW's two moments over the trained leaves, nothing over the base.
    for ts in (learner.state.policy, learner.state.critic):
      self.assertBetween(_size(ts.opt_state), 2 * _size(ts.params), 2 * _size(ts.params) + 8)
    self.assertEqual(self.metrics[-1]['policy/active'], 1.0)
    self.assertGreater(self.metrics[-1]['policy/grad_norm'], 0.0)

  def test_the_base_is_held_once_and_never_changes(self):
    """Policy and critic both run over `learner.base` (the critic's backbone is the policy's base), and no leaf of it
    moves in a step while the adapters do."""
    learner = self.learner
    self.assertEqual(_size(learner.base), H.MODEL.num_params())
    after = H.host(learner.base)
    for a, b in zip(jax.tree.leaves(self.base_before), jax.tree.leaves(after)):
      np.testing.assert_array_equal(a, b)
    moved = [float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(self.adapters_before), jax.tree.leaves(H.host(learner.state.policy.params)))]
    self.assertGreater(max(moved), 1e-4)
    policy, critic = learner.policy_model(), learner.critic_model()
    embed = lambda m: np.asarray(m.embed.embedding[...])
    np.testing.assert_array_equal(embed(critic.backbone), embed(policy))

  def test_checkpoint_holds_adapters_and_resumes_over_the_same_base_only(self):
    learner, config = self.learner, _config()
    with tempfile.TemporaryDirectory() as d:
      config.workdir = d
      with manager.Checkpointer(d, async_save=False) as ckpt:
        contents.save_checkpoint(ckpt, learner, MODEL, config, _Prompts())
        saved = ckpt.restore(None, items=('policy', 'critic'))
      self.assertEqual(_size(saved.policy), _size(learner.state.policy.params))
      self.assertEqual(_size(saved.critic), _size(learner.state.critic.params))

      fresh = _learner()
      with manager.Checkpointer(d, async_save=False) as ckpt:
        self.assertEqual(contents.restore_checkpoint(ckpt, fresh, config, _Prompts(),
                                                     defaults=config_lib.defaults()), 2)
      for got, want in ((fresh.state.policy.params, learner.state.policy.params),
                        (fresh.state.critic.params, learner.state.critic.params),
                        (fresh.state.policy.opt_state, learner.state.policy.opt_state)):
        for a, b in zip(jax.tree.leaves(H.host(got)), jax.tree.leaves(H.host(want))):
          np.testing.assert_array_equal(a, b)

      other = _learner(seed=1)  # Same shapes, another base.
      with manager.Checkpointer(d, async_save=False) as ckpt:
        with self.assertRaisesRegex(ConfigError, 'another base'):
          contents.restore_checkpoint(ckpt, other, config, _Prompts(), defaults=config_lib.defaults())

      # Eval / export: the policy rebuilt from the run's base (the named model of its seed) and the adapters.
      model, cfg = manager.load_policy(d)
      self.assertEqual(cfg, MODEL)
      tokens = H.batch(5).tokens
      np.testing.assert_allclose(model(tokens), learner.policy_model()(tokens), atol=1e-5)

  def test_state_split_own_leaves_the_base_out(self):
    spec = self.learner.policy_spec
    params, rest = state_lib.split_own(spec, self.learner.policy_model())
    self.assertEqual(_size(params), _size(self.learner.state.policy.params))
    self.assertEmpty(jax.tree.leaves(rest))


class LoraKlReferenceTest(absltest.TestCase):

  def test_the_reference_is_the_initial_policy_without_a_copy(self):
    """GRPO with a KL penalty: the reference is the base (the adapters zeroed), so the KL is 0 before the first
    update and grows after; the learner holds no copy of the weights for it (a mutation referencing the current
    adapters keeps the KL at 0)."""
    config = H.config('grpo', **{'model.lora.rank': MODEL.lora_rank, 'algo.kl_coef': 0.1})
    learner = _learner(config=config)
    self.assertEqual(_size(learner.ref_state), _size(learner.state.policy.params))
    kl = [learner.update(H.batch(i, pad_rows=0))['policy/kl_ref'] for i in range(3)]
    self.assertEqual(kl[0], 0.0)
    self.assertGreater(kl[2], 1e-7)


class LoraConfigTest(absltest.TestCase):

  def test_critic_attention_adapters_while_frozen_are_refused(self):
    c = _config(**{'model.lora.critic_targets': ('q_proj', 'up_proj')})
    with self.assertRaisesRegex(ConfigError, 'critic_targets'):
      config_lib.validate(c, log=False)


if __name__ == '__main__':
  absltest.main()
