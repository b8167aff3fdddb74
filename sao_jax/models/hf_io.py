"""Hugging Face checkpoint io: load an HF directory into a `Decoder`, export a `Decoder` to an HF directory.

Loading (`load_hf`) reads `config.json` and every `*.safetensors` file through a memory map (float32,
float16 and bfloat16 tensors; no torch needed). The model is created abstractly (`nnx.eval_shape`, no
allocation) and each parameter is then built with `jax.make_array_from_callback`: every device receives only
its own shard, sliced from the memory-mapped file, so with a mesh the whole model is never materialised on
one device. Shardings come from the parameters' logical axis names and `rules` (the `config.mesh.rules`
pairs, see `sao_jax.parallel.sharding`).

Weight layouts (HF `nn.Linear.weight` is [out, in]; ours are [in, ...out]):
  q_proj [N*H, D] -> [D, N, H];  k_proj/v_proj [K*H, D] -> [D, K, H];  o_proj [D, N*H] -> [N, H, D];
  gate/up [F, D] -> [D, F];  down [D, F] -> [F, D];  lm_head [V, D] -> [D, V];  biases [n*H] -> [n, H].
MoE (qwen3_moe, glm4_moe; HF layer l >= first_k_dense is our `moe_layers[l - first_k_dense]`): mlp.gate.weight
  [E, D] -> router [D, E]; mlp.gate.e_score_correction_bias [E] -> router_bias; mlp.experts.{e}.gate_proj/up_proj
  [F, D] -> gate_proj/up_proj [E, D, F] (expert e); down_proj [D, F] -> down_proj [E, F, D]; mlp.shared_experts.*
  as a dense MLP -> shared_*_proj. A shard reads only its own layers and experts (an expert-split model loads
  each device's experts only).

Exporting (`save_hf`) writes `config.json` (Llama / Qwen2 / Qwen3 / Qwen3-MoE / GLM-4-MoE architecture), `model.safetensors`
(float32) and, if given, the tokenizer files of `tokenizer_dir`; `transformers.AutoModelForCausalLM` loads it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sao_jax.models import lora
from sao_jax.models.config import ModelConfig
from sao_jax.models.llama import Decoder, RouterBias

Rules = Sequence[tuple[str, Any]]
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'vocab.json',
                   'merges.txt', 'tokenizer.model', 'chat_template.jinja', 'generation_config.json')

_ST_DTYPES = {'F32': np.float32, 'F16': np.float16, 'BF16': np.uint16, 'F64': np.float64}


# ---------------------------------------------------------------------------------------------------------
# Safetensors, memory-mapped.


class SafetensorsReader:
  """Lazy, memory-mapped reader of one or more .safetensors files (returns float32 numpy arrays)."""

  def __init__(self, files: Sequence[str]):
    self._index: dict[str, tuple[np.memmap, dict[str, Any], int]] = {}
    for path in files:
      with open(path, 'rb') as f:
        header_len = int.from_bytes(f.read(8), 'little')
        header = json.loads(f.read(header_len))
      data = np.memmap(path, dtype=np.uint8, mode='r')
      for name, meta in header.items():
        if name == '__metadata__':
          continue
        if meta['dtype'] not in _ST_DTYPES:
          raise ValueError(f'{path}: tensor {name!r} has unsupported dtype {meta["dtype"]}.')
        self._index[name] = (data, meta, 8 + header_len)

  def __contains__(self, name: str) -> bool:
    return name in self._index

  def keys(self) -> list[str]:
    return list(self._index)

  def get(self, name: str) -> np.ndarray:
    """The tensor as float32 (a zero-copy view for F32)."""
    if name not in self._index:
      raise KeyError(f'Tensor {name!r} is missing from the checkpoint.')
    data, meta, base = self._index[name]
    start, end = meta['data_offsets']
    raw = data[base + start: base + end].view(_ST_DTYPES[meta['dtype']]).reshape(meta['shape'])
    if meta['dtype'] == 'BF16':
      return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------------------
# Name and layout mapping.


class _Entry(NamedTuple):
  """Where one of our parameters comes from: an HF tensor name `template` (with `{l}` the HF layer index, `{e}` the
  expert), the HF -> ours transform of one tensor, the HF layers of our stacked axis (None: not stacked) and the
  experts of our expert axis (0: none). Ours is `[len(layers), experts, *transform(hf).shape]`, absent axes left
  out."""
  template: str
  transform: Callable[[np.ndarray], np.ndarray]
  layers: tuple[int, ...] | None = None
  experts: int = 0

  def names(self) -> list[str]:
    """Every HF tensor name of this parameter, in our layout's order (layers outer, experts inner)."""
    layers = (None,) if self.layers is None else self.layers
    experts = (None,) if not self.experts else range(self.experts)
    return [self.template.format(l=l, e=e) for l in layers for e in experts]


