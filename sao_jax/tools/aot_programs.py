"""The programs of a run, built from abstract states on a topology's devices (`sao_jax.tools.aot`'s plan).

Each program is the run's own jitted function (the learner's update, `generate.weights`' publish, `generate`'s
slot and static programs) lowered with `jax.ShapeDtypeStruct`s carrying the run's shardings. Residency (what a
program's chips hold outside its arguments while it runs): the learner state on the learner's chips; on the
actors' chips (the same chips when `config.mesh.actor_devices` is 0) the published decode-layout weights (one
version during an update, two otherwise: `VERSIONS_IN_UPDATE`, `VERSIONS_ELSE`; every actor thread of a process
shares them) and each actor's KV cache. A chip runs one program at a time, so no other program's temporaries.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax import parallel
from sao_jax.errors import ConfigError
from sao_jax.generate import programs as slot_programs
from sao_jax.generate import sampling
from sao_jax.generate import slots as slots_lib
from sao_jax.generate import static as static_lib
from sao_jax.generate import weights as weights_lib
from sao_jax.generate.config import GenerateConfig
from sao_jax.learner import algo as algo_lib
from sao_jax.models import loops
from sao_jax.learner import state as state_lib
from sao_jax.learner.learner import Learner, LearnerConfig
from sao_jax.models.build import model_config_of
from sao_jax.models import decode as decode_lib
from sao_jax.models.config import ModelConfig
from sao_jax.models.llama import Decoder
from sao_jax.tools import aot_plan as aot


def learner_mesh(mesh_config: Any, devices: list[Any]) -> Mesh:
  """The learner's mesh over `devices`, in the TPU's physical order where `mesh_utils` knows it."""
  shape = parallel.mesh_shape(mesh_config, len(devices))
  if devices[0].platform == 'tpu':
    from jax.experimental import mesh_utils  # pylint: disable=g-import-not-at-top
    try:
      grid = mesh_utils.create_device_mesh(shape, devices=devices)
      return Mesh(grid, parallel.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)
    except (ValueError, NotImplementedError, AssertionError):
      pass
  return parallel.make_mesh(mesh_config, devices)


def _replicated(mesh: Mesh, shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def _learner(config: Any, cfg: ModelConfig, mesh: Mesh) -> Learner:
  return Learner(LearnerConfig.from_config(config), policy=lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh=mesh,
                 model_config=cfg, abstract=True)


def _update_programs(raw_config: Any, cfg: ModelConfig, mesh: Mesh, rows: int, seq_len: int, grpo: bool
                     ) -> tuple[list[aot.Program], Learner]:
  """The run's update and, beside an algorithm with a critic, GRPO's (its preset: groups, no critic), compiled with
  their costs; and the run's (abstract) learner."""
  from sao_jax import config_lib  # pylint: disable=g-import-not-at-top
  out, first = [], None
  # Packed rows (`trainer.pack`) carry per-segment fields [rows, S]; as many rows as trajectories bounds a step.
  segments = int(raw_config.trainer.pack_segments) if raw_config.trainer.pack != 'none' else 1
  names = [str(raw_config.algo.name)]
  if grpo and names[0] in algo_lib.CRITIC_ALGOS:
    names.append('grpo')
  for name in names:
    c = raw_config.copy_and_resolve_references()
    c.algo.name = name
    c = config_lib.validate(c, devices=list(mesh.devices.flat), log=False)
    learner = _learner(c, cfg, mesh)
    first = first or learner
    prog = aot.compile_program(f'update ({name})',
                               lambda learner=learner: learner.lower_update(rows, seq_len, segments),
                               args=(learner.state, learner.base), note=f'{rows} x {seq_len} tokens'
                               + (f', up to {segments} trajectories a row' if segments > 1 else ''))

    # The cost compiles run one microbatch's rows as the whole batch (no minibatch or microbatch loop) and count
    # it `parts` times: the same arithmetic, each part's weight gathers included; the optimizer's update, once a
    # minibatch in the run, is counted `parts` times (a fraction of a percent of the step at 8B).
    micro = c.trainer.microbatch_size or c.trainer.minibatch_size or rows
    parts = rows // micro
    one = c.copy_and_resolve_references()
    one.trainer.batch_size, one.trainer.minibatch_size, one.trainer.microbatch_size = micro, 0, 0

    def at_depth(layers, c=one, micro=micro):
      small = cfg.replace(num_layers=layers, scan_layers=False)
      with loops.unrolled_loops():
        return _learner(c, small, mesh).lower_update(micro, seq_len, segments)
    flops, bytes_accessed = aot.depth_cost(at_depth, cfg.num_layers)
    prog.flops, prog.bytes_accessed = parts * flops, parts * bytes_accessed
    out.append(prog)
  return out, first


