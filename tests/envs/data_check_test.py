"""The start-of-run data check: too-long prompts dropped, counted and named by file and row; every skipped row
in the report, by file and row; generated tasks' eval sets measured."""

import json
import os
import tempfile
import time

from absl.testing import absltest
import numpy as np

from configs import arith as arith_config
from configs import math as math_config
from sao_jax import envs
from sao_jax import rollout
from sao_jax.envs import data_check
from sao_jax.errors import ConfigError
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout import episodes
from sao_jax.tokenizers import CharTokenizer, HFTokenizer

try:
  import tokenizers as hf_tokenizers  # pylint: disable=g-import-not-at-top
except ImportError:  # Optional: the HF tokenizer tests are skipped without it.
  hf_tokenizers = None


def _jsonl(rows: list[dict] | list[bytes]) -> str:
  f = tempfile.NamedTemporaryFile('wb', suffix='.jsonl', delete=False)
  f.write(b''.join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b'\n' for r in rows))
  f.close()
  return f.name


def _row(i: int, problem: str | None = None) -> dict:
  return {'id': f'p{i}', 'problem': problem or f'What is {i} + 1?', 'answer': str(i + 1)}


def _config(max_seq_len: int = 768, eval_size: int = 1, **kwargs):
  config = math_config.get_config()
  config.task.eval_size = eval_size
  config.task.kwargs.update({'verify_workers': 1, **kwargs})
  config.sampler.max_seq_len = max_seq_len
  config.sampler.max_new_tokens = min(config.sampler.max_new_tokens, max_seq_len - 1)
  return config


def _rows(task) -> list[int]:
  return sorted(e.data['row'] for e in task.eval_set() + task.train_examples())


def _fits(example, tokenizer, config) -> bool:
  """Whether the episode runner starts an episode on `example` (it refuses a prompt that does not fit)."""
  rules = episodes.EpisodeRules(tokenizer, rollout.EpisodeLimits.from_config(config), frozenset(tokenizer.stop_ids),
                                frozenset(tokenizer.stop_ids), SamplingParams())
  try:
    episodes.start_episode(_Env(example), 0, rules)
    return True
  except ValueError as e:
    if 'does not fit' not in str(e):
      raise
    return False


class _Env(envs.BaseEnv):
  """An env that resets to its example's messages, as every task's env does (no verifier pool to start)."""

  def _step(self, action_text):
    raise NotImplementedError


