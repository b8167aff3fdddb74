"""Tests of the KV-cache sampler and the token-selection functions (tiny model, CPU)."""

import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from absl.testing import parameterized
from flax import nnx
import ml_collections

from sao_jax.generate import sampling
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder
from sao_jax.generate.static import Sampler, StopReason, decode_windows
from sao_jax.generate.sampling import SamplingParams

_PROMPTS = ([5, 6, 7, 8, 9], [10, 11, 12], [13, 40, 41, 42, 43, 44, 45, 46, 47], [99])


@functools.lru_cache(maxsize=None)
def _model() -> Decoder:
  # Untied embeddings + qkv bias + qk norm: every optional weight path of the decode graph is exercised.
  cfg = get_model_config('tiny', tie_embeddings=False, qkv_bias=True, qk_norm=True)
  model = Decoder(cfg, rngs=nnx.Rngs(0))
  # Non-zero biases (they are zero-initialised) so that the test sees them.
  attn = model.layers.attn
  for i, name in enumerate(('q_bias', 'k_bias', 'v_bias')):
    p = getattr(attn, name)
    p.value = 0.1 * jax.random.normal(jax.random.key(i), p.value.shape)
  return model


@functools.lru_cache(maxsize=None)
def _other_model() -> Decoder:
  """Same architecture as `_model()`, other weights."""
  return Decoder(_model().cfg, rngs=nnx.Rngs(1))


@functools.lru_cache(maxsize=None)
def _sampler() -> Sampler:
  """The shared sampler (one set of compiled programs for most tests).

  Stop tokens: 3, 4 and the greedy first tokens after prompts 0 and 1 (so that stops really happen).
  """
  first = [int(np.argmax(_full_logits(list(p))[-1])) for p in _PROMPTS[:2]]
  return Sampler(_model(), stop_ids=tuple(sorted({3, 4, *first})), pad_id=0, prompt_buckets=(16,))


@functools.lru_cache(maxsize=None)
def _forward_fn():
  graphdef, state = nnx.split(_model())
  return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)), state


def _full_logits(seq: list[int], padded_len: int = 128) -> np.ndarray:
  """Plain forward pass (no cache) over one sequence: logits [T, V].

  The sequence is right-padded to a fixed length (one compiled program); causal attention makes the logits
  of the real positions independent of the padding.
  """
  fn, state = _forward_fn()
  assert len(seq) <= padded_len
  tokens = np.zeros((1, padded_len), np.int32)
  tokens[0, :len(seq)] = seq
  return np.array(fn(state, jnp.asarray(tokens))[0, :len(seq)])


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


