"""Math shared by the plain forward (`llama`) and the cached forward (`decode`): RMSNorm, RoPE, positions, SwiGLU.

One definition each, so that the two forward passes compute the same function (tests compare them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

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


class RopeFrequencies(NamedTuple):
  """RoPE frequencies of a config: `inv_freq` float32 [H/2] and `attention_factor`, which multiplies cos and sin
  (1.0 except for YaRN; HF's `attention_scaling`)."""
  inv_freq: np.ndarray
  attention_factor: float = 1.0


def _base_inv_freq(theta: float, h: int) -> np.ndarray:
  """theta^(-2i/H), i < H/2, float32 as HF."""
  return (1.0 / (np.float32(theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h)))).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, seq_len: int | None = None) -> RopeFrequencies:
  """Inverse frequencies f_i (i < H/2) and attention factor a of `cfg`'s RoPE (float32 as HF transformers).

  With theta = rope_theta, H = head_dim and the unscaled f_i = theta^(-2i/H), by `rope_scaling['rope_type']`:
    None (default): f_i; a = 1.
    'linear': f_i / factor (positions divided by `factor`); a = 1.
    'llama3': wavelength w_i = 2 pi / f_i against L = original_max_position_embeddings: f_i / factor where
      w_i > L / low_freq_factor; f_i where w_i < L / high_freq_factor; in between (1 - s) f_i / factor + s f_i with
      s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor); a = 1.
    'yarn': with s = factor (if None: max_position / L), L = original_max_position_embeddings,
      beta_fast = 32 and beta_slow = 1 unless given (0 or None also means the default):
        d(r) = H ln(L / (2 pi r)) / (2 ln theta), the dimension that turns r times over L positions;
        lo = d(beta_fast), hi = d(beta_slow) (floor / ceil when `truncate`, default true); lo = max(lo, 0),
        hi = min(hi, H - 1) (hi += 0.001 if equal);
        ramp_i = clip((i - lo) / (hi - lo), 0, 1), i < H/2; e_i = 1 - ramp_i (the extrapolated share);
        f'_i = (f_i / s) (1 - e_i) + f_i e_i;
        a = attention_factor if given, else mscale(s, mscale) / mscale(s, mscale_all_dim) when both are given and
        non-zero, else mscale(s, 1); mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1. cos and sin are multiplied
        by a (so attention logits by a^2).
    'dynamic' (dynamic NTK), computed once, statically: with L0 = cfg.max_position (HF max_position_embeddings)
      and T = max(seq_len, L0) (seq_len None: T = L0),
        theta' = theta (factor T / L0 - (factor - 1))^(H / (H - 2)), f'_i = theta'^(-2i/H); a = 1.
      The model's forward passes call this without `seq_len`, so theta' = theta: the unscaled frequencies at
      every position. That equals HF whenever a forward pass's positions are all < max_position_embeddings.
      HF instead recomputes theta' at run time, with T = the largest position + 1 of each forward call, once it
      exceeds max_position_embeddings (and returns to f_i when a call is short again); this decoder does not
      (beyond L0 it extrapolates the unscaled frequencies). `seq_len=T` gives the frequencies HF would use for a
      call reaching length T.

  H is `cfg.rotary_dim` (= head_dim unless `partial_rotary_factor` < 1: then the rotated dims only).

  Args:
    cfg: the model config.
    seq_len: 'dynamic' only: the sequence length T to scale for (ignored by the other types).

  Returns:
    `RopeFrequencies(inv_freq float32 [H/2], attention_factor)`, what `rope_tables` takes.
  """
  h = cfg.rotary_dim  # head_dim, or its rotated share (partial_rotary_factor < 1: HF's `dim`).
  inv = _base_inv_freq(cfg.rope_theta, h)
  rs = cfg.rope_scaling
  if rs is None:
    return RopeFrequencies(inv)
  kind = rs.get('rope_type', rs.get('type'))
  if kind == 'linear':
    return RopeFrequencies((inv / np.float32(rs['factor'])).astype(np.float32))
  if kind == 'llama3':  # Long wavelengths divided by `factor`, smooth ramp in between.
    factor = float(rs['factor'])
    low, high = float(rs['low_freq_factor']), float(rs['high_freq_factor'])
    old_ctx = float(rs['original_max_position_embeddings'])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * np.pi / inv
    inv_l = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return RopeFrequencies(np.where(medium, smoothed, inv_l).astype(np.float32))
  if kind == 'dynamic':
    factor = float(rs['factor'])
    ref = float(cfg.max_position)
    length = max(float(seq_len), ref) if seq_len is not None else ref
    theta = cfg.rope_theta * (factor * length / ref - (factor - 1)) ** (h / (h - 2))
    return RopeFrequencies(_base_inv_freq(theta, h))
  if kind == 'yarn':
    old_ctx = float(rs['original_max_position_embeddings'])
    factor = rs.get('factor')
    factor = float(cfg.max_position) / old_ctx if factor is None else float(factor)

    def mscale(scale, m=1.0):
      return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rs.get('attention_factor')
    if attention_factor is None:
      m, m_all = rs.get('mscale'), rs.get('mscale_all_dim')
      attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get('beta_fast') or 32.0, rs.get('beta_slow') or 1.0
    theta = float(cfg.rope_theta)

    def dim_of(rotations):  # The dimension that turns `rotations` times over the original context.
      return h * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(beta_fast), dim_of(beta_slow)
    if rs.get('truncate', True):
      lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, h - 1)
    if lo == hi:
      hi += 0.001
    ramp = np.clip((np.arange(h // 2, dtype=np.float32) - np.float32(lo)) / np.float32(hi - lo), 0, 1)
    extrapolated = (1 - ramp).astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, h, 2, dtype=np.float32) / np.float32(h))  # 1 / f_i.
    inv_interp = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv = inv_interp * (1 - extrapolated) + (1.0 / pos_freqs).astype(np.float32) * extrapolated
    return RopeFrequencies(inv.astype(np.float32), float(attention_factor))
  raise ValueError(f'rope_scaling type {kind!r} is not supported.')


def rope_tables(positions: Array, freqs: RopeFrequencies | np.ndarray) -> tuple[Array, Array]:
  """a cos, a sin of angle[b, t, i] = positions[b, t] * inv_freq[i]: float32 [B, T, H/2].

  `freqs` is `rope_inv_freq(cfg)` (a = its attention_factor) or a bare inv_freq array (a = 1).
  """
  if isinstance(freqs, RopeFrequencies):
    inv_freq, factor = freqs.inv_freq, freqs.attention_factor
  else:
    inv_freq, factor = freqs, 1.0
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if factor != 1.0:
    cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
  return cos, sin


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
  """Rotates halves of x [B, T, n, H]: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) (HF rotate_half).

  With cos, sin [B, T, R/2] for R < H (partial rotary), the first R dims rotate that way and the other H - R pass
  through unchanged (HF's `q_rot`, `q_pass`)."""
  rot = 2 * cos.shape[-1]
  if rot < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)
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


@jax.custom_vjp
def swiglu(gate: Array, up: Array) -> Array:
  """silu(gate) * up, with a backward pass that reuses the forward's sigmoid.

  d up = g * silu(gate),  d gate = g * up * s * (1 + gate * (1 - s)),  s = sigmoid(gate).
  Saving s keeps exp out of the backward: XLA:CPU fuses the backward's elementwise math into the transposes
  that feed the weight-gradient matmuls, and with a sigmoid inside, that fusion costs ~10x the same transpose with
  multiplies only (docs/benchmarks/learner.md).
  """
  return jax.nn.silu(gate) * up


def _swiglu_fwd(gate: Array, up: Array):
  s = jax.nn.sigmoid(gate)
  return gate * s * up, (gate, up, s)


def _swiglu_bwd(res, g: Array):
  gate, up, s = res
  d_up = g * (gate * s)
  d_gate = g * up * (s * (1 + gate * (1 - s)))
  return d_gate, d_up


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