class TooLongPromptTest(absltest.TestCase):

  def test_a_huge_prompt_is_dropped_counted_and_named_fast(self):
    # A 3 MB problem passed --dry_run and the task's load; every actor then failed on it ("A prompt of 3000031
    # tokens does not fit ... max_seq_len"), restarted, and the run never named the row.
    huge = 'x' * 3_000_000
    path = _jsonl([_row(1), _row(2), _row(3, huge), _row(4), _row(5)])
    config = _config(data_file=path)
    task = envs.get_task(config.task)
    self.assertIn(3, _rows(task))  # The load keeps it (the task knows no budget).
    t0 = time.perf_counter()
    with self.assertLogs(level='WARNING') as logs:
      report = data_check.check_task_data(config, task, CharTokenizer())
    seconds = time.perf_counter() - t0
    self.assertLess(seconds, 2.0)  # Decided from its length: a 3 MB prompt is not tokenized.
    self.assertEqual(_rows(task), [1, 2, 4, 5])  # Gone from train and eval alike.
    self.assertEqual(report.counts(), {'too_long': 1})
    [file_check] = report.files
    self.assertEqual((file_check.path, file_check.rows, file_check.used), (path, 5, 4))
    [skipped] = file_check.skipped
    self.assertEqual(skipped.row, 3)
    log = '\n'.join(logs.output)
    self.assertIn(f'config.task.kwargs.data_file={path!r}: skipped 1 problem(s) whose prompt does not fit', log)
    self.assertRegex(log, r'row 3 \(at least \d+ tokens\)')
    self.assertIn('config.sampler.max_seq_len=768', log)
    self.assertIn(f'{path} row 3: a prompt of at least', str(report))
    tok = CharTokenizer()
    self.assertTrue(all(_fits(ex, tok, config) for ex in task.eval_set() + task.train_examples()))
    task.close()

  def test_the_budget_is_the_episode_runners_to_the_token(self):
    # Problems around the budget: kept exactly when the runner starts an episode on them.
    tok = CharTokenizer()
    base = len(tok.apply_chat_template(envs.Example('u', 'ab', '').messages(), add_generation_prompt=True)[0])
    room = 64 - base + 2  # Characters of a problem whose prompt has exactly max_seq_len tokens.
    path = _jsonl([_row(1), _row(2)] + [_row(i, 'y' * (room + d)) for i, d in zip(range(3, 8), (-3, -2, -1, 0, 1))])
    config = _config(max_seq_len=64, eval_size=1, instruction='', data_file=path)
    task = envs.get_task(config.task)
    examples = {e.data['row']: e for e in task.eval_set() + task.train_examples()}
    expected = sorted(r for r, e in examples.items() if _fits(e, tok, config))
    self.assertEqual(expected, [1, 2, 3, 4, 5])  # The test straddles the budget.
    report = data_check.check_task_data(config, task, tok)
    self.assertEqual(_rows(task), expected)
    self.assertEqual([(s.row, s.kind) for s in report.files[0].skipped], [(6, 'too_long'), (7, 'too_long')])
    self.assertIn(f'{path} row 6: a prompt of 64 tokens does not fit config.sampler.max_seq_len=64', str(report))
    self.assertEqual(report.longest_prompt, 63)
    task.close()

  def test_a_prompt_the_tokenizer_cannot_render_is_skipped(self):
    # The char tokenizer refuses a character outside its vocabulary: start_episode raised on such a prompt.
    path = _jsonl([_row(1), _row(2, 'What is 2 \u2264 3?'), _row(3), _row(4)])
    config = _config(data_file=path)
    task = envs.get_task(config.task)
    with self.assertLogs(level='WARNING'):
      report = data_check.check_task_data(config, task, CharTokenizer())
    self.assertEqual((_rows(task), report.counts()), ([1, 3, 4], {'unrenderable': 1}))
    self.assertIn(f'{path} row 2: the tokenizer cannot render its prompt: CharTokenizer cannot encode character '
                  "'\u2264'", str(report))
    task.close()

  def test_a_file_with_no_prompt_that_fits_is_refused(self):
    path = _jsonl([_row(1, 'z' * 900), _row(2, 'w' * 900)])
    config = _config(data_file=path)
    task = envs.get_task(config.task)
    with self.assertRaisesRegex(ConfigError, r"config\.task\.kwargs\.data_file='.*': no problem of its 2 fits "
                                r'config\.sampler\.max_seq_len=768'):
      data_check.check_task_data(config, task, CharTokenizer())
    task.close()

  def test_eval_file_rows_are_checked_and_unused_rows_reported(self):
    data = _jsonl([_row(i) for i in range(1, 6)])
    evals = _jsonl([_row(1), _row(7, 'v' * 5000), _row(8), _row(9)])
    config = _config(data_file=data, eval_file=evals, eval_size=3)
    task = envs.get_task(config.task)
    report = data_check.check_task_data(config, task, CharTokenizer())
    self.assertEqual([e.data['row'] for e in task.eval_set()], [1, 3])  # Row 2 too long; row 4 beyond eval_size.
    self.assertEqual([e.data['row'] for e in task.train_examples()], [2, 3, 4, 5])  # Row 1 is an eval problem.
    by_file = {c.field: c for c in report.files}
    self.assertEqual([(s.row, s.kind) for s in by_file['task.kwargs.data_file'].skipped], [(1, 'unused')])
    self.assertEqual([(s.row, s.kind) for s in by_file['task.kwargs.eval_file'].skipped],
                     [(2, 'too_long'), (4, 'unused')])
    self.assertEqual(report.counts(), {'too_long': 1, 'unused': 2})
    task.close()


class MalformedRowsTest(absltest.TestCase):

  def test_malformed_rows_are_counted_by_file_and_row(self):
    path = _jsonl([json.dumps(_row(1)).encode(), b'{"id": "p2", "problem": "caf\xe9?", "answer": "1"}',
                   json.dumps({'id': 'p3', 'problem': 'q?'}).encode(), json.dumps(_row(1)).encode(),
                   json.dumps(_row(5)).encode(), json.dumps(_row(6)).encode()])
    config = _config(data_file=path)
    with self.assertLogs(level='WARNING'):
      task = envs.get_task(config.task)
    report = data_check.check_task_data(config, task, CharTokenizer())
    [file_check] = report.files
    self.assertEqual([(s.row, s.kind) for s in file_check.skipped],
                     [(2, 'malformed'), (3, 'malformed'), (4, 'duplicate')])
    self.assertEqual((file_check.rows, file_check.used, report.skipped), (6, 3, 3))
    self.assertEqual(report.counts(), {'malformed': 2, 'duplicate': 1})
    text = str(report)
    self.assertIn(f"{path} row 3: missing field 'answer'", text)
    self.assertIn(f"{path} row 4: duplicate id 'math:p1' (first at row 1)", text)
    task.close()

  def test_a_clean_file_says_so(self):
    config = _config()  # The shipped sample.
    task = envs.get_task(config.task)
    report = data_check.check_task_data(config, task, CharTokenizer())
    self.assertEqual((report.skipped, report.counts()), (0, {}))
    self.assertIn('no rows skipped', str(report))
    task.close()


