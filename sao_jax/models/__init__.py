"""Llama-family decoder, value model, log-prob helpers and HF weight io (Flax NNX)."""

from sao_jax.models.config import ModelConfig, get_model_config, MODEL_NAMES
from sao_jax.models.llama import Decoder, KVCache
from sao_jax.models.logprobs import token_logprobs, token_logprobs_from_logits
from sao_jax.models.value import CRITIC_ATTENTION, ValueModel