def _publish(learner: Learner, actor_mesh: Mesh | None, rules: Any) -> tuple[aot.Program, Any]:
  """The publish (`generate.weights`): the policy from the learner's shardings into decode layout, compute dtype,
  a copy per process over its devices (several processes, or actors on devices of their own: planned on the
  learner's devices; the local move to the actors' own is not a program): the run's layer program, run once per
  layer, and its embeddings program, as one program (all their outputs, the larger temporaries); on one process
  sharing the learner's mesh, the one conversion. Returns it and the weights an actor's programs read."""
  model = learner.policy_model()
  if actor_mesh is not None or len({d.process_index for d in learner.mesh.devices.flat}) > 1:
    lowered = weights_lib.lower_publish(model, learner.mesh, rules)
    stacked, outer = decode_lib.layer_params(model), decode_lib.outer_params(model)
    index = jax.ShapeDtypeStruct((), jnp.int32, sharding=lowered.index_sharding)
    layer = aot.compile_program('publish', lambda: lowered.layer, args=(stacked, index))
    rest = aot.compile_program('publish', lambda: lowered.outer, args=outer)
    n = lowered.num_layers
    layer_cost, rest_cost = aot.cost(lambda: lowered.layer), aot.cost(lambda: lowered.outer)
    prog = aot.Program(
        name='publish', argument_bytes=layer.argument_bytes + rest.argument_bytes,
        output_bytes=n * layer.output_bytes + rest.output_bytes, temp_bytes=max(layer.temp_bytes, rest.temp_bytes),
        alias_bytes=n * layer.alias_bytes + rest.alias_bytes, compile_s=layer.compile_s + rest.compile_s,
        largest=sorted(layer.largest + rest.largest, key=lambda t: -t[1])[:3],
        refused=layer.refused or rest.refused, note=f'{n} layer calls and the embeddings\', one after another')
    prog.flops, prog.bytes_accessed = n * layer_cost[0] + rest_cost[0], n * layer_cost[1] + rest_cost[1]
    abstract, target = lowered.abstract, lowered.shardings
    if actor_mesh is not None:
      target = weights_lib.decode_shardings(abstract, actor_mesh, rules)
  else:
    graphdef, state = nnx.split(model)
    lowered_fn = lambda: weights_lib._decode_copy.lower(graphdef, state)  # pylint: disable=protected-access
    prog = aot.compile_program('publish', lowered_fn, args=state, note='one conversion')
    prog.flops, prog.bytes_accessed = aot.cost(lowered_fn)
    abstract = jax.eval_shape(lambda s: weights_lib._to_decode_layout(graphdef, s), state)  # pylint: disable=protected-access
    if prog.refused:  # XLA chose no layout: replicated on the learner's mesh (an upper bound).
      target = jax.tree.map(lambda _: NamedSharding(learner.mesh, PartitionSpec()), abstract)
    else:
      target = lowered_fn().compile().output_shardings
  return prog, state_lib.abstract(abstract, target)


def _cache(cfg: ModelConfig, rows: int, slots: int, place: slot_programs.CachePlacement, per_row_index: bool
           ) -> decode_lib.DecodeCache:
  abstract = jax.eval_shape(lambda: decode_lib.init_cache(cfg, rows, slots, per_row_index=per_row_index))
  kv = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place.kv)
  rest = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=place.rest)
  return decode_lib.DecodeCache(k=tuple(map(kv, abstract.k)), v=tuple(map(kv, abstract.v)), valid=rest(abstract.valid),
                                index=rest(abstract.index), positions=rest(abstract.positions))


@dataclasses.dataclass
class _Engine:
  """The actors' sampler geometry of the run."""
  cfg: ModelConfig
  settings: GenerateConfig
  slots: int
  place: slot_programs.CachePlacement
  stop_ids: tuple[int, ...]
  max_new_tokens: int

  def static(self, window: int, cfg: ModelConfig | None = None) -> static_lib.StaticSettings:
    return static_lib.StaticSettings(cfg or self.cfg, self.settings.decoding, self.stop_ids, self.cfg.pad_id, window)


