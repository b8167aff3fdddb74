"""Tests of sao_jax.eval: scoring counts and pass@k, the KV-cache backend it builds, the CLI (the episode runner
itself is tested in tests/rollout)."""

import json
import math
import os
import subprocess
import sys
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import arith as arith_config
from configs import calculator as calculator_config
from configs import smollm2_arith as smollm2_arith_config
from sao_jax import checkpoint
from sao_jax import eval as eval_lib
from sao_jax import rollout
from sao_jax.generate.config import GenerateConfig
from sao_jax.envs import answers
from tests import multiprocess
from sao_jax.envs import arith_words
from sao_jax.envs import evaluation
from sao_jax.envs import registry
from sao_jax.errors import ConfigError
from sao_jax.models import hf_io
from sao_jax.generate import static as sampler_lib
from sao_jax.models.config import get_model_config
from sao_jax.models.llama import Decoder
from sao_jax.tokenizers import CharTokenizer
from tests.rollout import helpers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScriptedGenerate:
  """Returns scripted response texts: call c for problem i gets `script(i, c)` (+ the end-of-turn token)."""

  def __init__(self, tokenizer, index, script):
    self.tok, self.index, self.script = tokenizer, index, script
    self.calls = {}

  def __call__(self, context, max_new_tokens, stop_ids):
    i, _ = helpers.problem_of(context, self.index)
    c = self.calls.get(i, 0)
    self.calls[i] = c + 1
    text, stop = self.script(i, c)
    ids = self.tok.encode(text) + ([self.tok.eos_id] if stop else [])
    ids = ids[:max_new_tokens]
    return ids, [-0.5] * len(ids)


def _counts(i, k):
  """Correct samples of problem i (out of k): 0, 1, ..., k, 0, 1, ..."""
  return i % (k + 1)


def _settings(config):
  return eval_lib.EvalConfig.from_config(config)


def _arith_config():
  """configs/arith.py with the `<answer>N</answer>` format that the scripted replies below use."""
  config = arith_config.get_config()
  config.task.kwargs.answer_format = 'tag'
  return config


