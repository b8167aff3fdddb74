"""Gradient accumulation (`trainer.microbatch_size`): one optimizer update over microbatches == the whole batch.

Plain SGD (`p <- p - g`) makes the parameter change the gradient itself, so a wrong scale (a microbatch's
own token count or row count in the denominator instead of the minibatch's) shows directly. Rows have very
different action-token counts (and one has none), so local and global denominators differ a lot:
`test_local_denominators_would_be_caught` shows the mean of per-microbatch gradients misses the whole-batch
gradient by orders of magnitude more than the tolerance of the other tests.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.learner import Learner, LearnerConfig, StepConfig
from sao_jax.learner import state as state_lib
from sao_jax.learner import steps
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import value as value_lib
from tests import multiprocess
from tests.learner import helpers as H

# `_update`'s programs compile without XLA:CPU's fusion emitters (as `tests.multiprocess.NO_FUSION_EMITTERS`;
# not under SAO_TEST_XLA_FAST=0): about a third less compile time (the 2 objective tests: 54 s -> 35 s at load 7);
# both sides of every comparison here compile so, and the tolerances are 1e-4 of the largest change.
NO_FUSION_EMITTERS = {'xla_cpu_use_fusion_emitters': False} if multiprocess.fast_compile_flags() else {}

ROWS, T = 8, 16
COUNTS = (13, 1, 8, 2, 12, 1, 13, 0)  # Action tokens per row: heavy even rows, light odd rows, one empty.
REL_TOL = 1e-4  # Of the largest parameter change.


@functools.cache
def _policy():
  return H.policy_fn()()


def _policy_data(seed: int = 0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, H.VOCAB, (ROWS, T)).astype(np.int32)
  mask = np.zeros((ROWS, T), np.float32)
  for b, n in enumerate(COUNTS):
    mask[b, 2:2 + n] = 1
  logp = np.asarray(logprobs_lib.token_logprobs(_policy(), jnp.asarray(tokens)))
  # Behaviour log-probs around the policy's: some ratios inside the band, some cut on either side.
  blp = (logp + rng.uniform(-0.4, 0.4, logp.shape)) * mask
  adv = rng.standard_normal((ROWS, T)).astype(np.float32) * mask
  return {'tokens': jnp.asarray(tokens), 'behavior_logprobs': jnp.asarray(blp, jnp.float32),
          'advantages': jnp.asarray(adv), 'mask': jnp.asarray(mask)}


def _critic_data(seed: int = 1):
  rng = np.random.default_rng(seed)
  d = _policy_data(seed)
  returns = rng.standard_normal((ROWS, T)).astype(np.float32) * np.asarray(d['mask'])
  old = 0.3 * rng.standard_normal((ROWS, T)).astype(np.float32)
  return {'tokens': d['tokens'], 'returns': jnp.asarray(returns), 'mask': d['mask'], 'old_values': jnp.asarray(old)}


def _step_config(**fields) -> StepConfig:
  base = StepConfig.from_config(H.config('sao'))
  return dataclasses.replace(base, **fields)


def _train_state(model):
  mesh = H.mesh(1, 1)
  return state_lib.create_train_state(model, optax.sgd(1.0), mesh, H.config().mesh.rules)


@functools.cache
def _ref():
  """A reference policy for the KL term: the policy with perturbed weights (full `nnx.State`)."""
  graphdef, state = nnx.split(_policy())
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return graphdef, jax.tree.unflatten(treedef, leaves)


def _update(objective_name: str, cfg: StepConfig, data, microbatch_size: int):
  """(parameter change, metrics) of one SGD update with `run_updates`."""
  if objective_name == 'policy':
    spec, ts, _ = _train_state(_policy())
    ref_graphdef, ref = _ref()
    objective = steps.policy_objective(cfg, ref_graphdef)
  else:
    critic = value_lib.ValueModel.from_policy(_policy())
    critic.head.kernel[...] = jnp.linspace(-1.0, 1.0, H.MODEL.embed_dim)  # Non-zero: the backbone trains too.
    spec, ts, _ = _train_state(critic)
    ref, objective = None, steps.critic_objective(cfg)
  before = H.leaves_with_paths(ts.params)

  @jax.jit
  def run(ts, data, ref):
    return steps.run_updates(spec, ts, data, objective, epochs=1, minibatch_size=0, mesh=None,
                             microbatch_size=microbatch_size, extra=ref)

  run = run.lower(ts, data, ref).compile(compiler_options=NO_FUSION_EMITTERS)
  new_ts, metrics = run(ts, data, ref)
  after = H.leaves_with_paths(new_ts.params)
  return {k: after[k] - before[k] for k in before}, {k: float(v) for k, v in metrics.items()}


def _assert_same_update(test, got, want, tol=REL_TOL):
  scale = max(np.abs(v).max() for v in want.values())
  test.assertGreater(scale, 1e-5, 'the parameters did not move: the comparison would be vacuous')
  for k in want:
    np.testing.assert_allclose(got[k], want[k], atol=tol * scale, rtol=0, err_msg=k)


def _assert_same_metrics(test, got, want):
  test.assertEqual(sorted(got), sorted(want))
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=k)


class RowPartsTest(absltest.TestCase):

  def test_join_parts_inverts_take_minibatch(self):
    x = jnp.arange(8 * 3).reshape(8, 3)
    parts = jnp.stack([steps.take_minibatch(x, jnp.int32(i), 4, None) for i in range(4)])
    np.testing.assert_array_equal(parts[1][:, 0], [3, 15])  # Part 1 = rows 1 and 5 (interleaved).
    np.testing.assert_array_equal(steps.join_parts(parts, None), x)
    got = steps.map_rows(lambda r: r * 2 + r[:, :1], x, 4, None)  # Row-wise: equals fn on the whole.
    np.testing.assert_array_equal(got, x * 2 + x[:, :1])
    self.assertEqual(steps.num_microbatches(8, 0), 1)
    self.assertEqual(steps.num_microbatches(8, 2), 4)
    with self.assertRaisesRegex(ValueError, 'microbatch_size=3'):
      steps.num_microbatches(8, 3)


class ObjectiveAccumulationTest(parameterized.TestCase):
  """`run_updates` with microbatches of 4 and 2 rows (2 and 4 microbatches) == all 8 rows at once."""

  def _assert_microbatches_match(self, kind, cfg, data):
    """Microbatches of 4 and 2 rows give the whole minibatch's update and metrics; returns the metrics."""
    want, want_m = _update(kind, cfg, data, 0)
    for size in (4, 2):
      got, got_m = _update(kind, cfg, data, size)
      _assert_same_update(self, got, want)
      _assert_same_metrics(self, got_m, want_m)
    return want_m

  @parameterized.named_parameters(
      ('token_mean', 'double_side', 'token_mean'),
      ('seq_mean_token_mean', 'double_side', 'seq_mean_token_mean'),
      ('seq_mean_token_sum', 'double_side', 'seq_mean_token_sum'),
      ('gspo_seq_mean_token_mean', 'gspo', 'seq_mean_token_mean'),
  )
  def test_policy(self, clip_mode, agg):
    # Entropy bonus and KL penalty are token means: with a row-mean `agg` they weigh differently.
    cfg = _step_config(clip_mode=clip_mode, agg=agg, eps_low=0.2, eps_high=0.2, entropy_coef=0.3,
                       kl_coef=0.5)
    want_m = self._assert_microbatches_match('policy', cfg, _policy_data())
    self.assertIn('kl_ref', want_m)
    self.assertGreater(want_m['clip_frac_low'] + want_m['clip_frac_high'], 0.0)  # The band cuts tokens.

  def test_critic_with_value_clipping(self):
    cfg = _step_config(value_clip_eps=0.2)
    want_m = self._assert_microbatches_match('critic', cfg, _critic_data())
    self.assertGreater(want_m['value_clip_frac'], 0.0)

  def test_local_denominators_would_be_caught(self):
    """The mean of each microbatch's own token-mean gradient (local denominators) is far from the batch's."""
    cfg = _step_config(agg='token_mean')
    data = _policy_data()
    want, _ = _update('policy', cfg, data, 0)
    scale = max(np.abs(v).max() for v in want.values())
    halves = [_update('policy', cfg, jax.tree.map(lambda x, i=i: x[i::2], data), 0)[0] for i in range(2)]
    naive = {k: (halves[0][k] + halves[1][k]) / 2 for k in want}
    miss = max(np.abs(naive[k] - want[k]).max() for k in want)
    self.assertGreater(miss, 100 * REL_TOL * scale)