def _slot_programs(e: _Engine, weights: Any) -> tuple[list[aot.Program], int]:
  """The slot engine's admission (a chunk of the largest admission bucket into the most rows) and decode chunk
  (every slot, the whole cache as its window, with the queue of new episodes); returns them and the cache's
  per-chip bytes."""
  cfg, mesh = e.cfg, e.place.rest.mesh
  cache_len = slots_lib.cache_length(e.settings.max_seq_len)
  chunk, prefix_slots = max(slots_lib.CHUNK_BUCKETS), max(slots_lib.CHUNK_BUCKETS)
  cache = _cache(cfg, e.slots, cache_len, e.place, True)
  prefix = _cache(cfg, 1, prefix_slots, e.place, True)
  rows = max(min(4 ** k, e.slots) for k in range(16) if 4 ** (k - 1) < e.slots)  # `SlotSampler.row_buckets`.
  rep = lambda shape, dtype: _replicated(mesh, shape, dtype)
  admit_args = (weights, cache, rep((rows,), jnp.int32), rep((rows, chunk), jnp.int32), rep((rows, chunk), bool),
                rep((rows,), jnp.int32), rep((rows,), bool), rep((rows,), jnp.uint32), prefix, rep((rows,), bool))
  st = e.static(cache_len)
  admit = aot.compile_program('slot admit', lambda: slot_programs.admit_program.lower(st, e.place, *admit_args),
                              args=admit_args, note=f'{rows} rows x {chunk} tokens, {e.slots} slots x {cache_len}')
  r, q = e.slots, e.slots
  qchunk = e.settings.queue_chunk or min(slots_lib.CHUNK_BUCKETS)
  queue = slot_programs.Queue(rep((q, qchunk), jnp.int32), rep((q, qchunk), bool), rep((q,), bool),
                              rep((q,), jnp.uint32), rep((q,), jnp.int32), rep((q,), bool), rep((), jnp.int32),
                              rep((r,), bool), prefix)
  window = _cache(cfg, r, cache_len, e.place, True)
  decode_args = (weights, cache, rep((r,), jnp.int32), rep((r,), jnp.int32), rep((r,), bool), rep((r,), jnp.int32),
                 rep((r,), jnp.int32), rep((r,), jnp.uint32), rep((), jnp.int32), queue, (window.k, window.v))
  steps = e.settings.decode_steps
  decode = aot.compile_program(
      'slot decode', lambda: slot_programs.decode_program.lower(st, steps, e.place, *decode_args),
      args=decode_args, note=f'{r} rows, {steps} steps a call, window {cache_len}')
  admit.flops, admit.bytes_accessed = aot.cost(lambda: slot_programs.admit_program.lower(st, e.place, *admit_args))
  return [admit, decode], aot.tree_bytes_per_chip(cache)


def _static_programs(e: _Engine, weights: Any) -> list[aot.Program]:
  """The static engine's prefill (the largest prompt bucket) and decode loop, `sampler.batch_size` rows."""
  cfg, mesh = e.cfg, e.place.rest.mesh
  b = 1 << max(0, (e.slots - 1).bit_length())  # `Sampler.batch_bucket`: a power of two.
  s, t = e.settings.max_seq_len, max(e.settings.prompt_buckets)
  cache = _cache(cfg, b, s, e.place, False)
  rep = lambda shape, dtype: _replicated(mesh, shape, dtype)
  row = lambda dtype: rep((b,), dtype)
  prefill_args = (weights, cache, rep((b, t), jnp.int32), rep((b, t), bool), row(jnp.uint32), row(jnp.int32),
                  rep((), jnp.int32))
  prefill_fn = jax.jit(static_lib._prefill_impl, static_argnums=(0,), donate_argnums=(2,))  # pylint: disable=protected-access
  decode_fn = jax.jit(static_lib._decode_impl, static_argnums=(0, 1), donate_argnums=(3,))  # pylint: disable=protected-access
  st = e.static(s)
  prefill = aot.compile_program('static prefill', lambda: prefill_fn.lower(st, *prefill_args), args=prefill_args,
                                note=f'{b} rows x {t} tokens, cache {s}')
  n = static_lib._next_pow2(e.max_new_tokens, 16)  # `Sampler.new_tokens_bucket`.  pylint: disable=protected-access
  decode_args = (weights, cache, row(jnp.int32), row(jnp.float32), row(jnp.float32), row(jnp.int32), row(jnp.uint32),
                 row(jnp.int32), rep((), jnp.int32))
  decode = aot.compile_program('static decode', lambda: decode_fn.lower(st, n, *decode_args), args=decode_args,
                               note=f'{b} rows, {n} steps')
  prefill.flops, prefill.bytes_accessed = aot.cost(lambda: prefill_fn.lower(st, *prefill_args))
  decode.steps = n
  prefill.cache = cache  # Its KV cache (what the run holds when the static engine is its engine).
  return [prefill, decode]