class EvalScoringTest(parameterized.TestCase):
  """The pipeline with a scripted generator: JSONL rows, counts and pass@k / avg@k exactly."""

  def test_counts_pass_at_k_and_jsonl(self):
    config = _arith_config()
    config.task.eval_size = 7
    task = registry.get_task(config.task)
    tok = CharTokenizer()
    examples = task.eval_set()
    k = 4

    def script(i, c):
      ex = examples[i]
      wrong = str(int(ex.answer) + 1)
      if c == 0:  # Greedy: right on even problems; problem 1 emits no stop token (truncated).
        if i == 1:
          return '<answer>' + ex.answer, False
        return answers.render(ex.answer if i % 2 == 0 else wrong, 'tag'), True
      j = c - 1  # Sample j: the first _counts(i) samples are right, the rest wrong or malformed.
      if j < _counts(i, k):
        return answers.render(ex.answer, 'tag'), True
      return (answers.render(wrong, 'tag') if j % 2 else f'{ex.answer}'), True

    gen = ScriptedGenerate(tok, helpers.prompt_index(tok, examples), script)
    backend = rollout.ContextBackend(gen, tok.stop_ids)
    out = os.path.join(tempfile.mkdtemp(), 'sub', 'results.jsonl')
    summary = eval_lib.evaluate(None, tok, task, _settings(config), num_samples=k, greedy=True, backend=backend,
                                batch_size=3, output=out, progress=False)

    n = len(examples)
    greedy_ok = [i % 2 == 0 and i != 1 for i in range(n)]
    self.assertEqual(summary['num_problems'], n)
    self.assertEqual(summary['num_errors'], 0)
    self.assertEqual(summary['num_samples'], k)
    self.assertEqual(summary['num_episodes'], n * (k + 1))
    self.assertAlmostEqual(summary['greedy_accuracy'], np.mean(greedy_ok))
    for kk in (1, 2, 4):
      want_pass = np.mean([1 - math.comb(k - _counts(i, k), kk) / math.comb(k, kk) for i in range(n)])
      want_avg = np.mean([min(_counts(i, k), kk) / kk for i in range(n)])
      self.assertAlmostEqual(summary[f'pass@{kk}'], want_pass, places=12)
      self.assertAlmostEqual(summary[f'avg@{kk}'], want_avg, places=12)
    self.assertAlmostEqual(summary['truncated_fraction'], 1 / (n * (k + 1)))
    self.assertEqual(summary['mean_turns'], 1.0)
    # Every episode ran exactly once per (problem, sample).
    self.assertEqual(gen.calls, {i: k + 1 for i in range(n)})

    with open(out) as f:
      rows = [json.loads(line) for line in f]
    self.assertLen(rows, n)
    self.assertEqual([r['uid'] for r in rows], [ex.uid for ex in examples])
    for i, r in enumerate(rows):
      self.assertEqual(r['answer'], examples[i].answer)
      self.assertEqual(r['num_samples'], k)
      self.assertEqual(r['num_correct'], _counts(i, k))
      self.assertEqual(r['correct'], [j < _counts(i, k) for j in range(k)])
      self.assertEqual(r['greedy_correct'], greedy_ok[i])
      self.assertEqual(r['info']['greedy_truncated'], i == 1)
      self.assertEqual(r['responses'][:_counts(i, k)], [f'<answer>{examples[i].answer}</answer>'] * _counts(i, k))
      self.assertEqual(r['rewards'], [1.0 if j < _counts(i, k) else 0.0 for j in range(k)])
    self.assertEqual(rows[1]['greedy_response'], f'<answer>{examples[1].answer}')
    with open(out + '.summary.json') as f:
      self.assertEqual(json.load(f), summary)
    # The JSONL reads back into the same summary.
    self.assertEqual(evaluation.summarize(evaluation.read_jsonl(out))['pass@2'], summary['pass@2'])
    self.assertIn('pass@4', evaluation.format_table(summary))

  def test_env_errors_are_counted_and_excluded(self):
    config = _arith_config()
    config.task.eval_size = 4
    task = registry.get_task(config.task)
    examples = task.eval_set()
    bad_uid = examples[2].uid
    make_env = task.make_env

    def flaky_env(example):
      env = make_env(example)
      if example.uid == bad_uid:
        def boom(text):
          raise RuntimeError('verifier crashed')
        env._step = boom  # pylint: disable=protected-access
      return env
    task.make_env = flaky_env
    tok = CharTokenizer()
    gen = ScriptedGenerate(tok, helpers.prompt_index(tok, examples),
                           lambda i, c: (answers.render(examples[i].answer, 'tag'), True))
    run = eval_lib.run_eval(rollout.ContextBackend(gen, tok.stop_ids), tok, task, _settings(config), num_samples=2,
                            progress=False)
    self.assertEqual(run.summary['num_errors'], 1)
    self.assertEqual(run.summary['greedy_accuracy'], 1.0)  # Over the 3 problems without errors.
    self.assertEqual(run.summary['pass@2'], 1.0)
    self.assertLen(run.results[2].errors, 3)
    self.assertIn('verifier crashed', run.results[2].errors[0])
    self.assertEqual(run.results[2].rewards, [0.0, 0.0])

  def test_bad_arguments(self):
    config = _arith_config()
    config.task.eval_size = 2
    task = registry.get_task(config.task)
    tok = CharTokenizer()
    backend = rollout.ContextBackend(lambda c, n, s: ([tok.eos_id], [0.0]), tok.stop_ids)
    with self.assertRaisesRegex(ValueError, 'Nothing to evaluate'):
      eval_lib.run_eval(backend, tok, task, _settings(config), greedy=False, num_samples=0, progress=False)
    with self.assertRaisesRegex(ValueError, 'temperature > 0'):
      eval_lib.run_eval(backend, tok, task, _settings(config), num_samples=2, temperature=0.0, progress=False)
    with self.assertRaisesRegex(ValueError, 'limit=0'):
      eval_lib.run_eval(backend, tok, task, _settings(config), limit=0, progress=False)
    with self.assertRaisesRegex(ValueError, 'needs a model'):
      eval_lib.evaluate(None, tok, task, _settings(config))
    config.sampler.max_seq_len = 10  # The prompts are 16-17 tokens.
    with self.assertRaisesRegex(ValueError, 'config.sampler.max_seq_len=10'):
      eval_lib.run_eval(backend, tok, task, _settings(config), progress=False)
    with self.assertRaisesRegex(ValueError, 'exactly one of --checkpoint'):
      eval_lib.load_model_and_tokenizer(config, checkpoint=None, hf_model=None)