class GeneratedTaskTest(absltest.TestCase):

  def test_an_eval_file_of_a_generated_task_is_filtered(self):
    path = _jsonl([{'id': 1, 'problem': 'Add 2 and 3.', 'answer': 5}, {'id': 2, 'problem': 'q' * 5000, 'answer': 1},
                   {'id': 3, 'problem': 'Add 4 and 4.', 'answer': 8}, {'id': 4, 'problem': 'Add 1 + 1.', 'answer': 2}])
    config = arith_config.get_config()
    config.sampler.max_seq_len = 256
    task = envs.get_task({'name': 'arith_words', 'eval_size': 3, 'kwargs': {'eval_file': path}})
    with self.assertLogs(level='WARNING') as logs:
      report = data_check.check_task_data(config, task, CharTokenizer())
    self.assertEqual([e.data['row'] for e in task.eval_set()], [1, 3])
    self.assertEqual([(s.row, s.kind) for s in report.files[0].skipped], [(2, 'too_long'), (4, 'unused')])
    self.assertIn('row 2 (at least 389 tokens)', logs.output[0])
    self.assertIn(f'{path} row 4: beyond config.task.eval_size=3', str(report))

  def test_the_eval_set_is_measured(self):
    config = arith_config.get_config()
    task = envs.get_task(config.task)
    t0 = time.perf_counter()
    report = data_check.check_task_data(config, task, CharTokenizer())
    self.assertLess(time.perf_counter() - t0, 1.0)
    self.assertEqual((report.files, report.skipped, report.generated_checked), ([], 0, config.task.eval_size))
    config.sampler.max_seq_len = report.longest_prompt  # The longest eval prompt no longer fits.
    with self.assertRaisesRegex(ConfigError, rf'config\.sampler\.max_seq_len={report.longest_prompt}: .*arith'):
      data_check.check_task_data(config, task, CharTokenizer())


@absltest.skipIf(hf_tokenizers is None, 'needs the tokenizers package')
class HFTokenizerTest(absltest.TestCase):

  def _texts(self, alphabet: str) -> list[str]:
    rng = np.random.default_rng(0)
    texts = [''.join(rng.choice(list(alphabet), size=int(rng.integers(1, 400)))) for _ in range(200)]
    return texts + [' answer' * 300, 'hello world ' * 200, 'e\u0301' * 500, '\n' * 300, '<|im_start|>' * 50]

  def _check_bounds(self, tok, *, ceiling: bool):
    bounds = data_check._Bounds.of(tok)  # pylint: disable=protected-access
    self.assertIsNotNone(bounds)
    self.assertEqual(bounds.has_ceiling, ceiling)
    for text in self._texts('ab the answer is hello world 12=+\n\u00e9e\u0301\u0958\u4e16\U0001f600'):
      n = len(tok.encode(text))
      self.assertLessEqual(bounds.floor(text), n, text[:80])
      self.assertGreaterEqual(bounds.ceiling(text), n, text[:80])

  def test_byte_level_bpe_bounds_hold(self):
    from tests import tokenizers_test  # pylint: disable=g-import-not-at-top  (imports tokenizers)
    tok = tokenizers_test.tiny_hf_tokenizer()
    self._check_bounds(tok, ceiling=True)
    tok.tokenizer.normalizer = hf_tokenizers.normalizers.NFC()  # As Qwen's: NFC shortens e + U+0301, lengthens U+0958.
    self._check_bounds(tok, ceiling=True)

  def test_sentencepiece_style_bpe_floor_holds(self):
    models, normalizers, pre_tokenizers = hf_tokenizers.models, hf_tokenizers.normalizers, hf_tokenizers.pre_tokenizers
    vocab = {'<unk>': 0, '<|end|>': 1, **{f'<0x{b:02X}>': 2 + b for b in range(256)}}
    merges = []
    for word in ('\u2581the', '\u2581answer', '\u2581hello', 'ab', '\u00e9t\u00e9'):
      left = word[0]
      vocab.setdefault(left, len(vocab))
      for ch in word[1:]:
        vocab.setdefault(ch, len(vocab))
        merges.append((left, ch))
        left += ch
        vocab.setdefault(left, len(vocab))
    model = models.BPE(vocab=vocab, merges=merges, unk_token='<unk>', fuse_unk=True, byte_fallback=True)
    tok = hf_tokenizers.Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.add_special_tokens(['<|end|>'])
    wrapped = HFTokenizer(tok, None, eos_token='<|end|>')
    self._check_bounds(wrapped, ceiling=False)
    tok.model = models.BPE(vocab=vocab, merges=merges, unk_token='<unk>', fuse_unk=True)  # Unknowns fused: no bound.
    bounds = data_check._Bounds.of(HFTokenizer(tok, None, eos_token='<|end|>'))  # pylint: disable=protected-access
    self.assertIsNone(bounds)

  def test_a_huge_prompt_is_decided_without_tokenizing_it(self):
    from tests import tokenizers_test  # pylint: disable=g-import-not-at-top
    tok = tokenizers_test.tiny_hf_tokenizer()
    path = _jsonl([_row(1), _row(2), _row(3, 'the answer is hello world. ' * 200_000), _row(4)])  # 5.4 MB.
    config = _config(data_file=path)
    task = envs.get_task(config.task)
    t0 = time.perf_counter()
    with self.assertLogs(level='WARNING'):
      report = data_check.check_task_data(config, task, tok)
    self.assertLess(time.perf_counter() - t0, 2.0)  # Tokenizing it takes ~6 s.
    self.assertEqual((_rows(task), report.counts()), ([1, 2, 4], {'too_long': 1}))
    self.assertTrue(all(_fits(ex, tok, config) for ex in task.eval_set() + task.train_examples()))
    task.close()


if __name__ == '__main__':
  absltest.main()