def _decode_step_cost(e: _Engine, weights: Any, rows: int, slots: int) -> tuple[float, float]:
  """FLOPs and bytes of one decode step of `rows` rows attending over `slots` slots (the actors' token cost)."""

  def step(cfg, weights, cache, last, seeds):
    hidden, cache = decode_lib.forward(cfg, weights, cache, last[:, None], jnp.ones((last.shape[0], 1), bool))
    logits = decode_lib.last_logits(weights, hidden)
    tok, lp, _ = sampling.select_tokens(logits, seeds, cache.positions, e.settings.decoding)
    return cache, tok, lp

  mesh = e.place.rest.mesh

  def at_depth(layers):
    cfg = e.cfg.replace(num_layers=layers)
    fn = jax.jit(lambda w, c, l, sd: step(cfg, w, c, l, sd), donate_argnums=(1,))
    cache = _cache(cfg, rows, slots, e.place, True)
    rep = lambda shape, dtype: _replicated(mesh, shape, dtype)
    return fn.lower(weights.replace(layers=weights.layers[:layers]), cache, rep((rows,), jnp.int32),
                    rep((rows,), jnp.uint32))

  return aot.depth_cost(at_depth, e.cfg.num_layers)


# Versions of the published weights the actors' chips hold while the learner's update runs (the trainer publishes
# once an update has run), and while a publish or an actor's program runs (the version the actors decode with and
# the next one; `generate.weights.WeightPublisher` keeps two copies at most, every actor thread shares them).
VERSIONS_IN_UPDATE, VERSIONS_ELSE = 1, 2


