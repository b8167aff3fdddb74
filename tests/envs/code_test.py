"""The code task: rewards on right / wrong / partial / hostile solutions, attempts, and data loading."""

import json
import math
import os
import shutil
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np

from sao_jax import envs
from sao_jax import rollout
from sao_jax.errors import ConfigError
from sao_jax.envs import code
from sao_jax.envs import sandbox as sandbox_lib
from sao_jax.tokenizers import CharTokenizer

_BWRAP_PROBLEM = sandbox_lib.bwrap_problem()
# The scoring tests run under bubblewrap wherever it works (CI installs it); elsewhere under the weaker
# 'rlimits' mode, asked for by name (scoring does not depend on the isolation). Containment tests need bwrap.
_ISOLATION = 'bwrap' if _BWRAP_PROBLEM is None else 'rlimits'
_FAST = {'timeout_s': 3.0, 'per_test_timeout_s': 0.5, 'cpu_s': 2, 'memory_mb': 256, 'isolation': _ISOLATION}


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
    env.reset()
    obs = env.step('class Nine(int):\n  pass\ndef square(x):\n  return Nine(9)')[0]
    self.assertIn('assert square(3) == 9: returned ValueError: a value of type Nine, not plain data', obs)

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
    # The property, not an error text: nothing the program writes reaches the host, whatever it raises.
    if _BWRAP_PROBLEM is not None:
      self.skipTest(f'containment needs bubblewrap: {_BWRAP_PROBLEM}')
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    targets = [os.path.join(d, 'sao_code_test_pwned') for d in (tempfile.gettempdir(), '/tmp', '/dev/shm',
                                                                '/var/tmp', os.getcwd())]
    for t in targets:
      self.assertFalse(os.path.exists(t), t)
    source = (f'for path in {targets!r}:\n'
              '  try:\n'
              '    open(path, "w").write("x")\n'
              '  except OSError:\n'
              '    pass\n'
              'def add(a, b):\n  return a + b\n')
    try:
      obs, reward, done, _ = env.step(source)
      self.assertEqual((obs, reward, done), (None, 1.0, True))  # It ran (and solved the problem) ...
      for t in targets:  # ... but wrote nothing outside its sandbox.
        self.assertFalse(os.path.exists(t), t)
    finally:
      for t in targets:
        if os.path.exists(t):
          os.unlink(t)

  def test_the_task_data_is_not_readable_inside(self):
    # Under the weaker modes a program read the problems file and returned the expected outputs (reward 1).
    if _BWRAP_PROBLEM is not None:
      self.skipTest(f'containment needs bubblewrap: {_BWRAP_PROBLEM}')
    env = self.task.make_env(_by_entry(self.task, 'add'))
    env.reset()
    source = ('import json\n'
              'def add(a, b):\n'
              '  try:\n'
              f'    rows = [json.loads(l) for l in open({code.DEFAULT_DATA!r})]\n'
              '  except OSError:\n'
              '    return None\n'
              '  return [t["output"] for r in rows if r["entry_point"] == "add" for t in r["tests"]\n'
              '          if t["input"] == [a, b]][0]\n')
    self.assertEqual(env.step(source).reward, 0.0)

  def test_an_always_equal_object_does_not_pass(self):
    # An object whose == is always true passed every assert test (reward 1.0) when asserts ran inside.
    always = ('class Anything:\n'
              '  def __eq__(self, other): return True\n'
              '  def __ne__(self, other): return False\n'
              '  def __bool__(self): return True\n'
              '  def __sub__(self, other): return 0\n'
              '  __rsub__ = __sub__\n')
    for entry in ('square', 'last_char', 'add'):
      env = self.task.make_env(_by_entry(self.task, entry))
      env.reset()
      obs, reward, done, info = env.step(always + f'def {entry}(*args):\n  return Anything()\n')
      self.assertEqual(reward, 0.0, entry)
      self.assertEqual(info['tests_passed'], 0, obs)
      self.assertNotIn('error', info)

  def test_forged_records_do_not_pass(self):
    # Records printed behind the harness's marker (reachable as __main__._MARK), then os._exit(0), passed
    # the assert tests (reward 1.0): a record can only carry a value, never "passed".
    source = ('import __main__, os\n'
              'm = getattr(__main__, "_MARK", "@@")\n'
              'for i in range(8):\n'
              '  print(m + \'{"kind": "assert", "i": %d, "ok": true}\' % i, flush=True)\n'
              '  print(m + \'{"k": "call", "i": %d, "ok": true, "passed": true}\' % i, flush=True)\n'
              'os._exit(0)\n')
    for entry in ('square', 'add'):
      env = self.task.make_env(_by_entry(self.task, entry))
      env.reset()
      self.assertEqual(env.step(source).reward, 0.0, entry)

  @parameterized.named_parameters(
      ('not_an_object', '"5"'),
      ('deep_nesting', '"[" * 60000'),
      ('deep_value', '\'{"k": "call", "i": 0, "v": \' + "[" * 50 + "]" * 50 + "}"'),
      ('bad_tag', '\'{"k": "call", "i": 0, "v": {"tuple": 5}}\''),
      ('unhashable_set', '\'{"k": "call", "i": 0, "v": {"set": [[1]]}}\''),
      ('string_index', '\'{"k": "call", "i": "0", "v": 9}\''),
      ('huge_int', '\'{"k": "call", "i": 0, "v": 1\' + "0" * 5000 + "}"'),
      ('bad_json', '"{" + chr(34)'),
  )
  def test_unparseable_harness_output_scores_zero_and_is_no_error(self, payload):
    # `_MARK + "5"` and `_MARK + "[" * 60000` made the parent's parser raise (AttributeError, RecursionError):
    # the attempt became an environment error (dropped) instead of a failed attempt (scored 0).
    env = self.task.make_env(_by_entry(self.task, 'square'))
    env.reset()
    source = f'import __main__, os\nprint(__main__._MARK + {payload}, flush=True)\nos._exit(0)\n'
    obs, reward, done, info = env.step(source)
    self.assertEqual((reward, done), (0.0, False))
    self.assertNotIn('error', info)
    self.assertIn('0/2 tests passed', obs)

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


