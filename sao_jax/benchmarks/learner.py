r"""Learner throughput: one SAO step vs one GRPO step at the same token count, and the critic/policy split.

  python -m sao_jax.benchmarks.learner [--model=bench-25m --batch=8 --seq=256 --steps=3 --microbatch=2
                                        --programs=sao,critic,grpo] [--lora_rank=16]

All three programs are the real `sao_jax.learner.Learner` update (jitted, sharded, state donated):

  SAO step          critic forward -> returns (lambda=1) -> K=2 critic updates -> critic forward ->
                    adaptive-lambda advantages -> one policy update (frozen critic attention);
  SAO critic part   the same program inside its critic-only warmup (the policy update is skipped by
                    `lax.cond`), so policy part = SAO step - critic part;
  GRPO step         group advantages (G = --group) -> one policy update, no critic.

`--microbatch=m` sets `config.trainer.microbatch_size` (gradient accumulation over microbatches of m rows,
one optimizer update; the critic forwards run per microbatch too; 0 = the whole batch at once).

`--lengths=lognormal` times each program on a long-tailed length mix instead (reasoning replies: log-normal
lengths of median `--median_len` and shape `--sigma`, clipped to `--min_len`..`--seq`), the same trajectories in
two layouts (`rollout.pack`): bucketed (`trainer.pack='none'`: one per row, padded to the smallest of `--buckets`
that holds the longest) and packed (`'ffd'`: up to `--pack_segments` per row, first-fit decreasing); it prints
each layout's padding fraction and trained (non-pad) tokens/s, and packed / bucketed.

`--lora_rank=r` times each program with full fine-tuning and with rank-r LoRA adapters in turn (the policy's on
every projection, the critic's on its MLP; one shared frozen base): step times and the compiled update's memory
(its arguments: parameters, base, optimizer states, batch; its temporaries: gradients, activations).

tokens/s = batch * seq / median step time (compile excluded, reported separately). Model FLOPs use the
PaLM convention of `ModelConfig.flops_per_token` (forward + backward = 3 forwards; the critic has no
lm-head matmul; frozen attention is not discounted), and MFU divides by the float32 `jnp.dot` peak
measured in the same run (the best of before and after the programs). On a shared machine the load
changes both; compare runs made back to back.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from sao_jax import config_lib
from sao_jax import parallel
from sao_jax.benchmarks.common import matmul_peak
from sao_jax.learner import Learner, LearnerConfig
from sao_jax.models import Decoder, get_model_config
from sao_jax.models import lora as lora_lib
from sao_jax import rollout
from sao_jax.structs import Batch, Trajectory

_MODEL = flags.DEFINE_string('model', 'bench-25m', 'Named model config.')
_BATCH = flags.DEFINE_integer('batch', 8, 'Trajectories per learner step.')
_SEQ = flags.DEFINE_integer('seq', 256, 'Tokens per trajectory (padded length).')
_PROMPT = flags.DEFINE_integer('prompt', 64, 'Prompt tokens per trajectory (the rest are actions).')
_GROUP = flags.DEFINE_integer('group', 4, 'GRPO group size.')
_STEPS = flags.DEFINE_integer('steps', 2, 'Timed steps per program (after one compile + warm-up step).')
_DEVICES = flags.DEFINE_integer('devices', 1, 'Devices of the learner mesh (fsdp axis).')
_PEAK = flags.DEFINE_bool('peak', True, 'Measure the float32 matmul peak for MFU.')
_MICRO = flags.DEFINE_integer('microbatch', 0, 'config.trainer.microbatch_size: rows per gradient-accumulation '
                              'microbatch (0 = the whole batch at once).')
_PROGRAMS = flags.DEFINE_list('programs', ['sao', 'critic', 'grpo'],
                              'Programs to time: sao (SAO step), critic (its critic part), grpo (GRPO step).')
_LENGTHS = flags.DEFINE_enum('lengths', 'fixed', ['fixed', 'lognormal'],
                             'fixed: every row --seq tokens; lognormal: a long-tailed mix, bucketed vs packed.')
_MEDIAN = flags.DEFINE_integer('median_len', 384, 'lognormal: median trajectory length.')
_SIGMA = flags.DEFINE_float('sigma', 1.0, 'lognormal: shape (std of log length).')
_MIN_LEN = flags.DEFINE_integer('min_len', 64, 'lognormal: shortest trajectory (the longest is --seq).')
_BUCKETS = flags.DEFINE_list('buckets', [], 'lognormal: row lengths (default: 512, 768, 1024, 1536, ... up to --seq).')
_SEGMENTS = flags.DEFINE_integer('pack_segments', 16, 'lognormal: trajectories per packed row at most.')
_LORA = flags.DEFINE_integer('lora_rank', 0, 'Also run each program with LoRA adapters of this rank (every projection '
                             'of the policy, the MLP of the critic: config.model.lora) beside full fine-tuning: step '
                             'times and the update\'s compiled memory, LoRA / full.')


def synthetic_batch(rows: int, seq: int, prompt: int, vocab: int, group: int, seed: int = 0) -> Batch:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, (rows, seq)).astype(np.int32)
  action = np.zeros((rows, seq), np.float32)
  action[:, prompt:] = 1
  rewards = np.zeros((rows, seq), np.float32)
  rewards[:, -1] = rng.integers(0, 2, rows)
  blp = (-np.log(vocab) * action).astype(np.float32)
  return Batch.from_rows(tokens=tokens, action_mask=action, behavior_logprobs=blp, rewards=rewards,
                         lengths=np.full(rows, seq), group_ids=(np.arange(rows) // group).astype(np.int32))


def lognormal_trajectories(n: int, *, median: int, sigma: float, min_len: int, max_len: int, prompt: int,
                           vocab: int, group: int, seed: int = 0) -> list[Trajectory]:
  """`n` single-turn trajectories of log-normal lengths clipped to `min_len..max_len` (prompt: the first
  `min(prompt, length // 2)` tokens), a 0/1 reward each; consecutive runs of `group` share a group id."""
  rng = np.random.default_rng(seed)
  lengths = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(n))), min_len, max_len).astype(int)
  out = []
  for i, length in enumerate(lengths):
    mask = np.arange(length) >= min(prompt, length // 2)
    out.append(Trajectory(tokens=rng.integers(3, vocab, length), action_mask=mask,
                          behavior_logprobs=np.where(mask, -np.log(vocab), 0.0), reward=float(rng.integers(0, 2)),
                          group_id=i // group))
  return out


def _config(algo: str, rows: int, group: int, devices: int):
  c = config_lib.defaults()
  c.algo.name = algo
  c.trainer.batch_size = rows
  c.trainer.microbatch_size = _MICRO.value
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, devices, 1
  if algo == 'sao':
    c.algo.critic_epochs = 2
    c.algo.critic_warmup_steps = 0
  else:
    c.algo.group_size = group
    c.algo.clip_mode = 'ppo'
    c.algo.eps_low = c.algo.eps_high = 0.2
  return c


def update_memory(learner: Learner, rows: int, seq: int) -> dict[str, int]:
  """Bytes of the compiled update (per device): `state` = its arguments (parameters, a LoRA base, optimizer states;
  and the batch), `temp` = its temporaries (gradients, activations), `total` = the two (outputs alias the donated
  state)."""
  mem = learner.lower_update(rows, seq).compile().memory_analysis()
  state, temp = int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes)
  return {'state': state, 'temp': temp, 'total': state + temp}


def time_program(config, policy, batch, steps: int, devices, memory: dict | None = None
                 ) -> tuple[float, float, dict]:
  """(compile + first step seconds, median step seconds, last metrics) of one learner program; `memory`: filled
  with `update_memory`'s figures."""
  learner = Learner(LearnerConfig.from_config(config), policy=policy,
                    mesh=parallel.make_mesh(config.mesh, devices=devices))
  if memory is not None:
    memory.update(update_memory(learner, *batch.tokens.shape))
  t0 = time.perf_counter()
  learner.update(batch)
  first = time.perf_counter() - t0
  times, metrics = [], {}
  for _ in range(steps):
    metrics = learner.update(batch)
    times.append(metrics['perf/step_time_s'])
  del learner
  med = statistics.median(times)
  print(f'  {config.algo.name}: compile+first {first:.1f} s, median step {med:.3f} s', flush=True)
  return first, med, metrics


