"""The simulator fed by the compiler: a `python -m sao_jax.tools.aot --json=plan.json` plan -> a SimConfig.

The plan's `run` dict holds roofline figures of the compiled programs of one run on one TPU topology
(`sao_jax.tools.aot_programs.plan_programs`). Mapping (`config_from_plan`), with R x T the plan's `batch`:

  tokens_per_s           1 / run.decode_step_s: a decode step advances each of its `decode_rows` slots by one token.
  num_slots              run.decode_rows x threads x actor processes, where
                           processes = num_devices / run.actor_devices_per_process when run.actors_share_learner
                             (each process's actor decodes on its host's chips, which also hold the learner), else
                             (num_devices - run.learner_devices) / run.actor_devices_per_process;
                           threads = run.rollout_tokens_per_s_per_actor_chip x decode_step_s x
                             actor_devices_per_process / decode_rows (the plan's `sampler.num_threads`; must be a
                             positive whole number). The simulated pod then decodes rollout_tokens_per_s_per_actor_chip
                             x the actor chips tokens/s at full occupancy, the plan's own figure.
  step_time_per_token_s  run.learner_step_s / (R x T), step_time_s constant 0: the plan's step already holds the
                         fixed part (optimizer, all passes); the simulator charges a step by the batch's tokens
                         (prompt + generated), i.e. rows packed up to the compiled length T (configs' seq_buckets
                         are packed lengths). `update=NAME` takes the step from the program `update (NAME)` of the
                         plan instead (the plan compiles GRPO's update beside SAO's).
  batch_size             R (trajectories per learner step).
  publish_delay_s        run.publish_s.

Assumptions, each a bound or a guess, not a measurement:
  - every time is a roofline of the compiler's counts (max of FLOPs / peak and bytes / HBM bandwidth): a lower
    bound of the real time (no launch, host, collective-latency or scheduling overhead), so the simulated pod is
    faster than a real one;
  - the plan's decode step is costed at the whole cache window (every slot at the run's max_seq_len): an upper
    bound per step against the roofline, so a per-slot speed lower than the roofline's at shorter contexts; the
    two errors point opposite ways, their sum is not known;
  - actors that share the learner's chips (async, `actors_share_learner`) run at full speed while the learner
    updates and vice versa: the simulator does not model the two programs' contention for the same chips;
  - threads of one process each decode at the full step rate (as the plan's rollout figure counts them).

Workloads (episode shapes, stated assumptions):
  imo      single-turn olympiad reasoning as configs/imo.py runs it: prompt 300 tokens; generated tokens
           ~ log-normal(mean 2500, sigma 0.8) times a per-prompt difficulty factor ~ log-normal(mean 1, sigma 0.5)
           shared by a GRPO group, cut at the config's max_new_tokens 4096 (context cap 300 + 4096: the sampler
           stops there, before its max_seq_len 5120 binds; ~15% of episodes reach it); no tools, no observations.
  agentic  the episodes of `pod.POD` (multi-turn tool use, 128K contexts, 3000 prefill tokens/s per slot) on the
           plan's hardware. A plan compiled for a shorter window (configs/imo.py: 5120) prices each decode step at
           that window, far below a 128K context's: this overstates the decode speed.
Both: async SAO (G = 1), queue 2B, turn-level switching, a simulated day with the first 2 hours left out.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from sao_jax.errors import ConfigError
from sao_jax.sim import pod
from sao_jax.sim.dists import Dist
from sao_jax.sim.simulator import SimConfig

WORKLOADS = ('imo', 'agentic')

IMO_MAX_NEW_TOKENS = 4096  # configs/imo.py: sampler.max_new_tokens.

_IMO_EPISODES = dict(
    turns=Dist('constant', 1.0), prompt_tokens=300.0,
    gen_tokens=Dist('lognormal', 2500.0, sigma=0.8), prompt_sigma=0.5,
    obs_tokens=Dist('constant', 0.0), tool_latency_s=Dist('constant', 0.0), prefill_tokens_per_s=math.inf,
    max_episode_tokens=300.0 + IMO_MAX_NEW_TOKENS)
_AGENTIC_EPISODES = {k: getattr(pod.POD, k) for k in (
    'turns', 'prompt_tokens', 'gen_tokens', 'prompt_sigma', 'obs_tokens', 'tool_latency_s', 'prefill_tokens_per_s',
    'max_episode_tokens')}


def _get(d: Any, where: str, name: str, kind: type, positive: bool = True) -> Any:
  """d[name] checked: present, of `kind`, finite and (> 0 if `positive`, else >= 0) for numbers."""
  if not isinstance(d, dict) or name not in d:
    raise ConfigError(f'plan.{where}{name}: missing (a plan written by `python -m sao_jax.tools.aot --json=...`)')
  v = d[name]
  if kind is bool:
    if not isinstance(v, bool):
      raise ConfigError(f'plan.{where}{name}={v!r}: must be true or false')
    return v
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not (
      v > 0 if positive else v >= 0):
    raise ConfigError(f'plan.{where}{name}={v!r}: must be a finite number {">" if positive else ">="} 0 (NaN: the '
                      'program was not costed, e.g. refused by the compiler)')
  return kind(v)


def _whole(x: float, field: str, why: str) -> int:
  n = round(x)
  if n < 1 or abs(x - n) > 1e-6 * max(1.0, x):
    raise ConfigError(f'plan.{field}: {why} = {x:.6g} is not a positive whole number')
  return n


def plan_figures(plan: dict[str, Any], update: str | None = None) -> dict[str, Any]:
  """The SimConfig fields `plan` gives (the module docstring's mapping); ConfigError names a missing or bad field."""
  run = plan.get('run') if isinstance(plan, dict) else None
  num_devices = _get(plan, '', 'num_devices', int)
  if not isinstance(run, dict):
    raise ConfigError('plan.run: missing (a plan written by `python -m sao_jax.tools.aot --json=...`)')
  decode_step_s = _get(run, 'run.', 'decode_step_s', float)
  rows = _get(run, 'run.', 'decode_rows', int)
  per_process = _get(run, 'run.', 'actor_devices_per_process', int)
  rate = _get(run, 'run.', 'rollout_tokens_per_s_per_actor_chip', float)
  learner_devices = _get(run, 'run.', 'learner_devices', int)
  shared = _get(run, 'run.', 'actors_share_learner', bool)
  batch = run.get('batch')
  m = re.fullmatch(r'\s*(\d+)\s*x\s*(\d+)\s*tokens\s*', batch) if isinstance(batch, str) else None
  if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
    raise ConfigError(f'plan.run.batch={batch!r}: {"missing" if batch is None else "expected"} "ROWS x T tokens"')
  batch_rows, seq_len = int(m.group(1)), int(m.group(2))
  if update is None:
    step_s = _get(run, 'run.', 'learner_step_s', float)
  else:
    name = f'update ({update})'
    progs = [p for p in plan.get('programs') or () if isinstance(p, dict) and p.get('name') == name]
    if not progs:
      raise ConfigError(f'plan.programs[{name!r}]: missing (the plan has '
                        f'{[p.get("name") for p in plan.get("programs") or () if isinstance(p, dict)]})')
    step_s = _get(progs[0], f'programs[{name!r}].', 'roofline_s', float)
  publish_s = _get(run, 'run.', 'publish_s', float, positive=False)
  actor_chips = num_devices if shared else num_devices - learner_devices
  processes = _whole(actor_chips / per_process, 'run.actor_devices_per_process',
                     f'actor chips ({actor_chips}) / actor_devices_per_process ({per_process})')
  threads = _whole(rate * decode_step_s * per_process / rows, 'run.rollout_tokens_per_s_per_actor_chip',
                   'threads = rollout_tokens_per_s_per_actor_chip x decode_step_s x actor_devices_per_process / '
                   'decode_rows')
  return dict(tokens_per_s=1.0 / decode_step_s, num_slots=rows * threads * processes, batch_size=batch_rows,
              step_time_s=Dist('constant', 0.0), step_time_per_token_s=step_s / (batch_rows * seq_len),
              publish_delay_s=publish_s)


def config_from_plan(plan: dict[str, Any], workload: str = 'imo', update: str | None = None,
                     **overrides: Any) -> SimConfig:
  """The SimConfig of `workload` (WORKLOADS) on the hardware of `plan` (a parsed plan JSON), fields replaced by
  `overrides` (e.g. group_size=8, max_staleness=8), validated. ConfigError names a missing or bad plan field."""
  if workload not in WORKLOADS:
    raise ConfigError(f'workload={workload!r}: must be one of {WORKLOADS}')
  episodes = _IMO_EPISODES if workload == 'imo' else _AGENTIC_EPISODES
  base = SimConfig(group_size=1, mode='async', turn_level_switch=True, duration_s=86400.0, warmup_s=7200.0, seed=0,
                   **episodes, **plan_figures(plan, update))
  return dataclasses.replace(base, **overrides).validate()


def unfit_programs(plan: dict[str, Any]) -> list[str]:
  """Names of the plan's programs that do not fit their chips' HBM (`fits` false): a run that cannot start."""
  return [str(p.get('name')) for p in plan.get('programs') or () if isinstance(p, dict) and p.get('fits') is False]
