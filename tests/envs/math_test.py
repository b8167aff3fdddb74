"""math: math-verify equivalences and its timeout, benchmark layouts, file formats, malformed rows."""

import json
import os
import tempfile
import time

from absl.testing import absltest
from absl.testing import parameterized
import pyarrow as pa
import pyarrow.parquet as pq

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import math_task
from sao_jax.envs import verifier

_DATA = math_task.DATA_DIR


def _math(**kwargs):
  return envs.get_task({'name': 'math', 'max_turns': 1, 'eval_size': kwargs.pop('eval_size', 2),
                        'kwargs': {'verify_workers': 1, **kwargs}})


class VerifyAnswerTest(parameterized.TestCase):
  """math-verify equivalences (in-process: the pool only adds isolation)."""

  @parameterized.parameters(
      ('\\frac{1}{2}', 'The answer is \\boxed{0.5}'),
      ('\\frac{1}{2}', '\\boxed{\\frac{2}{4}}'),
      ('1/2', 'so $\\frac12$'),
      ('0.75', '\\boxed{\\frac{3}{4}}'),
      ('5\\sqrt{2}', '\\boxed{\\sqrt{50}}'),
      ('(0,1]', '\\boxed{(0,1]}'),
      ('[2, \\infty)', '\\boxed{[2,\\infty)}'),
      ('\\{1,2\\}', '\\boxed{\\{2,1\\}}'),
      ('204', 'The answer is 204.'),
      ('$x^2+1$', '\\boxed{1+x^2}'),
      ('9\\pi', '\\boxed{9\\pi}'),
  )
  def test_equivalent(self, gold, response):
    self.assertTrue(verifier.verify_answer(gold, response))

  @parameterized.parameters(
      ('\\frac{1}{2}', '\\boxed{\\frac{1}{3}}'),
      ('(0,1]', '\\boxed{(0,1)}'),
      ('(1,2)', '\\boxed{[1,2]}'),
      ('204', '\\boxed{205}'),
      ('\\{1,2\\}', '\\boxed{\\{1,2,3\\}}'),
      ('7', 'I do not know.'),
  )
  def test_not_equivalent(self, gold, response):
    self.assertFalse(verifier.verify_answer(gold, response))


class WorkerPoolTest(absltest.TestCase):

  def test_timeout_kills_and_replaces_the_worker(self):
    pool = verifier.WorkerPool(time.sleep, num_workers=1, timeout_s=0.5)  # Imported fast by the child.
    try:
      self.assertIsNone(pool.call(0))
      t0 = time.monotonic()
      with self.assertRaises(verifier.WorkerTimeout):
        pool.call(60)
      self.assertLess(time.monotonic() - t0, 2.0)
      self.assertIsNone(pool.call(0.01))  # A fresh worker took over.
    finally:
      pool.close()

  def test_a_dying_worker_is_replaced(self):
    pool = verifier.WorkerPool(os._exit, num_workers=1, timeout_s=5)  # pylint: disable=protected-access
    try:
      for _ in range(2):  # The second call reaches a fresh worker (and kills it too).
        with self.assertRaisesRegex(verifier.WorkerError, 'worker died'):
          pool.call(3)
    finally:
      pool.close()

  def test_module_level_functions_only(self):
    with self.assertRaisesRegex(ValueError, 'module-level function'):
      verifier.WorkerPool(lambda: 1, num_workers=1)

  def test_errors_come_back(self):
    pool = verifier.WorkerPool(int, num_workers=1, timeout_s=5)
    try:
      with self.assertRaisesRegex(verifier.WorkerError, 'ValueError'):
        pool.call('x')
      self.assertEqual(pool.call('12'), 12)
    finally:
      pool.close()


class MathTaskTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.task = _math(eval_size=4)

  def _score(self, ex, response):
    env = self.task.make_env(ex)
    env.reset()
    return env.step(response)

  def test_rewards_on_the_sample(self):
    by_answer = {}
    for ex in self.task.eval_set() + self.task.train_examples():
      by_answer.setdefault(ex.answer, ex)
    cases = [('\\frac{5}{6}', 'It is \\boxed{5/6}.', 1.0), ('\\frac{5}{6}', '\\boxed{\\frac{6}{5}}', 0.0),
             ('(-1, 1)', '$x \\in \\boxed{(-1,1)}$', 1.0), ('(-1, 1)', '\\boxed{[-1,1]}', 0.0),
             ('1/4', '\\boxed{0.25}', 1.0), ('5\\sqrt{2}', '\\boxed{\\sqrt{50}}', 1.0),
             ('55', '\\boxed{56}', 0.0)]
    for gold, response, want in cases:
      obs, reward, done, info = self._score(by_answer[gold], response)
      self.assertEqual((obs, reward, done), (None, want, True), (gold, response, info))

  def test_adversarial_answer_times_out_without_hanging(self):
    task = _math(verify_timeout_s=1.0)
    ex = task.eval_set()[0]
    env = task.make_env(ex)
    env.reset()
    task.checker.check('1', '\\boxed{1}')  # Start the worker first: startup is not part of the timeout.
    t0 = time.monotonic()
    obs, reward, done, info = env.step('\\boxed{9^{9^{9^{9}}}}')
    self.assertLess(time.monotonic() - t0, 3.0)
    self.assertEqual((obs, reward, done), (None, 0.0, True))
    self.assertIn('verifier timeout', info['error'])
    env.reset()
    self.assertEqual(env.step(f'\\boxed{{{ex.answer}}}').reward, 1.0)  # The pool recovered.

  def test_train_eval_split(self):
    ev = {e.uid for e in self.task.eval_set()}
    self.assertLen(ev, 4)
    it = self.task.train_iterator(0)
    drawn = {next(it).uid for _ in range(28)}
    self.assertLen(drawn, 28)  # One epoch of the 32 - 4 training problems.
    self.assertEmpty(ev & drawn)
    self.assertEqual([e.uid for e in _math(eval_size=4).eval_set()], [e.uid for e in self.task.eval_set()])

  @parameterized.parameters(
      ('imo_answerbench', 'imo_answerbench_sample.csv', 'math:imo-bench-sample-00', '890'),
      ('aime2025', 'aime2025_sample.jsonl', 'math:1', '49'),
      ('hmmt', 'hmmt_sample.jsonl', 'math:2', '\\frac{1}{3}'),
      ('beyond_aime', 'beyond_aime_sample.jsonl', 'math:row1', '1350'),
  )
  def test_benchmark_layouts(self, layout, filename, uid_prefix, an_answer):
    task = _math(layout=layout, data_file=os.path.join(_DATA, filename), eval_size=1)
    examples = task.eval_set() + task.train_examples()
    self.assertIn(an_answer, [e.answer for e in examples])
    self.assertTrue(any(e.uid.startswith(uid_prefix) for e in examples), [e.uid for e in examples])
    self.assertTrue(all('\\boxed{}' in e.prompt for e in examples))

  def test_parquet_and_custom_fields(self):
    with tempfile.TemporaryDirectory() as d:
      path = os.path.join(d, 'p.parquet')
      pq.write_table(pa.table({'question': ['What is $1+1$?', 'What is $2+2$?', ''],
                               'final': ['2', '4', '1'], 'qid': ['a', 'b', 'c']}), path)
      with self.assertLogs(level='WARNING') as logs:
        task = _math(data_file=path, problem_field='question', answer_field='final', id_field='qid',
                     eval_size=1)
      self.assertIn('row 3:', '\n'.join(logs.output))
      self.assertCountEqual([e.uid for e in task.eval_set() + task.train_examples()],
                            ['math:a', 'math:b'])

  def test_malformed_rows_are_counted_with_row_numbers(self):
    rows = ['{"problem": "p1", "answer": "1"}', '{"problem": "p2"}', '{not json', '[1, 2]',
            '{"problem": "p5", "answer": 5}', '{"problem": 7, "answer": "1"}', '']
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False) as f:
      f.write('\n'.join(rows) + '\n')
    try:
      with self.assertLogs(level='WARNING') as logs:
        task = _math(data_file=f.name, eval_size=1)
      text = '\n'.join(logs.output)
      self.assertIn('skipped 4 malformed row(s) of 6', text)
      for want in ("row 2: missing field 'answer'", 'row 3: invalid JSON', 'row 4: not an object',
                   "row 6: field 'problem' must be a non-empty string"):
        self.assertIn(want, text)
      self.assertEqual(sorted(e.answer for e in task.eval_set() + task.train_examples()), ['1', '5'])
    finally:
      os.unlink(f.name)

  def test_no_valid_row_is_an_error(self):
    with tempfile.NamedTemporaryFile('w', suffix='.jsonl', delete=False) as f:
      f.write(json.dumps({'question': 'q', 'answer': '1'}) + '\n')
    try:
      with self.assertRaisesRegex(ConfigError, r'config\.task\.kwargs\.data_file=.*no valid row among 1'):
        _math(data_file=f.name)
    finally:
      os.unlink(f.name)

  @parameterized.parameters(
      ({'data_file': '/no/such.jsonl'}, r'config\.task\.kwargs\.data_file=.*no such file'),
      ({'eval_file': '/no/such.jsonl'}, r'config\.task\.kwargs\.eval_file=.*no such file'),
      ({'layout': 'gsm8k'}, r'config\.task\.kwargs\.layout'),
      ({'eval_size': 40}, r'config\.task\.eval_size=40'),
  )
  def test_bad_config_names_the_field(self, kwargs, pattern):
    with self.assertRaisesRegex(ConfigError, pattern):
      _math(**kwargs)

  def test_unknown_extension(self):
    with tempfile.NamedTemporaryFile('w', suffix='.txt', delete=False) as f:
      f.write('x')
    try:
      with self.assertRaisesRegex(ConfigError, r'unknown file type \.txt'):
        _math(data_file=f.name)
    finally:
      os.unlink(f.name)


if __name__ == '__main__':
  absltest.main()
