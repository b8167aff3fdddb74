"""The code task: rewards on right / wrong / partial / hostile solutions, attempts, and data loading."""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax.errors import ConfigError
from sao_jax.envs import code
from sao_jax.tokenizers import CharTokenizer

_FAST = {'timeout_s': 3.0, 'per_test_timeout_s': 0.5, 'cpu_s': 2, 'memory_mb': 256}


def _task(max_turns=2, **kwargs):
  return envs.get_task({'name': 'code', 'max_turns': max_turns, 'eval_size': 4,
                        'kwargs': {**_FAST, **kwargs}})


def _by_entry(task, entry):
  for ex in task.eval_set() + task.train_examples():
    if ex.data['entry_point'] == entry:
      return ex
  raise KeyError(entry)


_GCD_RIGHT = '```python\nimport math\ndef gcd(a, b):\n  return math.gcd(a, b)\n```'


class CodeTaskTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.task = _task()

  def test_right_solution_gets_reward_one_in_one_attempt(self):
    env = self.task.make_env(_by_entry(self.task, 'gcd'))
    env.reset()
    obs, reward, done, info = env.step('Here it is.\n' + _GCD_RIGHT)
    self.assertEqual((obs, reward, done), (None, 1.0, True))
    self.assertEqual(info['tests_passed'], info['tests_total'])

  def test_wrong_solution_gets_feedback_then_zero(self):
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    obs, reward, done, info = env.step('```python\ndef add(a, b):\n  return a - b\n```')
    self.assertFalse(done)
    self.assertEqual(reward, 0.0)
    self.assertIn('0/3 tests passed', obs)
    self.assertIn('add(1, 2) returned -1', obs)
    self.assertNotIn('expected', obs)  # feedback='inputs' does not reveal expected outputs.
    obs, reward, done, info = env.step('```python\ndef add(a, b):\n  return a - b\n```')
    self.assertEqual((obs, reward, done), (None, 0.0, True))  # Last attempt: judged, not truncated.
    self.assertNotIn('truncated', info)

  def test_second_attempt_can_succeed(self):
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    self.assertFalse(env.step('def add(a, b):\n  return 0')[2])
    self.assertEqual(env.step('def add(a, b):\n  return a + b')[1], 1.0)

  def test_fraction_reward(self):
    task = _task(reward='fraction', feedback='full')
    env = task.make_env(_by_entry(task, 'is_even'))
    env.reset()
    obs, reward, done, _ = env.step('def is_even(n):\n  return True')  # Right on 2, 0; wrong on 7, -3.
    self.assertEqual(reward, 0.0)
    self.assertIn('expected false', obs)
    _, reward, done, _ = env.step('def is_even(n):\n  return True')
    self.assertTrue(done)
    self.assertAlmostEqual(reward, 0.5)

  def test_assert_style_tests(self):
    env = self.task.make_env(_by_entry(self.task, 'square'))
    env.reset()
    self.assertEqual(env.step('def square(x):\n  return x * x')[1], 1.0)
    env.reset()
    obs = env.step('def square(x):\n  return x + x')[0]
    self.assertIn('assert square(3) == 9', obs)

  @parameterized.named_parameters(
      ('syntax_error', 'def add(a, b) return a+b', 'failed to load: SyntaxError'),
      ('missing_function', 'def plus(a, b):\n  return a + b', 'no function named add'),
      ('infinite_loop', 'def add(a, b):\n  while True:\n    pass', 'Timeout'),
      ('exits', 'import os\nos._exit(0)', '0/3 tests passed'),
      ('raises', 'def add(a, b):\n  raise ValueError("nope")', 'raised ValueError: nope'),
  )
  def test_broken_solutions_score_zero(self, source, message):
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    obs, reward, done, _ = env.step(source)
    self.assertEqual(reward, 0.0)
    self.assertFalse(done)
    self.assertIn(message, obs)

  def test_a_program_cannot_fake_passing_io_tests(self):
    # Prints fake result lines in every format it could guess; expected values never enter the sandbox.
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    source = ('import sys\n'
              'def add(a, b):\n'
              '  return None\n'
              'for i in range(3):\n'
              '  print("@@SAO_0000@@" + \'{"kind": "io", "i": %d, "output": 3}\' % i)\n')
    self.assertEqual(env.step(source)[1], 0.0)

  def test_hostile_solution_is_contained(self):
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    private = os.path.join(tempfile.gettempdir(), 'sao_code_test_private')  # The sandbox's own tmpfs.
    project = os.path.join(os.getcwd(), 'sao_code_test_pwned')  # Not even visible inside.
    source = (f'open({private!r}, "w").write("x")\n'
              f'open({project!r}, "w").write("x")\n'
              'def add(a, b):\n  return a + b\n')
    obs, reward, _, _ = env.step(source)
    self.assertEqual(reward, 0.0)
    self.assertIn('failed to load: FileNotFoundError', obs)
    self.assertFalse(os.path.exists(private))
    self.assertFalse(os.path.exists(project))

  def test_extract_code(self):
    self.assertEqual(code.extract_code('a\n```python\nx = 1\n```\nb\n```py\ny = 2\n```'), 'y = 2\n')
    self.assertEqual(code.extract_code('x = 1'), 'x = 1')

  def test_eval_and_train_are_disjoint_and_prompts_name_the_function(self):
    ev = {e.uid for e in self.task.eval_set()}
    self.assertLen(ev, 4)
    it = self.task.train_iterator(0)
    seen = {next(it).uid for _ in range(60)}
    self.assertEmpty(ev & seen)
    ex = self.task.eval_set()[0]
    self.assertIn(f'`{ex.data["entry_point"]}`', ex.prompt)