@functools.cache
def _learner_update(algo: str, microbatch_size: int, minibatch_size: int = 4, mesh_shape=(1, 1)):
  """Params (policy, critic) and metrics after one learner step with SGD, past any warmup."""
  overrides = {'trainer.microbatch_size': microbatch_size, 'optim.optimizer': 'sgd', 'optim.grad_clip': 0.0,
               'optim.actor_lr': 0.05, 'optim.critic_lr': 0.05}
  if algo == 'sao':
    overrides.update({'trainer.minibatch_size': minibatch_size, 'algo.critic_warmup_steps': 0,
                      'algo.entropy_coef': 0.1})
  learner = Learner(LearnerConfig.from_config(H.config(algo, **overrides)), policy=_policy(), mesh=H.mesh(*mesh_shape),
                    model_config=H.MODEL)
  batch = H.batch(0, pad_rows=1 if algo == 'sao' else 2)
  am = np.array(batch.action_mask)
  for b, keep in enumerate((5, 0, 3, 1, 5, 0, 4, 2)):  # 3 to 8 action tokens per row.
    am[b, 4 + keep:9] = 0
  batch = batch.replace(action_mask=am, behavior_logprobs=batch.behavior_logprobs * am)
  before = {k: H.leaves_with_paths(getattr(learner.state, k).params)
            for k in ('policy', 'critic') if getattr(learner.state, k) is not None}
  metrics = learner.update(batch)
  deltas = {}
  for name, b in before.items():
    after = H.leaves_with_paths(getattr(learner.state, name).params)
    deltas[name] = {k: after[k] - b[k] for k in b}
  return deltas, {k: v for k, v in metrics.items() if not k.startswith('perf/')}


