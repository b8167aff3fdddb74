r"""Exports a policy as an HF directory and checks that transformers loads it and answers the task the same.

  python -m sao_jax.benchmarks.hf_export --config=configs/smollm2_arith.py --checkpoint=WORKDIR \
      --out=/tmp/smollm2-sao-hf [--limit=8] [--hf_batch_size=32]
  python -m sao_jax.benchmarks.hf_export --config=configs/smollm2_arith.py --hf_model=/tmp/smollm2-hf ...

1. loads the policy (a sao_jax checkpoint, or an HF directory) as `sao_jax.eval` does, and writes it with
   `sao_jax.models.hf_io.save_hf` (float32 safetensors, config.json, the tokenizer files of
   `config.model.hf_dir`) to `--out`;
2. plays the first `--limit` problems of the task's eval set greedily on our KV-cache sampler (`sao_jax.eval`);
3. loads `--out` with transformers (`AutoModelForCausalLM`, `AutoTokenizer`: its own chat template), generates
   greedily for the same chat prompts with the same budget, and scores each reply with the task's env
   (`--hf_batch_size` prompts a `generate` call, left-padded with an attention mask; 1, the default, pads
   nothing: a padded batch's float sums can differ in the last bits and, rarely, flip a greedy token);
4. prints both replies and rewards of the problems where they differ (of every problem with `--show_all`), the
   counts of identical prompts, replies and rewards, and both greedy accuracies (the export must score as ours).
"""

from __future__ import annotations

import os
import time

from absl import app, flags
from ml_collections import config_flags

from sao_jax import eval as eval_lib
from sao_jax import rollout
from sao_jax.envs import registry
from sao_jax.models import hf_io

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file (task, sampler budgets, model).')
_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'sao_jax checkpoint directory (or a trainer workdir).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')
_HF_MODEL = flags.DEFINE_string('hf_model', None, 'Or: an HF model directory.')
_OUT = flags.DEFINE_string('out', None, 'Where the exported HF directory is written.')
_LIMIT = flags.DEFINE_integer('limit', 8, 'Eval problems compared.')
_BATCH = flags.DEFINE_integer('batch_size', 0, 'Episodes per call of our sampler (0 = trainer.eval_batch_size, '
                              'else sampler.batch_size).')
_HF_BATCH = flags.DEFINE_integer('hf_batch_size', 1, 'Prompts per transformers generate call (left-padded).')
_SHOW_ALL = flags.DEFINE_bool('show_all', False, 'Print every problem\'s replies, not only those that differ.')
flags.mark_flags_as_required(['config', 'out'])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  config = _CONFIG.value
  model, tokenizer = eval_lib.load_model_and_tokenizer(config, checkpoint=_CHECKPOINT.value,
                                                       hf_model=_HF_MODEL.value, step=_STEP.value)
  out = _OUT.value
  t0 = time.perf_counter()
  hf_io.save_hf(model, model.cfg, out, tokenizer_dir=config.model.hf_dir or _HF_MODEL.value or None)
  print(f'[1] exported to {out} in {time.perf_counter() - t0:.1f}s: {sorted(os.listdir(out))}')

  task = registry.get_task(config.task)
  settings = eval_lib.EvalConfig.from_config(config)
  batch = min(_LIMIT.value, _BATCH.value or config.trainer.get('eval_batch_size', 0) or config.sampler.batch_size)
  backend = rollout.make_backend(model, tokenizer, task, settings.settings, batch_size=batch)
  t0 = time.perf_counter()
  run = eval_lib.run_eval(backend, tokenizer, task, settings, limit=_LIMIT.value, batch_size=batch, progress=False)
  print(f'[2] ours: greedy accuracy {run.summary["greedy_accuracy"]:.3f} on {len(run.results)} problems '
        f'({time.perf_counter() - t0:.0f}s)')

  hf_tok = transformers.AutoTokenizer.from_pretrained(out)
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  stop_ids = list(tokenizer.stop_ids)
  same_prompt = same_reply = same_reward = 0
  hf_correct = 0
  examples = list(task.eval_set())[:len(run.results)]
  prompts = []
  for ex in examples:
    messages = task.make_env(ex).reset()
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids['input_ids'] if hasattr(ids, 'keys') else ids)
    same_prompt += ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True)[0]
    prompts.append(ids)
  t0 = time.perf_counter()
  replies = []
  for start in range(0, len(prompts), _HF_BATCH.value):
    chunk = prompts[start:start + _HF_BATCH.value]
    width = max(map(len, chunk))
    ids = torch.tensor([[tokenizer.pad_id] * (width - len(p)) + p for p in chunk])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
    with torch.no_grad():
      gen = hf_model.generate(ids, attention_mask=mask, max_new_tokens=int(config.sampler.max_new_tokens),
                              do_sample=False, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_id)
    for row in gen[:, width:].tolist():
      ends = [i for i, t in enumerate(row) if t in stop_ids]
      replies.append(row[:ends[0] + 1] if ends else row)  # Up to the first stop token; a cut reply whole.
  hf_s = time.perf_counter() - t0
  for ex, ours, new in zip(examples, run.results, replies):
    reply = hf_tok.decode(new, skip_special_tokens=True)
    finished = bool(new) and new[-1] in stop_ids
    env = task.make_env(ex)
    env.reset()
    result = env.step(reply) if finished else None  # A cut reply scores 0 and is wrong, as in our eval.
    reward = result.reward if result else 0.0
    same_reply += reply == ours.greedy_response
    same_reward += reward == ours.greedy_reward
    hf_correct += bool(result) and bool(result.info.get('correct', result.reward >= 1.0))  # `is_correct`'s rule.
    if _SHOW_ALL.value or reply != ours.greedy_response:
      print(f'    {ex.uid} answer {ex.answer}: ours {ours.greedy_reward:.0f} {ours.greedy_response!r}\n'
            f'    {" " * len(ex.uid)}       transformers {reward:.0f} {reply!r}')
  n = len(run.results)
  print(f'[3] transformers on the export: identical chat prompts {same_prompt}/{n}, replies {same_reply}/{n}, '
        f'rewards {same_reward}/{n}; greedy accuracy {hf_correct / n:.3f} (ours '
        f'{run.summary["greedy_accuracy"]:.3f}; {hf_s:.0f}s, {_HF_BATCH.value} a call)')
  task.close()


if __name__ == '__main__':
  app.run(main)
