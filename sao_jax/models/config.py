"""Model configurations of the Llama-family decoder (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3).

`ModelConfig` is a frozen, hashable dataclass (it can be a static argument of `jax.jit`). Named configs are
returned by `get_model_config(name, **overrides)`; `ModelConfig.from_hf_config` / `.to_hf_config` convert
to and from a Hugging Face `config.json` dictionary.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

DTYPES = ('float32', 'bfloat16')  # Compute and parameter storage dtypes.
_ROPE_SCALING_TYPES = ('linear', 'dynamic', 'yarn', 'llama3')  # Formulas: `sao_jax.models.layers.rope_inv_freq`.
_ROPE_SCALING_REQUIRED = {  # Keys each type needs (yarn's factor may be None: max_position / original).
    'linear': ('factor',), 'dynamic': ('factor',), 'yarn': ('original_max_position_embeddings',),
    'llama3': ('factor', 'low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'),
}
# Rematerialisation of each decoder block in the backward pass, named after `jax.checkpoint_policies` (what the
# forward pass keeps for the backward; the rest is recomputed): 'none' keeps everything (no remat); 'full' keeps
# nothing but the block's input (`nothing_saveable`: least memory, one more forward pass of every block);
# 'dots_saveable' keeps every matmul output (the elementwise ops, norms and softmax are recomputed);
# 'dots_with_no_batch_dims_saveable' keeps the weight matmuls' outputs (projections, MLP) and recomputes the
# attention scores and softmax (the batched matmuls: the T x T memory).
REMAT_POLICIES = ('none', 'full', 'dots_saveable', 'dots_with_no_batch_dims_saveable')
# Attention of the plain (uncached) forward pass (`sao_jax.models.attention`): 'reference' dense masked scores (a
# [chunk, T] block per query chunk, T x T kept for the backward), 'flash' blocks with an online softmax and a
# recomputing backward (pure JAX, any backend, no T x T), 'splash' the Pallas TPU kernel; 'auto' is splash for a
# TPU program, flash elsewhere.
ATTENTION_IMPLS = ('auto', 'reference', 'flash', 'splash')
# The projections a LoRA adapter can target (HF PEFT's module names; `sao_jax.models.lora`).
LORA_ATTENTION_TARGETS = ('q_proj', 'k_proj', 'v_proj', 'o_proj')
LORA_TARGETS = LORA_ATTENTION_TARGETS + ('gate_proj', 'up_proj', 'down_proj')


def remat_policy(value: Any) -> str:
  """A remat setting as a policy name of `REMAT_POLICIES`: a name as is; the old bool, True -> 'full', False ->
  'none' (configs and checkpoints from before the policies).

  Raises:
    ValueError: any other value.
  """
  if isinstance(value, bool):
    return 'full' if value else 'none'
  if isinstance(value, str) and value in REMAT_POLICIES:
    return value
  raise ValueError(f'remat={value!r} is not one of {list(REMAT_POLICIES)} (or True = full, False = none).')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a Llama-family decoder.

  Attributes:
    vocab_size: Number of token embeddings (rows of the embedding table).
    embed_dim: Width D of the residual stream.
    num_layers: Number of decoder blocks L.
    num_heads: Query heads N.
    num_kv_heads: Key/value heads K (grouped-query attention; N % K == 0).
    head_dim: Width H of one attention head (need not equal D / N, e.g. Qwen3).
    mlp_dim: Hidden width F of the SwiGLU MLP.
    rope_theta: RoPE base frequency.
    rope_scaling: None, or an HF `rope_scaling` dict with `rope_type` (or the old key `type`) one of 'linear'
      (factor), 'dynamic' (factor; computed statically: no change up to max_position), 'yarn'
      (original_max_position_embeddings, factor; optional attention_factor, beta_fast, beta_slow, mscale,
      mscale_all_dim, truncate) or 'llama3' (factor, low_freq_factor, high_freq_factor,
      original_max_position_embeddings). Formulas: `sao_jax.models.layers.rope_inv_freq`.
    norm_eps: Epsilon of every RMSNorm.
    tie_embeddings: The lm head reuses the embedding table (logits = h @ E^T).
    qkv_bias: q/k/v projections have biases (Qwen2/2.5).
    qk_norm: RMSNorm over head_dim on queries and keys before RoPE (Qwen3).
    dtype: Compute dtype, 'float32' or 'bfloat16' (params stay in `param_dtype`).
    param_dtype: Storage dtype of parameters, 'float32' or 'bfloat16' (also of their gradients; the optimizer's
      math is float32: `sao_jax.learner.optim`).
    bos_id: Beginning-of-sequence token id (or None).
    eos_ids: Token ids that end generation.
    pad_id: Padding token id.
    remat: Rematerialisation policy of each decoder block in the backward pass (`REMAT_POLICIES`; saves
      activation memory). The old bools are accepted and stored as names: True -> 'full', False -> 'none'.
    scan_layers: Run the stacked blocks with `lax.scan` (fast compiles) instead of an unrolled loop.
    attention_chunk: Query block of causal attention without a cache (blocks above the diagonal are
      skipped): with 'reference' attention, 0 = one full [T, T] block, at most 16 blocks (the block grows with T);
      with 'flash', the block of queries and of keys (0 = `attention.FLASH_BLOCK`); splash picks its own.
    attention_impl: Attention without a cache (`ATTENTION_IMPLS`; the same values, different memory and speed):
      'auto' (splash on TPU, flash elsewhere), 'reference', 'flash' or 'splash' (TPU only).
    lora_rank: Rank r of the LoRA adapters (`sao_jax.models.lora`); 0 = none (full fine-tuning).
    lora_alpha: LoRA's alpha: an adapter adds (alpha / r) x A B.
    lora_targets: The projections that get an adapter (names of `LORA_TARGETS`).
    max_position: Longest position the model is meant for (HF `max_position_embeddings`): informative, except as
      the reference length of 'dynamic' RoPE scaling and the default factor of 'yarn' (`rope_inv_freq`).
    name: Name of the config (informative).
  """
  vocab_size: int
  embed_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 10_000.0
  rope_scaling: Mapping[str, Any] | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  qkv_bias: bool = False
  qk_norm: bool = False
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  bos_id: int | None = None
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0
  remat: str = 'none'
  scan_layers: bool = True
  attention_chunk: int = 64
  attention_impl: str = 'auto'
  lora_rank: int = 0
  lora_alpha: float = 32.0
  lora_targets: tuple[str, ...] = ()
  max_position: int = 8192
  name: str = ''

  def __post_init__(self):
    for field in ('vocab_size', 'embed_dim', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim', 'mlp_dim'):
      value = getattr(self, field)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f'ModelConfig.{field} must be a positive int, got {value!r}.')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'ModelConfig.num_heads ({self.num_heads}) must be a multiple of '
                       f'num_kv_heads ({self.num_kv_heads}).')
    if not isinstance(self.attention_chunk, int) or self.attention_chunk < 0:
      raise ValueError(f'ModelConfig.attention_chunk must be an int >= 0, got {self.attention_chunk!r}.')
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f'ModelConfig.attention_impl must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}.')
    if self.head_dim % 2:
      raise ValueError(f'ModelConfig.head_dim must be even for RoPE, got {self.head_dim}.')
    if self.dtype not in DTYPES:
      raise ValueError(f'ModelConfig.dtype must be one of {DTYPES}, got {self.dtype!r}.')
    if self.param_dtype not in DTYPES:
      raise ValueError(f'ModelConfig.param_dtype must be one of {DTYPES}, got {self.param_dtype!r}.')
    try:
      object.__setattr__(self, 'remat', remat_policy(self.remat))
    except ValueError as e:
      raise ValueError(f'ModelConfig.{e}') from e
    if self.rope_scaling is not None:
      kind = self.rope_scaling.get('rope_type', self.rope_scaling.get('type'))
      if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(f'ModelConfig.rope_scaling type {kind!r} is not supported (only {_ROPE_SCALING_TYPES}).')
      missing = [k for k in _ROPE_SCALING_REQUIRED[kind] if k not in self.rope_scaling]
      if missing:
        raise ValueError(f'ModelConfig.rope_scaling of type {kind!r} lacks {missing}.')
      # Store a plain dict copy (immutability by convention; hashing uses the sorted items).
      object.__setattr__(self, 'rope_scaling', dict(self.rope_scaling))
    object.__setattr__(self, 'eos_ids', tuple(int(i) for i in self.eos_ids))
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f'ModelConfig.lora_rank must be an int >= 0, got {self.lora_rank!r}.')
    object.__setattr__(self, 'lora_targets', tuple(self.lora_targets))
    if self.lora_rank:
      if (not self.lora_targets or len(set(self.lora_targets)) != len(self.lora_targets)
          or not set(self.lora_targets) <= set(LORA_TARGETS)):
        raise ValueError(f'ModelConfig.lora_targets={self.lora_targets!r}: expected distinct names among '
                         f'{LORA_TARGETS}.')
      if not self.lora_alpha > 0:
        raise ValueError(f'ModelConfig.lora_alpha must be > 0, got {self.lora_alpha!r}.')

  @property
  def lora_scale(self) -> float:
    """s = lora_alpha / lora_rank, what an adapter's product is multiplied by (0 without LoRA)."""
    return float(self.lora_alpha) / self.lora_rank if self.lora_rank else 0.0

  def has_adapter(self, target: str) -> bool:
    """Whether projection `target` (e.g. 'q_proj') carries a LoRA adapter."""
    return bool(self.lora_rank) and target in self.lora_targets

  def without_lora(self) -> ModelConfig:
    """The base model's config (no adapters): what a merged model, an export and the sampler run."""
    if not self.lora_rank:
      return self
    return self.replace(lora_rank=0, lora_targets=(), lora_alpha=type(self).__dataclass_fields__['lora_alpha'].default)

  def __hash__(self):
    # Computed once per instance: a jitted program hashes its static arguments at every call, and the continuous
    # sampler's are called per decode chunk (~0.1 ms a call otherwise: docs/benchmarks/rollout.md).
    cached = self.__dict__.get('_hash')
    if cached is None:
      values = []
      for f in dataclasses.fields(self):
        v = getattr(self, f.name)
        if isinstance(v, Mapping):
          v = tuple(sorted(v.items()))
        values.append(v)
      cached = hash(tuple(values))
      object.__setattr__(self, '_hash', cached)
    return cached

  def __getstate__(self):
    # Not the cached hash: string hashes differ between processes.
    return {k: v for k, v in self.__dict__.items() if k != '_hash'}

  def replace(self, **overrides) -> ModelConfig:
    """Returns a copy with some fields replaced (validated again)."""
    return dataclasses.replace(self, **overrides)

  @property
  def num_groups(self) -> int:
    """Query heads per key/value head, G = N / K."""
    return self.num_heads // self.num_kv_heads

  def num_params(self, *, include_embedding: bool = True) -> int:
    """Number of parameters (the input embedding table counted once, also when tied)."""
    d, h = self.embed_dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * h
    block = attn + 3 * d * self.mlp_dim + 2 * d
    total = self.num_layers * block + d
    if include_embedding:
      total += self.vocab_size * d
    if not self.tie_embeddings:
      total += self.vocab_size * d
    return total

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) as in the PaLM appendix.

    `6 * N_matmul + 12 * L * N_heads * H * T_eff`, where N_matmul counts the weights used in matrix
    multiplies (every block weight and the lm head, not the embedding lookup) and the attention term
    counts QK^T and AV over a causal context (T_eff = seq_len / 2 on average).
    """
    d, h = self.embed_dim, self.head_dim
    n_matmul = self.num_layers * (d * h * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * self.mlp_dim)
    n_matmul += self.vocab_size * d
    attn = 12 * self.num_layers * self.num_heads * h * seq_len / 2
    return 6.0 * n_matmul + attn

  # ---- Hugging Face config.json conversion.

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> ModelConfig:
    """Builds a config from an HF `config.json` dict (model_type llama, qwen2, qwen3, or a Llama-like one).

    Raises:
      ValueError: naming the HF field when the checkpoint uses a feature this decoder does not implement.
    """
    model_type = hf.get('model_type', 'llama')
    if model_type not in ('llama', 'qwen2', 'qwen3', 'mistral'):
      raise ValueError(f'config.json model_type={model_type!r} is not a supported Llama-family model '
                       '(llama, qwen2, qwen3, mistral).')
    if hf.get('hidden_act', 'silu') != 'silu':
      raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported.")
    if hf.get('mlp_bias', False):
      raise ValueError('config.json mlp_bias=true is not supported.')
    if model_type != 'qwen2' and hf.get('attention_bias', False):
      raise ValueError('config.json attention_bias=true (bias on q/k/v/o) is not supported for '
                       f'model_type={model_type!r}.')
    if hf.get('use_sliding_window', False):
      raise ValueError('config.json use_sliding_window=true is not supported.')
    if model_type == 'mistral' and hf.get('sliding_window') is not None:
      raise ValueError('config.json sliding_window is not supported.')
    rope_params = dict(hf.get('rope_parameters') or {})
    rope_scaling = hf.get('rope_scaling') or None
    rope_theta = hf.get('rope_theta', rope_params.get('rope_theta', 10_000.0))
    if rope_scaling is None and rope_params.get('rope_type', 'default') != 'default':
      rope_scaling = {k: v for k, v in rope_params.items() if k != 'rope_theta'}
    if rope_scaling is not None:
      rope_scaling = {k: v for k, v in dict(rope_scaling).items() if k != 'rope_theta'}
      kind = rope_scaling.get('rope_type', rope_scaling.get('type', 'default'))
      if kind == 'default':
        rope_scaling = None
      elif kind not in _ROPE_SCALING_TYPES:
        raise ValueError(f'config.json rope scaling type {kind!r} is not supported (only {_ROPE_SCALING_TYPES}).')
      elif kind == 'yarn':  # As HF: the original context defaults to max_position_embeddings.
        rope_scaling.setdefault('original_max_position_embeddings', int(hf.get('max_position_embeddings', 8192)))
      if rope_scaling is not None and rope_scaling.get('partial_rotary_factor', 1.0) != 1.0:
        raise ValueError(f"config.json partial_rotary_factor={rope_scaling['partial_rotary_factor']} is not supported.")
    num_heads = int(hf['num_attention_heads'])
    embed_dim = int(hf['hidden_size'])
    eos = hf.get('eos_token_id')
    eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    pad = hf.get('pad_token_id')
    if pad is None:
      pad = eos_ids[0] if eos_ids else 0
    kwargs = dict(
        vocab_size=int(hf['vocab_size']),
        embed_dim=embed_dim,
        num_layers=int(hf['num_hidden_layers']),
        num_heads=num_heads,
        num_kv_heads=int(hf.get('num_key_value_heads') or num_heads),
        head_dim=int(hf.get('head_dim') or embed_dim // num_heads),
        mlp_dim=int(hf['intermediate_size']),
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
        tie_embeddings=bool(hf.get('tie_word_embeddings', False)),
        qkv_bias=model_type == 'qwen2',
        qk_norm=model_type == 'qwen3',
        bos_id=hf.get('bos_token_id'),
        eos_ids=eos_ids,
        pad_id=int(pad),
        max_position=int(hf.get('max_position_embeddings', 8192)),
        name=hf.get('_name_or_path', '') or model_type,
    )
    kwargs.update(overrides)
    return cls(**kwargs)

  @property
  def hf_model_type(self) -> str:
    """The HF architecture that represents this config: qwen3 (q/k norm), qwen2 (qkv bias) or llama."""
    if self.qk_norm and self.qkv_bias:
      raise ValueError('No HF architecture has both qk_norm and qkv_bias.')
    if self.qk_norm:
      return 'qwen3'
    if self.qkv_bias:
      return 'qwen2'
    return 'llama'

  def to_hf_config(self) -> dict[str, Any]:
    """Returns an HF `config.json` dict (LlamaForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM)."""
    model_type = self.hf_model_type
    arch = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM'}[model_type]
    out = {
        'architectures': [arch],
        'model_type': model_type,
        'vocab_size': self.vocab_size,
        'hidden_size': self.embed_dim,
        'num_hidden_layers': self.num_layers,
        'num_attention_heads': self.num_heads,
        'num_key_value_heads': self.num_kv_heads,
        'head_dim': self.head_dim,
        'intermediate_size': self.mlp_dim,
        'hidden_act': 'silu',
        'rope_theta': self.rope_theta,
        'rope_scaling': dict(self.rope_scaling) if self.rope_scaling else None,
        'rms_norm_eps': self.norm_eps,
        'tie_word_embeddings': self.tie_embeddings,
        'max_position_embeddings': self.max_position,
        'bos_token_id': self.bos_id,
        'eos_token_id': (list(self.eos_ids) if len(self.eos_ids) > 1 else
                         (self.eos_ids[0] if self.eos_ids else None)),
        'pad_token_id': self.pad_id,
        'torch_dtype': 'float32',
        'use_cache': True,
    }
    if model_type == 'llama':
      out.update(attention_bias=False, mlp_bias=False)
    if model_type == 'qwen3':
      out.update(attention_bias=False)
    if model_type in ('qwen2', 'qwen3'):
      out.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
    return out


_NAMED: dict[str, dict[str, Any]] = {
    # Tests and synthetic tasks (vocab large enough for the char tokenizer).
    'tiny': dict(vocab_size=512, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 mlp_dim=128, rope_theta=10_000.0, norm_eps=1e-5, tie_embeddings=True, bos_id=1,
                 eos_ids=(2,), pad_id=0),
    # The CPU demo (configs/arith.py): the char tokenizer's vocabulary (111 tokens) and its ids.
    'demo': dict(vocab_size=128, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16,
                 mlp_dim=256, rope_theta=10_000.0, norm_eps=1e-5, tie_embeddings=True, bos_id=2, eos_ids=(1,),
                 pad_id=0, max_position=256),
    # ~26M parameters: the train-step throughput / MFU benchmark.
    'bench-25m': dict(vocab_size=8192, embed_dim=512, num_layers=7, num_heads=8, num_kv_heads=4, head_dim=64,
                      mlp_dim=1536, rope_theta=10_000.0, norm_eps=1e-5, tie_embeddings=True, bos_id=1,
                      eos_ids=(2,), pad_id=0),
    # HuggingFaceTB/SmolLM2-135M-Instruct.
    'smollm2-135m': dict(vocab_size=49152, embed_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         head_dim=64, mlp_dim=1536, rope_theta=100_000.0, norm_eps=1e-5, tie_embeddings=True,
                         bos_id=1, eos_ids=(2,), pad_id=2, max_position=8192),
    # Qwen/Qwen2.5-0.5B-Instruct.
    'qwen2.5-0.5b': dict(vocab_size=151936, embed_dim=896, num_layers=24, num_heads=14, num_kv_heads=2,
                         head_dim=64, mlp_dim=4864, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True,
                         qkv_bias=True, bos_id=151643, eos_ids=(151645, 151643), pad_id=151643,
                         max_position=32768),
    # Qwen/Qwen3-0.6B.
    'qwen3-0.6b': dict(vocab_size=151936, embed_dim=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                       head_dim=128, mlp_dim=3072, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=True,
                       qk_norm=True, bos_id=151643, eos_ids=(151645, 151643), pad_id=151643,
                       max_position=40960),
    # meta-llama/Llama-3.2-1B-Instruct.
    'llama3.2-1b': dict(vocab_size=128256, embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                        head_dim=64, mlp_dim=8192, rope_theta=500_000.0, norm_eps=1e-5, tie_embeddings=True,
                        rope_scaling={'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0,
                                      'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192},
                        bos_id=128000, eos_ids=(128001, 128008, 128009), pad_id=128004, max_position=131072),
    # Shapes for planning (`sao_jax.tools.aot`; weights come from `config.model.hf_dir`): Qwen/Qwen3-8B, Qwen3-32B.
    'qwen3-8b': dict(vocab_size=151936, embed_dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                     mlp_dim=12288, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
                     bos_id=151643, eos_ids=(151645, 151643), pad_id=151643, max_position=40960),
    'qwen3-32b': dict(vocab_size=151936, embed_dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                      mlp_dim=25600, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
                      bos_id=151643, eos_ids=(151645, 151643), pad_id=151643, max_position=40960),
}

MODEL_NAMES = tuple(_NAMED)


def get_model_config(name: str, **overrides) -> ModelConfig:
  """Returns the named config ('tiny', 'demo', 'bench-25m', 'smollm2-135m', 'qwen2.5-0.5b', 'qwen3-0.6b',
  'llama3.2-1b', 'qwen3-8b', 'qwen3-32b') with `overrides` applied (e.g. dtype='bfloat16', remat='full')."""
  if name not in _NAMED:
    raise ValueError(f'Unknown model config {name!r}; known: {", ".join(MODEL_NAMES)}.')
  kwargs = dict(_NAMED[name], name=name)
  kwargs.update(overrides)
  return ModelConfig(**kwargs)