def main(argv):
  del argv
  cfg = get_model_config(_MODEL.value)
  rows, seq = _BATCH.value, _SEQ.value
  tokens = rows * seq
  devices = jax.devices()[:_DEVICES.value]
  policy = lambda: Decoder(cfg, rngs=nnx.Rngs(0))  # Each learner creates it directly sharded, under jit.
  names = {
      'sao': 'SAO step (critic fwd, K=2 critic updates, critic fwd, 1 policy update)',
      'critic': 'SAO critic part (same program, policy update skipped)',
      'grpo': f'GRPO step (G={_GROUP.value}, 1 policy update)',
  }
  unknown = set(_PROGRAMS.value) - set(names)
  if unknown:
    raise app.UsageError(f'--programs: unknown {sorted(unknown)}; choose from {list(names)}.')
  if _MICRO.value and rows % _MICRO.value:
    raise app.UsageError(f'--microbatch={_MICRO.value} must divide --batch={rows}.')
  platform = f'{len(devices)} {devices[0].platform} device(s); jax {jax.__version__}'
  if _LENGTHS.value == 'lognormal':
    print(f'model {cfg.name}: {cfg.num_params() / 1e6:.1f}M params; {platform}')
    return _long_tail(cfg, policy, names, devices)
  if _LORA.value:
    return _lora(cfg, names, devices)
  print(f'model {cfg.name}: {cfg.num_params() / 1e6:.1f}M params; batch {rows} x {seq} = {tokens} tokens '
        f'({seq - _PROMPT.value} action tokens per row); {platform}')
  print(f'microbatch: {_MICRO.value or rows} rows ({rows // (_MICRO.value or rows)} per optimizer update)')
  batch = synthetic_batch(rows, seq, _PROMPT.value, cfg.vocab_size, _GROUP.value)
  peak0 = matmul_peak()[0] if _PEAK.value else None
  runs = {}
  for prog in _PROGRAMS.value:
    config = _config('grpo' if prog == 'grpo' else 'sao', rows, _GROUP.value, len(devices))
    if prog == 'critic':
      config.algo.critic_warmup_steps = 10 ** 9
    runs[prog] = time_program(config, policy, batch, _STEPS.value, devices)

  fpt = cfg.flops_per_token(seq)
  fpt_critic = fpt - 6.0 * cfg.vocab_size * cfg.embed_dim  # No lm-head matmul in the critic.
  flops = {  # Model FLOPs of each program per token: update = 3 forwards, forward = 1/3 of an update.
      'sao': fpt_critic * (2 + 2 / 3) + fpt,
      'critic': fpt_critic * (2 + 2 / 3),
      'grpo': fpt,
  }
  peak = max(peak0, matmul_peak()[0]) if _PEAK.value else None  # The best of before and after the programs.
  print(f'\n{"program":<74} {"compile+1st s":>13} {"step s":>8} {"tokens/s":>9} {"GFLOP/s":>8} {"MFU":>6}')
  medians = {}
  for prog, (first, med, _) in runs.items():
    gflops = tokens * flops[prog] / med / 1e9
    mfu = f'{100 * gflops * 1e9 / peak:5.1f}%' if peak else '   n/a'
    print(f'{names[prog]:<74} {first:13.1f} {med:8.3f} {tokens / med:9.0f} {gflops:8.1f} {mfu:>6}')
    medians[prog] = med
  if {'sao', 'critic'} <= set(medians):
    sao_s, critic_s = medians['sao'], medians['critic']
    policy_s = max(sao_s - critic_s, 0.0)
    print(f'\nSAO step split: critic {critic_s:.3f} s ({100 * critic_s / sao_s:.0f}%), '
          f'policy {policy_s:.3f} s ({100 * policy_s / sao_s:.0f}%)')
  if {'sao', 'grpo'} <= set(medians):
    print(f'SAO step / GRPO step time at equal tokens: {medians["sao"] / medians["grpo"]:.2f}x '
          f'(model-FLOP ratio {flops["sao"] / flops["grpo"]:.2f}x)')
  if peak:
    print(f'float32 matmul peak in this run: {peak / 1e9:.0f} GFLOP/s')
  if 'sao' in runs:
    m = runs['sao'][2]
    print(f'SAO critic grad norm {m["critic/grad_norm"]:.3g} (frozen attention), '
          f'policy grad norm {m["policy/grad_norm"]:.3g}')


