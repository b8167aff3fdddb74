"""The ahead-of-time plan's figures: topologies and their chips, compiled programs' per-chip bytes and costs, the
plan's table and JSON (`sao_jax.tools.aot` is the command; `aot_programs` builds the run's programs)."""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable
from typing import Any

from absl import logging


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator chip's figures (vendor's public specifications)."""
  key: str
  name: str
  hbm_bytes: int
  peak_flops: float  # bf16 dense FLOP/s.
  hbm_bytes_per_s: float
  source: str


_GIB = 1 << 30
CHIPS = {
    'v4': Chip('v4', 'TPU v4', 32 * _GIB, 275e12, 1228e9, 'https://cloud.google.com/tpu/docs/v4'),
    'v5e': Chip('v5e', 'TPU v5e', 16 * _GIB, 197e12, 819e9, 'https://cloud.google.com/tpu/docs/v5e'),
    'v5p': Chip('v5p', 'TPU v5p', 95 * _GIB, 459e12, 2765e9, 'https://cloud.google.com/tpu/docs/v5p'),
    'v6e': Chip('v6e', 'TPU v6e', 32 * _GIB, 918e12, 1640e9, 'https://cloud.google.com/tpu/docs/v6e'),
}
# Slice names count TensorCores on v4 / v5p (two a chip), chips on v5e / v6e.
_CORES_PER_CHIP = {'v4': 2, 'v5p': 2, 'v5e': 1, 'v6e': 1}
_ROOM = 0.9  # A program fits when its total is at most this fraction of a chip's HBM (the bound).


def chip_grid(generation: str, chips: int) -> str:
  """libtpu's topology name of a slice of `chips` chips: 2D (v5e, v6e) or 3D (v4, v5p) torus, near square."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f'{chips} chips: slices of a power of two chips only (or name the topology, e.g. v5e:4x8).')
  dims = 3 if generation in ('v4', 'v5p') else 2
  shape = [1] * dims
  for i in range(int(math.log2(chips))):
    shape[dims - 1 - i % dims] *= 2
  if dims == 3 and chips >= 4 and shape[0] == 1:  # 4 chips is 2x2x1 on v4 / v5p.
    shape = sorted(shape, reverse=True)
  return f'{generation}:{"x".join(map(str, shape))}'


_HOST_GRID = {'v4': 'v4:2x2x1', 'v5p': 'v5p:2x2x1', 'v5e': 'v5e:2x2', 'v6e': 'v6e:2x2'}


def host_devices(chip: Chip) -> list[Any]:
  """The devices of one host of `chip`'s slices (a one-host topology): the TPU compiler compiles a program for all
  of a topology's devices only, so a program on one process's devices (the actors') is compiled on these."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  return list(topologies.get_topology_desc(platform='tpu', topology_name=_HOST_GRID[chip.key]).devices)


def topology_devices(topology: str) -> tuple[list[Any], Chip | None, str]:
  """The devices of `topology` (see the `--topology` flag), their chip (None for host devices) and the libtpu
  topology name."""
  import jax  # pylint: disable=g-import-not-at-top

  m = re.fullmatch(r'cpu:(\d+)', topology)
  if m:
    n = int(m.group(1))
    devices = jax.devices('cpu')
    if len(devices) < n:
      raise ValueError(f'--topology={topology}: this process has {len(devices)} CPU devices (run the tool fresh: it '
                       'sets --xla_force_host_platform_device_count before jax starts).')
    return devices[:n], None, topology
  m = re.fullmatch(r'(v4|v5e|v5p|v6e)-(\d+)', topology)
  if m:
    gen = m.group(1)
    name = chip_grid(gen, int(m.group(2)) // _CORES_PER_CHIP[gen])
  elif re.fullmatch(r'(v4|v5e|v5p|v6e):\d+(x\d+)+', topology):
    gen, name = topology.split(':')[0], topology
  else:
    raise ValueError(f'--topology={topology!r}: expected e.g. v5e-64, v5p-128, v5e:4x4 or cpu:8.')
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    desc = topologies.get_topology_desc(platform='tpu', topology_name=name)
  except Exception as e:  # pylint: disable=broad-except
    raise RuntimeError(f'--topology={topology}: the TPU compiler could not describe {name!r} ({e}); is libtpu '
                       'installed (scripts/setup.sh --tpu)?') from e
  return list(desc.devices), CHIPS[gen], name


# ---------------------------------------------------------------------------------------------------------
# Programs.


@dataclasses.dataclass
class Program:
  """One compiled program's per-chip figures (bytes of the busiest chip, as XLA reports per device)."""
  name: str
  argument_bytes: int
  output_bytes: int
  temp_bytes: int
  alias_bytes: int
  resident_bytes: int = 0  # Held on the same chips while it runs, outside its arguments (see `Plan`).
  flops: float = float('nan')  # Per chip, all loops counted (see the module docstring).
  bytes_accessed: float = float('nan')
  compile_s: float = 0.0
  largest: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # Its largest arguments per chip.
  note: str = ''
  refused: bool = False  # The compiler refused it for memory (its temporaries are what it asked for).
  steps: int = 0  # Decode loops: the steps of one call.
  cache: Any = None  # The static prefill's KV cache (abstract), for the run's residency.

  @property
  def program_bytes(self) -> int:
    return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

  @property
  def total_bytes(self) -> int:
    return self.program_bytes + self.resident_bytes

  def roofline_s(self, chip: Chip | None) -> float:
    if chip is None or not math.isfinite(self.flops):
      return float('nan')
    return max(self.flops / chip.peak_flops, self.bytes_accessed / chip.hbm_bytes_per_s)


