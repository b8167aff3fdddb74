"""Learner tests: sharded == single device (SAO, GRPO), frozen critic attention, critic warmup and K critic
updates, NaN guard, overfitting sanity, and a 2-process `jax.distributed` run.

Compiling an update step dominates the runtime, so each learner is built once per module (`_runs`) and
several tests read the same run.
"""

import functools
import json
import os
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.errors import ConfigError
from sao_jax.learner import Learner, LearnerConfig, NonFiniteUpdateError, StepConfig
from sao_jax.learner import algo as algo_lib
from sao_jax.learner import optim as optim_lib
from sao_jax.learner import state as state_lib
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import value as value_lib
from tests import multiprocess
from tests.learner import helpers as H

SAO_OVERRIDES = H.SAO_OVERRIDES
GRPO_OVERRIDES = {}


@functools.cache
def _policy():
  """One eagerly built policy module shared by every learner (the learners copy it)."""
  return H.policy_fn()()


def _snapshot(learner):
  out = {'policy': H.leaves_with_paths(learner.state.policy.params), 'step': learner.step,
         'policy_step': int(H.host(learner.state.policy.step))}
  if learner.state.critic is not None:
    out['critic'] = H.leaves_with_paths(learner.state.critic.params)
    out['critic_rest'] = H.leaves_with_paths(learner.state.critic.rest)
    out['critic_step'] = int(H.host(learner.state.critic.step))
  return out


@functools.cache
def _runs(algo: str, mesh_shape: tuple[int, int]):
  """Builds a learner on a (fsdp, tensor) mesh and runs two steps on batches 0 and 1; returns snapshots."""
  overrides = SAO_OVERRIDES if algo == 'sao' else GRPO_OVERRIDES
  learner = Learner(LearnerConfig.from_config(H.config(algo, **overrides)), policy=_policy(), mesh=H.mesh(*mesh_shape),
                    model_config=H.MODEL)
  snaps = [_snapshot(learner)]
  metrics = []
  for i in range(2):
    metrics.append(learner.update(H.batch(i, pad_rows=1 if algo == 'sao' else 2)))
    snaps.append(_snapshot(learner))
  return learner, snaps, metrics


def _assert_trees_close(test, a, b, atol, rtol=1e-4):
  test.assertEqual(sorted(a), sorted(b))
  for k in a:
    np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=rtol, err_msg=k)


def _comparable_metrics(m):
  return {k: v for k, v in m.items() if not k.startswith('perf/')}


class ShardedMatchesSingleDeviceTest(parameterized.TestCase):

  @parameterized.parameters('sao', 'grpo')
  def test_fsdp_x_tensor_equals_one_device(self, algo):
    _, one, m_one = _runs(algo, (1, 1))
    learner8, eight, m_eight = _runs(algo, (4, 2))
    # The 8-device run really is sharded: an MLP kernel is split over fsdp x tensor.
    kernel = learner8.state.policy.params['layers']['mlp']['up_proj'].get_value()
    self.assertEqual(kernel.sharding.spec, jax.sharding.PartitionSpec(None, 'fsdp', 'tensor'))
    self.assertLess(kernel.addressable_shards[0].data.size, kernel.size)
    for name in ('policy', 'critic') if algo == 'sao' else ('policy',):
      _assert_trees_close(self, one[-1][name], eight[-1][name], atol=2e-6)
      moved = max(np.abs(one[-1][name][k] - one[0][name][k]).max() for k in one[0][name])
      self.assertGreater(moved, 1e-4, f'{name} did not move: the comparison would be vacuous')
    for a, b in zip(m_one, m_eight):
      a, b = _comparable_metrics(a), _comparable_metrics(b)
      self.assertEqual(sorted(a), sorted(b))
      for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, rtol=1e-4, err_msg=k)

  def test_metrics_present(self):
    _, _, metrics = _runs('sao', (1, 1))
    for key in ('critic/loss', 'critic/grad_norm', 'critic/value_mean', 'critic/explained_variance_before',
                'policy/loss', 'policy/grad_norm', 'policy/clip_frac_low', 'policy/clip_frac_high',
                'policy/ratio_mean', 'policy/approx_kl', 'policy/entropy', 'adv/mean', 'adv/std',
                'perf/tokens_per_s', 'batch/action_tokens'):
      self.assertIn(key, metrics[1])
      self.assertTrue(np.isfinite(metrics[1][key]), key)
    # Row 7 is padding and row 1 is truncated: 7 rows x 8 action tokens count.
    self.assertEqual(metrics[1]['batch/action_tokens'], 56.0)
    self.assertGreater(metrics[1]['policy/grad_norm'], 0.0)