def plan_programs(raw_config: Any, devices: list[Any], chip: aot.Chip | None, topology: str, *, seq_len: int = 0,
                  grpo: bool = True, engines: str = 'run') -> aot.Plan:
  """Every program of the run `raw_config` (as given, not validated) describes on `devices` (module docstring)."""
  from sao_jax import config_lib  # pylint: disable=g-import-not-at-top
  config = config_lib.validate(raw_config, devices=devices, log=False)
  cfg = model_config_of(config.model)
  learner_devices, actor_devices = parallel.split_devices(config.mesh, devices)
  shared = actor_devices is None or not {d.id for d in actor_devices} - {d.id for d in learner_devices}
  if chip is not None and len(learner_devices) < len(devices):
    raise ConfigError(f'config.mesh.actor_devices={config.mesh.actor_devices}: the TPU compiler compiles for a whole '
                      "slice's devices only, not the learner's part of one; plan with actor_devices=0 (the actors on "
                      "each host's chips, shared), or plan the learner's slice on its own.")
  if chip is not None and actor_devices is not None and len(actor_devices) < len(devices):
    actor_devices = aot.host_devices(chip)  # One process's chips, as a one-host slice.
  mesh = learner_mesh(config.mesh, learner_devices)
  actor_mesh = None if actor_devices is None else parallel.make_actor_mesh(actor_devices)
  rows = int(config.trainer.batch_size)
  seq_len = seq_len or max(int(t) for t in config.trainer.seq_buckets)
  updates, learner = _update_programs(raw_config, cfg, mesh, rows, seq_len, grpo)
  learner_bytes = aot.tree_bytes_per_chip((learner.state, learner.ref_state, learner.base))  # LoRA: its base too.

  publish, weights = _publish(learner, actor_mesh, config.mesh.rules)
  settings = GenerateConfig.from_config(config)
  group_size = learner.step_config.group_size
  slots = settings.episodes_per_call(group_size)
  actors_mesh = mesh if actor_mesh is None else actor_mesh
  kv = NamedSharding(actors_mesh, parallel.logical_to_spec((None, 'kv_heads'), (slots, cfg.num_kv_heads), actors_mesh,
                                                           config.mesh.rules, name="the actors' slot cache"))
  engine = _Engine(cfg, settings, slots, slot_programs.CachePlacement.of(kv), tuple(cfg.eos_ids),
                   int(config.sampler.max_new_tokens))
  # The run's engine (config.sampler.continuous: slot, else static), or both; the other's cache is not resident.
  slot_progs, static_progs, cache_bytes = [], [], 0
  platform = 'cpu' if chip is None else 'tpu'  # The actors' attention is the topology's, not this host's.
  if settings.continuous or engines == 'both':
    with decode_lib.attention_for(platform):
      slot_progs, cache_bytes = _slot_programs(engine, weights)
  if not settings.continuous or engines == 'both':
    with decode_lib.attention_for(platform):
      static_progs = _static_programs(engine, weights)
    if not settings.continuous:
      cache_bytes = aot.tree_bytes_per_chip(static_progs[0].cache)

  threads = int(config.sampler.num_threads)
  weights_bytes = aot.tree_bytes_per_chip(weights)  # One version, shared by every actor thread of a process.
  caches = threads * cache_bytes
  # A chip runs one program at a time: another program's temporaries are not live during this one's; what is
  # resident is the other side's state (learner state; published versions and KV caches).
  for p in updates:
    p.resident_bytes = (VERSIONS_IN_UPDATE * weights_bytes + caches) if shared else 0
  # The publish's outputs are the new version; the actors keep the one they decode with.
  publish.resident_bytes = learner_bytes - publish.argument_bytes + (
      (VERSIONS_ELSE - 1) * weights_bytes + caches if shared else 0)
  for p in slot_progs + static_progs:
    # Arguments: one version of the weights and this actor's cache; the other version and caches stay.
    p.resident_bytes = (learner_bytes if shared else 0) + (VERSIONS_ELSE - 1) * weights_bytes + caches - cache_bytes

  # ---- The run's figures (rooflines of the compiler's counts).
  with decode_lib.attention_for(platform):
    step_flops, step_bytes = _decode_step_cost(engine, weights, slots, slots_lib.cache_length(settings.max_seq_len))
  # The decode loops' costs: their steps' (a while loop's body counts once), at the whole cache's window.
  decoders = ([(slot_progs[1], settings.decode_steps)] if slot_progs else []) + (
      [(static_progs[1], static_progs[1].steps)] if static_progs else [])
  for p, steps in decoders:
    p.flops, p.bytes_accessed = step_flops * steps, step_bytes * steps
    p.note += f'; cost: {steps} x one step over the whole window'
  actor_chips = len({d.id for d in actors_mesh.devices.flat})
  decode_step_s = (max(step_flops / chip.peak_flops, step_bytes / chip.hbm_bytes_per_s) if chip else float('nan'))
  update = updates[0]
  step_s = update.roofline_s(chip)
  step_config = learner.step_config
  passes = step_config.policy_epochs + (step_config.critic_epochs if step_config.uses_critic else 0)
  model_flops = cfg.flops_per_token(seq_len) * rows * seq_len * passes
  run = {
      'learner_devices': len(learner_devices), 'actor_devices_per_process': actor_chips, 'actors_share_learner': shared,
      'batch': f'{rows} x {seq_len} tokens', 'learner_step_s': step_s,
      'learner_model_flops': model_flops, 'learner_compiler_flops': update.flops * len(learner_devices),
      'learner_mfu': (model_flops / (step_s * len(learner_devices) * chip.peak_flops)) if chip else float('nan'),
      'decode_step_s': decode_step_s, 'decode_rows': slots,
      'rollout_tokens_per_s_per_actor_chip': threads * slots / decode_step_s / actor_chips if chip else float('nan'),
      'publish_s': publish.roofline_s(chip),
  }
  return aot.Plan(topology=topology, chip=chip, num_devices=len(devices), model=cfg.name,
                  num_params=cfg.num_params(), programs=updates + [publish] + slot_progs + static_progs,
                  run=run)