def _per_chip_bytes(x: Any) -> int:
  """Bytes of the largest shard of a `ShapeDtypeStruct` with a sharding (one chip's share)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  shape = x.sharding.shard_shape(x.shape) if getattr(x, 'sharding', None) is not None else x.shape
  return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def tree_bytes_per_chip(tree: Any) -> int:
  """Per-chip bytes of an abstract tree whose leaves carry shardings (every leaf's largest shard)."""
  import jax  # pylint: disable=g-import-not-at-top
  return sum(_per_chip_bytes(x) for x in jax.tree.leaves(tree))


def _largest(tree: Any, k: int = 3) -> list[tuple[str, int]]:
  import jax  # pylint: disable=g-import-not-at-top
  leaves = jax.tree_util.tree_leaves_with_path(tree)
  sized = [(jax.tree_util.keystr(path), _per_chip_bytes(x)) for path, x in leaves if hasattr(x, 'dtype')]
  return sorted(sized, key=lambda t: -t[1])[:k]


_UNITS = {'': 1, 'K': 1 << 10, 'M': 1 << 20, 'G': 1 << 30, 'T': 1 << 40}


def compile_program(name: str, lowered: Callable[[], Any], *, args: Any = None, note: str = '') -> Program:
  """Compiles `lowered()` (a `jax.stages.Lowered`) and reads its memory analysis. A program the compiler refuses
  for memory (RESOURCE_EXHAUSTED) is returned with the temporaries it asked for and its arguments' per-chip bytes
  (from their shardings), its note the compiler's message."""
  t0 = time.perf_counter()
  try:
    compiled = lowered().compile()
  except Exception as e:  # pylint: disable=broad-except  # jax.errors.JaxRuntimeError; anything else re-raised.
    m = re.search(r'HLO temporaries \(([\d.]+)([KMGT]?)\)', str(e))
    if 'RESOURCE_EXHAUSTED' not in str(e) or args is None:
      raise
    temp = int(float(m.group(1)) * _UNITS[m.group(2)]) if m else 0
    logging.warning('%s does not fit: %s', name, str(e).splitlines()[0])
    return Program(name=name, argument_bytes=tree_bytes_per_chip(args), output_bytes=0, temp_bytes=temp,
                   alias_bytes=0, compile_s=time.perf_counter() - t0, largest=_largest(args), refused=True,
                   note=(note + '; ' if note else '') + 'refused by the compiler: ' + str(e).splitlines()[0][:200])
  dt = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  logging.info('Compiled %s in %.1f s.', name, dt)
  return Program(name=name, argument_bytes=int(mem.argument_size_in_bytes), output_bytes=int(mem.output_size_in_bytes),
                 temp_bytes=int(mem.temp_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes), compile_s=dt,
                 largest=_largest(args) if args is not None else [], note=note)


def cost(lowered: Callable[[], Any]) -> tuple[float, float]:
  """(FLOPs, bytes accessed) per chip of a lowered program, from the compiler (NaN when it refuses the program
  for memory)."""
  t0 = time.perf_counter()
  try:
    ca = lowered().compile().cost_analysis()
    logging.info('Compiled for its cost in %.1f s.', time.perf_counter() - t0)
  except Exception as e:  # pylint: disable=broad-except
    if 'RESOURCE_EXHAUSTED' not in str(e):
      raise
    return float('nan'), float('nan')
  ca = ca[0] if isinstance(ca, (list, tuple)) else ca
  return float(ca.get('flops', 0.0)), float(ca.get('bytes accessed', 0.0))


def depth_cost(lowered_at: Callable[[int], Any], num_layers: int) -> tuple[float, float]:
  """FLOPs and bytes of the program at `num_layers`, from compiles at 1 and 2 layers (loops unrolled)."""
  one, two = cost(lambda: lowered_at(1)), cost(lambda: lowered_at(2))
  return tuple(a + (num_layers - 1) * (b - a) for a, b in zip(one, two))


# ---------------------------------------------------------------------------------------------------------
# The plan.


@dataclasses.dataclass
class Plan:
  topology: str
  chip: Chip | None
  num_devices: int
  model: str
  num_params: int
  programs: list[Program]
  run: dict[str, Any]

  @property
  def hbm_bytes(self) -> int | None:
    return None if self.chip is None else self.chip.hbm_bytes

  def fits(self, program: Program) -> bool | None:
    if program.refused:
      return False
    return None if self.chip is None else program.total_bytes <= _ROOM * self.chip.hbm_bytes

  def to_json(self) -> dict[str, Any]:
    return {
        'topology': self.topology, 'num_devices': self.num_devices, 'model': self.model, 'num_params': self.num_params,
        'chip': None if self.chip is None else dataclasses.asdict(self.chip),
        'fit_fraction': _ROOM,
        'programs': [{
            'name': p.name, 'argument_bytes_per_chip': p.argument_bytes, 'output_bytes_per_chip': p.output_bytes,
            'temp_bytes_per_chip': p.temp_bytes, 'alias_bytes_per_chip': p.alias_bytes,
            'program_bytes_per_chip': p.program_bytes, 'resident_bytes_per_chip': p.resident_bytes,
            'total_bytes_per_chip': p.total_bytes, 'hbm_bytes_per_chip': self.hbm_bytes, 'fits': self.fits(p),
            'flops_per_chip': p.flops, 'bytes_accessed_per_chip': p.bytes_accessed,
            'roofline_s': p.roofline_s(self.chip), 'compile_s': p.compile_s,
            'largest_arguments': [{'name': n, 'bytes_per_chip': b} for n, b in p.largest], 'note': p.note,
            'refused_by_compiler': p.refused,
        } for p in self.programs],
        'run': self.run,
    }

  def table(self) -> str:
    gib = lambda b: f'{b / _GIB:7.2f}'
    hbm = '-' if self.chip is None else f'{self.chip.hbm_bytes / _GIB:.0f}'
    lines = [f'{self.model} ({self.num_params / 1e9:.2f}B parameters) on {self.topology}: {self.num_devices} '
             f'devices, {hbm} GiB HBM a chip ({"host devices" if self.chip is None else self.chip.name}).',
             f'{"program":<22} {"args":>7} {"out":>7} {"temp":>7} {"alias":>7} {"resid":>7} {"total":>7}  fits'
             f' {"TFLOP":>8} {"GB acc":>8} {"roofline":>9}',
             '(GiB per chip)']
    for p in self.programs:
      fit = {None: '   -', True: ' yes', False: '  NO'}[self.fits(p)]
      lines.append(f'{p.name:<22} {gib(p.argument_bytes)} {gib(p.output_bytes)} {gib(p.temp_bytes)} '
                   f'{gib(p.alias_bytes)} {gib(p.resident_bytes)} {gib(p.total_bytes)} {fit} '
                   f'{p.flops / 1e12:8.3f} {p.bytes_accessed / 1e9:8.2f} {p.roofline_s(self.chip) * 1e3:7.1f}ms')
    for p in self.programs:
      if self.fits(p) is False:
        lines.append(f'  {p.name} does not fit: largest arguments per chip ' +
                     ', '.join(f'{n} {b / _GIB:.2f} GiB' for n, b in p.largest))
    for key, value in self.run.items():
      lines.append(f'{key}: {value:.4g}' if isinstance(value, float) else f'{key}: {value}')
    return '\n'.join(lines)


def plan(config: Any, topology: str, *, seq_len: int = 0, grpo: bool = True, engines: str = 'run') -> Plan:
  """Compiles every program of the run `config` (as given: each algorithm planned is validated) describes for
  `topology` and returns their figures."""
  from sao_jax.tools import aot_programs  # pylint: disable=g-import-not-at-top  # It imports this module.
  devices, chip, name = topology_devices(topology)
  return aot_programs.plan_programs(config, devices, chip, topology if name == topology else f'{topology} ({name})',
                                    seq_len=seq_len, grpo=grpo, engines=engines)