class CompileAheadTest(absltest.TestCase):

  def test_compiled_update_is_used_and_matches_the_jitted_one(self):
    _, snaps, metrics = _runs('sao', (1, 1))  # The reference: the jitted update, compiled at its first call.
    learner = Learner(LearnerConfig.from_config(H.config('sao', **SAO_OVERRIDES)), policy=_policy(), mesh=H.mesh(1, 1),
                      model_config=H.MODEL)
    learner.compile_update(H.B, (H.T,))

    def no_compile(*args):
      raise AssertionError(f'the jitted update ran (it would compile) for a batch of {args[1].tokens.shape}')

    learner._step_fn = no_compile  # pylint: disable=protected-access
    for i in range(2):
      m = learner.update(H.batch(i, pad_rows=1))
      _assert_trees_close(self, _snapshot(learner)['policy'], snaps[i + 1]['policy'], atol=0, rtol=0)
      self.assertEqual(_comparable_metrics(m), _comparable_metrics(metrics[i]))
    with self.assertRaisesRegex(AssertionError, r'the jitted update ran .* \(8, 24\)'):
      learner.update(H.batch(0, length=24))  # A length not compiled ahead falls back to jit.


class HyperparametersAreInputsTest(absltest.TestCase):
  """The step's numbers (`StepConfig.hparams`, `optim.OptimHParams`) are inputs of the compiled update: a config
  that changes only numbers runs the same program (one compile, or a persistent-cache hit), fed its values."""

  # Every number the update reads, changed; the constant schedule becomes a warmed-up cosine.
  OTHER = {'algo.eps_low': 0.25, 'algo.eps_high': 4.0, 'algo.gamma': 0.99, 'algo.lam_critic': 0.9,
           'algo.adaptive_alpha': 2.0, 'algo.critic_warmup_steps': 0, 'algo.entropy_coef': 0.0,
           'optim.actor_lr': 3e-3, 'optim.critic_lr': 2e-3, 'optim.schedule': 'cosine', 'optim.total_steps': 7,
           'optim.warmup_steps': 2, 'optim.end_lr_factor': 0.3, 'optim.b1': 0.8, 'optim.b2': 0.99,
           'optim.eps': 1e-6, 'optim.weight_decay': 0.01, 'optim.grad_clip': 0.5}

  def _learner(self, **overrides):
    return Learner(LearnerConfig.from_config(H.config('sao', **SAO_OVERRIDES, **overrides)), policy=_policy(),
                   mesh=H.mesh(1, 1),
                   model_config=H.MODEL)

  def _program(self, learner):
    batch = learner.put_batch(H.batch(0, pad_rows=1))
    step_fn = learner._step_fn  # pylint: disable=protected-access
    return step_fn.lower(learner.state, batch, learner.ref_state, learner.hparams, learner.base).as_text()

  def test_numbers_change_no_program_and_drive_the_update(self):
    _, snaps, _ = _runs('sao', (1, 1))  # The reference config's two updates.
    ref, other = self._learner(), self._learner(**self.OTHER)
    self.assertEqual(self._program(other), self._program(ref))
    # A structural setting does change the program (the comparison sees a change).
    self.assertNotEqual(self._program(self._learner(**{'algo.clip_mode': 'ppo'})), self._program(ref))
    # Its own numbers move the weights elsewhere than the reference's ...
    moved = self._learner(**self.OTHER)
    moved.update(H.batch(0, pad_rows=1))
    got, want = _snapshot(moved)['policy'], snaps[1]['policy']
    self.assertGreater(max(np.max(np.abs(got[k] - want[k])) for k in want), 1e-4)
    # ... and fed the reference's numbers, the same program makes the reference's updates exactly.
    other.hparams = ref.hparams
    for i in range(2):
      other.update(H.batch(i, pad_rows=1))
      _assert_trees_close(self, _snapshot(other)['policy'], snaps[i + 1]['policy'], atol=0, rtol=0)
      _assert_trees_close(self, _snapshot(other)['critic'], snaps[i + 1]['critic'], atol=0, rtol=0)


