"""arith, calculator and the safe evaluator: rewards on right and wrong answers, formats, problem streams."""

from fractions import Fraction
import re

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import answers
from sao_jax.envs import arith
from sao_jax.envs import calculator
from sao_jax.envs import safe_eval


def _task(name='arith', max_turns=1, eval_size=16, **kwargs):
  return envs.get_task(ml_collections.ConfigDict(
      {'name': name, 'max_turns': max_turns, 'eval_size': eval_size, 'kwargs': kwargs}))


def _reward(task, ex, *texts):
  env = task.make_env(ex)
  env.reset()
  out = None
  for t in texts:
    out = env.step(t)
  return out


class AnswersTest(parameterized.TestCase):

  @parameterized.parameters(
      ('tag', '<answer>42</answer>', '42'),
      ('tag', 'I think 6*7 is <answer>42</answer>', '42'),
      ('tag', '<answer>-7</answer>', '-7'),
      ('tag', '<answer>42</answer> done', None),  # Text after the answer.
      ('tag', '<answer> 42</answer>', None),  # Spaces.
      ('tag', '<answer>4</answer><answer>42</answer>', None),  # Two answers.
      ('tag', '42', None),
      ('boxed', 'so \\boxed{42}', '42'),
      ('boxed', '\\boxed{4.2}', None),
      ('hash', 'work\n#### 42', '42'),
      ('hash', '#### 42 apples', None),
      ('plain', '42', '42'),
      ('plain', 'the answer is 42', None),
  )
  def test_strict(self, fmt, text, want):
    self.assertEqual(answers.parse(text, fmt, strict=True), want)

  @parameterized.parameters(
      ('tag', '<answer> 1,234 </answer> done', '1234'),
      ('tag', '<answer>1</answer> then <answer>+2</answer>', '2'),
      ('boxed', '\\boxed{ -3 }.', '-3'),
      ('plain', 'the answer is 42', '42'),
  )
  def test_lenient(self, fmt, text, want):
    self.assertEqual(answers.parse(text, fmt, strict=False), want)

  def test_render_round_trips(self):
    for fmt in answers.FORMATS:
      self.assertEqual(answers.parse(answers.render(-12, fmt), fmt), '-12')