def _param_map(cfg: ModelConfig) -> dict[tuple[str, ...], _Entry]:
  """Our param path -> its `_Entry` (HF names and transform)."""
  n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.embed_dim
  ident = lambda w: w  # noqa: E731
  t = lambda w: w.T  # noqa: E731
  pre = 'model.layers.{l}.'
  m = {
      ('embed', 'embedding'): _Entry('model.embed_tokens.weight', ident),
      ('final_norm', 'scale'): _Entry('model.norm.weight', ident),
  }
  stacks = [('layers', tuple(range(cfg.num_dense_layers)))]
  if cfg.is_moe:
    stacks.append(('moe_layers', tuple(range(cfg.first_k_dense, cfg.num_layers))))
  for stack, layers in stacks:
    if not layers:
      continue
    per_layer = {
        ('attn_norm', 'scale'): ('input_layernorm.weight', ident),
        ('mlp_norm', 'scale'): ('post_attention_layernorm.weight', ident),
        ('attn', 'q_proj'): ('self_attn.q_proj.weight', lambda w: w.T.reshape(d, n, h)),
        ('attn', 'k_proj'): ('self_attn.k_proj.weight', lambda w: w.T.reshape(d, k, h)),
        ('attn', 'v_proj'): ('self_attn.v_proj.weight', lambda w: w.T.reshape(d, k, h)),
        ('attn', 'o_proj'): ('self_attn.o_proj.weight', lambda w: w.T.reshape(n, h, d)),
    }
    if cfg.qkv_bias:
      per_layer[('attn', 'q_bias')] = ('self_attn.q_proj.bias', lambda b: b.reshape(n, h))
      per_layer[('attn', 'k_bias')] = ('self_attn.k_proj.bias', lambda b: b.reshape(k, h))
      per_layer[('attn', 'v_bias')] = ('self_attn.v_proj.bias', lambda b: b.reshape(k, h))
    if cfg.qk_norm:
      per_layer[('attn', 'q_norm', 'scale')] = ('self_attn.q_norm.weight', ident)
      per_layer[('attn', 'k_norm', 'scale')] = ('self_attn.k_norm.weight', ident)
    if stack == 'layers':
      for proj in ('gate_proj', 'up_proj', 'down_proj'):
        per_layer[('mlp', proj)] = (f'mlp.{proj}.weight', t)
    else:
      per_layer[('moe', 'router')] = ('mlp.gate.weight', t)
      if cfg.router_bias:
        per_layer[('moe', 'router_bias')] = ('mlp.gate.e_score_correction_bias', ident)
      if cfg.num_shared_experts:
        for proj in ('gate_proj', 'up_proj', 'down_proj'):
          per_layer[('moe', f'shared_{proj}')] = (f'mlp.shared_experts.{proj}.weight', t)
      for proj in ('gate_proj', 'up_proj', 'down_proj'):  # HF per-expert tensors [out, in].
        m[(stack, 'moe', proj)] = _Entry(pre + 'mlp.experts.{e}.' + proj + '.weight', t, layers, cfg.num_experts)
    for path, (name, transform) in per_layer.items():
      m[(stack,) + path] = _Entry(pre + name, transform, layers)
  if not cfg.tie_embeddings:
    m[('lm_head',)] = _Entry('lm_head.weight', t)
  return m


def _to_hf(ours: np.ndarray, path: tuple[str, ...], cfg: ModelConfig) -> np.ndarray:
  """Inverse of the load transform for one (per-layer) parameter."""
  if path[-1] in ('q_proj', 'k_proj', 'v_proj'):
    return ours.reshape(cfg.embed_dim, -1).T
  if path[-1] == 'o_proj':
    return ours.reshape(-1, cfg.embed_dim).T
  if path[-1] in ('q_bias', 'k_bias', 'v_bias'):
    return ours.reshape(-1)
  if path[-1] in ('gate_proj', 'up_proj', 'down_proj', 'lm_head', 'router', 'shared_gate_proj', 'shared_up_proj',
                  'shared_down_proj'):
    return ours.T
  return ours


def _var_path(path) -> tuple[str, ...]:
  return tuple(str(getattr(p, 'key', p)) for p in path)