class SaoStructureTest(absltest.TestCase):

  def test_critic_warmup_and_k_critic_updates(self):
    _, snaps, metrics = _runs('sao', (4, 2))
    per_step = 2 * 2  # critic_epochs K=2 passes x 2 minibatches of 4 rows.
    # Step 0 is critic-only: the policy is bit-identical, the critic moved K x minibatches times.
    self.assertEqual(metrics[0]['policy/active'], 0.0)
    for k, v in snaps[0]['policy'].items():
      np.testing.assert_array_equal(v, snaps[1]['policy'][k], err_msg=k)
    self.assertEqual(snaps[1]['policy_step'], 0)
    self.assertEqual(snaps[1]['critic_step'], per_step)
    self.assertEqual(snaps[1]['step'], 1)  # The learner step still advances during warmup.
    # Step 1: the policy takes its (2 minibatch) updates.
    self.assertEqual(metrics[1]['policy/active'], 1.0)
    self.assertEqual(snaps[2]['policy_step'], 2)
    self.assertEqual(snaps[2]['critic_step'], 2 * per_step)
    self.assertTrue(any(np.any(snaps[1]['policy'][k] != snaps[2]['policy'][k]) for k in snaps[1]['policy']))

  def test_frozen_attention(self):
    learner, snaps, _ = _runs('sao', (4, 2))
    # Frozen attention weights live in `rest`, unchanged bit for bit; the trainable part has none.
    attn = {k: v for k, v in snaps[0]['critic_rest'].items() if "['attn']" in k}
    self.assertLen(attn, 4)  # q, k, v, o projections.
    for k, v in attn.items():
      np.testing.assert_array_equal(v, snaps[-1]['critic_rest'][k], err_msg=k)
    self.assertFalse([k for k in snaps[0]['critic'] if "['attn']" in k])
    for k in snaps[0]['critic']:
      if k.startswith("['head']") or 'mlp' in k or 'embed' in k:
        self.assertTrue(np.any(snaps[0]['critic'][k] != snaps[-1]['critic'][k]), f'{k} did not move')
    # The critic's attention equals the policy's initial attention (ValueModel.from_policy copies it).
    policy0 = snaps[0]['policy']
    for k, v in attn.items():
      np.testing.assert_array_equal(v, policy0[k.replace("['backbone']", '')])
    # No optimizer state for frozen leaves: every param-shaped optax leaf is a trainable leaf.
    opt_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_leaves_with_path(learner.state.critic.opt_state)]
    self.assertTrue(opt_paths)
    self.assertFalse([p for p in opt_paths if "['attn']" in p])
    mu = learner.state.critic.opt_state[1][0].mu
    self.assertEqual(state_lib.num_elements(mu), state_lib.num_elements(learner.state.critic.params))

  def test_unfrozen_critic_trains_attention(self):
    config = H.config('sao')
    config.optim.freeze_critic_attention = False
    critic = value_lib.ValueModel.from_policy(_policy())
    mesh = H.mesh(1, 1)
    tx = optim_lib.make_optimizer(config.optim, 1e-3)
    from sao_jax.learner.learner import critic_trainable  # pylint: disable=g-import-not-at-top
    spec, state, _ = state_lib.create_train_state(critic, tx, mesh, config.mesh.rules,
                                                  trainable=critic_trainable(False))
    self.assertIn('attn', state.params['backbone']['layers'])
    self.assertFalse([p for p, _ in jax.tree_util.tree_leaves_with_path(state.rest)
                      if "['attn']" in jax.tree_util.keystr(p)])
    mu = state.opt_state[1][0].mu
    self.assertIn('attn', mu['backbone']['layers'])
    del spec

  def test_nan_batch_is_skipped_then_stops_the_run(self):
    learner, _, _ = _runs('sao', (4, 2))
    before = _snapshot(learner)
    bad = H.batch(2)
    bad = bad.replace(rewards=np.where(bad.action_mask > 0, np.nan, 0.0).astype(np.float32))
    metrics = learner.update(bad)
    after = _snapshot(learner)
    for name in ('policy', 'critic'):
      for k, v in before[name].items():
        np.testing.assert_array_equal(v, after[name][k], err_msg=k)
    self.assertEqual(metrics['critic/skipped'], 4.0)
    self.assertEqual(metrics['policy/skipped'], 2.0)
    self.assertEqual(after['critic_step'], before['critic_step'])
    self.assertEqual(int(H.host(learner.state.critic.consecutive_skips)), 4)
    self.assertEqual(int(H.host(learner.state.critic.skipped)), 4)
    # A good batch resets the consecutive counters.
    learner.update(H.batch(3))
    self.assertEqual(int(H.host(learner.state.critic.consecutive_skips)), 0)
    self.assertEqual(int(H.host(learner.state.policy.skipped)), 2)
    # config.optim.max_consecutive_skips=5: two bad batches in a row (8 critic skips) stop the run.
    learner.update(bad)
    with self.assertRaisesRegex(NonFiniteUpdateError, 'max_consecutive_skips=5'):
      learner.update(bad)


