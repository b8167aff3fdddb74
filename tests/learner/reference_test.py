"""One learner step (SAO, GRPO) against the independent reference of `tests/learner/reference.py`.

The learner runs ONE step with plain SGD (`p <- p - lr g`, so the parameter change is linear in the
gradient), no gradient clipping, no warmup, the whole batch as one minibatch; the reference computes the
same step from DESIGN's formulas (float64 loops for returns, advantages, ratios and weights; its own losses
and `jax.grad` on the same model classes). The parameters after the step (policy and critic) must agree to
float32 noise. `WrongVariantsTest` shows that every known-wrong algorithm (advantages from the pre-update
critic, lambda_policy = 1, bootstrap from the value before the last token, ratio to the current policy,
token mean over kept tokens only, values misaligned by one; GRPO without std normalisation, with a
leave-one-out baseline, with a mean of row means) lands orders of magnitude farther from the learner than
the tolerance, so the reference test fails on each of them. A closed band (`<=` instead of `<`) differs only
for ratios exactly on an edge, which a real forward pass never hits: `tests/losses/policy_test.py` pins it.

Every setting the step depends on is set explicitly below, so presets of `algo.name` cannot change it.
"""

import dataclasses
import functools

import jax
import numpy as np
from absl import logging
from absl.testing import absltest
from flax import nnx

from configs import base
from sao_jax.learner import Learner, LearnerConfig
from sao_jax.models import Decoder
from sao_jax.models import lora
from sao_jax.models import value as value_lib
from sao_jax.structs import Batch
from tests.learner import helpers as H
from tests.learner import reference as ref

# Learning rates large enough that one step moves parameters by ~1e-2 (float32 noise is ~1e-7).
SAO = ref.Settings(actor_lr=1.0, critic_lr=0.5, eps_low=0.3, eps_high=1.0, gamma=1.0, alpha=1.5,
                   critic_epochs=2)
GRPO = ref.Settings(actor_lr=1.0, critic_lr=0.0, eps_low=0.2, eps_high=0.28, group_size=4)
# Max |param difference| allowed between the learner and the reference (float32 noise: ~1e-7 measured).
ATOL = 2e-6
# A wrong variant must land at least this many tolerances away.
MARGIN = 100.0
# Ratios of the out-of-band tokens (clearly outside (1 - eps_low, 1 + eps_high) for both algorithms).
R_LOW, R_HIGH = 0.35, 3.5

SEGMENTS_SAO = (  # Per row: (kind, length) with kind 'p'rompt, 'a'ction, 'o'bservation; the rest is padding.
    (('p', 3), ('a', 6), ('o', 3), ('a', 4)),
    (('p', 4), ('a', 5)),
    (('p', 2), ('a', 3), ('o', 2), ('a', 3), ('o', 4), ('a', 5)),
    (('p', 3), ('a', 4), ('o', 2), ('a', 12)),  # Truncated: its last real token is an action token.
    (('p', 3), ('a', 15)),
    (('p', 4), ('a', 4), ('o', 5), ('a', 3)),
    (('p', 2), ('a', 3), ('o', 3), ('a', 16)),  # Truncated, filling all T positions.
    (('p', 2), ('a', 8)),  # A padding row (row_mask 0) with junk in it.
)
SAO_REWARDS = (1.0, -0.5, 0.7, 0.0, 1.5, 0.25, 0.0, 5.0)
SAO_TRUNCATED = (3, 6)
SAO_PADDING_ROW = 7

SEGMENTS_GRPO = (
    (('p', 3), ('a', 6), ('o', 3), ('a', 4)),
    (('p', 3), ('a', 9)),
    (('p', 3), ('a', 2), ('o', 2), ('a', 5), ('o', 1), ('a', 3)),
    (('p', 3), ('a', 14)),
    (('p', 5), ('a', 4)),
    (('p', 5), ('a', 7), ('o', 4), ('a', 2)),
    (('p', 5), ('a', 12)),
    (('p', 5), ('a', 3), ('o', 2), ('a', 6)),
)
GRPO_REWARDS = (1.0, 0.0, 0.5, 1.0, 0.0, 2.0, -1.0, 0.3)
T = 24


