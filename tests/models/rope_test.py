"""RoPE scalings (linear, yarn, dynamic; sao_jax.models.layers.rope_inv_freq): parity with transformers on tiny random
Llama / Qwen3 models, the frequencies against numpy written from the formulas, config conversion and refusal."""

import math
import tempfile

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx

from sao_jax.checkpoint import manager
from sao_jax.models import hf_io, layers
from sao_jax.models.config import ModelConfig
from tests.models import hf_io_test  # Its setUpModule: torch and transformers.
from tests.models import hf_reference

torch = None
transformers = None


def setUpModule():
  global torch, transformers
  hf_io_test.setUpModule()  # Heavy imports (torch, transformers): only when this module's tests run.
  torch, transformers = hf_io_test.torch, hf_io_test.transformers


_VOCAB = 128
_ORIG = 256  # Small enough that the test sequences (300 tokens) run past it, large enough for YaRN's ramp to span
# several of the 8 (llama) / 12 (qwen3) frequencies (d(beta_fast) ~ 0.3-0.4, d(beta_slow) ~ 5-6.5).
_SCALINGS = {
    'linear': {'rope_type': 'linear', 'factor': 4.0},
    'yarn': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': _ORIG},
    'yarn_attention_factor': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': _ORIG,
                              'attention_factor': 1.3, 'beta_fast': 16.0, 'beta_slow': 2.0},
    'yarn_mscale': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': _ORIG,
                    'mscale': 1.0, 'mscale_all_dim': 0.5, 'truncate': False},
    'dynamic': {'rope_type': 'dynamic', 'factor': 4.0},
    'llama3': {'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': _ORIG},
}
_MODELS = {'llama': ('LlamaConfig', dict(rope_theta=500.0)),
           'qwen3': ('Qwen3Config', dict(head_dim=24, rope_theta=1000.0))}


def _hf_model(family: str, scaling: str):
  """A tiny random HF model with one RoPE scaling (norms and weights randomised), saved: (model, dir).

  Weights of std 0.1: with hidden size 64 and 300 tokens, 0.15 makes the Llama softmax sharp enough that float32
  rounding alone (plain RoPE too) reaches 1.4e-4 on the logits.
  """
  cls_name, extra = _MODELS[family]
  cfg = getattr(transformers, cls_name)(
      vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=96, max_position_embeddings=4 * _ORIG, bos_token_id=1, eos_token_id=None, pad_token_id=0,
      tie_word_embeddings=True, rope_scaling=dict(_SCALINGS[scaling]), **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.2 * torch.randn_like(p) if 'norm' in name else 0.1 * torch.randn_like(p))
  out_dir = tempfile.mkdtemp(prefix=f'rope_{family}_{scaling}_')
  model.save_pretrained(out_dir)
  return model, out_dir


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def _np_default(theta, h):
  return 1.0 / theta ** (np.arange(0, h, 2) / h)