class ArithTest(parameterized.TestCase):

  def test_right_and_wrong_answers(self):
    task = _task()
    ex = task.eval_set()[0]
    self.assertEqual(_reward(task, ex, f'<answer>{ex.answer}</answer>')[1:3], (1.0, True))
    self.assertEqual(_reward(task, ex, f'<answer>{int(ex.answer) + 1}</answer>')[1], 0.0)
    self.assertEqual(_reward(task, ex, ex.answer)[1], 0.0)  # Right number, wrong format.

  def test_format_reward(self):
    task = _task(format_reward=0.1)
    ex = task.eval_set()[0]
    self.assertAlmostEqual(_reward(task, ex, f'<answer>{int(ex.answer) + 1}</answer>')[1], 0.1)
    self.assertEqual(_reward(task, ex, 'no idea')[1], 0.0)
    self.assertEqual(_reward(task, ex, f'<answer>{ex.answer}</answer>')[1], 1.0)

  def test_difficulty_knobs_and_values(self):
    task = _task(min_digits=3, max_digits=3, min_ops=2, max_ops=3, ops='*')
    for ex in task.eval_set():
      nums = ex.data['expression'].split('*')
      self.assertBetween(len(nums), 3, 4)
      self.assertTrue(all(len(n) == 3 for n in nums))
      self.assertEqual(int(ex.answer), eval(ex.data['expression']))  # pylint: disable=eval-used
      self.assertIn('<answer>N</answer>', ex.prompt)

  def test_mul_max_digits_bounds_the_right_factor_only(self):
    task = _task(eval_size=300, min_digits=2, max_digits=2, mul_max_digits=1, min_ops=1, max_ops=2)
    right_factors = 0
    for ex in task.eval_set():
      expr = ex.data['expression']
      parts = re.split(r'([+*-])', expr)  # Operands at even indices.
      for i in range(0, len(parts), 2):
        right_of_mul = i > 0 and parts[i - 1] == '*'
        right_factors += right_of_mul
        self.assertLen(parts[i], 1 if right_of_mul else 2, expr)  # 0-9, or 10-99 (left factors too).
      self.assertEqual(int(ex.answer), eval(expr))  # pylint: disable=eval-used
    self.assertGreater(right_factors, 50)
    # Without it the stream is the one it always was (the redraw comes after the expression's draws).
    plain = _task(eval_size=32, min_digits=2, max_digits=2, ops='+-')
    also = _task(eval_size=32, min_digits=2, max_digits=2, ops='+-', mul_max_digits=1)
    self.assertEqual([e.uid for e in plain.eval_set()], [e.uid for e in also.eval_set()])
    with self.assertRaisesRegex(ConfigError, 'mul_max_digits'):
      _task(mul_max_digits=19)

  def test_solution_is_the_rewarded_reply(self):
    for fmt in answers.FORMATS:
      task = _task(eval_size=8, answer_format=fmt)
      for ex in task.eval_set():
        self.assertEqual(_reward(task, ex, task.solution(ex)).reward, 1.0)

  @parameterized.parameters(
      ('reversed', '47+38', '58\n#### 85'), ('reversed', '23-58', '-53\n#### -35'),
      ('reversed', '47*8', '673\n#### 376'), ('reversed', '50+50', '001\n#### 100'), ('reversed', '7*0', '0\n#### 0'),
      ('partials', '47+38', '58\n#### 85'), ('partials', '23-58', '-53\n#### -35'),
      ('partials', '47*8', '65 23 673\n#### 376'), ('partials', '40*0', '00 00 0\n#### 0'),
      ('partials', '9*9', '18 18\n#### 81'), ('partials', '47*18', '648\n#### 846'),  # Two-digit factor: reversed.
      ('none', '47*8', '#### 376'))
  def test_scratchpad_solution(self, scratchpad, expr, want):
    opts = arith.ArithOptions(answer_format='hash', scratchpad=scratchpad)
    answer = str(safe_eval.safe_eval(expr))
    self.assertEqual(arith.render_solution(expr, answer, opts), want)
    self.assertEqual(arith.score(want, answer, opts)[0], 1.0)
    # The reward reads the final answer only: a wrong scratchpad with the right answer is right, and the reverse
    # (the scratchpad holding the answer's digits forward, the final answer wrong) is wrong.
    self.assertEqual(arith.score(f'123\n#### {answer}', answer, opts)[0], 1.0)
    self.assertEqual(arith.score(f'{answer}\n#### {int(answer) + 1}', answer, opts)[0], 0.0)

  @parameterized.product(fmt=('hash', 'tag', 'boxed'), scratchpad=('reversed', 'partials'))
  def test_scratchpad_solution_is_the_rewarded_reply(self, fmt, scratchpad):
    task = _task(eval_size=16, min_digits=2, max_digits=2, mul_max_digits=1, answer_format=fmt,
                 scratchpad=scratchpad)
    for ex in task.eval_set():
      reply = task.solution(ex)
      scratch, _ = reply.split('\n', 1)
      *partials, reversed_answer = scratch.split(' ')
      self.assertEqual(reversed_answer.lstrip('-')[::-1], ex.answer.lstrip('-'))
      if partials:  # a*b: the partial products of a's digits (units first), each reversed, sum to the answer.
        a, b = ex.data['expression'].split('*')
        self.assertEqual(partials, [f'{int(d) * int(b):02d}'[::-1] for d in reversed(a)])
        self.assertEqual(sum(int(p[::-1]) * 10 ** i for i, p in enumerate(partials)), int(ex.answer))
      self.assertEqual(_reward(task, ex, reply).reward, 1.0)

  def test_eval_fixed_and_disjoint_from_train(self):
    a, b = _task(eval_size=32), _task(eval_size=32)
    self.assertEqual([e.uid for e in a.eval_set()], [e.uid for e in b.eval_set()])
    ev = {e.uid for e in a.eval_set()}
    self.assertLen(ev, 32)
    # A small problem space (1-digit +: 100 problems) makes collisions certain if they were not excluded.
    small = _task(eval_size=50, min_digits=1, max_digits=1, ops='+')
    held = {e.uid for e in small.eval_set()}
    it = small.train_iterator(0)
    drawn = {next(it).uid for _ in range(300)}
    self.assertEmpty(held & drawn)
    self.assertLen(drawn | held, 100)

  def test_seeds_give_different_streams(self):
    task = _task()
    s0 = [next(task.train_iterator(0)).uid for _ in range(1)]
    it0, it1 = task.train_iterator(0), task.train_iterator(1)
    self.assertNotEqual([next(it0).uid for _ in range(10)], [next(it1).uid for _ in range(10)])
    self.assertEqual(s0, [next(task.train_iterator(0)).uid])

  def test_eval_size_too_large_for_the_problem_space(self):
    task = _task(eval_size=101, min_digits=1, max_digits=1, ops='+')  # 100 distinct problems exist.
    with self.assertRaisesRegex(ConfigError, 'config.task.eval_size=101: only 100 distinct'):
      task.eval_set()

  @parameterized.parameters(
      ({'ops': '/'}, 'ops'), ({'min_digits': 3, 'max_digits': 2}, 'min_digits'),
      ({'answer_format': 'json'}, 'answer_format'), ({'digits': 3}, 'digits is not an option'),
      ({'max_digits': 'two'}, 'max_digits'), ({'scratchpad': 'forward'}, 'scratchpad'),
      ({'scratchpad': 'reversed', 'answer_format': 'plain'}, 'scratchpad'))
  def test_bad_options_name_the_field(self, kwargs, field):
    with self.assertRaisesRegex(ConfigError, f'config.task.kwargs.{field}'):
      _task(**kwargs)