class SelectTokensTest(parameterized.TestCase):

  def test_policy_logprob_and_determinism(self):
    logits = jax.random.normal(jax.random.key(0), (4, 50)) * 3
    seeds = jnp.arange(4, dtype=jnp.uint32)
    tok, lp, slp = sampling.select_tokens(logits, seeds, 7, SamplingParams())
    ref = _log_softmax(np.asarray(logits))[np.arange(4), np.asarray(tok)]
    np.testing.assert_allclose(lp, ref, atol=1e-5)
    np.testing.assert_array_equal(lp, slp)
    tok2, _, _ = sampling.select_tokens(logits, seeds, 7, SamplingParams())
    np.testing.assert_array_equal(tok, tok2)
    # A row's draw depends on its own seed only, not on its place in the batch.
    tok_rev, _, _ = sampling.select_tokens(logits[::-1], seeds[::-1], 7, SamplingParams())
    np.testing.assert_array_equal(tok, np.asarray(tok_rev)[::-1])

  def test_greedy(self):
    logits = jax.random.normal(jax.random.key(1), (3, 20))
    tok, lp, slp = sampling.select_tokens(logits, jnp.zeros(3, jnp.uint32), 0, SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(tok, np.argmax(logits, -1))
    np.testing.assert_array_equal(slp, 0.0)
    np.testing.assert_allclose(lp, _log_softmax(np.asarray(logits)).max(-1), atol=1e-6)

  def test_row_uniforms_are_jax_randoms_bit_for_bit(self):
    """`row_uniforms` (threefry written out) draws exactly `jax.random.uniform` under each row's key
    `fold_in(key(seed), step)` (with jax's default, partitionable threefry bits): random and edge seeds and steps,
    a step per row and one for all, eager and jitted. A wrong rotation, key schedule or bits-to-float step changes
    nearly every draw."""
    rng = np.random.default_rng(0)
    edges = np.asarray([0, 1, 2 ** 31, 2 ** 32 - 1], np.uint32)
    seeds = np.concatenate([rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32), edges, edges[::-1]])
    steps = np.concatenate([rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).astype(np.uint32), edges, edges])
    draw = lambda s, i: jax.random.uniform(jax.random.fold_in(jax.random.key(s), i))
    reference = lambda s, i: jax.vmap(draw)(s, jnp.broadcast_to(jnp.asarray(i, jnp.uint32), s.shape))
    with jax.threefry_partitionable(True):
      for step in (steps, 7):
        want = np.asarray(jax.jit(reference)(seeds, step)).view(np.uint32)
        np.testing.assert_array_equal(np.asarray(sampling.row_uniforms(seeds, step)).view(np.uint32), want)
        np.testing.assert_array_equal(np.asarray(jax.jit(sampling.row_uniforms)(seeds, step)).view(np.uint32), want)
    u = np.asarray(sampling.row_uniforms(seeds, steps))
    self.assertTrue(np.all((u >= 0) & (u < 1)))
    self.assertGreater(len(np.unique(u)), 0.99 * len(u))

  def test_categorical_icdf_matches_distribution(self):
    # 200 tokens (not a multiple of the 128 block) with a few zero-probability ones.
    z = np.asarray(jax.random.normal(jax.random.key(2), (200,))) * 2
    z[[0, 127, 128, 199]] = -1e30
    lp = _log_softmax(z[None])[0]
    n = 40000
    u = jax.random.uniform(jax.random.key(3), (n,))
    draws = np.asarray(sampling.categorical_icdf(jnp.broadcast_to(jnp.asarray(lp), (n, 200)), u))
    counts = np.bincount(draws, minlength=200)
    self.assertEqual(counts[[0, 127, 128, 199]].sum(), 0)
    p = np.exp(lp)
    # Every count within 5 binomial standard deviations (+1) of its expectation.
    np.testing.assert_array_less(np.abs(counts - n * p), 5 * np.sqrt(n * p * (1 - p)) + 1)

  def test_icdf_edge_uniforms(self):
    lp = jnp.log(jnp.asarray([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]]) + 1e-38)
    for u, expected in ((0.0, [1, 0]), (0.9999999, [3, 3]), (0.5, [3, 2])):
      tok = sampling.categorical_icdf(lp, jnp.full((2,), u), block=2)
      np.testing.assert_array_equal(tok, expected, err_msg=f'u={u}')

  def test_top_p_mask_matches_sorted_reference(self):
    logits = np.asarray(jax.random.normal(jax.random.key(4), (6, 300))) * 2
    lp = _log_softmax(logits)
    for top_p in (0.05, 0.5, 0.9, 0.999):
      mask = np.asarray(sampling.top_p_mask(jnp.asarray(lp), top_p))
      for b in range(6):
        order = np.argsort(-lp[b])
        cum = np.cumsum(np.exp(lp[b][order]))
        keep_n = int(np.searchsorted(cum, top_p) + 1)
        ref = np.zeros(300, bool)
        ref[order[:keep_n]] = True
        np.testing.assert_array_equal(mask[b], ref, err_msg=f'top_p={top_p} row={b}')

  def test_policy_with_banned_tokens_draws_from_the_allowed_policy(self):
    # Temperature 1 without a cut but with banned tokens: what the sampler runs until min_new_tokens.
    z = np.asarray(jax.random.normal(jax.random.key(6), (60,))) * 2
    z[7] = 30.0  # A banned token that holds almost all of the policy's mass.
    banned = np.zeros((60,), bool)
    banned[[7, 59]] = True
    n = 30000
    tok, lp, slp = sampling.select_tokens(jnp.broadcast_to(jnp.asarray(z), (n, 60)), jnp.arange(n, dtype=jnp.uint32),
                                          3, SamplingParams(), banned=jnp.asarray(banned))
    tok = np.asarray(tok)
    q = np.exp(_log_softmax(np.where(banned, -np.inf, z)[None])[0])
    counts = np.bincount(tok, minlength=60)
    self.assertEqual(counts[banned].sum(), 0)
    np.testing.assert_array_less(np.abs(counts - n * q), 5 * np.sqrt(n * q * (1 - q)) + 1)
    np.testing.assert_allclose(lp, _log_softmax(z[None])[0][tok], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(slp, np.log(q)[tok], atol=1e-5)

  @parameterized.named_parameters(
      ('policy', SamplingParams()),
      ('temperature', SamplingParams(temperature=0.7)),
      ('top_k', SamplingParams(top_k=5)),
      ('top_p', SamplingParams(top_p=0.8)),
      ('all', SamplingParams(temperature=1.3, top_k=10, top_p=0.9)))
  def test_sampling_logprob(self, params):
    logits = np.asarray(jax.random.normal(jax.random.key(5), (8, 64))) * 2
    banned = np.zeros((8, 64), bool)
    banned[:, 3] = True
    tok, lp, slp = sampling.select_tokens(jnp.asarray(logits), jnp.arange(8, dtype=jnp.uint32), 0, params,
                                          banned=jnp.asarray(banned))
    tok = np.asarray(tok)
    self.assertFalse(np.any(tok == 3))
    np.testing.assert_allclose(lp, _log_softmax(logits)[np.arange(8), tok], atol=1e-5)
    z = np.where(banned, -np.inf, logits) / params.temperature
    keep = np.isfinite(z)
    if params.top_k:
      kth = np.sort(z, -1)[:, -params.top_k][:, None]
      keep &= z >= kth
    zk = np.where(keep, z, -np.inf)
    if params.top_p < 1:
      keep &= np.asarray(sampling.top_p_mask(jnp.asarray(_log_softmax(zk)), params.top_p))
    ref = _log_softmax(np.where(keep, z, -np.inf))
    self.assertTrue(np.all(keep[np.arange(8), tok]))
    np.testing.assert_allclose(slp, ref[np.arange(8), tok], atol=1e-5)

  def test_bad_params(self):
    with self.assertRaisesRegex(ValueError, 'top_p'):
      SamplingParams(top_p=0.0)
    with self.assertRaisesRegex(ValueError, 'temperature'):
      SamplingParams(temperature=-1.0)
    with self.assertRaisesRegex(ValueError, 'top_k'):
      SamplingParams(top_k=-2)


class SamplingParamsTest(absltest.TestCase):

  def test_from_config(self):
    config = ml_collections.ConfigDict({'sampler': {'temperature': 0.7, 'top_p': 0.9, 'top_k': 5}})
    want = SamplingParams(temperature=0.7, top_p=0.9, top_k=5)
    self.assertEqual(SamplingParams.from_config(config.sampler), want)
    self.assertEqual(SamplingParams.from_config(config), want)
    config.sampler.top_p = 1.5
    with self.assertRaisesRegex(ValueError, 'top_p must be in'):
      SamplingParams.from_config(config.sampler)


class WeightsSnapshotTest(absltest.TestCase):
  """`update_weights` publishes (weights, version) atomically; a call uses one snapshot and reports it."""

  _KW = dict(max_new_tokens=12, params=SamplingParams(temperature=0.0), min_new_tokens=12)

  def setUp(self):
    super().setUp()
    self.sampler = _sampler()
    self.v = self.sampler.version
    self.addCleanup(self.sampler.update_weights, _model(), version=self.v)

  def test_a_swap_between_calls_changes_the_weights_and_the_version(self):
    old = self.sampler.generate(_PROMPTS, **self._KW)
    self.sampler.update_weights(_other_model(), version=self.v + 3)
    new = self.sampler.generate(_PROMPTS, **self._KW)
    self.assertEqual((old.version, new.version), (self.v, self.v + 3))
    self.assertFalse(np.array_equal(old.tokens, new.tokens))
    self.sampler.update_weights(_model())  # Default version: the current one + 1.
    again = self.sampler.generate(_PROMPTS, **self._KW)
    self.assertEqual(again.version, self.v + 4)
    np.testing.assert_array_equal(again.tokens, old.tokens)

  def test_a_call_uses_one_snapshot_throughout(self):
    """Weights published during a call (between its prefill and its decode, as another thread may) take effect
    at the next call: the call's output is exactly the old weights'."""
    sampler = self.sampler
    old = sampler.generate(_PROMPTS, **self._KW)
    decode = sampler._decode

    def swapping_decode(*args):
      sampler.update_weights(_other_model(), version=self.v + 1)
      return decode(*args)

    with mock.patch.object(sampler, '_decode', swapping_decode):
      out = sampler.generate(_PROMPTS, **self._KW)
    self.assertEqual((out.version, sampler.version), (self.v, self.v + 1))
    np.testing.assert_array_equal(out.tokens, old.tokens)
    np.testing.assert_array_equal(out.logprobs, old.logprobs)

    # The same for a continuation, with the swap inside its prefill.
    sampler.update_weights(_model(), version=self.v)
    obs = [[20, 21, 22], [23], None]  # The shapes of test_continuation_matches_forward_without_reprefill.
    start = lambda: sampler.generate(_PROMPTS[:3], max_new_tokens=[6, 4, 5], seeds=5, keep_state=True,
                                     min_new_tokens=3, max_total_len=64).state
    ref = sampler.continue_generation(start(), obs, max_new_tokens=7, keep_state=True)
    prefill = sampler._prefill

    def swapping_prefill(*args):
      sampler.update_weights(_other_model(), version=self.v + 2)
      return prefill(*args)

    state = start()
    with mock.patch.object(sampler, '_prefill', swapping_prefill):
      out = sampler.continue_generation(state, obs, max_new_tokens=7, keep_state=True)
    self.assertEqual(out.version, self.v)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)


