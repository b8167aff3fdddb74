"""arith_words: phrasings give the right answers, the last-number reward rule, a held-out set never trained on,
eval files (and their malformed rows), and the SmolLM2 config's smoke-run override."""

import json
import os
import re
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import ml_collections
import numpy as np

from configs import smollm2_arith
from sao_jax import config_lib
from sao_jax import envs
from sao_jax.envs import arith_words
from sao_jax.errors import ConfigError
from sao_jax.tokenizers import CharTokenizer


def _task(eval_size=64, **kwargs):
  return envs.get_task(ml_collections.ConfigDict(
      {'name': 'arith_words', 'max_turns': 1, 'eval_size': eval_size, 'kwargs': kwargs}))


def _reference(problem: str, op: str) -> int:
  """The answer from the two integers written in the problem text (independent of the generator's a, b): for
  `-` the first one minus the second, or the second minus the first when the text says "(subtract / take) ...
  from / away from"."""
  x, y = (int(v) for v in re.findall(r'\d+', problem))
  if op == '-' and re.search(r'\bfrom\b', problem):
    x, y = y, x
  return {'+': x + y, '-': x - y, '*': x * y}[op]


def _write(rows, suffix='.jsonl'):
  fd, path = tempfile.mkstemp(suffix=suffix)
  with os.fdopen(fd, 'w') as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return path


class PhrasingTest(parameterized.TestCase):

  @parameterized.parameters('+', '-', '*')
  def test_every_template_states_both_operands(self, op):
    for form, table in (('plain', arith_words._PLAIN), ('word', arith_words._WORDS)):
      self.assertGreaterEqual(len(table[op]), 10, f'{form} {op}')
      for t in table[op]:
        text = t.format(a=47, b=18, name='Ann', name2='Bo', he='she', He='She', his='her', His='Her',
                        items='beads', food='plums')
        self.assertEqual(sorted(int(v) for v in re.findall(r'\d+', text)), [18, 47], text)
        self.assertNotIn('{', text)
        self.assertTrue(text.isascii() and text[-1] in '?.', text)

  def test_generated_answers_match_the_text(self):
    rng = np.random.default_rng(0)
    opts = arith_words.ArithWordsOptions()
    seen = set()
    for _ in range(3000):
      problem, value, data = arith_words.make_problem(rng, opts)
      op = re.sub(r'\d', '', data['expression'])
      self.assertEqual(value, _reference(problem, op), problem)
      a, b = (int(v) for v in data['expression'].split(op))
      if op in '+-':
        self.assertTrue(2 <= a <= 50 and 2 <= b <= 50, problem)
        self.assertGreaterEqual(value, 0)
      else:
        self.assertTrue(2 <= min(a, b) <= 9 and 2 <= max(a, b) <= 25, problem)
      seen.add((op, data['form'], data['template']))
    want = {(op, form, k) for form, table in (('plain', arith_words._PLAIN), ('word', arith_words._WORDS))
            for op, ts in table.items() for k in range(len(ts))}
    self.assertEqual(seen, want)  # Every phrasing is drawn.

  def test_prompt_is_the_problem_and_the_instruction_as_one_user_message(self):
    task = _task()
    ex = task.eval_set()[0]
    messages = task.make_env(ex).reset()
    self.assertEqual(messages, [{'role': 'user', 'content': ex.data['problem'] + ' Answer with just the number.'}])
    self.assertIsNone(ex.system)  # The chat template's default system message, not ours.
    self.assertEqual(ex.answer, str(_reference(ex.data['problem'], re.sub(r'\d', '', ex.data['expression']))))

  def test_options_are_checked(self):
    for kwargs, field in (({'ops': '/'}, 'ops'), ({'mul_small_max': 1}, 'mul_small_max'),
                          ({'word_fraction': 1.5}, 'word_fraction'), ({'eval_file': '/nonexistent.jsonl'},
                                                                      'eval_file')):
      with self.assertRaisesRegex(ConfigError, rf'config\.task\.kwargs\.{field}'):
        _task(**kwargs)


class RewardTest(parameterized.TestCase):

  @parameterized.parameters(
      ('81', '81', 1.0),
      ('The answer is 81.', '81', 1.0),
      ('23 + 58 = 81', '81', 1.0),
      ('81 apples, or maybe 82', '81', 0.0),  # The LAST number counts.
      ('82', '81', 0.0),
      ('9,801', '9801', 1.0),
      ('The result is -35.', '-35', 1.0),
      ('58-23', '-23', 0.0),  # A minus right after a digit is subtraction, not a sign.
      ('95-60=35', '35', 1.0),
      ('81.0', '81', 1.0),
      ('81.5', '81', 0.0),
      ('eighty-one', '81', 0.0),
      ('', '81', 0.0),
  )
  def test_last_number_rule(self, reply, answer, want):
    env = arith_words.ArithWordsEnv(envs.Example('u', 'p', answer))
    env.reset()
    obs, reward, done, info = env.step(reply)
    self.assertEqual((obs, reward, done, info['correct']), (None, want, True, want == 1.0))


