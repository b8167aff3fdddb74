"""Math shared by the plain forward (`llama`) and the cached forward (`decode`): RMSNorm, RoPE, positions.

One definition each, so that the two forward passes compute the same function (tests compare them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.config import ModelConfig

Array = jax.Array


def rms_norm(x: Array, scale: Array, eps: float, axis: int = -1) -> Array:
  """x / sqrt(mean(x^2, axis) + eps) * scale, computed in float32 and cast back (HF casting order)."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axis, keepdims=True) + eps)
  return y.astype(x.dtype) * scale.astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies theta^(-2i/H), i < H/2, with optional Llama-3 scaling (float32, as HF)."""
  h = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))))
  inv = inv.astype(np.float32)
  rs = cfg.rope_scaling
  if rs is not None:  # Llama 3: long wavelengths divided by `factor`, smooth ramp in between.
    factor = float(rs['factor'])
    low, high = float(rs['low_freq_factor']), float(rs['high_freq_factor'])
    old_ctx = float(rs['original_max_position_embeddings'])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * np.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv = np.where(medium, smoothed, inv_l).astype(np.float32)
  return inv


def rope_tables(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
  """cos, sin of angle[b, t, i] = positions[b, t] * inv_freq[i]: float32 [B, T, H/2]."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates halves of x [B, T, n, H]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (HF rotate_half)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def default_positions(attention_mask: Array | None, batch: int, length: int,
                      offset: Array | None = None) -> Array:
  """Positions of a chunk: `offset[b] + cumsum(mask[b]) - 1` (clipped at offset), or `offset + arange`."""
  if attention_mask is None:
    pos = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  else:
    pos = jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)
  if offset is not None:
    pos = pos + offset[:, None]
  return pos