class SamplerTest(parameterized.TestCase):

  def _check_against_forward(self, prompts, out, params=SamplingParams()):
    """Log-probs returned by the sampler == those of a plain forward pass over prompt + generation."""
    for b, prompt in enumerate(prompts):
      gen = out.tokens[b, :out.lengths[b]].tolist()
      self.assertTrue(np.all(out.tokens[b, out.lengths[b]:] == 0))
      if not gen:
        continue
      seq = list(prompt) + gen
      logits = _full_logits(seq)[len(prompt) - 1:len(seq) - 1]
      ref = _log_softmax(logits)[np.arange(len(gen)), gen]
      np.testing.assert_allclose(out.logprobs[b, :len(gen)], ref, atol=2e-5, err_msg=f'row {b}')
      if params is None:
        continue
      if params.is_policy:
        np.testing.assert_array_equal(out.sampling_logprobs[b], out.logprobs[b])
      else:
        z = logits / params.temperature
        keep = np.ones_like(z, bool)
        if params.top_k:
          keep &= z >= np.sort(z, -1)[:, -params.top_k][:, None]
        if params.top_p < 1:
          lp_k = _log_softmax(np.where(keep, z, -np.inf))
          keep &= np.asarray(sampling.top_p_mask(jnp.asarray(lp_k), params.top_p))
        ref_s = _log_softmax(np.where(keep, z, -np.inf))[np.arange(len(gen)), gen]
        np.testing.assert_allclose(out.sampling_logprobs[b, :len(gen)], ref_s, atol=2e-5)

  def _check_stops(self, out, budgets, stop_ids):
    for b in range(len(out.lengths)):
      gen = out.tokens[b, :out.lengths[b]].tolist()
      early = [t for t in gen[:-1] if t in stop_ids]
      self.assertEqual(early, [], f'row {b} continued past a stop token')
      if out.stop_reason[b] == StopReason.STOP_TOKEN:
        self.assertIn(gen[-1], stop_ids)
      else:
        self.assertEqual(out.stop_reason[b], StopReason.BUDGET)
        self.assertEqual(out.lengths[b], budgets[b])

  def test_logprobs_match_forward_and_stops(self):
    sampler = _sampler()
    budgets = [12, 5, 20, 0]
    out = sampler.generate(_PROMPTS, max_new_tokens=budgets, seeds=11)
    self.assertEqual(out.tokens.shape, (4, 32))
    self.assertEqual(out.lengths[3], 0)
    self._check_stops(out, budgets, sampler.stop_ids)
    self._check_against_forward(_PROMPTS, out)
    # Several seeds: both stop reasons occur.
    reasons = set()
    for seed in range(4):
      o = sampler.generate(_PROMPTS, max_new_tokens=budgets, seeds=100 * seed)
      self._check_stops(o, budgets, sampler.stop_ids)
      reasons |= set(o.stop_reason[:3].tolist())
    self.assertEqual(reasons, {StopReason.STOP_TOKEN, StopReason.BUDGET})

  def test_sampling_logprobs_match_forward(self):
    params = SamplingParams(temperature=0.7, top_k=7, top_p=0.9)
    out = _sampler().generate(_PROMPTS[:3], max_new_tokens=10, seeds=[1, 2, 3], params=params)
    self._check_against_forward(_PROMPTS[:3], out, params)

  def test_greedy_matches_uncached_greedy(self):
    sampler = _sampler()
    greedy = SamplingParams(temperature=0.0)
    # Greedy stops at once after prompts 0 and 1 (their first greedy token is a stop token) ...
    out = sampler.generate(_PROMPTS, max_new_tokens=12, params=greedy)
    np.testing.assert_array_equal(out.lengths[:2], 1)
    np.testing.assert_array_equal(out.stop_reason[:2], StopReason.STOP_TOKEN)
    # ... and with the stop tokens banned for 12 tokens every row runs its full budget.
    out = sampler.generate(_PROMPTS, max_new_tokens=12, params=greedy, min_new_tokens=12)
    np.testing.assert_array_equal(out.lengths, 12)
    np.testing.assert_array_equal(out.stop_reason, StopReason.BUDGET)
    for b, prompt in enumerate(_PROMPTS):
      seq = list(prompt)
      for _ in range(12):  # Greedy decoding with a full forward pass per token (no cache), stops banned.
        logits = _full_logits(seq)[-1]
        logits[list(sampler.stop_ids)] = -np.inf
        seq.append(int(np.argmax(logits)))
      self.assertEqual(out.tokens[b].tolist()[:12], seq[len(prompt):], f'row {b}')
      np.testing.assert_array_equal(out.sampling_logprobs[b, :12], 0.0)
    # The policy log-prob is unaffected by the ban.
    self._check_against_forward(_PROMPTS, out, params=None)

  def test_seeds(self):
    sampler = _sampler()
    a = sampler.generate(_PROMPTS[:3], max_new_tokens=8, seeds=[7, 8, 9])
    b = sampler.generate(_PROMPTS[:3][::-1], max_new_tokens=8, seeds=[9, 8, 7])
    np.testing.assert_array_equal(a.tokens, b.tokens[::-1])
    c = sampler.generate(_PROMPTS[:3], max_new_tokens=8, seeds=[17, 18, 19])
    self.assertFalse(np.array_equal(a.tokens, c.tokens))

  def test_continuation_matches_forward_without_reprefill(self):
    sampler = _sampler()
    grows = sampler.num_compiled()['resize_cache']
    out1 = sampler.generate(_PROMPTS[:3], max_new_tokens=[6, 4, 5], seeds=5, keep_state=True, min_new_tokens=3,
                            max_total_len=64)
    self.assertEqual(out1.state.cache.max_len, 64)
    index1 = int(out1.state.cache.index)
    obs = [[20, 21, 22], [23], None]  # Row 2's episode is over.
    out2 = sampler.continue_generation(out1.state, obs, max_new_tokens=7, keep_state=True)
    self.assertEqual(out2.lengths[2], 0)
    self.assertEqual(out2.state.cache.max_len, 64)  # <= 21 + 16 + 16 slots needed: no growth.
    self.assertEqual(sampler.num_compiled()['resize_cache'], grows)
    # Only the new chunk (bucket 16) and the decode steps were written: the history was not re-run.
    steps2 = int(out2.lengths.max())
    self.assertEqual(int(out2.state.cache.index), index1 + 16 + steps2 - 1)
    obs3 = [[30, 31], [32, 33, 34, 35], [36]]  # Row 2 comes back.
    out3 = sampler.continue_generation(out2.state, obs3, max_new_tokens=[3, 9, 4], keep_state=True)
    self.assertEqual(out3.state.cache.max_len, 128)  # >= 34 + 16 + 16 > 64 slots needed: grown.
    self.assertEqual(sampler.num_compiled()['resize_cache'], grows + 1)
    for b in range(3):
      seq = list(_PROMPTS[b])
      turns = []
      for out, ob in ((out1, None), (out2, obs[b]), (out3, obs3[b])):
        if ob is not None:
          seq += ob
        gen = out.tokens[b, :out.lengths[b]].tolist()
        turns.append((len(seq), gen, out.logprobs[b, :len(gen)]))
        seq += gen
      logp = _log_softmax(_full_logits(seq))
      for start, gen, lps in turns:
        ref = logp[np.arange(start - 1, start - 1 + len(gen)), gen]
        np.testing.assert_allclose(lps, ref, atol=3e-5, err_msg=f'row {b}')

  def test_long_decode_runs_window_segments_and_matches_forward(self):
    # 100 new tokens after a 16-token prompt bucket: the decode loop runs in attention-window segments
    # (64, 128, 144 slots here); then a continuation starts decoding past the first segment (it is skipped).
    self.assertEqual(decode_windows(144), (64, 128, 144))
    self.assertEqual(decode_windows(288), (64, 128, 192, 256, 288))
    self.assertEqual(decode_windows(4096), tuple(range(512, 4097, 512)))
    sampler = _sampler()
    prompts = [list(p) for p in _PROMPTS[:3]]
    out1 = sampler.generate(prompts, max_new_tokens=[100, 70, 5], seeds=3, min_new_tokens=100, keep_state=True,
                            max_total_len=256)
    np.testing.assert_array_equal(out1.lengths, [100, 70, 5])
    self._check_against_forward(prompts, out1, params=None)
    obs = [[20, 21], [22], [23, 24, 25]]
    out2 = sampler.continue_generation(out1.state, obs, max_new_tokens=10, min_new_tokens=10)
    np.testing.assert_array_equal(out2.lengths, [10, 10, 10])
    for b in range(3):
      seq = prompts[b] + out1.token_lists()[b] + obs[b]
      gen = out2.token_lists()[b]
      ref = _log_softmax(_full_logits(seq + gen, padded_len=256))[np.arange(len(seq) - 1, len(seq) + 9), gen]
      np.testing.assert_allclose(out2.logprobs[b, :10], ref, atol=3e-5, err_msg=f'row {b}')

  def test_bfloat16_model_samples_with_logprobs_close_to_its_forward(self):
    model = Decoder(get_model_config('tiny', dtype='bfloat16', qkv_bias=True), rngs=nnx.Rngs(1))
    prompts = [list(p) for p in _PROMPTS[:2]]
    out = Sampler(model, stop_ids=(3,), pad_id=0).generate(prompts, max_new_tokens=8, min_new_tokens=8, seeds=2)
    np.testing.assert_array_equal(out.lengths, [8, 8])
    forward = jax.jit(lambda x: nnx.merge(*nnx.split(model))(x))
    for b, prompt in enumerate(prompts):
      seq = prompt + out.token_lists()[b]
      logits = np.asarray(forward(jnp.asarray([seq], jnp.int32))[0], np.float32)
      ref = _log_softmax(logits)[np.arange(len(prompt) - 1, len(seq) - 1), out.token_lists()[b]]
      np.testing.assert_allclose(out.logprobs[b, :8], ref, atol=0.1)

  def test_bucketing_bounds_compiles(self):
    sampler = Sampler(_model(), stop_ids=(3,), pad_id=0, prompt_buckets=(8, 16))
    self.assertEqual([sampler.batch_bucket(b) for b in (1, 2, 3, 4, 5, 9)], [1, 2, 4, 4, 8, 16])
    self.assertEqual([sampler.chunk_bucket(n) for n in (1, 8, 9, 16, 17, 40)], [8, 8, 16, 16, 32, 64])
    self.assertEqual([sampler.new_tokens_bucket(n) for n in (1, 16, 17, 100)], [16, 16, 32, 128])
    # Batch 3..4 -> bucket 4; prompt 1..16 -> {8, 16}; new tokens 0..16 -> {16}: 2 shapes.
    for length in (8, 16):
      sampler.generate([[5] * length] * 4, max_new_tokens=2)
    expected = {'prefill': 2, 'decode': 2, 'init_cache': 2, 'resize_cache': 0}
    self.assertEqual(sampler.num_compiled(), expected)
    rng = np.random.default_rng(0)
    for _ in range(6):
      b = int(rng.integers(3, 5))
      prompts = [rng.integers(5, 500, size=rng.integers(1, 17)).tolist() for _ in range(b)]
      budgets = rng.integers(0, 17, size=b)
      out = sampler.generate(prompts, max_new_tokens=budgets, seeds=int(rng.integers(1000)))
      self.assertEqual(out.lengths.shape, (b,))
      self.assertTrue(np.all(out.lengths <= budgets))
    self.assertEqual(sampler.num_compiled(), expected)

  def test_errors(self):
    sampler = _sampler()
    with self.assertRaisesRegex(ValueError, 'prompt 1 is empty'):
      sampler.generate([[1, 2], []], max_new_tokens=3)
    with self.assertRaisesRegex(ValueError, 'max_new_tokens'):
      sampler.generate([[1, 2]], max_new_tokens=[3, 4])
    with self.assertRaisesRegex(ValueError, 'stop_ids'):
      Sampler(_model(), stop_ids=(10_000,))
    out = sampler.generate([[1, 2]], max_new_tokens=2, keep_state=True)
    with self.assertRaisesRegex(ValueError, 'observations'):
      sampler.continue_generation(out.state, [[1], [2]], max_new_tokens=2)


if __name__ == '__main__':
  absltest.main()