class HeldOutTest(absltest.TestCase):

  def test_eval_set_is_fixed_distinct_and_never_trained_on(self):
    task = _task(eval_size=256)
    ev = task.eval_set()
    self.assertLen({e.uid for e in ev}, 256)
    self.assertEqual([e.prompt for e in ev], [e.prompt for e in _task(eval_size=256).eval_set()])
    held = {e.data['expression'] for e in ev}
    for seed in (0, 1):
      it = task.train_iterator(seed)
      train = [next(it) for _ in range(4000)]
      self.assertEmpty({e.data['expression'] for e in train} & held)  # Not even in another phrasing.
    self.assertNotEqual(next(task.train_iterator(0)).prompt, next(task.train_iterator(1)).prompt)


class EvalFileTest(absltest.TestCase):

  def test_rows_become_examples_asked_and_scored_the_same_way(self):
    path = _write([{'id': 'a', 'problem': 'What is 2 plus 2?', 'answer': 4},
                   {'id': 7, 'problem': 'Sam has 9 cats and gives away 3. How many are left?', 'answer': '6'},
                   {'id': 'c', 'problem': 'Halve 3.', 'answer': '1.5'}])
    task = _task(eval_size=0, eval_file=path)
    ev = task.eval_set()
    self.assertEqual([e.prompt for e in ev], ['What is 2 plus 2? Answer with just the number.',
                                              'Sam has 9 cats and gives away 3. How many are left? Answer with just '
                                              'the number.', 'Halve 3. Answer with just the number.'])
    self.assertEqual([e.uid for e in ev], ['arith_words:file:a', 'arith_words:file:7', 'arith_words:file:c'])
    rewards = [task.make_env(e).step(r).reward for e, r in zip(ev, ('It is 4.', '5', '1.5'))]
    self.assertEqual(rewards, [1.0, 0.0, 1.0])
    self.assertLen(_task(eval_size=2, eval_file=path).eval_set(), 2)

  def test_malformed_row_is_an_error_naming_it(self):
    good = {'id': 1, 'problem': 'What is 1 plus 1?', 'answer': 2}
    for bad, why in (({'id': 2, 'problem': 'x'}, r"missing field 'answer'"),
                     ({'id': 2, 'problem': 'x', 'answer': 'two'}, r"answer 'two' is not a number"),
                     ({'id': 2, 'answer': 3}, r"missing field 'problem'"),
                     ({'id': 1, 'problem': 'y', 'answer': 3}, r"duplicate id '1' \(first at row 1\)"),
                     ('{"id": 2, "problem": ', r'invalid JSON'),
                     ('[1, 2]', r'not an object but list')):
      path = _write([good, bad])
      with self.assertRaisesRegex(ConfigError, rf'config\.task\.kwargs\.eval_file=.*row 2: {why}'):
        _task(eval_size=0, eval_file=path)

  def test_training_skips_the_files_problems(self):
    plain = _task()
    it = plain.train_iterator(0)
    first = [next(it) for _ in range(5)]
    path = _write([{'id': i, 'problem': e.data['problem'], 'answer': e.answer} for i, e in enumerate(first)])
    it = _task(eval_size=0, eval_file=path).train_iterator(0)
    texts = {e.data['problem'] for e in first}
    self.assertEmpty({next(it).data['problem'] for _ in range(50)} & texts)


class ConfigTest(absltest.TestCase):

  def test_smoke_override_validates_and_char_prompts_fit(self):
    config = smollm2_arith.get_config()
    self.assertEqual((config.task.name, config.algo.name, config.model.name), ('arith_words', 'sao', 'smollm2-135m'))
    config.model.name, config.model.hf_dir, config.model.tokenizer = 'tiny', '', 'char'
    config_lib.validate(config, log=False)
    task = envs.get_task(config.task)
    tok = CharTokenizer()
    it = task.train_iterator(0)
    longest = max(len(tok.apply_chat_template(task.make_env(e).reset(), add_generation_prompt=True)[0])
                  for e in task.eval_set() + [next(it) for _ in range(500)])
    self.assertLessEqual(longest, max(config.sampler.prompt_buckets))
    self.assertLessEqual(longest + config.sampler.max_new_tokens, config.sampler.max_seq_len)


if __name__ == '__main__':
  absltest.main()
