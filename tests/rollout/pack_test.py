"""`rollout.pack`: hand-built trajectories against hand-written batches; drops, groups and errors."""

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax import structs
from sao_jax.envs import calculator
from sao_jax.tokenizers import CharTokenizer
from tests.rollout import helpers


def _traj(tokens, mask, logp, reward, **kwargs):
  return structs.Trajectory(tokens=np.asarray(tokens), action_mask=np.asarray(mask, bool),
                          behavior_logprobs=np.asarray(logp, np.float32), reward=reward, **kwargs)


# Row A: prompt 2, action 2, observation 1, action 1, observation 1 (reward on position 5). Row B: prompt 1,
# action 3 (reward on its last token).
_A = dict(tokens=[5, 6, 7, 8, 9, 10, 15], mask=[0, 0, 1, 1, 0, 1, 0], logp=[0, 0, -0.1, -0.2, 0, -0.3, 0],
          reward=1.0)
_B = dict(tokens=[11, 12, 13, 14], mask=[0, 1, 1, 1], logp=[0, -0.4, -0.5, -0.6], reward=-0.5)


class PackTest(parameterized.TestCase):

  def test_layout_against_a_hand_written_batch(self):
    a = _traj(**_A, group_id=-1, policy_version=3, turn_versions=(3, 4))
    b = _traj(**_B, truncated=False, policy_version=2)
    packed = rollout.pack([a, b], seq_buckets=(4, 8, 16), pad_id=0, rows=3)
    batch = packed.batch
    self.assertIsInstance(batch, structs.Batch)
    self.assertEqual(batch.shape, (3, 8))  # The smallest bucket >= 7 tokens; one padding row.
    np.testing.assert_array_equal(batch.tokens, [[5, 6, 7, 8, 9, 10, 15, 0], [11, 12, 13, 14, 0, 0, 0, 0],
                                                 [0] * 8])
    np.testing.assert_array_equal(batch.action_mask, [[0, 0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_allclose(batch.behavior_logprobs, [[0, 0, -0.1, -0.2, 0, -0.3, 0, 0],
                                                         [0, -0.4, -0.5, -0.6, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(batch.rewards, [[0, 0, 0, 0, 0, 1.0, 0, 0], [0, 0, 0, -0.5, 0, 0, 0, 0], [0] * 8])
    np.testing.assert_array_equal(batch.segment_mask[:, 0], [1, 1, 0])
    np.testing.assert_array_equal(batch.truncated[:, 0], [False, False, False])
    np.testing.assert_array_equal(batch.group_ids[:, 0], [-1, -1, -1])
    np.testing.assert_array_equal(batch.policy_version[:, 0], [3, 2, 0])
    np.testing.assert_array_equal(batch.segment_ids, [[1] * 7 + [0], [1] * 4 + [0] * 4, [0] * 8])
    for k, (_, dtype) in structs.BATCH_FIELDS.items():
      self.assertEqual(getattr(batch, k).dtype, dtype, k)
      self.assertEqual(getattr(batch, k).shape, structs.Batch.field_shape(k, 3, 8, 1), k)
    self.assertEqual((packed.kept, packed.dropped), ([0, 1], {}))
    # rows=None: exactly the kept rows.
    self.assertEqual(rollout.pack([a, b], seq_buckets=(16, 8), pad_id=0).batch.shape, (2, 8))

  def test_truncated_rows_bootstrap_drop_or_end(self):
    ok = _traj(**_A)
    cut = _traj(**{**_B, 'reward': 0.0}, truncated=True)  # A bootstrappable cut (e.g. mid-turn).
    lost = _traj(**{**_B, 'reward': 0.0}, truncated=True, bootstrappable=False, info={'cut_by': 'max_seq_len'})
    failed = _traj(**{**_A, 'reward': 0.0}, info={'error': 'timeout'})
    packed = rollout.pack([ok, cut, lost, failed], seq_buckets=(8,), pad_id=0, rows=4)
    self.assertEqual(packed.kept, [0, 1])
    self.assertEqual(packed.dropped, {'not_bootstrappable': 1, 'env_error': 1})
    np.testing.assert_array_equal(packed.batch.truncated[:, 0], [False, True, False, False])
    np.testing.assert_array_equal(packed.batch.segment_mask[:, 0], [1, 1, 0, 0])
    packed = rollout.pack([ok, cut, lost], seq_buckets=(8,), pad_id=0, truncation='drop')
    self.assertEqual(packed.kept, [0])
    self.assertEqual(packed.dropped, {'truncated': 2})
    packed = rollout.pack([ok, cut, lost, failed], seq_buckets=(8,), pad_id=0, truncation='terminal')
    self.assertEqual((packed.kept, packed.dropped), ([0, 1, 2], {'env_error': 1}))  # A cut ends it: nothing to bootstrap.
    np.testing.assert_array_equal(packed.batch.truncated[:, 0], [False, True, True])

  def test_runner_truncations_pack_or_drop(self):
    """The runner's three kinds of cut: the turn-limit and length cuts pack, the observation overflow drops."""
    tok = CharTokenizer()
    task = envs.get_task(ml_collections.ConfigDict(
        {'name': 'calculator', 'max_turns': 2, 'eval_size': 2, 'kwargs': {}}))
    ex = task.eval_set()[0]
    call, _ = calculator.demo_actions(ex)
    prompt, _ = tok.apply_chat_template(ex.messages(), add_generation_prompt=True)

    def play(texts, limits, stop=True):
      gen, _ = helpers.scripted(tok, texts, stop=stop)
      return rollout.run_episode(task.make_env(ex), tok, gen, limits=limits)

    turn_limit = play([call, call], rollout.EpisodeLimits(2, 64, 512))
    length_cut = play(['<answer>1234567890'], rollout.EpisodeLimits(2, 4, 512), stop=False)
    overflow = play([call], rollout.EpisodeLimits(2, 64, len(prompt) + len(tok.encode(call)) + 2))
    self.assertEqual([t.info['cut_by'] for t in (turn_limit, length_cut, overflow)],
                     ['max_turns', 'max_new_tokens', 'max_seq_len'])
    packed = rollout.pack([turn_limit, length_cut, overflow], seq_buckets=(512,), pad_id=tok.pad_id, rows=3)
    self.assertEqual((packed.kept, packed.dropped), ([0, 1], {'not_bootstrappable': 1}))
    np.testing.assert_array_equal(packed.batch.truncated[:, 0], [True, True, False])
    np.testing.assert_array_equal(packed.batch.rewards, 0.0)
    # The turn-limit row ends on its final observation (non-action), the length-cut row on an action token.
    lengths = [len(turn_limit.tokens), len(length_cut.tokens)]
    self.assertEqual(packed.batch.action_mask[0, lengths[0] - 1], 0.0)
    self.assertEqual(packed.batch.action_mask[1, lengths[1] - 1], 1.0)

  def test_groups(self):
    rows = [_traj(**_A, group_id=g) for g in (7, 7, 3, 3)]
    packed = rollout.pack(rows, seq_buckets=(8,), pad_id=0, rows=6, group_size=2)
    np.testing.assert_array_equal(packed.batch.group_ids[:, 0], [7, 7, 3, 3, -1, -1])
    # A group that loses a row is dropped whole.
    broken = list(rows)
    broken[3] = _traj(**_A, group_id=3, truncated=True, bootstrappable=False)
    packed = rollout.pack(broken, seq_buckets=(8,), pad_id=0, rows=4, group_size=2)
    self.assertEqual(packed.kept, [0, 1])
    self.assertEqual(packed.dropped, {'group_incomplete': 1, 'not_bootstrappable': 1})
    with self.assertRaisesRegex(ValueError, 'not one whole group'):
      rollout.pack([rows[0], rows[2], rows[1], rows[3]], seq_buckets=(8,), pad_id=0, group_size=2)
    with self.assertRaisesRegex(ValueError, 'not one whole group'):  # Group 7 twice: not contiguous.
      rollout.pack(rows[:2] + rows[:2], seq_buckets=(8,), pad_id=0, group_size=2)
    with self.assertRaisesRegex(ValueError, 'not whole groups'):
      rollout.pack(rows[:3], seq_buckets=(8,), pad_id=0, group_size=2)
    with self.assertRaisesRegex(ValueError, 'rows=5 is not a multiple'):
      rollout.pack(rows, seq_buckets=(8,), pad_id=0, rows=5, group_size=2)

  def test_errors(self):
    a = _traj(**_A)
    with self.assertRaisesRegex(ValueError, r'7 tokens does not fit config.trainer.seq_buckets=\(4, 5\)'):
      rollout.pack([a], seq_buckets=(5, 4), pad_id=0)
    with self.assertRaisesRegex(ValueError, '2 trajectories to pack into 1 rows'):
      rollout.pack([a, a], seq_buckets=(8,), pad_id=0, rows=1)
    with self.assertRaisesRegex(ValueError, 'greedy episodes are for eval only'):
      rollout.pack([_traj(**_A, greedy=True)], seq_buckets=(8,), pad_id=0)
    with self.assertRaisesRegex(ValueError, 'no action token'):
      rollout.pack([_traj([1, 2], [0, 0], [0, 0], 1.0)], seq_buckets=(8,), pad_id=0)
    with self.assertRaisesRegex(ValueError, 'starting at position 0 starts with an action token'):
      rollout.pack([_traj([1, 2], [1, 1], [-0.1, -0.1], 1.0)], seq_buckets=(8,), pad_id=0)

  def test_packed_layout_first_fit_decreasing(self):
    # Lengths 7, 4, 4, 3, 3, 2 (prompt + action each, reward on the last token) into rows of 8 tokens.
    lens = [4, 7, 3, 4, 2, 3]
    trajs = [_traj(list(range(10 + i, 10 + i + n)), [0] + [1] * (n - 1), [0] + [-0.1] * (n - 1), float(i + 1),
                   group_id=i // 2, policy_version=i, truncated=(i == 3)) for i, n in enumerate(lens)]
    packed = rollout.pack(trajs, seq_buckets=(8, 16), pad_id=0, packing='fixed', pack_len=8, segments=3,
                          group_size=2, row_multiple=2)
    batch = packed.batch
    # FFD: 7 -> row 0; 4 (#0) -> row 1; 4 (#3) -> row 1; 3 (#2) -> row 2; 3 (#5) -> row 2; 2 (#4) -> row 2.
    self.assertEqual(batch.shape, (4, 8))  # 3 rows needed, rounded up to a multiple of 2.
    self.assertEqual(packed.kept, [1, 0, 3, 2, 5, 4])
    np.testing.assert_array_equal(batch.segment_ids, [[1] * 7 + [0], [1] * 4 + [2] * 4, [1, 1, 1, 2, 2, 2, 3, 3],
                                                      [0] * 8])
    np.testing.assert_array_equal(batch.tokens[1], [10, 11, 12, 13, 13, 14, 15, 16])
    np.testing.assert_array_equal(batch.rewards[2], [0, 0, 3, 0, 0, 6, 0, 5])
    np.testing.assert_array_equal(batch.segment_mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0]])
    np.testing.assert_array_equal(batch.group_ids, [[0, -1, -1], [0, 1, -1], [1, 2, 2], [-1, -1, -1]])
    np.testing.assert_array_equal(batch.truncated[1], [False, True, False])
    np.testing.assert_array_equal(batch.policy_version[2], [2, 5, 4])
    self.assertAlmostEqual(rollout.padding_fraction(batch), 9 / 32)
    # 'ffd' picks the bucket of least area: 4 x 8 (3 rows rounded up), 2 x 12 (7 + 4, 4 + 3 + 3 + 2), 2 x 32.
    ffd = rollout.pack(trajs, seq_buckets=(8, 12, 32), pad_id=0, packing='ffd', segments=8, group_size=2,
                       row_multiple=2).batch
    self.assertEqual(ffd.shape, (2, 12))
    # A row count given (processes agreeing on one): empty rows fill it; fewer than needed is refused.
    self.assertEqual(rollout.pack(trajs, seq_buckets=(8,), pad_id=0, packing='fixed', segments=3, rows=6,
                                  row_multiple=2).batch.shape, (6, 8))
    with self.assertRaisesRegex(ValueError, 'need 3 packed rows'):
      rollout.pack(trajs, seq_buckets=(8,), pad_id=0, packing='fixed', segments=3, rows=2)
    self.assertEqual(int(ffd.segment_mask.sum()), 6)
    with self.assertRaisesRegex(ValueError, 'does not fit'):
      rollout.pack(trajs, seq_buckets=(8,), pad_id=0, packing='fixed', pack_len=6, segments=3)

  def test_allowed_rows(self):
    self.assertEqual([rollout.allowed_rows(n, 1) for n in range(1, 20)], list(range(1, 17)) + [18, 18, 20])
    self.assertEqual([rollout.allowed_rows(n, 1) for n in (33, 37, 64, 65)], [36, 40, 64, 72])
    self.assertEqual([rollout.allowed_rows(n, 3) for n in (0, 1, 3, 4, 48, 49)], [3, 3, 3, 6, 48, 54])
    for n in range(1, 300):  # Under 1/8 of the rows added, at most 8 counts per doubling.
      self.assertLess(rollout.allowed_rows(n, 1) - n, max(n / 8, 1))
    self.assertEqual(len({rollout.allowed_rows(n, 1) for n in range(129, 257)}), 8)

  def test_check_batch_catches_broken_segments(self):
    trajs = [_traj(**_A), _traj(**_B)]
    good = rollout.pack(trajs, seq_buckets=(16,), pad_id=0, packing='fixed', segments=2).batch
    rollout.check_batch(good)
    for seg in ([1] * 7 + [0] + [2] * 4 + [0] * 4, [2] * 7 + [1] * 4 + [0] * 5, [1] * 7 + [3] * 4 + [0] * 5):
      with self.assertRaisesRegex(ValueError, 'not contiguous runs'):
        rollout.check_batch(good.replace(segment_ids=np.array([seg], np.int32)))
    with self.assertRaisesRegex(ValueError, 'segment_mask 0 but it has tokens'):
      rollout.check_batch(good.replace(segment_mask=np.array([[1, 0]], np.float32)))

  def test_check_batch_catches_misplaced_rewards(self):
    good = rollout.pack([_traj(**_A), _traj(**_B)], seq_buckets=(8,), pad_id=0, rows=3).batch
    rollout.check_batch(good)
    for (r, t), where in (((0, 4), 'a non-action token'), ((0, 3), 'an earlier action token'),
                          ((2, 0), 'padding'), ((1, 6), 'padding')):
      rewards = np.array(good.rewards)
      rewards[r, t] = 2.0
      with self.assertRaisesRegex(ValueError, f'at \\(row {r}, position {t}\\) sits on {where}'):
        rollout.check_batch(good.replace(rewards=rewards))
    mask = np.array(good.action_mask)
    mask[1] = 0
    with self.assertRaisesRegex(ValueError, 'Row 1 has no action token'):
      rollout.check_batch(good.replace(action_mask=mask))


if __name__ == '__main__':
  absltest.main()