def _config(algo: str, s: ref.Settings, rows: int, gae_over: str = 'actions', truncation: str = 'bootstrap'):
  """The learner config with every field the step depends on set explicitly."""
  c = base.get_config()
  a, o, tr = c.algo, c.optim, c.trainer
  a.name = algo
  a.eps_low, a.eps_high = s.eps_low, s.eps_high
  a.agg = 'token_mean'
  a.whiten_advantages = False
  a.behavior_correction = 'none'
  a.kl_coef = 0.0
  a.entropy_coef = 0.0
  a.gamma = s.gamma
  if algo == 'sao':
    a.clip_mode = 'double_side'
    a.lam_policy = -1.0
    a.adaptive_alpha = s.alpha
    a.lam_critic = 1.0
    a.critic_epochs = s.critic_epochs
    a.critic_warmup_steps = 0
    a.advantages_from = 'updated_critic'
    a.value_clip_eps = 0.0
    a.truncation = truncation
    a.gae_over = gae_over
    a.group_size = 1
  else:
    a.clip_mode = 'ppo'
    a.group_size = s.group_size
    a.group_std_normalize = True
    a.group_baseline = 'mean'
    a.dynamic_sampling = False
  o.optimizer = 'sgd'
  o.actor_lr, o.critic_lr = s.actor_lr, s.critic_lr
  o.grad_clip = 0.0
  o.weight_decay = 0.0
  o.schedule = 'constant'
  o.warmup_steps = 0
  o.freeze_critic_attention = True
  tr.batch_size = rows
  tr.minibatch_size = 0
  tr.microbatch_size = 0
  tr.policy_epochs = 1
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 1, 1
  c.sampler.temperature = s.temperature
  return c


def _layout(segments, rewards, seed):
  """tokens, action mask, real-token mask, rewards (on each row's last action token) of a right-padded batch."""
  rng = np.random.default_rng(seed)
  rows = len(segments)
  tokens = np.zeros((rows, T), np.int32)
  action = np.zeros((rows, T), np.float32)
  real = np.zeros((rows, T), bool)
  reward = np.zeros((rows, T), np.float32)
  for b, segs in enumerate(segments):
    t = 0
    for kind, n in segs:
      tokens[b, t:t + n] = rng.integers(3, H.VOCAB, n)
      action[b, t:t + n] = kind == 'a'
      t += n
    real[b, :t] = True
    reward[b, np.flatnonzero(action[b])[-1]] = rewards[b]
  return tokens, action, real, reward


def _behavior(logp, action, seed):
  """Behaviour log-probs: about 60% of the action tokens in the band (ratio within e^{+-0.15}), 20% with
  ratio R_LOW and 20% with ratio R_HIGH, so both sides of the band are cut."""
  rng = np.random.default_rng(seed + 100)
  u = rng.random(logp.shape)
  log_r = np.where(u < 0.2, np.log(R_LOW), np.where(u < 0.4, np.log(R_HIGH), rng.uniform(-0.15, 0.15, u.shape)))
  return ((logp - log_r) * action).astype(np.float32)


def _initial_logprobs(policy, tokens, temperature=1.0):
  graphdef, params, rest = nnx.split(policy, nnx.Param, ...)
  return np.asarray(ref.token_logprobs(graphdef, params, rest, tokens, np.float32(temperature)), np.float64)


def _dist(a: dict, b: dict) -> float:
  assert sorted(a) == sorted(b), (sorted(a), sorted(b))
  return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


@dataclasses.dataclass(frozen=True)
class Run:
  """One learner step: the models and batch it started from, and the parameters before and after it."""
  policy: nnx.Module
  critic: nnx.Module | None
  batch: Batch
  real: np.ndarray  # [B, T] non-padding tokens.
  before: dict  # 'policy', 'critic', 'critic_rest': {path: array}.
  after: dict


def _flat_model(model, trained):
  _, params, rest = nnx.split(model, trained, ...)
  return ref.flat(params), ref.flat(rest)


def _run_learner(algo, settings, policy, critic, batch, real, gae_over='actions', policy_trained=nnx.Param,
                 critic_trained=ref.CRITIC_TRAINED, truncation='bootstrap') -> Run:
  before = {'policy': _flat_model(policy, policy_trained)[0]}
  if critic is not None:
    before['critic'], before['critic_rest'] = _flat_model(critic, critic_trained)
  config = LearnerConfig.from_config(_config(algo, settings, len(batch.tokens), gae_over, truncation))
  learner = Learner(config, policy=policy, critic=critic, mesh=H.mesh(1, 1), model_config=policy.cfg)
  if learner.base is not None:
    before['base'] = ref.flat(H.host(learner.base))
  learner.update(batch)
  after = {'policy': ref.flat(H.host(learner.state.policy.params))}
  if critic is not None:
    after['critic'] = ref.flat(H.host(learner.state.critic.params))
    after['critic_rest'] = ref.flat(H.host(learner.state.critic.rest))
  if learner.base is not None:
    after['base'] = ref.flat(H.host(learner.base))
  return Run(policy, critic, batch, real, before, after)


