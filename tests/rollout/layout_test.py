"""The episode -> token layout: masks, behaviour / policy log-probs, versions, message observation tokens."""

from absl.testing import absltest
import numpy as np

from sao_jax import rollout
from sao_jax.tokenizers import CharTokenizer


class EpisodeToTrajectoryTest(absltest.TestCase):

  def test_layout_masks_logprobs_versions_and_reward(self):
    traj = rollout.episode_to_trajectory(
        [1, 2, 3], [rollout.Turn([4, 5], [-0.1, -0.2], [6, 7, 8], version=7),
                    rollout.Turn([9], [-0.3], version=9)], 1.5, group_id=4, info={'k': 1})
    np.testing.assert_array_equal(traj.tokens, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    np.testing.assert_array_equal(traj.action_mask, [0, 0, 0, 1, 1, 0, 0, 0, 1])
    np.testing.assert_allclose(traj.behavior_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, 0, -0.3])
    self.assertIsNone(traj.policy_logprobs)
    self.assertEqual(traj.reward, 1.5)
    self.assertEqual(traj.last_action_index, 8)
    self.assertFalse(traj.truncated)
    self.assertEqual((traj.turn_versions, traj.policy_version), ((7, 9), 7))  # The oldest turn's version.
    self.assertEqual(traj.group_id, 4)
    self.assertEqual(traj.info, {'k': 1})

  def test_truncated_episode_has_no_reward(self):
    traj = rollout.episode_to_trajectory([1], [rollout.Turn([2], [-1.0])], 1.0, truncated=True,
                                         bootstrappable=False)
    self.assertTrue(traj.truncated)
    self.assertFalse(traj.bootstrappable)
    self.assertEqual(traj.reward, 0.0)

  def test_policy_logprobs_follow_the_layout(self):
    traj = rollout.episode_to_trajectory(
        [1], [rollout.Turn([2, 3], [-0.5, -0.6], [4], policy_logprobs=[-1.0, -2.0]),
              rollout.Turn([5], [-0.7], policy_logprobs=[-3.0])], 0.0)
    np.testing.assert_allclose(traj.policy_logprobs, [0, -1.0, -2.0, 0, -3.0])
    np.testing.assert_allclose(traj.behavior_logprobs, [0, -0.5, -0.6, 0, -0.7])

  def test_bad_input(self):
    with self.assertRaisesRegex(ValueError, 'log-probs for 2 action tokens'):
      rollout.episode_to_trajectory([1], [rollout.Turn([2, 3], [-1.0])], 0.0)
    with self.assertRaisesRegex(ValueError, 'at least one action token'):
      rollout.episode_to_trajectory([1], [rollout.Turn([], [])], 0.0)


class MessageObservationTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.tok = CharTokenizer()

  def test_observation_after_a_length_cut_turn_carries_the_missing_stop_token(self):
    hist = [{'role': 'user', 'content': 'q'}]
    ids = rollout.message_observation_ids(self.tok, hist, 'abc', False, {'role': 'tool', 'content': '1'})
    self.assertEqual(self.tok.decode(ids, skip_special_tokens=False), '<|end|><|tool|>1<|end|><|assistant|>')
    ids = rollout.message_observation_ids(self.tok, hist, 'abc', True, {'role': 'tool', 'content': '1'})
    self.assertEqual(self.tok.decode(ids, skip_special_tokens=False), '<|tool|>1<|end|><|assistant|>')

  def test_inconsistent_template_is_refused(self):

    class Shuffling(CharTokenizer):
      """Renders messages in reverse order: longer conversations do not extend shorter ones."""

      def apply_chat_template(self, messages, *, add_generation_prompt):
        return super().apply_chat_template(list(messages)[::-1], add_generation_prompt=add_generation_prompt)

    with self.assertRaisesRegex(ValueError, 'renders conversations inconsistently'):
      rollout.message_observation_ids(Shuffling(), [{'role': 'user', 'content': 'q'}], 'a', True,
                                      {'role': 'tool', 'content': '1'})

  def test_safe_decode_drops_out_of_vocabulary_ids(self):
    ids = self.tok.encode('ab')
    self.assertEqual(rollout.safe_decode(self.tok, [ids[0], self.tok.vocab_size + 3, -1, ids[1]]), 'ab')


if __name__ == '__main__':
  absltest.main()