class AssertCheckTest(parameterized.TestCase):
  """Assert tests decided here from returned values, with Python's own semantics for plain data."""

  @parameterized.parameters(
      ('assert f(3) == 9', [9], True),
      ('assert f(3) == 9', [9.0], True),  # Python: 9 == 9.0.
      ('assert f(1) == (1, 2)', [[1, 2]], False),  # Python: a list is not a tuple.
      ('assert f(1) == (1, 2)', [(1, 2)], True),
      ('assert set(f([1, 2])) == set([2, 1])', [[2, 1, 1]], True),
      ('assert sorted(f("ab")) == ["a", "b"]', [('b', 'a')], True),
      ('assert f(2) != 5', [5], False),
      ('assert f(7)', [[0]], True),
      ('assert not f(8)', [0], True),
      ('assert f(2) is True', [1], False),
      ('assert math.isclose(f(0), 1.5, rel_tol=0.01)', [1.505], True),
      ('assert abs(f(0) - 3.14) < 0.01', [3.141], True),
      ('assert f(1) == f(2) and f(3) in [1, 2]', [4, 4, 2], True),
      ('assert f(1) == f(2) and f(3) in [1, 2]', [4, 5, 2], False),
      ('assert f({"a": 1}, k=(1,)) == {"a": {1, 2}}', [{'a': {2, 1}}], True),
      ('assert f(0) == float("nan")', [math.nan], False),
      ('assert f(0)[1:] == [2]', [[1, 2]], True),
      ('assert f(0) + "x" == "ax"', ['a'], False),  # Arithmetic on numbers only.
  )
  def test_decide(self, src, returned, want):
    check = code.parse_assert(src, 'f')
    self.assertLen(check.calls, len(returned))
    self.assertEqual(check.decide(returned), want)

  def test_calls_carry_plain_arguments(self):
    check = code.parse_assert('assert f((1, 2), {3}, k=[None]) == 0', 'f')
    self.assertEqual(check.calls, (([(1, 2), {3}], {'k': [None]}),))

  @parameterized.parameters(
      'x = 1', 'assert g(1) == 2', 'assert f(x) == 2', 'assert f(1) == g(2)', 'assert f(lambda: 1) == 2',
      'assert f(f(1)) == 2', 'assert f(1).real == 2', 'assert [f(i) for i in range(3)] == [0, 1, 2]',
      'assert f(1) == 2\nassert f(2) == 3', 'assert 1 == 1', 'assert f(*[1]) == 2', 'assert f(1) == __import__("os")',
      'assert f(0) == 10 ** 9 ** 9',  # No ** (unbounded time): refused at load, never evaluated.
  )
  def test_unsupported_asserts_are_refused(self, src):
    with self.assertRaises(code.UnsupportedAssert):
      code.parse_assert(src, 'f')

  def test_values_round_trip_with_their_types(self):
    for value in [None, True, 3, -2**70, 1.5, math.inf, 'é', b'\x00\xff', 1 + 2j, [1, (2, 3)], {1, 'a'},
                  frozenset(), {'a': [1], 2: (None,)}, ((),)]:
      got = code._decode(json.loads(json.dumps(code._encode(value))))  # pylint: disable=protected-access
      self.assertEqual(got, value)
      self.assertEqual(type(got), set if type(value) is frozenset else type(value))
    self.assertTrue(math.isnan(code._decode(code._encode(math.nan))))  # pylint: disable=protected-access
    deep = []
    for _ in range(40):
      deep = [deep]
    for bad in [object(), type('L', (list,), {})(), type('I', (int,), {})(3), deep, [print]]:
      with self.assertRaises(ValueError):
        code._encode(bad)  # pylint: disable=protected-access


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
        {'task_id': 'e', 'prompt': 'r', 'entry_point': 'h', 'test_list': ['assert g(1) == 1']},
    ]
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False) as f:
      for r in rows:
        f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
    try:
      with self.assertLogs(level='WARNING') as logs:
        task = envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1,
                              'kwargs': {'data_file': f.name, 'isolation': _ISOLATION}})
      self.assertEqual(len(task.eval_set()) + len(task.train_examples()), 2)
      text = '\n'.join(logs.output)
      self.assertIn('skipped 4 malformed row(s) of 6', text)
      for n in ('row 2:', 'row 3: invalid JSON', 'row 4: no tests',
                "row 6: assert 'assert g(1) == 1' cannot be decided from returned values"):
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
    with self.assertRaisesRegex(ConfigError, r"config\.task\.kwargs\.isolation='auto'"):
      envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1, 'kwargs': {'isolation': 'auto'}})

  def test_missing_bwrap_names_the_field(self):
    which = shutil.which
    with mock.patch.object(shutil, 'which', lambda name, *a, **k: None if name == 'bwrap' else which(name, *a, **k)):
      with self.assertRaisesRegex(ConfigError, r"config\.task\.kwargs\.isolation='bwrap': .*bwrap is not "
                                  'installed'):
        envs.get_task({'name': 'code', 'max_turns': 1, 'eval_size': 1, 'kwargs': {}})


if __name__ == '__main__':
  absltest.main()