@functools.cache
def _sao(gae_over: str = 'actions', settings: ref.Settings = SAO, truncation: str = 'bootstrap') -> Run:
  policy = Decoder(H.MODEL, rngs=nnx.Rngs(0))
  critic = value_lib.ValueModel(H.MODEL, rngs=nnx.Rngs(1))  # Its own backbone; a non-zero head.
  critic.head.kernel[...] = 0.1 * jax.random.normal(jax.random.key(2), critic.head.kernel.shape)
  critic.head.bias[...] = 0.2
  batch, real = _sao_batch(policy, settings.temperature)
  return _run_learner('sao', settings, policy, critic, batch, real, gae_over, truncation=truncation)


def _sao_batch(policy, temperature: float = 1.0) -> tuple[Batch, np.ndarray]:
  tokens, action, real, rewards = _layout(SEGMENTS_SAO, SAO_REWARDS, seed=0)
  rows = len(tokens)
  truncated = np.zeros(rows, bool)
  truncated[list(SAO_TRUNCATED)] = True
  row_mask = np.ones(rows, np.float32)
  row_mask[SAO_PADDING_ROW] = 0.0
  batch = Batch.from_rows(tokens=tokens, action_mask=action,
                          behavior_logprobs=_behavior(_initial_logprobs(policy, tokens, temperature), action, seed=0),
                          rewards=rewards, lengths=real.sum(axis=1), truncated=truncated, row_mask=row_mask)
  return batch, real


# LoRA: every projection of the policy adapted (rank 4), the critic's MLP; B drawn non-zero (as after some training)
# so that A has gradients too; the critic's base is the policy's (ValueModel.from_policy), shared by the learner.
LORA_MODEL = H.MODEL.replace(lora_rank=4, lora_alpha=8.0, lora_targets=lora.TARGETS)
LORA_CRITIC_TRAINED = nnx.All(nnx.Any(lora.ADAPTERS, nnx.PathContains('head')), nnx.Not(value_lib.CRITIC_ATTENTION))


def _random_b(model, seed):
  for i, (path, var) in enumerate(nnx.to_flat_state(nnx.state(model, lora.ADAPTERS))):
    if path[-1] == 'b':
      var[...] = 0.05 * jax.random.normal(jax.random.key(seed + i), var.shape)


@functools.cache
def _sao_lora() -> Run:
  policy = Decoder(LORA_MODEL, rngs=nnx.Rngs(0))
  _random_b(policy, 10)
  critic = value_lib.ValueModel.from_policy(policy, rngs=nnx.Rngs(1), lora_rank=2, lora_targets=lora.MLP_TARGETS)
  _random_b(critic, 20)
  critic.head.kernel[...] = 0.1 * jax.random.normal(jax.random.key(2), critic.head.kernel.shape)
  critic.head.bias[...] = 0.2
  batch, real = _sao_batch(policy)
  return _run_learner('sao', SAO, policy, critic, batch, real, policy_trained=lora.ADAPTERS,
                      critic_trained=LORA_CRITIC_TRAINED)


@functools.cache
def _sao_reference(variant: ref.SaoVariant = ref.SaoVariant()) -> ref.StepResult:
  run = _sao()
  return ref.sao_step(run.policy, run.critic, run.batch, SAO, variant, real_tokens=run.real)


