"""`SharedPrefix`: the longest common head of the distinct new prompts, against prompts built to have one."""

from absl.testing import absltest

from sao_jax.generate.prefix import MIN_PREFIX, SharedPrefix


class SharedPrefixTest(absltest.TestCase):

  def test_learns_shrinks_and_drops_the_head(self):
    head = list(range(100, 112))  # 12 tokens.
    shared = SharedPrefix(max_len=16)
    shared.learn(head + [1, 2])
    shared.learn(head + [1, 2])  # The same prompt again (a group): nothing to compare yet.
    self.assertEqual(shared.tokens, ())
    shared.learn(head + [3])
    self.assertEqual(shared.tokens, tuple(head))
    self.assertEqual((shared.start(head + [7, 8]), shared.start(head), shared.start([5] + head)), (12, 0, 0))
    shared.learn(head[:9] + [4, 4])  # Shares 9 tokens: the head shrinks to them.
    self.assertEqual(shared.tokens, tuple(head[:9]))
    shared.learn(head + [9])  # Starts with the head: no change (it never grows back).
    self.assertEqual(shared.tokens, tuple(head[:9]))
    shared.learn(head[:MIN_PREFIX - 1] + [0, 0, 0])  # Too short to keep: dropped for good.
    self.assertEqual(shared.tokens, ())
    shared.learn(head + [1])
    shared.learn(head + [2])
    self.assertEqual((shared.tokens, shared.start(head + [1])), ((), 0))

  def test_bounded_by_max_len_and_by_the_prompts(self):
    shared = SharedPrefix(max_len=10)
    shared.learn(list(range(20)) + [1])
    shared.learn(list(range(20)) + [2])
    self.assertEqual(shared.tokens, tuple(range(10)))
    short = SharedPrefix(max_len=64)
    short.learn(list(range(12)))
    short.learn(list(range(12)) + [5])  # The first prompt is all head.
    self.assertEqual(short.tokens, tuple(range(12)))
    self.assertEqual(short.start(list(range(12))), 0)  # A prompt no longer than the head is written whole.
    short.learn(list(range(9)))  # The head stays shorter than the prompt it is compared with.
    self.assertEqual(short.tokens, tuple(range(8)))

  def test_disabled_learns_nothing(self):
    shared = SharedPrefix(max_len=16, enabled=False)
    for tail in ([1], [2], [3]):
      shared.learn(list(range(100, 112)) + tail)
    self.assertEqual(shared.tokens, ())


if __name__ == '__main__':
  absltest.main()
