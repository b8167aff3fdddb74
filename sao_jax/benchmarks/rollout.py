r"""Rollout throughput on long-tailed episodes: static batches (`run_episodes`) vs continuous batching
(`run_continuous`) at the same slot count.

  python -m sao_jax.benchmarks.rollout [--model=tiny | --hf_dir=/path/to/smollm2-hf] \
      [--episodes=128 --slots=16 --workloads=single,multi --repeats=2 --decode_steps=32 --refill_rows=1,4
       --device_refill=false,true --queue_chunk=16]

Workloads (the same episodes, the same seeds, for both runners):

* `single`: one turn per episode; its length is drawn log-normal (median `--median_len`, sigma `--sigma`),
  clipped to [`--min_len`, `--max_len`] tokens, and forced: it is the turn's token budget and no token stops a
  turn (a random model does not stop on its own, except by chance on its end-of-turn token, which is off);
* `multi`: `--turns` turns per episode, each with its own forced length drawn as above (median divided by the
  number of turns), and after every turn a tool call whose wall time is log-normal (median `--tool_ms`),
  clipped to [20, 500] ms (the env sleeps, as a sandbox or a remote tool would).

The static runner plays `--slots` episodes at a time, turn by turn (a turn waits for its longest generation and the
slowest of the batch's env steps, which run concurrently); the continuous runner keeps `--slots` decode slots busy
and steps envs in a thread pool. Figures: completed episodes/s and generated (action) tokens/s, median of
`--repeats` interleaved runs after one warm-up run of each (compilation excluded), with the machine's load average
printed alongside, the process CPU seconds of each (on a machine loaded by others the CPU ratio is the steadier
figure) and the memory bandwidth measured just before each run (`common.memory_bandwidth`, the median of the
runner's runs: on a shared host it moves several-fold within minutes, and a decode step over a long KV cache moves
with it). The continuous runner runs once per `--refill_rows` value (free slots a decode chunk waits for while
episodes wait: 1 refills a slot at once) and `--device_refill` value (slots take queued episodes inside decode
chunks, as the actors' engine does, or the host admits them between chunks), interleaved with the static runs; a
line per run says its decode steps, chunks, admissions and the wall and CPU seconds and page faults in each kind
of device call. The continuous runner starts new episodes from the cache of the prompts' shared head
(`--prefix_cache`); the static runner prefills whole prompts (one call per batch). Reports:
docs/benchmarks/rollout.md.
"""

from __future__ import annotations

import collections
import os
import resource
import statistics
import time

from absl import app
from absl import flags
from flax import nnx
import numpy as np

from sao_jax import rollout
from sao_jax.benchmarks import common
from sao_jax.envs import base
from sao_jax.models.config import get_model_config
from sao_jax.generate.slots import SlotSampler
from sao_jax.models.llama import Decoder
from sao_jax.generate.sampling import SamplingParams
from sao_jax.rollout.continuous import run_continuous
from sao_jax.tokenizers import CharTokenizer, get_tokenizer

_MODEL = flags.DEFINE_string('model', 'tiny', 'Named model config (random weights) when --hf_dir is not given.')
_HF_DIR = flags.DEFINE_string('hf_dir', '', 'HF directory (e.g. SmolLM2-135M-Instruct from the GGUF) to load.')
_EPISODES = flags.DEFINE_integer('episodes', 128, 'Episodes per run.')
_SLOTS = flags.DEFINE_integer('slots', 16, 'Decode slots (continuous) = batch size (static).')
_WORKLOADS = flags.DEFINE_list('workloads', ['single', 'multi'], 'single and/or multi.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Timed runs of each runner (interleaved), after one warm-up.')
_MEDIAN_LEN = flags.DEFINE_integer('median_len', 64, 'Median generated tokens of an episode.')
_SIGMA = flags.DEFINE_float('sigma', 1.0, 'Log-normal sigma of the lengths and tool latencies.')
_MIN_LEN = flags.DEFINE_integer('min_len', 16, 'Shortest episode (tokens).')
_MAX_LEN = flags.DEFINE_integer('max_len', 512, 'Longest episode (tokens).')
_TURNS = flags.DEFINE_integer('turns', 3, 'Turns of a multi-turn episode.')
_TOOL_MS = flags.DEFINE_float('tool_ms', 80.0, 'Median tool latency (ms), clipped to [20, 500].')
_PREFIX_CACHE = flags.DEFINE_bool('prefix_cache', True, 'Continuous: new episodes start from the cache of the '
                                   "prompts' shared head (the chat template's system prompt).")
