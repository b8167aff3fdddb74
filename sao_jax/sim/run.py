"""One simulation: `python -m sao_jax.sim.run [--preset=pod | --plan=plan.json [--workload=imo|agentic]]
[--set=field=value ...] [--json=out.json]`.

`--plan` takes the hardware figures from a compiled plan (`python -m sao_jax.tools.aot --json=plan.json`;
mapping and assumptions: `sao_jax.sim.plan`) instead of the preset.

Prints the summary (utilisations, trajectories/hour, staleness percentiles and histogram, drops, queue and
group waits), the end-of-run ledger and the wall and CPU seconds the simulation took. `--set` values are
JSON (`--set=group_size=8 --set=max_staleness=inf --set='gen_tokens={"kind":"pareto","mean":3000,"alpha":1.5}'`).

The simulator's speed (sao_jax/sim/README.md): `python -m sao_jax.sim.run --preset=pod` (a simulated day of 1024
slots).
"""

from __future__ import annotations

import json
import time

from absl import app
from absl import flags

from sao_jax.errors import ConfigError
from sao_jax.sim import plan as plan_lib
from sao_jax.sim import pod
from sao_jax.sim import simulator
from sao_jax.sim.simulator import SimConfig

_PRESET = flags.DEFINE_enum('preset', 'pod', ['pod', 'default'], 'Base config: the pod workload or SimConfig().')
_PLAN = flags.DEFINE_string('plan', None, 'A plan JSON of `python -m sao_jax.tools.aot`: the base config is '
                            '--workload on its hardware (replaces --preset).')
_WORKLOAD = flags.DEFINE_enum('workload', 'imo', list(plan_lib.WORKLOADS), 'With --plan: the episodes.')
_PLAN_UPDATE = flags.DEFINE_string('plan_update', None, "With --plan: the learner step is the roofline of the plan's "
                                   "program 'update (NAME)' (e.g. grpo) instead of the run's learner_step_s.")
_SET = flags.DEFINE_multi_string('set', [], 'field=value overrides of the config (value is JSON or inf).')
_JSON = flags.DEFINE_string('json', None, 'Also write the config, summary and counts here.')


def parse_overrides(items: list[str]) -> dict:
  """['field=value', ...] -> {field: value} with JSON values ('inf' and bare words kept as strings)."""
  out = {}
  for item in items:
    if '=' not in item:
      raise ConfigError(f'--set={item!r}: expected field=value')
    k, v = item.split('=', 1)
    try:
      out[k] = json.loads(v)
    except json.JSONDecodeError:
      out[k] = v
  return out


def config_from_flags(preset: str, items: list[str], plan: str | None = None, workload: str = 'imo',
                      plan_update: str | None = None) -> SimConfig:
  """The preset's config (or, with `plan` a plan JSON's path, `workload` on its hardware) with `items` applied."""
  if plan:
    with open(plan) as f:
      plan_json = json.load(f)
    base = plan_lib.config_from_plan(plan_json, workload, update=plan_update)
    if unfit := plan_lib.unfit_programs(plan_json):
      print(f'{plan}: these programs do not fit their chips: {unfit} (the figures are those of a run that cannot '
            'start as planned)')
  else:
    base = pod.POD if preset == 'pod' else SimConfig()
  return SimConfig.from_dict({**base.to_dict(), **parse_overrides(items)}).validate()


def main(argv):
  del argv
  cfg = config_from_flags(_PRESET.value, _SET.value, _PLAN.value, _WORKLOAD.value, _PLAN_UPDATE.value)
  if _PLAN.value:
    print(f'{_PLAN.value}, {_WORKLOAD.value}: {cfg.num_slots} slots at {cfg.tokens_per_s:.4g} tokens/s, '
          f'{cfg.step_time_per_token_s * 1e6:.4g} us per learner token, publish {cfg.publish_delay_s:.4g} s')
  wall, cpu = time.perf_counter(), time.process_time()
  r = simulator.simulate(cfg)
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  summary = r.summary()
  print(f'{cfg.mode} G={cfg.group_size} N={cfg.num_slots} B={cfg.batch_size} max_staleness={cfg.max_staleness}')
  for k, v in summary.items():
    print(f'  {k:24s} {v:.6g}' if isinstance(v, float) else f'  {k:24s} {v}')
  print(f'  staleness histogram      {r.staleness_histogram()}')
  print(f'  end-of-run ledger        {r.counts}')
  print(f'simulated {cfg.duration_s / 3600:.1f} h of {cfg.num_slots} slots ({r.counts["started"]} episodes, '
        f'{r.counts["trained_total"] // cfg.batch_size} steps) in {wall:.2f} s wall, {cpu:.2f} s CPU')
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      json.dump({'config': cfg.to_dict(), 'summary': summary, 'counts': r.counts, 'wall_s': wall, 'cpu_s': cpu}, f,
                indent=1)


if __name__ == '__main__':
  app.run(main)