class OverfitTest(absltest.TestCase):

  def test_good_action_probability_rises(self):
    learner, _, _ = _runs('sao', (1, 1))  # Past its critic warmup.
    rows, length, good, bad = H.B, H.T, 5, 7
    tokens = np.zeros((rows, length), np.int32)
    tokens[:, :8] = np.arange(10, 18)
    tokens[:, 8] = np.where(np.arange(rows) % 2 == 0, good, bad)
    action = np.zeros((rows, length), np.float32)
    action[:, 8] = 1
    rewards = np.where(tokens == good, 1.0, 0.0).astype(np.float32) * action
    graphdef = learner.policy_spec.graphdef

    @jax.jit
    def logp(params, rest, toks):
      return logprobs_lib.token_logprobs(nnx.merge(graphdef, params, rest), toks)

    def current():
      return np.asarray(logp(learner.state.policy.params, learner.state.policy.rest, tokens))

    p0 = np.exp(current()[0, 8])
    for _ in range(12):
      blp = current() * action  # On-policy behaviour log-probs, the same fixed batch every step.
      batch = H.whole_rows(H.batch(0).replace(tokens=tokens, action_mask=action, behavior_logprobs=blp,
                                              rewards=rewards))
      learner.update(batch)
    p1 = np.exp(current()[0, 8])
    self.assertGreater(p1, 3 * p0, f'pi(good) went {p0:.4f} -> {p1:.4f}')


class GroupLayoutTest(absltest.TestCase):

  def test_groups_must_be_whole(self):
    learner, _, _ = _runs('grpo', (1, 1))
    b = H.batch(0, pad_rows=0)
    learner.put_batch(b.replace(group_ids=np.array([0, 1, 0, 1, 2, 2, 3, 3], np.int32)[:, None]))  # Any order.
    with self.assertRaisesRegex(ValueError, 'group id 0 has 3 trajectories'):
      learner.put_batch(b.replace(group_ids=np.array([0, 1, 0, 0, 2, 2, 3, 3], np.int32)[:, None]))

  def test_algorithm_names_select_their_preset(self):
    c = H.config('gspo')  # Sets clip_mode='ppo': an ablation of gspo, recorded (config_lib_test pins presets).
    self.assertIn("algo.clip_mode: 'gspo' -> 'ppo'", algo_lib.resolve(c)[1])
    c.algo.clip_mode = None  # The preset's value.
    cfg = StepConfig.from_config(c)
    self.assertEqual(cfg.clip_mode, 'gspo')
    self.assertFalse(cfg.uses_critic)
    c.algo.group_size = 1
    with self.assertRaisesRegex(ConfigError, 'config.algo.group_size=1'):
      StepConfig.from_config(c)