_DECODE_STEPS = flags.DEFINE_integer('decode_steps', 32, 'Decode steps per continuous chunk (at most).')
_REFILL_ROWS = flags.DEFINE_list('refill_rows', ['1', '4'], 'Continuous runs, one per value: while episodes wait, '
                                 'a decode chunk ends once this many slots are free (1: a slot is refilled at once).')
_REFILL = flags.DEFINE_list('device_refill', ['true'], 'Continuous runs, one per value (x --refill_rows): a slot '
                            "whose episode's last turn ends takes a queued episode inside the decode chunk (true, "
                            'the actors\' engine) or the host admits it between chunks (false).')
_QUEUE_CHUNK = flags.DEFINE_integer('queue_chunk', 32, 'With --device_refill: the longest prompt (past the shared '
                                    'prefix) a queued episode may have (the tiny workload\'s prompts: <= 31 tokens).')
_SEED = flags.DEFINE_integer('seed', 0, 'Workload and sampling seed.')


class LongTailEnv(base.BaseEnv):
  """An episode of forced turn lengths (`turn_token_budget`, `budget_ends_turn`) and tool latencies."""
  observation_mode = 'inline'

  def __init__(self, example: base.Example, lengths: list[int], latencies: list[float]):
    super().__init__(example, max_turns=len(lengths))
    self.lengths, self.latencies = lengths, latencies
    self.budget_ends_turn = True
    self.slept: list[float] = []

  def turn_token_budget(self, turn: int) -> int:
    return self.lengths[min(turn, len(self.lengths) - 1)]

  def _reset(self) -> None:
    self.slept = []

  def _step(self, action_text: str) -> base.StepResult:
    del action_text
    if self.turn >= self.max_turns:
      return base.StepResult(None, 1.0, True, {})
    latency = self.latencies[self.turn - 1]
    time.sleep(latency)
    self.slept.append(latency)
    return base.StepResult(' ok. ', 0.0, False, {})


