"""Llama-family decoder (dense and mixture-of-experts), value model, log-prob helpers and HF weight io (Flax NNX).

- `config`: `ModelConfig`, `get_model_config(name, **overrides)` (tiny, bench-25m, smollm2-135m, qwen2.5-0.5b,
  qwen3-0.6b, llama3.2-1b, ..., the MoE qwen3-30b-a3b and glm-4.5-air), HF config.json conversion.
- `moe`: the mixture-of-experts MLP as pure functions (router, dropless / capacity experts, `MoeAux` statistics).
- `llama`: `Decoder(cfg, rngs=...)` -> logits / hidden states; with a cache, prefill, decode and continuation.
- `decode`: the cached forward pass (`DecodeCache`, `decode_weights`, `forward`), run by the Decoder and the sampler.
- `logprobs`: `token_logprobs(model, tokens, ...)` (DESIGN alignment, chunked over positions).
- `value`: `ValueModel` (backbone + zero scalar head), `ValueModel.from_policy`, `CRITIC_ATTENTION`.
- `build`: `build(config.model, mesh=, rules=, seed=) -> (model, model_config)`, named config or HF weights.
- `hf_io`: `load_hf(dir, dtype=, mesh=, rules=)`, `save_hf(model, cfg, dir, tokenizer_dir=)`.
"""

from sao_jax.models.build import build
from sao_jax.models.config import MODEL_NAMES, ModelConfig, get_model_config
from sao_jax.models.decode import DecodeCache
from sao_jax.models.llama import Decoder
from sao_jax.models.logprobs import token_logprobs, token_logprobs_from_logits
from sao_jax.models.value import CRITIC_ATTENTION, ValueModel