class GroupAdvantagesTest(parameterized.TestCase):
  """The GRPO family's advantages from `config.algo` (pure, no model)."""

  @parameterized.named_parameters(
      ('grpo', 'grpo', {}, [0.5 / np.sqrt(0.5), -0.5 / np.sqrt(0.5)]),  # std with Bessel's correction.
      ('dr_grpo', 'dr_grpo', {'algo.group_std_normalize': False, 'algo.agg': 'seq_mean_token_sum'},
       [0.5, -0.5]),
      ('rloo', 'rloo', {'algo.group_baseline': 'leave_one_out'}, [1.0, -1.0]),
  )
  def test_group_advantages(self, algo, overrides, first_group):
    from sao_jax.learner import steps  # pylint: disable=g-import-not-at-top
    cfg = StepConfig.from_config(H.config(algo, **overrides))
    rewards = jnp.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 3.0, 1.0])
    adv = np.asarray(steps.group_advantages(cfg, rewards, jnp.arange(8) // 2, jnp.ones(8)))
    np.testing.assert_allclose(adv[:2], first_group, rtol=1e-4)
    np.testing.assert_allclose(adv[2:6], 0.0, atol=1e-6)  # Groups with equal rewards get exactly 0.
    self.assertGreater(adv[6], 0.0)


class StepPartsTest(absltest.TestCase):
  """Pieces of the step, without compiling a whole update."""

  def test_critic_values_alignment(self):
    from sao_jax.learner import steps  # pylint: disable=g-import-not-at-top
    critic = value_lib.ValueModel.from_policy(_policy())
    critic.head.kernel.value = jnp.linspace(-1.0, 1.0, H.MODEL.embed_dim)  # A non-zero head.
    tokens = jnp.asarray(H.batch(0).tokens)
    values, next_values = steps.critic_values(critic, tokens)
    np.testing.assert_allclose(values, critic(tokens), atol=1e-6)
    np.testing.assert_allclose(values[:, 1:], next_values[:, :-1], atol=1e-6)
    self.assertTrue(np.all(np.asarray(values[:, 0]) == 0.0))

  def test_interleaved_minibatches_cover_the_batch(self):
    from sao_jax.learner import steps  # pylint: disable=g-import-not-at-top
    x = jnp.arange(8 * 3).reshape(8, 3)
    parts = [np.asarray(steps.take_minibatch(x, jnp.int32(i), 2, None)) for i in range(2)]
    np.testing.assert_array_equal(parts[0][:, 0], [0, 6, 12, 18])  # Rows 0, 2, 4, 6.
    np.testing.assert_array_equal(np.sort(np.concatenate(parts).ravel()), np.arange(24))
    self.assertEqual(steps.num_minibatches(8, 0), 1)
    with self.assertRaisesRegex(ValueError, 'minibatch_size=3'):
      steps.num_minibatches(8, 3)

  def test_guarded_apply(self):
    from sao_jax.learner import steps  # pylint: disable=g-import-not-at-top
    tx = optim_lib.make_optimizer(H.config().optim, 0.1)
    params = {'w': jnp.ones(3)}
    ts = state_lib.TrainState(params, {}, tx.init(params), jnp.int32(0), jnp.int32(0), jnp.int32(0))
    spec = state_lib.ModelSpec(None, tx, None)
    ts1, m1 = steps.guarded_apply(spec, ts, {'w': jnp.array([1.0, jnp.nan, 0.0])}, jnp.float32(1.0))
    np.testing.assert_array_equal(ts1.params['w'], params['w'])
    self.assertEqual((int(ts1.step), int(ts1.skipped), int(ts1.consecutive_skips)), (0, 1, 1))
    self.assertEqual(float(m1['skipped']), 1.0)
    ts2, _ = steps.guarded_apply(spec, ts1, {'w': jnp.ones(3)}, jnp.float32(jnp.inf))
    self.assertEqual(int(ts2.consecutive_skips), 2)
    ts3, m3 = steps.guarded_apply(spec, ts2, {'w': jnp.ones(3)}, jnp.float32(1.0))
    self.assertEqual((int(ts3.step), int(ts3.skipped), int(ts3.consecutive_skips)), (1, 2, 0))
    self.assertTrue(np.all(np.asarray(ts3.params['w']) < 1.0))
    self.assertAlmostEqual(float(m3['grad_norm']), np.sqrt(3.0), places=5)

  def test_schedule(self):
    c = H.config()
    c.optim.warmup_steps, c.optim.schedule, c.optim.total_steps, c.optim.end_lr_factor = 4, 'cosine', 14, 0.1
    lr = optim_lib.make_schedule(c.optim, 1.0)
    np.testing.assert_allclose([lr(0), lr(2), lr(4), lr(9), lr(14), lr(100)], [0, 0.5, 1, 0.55, 0.1, 0.1],
                               atol=1e-6)
    c.optim.total_steps = 4
    with self.assertRaisesRegex(ConfigError, 'config.optim.total_steps=4'):
      optim_lib.make_schedule(c.optim, 1.0)

  def test_whole_run_horizons(self):
    # total_steps = 0: each optimizer decays over its own updates in the run. SAO, 20 learner steps, critic-only
    # warmup 3, K=2, batch 8 in minibatches of 4 (M=2): policy (20 - 3) * 1 * 2 = 34, critic 20 * 2 * 2 = 80.
    c = H.config(**{'trainer.num_steps': 20, 'algo.critic_warmup_steps': 3, 'trainer.minibatch_size': 4,
                    'optim.schedule': 'cosine', 'optim.total_steps': 0, 'optim.end_lr_factor': 0.1})
    self.assertEqual(optim_lib.optimizer_horizons(c), (34, 80))
    g = H.config('grpo', **{'trainer.num_steps': 20, 'trainer.policy_epochs': 2})
    self.assertEqual(optim_lib.optimizer_horizons(g), (40, 0))  # 20 * 2 epochs * M=1; no critic.
    lr = optim_lib.make_schedule(c.optim, 1.0, 34)
    np.testing.assert_allclose([lr(0), lr(17), lr(34), lr(80)], [1, 0.55, 0.1, 0.1], atol=1e-6)
    with self.assertRaisesRegex(ConfigError, 'total_steps=0'):
      optim_lib.make_schedule(c.optim, 1.0)  # No horizon to decay over.
    # The learner hands each optimizer its own horizon (policy 34, critic 80), not the other's or none: the
    # hyperparameters its update runs with (`Learner.hparams`) and builds its optimizer states from.
    seen = []
    def spy(o, lr, run_steps=None):
      seen.append((lr, run_steps))
      return optim_hparams(o, lr, run_steps)
    optim_hparams = optim_lib.optim_hparams
    c.optim.actor_lr, c.optim.critic_lr = 1e-3, 2e-3
    with mock.patch.object(optim_lib, 'optim_hparams', spy):
      Learner(LearnerConfig.from_config(c), policy=H.policy_fn(), mesh=H.mesh(1, 1))
    self.assertEqual(seen, [(1e-3, 34), (2e-3, 80)])
    c.trainer.num_steps = 2  # 2 critic-only steps of a 3-step warmup: no decay phase for a 5-step LR warmup.
    c.optim.warmup_steps = 5
    with self.assertRaisesRegex(ConfigError, r'total_steps=0: the policy makes 2 optimizer updates'):
      optim_lib.check_config(c)


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_match_single_process(self):
    with tempfile.TemporaryDirectory() as out:
      multiprocess.run_two_processes(self, 'tests.learner.mp_worker', out, timeout_s=420)
      result = dict(np.load(os.path.join(out, 'params.npz')))
      with open(os.path.join(out, 'metrics.json')) as f:
        metrics = json.load(f)
    self.assertEqual(metrics['devices'], 4)
    self.assertEqual(metrics['processes'], 2)
    _, one, m_one = _runs('sao', (1, 1))
    for name in ('policy', 'critic'):
      got = {k[len(name) + 1:]: v for k, v in result.items() if k.startswith(name + ':')}
      _assert_trees_close(self, one[2][name], got, atol=2e-6)
    for k, v in _comparable_metrics(m_one[1]).items():
      np.testing.assert_allclose(metrics['step1'][k], v, atol=1e-5, rtol=1e-4, err_msg=k)


if __name__ == '__main__':
  absltest.main()