class MakeBackendTest(absltest.TestCase):

  def test_reused_sampler_must_stop_on_task_tokens(self):
    tok = CharTokenizer()
    model = helpers.small_model(tok.vocab_size, seed=0)
    config = calculator_config.get_config()
    config.task.eval_size = 2
    task = registry.get_task(config.task)
    plain = sampler_lib.Sampler(model, stop_ids=tok.stop_ids, pad_id=tok.pad_id)
    with self.assertRaisesRegex(ValueError, 'does not stop on token'):
      rollout.make_backend(model, tok, task, GenerateConfig.from_config(config), sampler=plain)
    big = helpers.small_model(tok.vocab_size - 10, seed=0)
    with self.assertRaisesRegex(ValueError, 'only .* embeddings'):
      rollout.make_backend(big, tok, task, GenerateConfig.from_config(config))


class EndToEndTest(absltest.TestCase):
  """The real thing with a random tiny Decoder and the char tokenizer (accuracy ~0; the pipeline is checked)."""

  def test_calculator_evaluate_with_kv_sampler(self):
    config = calculator_config.get_config()
    config.task.eval_size = 3
    config.sampler.max_new_tokens = 12
    tok = CharTokenizer()
    task = registry.get_task(config.task)
    model = helpers.small_model(tok.vocab_size, seed=1)
    backend = rollout.make_backend(model, tok, task, GenerateConfig.from_config(config), batch_size=4)
    rows, generate = [], backend.sampler.generate

    def spy(prompts, **kwargs):
      rows.append(len(prompts))
      return generate(prompts, **kwargs)
    backend.sampler.generate = spy
    run = eval_lib.run_eval(backend, tok, task, _settings(config), num_samples=2, greedy=True, batch_size=4,
                            progress=False)
    summary = run.summary
    self.assertEqual(summary['num_problems'], 3)
    self.assertEqual(summary['num_episodes'], 9)
    # Batches of 3 (greedy), 4 and 2 (samples) all run as 4 rows (one program per decoding mode).
    self.assertEqual(rows, [4, 4, 4])
    # Periodic eval: the same backend with another model's weights compiles nothing new.
    compiled = backend.sampler.num_compiled()
    other = helpers.small_model(tok.vocab_size, seed=7)
    out = os.path.join(tempfile.mkdtemp(), 'again.jsonl')
    eval_lib.evaluate(other, tok, task, _settings(config), backend=backend, batch_size=4, progress=False, output=out)
    self.assertEqual(backend.sampler.num_compiled(), compiled)
    again = [r.greedy_response for r in evaluation.read_jsonl(out)]
    self.assertNotEqual(again, [r.greedy_response for r in run.results])  # The new weights were used.
    for key in ('greedy_accuracy', 'pass@1', 'pass@2', 'avg@1', 'avg@2'):
      self.assertBetween(summary[key], 0.0, 1.0)
    self.assertBetween(summary['mean_action_tokens'], 1.0, 3 * 12)

  def test_cli_arith_checkpoint_and_errors(self):
    tmp = tempfile.mkdtemp()
    cfg = get_model_config('tiny', num_layers=1, vocab_size=128, embed_dim=32, mlp_dim=64, head_dim=8)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    with checkpoint.Checkpointer(os.path.join(tmp, 'checkpoints')) as ckpt:  # A trainer's workdir layout.
      ckpt.save(checkpoint.CheckpointState(step=3, policy=nnx.state(model),
                                           metadata=checkpoint.policy_metadata(cfg)))
    out = os.path.join(tmp, 'res.jsonl')
    env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=multiprocess.child_xla_flags(1))
    cmd = [sys.executable, '-m', 'sao_jax.eval', '--config=configs/arith.py', '--limit=2', '--num_samples=2',
           '--batch_size=4', f'--output={out}', '--config.sampler.max_new_tokens=8']
    proc = subprocess.run(cmd + [f'--checkpoint={tmp}'], cwd=_ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    self.assertIn('pass@2', proc.stdout)
    self.assertIn('greedy_accuracy', proc.stdout)
    with open(out) as f:
      rows = [json.loads(line) for line in f]
    self.assertLen(rows, 2)
    self.assertTrue(all(r['num_samples'] == 2 and len(r['responses']) == 2 for r in rows))
    self.assertTrue(all(r['greedy_response'] is not None for r in rows))

    proc = subprocess.run(cmd, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=120)
    self.assertNotEqual(proc.returncode, 0)
    self.assertIn('exactly one of --checkpoint', proc.stderr)

  def test_cli_eval_file_rows_and_a_bad_row(self):
    tmp = tempfile.mkdtemp()
    tok = CharTokenizer()
    model = helpers.small_model(tok.vocab_size, seed=3)
    with checkpoint.Checkpointer(os.path.join(tmp, 'checkpoints')) as ckpt:
      ckpt.save(checkpoint.CheckpointState(step=1, policy=nnx.state(model),
                                           metadata=checkpoint.policy_metadata(model.cfg)))
    rows = [{'id': 'q1', 'problem': 'What is 12 plus 30?', 'answer': 42},
            {'id': 2, 'problem': 'Ana has 9 pens and loses 4. How many are left?', 'answer': '5'},
            {'id': 'q3', 'problem': 'Compute 6 * 7.', 'answer': '42'}]
    good, bad = os.path.join(tmp, 'good.jsonl'), os.path.join(tmp, 'bad.jsonl')
    for path, data in ((good, rows), (bad, rows[:1] + [{'id': 'q2', 'problem': 'x', 'answer': 'many'}])):
      with open(path, 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in data)
    out = os.path.join(tmp, 'res.jsonl')
    env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=multiprocess.child_xla_flags(1))
    cmd = [sys.executable, '-m', 'sao_jax.eval', '--config=configs/smollm2_arith.py', f'--checkpoint={tmp}',
           '--config.model.name=tiny', '--config.model.hf_dir=', '--config.model.tokenizer=char',
           '--config.sampler.max_new_tokens=4', '--batch_size=4', f'--output={out}']
    proc = subprocess.run(cmd + [f'--eval_file={good}'], cwd=_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
    got = evaluation.read_jsonl(out)
    self.assertEqual([(r.uid, r.prompt, r.answer) for r in got], [
        (f'arith_words:file:{r["id"]}', f'{r["problem"]} Answer with just the number.', str(r['answer']))
        for r in rows])
    for r in got:  # Scored by the task's rule: the last number of the reply.
      self.assertEqual(r.greedy_correct, arith_words.last_number(r.greedy_response) == int(r.answer))
    self.assertRegex(proc.stdout, r'num_problems\s*\|\s*3\n')

    # What the CLI does with --eval_file before it loads a model (it exits with this error).
    config = eval_lib.with_eval_file(smollm2_arith_config.get_config(), bad)
    with self.assertRaisesRegex(ConfigError, rf"config\.task\.kwargs\.eval_file='{bad}': row 2: answer 'many' "
                                'is not a number'):
      registry.get_task(config.task)

  def test_hf_model_loading(self):
    tmp = tempfile.mkdtemp()
    tok = CharTokenizer()
    model = helpers.small_model(tok.vocab_size, seed=2)
    hf_io.save_hf(model, model.cfg, tmp)
    config = arith_config.get_config()
    loaded, tokenizer = eval_lib.load_model_and_tokenizer(config, checkpoint=None, hf_model=tmp)
    self.assertIsInstance(tokenizer, CharTokenizer)  # No tokenizer.json: config.model.tokenizer ('char').
    tokens = jnp.asarray([[5, 6, 7]], jnp.int32)
    np.testing.assert_allclose(np.asarray(loaded(tokens)), np.asarray(model(tokens)), atol=1e-5)
    with self.assertRaisesRegex(FileNotFoundError, 'not a directory'):
      eval_lib.load_model_and_tokenizer(config, checkpoint=None, hf_model=os.path.join(tmp, 'nope'))


if __name__ == '__main__':
  absltest.main()