def _lora(cfg, names, devices) -> None:
  """`--lora_rank=r`: each program with full fine-tuning and with rank-r adapters, in turn, on the same batch."""
  rows, seq, rank = _BATCH.value, _SEQ.value, _LORA.value
  lora_cfg = cfg.replace(lora_rank=rank, lora_targets=lora_lib.TARGETS)
  adapters = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      nnx.state(nnx.eval_shape(lambda: Decoder(lora_cfg, rngs=nnx.Rngs(0))), lora_lib.ADAPTERS)))
  print(f'model {cfg.name}: {cfg.num_params() / 1e6:.1f}M params, rank-{rank} adapters on every projection '
        f'{adapters / 1e6:.2f}M ({100 * adapters / cfg.num_params():.2f}%); batch {rows} x {seq}; '
        f'{len(devices)} {devices[0].platform} device(s); jax {jax.__version__}')
  batch = synthetic_batch(rows, seq, _PROMPT.value, cfg.vocab_size, _GROUP.value)
  rows_out = []
  for prog in _PROGRAMS.value:
    out = {}
    for kind, model_cfg in (('full', cfg), ('lora', lora_cfg)):
      config = _config('grpo' if prog == 'grpo' else 'sao', rows, _GROUP.value, len(devices))
      config.model.lora.rank = rank if kind == 'lora' else 0
      if prog == 'critic':
        config.algo.critic_warmup_steps = 10 ** 9
      memory = {}
      print(f'{prog} {kind}:', flush=True)
      _, med, _ = time_program(config, lambda c=model_cfg: Decoder(c, rngs=nnx.Rngs(0)), batch, _STEPS.value,
                               devices, memory)
      out[kind] = (med, memory)
    rows_out.append((prog, out))
  mib = lambda b: b / 2 ** 20
  print(f'\n{"program":<74} {"step s full":>11} {"LoRA":>7} {"speed-up":>8}   '
        f'{"update MiB full (state + temp)":>30} {"LoRA":>20} {"LoRA/full":>9}')
  for prog, out in rows_out:
    (full_s, full_m), (lora_s, lora_m) = out['full'], out['lora']
    print(f'{names[prog]:<74} {full_s:11.3f} {lora_s:7.3f} {full_s / lora_s:7.2f}x   '
          f'{mib(full_m["total"]):10.1f} ({mib(full_m["state"]):.1f} + {mib(full_m["temp"]):.1f}) '
          f'{mib(lora_m["total"]):9.1f} ({mib(lora_m["state"]):.1f} + {mib(lora_m["temp"]):.1f}) '
          f'{100 * lora_m["total"] / full_m["total"]:8.1f}%')