def _np_yarn(theta, h, rs, max_position):
  """YaRN from the paper's formulas in float64 (interpolate f/s below the ramp, keep f above it)."""
  f = _np_default(theta, h)
  s, orig = rs.get('factor') or max_position / rs['original_max_position_embeddings'], \
      rs['original_max_position_embeddings']
  dim = lambda r: h * math.log(orig / (r * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
  lo, hi = dim(rs.get('beta_fast', 32)), dim(rs.get('beta_slow', 1))
  if rs.get('truncate', True):
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, h - 1)
  ramp = np.clip((np.arange(h // 2) - lo) / (hi - lo), 0, 1)
  inv = f / s * ramp + f * (1 - ramp)
  if rs.get('attention_factor') is not None:
    a = rs['attention_factor']
  elif rs.get('mscale') and rs.get('mscale_all_dim'):
    a = (0.1 * rs['mscale'] * math.log(s) + 1) / (0.1 * rs['mscale_all_dim'] * math.log(s) + 1)
  else:
    a = 0.1 * math.log(s) + 1
  return inv, a


def _cfg(rs, head_dim=32, theta=500.0, max_position=4 * _ORIG):
  return ModelConfig(vocab_size=8, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim,
                     mlp_dim=8, rope_theta=theta, rope_scaling=rs, max_position=max_position)


class RopeParityTest(parameterized.TestCase):

  @parameterized.named_parameters((f'{f}_{s}', f, s) for f in _MODELS for s in _SCALINGS)
  def test_logits_match_transformers(self, family, scaling):
    hf, path = _hf_model(family, scaling)
    model, cfg = hf_io.load_hf(path)
    self.assertEqual(cfg.rope_scaling['rope_type'], scaling.split('_')[0])
    # 300 tokens: past the original context (256) for yarn / linear / llama3; within max_position_embeddings (1024)
    # for dynamic.
    tokens = np.random.RandomState(1).randint(3, _VOCAB, (2, 300)).astype(np.int32)
    with torch.no_grad():
      ref = hf(torch.tensor(tokens, dtype=torch.int64)).logits.numpy()
    ours = np.asarray(_forward(model, jnp.asarray(tokens)))
    err = np.abs(ours - ref).max()
    print(f'rope parity {family} {scaling}: max |logit diff| = {err:.2e}')
    self.assertLessEqual(err, 1e-4)
    self.assertGreater(np.abs(ref).max(), 1.0)  # Non-trivial logits.
    # The frequencies HF used, and its cos/sin scale, equal ours.
    rotary = hf.model.rotary_emb
    np.testing.assert_allclose(layers.rope_inv_freq(cfg).inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    self.assertAlmostEqual(layers.rope_inv_freq(cfg).attention_factor, rotary.attention_scaling, places=6)
    if scaling == 'yarn':  # The cached forward (prefill + decode steps past the original context) as HF generate.
      prompt = tokens[:, :260]
      with torch.no_grad():
        gen = hf.generate(torch.tensor(prompt, dtype=torch.int64), attention_mask=torch.ones(prompt.shape, dtype=int),
                          max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()[:, 260:]
      ours_greedy = hf_reference.greedy(model, jnp.asarray(prompt), 6)
      np.testing.assert_array_equal(ours_greedy, gen)
    # The checkpoint's JSON round trip keeps the scaling.
    self.assertEqual(manager.model_config_from_json(manager.model_config_to_json(cfg)), cfg)

  def test_dynamic_static_formula_matches_transformers_past_max_position(self):
    # HF recomputes the dynamic frequencies for a call whose sequence exceeds max_position_embeddings (1024);
    # `rope_inv_freq(cfg, seq_len=T)` is that computation (the forward pass itself stays unscaled).
    hf, path = _hf_model('llama', 'dynamic')
    _, cfg = hf_io.load_hf(path)
    base = layers.rope_inv_freq(cfg).inv_freq
    np.testing.assert_array_equal(base, layers.rope_inv_freq(cfg.replace(rope_scaling=None)).inv_freq)
    with torch.no_grad():
      hf(torch.zeros((1, 1100), dtype=torch.int64))
      scaled = hf.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(layers.rope_inv_freq(cfg, seq_len=1100).inv_freq, scaled, rtol=1e-6)
    self.assertTrue(np.all(scaled[1:] < base[1:]))


class RopeFormulaTest(parameterized.TestCase):

  def test_linear(self):
    rs = {'rope_type': 'linear', 'factor': 8.0}
    freqs = layers.rope_inv_freq(_cfg(rs))
    np.testing.assert_allclose(freqs.inv_freq, _np_default(500.0, 32) / 8.0, rtol=1e-6)
    self.assertEqual(freqs.attention_factor, 1.0)

  @parameterized.named_parameters((k, k) for k in _SCALINGS if k.startswith('yarn'))
  def test_yarn_and_tables(self, name):
    rs = dict(_SCALINGS[name])
    freqs = layers.rope_inv_freq(_cfg(rs))
    inv, a = _np_yarn(500.0, 32, rs, 4 * _ORIG)
    np.testing.assert_allclose(freqs.inv_freq, inv, rtol=1e-6)
    self.assertAlmostEqual(freqs.attention_factor, a, places=12)
    self.assertNotEqual(a, 1.0)
    # Tables: a cos(p f), a sin(p f) (float32 angles up to 300: ~3e-5 rounding).
    pos = np.arange(300)[None]
    cos, sin = layers.rope_tables(jnp.asarray(pos), freqs)
    np.testing.assert_allclose(np.asarray(cos)[0], a * np.cos(pos[0, :, None] * inv), atol=6e-5)
    np.testing.assert_allclose(np.asarray(sin)[0], a * np.sin(pos[0, :, None] * inv), atol=6e-5)

  def test_yarn_factor_none_uses_max_position_ratio(self):
    rs = {'rope_type': 'yarn', 'factor': None, 'original_max_position_embeddings': 16}
    inv, a = _np_yarn(500.0, 32, rs, 128)
    freqs = layers.rope_inv_freq(_cfg(rs, max_position=128))
    np.testing.assert_allclose(freqs.inv_freq, inv, rtol=1e-6)
    self.assertAlmostEqual(freqs.attention_factor, 0.1 * math.log(8.0) + 1, places=12)

  def test_dynamic_is_unscaled_up_to_max_position_then_ntk(self):
    rs = {'rope_type': 'dynamic', 'factor': 2.0}
    cfg = _cfg(rs, max_position=64)
    plain = _np_default(500.0, 32)
    for seq_len in (None, 10, 64):
      np.testing.assert_allclose(layers.rope_inv_freq(cfg, seq_len=seq_len).inv_freq, plain, rtol=1e-6)
    theta = 500.0 * (2.0 * 256 / 64 - 1.0) ** (32 / 30)
    np.testing.assert_allclose(layers.rope_inv_freq(cfg, seq_len=256).inv_freq, _np_default(theta, 32), rtol=1e-6)


class RopeConfigTest(absltest.TestCase):

  def _hf(self, **rope):
    return dict(model_type='qwen3', vocab_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, intermediate_size=8, max_position_embeddings=40960, **rope)

  def test_both_hf_forms_and_round_trip(self):
    yarn = {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 32768}
    old = ModelConfig.from_hf_config(self._hf(rope_theta=1e6, rope_scaling=dict(yarn)))
    new = ModelConfig.from_hf_config(self._hf(rope_parameters=dict(yarn, rope_theta=1e6)))
    self.assertEqual(old, new)
    self.assertEqual(old.rope_scaling, yarn)
    self.assertEqual(old.rope_theta, 1e6)
    self.assertEqual(ModelConfig.from_hf_config(old.to_hf_config()), old)
    self.assertEqual(manager.model_config_from_json(manager.model_config_to_json(old)), old)
    # Old-style `type` key, and yarn's original context defaulting to max_position_embeddings (as HF).
    lin = ModelConfig.from_hf_config(self._hf(rope_scaling={'type': 'linear', 'factor': 2.0}))
    self.assertEqual(lin.rope_scaling, {'type': 'linear', 'factor': 2.0})
    y = ModelConfig.from_hf_config(self._hf(rope_parameters={'rope_type': 'yarn', 'factor': 2.0, 'rope_theta': 1e4}))
    self.assertEqual(y.rope_scaling['original_max_position_embeddings'], 40960)

  def test_unknown_or_incomplete_scaling_refused(self):
    with self.assertRaisesRegex(ValueError, "'longrope'"):
      ModelConfig.from_hf_config(self._hf(rope_scaling={'rope_type': 'longrope', 'factor': 2.0}))
    with self.assertRaisesRegex(ValueError, "'su'"):
      _cfg({'type': 'su', 'factor': 2.0})
    with self.assertRaisesRegex(ValueError, r"lacks \['factor'\]"):
      _cfg({'rope_type': 'linear'})


if __name__ == '__main__':
  absltest.main()
