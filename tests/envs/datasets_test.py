"""Corrupt problem files: bad rows skipped with their row number and reason, unreadable files a clear error."""

import json
import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized

from sao_jax import envs
from sao_jax.errors import ConfigError
from sao_jax.envs import datasets


def _write(suffix: str, data: bytes) -> str:
  f = tempfile.NamedTemporaryFile('wb', suffix=suffix, delete=False)
  f.write(data)
  f.close()
  return f.name


def _math(path: str, **kwargs):
  return envs.get_task({'name': 'math', 'max_turns': 1, 'eval_size': 1,
                        'kwargs': {'data_file': path, 'verify_workers': 1, **kwargs}})


def _row(i: int, **fields) -> bytes:
  return json.dumps({'id': f'p{i}', 'problem': f'What is {i} + 1?', 'answer': str(i + 1), **fields}).encode()


class CorruptRowsTest(parameterized.TestCase):

  def _load(self, lines: list[bytes], **kwargs):
    path = _write('.jsonl', b'\n'.join(lines) + b'\n')
    self.addCleanup(os.unlink, path)
    with self.assertLogs(level='WARNING') as logs:
      task = _math(path, **kwargs)
    return task, '\n'.join(logs.output)

  def _kept(self, task) -> list[str]:
    return sorted(e.uid for e in task.eval_set() + task.train_examples())

  def test_invalid_utf8_line_is_one_bad_row(self):
    # One invalid UTF-8 line used to reject the whole file, with no row number.
    task, log = self._load([_row(1), b'{"id": "p2", "problem": "caf\xe9 ?", "answer": "1"}', _row(3)])
    self.assertIn('skipped 1 malformed row(s) of 3', log)
    self.assertIn('row 2: invalid UTF-8 at byte', log)
    self.assertEqual(self._kept(task), ['math:p1', 'math:p3'])

  def test_deep_nesting_is_one_bad_row(self):
    # A line nested 200k brackets deep raised an uncaught RecursionError.
    task, log = self._load([_row(1), b'[' * 200_000 + b']' * 200_000, _row(3),
                            b'{"id": "p4", "problem": ' + b'[' * 200_000 + b']' * 200_000 + b'}'])
    self.assertIn('skipped 2 malformed row(s) of 4', log)
    self.assertIn('row 2: nested too deeply to parse', log)
    self.assertIn('row 4: nested too deeply to parse', log)
    self.assertEqual(self._kept(task), ['math:p1', 'math:p3'])

  def test_duplicate_ids_and_prompts_are_reported(self):
    task, log = self._load([_row(1), _row(2), _row(1, problem='Another problem'), _row(5, id='p9'),
                            _row(2, id='p7', answer='4')])
    self.assertIn('skipped 2 malformed row(s) of 5', log)
    self.assertIn("row 3: duplicate id 'math:p1' (first at row 1)", log)
    self.assertIn('row 5: duplicate prompt (first at row 2)', log)
    self.assertEqual(self._kept(task), ['math:p1', 'math:p2', 'math:p9'])

  @parameterized.named_parameters(
      ('nan_literal', b'{"id": "x", "problem": "q?", "answer": NaN}', "field 'answer' is nan"),
      ('infinity_literal', b'{"id": "x", "problem": "q?", "answer": -Infinity}', "field 'answer' is -inf"),
      ('nan_string', b'{"id": "x", "problem": "q?", "answer": "NaN"}', "the answer 'NaN' is not a value"),
      ('unparseable', b'{"id": "x", "problem": "q?", "answer": "\\\\frac{"}', 'math-verify cannot parse'),
      ('too_long', b'{"id": "x", "problem": "q?", "answer": "' + b'1' * 2000 + b'"}', 'the answer is longer than 1000'),
  )
  def test_unusable_gold_answers_are_reported(self, line, why):
    # NaN and unparseable gold answers were accepted silently (every episode on them then failed).
    task, log = self._load([_row(1), _row(2), line])
    self.assertIn('skipped 1 malformed row(s) of 3', log)
    self.assertIn(f'row 3: {why}', log)
    self.assertEqual(self._kept(task), ['math:p1', 'math:p2'])

  def test_answer_check_can_be_turned_off(self):
    path = _write('.jsonl', b'\n'.join([_row(1), _row(2), b'{"id": "x", "problem": "q?", "answer": "\\\\frac{"}']))
    self.addCleanup(os.unlink, path)
    self.assertLen(self._kept(_math(path, check_answers=False)), 3)

  def test_csv_row_with_invalid_utf8(self):
    path = _write('.csv', b'id,problem,answer\np1,What is 1?,1\np2,caf\xe9?,2\np3,What is 3?,3\n')
    self.addCleanup(os.unlink, path)
    with self.assertLogs(level='WARNING') as logs:
      task = _math(path)
    self.assertIn("row 2: invalid UTF-8 in column 'problem'", '\n'.join(logs.output))
    self.assertEqual(self._kept(task), ['math:p1', 'math:p3'])


class UnreadableFileTest(parameterized.TestCase):

  @parameterized.named_parameters(
      ('garbage_parquet', '.parquet', b'PAR1 this is not a parquet file' * 10, 'not a readable Parquet file'),
      ('deep_json', '.json', b'[' * 200_000 + b']' * 200_000, 'nested too deeply'),
      ('invalid_utf8_json', '.json', b'[{"problem": "caf\xe9"}]', 'UnicodeDecodeError'),
      ('bad_json', '.json', b'[{"problem": ', 'JSONDecodeError'),
  )
  def test_a_clear_error_naming_the_field_and_the_file(self, suffix, data, why):
    # A garbage .parquet raised an uncaught ArrowInvalid.
    path = _write(suffix, data)
    self.addCleanup(os.unlink, path)
    with self.assertRaises(ConfigError) as cm:
      datasets.read_rows(path, 'task.kwargs.data_file')
    self.assertIn(f'config.task.kwargs.data_file={path!r}: cannot be read', str(cm.exception))
    self.assertIn(why, str(cm.exception))
    with self.assertRaisesRegex(ConfigError, 'cannot be read'):  # And through the task, at load.
      _math(path)


if __name__ == '__main__':
  absltest.main()
