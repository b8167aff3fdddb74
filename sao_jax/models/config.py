"""Model configurations of the Llama-family decoder (Llama 3.x, SmolLM2, Qwen2/2.5, Qwen3) and its mixture-of-experts
variants (Qwen3-MoE, GLM-4.5 / GLM-4.5-Air: `num_experts > 0`, `sao_jax.models.moe`).

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
# Router scoring of an MoE layer (`sao_jax.models.moe.route`): 'softmax' (Qwen3-MoE, Mixtral) or 'sigmoid'
# (GLM-4.5, DeepSeek-V3: optional correction bias, grouped top-k).
ROUTER_SCORINGS = ('softmax', 'sigmoid')
# How an MoE layer computes its experts (`sao_jax.models.moe`): 'dropless' sorts the token-expert pairs by expert and
# runs grouped matmuls (`jax.lax.ragged_dot`), no token dropped; 'capacity' gives each expert a buffer of
# ceil(capacity_factor * M * k / E) slots (the pairs past it are dropped: their expert output is 0).
MOE_IMPLS = ('dropless', 'capacity')
# The grouped matmul of 'dropless' (`sao_jax.models.moe.grouped_matmul`): 'ragged_dot' (`jax.lax.ragged_dot`, TPU /
# GPU), 'tiles' (a scan over (expert, row tile) visits: the CPU form; XLA:CPU runs ragged_dot as E dense products) or
# 'auto' (tiles on a CPU, ragged_dot elsewhere, by the backend a program is traced for).
MOE_MATMULS = ('auto', 'ragged_dot', 'tiles')


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
    partial_rotary_factor: Share of head_dim that RoPE rotates (GLM-4.5: 0.5): the first
      `rotary_dim = int(head_dim * partial_rotary_factor)` (even) dims of each head, the rest pass unrotated.
    num_experts: Routed experts E of each MoE layer; 0 = a dense model (every MoE field below is then unused).
    num_experts_per_tok: Experts k each token is routed to (top-k; HF `num_experts_per_tok`), 1 <= k <= E.
    moe_mlp_dim: Hidden width F_e of one expert's SwiGLU MLP (HF `moe_intermediate_size`); `mlp_dim` stays the
      width of the dense layers' MLP.
    router_scoring: 'softmax' (p = softmax(x W_r): Qwen3-MoE) or 'sigmoid' (s = sigmoid(x W_r): GLM-4.5 /
      DeepSeek-V3), `ROUTER_SCORINGS`.
    norm_topk_prob: Renormalise the k chosen weights to sum to 1 (HF `norm_topk_prob`).
    router_bias: Sigmoid routers only: a per-expert correction bias b (HF `e_score_correction_bias`) added to the
      scores for the choice of experts only, never to the weights; a state variable, not trained by gradient.
    moe_groups: Expert groups G of grouped top-k (HF `n_group`; E % G == 0): each token first keeps the
      `moe_topk_groups` groups whose two best (biased) scores sum highest, then picks its k experts among them.
      1 = plain top-k.
    moe_topk_groups: Groups kept per token (HF `topk_group`), 1 <= moe_topk_groups <= moe_groups.
    routed_scaling_factor: Multiplies the routed experts' weights after the renormalisation (HF
      `routed_scaling_factor`; 1.0 = none).
    num_shared_experts: Width multiple of the always-on shared expert MLP (HF `n_shared_experts`): one SwiGLU of
      hidden width num_shared_experts * moe_mlp_dim added to every MoE layer's output; 0 = none.
    first_k_dense: The first `first_k_dense` layers are dense (HF `first_k_dense_replace`); the other
      num_layers - first_k_dense are MoE layers. The two kinds are separate stacks (`layers`, `moe_layers`).
    moe_impl: How experts are computed (`MOE_IMPLS`): 'dropless' (sorted grouped matmuls) or 'capacity'.
    capacity_factor: moe_impl='capacity' only: expert buffers of ceil(capacity_factor * M * k / E) slots.
    moe_matmul: moe_impl='dropless' only: its grouped matmul (`MOE_MATMULS`): 'auto', 'ragged_dot' or 'tiles'.
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
  partial_rotary_factor: float = 1.0
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_mlp_dim: int = 0
  router_scoring: str = 'softmax'
  norm_topk_prob: bool = True
  router_bias: bool = False
  moe_groups: int = 1
  moe_topk_groups: int = 1
  routed_scaling_factor: float = 1.0
  num_shared_experts: int = 0
  first_k_dense: int = 0
  moe_impl: str = 'dropless'
  capacity_factor: float = 1.25
  moe_matmul: str = 'auto'
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
    rot = self.head_dim * self.partial_rotary_factor
    if not 0 < self.partial_rotary_factor <= 1 or rot != int(rot) or int(rot) % 2:
      raise ValueError(f'ModelConfig.partial_rotary_factor={self.partial_rotary_factor!r}: must be in (0, 1] with '
                       f'head_dim * partial_rotary_factor an even int (head_dim={self.head_dim}).')
    self._check_moe()

  def _check_moe(self):
    """Validates the MoE fields (class docstring); each error names its field."""
    def bad(field, why):
      raise ValueError(f'ModelConfig.{field}={getattr(self, field)!r}: {why}')

    if not isinstance(self.num_experts, int) or self.num_experts < 0:
      bad('num_experts', 'must be an int >= 0 (0 = dense).')
    if not self.num_experts:
      return
    e = self.num_experts
    if not isinstance(self.num_experts_per_tok, int) or not 1 <= self.num_experts_per_tok <= e:
      bad('num_experts_per_tok', f'must be an int in [1, num_experts={e}].')
    if not isinstance(self.moe_mlp_dim, int) or self.moe_mlp_dim <= 0:
      bad('moe_mlp_dim', 'must be a positive int (the expert MLP width) when num_experts > 0.')
    if self.router_scoring not in ROUTER_SCORINGS:
      bad('router_scoring', f'must be one of {ROUTER_SCORINGS}.')
    if self.router_bias and self.router_scoring != 'sigmoid':
      bad('router_bias', "a correction bias needs router_scoring='sigmoid'.")
    if not isinstance(self.moe_groups, int) or self.moe_groups < 1 or e % self.moe_groups:
      bad('moe_groups', f'must be an int >= 1 dividing num_experts={e}.')
    if self.moe_groups > 1 and e // self.moe_groups < 2:
      bad('moe_groups', 'grouped top-k scores a group by its two best experts: needs >= 2 experts a group.')
    if not isinstance(self.moe_topk_groups, int) or not 1 <= self.moe_topk_groups <= self.moe_groups:
      bad('moe_topk_groups', f'must be an int in [1, moe_groups={self.moe_groups}].')
    if self.num_experts_per_tok > self.moe_topk_groups * (e // self.moe_groups):
      bad('num_experts_per_tok', 'exceeds the experts of the kept groups (moe_topk_groups * num_experts / moe_groups).')
    if not self.routed_scaling_factor > 0:
      bad('routed_scaling_factor', 'must be > 0.')
    if not isinstance(self.num_shared_experts, int) or self.num_shared_experts < 0:
      bad('num_shared_experts', 'must be an int >= 0.')
    if not isinstance(self.first_k_dense, int) or not 0 <= self.first_k_dense < self.num_layers:
      bad('first_k_dense', f'must be an int in [0, num_layers={self.num_layers}) (at least one MoE layer).')
    if self.moe_impl not in MOE_IMPLS:
      bad('moe_impl', f'must be one of {MOE_IMPLS}.')
    if not self.capacity_factor > 0:
      bad('capacity_factor', 'must be > 0.')
    if self.moe_matmul not in MOE_MATMULS:
      bad('moe_matmul', f'must be one of {MOE_MATMULS}.')
    if self.lora_rank:
      bad('lora_rank', 'LoRA adapters on an MoE model (num_experts > 0) are not supported yet.')

  @property
  def is_moe(self) -> bool:
    """Whether the model has MoE layers (`num_experts > 0`)."""
    return self.num_experts > 0

  @property
  def num_dense_layers(self) -> int:
    """Layers of the dense stack `layers`: all of them for a dense model, the first `first_k_dense` for an MoE."""
    return self.first_k_dense if self.is_moe else self.num_layers

  @property
  def num_moe_layers(self) -> int:
    """Layers of the MoE stack `moe_layers` (after the dense ones): num_layers - first_k_dense, 0 if dense."""
    return self.num_layers - self.first_k_dense if self.is_moe else 0

  @property
  def rotary_dim(self) -> int:
    """Dims of each head that RoPE rotates: head_dim * partial_rotary_factor."""
    return int(self.head_dim * self.partial_rotary_factor)

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
    """Number of parameters (the input embedding table counted once, also when tied; an MoE router's correction bias,
    a `RouterBias` variable, not counted: what `llama.count_params` counts)."""
    d, h = self.embed_dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += h * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * h
    block = attn + 3 * d * self.mlp_dim + 2 * d
    total = self.num_dense_layers * block + d
    if self.is_moe:
      moe = attn + 2 * d + d * self.num_experts + 3 * d * self.moe_mlp_dim * (self.num_experts
                                                                             + self.num_shared_experts)
      total += self.num_moe_layers * moe  # The router's correction bias is state, not a parameter.
    if include_embedding:
      total += self.vocab_size * d
    if not self.tie_embeddings:
      total += self.vocab_size * d
    return total

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) as in the PaLM appendix.

    `6 * N_matmul + 12 * L * N_heads * H * T_eff`, where N_matmul counts the weights used in matrix
    multiplies (every block weight and the lm head, not the embedding lookup; of an MoE layer the router, the
    k active experts and the shared one) and the attention term counts QK^T and AV over a causal context
    (T_eff = seq_len / 2 on average).
    """
    d, h = self.embed_dim, self.head_dim
    attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2)
    n_matmul = self.num_dense_layers * (attn + 3 * d * self.mlp_dim)
    n_matmul += self.num_moe_layers * (attn + d * self.num_experts + 3 * d * self.moe_mlp_dim * (
        self.num_experts_per_tok + self.num_shared_experts))
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
    if model_type not in ('llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'glm4_moe'):
      raise ValueError(f'config.json model_type={model_type!r} is not a supported Llama-family model '
                       '(llama, qwen2, qwen3, mistral, qwen3_moe, glm4_moe).')
    if hf.get('hidden_act', 'silu') != 'silu':
      raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported.")
    if hf.get('mlp_bias', False):
      raise ValueError('config.json mlp_bias=true is not supported.')
    if model_type not in ('qwen2', 'glm4_moe') and hf.get('attention_bias', False):
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
      if rope_scaling is not None:
        rope_scaling.pop('partial_rotary_factor', None)  # A field of the config (below), not of the scaling.
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
        qk_norm=model_type in ('qwen3', 'qwen3_moe'),
        bos_id=hf.get('bos_token_id'),
        eos_ids=eos_ids,
        pad_id=int(pad),
        max_position=int(hf.get('max_position_embeddings', 8192)),
        name=hf.get('_name_or_path', '') or model_type,
    )
    partial = hf.get('partial_rotary_factor', rope_params.get('partial_rotary_factor',
                                                             (hf.get('rope_scaling') or {}).get('partial_rotary_factor',
                                                                                                1.0)))
    if partial is None and model_type == 'glm4_moe':
      partial = 0.5  # HF Glm4MoeConfig's default.
    kwargs['partial_rotary_factor'] = float(1.0 if partial is None else partial)
    if model_type in ('qwen3_moe', 'glm4_moe'):
      kwargs.update(_moe_from_hf(hf, model_type))
    kwargs.update(overrides)
    return cls(**kwargs)

  @property
  def hf_model_type(self) -> str:
    """The HF architecture that represents this config: qwen3 (q/k norm), qwen2 (qkv bias) or llama; an MoE model
    glm4_moe (sigmoid router) or qwen3_moe (softmax router)."""
    if self.is_moe:
      return 'glm4_moe' if self.router_scoring == 'sigmoid' else 'qwen3_moe'
    if self.partial_rotary_factor != 1.0:
      raise ValueError('Only glm4_moe among the HF architectures here has partial_rotary_factor < 1.')
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
    arch = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM', 'qwen3': 'Qwen3ForCausalLM',
            'qwen3_moe': 'Qwen3MoeForCausalLM', 'glm4_moe': 'Glm4MoeForCausalLM'}[model_type]
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
    if model_type == 'qwen3_moe':
      if (self.qkv_bias or not self.qk_norm or self.router_bias or self.moe_groups > 1 or self.num_shared_experts
          or self.first_k_dense or self.routed_scaling_factor != 1.0):
        raise ValueError('A softmax-routed MoE is written as qwen3_moe, which has q/k norm and no qkv bias, router '
                         'bias, groups, shared experts, dense leading layers or routed scaling.')
      out.update(attention_bias=False, num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_mlp_dim, norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                 mlp_only_layers=[], use_sliding_window=False, sliding_window=None)
    if model_type == 'glm4_moe':
      if not self.router_bias:
        raise ValueError('glm4_moe always has a router correction bias (router_bias=True).')
      out.update(attention_bias=self.qkv_bias, use_qk_norm=self.qk_norm, n_routed_experts=self.num_experts,
                 num_experts_per_tok=self.num_experts_per_tok, moe_intermediate_size=self.moe_mlp_dim,
                 norm_topk_prob=self.norm_topk_prob, n_group=self.moe_groups, topk_group=self.moe_topk_groups,
                 routed_scaling_factor=self.routed_scaling_factor, n_shared_experts=self.num_shared_experts,
                 first_k_dense_replace=self.first_k_dense, partial_rotary_factor=self.partial_rotary_factor,
                 num_nextn_predict_layers=0)
    return out


