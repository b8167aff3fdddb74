"""Continuous batching (`generate.slots.SlotSampler` + `rollout.continuous`) against the static sampler and
the plain forward pass: the same greedy episodes in any arrival order (multi-turn, observations, long prompts
written in pieces), behaviour and policy log-probs of the plain forward, no recompiles as slots refill, and
weight swaps recorded per token. One tiny model, one set of compiled shapes for the whole file."""

import itertools
import threading
import time
import types
from unittest import mock

from absl.testing import absltest
from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from configs import base as base_config
from sao_jax import parallel
from sao_jax import rollout
from sao_jax.envs import base
from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models.config import get_model_config
from sao_jax.generate import code_maps
from sao_jax.generate import programs
from sao_jax.generate import slots as continuous_lib
from sao_jax.generate.config import GenerateConfig
from sao_jax.generate.slots import Admission, SlotSampler
from sao_jax.generate.weights import WeightPublisher
from sao_jax.models.llama import Decoder
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout import actor as actor_lib
from sao_jax.rollout import prompts as prompts_lib
from sao_jax.rollout.continuous import ContinuousRunner, run_continuous
from sao_jax.tokenizers import CharTokenizer
from tests.rollout import helpers

_GREEDY = SamplingParams(temperature=0.0)
_SAMPLED = SamplingParams(temperature=0.7)


class _SwapAfter:
  """A `WeightFollower` that publishes `model` (as `version`) before the `at`-th device call."""

  def __init__(self, backend, model, version, at):
    self.backend, self.model, self.version, self.at = backend, model, version, at
    self.calls = 0

  def newer(self):
    return self.calls >= self.at and self.backend.sampler.version < self.version

  def refresh(self):
    self.calls += 1
    if self.newer():
      self.backend.update_weights(self.model, version=self.version)


class ContinuousTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tok = CharTokenizer()
    cls.model = helpers.small_model(cls.tok.vocab_size, seed=3)
    # Nearly every character ends a turn, so episodes go through several continuations.
    cls.stop_texts = tuple('0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-*/=(). ')
    prompts = ['12+7=?', 'What is 3*45?', 'x', '99-100', 'hello there', 'a much longer prompt, over two chunks']
    cls.examples = [base.Example(uid=str(i), prompt=p, answer='0') for i, p in enumerate(prompts)]
    cls.limits = rollout.EpisodeLimits(max_turns=3, max_new_tokens=6, max_seq_len=128)
    cls.task = helpers.EchoTask(cls.examples, 'message', cls.stop_texts, 3)
    env = cls.task.make_env(cls.examples[0])
    cls.backend = rollout.SamplerBackend(cls.model, stop_ids=rollout.stop_ids_for(env, cls.tok),
                                         pad_id=cls.tok.pad_id, max_total_len=128, min_rows=8, version=4)
    # Two slots for six episodes: slots refill many times; one chunk bucket of 16: prompts (>= 20 tokens
    # with the chat template) are written in pieces; two attention windows (96, 192 slots): decode chunks run
    # on the cache cut to a window and written back; two admit windows (128, 192): early chunks attend over
    # the small one; newcomers admitted by the host between chunks (device refill: its own tests below).
    cls.slots = SlotSampler(cls.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=cls.backend.stop_ids,
                            pad_id=cls.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                            num_admit_windows=2)
    cls.slots.warmup(_GREEDY)
    cls.slots.warmup(_SAMPLED)
    cls.compiled = cls.slots.num_compiled()

  def _envs(self, order):
    return [self.task.make_env(self.examples[i]) for i in order]

  def _continuous(self, order, decoding, **kwargs):
    return run_continuous(self.slots, self.tok, self._envs(order), limits=self.limits, decoding=decoding,
                          seeds=list(order), group_ids=list(order), **kwargs)

  def test_compiled_programs_are_fixed_by_the_slot_count(self):
    # Per sampling setting: row buckets {1, 2} x chunk buckets {16} x admit windows {128, 192} admit programs;
    # decode programs: windows {96, 192} x row buckets {1, 2}; one program computes the shared prefix.
    self.assertEqual(self.slots.row_buckets, (1, 2))
    self.assertEqual(self.slots.windows, (96, 192))
    self.assertEqual(self.slots.admit_windows, (128, 192))
    self.assertEqual(self.compiled, {'admit': 2 * 2 * 1 * 2, 'decode': 2 * 2 * 2, 'prefix': 1})

  def test_samplers_of_a_process_share_their_programs(self):
    """A second SlotSampler of the same model and shapes (another actor, another trainer run) compiles nothing:
    its warm-up runs the first one's programs; one of another slot count compiles its own."""
    before = programs.compiled_programs()
    twin = SlotSampler(self.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=self.backend.stop_ids,
                       pad_id=self.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                       num_admit_windows=2)
    self.assertEqual(twin.num_compiled(), {'admit': 0, 'decode': 0, 'prefix': 0})
    twin.warmup(_GREEDY)
    self.assertEqual(twin.num_compiled(), {'admit': 4, 'decode': 4, 'prefix': 1})
    self.assertEqual(programs.compiled_programs(), before)
    other = SlotSampler(self.backend.sampler, num_slots=3, max_seq_len=128, stop_ids=self.backend.stop_ids,
                        pad_id=self.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                        num_admit_windows=2)
    other.admit([Admission(0, [5, 6, 7], new=True, budget=2)], _GREEDY)
    self.assertEqual(programs.compiled_programs(), {**before, 'admit': before['admit'] + 1})

  def test_a_program_past_the_memory_map_limit_raises_before_it_compiles(self):
    """XLA:CPU maps each compiled program's code, and past `vm.max_map_count` the process crashes while
    compiling: `CodeMaps` checks a program at its first call (maps held plus twice the most a program added)
    and raises instead, naming the limit and the knobs; the sampler is left as it was."""
    maps = {'used': 1000, 'limit': 65530}
    guard = code_maps.CodeMaps(lambda: (maps['used'], maps['limit']))
    with guard.compiling('a'):
      maps['used'] += 600  # The program's code.
    self.assertEqual(guard.per_program, 600)
    maps['used'] = 64400  # 64400 + 2 x 600 >= 65530.
    with guard.compiling('a'):  # Compiled already: not checked.
      pass
    with self.assertRaisesRegex(RuntimeError, r'vm\.max_map_count = 65530; this process holds 64400 maps and a '
                                r'program added up to 600.*config\.sampler\.batch_size'):
      with guard.compiling('b'):
        self.fail('ran past the check')
    maps['used'] = 64000
    with guard.compiling('b'):
      pass
    self.assertEqual(guard.per_program, 600)

    slots = SlotSampler(self.backend.sampler, num_slots=5, max_seq_len=128, stop_ids=self.backend.stop_ids,
                        pad_id=self.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                        num_admit_windows=2, prefix_cache=False)
    admission = [Admission(0, [5, 6, 7], new=True, budget=2)]
    before = programs.compiled_programs()
    full = code_maps.CodeMaps(lambda: (100, 100))
    with mock.patch.object(continuous_lib, 'CODE_MAPS', full):
      with self.assertRaisesRegex(RuntimeError, 'vm.max_map_count = 100'):
        slots.admit(admission, _GREEDY)
    self.assertEqual(programs.compiled_programs(), before)
    self.assertEqual(slots.num_compiled(), {'admit': 0, 'decode': 0, 'prefix': 0})
    self.assertFalse(slots.any_active)
    (first,) = slots.admit(admission, _GREEDY)  # The cache was not donated to a call that did not run.
    self.assertLen(first.ids, 1)
    self.assertEqual(slots.fill[0], 3)

  def test_greedy_episodes_equal_the_static_sampler_in_any_arrival_order(self):
    n = len(self.examples)
    compiled = programs.compiled_programs()
    want = rollout.run_episodes(self.backend, self.tok, self._envs(range(n)), limits=self.limits,
                                decoding=_GREEDY, seeds=list(range(n)), group_ids=list(range(n)))
    self.assertGreaterEqual(sum(t.info['num_turns'] >= 2 for t in want), 2, [t.info for t in want])
    self.assertGreater(len(want[-1].tokens) - want[-1].num_action_tokens, 32)  # A prompt of several pieces.
    # refill_rows=2: a freed slot waits for the other one (admissions of two rows); the tokens must not change.
    for order, refill in (([0, 1, 2, 3, 4, 5], 1), ([5, 3, 1, 4, 0, 2], 1), ([5, 3, 1, 4, 0, 2], 2)):
      with self.subTest(order=order, refill_rows=refill):
        got = self._continuous(order, _GREEDY, refill_rows=refill)
        for i, g in zip(order, got):
          w = want[i]
          np.testing.assert_array_equal(g.tokens, w.tokens)
          np.testing.assert_array_equal(g.action_mask, w.action_mask)
          np.testing.assert_allclose(g.policy_logprobs, w.policy_logprobs, atol=1e-5)
          np.testing.assert_array_equal(g.behavior_logprobs, 0.0)
          self.assertEqual((g.group_id, g.turn_versions, g.greedy), (i, w.turn_versions, True))
          g.info.pop('token_versions')
          self.assertEqual(g.info, w.info)
    self.assertEqual(self.slots.num_compiled(), self.compiled)  # Slots refilled without a recompile.
    self.assertEqual(programs.compiled_programs(), compiled)

  def test_episodes_with_a_shared_prompt_head_equal_the_static_sampler(self):
    """Prompts that begin alike (as a chat template's system prompt makes them): the runner's slots start new
    episodes from the head's cache, and the greedy episodes are still the static sampler's."""
    examples = [base.Example(uid=str(i), prompt='Reply briefly. ' + e.prompt, answer='0')
                for i, e in enumerate(self.examples[:4])]
    task = helpers.EchoTask(examples, 'message', self.stop_texts, 3)
    envs = lambda: [task.make_env(e) for e in examples]
    slots = SlotSampler(self.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=self.backend.stop_ids,
                        pad_id=self.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                        num_admit_windows=2)  # The class's shapes: its programs, nothing compiles.
    want = rollout.run_episodes(self.backend, self.tok, envs(), limits=self.limits, decoding=_GREEDY,
                                seeds=list(range(4)), group_ids=list(range(4)))
    got = run_continuous(slots, self.tok, envs(), limits=self.limits, decoding=_GREEDY, seeds=list(range(4)),
                         group_ids=list(range(4)))
    self.assertGreaterEqual(len(slots.prefix), len('Reply briefly. '))
    self.assertGreaterEqual(sum(t.info['num_turns'] >= 2 for t in want), 1)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(g.tokens, w.tokens)
      np.testing.assert_array_equal(g.action_mask, w.action_mask)
      np.testing.assert_allclose(g.policy_logprobs, w.policy_logprobs, atol=1e-5)
    self.assertEqual(slots.num_compiled()['prefix'], 1)

  def test_device_refill_plays_the_static_sampler_episodes(self):
    """`device_refill`: a slot whose episode's last turn ends takes the next queued episode inside the decode
    chunk. Single-turn episodes (every turn is the last), greedy and sampled at 0.7, and three-turn ones (the
    third is; sampled: greedy ones here end after one turn): the episodes are the static sampler's, token for
    token (a taken episode samples with its own seed at its own positions), with their log-probs; slots were
    refilled on the device (the longest prompt, past the queue's 16 tokens, by the host); nothing compiles after
    the warm-up. Letters end a turn (turns of a few tokens, and three-turn episodes that reach their third).
    Prompts with a shared head (a chat template's system prompt): a taken episode starts from the head's cache
    in a row of a longer window and its prompt attends over the head and itself (`forward_mixed`'s
    `chunk_window`)."""
    stops = tuple('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ')
    env = helpers.EchoTask(self.examples, 'message', stops, 1).make_env(self.examples[0])
    backend = rollout.SamplerBackend(self.model, stop_ids=rollout.stop_ids_for(env, self.tok), pad_id=self.tok.pad_id,
                                     max_total_len=128, min_rows=8)
    slots = SlotSampler(backend.sampler, num_slots=2, max_seq_len=128, stop_ids=backend.stop_ids,
                        pad_id=self.tok.pad_id, chunk_buckets=(16,), decode_steps=4, num_windows=2,
                        num_admit_windows=2, device_refill=True)
    self.assertTrue(all(slots._queue_fits(w) for w in slots.windows))
    headed = [base.Example(uid=e.uid, prompt='Reply. ' + e.prompt, answer=e.answer) for e in self.examples]
    for params in (_GREEDY, _SAMPLED):
      slots.warmup(params)
    compiled = slots.num_compiled()
    taken = _checked_steps(slots)
    n = len(self.examples)
    # The head first: a sampler's shared prefix is learned from its first prompts (later ones only shrink it).
    for turns, params, examples in ((1, _GREEDY, headed), (1, _GREEDY, self.examples), (1, _SAMPLED, self.examples),
                                    (3, _SAMPLED, self.examples)):
      task = helpers.EchoTask(examples, 'message', stops, turns)
      envs = lambda order: [task.make_env(examples[i]) for i in order]
      limits = rollout.EpisodeLimits(max_turns=turns, max_new_tokens=8, max_seq_len=128)
      want = rollout.run_episodes(backend, self.tok, envs(range(n)), limits=limits, decoding=params,
                                  seeds=list(range(n)), group_ids=list(range(n)))
      if turns == 3:
        self.assertGreaterEqual(sum(t.info['num_turns'] == 3 for t in want), 4, [t.info for t in want])
      for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 4, 0, 2]):
        with self.subTest(turns=turns, temperature=params.temperature, head=examples is headed, order=order):
          del taken[:]
          got = run_continuous(slots, self.tok, envs(order), limits=limits, decoding=params, seeds=list(order),
                               group_ids=list(order), refill_rows=1)
          self.assertNotEmpty(taken)  # Slots refilled on the device.
          for i, g in zip(order, got):
            w = want[i]
            np.testing.assert_array_equal(g.tokens, w.tokens)
            np.testing.assert_array_equal(g.action_mask, w.action_mask)
            np.testing.assert_allclose(g.policy_logprobs, w.policy_logprobs, atol=1e-5)
            np.testing.assert_allclose(g.behavior_logprobs, w.behavior_logprobs, atol=1e-5)
            g.info.pop('token_versions')
            self.assertEqual((g.group_id, g.info), (i, w.info))
          if examples is headed:  # Taken episodes started from the head's cache.
            self.assertGreaterEqual(len(slots.prefix), len('Reply. '))
    self.assertEqual(slots.num_compiled(), compiled)

  def test_logprobs_are_those_of_the_plain_forward(self):
    """Sampling at temperature 0.7: behaviour = log q (tempered forward), policy = log pi (forward at T=1)."""
    got = self._continuous(range(len(self.examples)), _SAMPLED)
    self.assertGreaterEqual(sum(t.info['num_turns'] >= 2 for t in got), 2)
    log_pi, log_q = _forward_logprobs(self.model, got), _forward_logprobs(self.model, got, temperature=0.7)
    checked = 0
    for i, t in enumerate(got):
      m, n = t.action_mask, len(t.tokens)
      np.testing.assert_allclose(t.behavior_logprobs[m], log_q[i, :n][m], atol=2e-4)
      np.testing.assert_allclose(t.policy_logprobs[m], log_pi[i, :n][m], atol=2e-4)
      np.testing.assert_array_equal(t.behavior_logprobs[~m], 0.0)
      checked += int(m.sum())
    self.assertGreater(checked, 20)
    diffs = np.concatenate([np.abs(t.behavior_logprobs - t.policy_logprobs) for t in got])
    self.assertGreater(diffs.max(), 0.05)  # The two differ: a runner that confused them would fail.
    self.assertEqual(self.slots.num_compiled(), self.compiled)

  def test_a_chunk_ends_once_enough_slots_are_free_and_held_histories_survive_the_window(self):
    """`decode(free_target=1)` stops at the step that frees a slot; a slot whose turn ended keeps its long history
    (past the small window) while the other decodes, so its next turn is the plain forward's greedy one. The
    first admission mixes chunk buckets (a 100-token prompt in pieces of 64 and 36, a 3-token one: one call per
    bucket) and attends over the small admit window (64 of 64, 128, 192 slots)."""
    slots = SlotSampler(self.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=(), pad_id=self.tok.pad_id,
                        chunk_buckets=(16, 64), decode_steps=4, num_windows=2, num_admit_windows=3)
    self.assertEqual(slots.admit_windows, (64, 128, 192))
    slots.warmup(_GREEDY)
    compiled = slots.num_compiled()
    long_prompt, short_prompt = [3 + i % 50 for i in range(100)], [9, 10, 11]
    seqs = {0: list(long_prompt), 1: list(short_prompt)}
    gen, lps = {0: [], 1: []}, {0: [], 1: []}

    def record(results):
      for r in results:
        seqs[r.slot] += r.ids
        gen[r.slot] += [len(seqs[r.slot]) - len(r.ids) + j for j in range(len(r.ids))]
        lps[r.slot] += r.logprobs
      return {r.slot: r for r in results}

    record(slots.admit([Admission(0, long_prompt, new=True, budget=2, seed=0),
                        Admission(1, short_prompt, new=True, budget=12, seed=1)], _GREEDY))
    first = record(slots.decode(_GREEDY, free_target=1))
    self.assertEqual({s: len(r.ids) for s, r in first.items()}, {0: 1, 1: 1})  # Stopped when slot 0 ended.
    self.assertTrue(first[0].ended)
    self.assertFalse(first[1].ended)
    # Slot 1 decodes alone (its window is the small one unless slot 0's history counts) in chunks of 4.
    sizes = []
    while slots.active[1]:
      sizes.append(len(record(slots.decode(_GREEDY))[1].ids))
    self.assertEqual(sizes, [4, 4, 2])
    # Slot 0's next turn: its pending token and an observation appended to the history it kept.
    seqs[0] += [5, 6]
    record(slots.admit([Admission(0, [5, 6], new=False, budget=3)], _GREEDY))
    while slots.active[0]:
      record(slots.decode(_GREEDY))
    self.assertLen(seqs[0], 100 + 2 + 2 + 3)
    logits = np.asarray(_logits(self.model, _padded([types.SimpleNamespace(tokens=seqs[s]) for s in (0, 1)])))
    for s in (0, 1):
      pos = np.asarray(gen[s])
      np.testing.assert_array_equal(np.asarray(seqs[s])[pos], np.argmax(logits[s, pos - 1], axis=-1))
      log_pi = logits[s, pos - 1] - np.log(np.exp(logits[s, pos - 1]).sum(-1, keepdims=True))
      np.testing.assert_allclose(lps[s], log_pi[np.arange(len(pos)), np.asarray(seqs[s])[pos]], atol=2e-4)
    self.assertEqual(slots.num_compiled(), compiled)

  def test_decode_chunks_copy_their_windows_into_buffers_kept_between_calls(self):
    """A decode chunk's copy of its rows' windows goes into buffers the sampler keeps (donated to the program,
    returned by it): the program allocates no temporary for the copy (`memory_analysis`, against the same
    program given none), and two chunks of one shape write the same buffers. On XLA:CPU a fresh buffer of that
    size is new pages at every call, faulted in and zeroed by the kernel (SmolLM2, 16 rows at 616 slots: a
    call's fixed part 328 ms, 38 with kept buffers)."""
    slots = SlotSampler(self.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=(), pad_id=self.tok.pad_id,
                        chunk_buckets=(16,), decode_steps=4, num_windows=2, num_admit_windows=2)
    slots.warmup(_GREEDY)
    compiled = slots.num_compiled()
    slots.admit([Admission(0, [3, 4, 5], new=True, budget=20, seed=0)], _GREEDY)
    kept = []
    for _ in range(3):
      slots.decode(_GREEDY)
      shapes, windows = next(reversed(slots._windows.items()))  # pylint: disable=protected-access  (last used)
      kept.append((shapes, windows, [x.unsafe_buffer_pointer() for x in jax.tree.leaves(windows)]))
    (shapes, first, pointers), *rest = kept
    self.assertEqual(shapes, (1, slots.windows[0]))  # One active slot's row, its short history's window.
    self.assertEqual([(s, p) for s, _, p in rest], [(shapes, pointers)] * 2)
    self.assertTrue(all(x.is_deleted() for x in jax.tree.leaves(first)))  # Donated to the next chunk.
    self.assertEqual(slots.num_compiled(), compiled)

    # The program itself: given buffers, its temporaries are smaller by at least the copy's size.
    weights = self.backend.sampler.snapshot.weights
    rows, zeros = np.arange(2, dtype=np.int32), np.zeros((2,), np.int32)
    st = slots._static(_GREEDY, slots.windows[0])  # pylint: disable=protected-access
    args = (rows, zeros, np.ones((2,), bool), zeros, np.full((2,), 8, np.int32), zeros.astype(np.uint32),
            np.int32(3), None)
    temp = lambda window: programs.decode_program.lower(
        st, 4, None, weights, slots._cache, *args, window).compile().memory_analysis().temp_size_in_bytes
    buffers = slots._new_window(2, slots.windows[0])  # pylint: disable=protected-access
    self.assertGreaterEqual(temp(None) - temp(buffers), sum(x.nbytes for x in jax.tree.leaves(buffers)))

  def test_exact_admissions_compute_no_padding_rows_and_change_no_token(self):
    """Seven slots admitted together: exact admissions run calls of full row buckets (4 + 1 + 1 + 1 rows), padded one
    call of 8 rows; the first tokens, log-probs and the whole cache after them are the same, and so are the
    tokens of the decode chunks that follow (multi-turn: a next turn's observation admitted into a held
    history). An admission copies its rows cut to its window, not whole rows (`memory_analysis`)."""
    prompts = [[3 + (5 * i + j) % 40 for j in range(4 + i)] for i in range(7)]

    def play(exact):
      slots = SlotSampler(self.backend.sampler, num_slots=8, max_seq_len=128, stop_ids=(), pad_id=self.tok.pad_id,
                          chunk_buckets=(16,), decode_steps=4, num_windows=2, num_admit_windows=2,
                          prefix_cache=False)
      slots.exact_admissions = exact  # Chosen by the platform and the model (`exact_admissions`); both here.
      calls = []
      run_admit = slots._run_admit  # pylint: disable=protected-access

      def counted(st, weights, rows, *args):
        calls.append((int((rows < slots.num_slots).sum()), rows.shape[0]))  # (real rows, row bucket)
        return run_admit(st, weights, rows, *args)

      slots._run_admit = counted  # pylint: disable=protected-access
      first = slots.admit([Admission(i, p, new=True, budget=3, seed=i) for i, p in enumerate(prompts)], _GREEDY)
      cache = jax.tree.map(np.asarray, slots._cache)  # pylint: disable=protected-access
      out = [(r.slot, r.ids, r.logprobs) for r in first]
      while slots.active.any():
        out += [(r.slot, r.ids, r.logprobs) for r in slots.decode(_GREEDY)]
      # The next turn of slots 1, 2 and 5 (held histories of 8-14 tokens): an observation each.
      turn = slots.admit([Admission(s, [60 + s, 61], new=False, budget=3) for s in (5, 1, 2)], _GREEDY)
      out += [(r.slot, r.ids, r.logprobs) for r in turn]
      while slots.active.any():
        out += [(r.slot, r.ids, r.logprobs) for r in slots.decode(_GREEDY)]
      return calls, cache, out, slots

    exact_calls, exact_cache, exact_out, slots = play(True)
    padded_calls, padded_cache, padded_out, _ = play(False)
    self.assertEqual(exact_calls, [(4, 4)] + [(1, 1)] * 6)  # 7 rows: 4 + 1 + 1 + 1; 3 rows: 1 + 1 + 1.
    self.assertEqual(padded_calls, [(7, 8), (3, 4)])
    self.assertEqual([(s, ids) for s, ids, _ in exact_out], [(s, ids) for s, ids, _ in padded_out])
    np.testing.assert_allclose(np.concatenate([lp for *_, lp in exact_out]),
                               np.concatenate([lp for *_, lp in padded_out]), atol=1e-6)
    for name in ('valid', 'index', 'positions'):
      np.testing.assert_array_equal(getattr(exact_cache, name), getattr(padded_cache, name), err_msg=name)
    held = exact_cache.valid[:, None, None, :]  # Keys and values of the slots written.
    for got, want in zip(exact_cache.k + exact_cache.v, padded_cache.k + padded_cache.v):
      got, want = (np.where(held if x.shape[-1] == held.shape[-1] else np.swapaxes(held, -1, -2), x, 0)
                   for x in (got, want))
      np.testing.assert_allclose(got, want, atol=1e-6)

    # The admit program's temporaries hold its rows' windows, not whole rows: in a cache 8x as long (1536 slots)
    # they grow by less than one row's extra keys and values (a whole-row copy of 4 rows: by 4 rows').
    weights = self.backend.sampler.snapshot.weights
    st = slots._static(_GREEDY, slots.admit_windows[0])  # pylint: disable=protected-access
    p, t = 4, 16
    args = (np.arange(p, dtype=np.int32), np.zeros((p, t), np.int32), np.ones((p, t), bool),
            np.full((p,), t, np.int32), np.zeros((p,), bool), np.zeros((p,), np.uint32),
            slots._no_prefix, np.zeros((p,), bool))  # pylint: disable=protected-access
    temp = lambda cache: programs.admit_program.lower(
        st, None, weights, cache, *args).compile().memory_analysis().temp_size_in_bytes
    small = slots._cache  # pylint: disable=protected-access
    large = programs.init_cache(slots.cfg, 8, 8 * slots.cache_len, per_row_index=True)
    row_kv = lambda cache: sum(x[0].nbytes for x in cache.k + cache.v)
    self.assertLess(temp(large) - temp(small), row_kv(large) - row_kv(small))

  def test_admissions_are_exact_on_a_cpu_for_a_model_whose_padding_costs_a_call(self):
    smollm2, tiny = get_model_config('smollm2-135m'), get_model_config('tiny')
    self.assertTrue(continuous_lib.exact_admissions(smollm2, 16, 'cpu'))  # 3.4 GFLOP a padding row.
    self.assertFalse(continuous_lib.exact_admissions(tiny, 16, 'cpu'))  # 2.4 MFLOP.
    self.assertFalse(continuous_lib.exact_admissions(smollm2, 16, 'gpu'))
    self.assertFalse(continuous_lib.exact_admissions(smollm2, 16, 'tpu'))
    self.assertFalse(self.slots.exact_admissions)  # The tiny model here.

  def test_decode_chunks_that_take_queued_episodes_copy_no_rows(self):
    """A decode program that carries a queue (`device_refill`) starts a taken episode's row in place and puts
    back the slots it wrote with a loop over the rows that took one: its temporaries exceed the plain program's
    by less than an eighth of one row's window of keys and values (~2% here). Gathering the row and scattering it
    back, and putting back the taken slots of every row at once, each materialized copies: ~75% of a row's window
    here; SmolLM2, 16 rows at 616 slots, 83 MB of temporaries against 12 MB, fresh pages at every call. A model of
    8 layers (the copies are per layer)."""
    cfg = get_model_config('tiny', vocab_size=self.tok.vocab_size, num_layers=8, embed_dim=32, mlp_dim=64,
                           head_dim=8, eos_ids=(1,))
    backend = rollout.SamplerBackend(Decoder(cfg, rngs=nnx.Rngs(0)), stop_ids=(1,), pad_id=self.tok.pad_id,
                                     max_total_len=128, min_rows=8)
    slots = SlotSampler(backend.sampler, num_slots=8, max_seq_len=1024, stop_ids=(), pad_id=self.tok.pad_id,
                        chunk_buckets=(16,), decode_steps=4, num_windows=2, num_admit_windows=2, device_refill=True)
    r, w = 8, slots.windows[-1]
    zeros = np.zeros((r,), np.int32)
    st = slots._static(_GREEDY, w)  # pylint: disable=protected-access

    def temp(queue):
      window = slots._new_window(r, w)  # pylint: disable=protected-access
      cache = slots._cache  # pylint: disable=protected-access
      return programs.decode_program.lower(
          st, 4, None, backend.sampler.snapshot.weights, cache, np.full((r,), 8, np.int32), zeros,
          np.zeros((r,), bool), zeros, zeros, zeros.astype(np.uint32), np.int32(r + 1), queue,
          window).compile().memory_analysis().temp_size_in_bytes

    queue = slots._queue(w, [], np.zeros((r,), bool))  # pylint: disable=protected-access
    self.assertIsNotNone(queue)
    row_window = sum(x.nbytes for x in jax.tree.leaves(slots._new_window(1, w)))  # pylint: disable=protected-access
    self.assertLess(temp(queue) - temp(None), row_window / 8)

  def test_new_prompts_start_from_the_shared_prefix_cache(self):
    """Prompts with a common head (a chat template's system prompt): the slot of a new episode starts from the
    head's cache and only the rest is written; the tokens and log-probs are the plain forward's, also after a
    weight swap (the head's cache is recomputed) and after a prompt that shares less (the prefix shrinks), and
    they equal those of a sampler without the prefix cache. Each pair of prompts goes through `step`: the
    second is admitted while the first decodes, and the host's fill mirrors the cache's index."""
    head = [3 + (7 * i) % 40 for i in range(12)]
    prompts = [head + [50, 51], head + list(range(60, 70)), head + [70], head[:9] + [80, 81], head + [90, 91, 92]]
    other = helpers.small_model(self.tok.vocab_size, seed=9)
    self.addCleanup(self.backend.update_weights, self.model, version=4)

    def play(prefix_cache):
      self.backend.update_weights(self.model, version=4)
      slots = SlotSampler(self.backend.sampler, num_slots=2, max_seq_len=128, stop_ids=(), pad_id=self.tok.pad_id,
                          chunk_buckets=(16,), decode_steps=4, num_windows=2, num_admit_windows=2,
                          prefix_cache=prefix_cache)
      slots.warmup(_GREEDY)
      compiled = slots.num_compiled()
      admit_calls = 0
      admit = slots._admit

      def counted_admit(*args):
        nonlocal admit_calls
        admit_calls += 1
        return admit(*args)

      slots._admit = counted_admit
      seqs, lps, models, prefixes = [], [], [], []

      def call(got, fn, *args):
        got += fn(*args)
        used = [s for s in range(2) if slots.has_pending[s]]
        np.testing.assert_array_equal(slots.fill[used], np.asarray(slots._cache.index)[used])

      for first in range(0, len(prompts), 2):
        if first == 4:
          self.backend.update_weights(other, version=5)  # The last prompt runs on other weights, same prefix.
        batch = prompts[first:first + 2]
        for slot in range(2):
          slots.release(slot)
        got = []
        for j, p in enumerate(batch):  # The second admitted while the first decodes.
          call(got, slots.step, [Admission(j, p, new=True, budget=6, seed=j)], _GREEDY)
        prefixes.append(slots.prefix)
        while slots.active.any():
          call(got, slots.decode, _GREEDY)
        for j, p in enumerate(batch):
          seqs.append(p + [x for r in got if r.slot == j for x in r.ids])
          lps.append([x for r in got if r.slot == j for x in r.logprobs])
          models.append(self.model if first < 4 else other)
      self.assertEqual(slots.num_compiled(), compiled)
      return seqs, lps, models, prefixes, admit_calls

    seqs, lps, models, prefixes, admit_calls = play(True)
    self.assertEqual(prefixes, [tuple(head), tuple(head[:9]), tuple(head[:9])])
    self.assertEqual(admit_calls, 5)
    for seq, lp, model, prompt in zip(seqs, lps, models, prompts):
      self.assertLen(seq, len(prompt) + 6)
      logits = np.asarray(_logits(model, _padded([types.SimpleNamespace(tokens=seq)])))[0]
      pos = np.arange(len(prompt), len(seq))
      np.testing.assert_array_equal(np.asarray(seq)[pos], np.argmax(logits[pos - 1], axis=-1))
      log_pi = logits[pos - 1] - np.log(np.exp(logits[pos - 1]).sum(-1, keepdims=True))
      np.testing.assert_allclose(lp, log_pi[np.arange(len(pos)), np.asarray(seq)[pos]], atol=2e-4)
    plain_seqs, plain_lps, _, plain_prefixes, plain_admits = play(False)
    self.assertEqual(plain_prefixes, [(), (), ()])
    self.assertEqual(plain_admits, 5)
    self.assertEqual(plain_seqs, seqs)
    np.testing.assert_allclose(np.concatenate(plain_lps), np.concatenate(lps), atol=1e-5)

  def _placed_run(self, state_sharding, **kwargs):
    """A 2-slot sampler over weights placed with `state_sharding` (a model-state tree or one sharding), warmed
    up, then admissions from the shared prefix and decode chunks. Returns the
    tokens, the programs lowered after the warm-up and the sampler."""
    model = helpers.small_model(self.tok.vocab_size, seed=3)
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_sharding(state)))
    sampler = rollout.SamplerBackend(model, stop_ids=(), pad_id=self.tok.pad_id, max_total_len=128).sampler
    self.assertTrue(jax.tree.leaves(sampler.snapshot.weights)[0].committed)
    slots = SlotSampler(sampler, num_slots=2, max_seq_len=128, stop_ids=(), pad_id=self.tok.pad_id,
                        chunk_buckets=(16,), decode_steps=4, num_windows=1, num_admit_windows=1, **kwargs)
    slots.warmup(_GREEDY)
    head = [3 + (7 * i) % 40 for i in range(12)]
    got = []
    with helpers.lowerings() as lowered:
      for j, rest in enumerate(([50, 51], [52], list(range(60, 80)))):  # The last one's rest: in two pieces.
        slot = j % 2
        slots.release(slot)
        got += slots.step([Admission(slot, head + rest, new=True, budget=5, seed=j)], _GREEDY)
        while slots.active.any():
          got += slots.decode(_GREEDY)
    self.assertEqual(slots.prefix, tuple(head))
    ids = [r.ids for r in got]
    self.assertLen([x for r in ids for x in r], 15)
    return ids, lowered, slots

  def test_weights_committed_to_a_device_compile_nothing_after_the_warm_up(self):
    """Weights placed on a device (an actor's own, loaded weights) are committed, and so are the programs'
    outputs from them (the cache after a call, the shared prefix's cache); a program is keyed by its arguments'
    placement too. After the warm-up, admissions from the shared prefix and decode chunks lower no program
    (`helpers.lowerings`: what jax turns into XLA modules, whether a compilation cache then has it or not)."""
    _, lowered, _ = self._placed_run(lambda state: jax.devices()[0])
    self.assertEqual(lowered, [])

  def test_weights_on_an_actor_mesh_compile_nothing_after_the_warm_up(self):
    """Weights split over a 2-device actor mesh by the config's rules (the trainer's `mesh.actor_devices=2`):
    the cache goes replicated on that mesh, or where `cache_sharding` says (kv heads over `tensor`, as the
    trainer asks); either way every program keeps its output cache there, and nothing lowers after the warm-up
    (before the fix each program lowered again at its first call with a cache an earlier call made). The tokens
    are those of the same weights on one device."""
    mesh = parallel.make_actor_mesh(jax.devices()[:2])
    rules = base_config.get_config().mesh.rules
    on_mesh = lambda state: parallel.tree_shardings(state, mesh, rules)
    want, _, _ = self._placed_run(lambda state: jax.devices()[0])
    kv = NamedSharding(mesh, PartitionSpec(None, 'tensor'))
    for cache_sharding, spec in ((None, PartitionSpec()), (kv, PartitionSpec(None, 'tensor'))):
      with self.subTest(cache_sharding=cache_sharding):
        got, lowered, slots = self._placed_run(on_mesh, cache_sharding=cache_sharding)
        self.assertEqual(lowered, [])
        self.assertEqual(got, want)
        cache = slots._cache  # pylint: disable=protected-access
        for x, want_spec in ((cache.k[0], spec), (cache.valid, PartitionSpec()), (cache.index, PartitionSpec())):
          self.assertTrue(x.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), x.ndim), x.sharding)

  def test_a_weight_swap_mid_run_is_recorded_per_token(self):
    other = helpers.small_model(self.tok.vocab_size, seed=9)
    self.addCleanup(self.backend.update_weights, self.model, version=4)
    # Swapped before the 4th runner step: slot 0's first episode is in its second turn then.
    follower = _SwapAfter(self.backend, other, 5, at=4)
    got = self._continuous(range(len(self.examples)), _GREEDY, follower=follower)
    both = 0
    for t in got:
      versions = t.info['token_versions']
      self.assertLen(versions, t.num_action_tokens)
      self.assertEqual(versions, sorted(versions))
      self.assertEqual(t.policy_version, versions[0])
      both += len(set(versions)) == 2
      # Each turn's version is the oldest of its tokens'.
      starts = np.cumsum([0] + [len(a) for a in _turn_actions(t)])
      self.assertEqual(t.turn_versions, tuple(versions[s] for s in starts[:-1]))
    self.assertGreaterEqual(both, 1)
    # An episode that started after the swap is exactly the new model's greedy episode.
    late = [t for t in got if t.info['token_versions'][0] == 5]
    self.assertNotEmpty(late)
    log_pi, logits = _forward_logprobs(other, late), _forward_logits(other, late)
    for i, t in enumerate(late):
      m, n = t.action_mask, len(t.tokens)
      np.testing.assert_allclose(t.policy_logprobs[m], log_pi[i, :n][m], atol=2e-4)
      np.testing.assert_array_equal(t.tokens[m], np.argmax(logits[i, :n - 1], axis=-1)[m[1:]])

  def test_env_steps_do_not_block_other_slots(self):
    """Episode 0's env step waits until episode 1 has finished: only a runner that keeps decoding other slots
    while an env step is pending gets there (a static batch would deadlock; the test times out the wait)."""
    released = threading.Event()

    def on_step(env):
      if env.example.uid == '0':
        self.assertTrue(released.wait(timeout=60), 'episode 1 never finished while episode 0 waited')

    task = helpers.EchoTask(self.examples, 'message', self.stop_texts, 3, on_step)
    runner = ContinuousRunner(self.slots, self.tok, limits=self.limits, decoding=_GREEDY)
    self.addCleanup(runner.close)
    runner.submit([task.make_env(self.examples[0]), task.make_env(self.examples[2])], seeds=[0, 1],
                  keys=['slow', 'fast'])
    finished = []
    while runner.pending:
      for key, _ in runner.step():
        finished.append(key)
        if key == 'fast':
          released.set()
    self.assertEqual(finished, ['fast', 'slow'])

  def test_dropped_episodes_free_their_slots_and_the_others_run_on(self):
    """`drop_older_than(5)` ends the episodes whose first token came from version 4: one whose env step is still
    running keeps its slot until the step ends (its result discarded), while the other slot runs the episodes
    that come after, at version 5, exactly as the static sampler plays them. Once episode 0's env step is
    submitted the loop waits for it to begin: however the env threads are scheduled, episode 1 is still running
    then."""
    stepping, released = threading.Event(), threading.Event()
    self.addCleanup(released.set)

    def on_step(env):
      if env.example.uid == '0':
        stepping.set()
        self.assertTrue(released.wait(timeout=60), 'never released')

    task = helpers.EchoTask(self.examples, 'message', self.stop_texts, 3, on_step)
    runner = ContinuousRunner(self.slots, self.tok, limits=self.limits, decoding=_GREEDY)
    self.addCleanup(runner.close)
    self.addCleanup(self.backend.update_weights, self.model, version=4)
    runner.submit([task.make_env(self.examples[i]) for i in (0, 1, 2, 3)], seeds=[0, 1, 2, 3], keys=[0, 1, 2, 3])
    done = {}
    for _ in range(100):  # Episodes 0 and 1 start at version 4; run until episode 0's first env step is running.
      done.update(runner.step())
      # pylint: disable-next=protected-access
      stepping_slots, running = {s for s, _ in runner._env_steps.values()}, runner._running
      if any(run.key == 0 for s, run in running.items() if s in stepping_slots):
        self.assertTrue(stepping.wait(timeout=60), "episode 0's env step never began")
      if stepping.is_set():
        break
    self.assertTrue(stepping.is_set())
    self.assertEmpty(done)
    self.backend.update_weights(self.model, version=5)  # The same weights: the episodes are the static ones.
    self.assertEqual(runner.drop_older_than(4), [])
    dropped = runner.drop_older_than(5)
    self.assertIn(0, dropped)
    self.assertSameElements(dropped, [0, 1])
    self.assertTrue(runner.busy)
    for _ in range(500):  # Episodes 2 and 3 run in the one free slot while episode 0's env step holds the other.
      done.update(runner.step())
      if len(done) == 2:
        break
    self.assertSameElements(done, [2, 3])
    self.assertEqual(runner.free_slots, 1)
    released.set()
    for _ in range(500):
      if not runner.busy:
        break
      done.update(runner.step())
    self.assertFalse(runner.busy)
    self.assertSameElements(done, [2, 3])  # Episode 0's env step ended: its result was discarded.
    self.assertEqual(runner.free_slots, 2)
    self.assertFalse(self.slots.active.any())
    n = len(self.examples)  # The greedy test's static call (its compiled shapes).
    want = rollout.run_episodes(self.backend, self.tok, self._envs(range(n)), limits=self.limits, decoding=_GREEDY,
                                seeds=list(range(n)))
    for key in (2, 3):
      np.testing.assert_array_equal(done[key].tokens, want[key].tokens)
      self.assertEqual(set(done[key].info['token_versions']), {5})

  def test_actor_drops_whole_groups_bound_to_be_stale(self):
    """With `max_staleness=1`, once version 6 is published every group with a rollout started at version 4 is
    dropped whole (its finished, running and waiting rollouts) and counted; the next prompt plays at version 6.
    Exactly one rollout of prompt 0 finishes before the drop, however the env threads are scheduled (two
    rollouts finishing in one step would complete the group): the second of its rollouts to reach an env step
    waits there until the drop, and the first waits until the second reaches one (then it goes on and finishes)
    or until the drop (a rollout whose turn ends by its token budget takes no env step and finishes alone)."""
    self.addCleanup(self.backend.update_weights, self.model, version=4)
    stepped, lock = [], threading.Lock()
    released, lead_free = threading.Event(), threading.Event()  # The drop; the first stepper may go on.

    def release():
      released.set()
      lead_free.set()

    self.addCleanup(release)

    def on_step(env):
      if env.example.uid == '0':
        with lock:
          if env not in stepped:
            stepped.append(env)
          lead = env is stepped[0]
          if len(stepped) > 1:
            lead_free.set()
        self.assertTrue((lead_free if lead else released).wait(timeout=60), 'never released')

    task = helpers.EchoTask(self.examples, 'message', self.stop_texts, 3, on_step)
    publisher = WeightPublisher()
    publisher.publish(self.model, version=4)
    prompts = prompts_lib.PromptSource(itertools.cycle(self.examples))
    actor = actor_lib.Actor(self.slots, self.tok, task, prompts, publisher=publisher, limits=self.limits,
                            settings=GenerateConfig(decoding=_SAMPLED, batch_size=2), seed=1, group_size=2,
                            max_staleness=1)
    actor.submit(2)  # Prompts 0 and 1: four rollouts in two slots.
    for _ in range(200):  # Until one rollout of prompt 0 has finished and its group waits for the other.
      self.assertEmpty(actor.collect())
      if actor._groups:  # pylint: disable=protected-access
        break
    self.assertEqual(list(actor._groups), [0])  # pylint: disable=protected-access
    self.assertEqual(actor.drop_stale(), 0)  # Version 4 is not past the bound yet.
    publisher.publish(self.model, version=5)
    self.assertEqual(actor.drop_stale(), 0)  # 5 - 4 <= max_staleness.
    publisher.publish(self.model, version=6)
    # Prompt 0: one finished rollout, one running; prompt 1: one started at version 4 (in the freed slot), one
    # waiting. Both groups are bound to be stale: all four trajectories are dropped.
    self.assertEqual(actor.drop_stale(), 4)
    self.assertEqual(actor.dropped_stale, 4)
    self.assertFalse(actor.runner.pending)
    self.assertEmpty(actor._groups)  # pylint: disable=protected-access
    release()  # The dropped rollout's env step ends; its slot comes back.
    actor.submit(1)
    items = []
    for _ in range(500):
      items += actor.collect()
      if not actor.runner.busy:
        break
    (item,) = items
    self.assertEqual([t.info['prompt_number'] for t in item], [2, 2])
    self.assertEqual([t.policy_version for t in item], [6, 6])
    self.assertEqual(actor.drop_stale(), 0)

  def test_an_async_actor_takes_the_newest_computed_weights(self):
    """Published weights still being computed (an update in flight): an async actor (`wait_for_weights=False`)
    goes on with the newest computed version, even one a newer version in flight has overtaken; a sync actor
    takes the newest at once. The publisher's readiness is that of the arrays: False for the output of a program
    still running."""
    self.addCleanup(self.backend.update_weights, self.model, version=4)
    publisher = _HeldPublisher()
    publisher.publish(self.model, version=4)
    prompts = prompts_lib.PromptSource(itertools.cycle(self.examples))
    actors = {wait: actor_lib.Actor(self.backend, self.tok, self.task, prompts, publisher=publisher,
                                    limits=self.limits, settings=GenerateConfig(decoding=_GREEDY, continuous=False),
                                    seed=0, wait_for_weights=wait)
              for wait in (False, True)}
    publisher.held = {7, 9}  # Still being computed.
    publisher.publish(self.model, version=7)
    self.assertFalse(actors[False].backend.newer())
    actors[False].backend.refresh()
    self.assertEqual(self.backend.sampler.version, 4)
    self.assertTrue(actors[True].backend.newer())
    publisher.publish(self.model, version=9)
    self.assertEqual((publisher.version, publisher.computed_version), (9, 4))
    publisher.held = {9}  # 7 is computed; 9 still is not.
    self.assertTrue(actors[False].backend.newer())
    actors[False].backend.refresh()
    self.assertEqual(self.backend.sampler.version, 7)
    publisher.held = set()
    actors[False].backend.refresh()
    self.assertEqual(self.backend.sampler.version, 9)
    self.assertLen(publisher._published, 1)  # pylint: disable=protected-access  (older copies let go)
    # The real readiness: a state computed by a program still running. Its length is calibrated on this machine
    # (~1.5 s: a loop of small sequential matmuls, with a trip count that is an argument, so no recompile); what
    # is asserted is bracketed by the array's own readiness read after the publisher's answer. An answer read
    # after the program ended (this thread descheduled that long) tells nothing: that try is repeated with a
    # program 4x longer, never counted as a pass.
    spin = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, a: jnp.tanh(a @ a), x))
    x = jnp.full((self.model.cfg.embed_dim,) * 2, 1e-3)  # Row 0 of its result: a final-norm scale.
    spin(x, 10).block_until_ready()  # Compiled.
    start = time.perf_counter()
    spin(x, 200).block_until_ready()
    n = int(200 * 1.5 / max(time.perf_counter() - start, 1e-4))
    for _ in range(3):
      real = WeightPublisher()
      real.publish(self.model, version=1)
      slow = nnx.clone(self.model)  # Its own variables: the class's model stays as it is.
      slow.final_norm.scale.value = spin(x, n)[0]  # Dispatched: its value is a future for ~1.5 s.
      real.publish(slow, version=2)
      answer = (real.version, real.computed_version, real.latest(computed=True)[1])
      if not slow.final_norm.scale.value.is_ready():
        break
      jax.block_until_ready(slow.final_norm.scale.value)
      n *= 4
    else:
      self.fail('the program ended before the publisher was asked, 3 times')
    self.assertEqual(answer, (2, 1, 1))
    jax.block_until_ready(real.latest()[0].weights)
    self.assertEqual(real.computed_version, 2)

  def test_actor_streams_whole_groups_of_the_static_episodes(self):
    """The Actor with `continuous=True`: `play` (sync mode) and its thread's streaming loop (async mode) give
    whole groups, in prompt order for `play`, with the static sampler's greedy episodes."""
    n = len(self.examples)
    want = rollout.run_episodes(self.backend, self.tok, self._envs(range(n)), limits=self.limits,
                                decoding=_GREEDY, seeds=list(range(n)))
    publisher = WeightPublisher()
    publisher.publish(self.model, version=4)
    prompts = prompts_lib.PromptSource(itertools.cycle(self.examples))
    actor = actor_lib.Actor(self.slots, self.tok, self.task, prompts, publisher=publisher, limits=self.limits,
                            settings=GenerateConfig(decoding=_GREEDY, batch_size=2), seed=0, group_size=2)
    items = actor.play(2)
    queue = _ListQueue(stop_after=3)
    thread = actor_lib.ActorThread(actor, queue)
    queue.thread = thread
    thread.run()  # In this thread: returns when the stub queue has 3 items.
    self.assertIsNone(thread.error)
    items += queue.items
    self.assertEqual([it[0].info['prompt_number'] for it in items[:2]], [0, 1])
    self.assertEqual(sorted(it[0].info['prompt_number'] for it in items[2:]), [2, 3, 4])
    for item in items:
      self.assertLen(item, 2)
      number = item[0].info['prompt_number']
      for t in item:
        self.assertEqual(t.group_id, number)
        np.testing.assert_array_equal(t.tokens, want[number % n].tokens)
    self.assertEqual(actor.generated_tokens, sum(t.num_action_tokens for it in items for t in it))
    self.assertEqual(queue.reserved, 2 * 5 - 2 * 2)  # Every started prompt reserved its group's room.
    self.assertEqual(self.slots.num_compiled(), self.compiled)