class LearnerAccumulationTest(parameterized.TestCase):
  """The SAO step (K=2 critic epochs over 2 minibatches, then the policy) and the GRPO step."""

  @parameterized.named_parameters(('sao', 'sao', 4), ('grpo', 'grpo', 8))
  def test_microbatches_equal_whole_minibatch(self, algo, minibatch_rows):
    want, want_m = _learner_update(algo, 0)
    self.assertEqual(sorted(want), ['critic', 'policy'] if algo == 'sao' else ['policy'])
    for size in (minibatch_rows // 2, minibatch_rows // 4):
      got, got_m = _learner_update(algo, size)
      for name in want:
        _assert_same_update(self, got[name], want[name], tol=1e-3)
      _assert_same_metrics(self, got_m, want_m)

  def test_sharded_microbatches_equal_single_device_whole_batch(self):
    """Rows over fsdp=4 (x tensor=2): 2 microbatches of 4 rows, one per device each, critic forwards included."""
    want, want_m = _learner_update('sao', 0, 0)
    got, got_m = _learner_update('sao', 4, 0, (4, 2))
    for name in want:
      _assert_same_update(self, got[name], want[name], tol=1e-3)
    _assert_same_metrics(self, got_m, want_m)


if __name__ == '__main__':
  absltest.main()