def _moe_from_hf(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """The MoE fields of `ModelConfig` from a qwen3_moe or glm4_moe `config.json` (refusing what is not implemented,
  naming the HF field)."""
  if model_type == 'qwen3_moe':
    if int(hf.get('decoder_sparse_step', 1)) != 1:
      raise ValueError(f"config.json decoder_sparse_step={hf['decoder_sparse_step']}: only 1 (every layer MoE).")
    if hf.get('mlp_only_layers'):
      raise ValueError(f"config.json mlp_only_layers={hf['mlp_only_layers']}: dense layers between MoE layers are "
                       'not supported (only leading ones).')
    return dict(num_experts=int(hf.get('num_experts', hf.get('num_local_experts'))),
                num_experts_per_tok=int(hf['num_experts_per_tok']), moe_mlp_dim=int(hf['moe_intermediate_size']),
                router_scoring='softmax', norm_topk_prob=bool(hf.get('norm_topk_prob', False)))
  return dict(num_experts=int(hf.get('n_routed_experts', hf.get('num_local_experts'))),
              num_experts_per_tok=int(hf['num_experts_per_tok']), moe_mlp_dim=int(hf['moe_intermediate_size']),
              router_scoring='sigmoid', router_bias=True, norm_topk_prob=bool(hf.get('norm_topk_prob', True)),
              moe_groups=int(hf.get('n_group') or 1), moe_topk_groups=int(hf.get('topk_group') or 1),
              routed_scaling_factor=float(hf.get('routed_scaling_factor', 1.0)),
              num_shared_experts=int(hf.get('n_shared_experts') or 0),
              first_k_dense=int(hf.get('first_k_dense_replace', 0)),
              qkv_bias=bool(hf.get('attention_bias', False)), qk_norm=bool(hf.get('use_qk_norm', False)))


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
    # Mixture-of-experts shapes (config.json of Qwen/Qwen3-30B-A3B and zai-org/GLM-4.5-Air, written from memory:
    # see docs/design.md's MoE section for the fields not checked against the files). 30.5B / 106B parameters.
    'qwen3-30b-a3b': dict(vocab_size=151936, embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                          mlp_dim=6144, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False, qk_norm=True,
                          num_experts=128, num_experts_per_tok=8, moe_mlp_dim=768, router_scoring='softmax',
                          norm_topk_prob=True, bos_id=151643, eos_ids=(151645, 151643), pad_id=151643,
                          max_position=40960),
    'glm-4.5-air': dict(vocab_size=151552, embed_dim=4096, num_layers=46, num_heads=96, num_kv_heads=8, head_dim=128,
                        mlp_dim=10944, rope_theta=1_000_000.0, norm_eps=1e-5, tie_embeddings=False, qkv_bias=True,
                        qk_norm=False, partial_rotary_factor=0.5, num_experts=128, num_experts_per_tok=8,
                        moe_mlp_dim=1408, router_scoring='sigmoid', router_bias=True, norm_topk_prob=True,
                        moe_groups=1, moe_topk_groups=1, routed_scaling_factor=1.0, num_shared_experts=1,
                        first_k_dense=1, bos_id=None, eos_ids=(151329, 151336, 151338), pad_id=151329,
                        max_position=131072),
}

MODEL_NAMES = tuple(_NAMED)


def get_model_config(name: str, **overrides) -> ModelConfig:
  """Returns the named config ('tiny', 'demo', 'bench-25m', 'smollm2-135m', 'qwen2.5-0.5b', 'qwen3-0.6b',
  'llama3.2-1b', 'qwen3-8b', 'qwen3-32b', and the MoE 'qwen3-30b-a3b', 'glm-4.5-air') with `overrides` applied (e.g.
  dtype='bfloat16', remat='full')."""
  if name not in _NAMED:
    raise ValueError(f'Unknown model config {name!r}; known: {", ".join(MODEL_NAMES)}.')
  kwargs = dict(_NAMED[name], name=name)
  kwargs.update(overrides)
  return ModelConfig(**kwargs)