class SafeEvalTest(parameterized.TestCase):

  @parameterized.parameters(
      ('12*34', 408), ('2+3*4', 14), ('(2+3)*4', 20), ('-3**2', -9), ('7/2', Fraction(7, 2)), ('7//2', 3),
      ('7%3', 1), ('2**-2', Fraction(1, 4)), ('1.5*2', 3), (' 1 + 1 ', 2), ('+5', 5))
  def test_values(self, expr, want):
    self.assertEqual(safe_eval.safe_eval(expr), want)

  @parameterized.parameters(
      '__import__("os").system("id")', 'open("x")', 'x', '[1, 2]', '1 if 1 else 2', 'lambda: 1', '"a" * 3',
      '(1).__class__', '1 < 2', 'True + 1', '9**9**9**9', '10**100', '2**0.5', '1/0', '5 % 0', '0**-1',
      '1' * 300, '(' * 50 + '1' + ')' * 50, '', '1 +', 'f"{1}"', '1e400')
  def test_rejects(self, expr):
    with self.assertRaises(safe_eval.UnsafeExpression):
      safe_eval.safe_eval(expr)

  def test_format_number(self):
    self.assertEqual(safe_eval.format_number(Fraction(408)), '408')
    self.assertEqual(safe_eval.format_number(Fraction(1, 3)), '0.333333')
    self.assertEqual(safe_eval.format_number(Fraction(-7, 2)), '-3.5')


class CalculatorTest(parameterized.TestCase):

  def setUp(self):
    super().setUp()
    self.task = _task('calculator', max_turns=3, eval_size=8)
    self.ex = self.task.eval_set()[0]

  def test_tool_then_right_answer(self):
    call, final = calculator.demo_actions(self.ex)
    env = self.task.make_env(self.ex)
    env.reset()
    obs, reward, done, info = env.step(call)
    self.assertEqual(obs, f'<result>{self.ex.answer}</result>')
    self.assertEqual((reward, done, info['tool_calls']), (0.0, False, 1))
    obs, reward, done, info = env.step(final)
    self.assertEqual((obs, reward, done), (None, 1.0, True))

  def test_wrong_answer_and_no_action(self):
    self.assertEqual(_reward(self.task, self.ex, '<answer>1</answer>')[1:3], (0.0, True))
    self.assertEqual(_reward(self.task, self.ex, 'hmm')[1:3], (0.0, True))

  def test_tool_errors_are_observations(self):
    env = self.task.make_env(self.ex)
    env.reset()
    obs, _, done, _ = env.step('<calc>__import__("os")</calc>')
    self.assertFalse(done)
    self.assertTrue(obs.startswith('<result>error:'), obs)
    self.assertIn('error: division by zero', env.step('<calc>1/0</calc>')[0])

  def test_turn_limit_cuts_a_pending_tool_call(self):
    env = self.task.make_env(self.ex)
    env.reset()
    for _ in range(2):
      self.assertFalse(env.step('<calc>1+1</calc>').done)
    obs, reward, done, info = env.step('<calc>1+1</calc>')
    self.assertEqual((obs, reward, done), ('<result>2</result>', 0.0, True))  # The result is kept (rollout).
    self.assertTrue(info['truncated'])

  def test_needs_two_turns(self):
    with self.assertRaisesRegex(ConfigError, r'config\.task\.max_turns=1'):
      _task('calculator', max_turns=1)


if __name__ == '__main__':
  absltest.main()