class CodeEpisodeTest(absltest.TestCase):

  def test_two_attempt_episode_layout(self):
    tok = CharTokenizer()
    task = _task(max_turns=2)
    ex = _by_entry(task, 'add')
    attempts = ['```python\ndef add(a, b):\n  return a - b\n```',
                '```python\ndef add(a, b):\n  return a + b\n```']
    queue = list(attempts)

    def gen(context, budget, stop_ids):
      del context, budget, stop_ids
      ids = tok.encode(queue.pop(0)) + [tok.eos_id]
      return ids, [-0.5] * len(ids)

    traj = rollout.run_episode(task.make_env(ex), tok, gen, limits=rollout.EpisodeLimits(2, 128, 1024))
    self.assertEqual(traj.reward, 1.0)
    self.assertFalse(traj.truncated)
    report = code.feedback_text(code.TestReport(0, 3, ('add(1, 2) returned -1', 'add(-5, 5) returned -10',
                                                       'add(100, 23) returned 77'), None, False, ''), task.opts)
    whole, mask = tok.apply_chat_template(
        ex.messages() + [{'role': 'assistant', 'content': attempts[0]}, {'role': 'user', 'content': report},
                         {'role': 'assistant', 'content': attempts[1]}], add_generation_prompt=False)
    np.testing.assert_array_equal(traj.tokens, whole)  # The test report is the (user) observation.
    np.testing.assert_array_equal(traj.action_mask, mask)
    self.assertEqual(traj.info['attempt'], 2)


class CodeDataTest(absltest.TestCase):

  def test_malformed_rows_are_skipped_with_row_numbers(self):
    rows = [
        {'task_id': 'a', 'prompt': 'p', 'entry_point': 'f', 'tests': [{'input': [1], 'output': 1}]},
        {'task_id': 'b', 'prompt': 'p', 'entry_point': 'not an id', 'tests': [{'input': [1], 'output': 1}]},
        'not json',
        {'task_id': 'c', 'prompt': 'p', 'entry_point': 'f'},
        {'task_id': 'd', 'prompt': 'q', 'entry_point': 'g', 'tests': [{'input': [2], 'output': 4}]},
    ]
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False) as f:
      for r in rows:
        f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
    try:
      with self.assertLogs(level='WARNING') as logs:
        task = envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1,
                              'kwargs': {'data_file': f.name}})
      self.assertEqual(len(task.eval_set()) + len(task.train_examples()), 2)
      text = '\n'.join(logs.output)
      self.assertIn('skipped 3 malformed row(s) of 5', text)
      for n in ('row 2:', 'row 3: invalid JSON', 'row 4: no tests'):
        self.assertIn(n, text)
    finally:
      os.unlink(f.name)

  def test_missing_file_names_the_field(self):
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.data_file=.*no such file'):
      envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1,
                     'kwargs': {'data_file': '/nonexistent.jsonl'}})

  def test_bad_option_names_the_field(self):
    with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.reward'):
      envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1, 'kwargs': {'reward': 'most'}})


if __name__ == '__main__':
  absltest.main()