def _checked_steps(slots):
  """Checks every `slots.step` call: after it, a slot's cache holds exactly the host's count of its episode's
  tokens (nothing of an earlier episode). Returns the list the queue entries taken on the device go to."""
  step, taken = slots.step, []

  def checked(*args, **kwargs):
    out = step(*args, **kwargs)
    taken.extend(r.queued for r in out if r.queued is not None)
    held = slots.has_pending
    np.testing.assert_array_equal(np.asarray(slots._cache.index)[held], slots.fill[held])
    np.testing.assert_array_equal(np.asarray(slots._cache.valid).sum(1)[held], slots.fill[held])
    return out

  slots.step = checked
  return taken


class _HeldPublisher(WeightPublisher):
  """A publisher whose versions in `held` read as still being computed."""

  held = frozenset()

  def _computed(self, entry):
    return entry.version not in self.held and super()._computed(entry)


class _ListQueue:
  """A stub `TrajectoryQueue`: unbounded, records reservations and items; stops the thread after N items."""

  def __init__(self, stop_after):
    self.items, self.reserved, self.stop_after, self.thread = [], 0, stop_after, None

  def reserve(self, n, timeout=None):
    del timeout
    self.reserved += n
    return True

  def release(self, n):
    self.reserved -= n

  def put(self, item, timeout=None, *, reserved=False):
    del timeout, reserved
    self.items.append(item)
    if len(self.items) >= self.stop_after:
      self.thread.stop()
    return True


def _turn_actions(t):
  """The action tokens of each turn (runs of the action mask)."""
  out, cur = [], []
  for tok, a in zip(t.tokens, t.action_mask):
    if a:
      cur.append(tok)
    elif cur:
      out.append(cur)
      cur = []
  return out + ([cur] if cur else [])


def _padded(trajs, rows=8, length=128):
  out = np.zeros((rows, length), np.int32)  # One shape for every call (one compile).
  for i, t in enumerate(trajs):
    out[i, :len(t.tokens)] = t.tokens
  return out


@nnx.jit(static_argnames=('temperature',))
def _token_logprobs(model, tokens, temperature=1.0):
  return logprobs_lib.token_logprobs(model, tokens, temperature=temperature)


def _forward_logprobs(model, trajs, temperature=1.0):
  """`models.logprobs.token_logprobs` of the right-padded trajectories (causal: padding changes nothing)."""
  return np.asarray(_token_logprobs(model, _padded(trajs), temperature=temperature))


@nnx.jit
def _logits(model, tokens):
  return model(tokens)


def _forward_logits(model, trajs):
  return np.asarray(_logits(model, _padded(trajs)))


if __name__ == '__main__':
  absltest.main()