def _workload(kind: str, n: int, rng: np.random.Generator):
  """Per episode: (forced turn lengths, tool latencies in seconds)."""
  turns = 1 if kind == 'single' else _TURNS.value
  median = _MEDIAN_LEN.value / turns
  lengths = np.clip(np.exp(rng.normal(np.log(median), _SIGMA.value, (n, turns))), _MIN_LEN.value // turns,
                    _MAX_LEN.value // turns).astype(int)
  latencies = np.clip(np.exp(rng.normal(np.log(_TOOL_MS.value / 1e3), _SIGMA.value, (n, turns))), 0.02, 0.5)
  return [(lengths[i].tolist(), latencies[i].tolist()) for i in range(n)]


def _envs(work, prompts):
  return [LongTailEnv(base.Example(uid=str(i), prompt=prompts[i % len(prompts)], answer=''), lengths, lat)
          for i, (lengths, lat) in enumerate(work)]


def _page_faults() -> int:
  """The process's page faults so far (minor: a fresh page's first touch; every thread's)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _load_average() -> str:
  return ' / '.join(f'{x:.1f}' for x in os.getloadavg())


def main(argv):
  del argv
  if _HF_DIR.value:
    from sao_jax.models import hf_io  # pylint: disable=g-import-not-at-top  (optional weights)
    model, cfg = hf_io.load_hf(_HF_DIR.value)
    tok = get_tokenizer('hf', hf_dir=_HF_DIR.value)
    name = os.path.basename(os.path.normpath(_HF_DIR.value))
  else:
    tok = CharTokenizer()
    cfg = get_model_config(_MODEL.value, vocab_size=max(tok.vocab_size, 64), eos_ids=tuple(tok.stop_ids))
    model = Decoder(cfg, rngs=nnx.Rngs(_SEED.value))
    name = f'{_MODEL.value} (random weights)'
  # A random model stops on its end-of-turn token now and then (~1/V per token), which would cut the forced
  # long tail: no stop tokens here, every turn ends at its forced length (`LongTailEnv.budget_ends_turn`).
  tok.stop_ids = ()
  prompts = ['What is 12+7?', 'Tell me a story about a cat.', 'Compute 3*45 step by step.', 'hello there']
  slots_n, n = _SLOTS.value, _EPISODES.value
  decoding = SamplingParams()  # Temperature 1, the actors' setting.
  max_prompt = max(len(tok.apply_chat_template([{'role': 'user', 'content': p}], add_generation_prompt=True)[0])
                   for p in prompts)
  max_seq_len = max_prompt + _MAX_LEN.value + 16 * _TURNS.value + 16
  limits = rollout.EpisodeLimits(max_turns=_TURNS.value, max_new_tokens=_MAX_LEN.value, max_seq_len=max_seq_len)
  stop_ids = tuple(tok.stop_ids)
  backend = rollout.SamplerBackend(model, stop_ids=stop_ids, pad_id=tok.pad_id, max_total_len=max_seq_len,
                                   min_rows=slots_n)
  as_bool = lambda x: {'true': True, 'false': False}[x.lower()]
  settings = [as_bool(x) for x in _REFILL.value]  # Device refill or not.
  slot_sampler = SlotSampler(backend.sampler, num_slots=slots_n, max_seq_len=max_seq_len, stop_ids=stop_ids,
                             pad_id=tok.pad_id, decode_steps=_DECODE_STEPS.value, prefix_cache=_PREFIX_CACHE.value,
                             device_refill=any(settings), queue_chunk=_QUEUE_CHUNK.value)

  def use(refill):
    slot_sampler.device_refill = refill

  t0 = time.perf_counter()
  for setting in settings:  # Decode programs that carry a queue compile programs of their own.
    use(setting)
    slot_sampler.warmup(decoding)
  print(f'# model {name}; {n} episodes, {slots_n} slots; continuous warm-up (compile) {time.perf_counter() - t0:.1f}s, '
        f'programs {slot_sampler.num_compiled()}; load average {_load_average()}')
  seeds = [rollout.episode_seed(_SEED.value, i, 0) for i in range(n)]

  def run_static(envs):
    out = []
    for i in range(0, len(envs), slots_n):
      out += rollout.run_episodes(backend, tok, envs[i:i + slots_n], limits=limits, decoding=decoding,
                                  seeds=seeds[i:i + slots_n])
    return out

  def run_cont(envs, refill, setting):
    use(setting)
    return run_continuous(slot_sampler, tok, envs, limits=limits, decoding=decoding, seeds=seeds[:len(envs)],
                          refill_rows=refill)

  refills = [int(x) for x in _REFILL_ROWS.value]
  if not refills or min(refills) < 1:
    raise ValueError(f'--refill_rows must list values >= 1, got {_REFILL_ROWS.value}.')
  run_name = lambda r, d: 'continuous' + ''.join(
      [f' refill {r}' if len(refills) > 1 else '',
       (' device refill' if d else ' host refill') if len(settings) > 1 else ''])
  runners = [('static', run_static)] + [(run_name(r, d), lambda envs, r=r, d=d: run_cont(envs, r, d))
                                        for r in refills for d in settings]

  # Where the continuous runner's time goes: device calls, decode steps run, wall and CPU seconds in each kind.
  calls = collections.defaultdict(float)

  def counted(kind, method):
    def call(*args, **kwargs):
      t0, c0, steps, f0 = time.perf_counter(), time.process_time(), slot_sampler.steps_run, _page_faults()
      out = method(*args, **kwargs)
      calls[f'{kind}_wall'] += time.perf_counter() - t0
      calls[f'{kind}_cpu'] += time.process_time() - c0
      calls[f'{kind}_faults'] += _page_faults() - f0
      calls[f'{kind}_calls'] += 1
      if kind == 'decode':
        calls['decode_steps'] += slot_sampler.steps_run - steps  # Steps the chunk ran.
        calls['queued'] += sum(r.queued is not None for r in out)  # Episodes started inside the chunk.
      return out
    return call

  slot_sampler._admit = counted('admit', slot_sampler._admit)  # pylint: disable=protected-access
  slot_sampler._decode = counted('decode', slot_sampler._decode)  # pylint: disable=protected-access
  run_admit = slot_sampler._run_admit  # pylint: disable=protected-access

  def admit_call(*args):  # A device call of an admission round.
    calls['admit_programs'] += 1
    return run_admit(*args)

  slot_sampler._run_admit = admit_call  # pylint: disable=protected-access

  rng = np.random.default_rng(_SEED.value)
  print('| workload | runner | episodes/s | generated tok/s | wall s | speed-up | CPU s | CPU speed-up | load | mem GB/s |')
  print('|---|---|---|---|---|---|---|---|---|---|')
  for kind in _WORKLOADS.value:
    work = _workload(kind, n, rng)
    runs = {label: [] for label, _ in runners}
    tokens = 0
    for r in range(_REPEATS.value + 1):
      for label, fn in runners:
        envs = _envs(work, prompts)
        calls.clear()
        bandwidth = common.memory_bandwidth() if r else 0.0  # The conditions of the run (`common`).
        t0, c0 = time.perf_counter(), time.process_time()
        trajs = fn(envs)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(t.num_action_tokens for t in trajs)
        if r == 0:
          continue  # Warm-up (compiles the static sampler's programs).
        runs[label].append((wall, tokens, cpu, bandwidth))
        if label != 'static':
          print(f'# {kind} {label} run {r}: {calls["decode_steps"]:.0f} decode steps in {calls["decode_calls"]:.0f} '
                f'chunks ({calls["queued"]:.0f} episodes started in them), {calls["admit_calls"]:.0f} admission '
                f'rounds in {calls["admit_programs"]:.0f} device calls; wall s: decode {calls["decode_wall"]:.2f}, '
                f'admit {calls["admit_wall"]:.2f}, rest {wall - calls["decode_wall"] - calls["admit_wall"]:.2f}; CPU s: '
                f'decode {calls["decode_cpu"]:.2f}, admit {calls["admit_cpu"]:.2f}, rest '
                f'{cpu - calls["decode_cpu"] - calls["admit_cpu"]:.2f}; page faults: decode '
                f'{calls["decode_faults"]:.0f}, admit {calls["admit_faults"]:.0f}')
    if kind == 'single':
      lengths = [w[0][0] for w in work]
      static_steps = sum(max(lengths[i:i + slots_n]) for i in range(0, n, slots_n))
      print(f'# single: static decode steps (sum over batches of the longest row) {static_steps}; tokens / slots '
            f'{sum(lengths) / slots_n:.0f}')
    load = _load_average()
    base_wall = statistics.median(v[0] for v in runs['static'])
    base_cpu = statistics.median(v[2] for v in runs['static'])
    for label, vals in runs.items():
      wall = statistics.median(v[0] for v in vals)
      toks = statistics.median(v[1] for v in vals)
      cpu = statistics.median(v[2] for v in vals)
      bandwidth = statistics.median(v[3] for v in vals)
      print(f'| {kind} | {label} | {n / wall:.2f} | {toks / wall:.0f} | {wall:.2f} | {base_wall / wall:.2f}x '
            f'| {cpu:.2f} | {base_cpu / cpu:.2f}x | {load} | {bandwidth:.0f} |')
  print(f'# continuous programs after the runs: {slot_sampler.num_compiled()} (no recompiles when unchanged); '
        f'static sampler programs: {backend.sampler.num_compiled()}; shared prompt prefix: '
        f'{len(slot_sampler.prefix)} tokens (--prefix_cache={_PREFIX_CACHE.value})')


if __name__ == '__main__':
  app.run(main)