def _long_tail(cfg, policy, names, devices) -> None:
  """`--lengths=lognormal`: each program on the same trajectories, bucketed and packed (module docstring)."""
  rows, seq = _BATCH.value, _SEQ.value
  steps = sorted({m << k for k in range(8, 20) for m in (2, 3)})  # 512, 768, 1024, 1536, ...
  buckets = tuple(int(b) for b in _BUCKETS.value) or tuple(b for b in steps if 512 <= b < seq) + (seq,)
  trajs = lognormal_trajectories(rows, median=_MEDIAN.value, sigma=_SIGMA.value, min_len=_MIN_LEN.value,
                                 max_len=seq, prompt=_PROMPT.value, vocab=cfg.vocab_size, group=_GROUP.value)
  lengths = np.array([len(t.tokens) for t in trajs])
  trained = int(lengths.sum())
  print(f'lognormal lengths (median {_MEDIAN.value}, sigma {_SIGMA.value}, {_MIN_LEN.value}..{seq}): '
        f'{rows} trajectories, {trained} tokens, percentiles 10/50/90/max '
        f'{"/".join(str(int(np.percentile(lengths, q))) for q in (10, 50, 90, 100))}; buckets {buckets}')
  layouts = {'bucketed': dict(packing='none', rows=rows),
             'packed': dict(packing='ffd', segments=_SEGMENTS.value)}
  results = {}
  for prog in _PROGRAMS.value:
    for layout, kw in layouts.items():
      group = _GROUP.value if prog == 'grpo' else 1
      batch = rollout.pack(trajs, seq_buckets=buckets, pad_id=0, group_size=group,
                           row_multiple=rows // (_MICRO.value or rows), **kw).batch
      config = _config('grpo' if prog == 'grpo' else 'sao', rows, _GROUP.value, len(devices))
      if prog == 'critic':
        config.algo.critic_warmup_steps = 10 ** 9
      print(f'{prog} {layout}: batch {batch.shape[0]} x {batch.shape[1]} ({batch.num_segments} per row)', flush=True)
      first, med, _ = time_program(config, policy, batch, _STEPS.value, devices)
      results[(prog, layout)] = (batch, first, med)
  print(f'\n{"program":<60} {"layout":<9} {"rows x T":>11} {"padding":>8} {"compile+1st s":>13} {"step s":>8} '
        f'{"trained tok/s":>13}')
  for (prog, layout), (batch, first, med) in results.items():
    print(f'{names[prog]:<60} {layout:<9} {f"{batch.shape[0]} x {batch.shape[1]}":>11} '
          f'{100 * rollout.padding_fraction(batch):7.1f}% {first:13.1f} {med:8.3f} {trained / med:13.0f}')
  for prog in _PROGRAMS.value:
    speedup = results[(prog, 'bucketed')][2] / results[(prog, 'packed')][2]
    print(f'{prog}: packed / bucketed trained tokens/s = {speedup:.2f}x')


if __name__ == '__main__':
  app.run(main)