def _spec(var: nnx.Variable, shape, mesh: Mesh, rules: Rules | None, name: str) -> PartitionSpec:
  if rules is None:
    return PartitionSpec()
  from sao_jax.parallel.sharding import logical_to_spec  # Same-level room; imported lazily.
  logical = var.get_metadata().get('out_sharding')
  return logical_to_spec(tuple(logical) if logical else None, shape, mesh, rules, name=name)


# ---------------------------------------------------------------------------------------------------------
# Load / save.


def read_hf_config(hf_dir: str) -> dict[str, Any]:
  path = os.path.join(hf_dir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{hf_dir!r} has no config.json (not an HF checkpoint directory).')
  with open(path) as f:
    return json.load(f)


def load_hf(hf_dir: str, *, dtype: str = 'float32', mesh: Mesh | None = None, rules: Rules | None = None,
            lora_seed: int = 0, **config_overrides) -> tuple[Decoder, ModelConfig]:
  """Loads an HF Llama / Qwen2 / Qwen3 checkpoint directory into a `Decoder`.

  Args:
    hf_dir: directory with config.json and *.safetensors.
    dtype: compute dtype of the returned model ('float32' or 'bfloat16').
    mesh: if given, every parameter is placed with `NamedSharding(mesh, spec)`, shard by shard.
    rules: logical-axis -> mesh-axis pairs (`config.mesh.rules`); None = replicated on `mesh`.
    lora_seed: the seed of fresh LoRA adapters' A (`lora.initial`), when the overrides ask for adapters.
    **config_overrides: extra `ModelConfig` fields (e.g. param_dtype='bfloat16': the weights are read as float32
      and stored in that dtype; remat='full', scan_layers=False; lora_rank, lora_targets: fresh adapters).

  Returns:
    (model, cfg).
  """
  cfg = ModelConfig.from_hf_config(read_hf_config(hf_dir), dtype=dtype, **config_overrides)
  files = sorted(glob.glob(os.path.join(hf_dir, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'{hf_dir!r} has no *.safetensors files.')
  reader = SafetensorsReader(files)
  mapping = _param_map(cfg)
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  devices = None if mesh is not None else jax.devices()[:1]

  lora_key = jax.random.key(lora_seed)

  def load(path, var):
    key = _var_path(path)
    adapter = lora.target_of(key)
    if adapter is not None:  # Not in the checkpoint: a fresh LoRA adapter (B = 0).
      value = np.asarray(lora.initial(cfg, adapter[0], lora_key)['ab'.index(adapter[1])])
      sharding = (jax.sharding.SingleDeviceSharding(devices[0]) if mesh is None
                  else NamedSharding(mesh, _spec(var, value.shape, mesh, rules, '/'.join(key))))
      return var.replace(jax.make_array_from_callback(value.shape, sharding, lambda index: value[index]))
    if key not in mapping:
      raise ValueError(f'No HF weight mapped to parameter {"/".join(key)}.')
    entry = mapping[key]
    transform = entry.transform
    sds = var.get_value()
    names = entry.names()
    for nm in names:
      if nm not in reader:
        raise ValueError(f'{hf_dir}: checkpoint lacks tensor {nm!r} (needed for {"/".join(key)}).')
    lead = ((len(entry.layers),) if entry.layers is not None else ()) + ((entry.experts,) if entry.experts else ())
    grid = np.arange(len(names)).reshape(lead) if lead else None  # Our leading (layer, expert) index -> name.

    def read(index) -> np.ndarray:
      if not lead:
        out = transform(reader.get(names[0]))[index]
      else:  # Only this shard's layers and experts are read, each sliced to the shard.
        picks = grid[index[:len(lead)]]
        out = np.stack([transform(reader.get(names[i]))[index[len(lead):]] for i in picks.reshape(-1)])
        out = out.reshape(picks.shape + out.shape[1:])
      return np.ascontiguousarray(out, dtype=sds.dtype)

    expected = tuple(sds.shape)
    first = transform(reader.get(names[0]))
    if tuple(lead + first.shape) != expected:
      raise ValueError(f'{hf_dir}: {names[0]} has shape {reader.get(names[0]).shape}, which does not fit '
                       f'{"/".join(key)} {expected} of this config.')
    if mesh is None:
      sharding = jax.sharding.SingleDeviceSharding(devices[0])
    else:
      sharding = NamedSharding(mesh, _spec(var, expected, mesh, rules, '/'.join(key)))
    return var.replace(jax.make_array_from_callback(expected, sharding, read))

  state = jax.tree_util.tree_map_with_path(load, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  unused = set(reader.keys()) - {name for entry in mapping.values() for name in entry.names()}
  unused -= {'lm_head.weight'}  # Tied checkpoints may still store it.
  if unused:
    logging.warning('load_hf(%s): %d checkpoint tensors unused, e.g. %s', hf_dir, len(unused), sorted(unused)[:3])
  return nnx.merge(graphdef, state), cfg


def hf_state_dict(model: Decoder, cfg: ModelConfig | None = None) -> dict[str, np.ndarray]:
  """The model's weights as an HF-named dict of float32 numpy arrays (gathered to host; bfloat16 parameters
  widen exactly); LoRA adapters merged into their weights (`Decoder.merged`)."""
  model = model.merged()
  cfg = (cfg or model.cfg).without_lora()
  mapping = _param_map(cfg)
  out = {}
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, RouterBias))):
    key = _var_path(path)
    if key not in mapping:
      raise ValueError(f'Parameter {"/".join(key)} has no HF name.')
    entry = mapping[key]
    value = np.asarray(jax.device_get(var.get_value()), dtype=np.float32)
    lead = ((len(entry.layers),) if entry.layers is not None else ()) + ((entry.experts,) if entry.experts else ())
    for name, one in zip(entry.names(), value.reshape((-1,) + value.shape[len(lead):])):
      out[name] = np.ascontiguousarray(_to_hf(one, key, cfg))
  return out


PEFT_MODULES = {t: ('self_attn.' if t in lora.ATTENTION_TARGETS else 'mlp.') + t for t in lora.TARGETS}


def save_peft_adapter(model: Decoder, out_dir: str, base_model: str = '') -> None:
  """Writes `model`'s LoRA adapters as a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that
  `peft.PeftModel.from_pretrained(<the base in transformers>, out_dir)` loads.

  PEFT's delta of a projection is (alpha / r) lora_B.weight @ lora_A.weight on HF's `[out, in]` weight, so with
  ours, s A B on `[*in, *out]`: lora_A.weight = A^T `[r, in]`, lora_B.weight = B^T `[out, r]` (flattened). `base_model`:
  what the config names as the base (e.g. its HF directory).

  Raises:
    ValueError: the model has no adapters.
  """
  from safetensors.numpy import save_file
  cfg = model.cfg
  if not cfg.lora_rank:
    raise ValueError('save_peft_adapter: the model has no LoRA adapters (ModelConfig.lora_rank is 0).')
  flat = {tuple(str(k) for k in path): np.asarray(jax.device_get(var.get_value()), np.float32)
          for path, var in nnx.to_flat_state(nnx.state(model, lora.ADAPTERS))}
  shapes = lora.shapes(cfg)
  tensors = {}
  for target in cfg.lora_targets:
    in_shape, _, out_shape, _ = shapes[target]
    a, b = (flat[('layers', lora.HOLDER[target], lora.suffix(target), x)] for x in 'ab')
    for i in range(cfg.num_layers):
      name = f'base_model.model.model.layers.{i}.{PEFT_MODULES[target]}'
      tensors[f'{name}.lora_A.weight'] = np.ascontiguousarray(a[i].reshape(int(np.prod(in_shape)), -1).T)
      tensors[f'{name}.lora_B.weight'] = np.ascontiguousarray(b[i].reshape(cfg.lora_rank, -1).T)
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'adapter_config.json'), 'w') as f:
    json.dump({'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'base_model_name_or_path': base_model,
               'r': cfg.lora_rank, 'lora_alpha': cfg.lora_alpha, 'lora_dropout': 0.0, 'bias': 'none',
               'target_modules': list(cfg.lora_targets), 'fan_in_fan_out': False, 'use_rslora': False,
               'inference_mode': True, 'modules_to_save': None}, f, indent=2)
  save_file(tensors, os.path.join(out_dir, 'adapter_model.safetensors'), metadata={'format': 'pt'})


def save_hf(model: Decoder, cfg: ModelConfig | None, out_dir: str, tokenizer_dir: str | None = None) -> None:
  """Writes config.json, model.safetensors (float32 whatever `cfg.param_dtype`; config.json says torch_dtype
  float32; LoRA adapters merged) and the tokenizer files of `tokenizer_dir` to `out_dir`."""
  from safetensors.numpy import save_file
  cfg = (cfg or model.cfg).without_lora()
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(cfg.to_hf_config(), f, indent=2)
  save_file(hf_state_dict(model, cfg), os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
  if tokenizer_dir:
    copied = 0
    for name in TOKENIZER_FILES:
      src = os.path.join(tokenizer_dir, name)
      if os.path.exists(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
        shutil.copy(src, os.path.join(out_dir, name))
        copied += 1
    if not copied:
      logging.warning('save_hf: no tokenizer files found in %s', tokenizer_dir)