@functools.cache
def _grpo() -> Run:
  policy = Decoder(H.MODEL, rngs=nnx.Rngs(3))
  tokens, action, real, rewards = _layout(SEGMENTS_GRPO, GRPO_REWARDS, seed=1)
  rows = len(tokens)
  batch = Batch.from_rows(tokens=tokens, action_mask=action,
                          behavior_logprobs=_behavior(_initial_logprobs(policy, tokens), action, seed=1),
                          rewards=rewards, lengths=real.sum(axis=1),
                          group_ids=(np.arange(rows) // GRPO.group_size).astype(np.int32))
  return _run_learner('grpo', GRPO, policy, None, batch, real)


@functools.cache
def _grpo_reference(variant: ref.GrpoVariant = ref.GrpoVariant()) -> ref.StepResult:
  run = _grpo()
  return ref.grpo_step(run.policy, run.batch, GRPO, variant)


SAO_WRONG = {
    'advantages from the pre-update critic': ref.SaoVariant(advantages_from='pre_update'),
    'lambda_policy = 1': ref.SaoVariant(lam_policy=1.0),
    'bootstrap from V before the last token': ref.SaoVariant(bootstrap='before_last'),
    'no bootstrap (a cut row as terminal)': ref.SaoVariant(bootstrap='none'),
    'ratio to the current policy': ref.SaoVariant(ratio_to='current'),
    'token mean over kept tokens only': ref.SaoVariant(denominator='kept'),
    'values misaligned by one': ref.SaoVariant(value_shift=0),
    'closed band (<=)': ref.SaoVariant(band='closed'),
    'GAE through observation tokens': ref.SaoVariant(chain='span'),
}
GRPO_WRONG = {
    'no std normalisation': ref.GrpoVariant(std_normalize=False),
    'leave-one-out baseline': ref.GrpoVariant(baseline='leave_one_out'),
    'mean of row means (seq_mean_token_mean)': ref.GrpoVariant(agg='seq_mean_token_mean'),
}
# Variants that differ only on measure-zero inputs (exact band edges), pinned by the policy-loss tests.
EDGE_ONLY = ('closed band (<=)',)


def _sao_distance(result: ref.StepResult) -> float:
  after = _sao().after
  return max(_dist(result.policy, after['policy']), _dist(result.critic, after['critic']))


class SaoReferenceStepTest(absltest.TestCase):

  def test_policy_and_critic_match_the_reference(self):
    run, want = _sao(), _sao_reference()
    moved = {name: _dist(getattr(want, name), run.before[name]) for name in ('policy', 'critic')}
    for name in ('policy', 'critic'):
      self.assertGreater(moved[name], 1000 * ATOL, f'{name} barely moved: the comparison would be vacuous')
      got = run.after[name]
      self.assertEqual(sorted(got), sorted(getattr(want, name)))
      for k in got:
        np.testing.assert_allclose(got[k], getattr(want, name)[k], rtol=0, atol=ATOL, err_msg=f'{name} {k}')
    logging.info('SAO step: learner vs reference %.2e (policy moved %.2e, critic %.2e)',
                 _sao_distance(want), moved['policy'], moved['critic'])

  def test_gae_through_observations_ablation_matches_the_reference(self):
    # `algo.gae_over='span'` (the ablation of skip-observation GAE) against the reference's span chain; the
    # SAO learner's distance to the span reference is among the wrong variants below.
    run, want = _sao('span'), _sao_reference(ref.SaoVariant(chain='span'))
    for name in ('policy', 'critic'):
      for k, got in run.after[name].items():
        np.testing.assert_allclose(got, getattr(want, name)[k], rtol=0, atol=ATOL, err_msg=f'{name} {k}')

  def test_policy_is_the_samplers_tempered_one(self):
    # Sampling at temperature 0.7 (behaviour log-probs at 0.7): the learner trains softmax(logits / 0.7), not
    # the temperature-1 policy (whose ratio to the sampler is off by the temperature on every token).
    settings = dataclasses.replace(SAO, temperature=0.7)
    run = _sao(settings=settings)
    want = ref.sao_step(run.policy, run.critic, run.batch, settings, real_tokens=run.real)
    untempered = ref.sao_step(run.policy, run.critic, run.batch, settings, ref.SaoVariant(tempered=False),
                              real_tokens=run.real)
    for name in ('policy', 'critic'):
      for k, got in run.after[name].items():
        np.testing.assert_allclose(got, getattr(want, name)[k], rtol=0, atol=ATOL, err_msg=f'{name} {k}')
    self.assertGreater(_dist(untempered.policy, run.after['policy']), MARGIN * ATOL)

  def test_terminal_truncation_matches_the_reference(self):
    # `algo.truncation='terminal'`: a cut row's chain ends in 0 (its reward is the env's), as at a stop token;
    # the SAO learner's distance to this reference is among the wrong variants below (a bootstrap of 0).
    run, want = _sao(truncation='terminal'), _sao_reference(ref.SaoVariant(bootstrap='none'))
    for name in ('policy', 'critic'):
      for k, got in run.after[name].items():
        np.testing.assert_allclose(got, getattr(want, name)[k], rtol=0, atol=ATOL, err_msg=f'{name} {k}')

  def test_frozen_critic_attention_did_not_move(self):
    run = _sao()
    self.assertTrue(any("['attn']" in k for k in run.before['critic_rest']))
    for k, v in run.before['critic_rest'].items():
      np.testing.assert_array_equal(run.after['critic_rest'][k], v, err_msg=k)

  def test_batch_exercises_every_case(self):
    run, r = _sao(), _sao_reference()
    batch, real = run.batch, run.real
    m = r.mask > 0
    lo, hi = 1 - SAO.eps_low, 1 + SAO.eps_high
    for side in (r.ratio <= lo, r.ratio >= hi, (r.ratio > lo) & (r.ratio < hi)):
      self.assertGreater((side & m & (r.advantages > 0)).sum(), 0)
      self.assertGreater((side & m & (r.advantages < 0)).sum(), 0)
    # Multi-turn rows: observation tokens between action tokens.
    action = np.asarray(batch.action_mask) > 0
    gaps = [b for b in range(len(action)) if np.any(np.diff(np.flatnonzero(action[b])) > 1)]
    self.assertGreaterEqual(len(gaps), 2)
    # The truncated row ends on an action token and bootstraps from a non-zero value.
    for b in SAO_TRUNCATED:
      last = np.flatnonzero(real[b])[-1]
      self.assertTrue(action[b, last])
      self.assertGreater(abs(r.extra['bootstrap_new'][b]), 1e-2)
    self.assertTrue(real[SAO_TRUNCATED[-1], -1])  # One of them fills the row: its bootstrap is v at T - 1.
    # Rows of different lengths, adaptive lambdas all different and in (0, 1).
    lam = r.extra['lam'][np.asarray(batch.segment_mask[:, 0]) > 0]
    self.assertLen(set(np.round(lam, 6)), len(lam))
    self.assertTrue(np.all((lam > 0) & (lam < 1)))
    # The padding row is ignored (its junk reward would otherwise dominate).
    self.assertFalse(m[SAO_PADDING_ROW].any())


class GrpoReferenceStepTest(absltest.TestCase):

  def test_policy_matches_the_reference(self):
    run, want = _grpo(), _grpo_reference()
    before, after = run.before['policy'], run.after['policy']
    self.assertGreater(_dist(want.policy, before), 1000 * ATOL, 'the policy barely moved')
    self.assertEqual(sorted(after), sorted(want.policy))
    for k in after:
      np.testing.assert_allclose(after[k], want.policy[k], rtol=0, atol=ATOL, err_msg=k)

  def test_batch_exercises_every_case(self):
    r = _grpo_reference()
    m = r.mask > 0
    lo, hi = 1 - GRPO.eps_low, 1 + GRPO.eps_high
    for side in (r.ratio < lo, r.ratio > hi, (r.ratio > lo) & (r.ratio < hi)):
      self.assertGreater((side & m & (r.advantages > 0)).sum(), 0)
      self.assertGreater((side & m & (r.advantages < 0)).sum(), 0)
    self.assertGreater((~r.kept & m).sum(), 0)  # Some tokens are clipped away ...
    self.assertGreater((r.kept & m & ((r.ratio < lo) | (r.ratio > hi))).sum(), 0)  # ... others out but kept.


class ReferenceSelfTest(absltest.TestCase):
  """The reference's scalar parts against numbers worked out by hand."""

  def test_skip_observation_gae_by_hand(self):
    # t: 0 prompt, 1 action, 2 action, 3 observation (its value and reward must not matter), 4 action, 5 pad.
    values = np.array([[0.0, 0.5, 0.2, 9.0, -0.3, 0.0]])
    rewards = np.array([[0.0, 0.0, 0.0, 7.0, 1.0, 0.0]])
    mask = np.array([[0, 1, 1, 0, 1, 0]], bool)
    # gamma 0.9, lambda 0.5: delta_4 = 1 + 0.9 * boot + 0.3, delta_2 = 0.9 * -0.3 - 0.2 = -0.47,
    # delta_1 = 0.9 * 0.2 - 0.5 = -0.32, A_k = delta_k + 0.45 A_{k+1}.
    for boot, want_adv in ((0.0, [-0.26825, 0.115, 1.3]), (2.0, [0.09625, 0.925, 3.1])):
      adv, ret = ref.gae(rewards, values, mask, [boot], 0.9, [0.5])
      np.testing.assert_allclose(adv[0, [1, 2, 4]], want_adv, rtol=1e-12)
      np.testing.assert_allclose(ret[0, [1, 2, 4]], np.array(want_adv) + [0.5, 0.2, -0.3], rtol=1e-12)
      self.assertTrue(np.all(adv[0, [0, 3, 5]] == 0) and np.all(ret[0, [0, 3, 5]] == 0))
    # gamma = lambda = 1: returns are Monte Carlo (reward + bootstrap) at every action token.
    _, ret = ref.gae(rewards, values, mask, [2.0], 1.0, [1.0])
    np.testing.assert_allclose(ret[0, [1, 2, 4]], 3.0, rtol=1e-12)

  def test_adaptive_lambda_by_hand(self):
    mask = np.array([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_allclose(ref.adaptive_lambda(mask, 1.5), [1 - 1 / 4.5, 1 - 1 / 1.5, 0.0], rtol=1e-12)

  def test_group_advantages_by_hand(self):
    s = dataclasses.replace(GRPO, group_eps=0.0)
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 6.0])
    # Group 1: mean 0.5, Bessel std sqrt(1/3); group 2: mean 3, std 2.
    a = 0.5 * 3 ** 0.5
    np.testing.assert_allclose(ref.grpo_advantages(rewards, s), [a, -a, -a, a, -0.5, -0.5, -0.5, 1.5], rtol=1e-12)
    np.testing.assert_allclose(ref.grpo_advantages(rewards, s, ref.GrpoVariant(baseline='leave_one_out')),
                               [2 / 3, -2 / 3, -2 / 3, 2 / 3, -4 / 3, -4 / 3, -4 / 3, 4], rtol=1e-12)


class WrongVariantsTest(absltest.TestCase):
  """Each known-wrong algorithm, computed by the reference, misses the learner by >> the tolerance."""

  def test_sao_wrong_variants_are_far(self):
    rows = [('SAO as specified', _sao_distance(_sao_reference()))]
    for name, variant in SAO_WRONG.items():
      rows.append((name, _sao_distance(_sao_reference(variant))))
    _report('SAO', rows)
    self.assertLess(rows[0][1], ATOL)
    for name, d in rows[1:]:
      if name in EDGE_ONLY:
        self.assertLess(d, ATOL, f'{name}: no ratio sits on an edge here')
      else:
        self.assertGreater(d, MARGIN * ATOL, name)

  def test_grpo_wrong_variants_are_far(self):
    after = _grpo().after['policy']
    rows = [('GRPO as specified', _dist(_grpo_reference().policy, after))]
    for name, variant in GRPO_WRONG.items():
      rows.append((name, _dist(_grpo_reference(variant).policy, after)))
    _report('GRPO', rows)
    self.assertLess(rows[0][1], ATOL)
    for name, d in rows[1:]:
      self.assertGreater(d, MARGIN * ATOL, name)


def _report(algo, rows):
  lines = [f'{algo} variant -> max |param diff| vs the learner (tolerance {ATOL:.0e})']
  lines += [f'  {name:<45s} {d:.3e}  ({d / ATOL:,.0f} x tol)' for name, d in rows]
  text = '\n'.join(lines)
  logging.info('%s', text)
  print(text)




class SaoLoraReferenceStepTest(absltest.TestCase):
  """LoRA: the learner's SAO step moves exactly the adapters (and the critic's head) as the reference's SGD on them,
  and leaves the shared base bit for bit."""

  def test_adapters_match_the_reference_and_the_base_stays(self):
    run = _sao_lora()
    want = ref.sao_step(run.policy, run.critic, run.batch, SAO, real_tokens=run.real, policy_trained=lora.ADAPTERS,
                        critic_trained=LORA_CRITIC_TRAINED)
    for name in ('policy', 'critic'):
      self.assertGreater(_dist(getattr(want, name), run.before[name]), 1000 * ATOL, f'{name} barely moved')
      self.assertEqual(sorted(run.after[name]), sorted(getattr(want, name)))
      self.assertLess(_dist(run.after[name], getattr(want, name)), ATOL, name)
    self.assertTrue(all("_lora']" in k for k in run.after['policy']), sorted(run.after['policy']))
    self.assertEqual(run.after['critic_rest'], {})  # Frozen attention has no adapter; the backbone is the base.
    self.assertEqual(sorted(run.after['base']), sorted(run.before['base']))
    for k, v in run.before['base'].items():
      np.testing.assert_array_equal(run.after['base'][k], v, err_msg=k)


if __name__ == '__main__':
  absltest.main()
