"""MoE parity with HF transformers (torch CPU): Qwen3MoeForCausalLM and Glm4MoeForCausalLM on tiny random configs,
saved by transformers, loaded by our `hf_io.load_hf`: logits, 32 greedy tokens through our KV cache, export."""

import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from configs import base
from sao_jax import parallel
from sao_jax.models import hf_io
from tests.models import hf_reference

torch = None
transformers = None


def setUpModule():
  global torch, transformers
  torch, transformers = hf_reference.import_hf()


_VOCAB = 96
_COMMON = dict(vocab_size=_VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               intermediate_size=48, moe_intermediate_size=16, num_experts_per_tok=3, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
_KINDS = {
    # Softmax router, renormalised top-3 of 8, every layer MoE.
    'qwen3_moe': ('Qwen3MoeConfig', dict(num_hidden_layers=2, num_experts=8, norm_topk_prob=True)),
    # Sigmoid router with a correction bias, top-3 of 8 in the best 2 of 4 groups, routed scaling 2.5, a shared
    # expert of twice the expert width, the first layer dense, qkv bias, q/k norm and half-rotary RoPE.
    'glm4_moe': ('Glm4MoeConfig', dict(
        num_hidden_layers=3, n_routed_experts=8, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        num_nextn_predict_layers=0)),
}
_CACHE = {}


def _hf_model(kind: str):
  """A tiny random HF MoE (every weight, norm and bias randomised; the router's weights large enough that the
  choices are far from ties) saved to a temp dir: (model, dir)."""
  if kind in _CACHE:
    return _CACHE[kind]
  cls_name, extra = _KINDS[kind]
  cfg = getattr(transformers, cls_name)(**_COMMON, **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
      if 'e_score_correction_bias' in name:
        p.copy_(0.3 * torch.randn_like(p))  # Moves the choice: larger than most score gaps.
      elif 'mlp.gate.weight' in name:
        p.copy_(0.6 * torch.randn_like(p))
      elif 'norm' in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif p.dtype == torch.float32 and 'inv_freq' not in name:
        p.copy_(0.15 * torch.randn_like(p))
  out_dir = tempfile.mkdtemp(prefix=f'hf_{kind}_')
  model.save_pretrained(out_dir)
  _CACHE[kind] = (model, out_dir)
  return model, out_dir


class MoeHFParityTest(parameterized.TestCase):

  @parameterized.named_parameters((k, k) for k in _KINDS)
  def test_logits_greedy_and_export(self, kind):
    """Catches any router difference (a top-k left unnormalised, the correction bias in the weights, a missing group
    mask or scaling), expert or layout error (a transposed expert, a shared expert dropped) and a cached decode that
    differs from the forward."""
    hf, path = _hf_model(kind)
    model, cfg = hf_io.load_hf(path)
    self.assertEqual((cfg.num_experts, cfg.num_experts_per_tok), (8, 3))
    if kind == 'glm4_moe':
      self.assertEqual((cfg.router_scoring, cfg.router_bias, cfg.moe_groups, cfg.moe_topk_groups,
                        cfg.num_shared_experts, cfg.first_k_dense, cfg.partial_rotary_factor),
                       ('sigmoid', True, 4, 2, 2, 1, 0.5))
      bias = np.asarray(model.moe_layers.moe.router_bias.get_value())
      self.assertGreater(np.abs(bias).min(), 0.0)

    # Logits of a right-padded batch (rows of 20 and 9 tokens) match on the real tokens.
    rng = np.random.RandomState(1)
    tokens = rng.randint(3, _VOCAB, (2, 20)).astype(np.int32)
    mask = np.arange(20)[None] < np.array([[20], [9]])
    ref = hf_reference.hf_logits(hf, tokens, mask)
    ours = np.asarray(hf_reference.forward(model, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[0], ref[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[1, :9], ref[1, :9], atol=1e-4, rtol=0)
    self.assertGreater(np.abs(ref).max(), 1.0)  # Non-trivial logits.

    # Greedy decoding through our KV cache (decode.forward's MoE layers) equals HF generate for 32 tokens.
    prompt = rng.randint(3, _VOCAB, (2, 6)).astype(np.int32)
    with torch.no_grad():
      gen = hf.generate(torch.tensor(prompt, dtype=torch.int64), attention_mask=torch.ones(2, 6, dtype=torch.int64),
                        max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0).numpy()[:, 6:]
    np.testing.assert_array_equal(hf_reference.greedy(model, jnp.asarray(prompt), 32), gen)

    # Export, reload in transformers: same architecture, same logits.
    out_dir = tempfile.mkdtemp(prefix=f'export_{kind}_')
    hf_io.save_hf(model, cfg, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    self.assertEqual(type(reloaded).__name__, type(hf).__name__)
    np.testing.assert_allclose(hf_reference.hf_logits(reloaded, tokens[:1]), ours[:1], atol=1e-4, rtol=0)

  def test_sharded_load_reads_each_expert_once(self):
    """Loaded onto an expert axis of 4 devices (rules ('expert', 'expert')), each device reads its own 2 of the 8
    experts' tensors: every expert tensor is read once (plus one shape check per parameter), not once per device;
    the values equal the single-device load."""
    _, path = _hf_model('qwen3_moe')
    rules = tuple(r for r in base.get_config().mesh.rules if r[0] != 'expert') + (('expert', 'expert'),)
    mesh = jax.make_mesh((1, 1, 4, 1), parallel.MOE_MESH_AXES, devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 4)
    reads = []
    get = hf_io.SafetensorsReader.get

    def counting_get(reader, name):
      reads.append(name)
      return get(reader, name)

    with mock.patch.object(hf_io.SafetensorsReader, 'get', counting_get):
      sharded, cfg = hf_io.load_hf(path, mesh=mesh, rules=rules)
    expert_reads = [n for n in reads if '.experts.' in n]
    self.assertEqual(len(expert_reads), cfg.num_moe_layers * 8 * 3 + 3)  # + the shape check of each of the 3.
    gate = sharded.moe_layers.moe.gate_proj.get_value()
    self.assertEqual(gate.sharding.spec[1], 'expert')
    single, _ = hf_io.load_hf(path)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(single.moe_layers.moe.gate_proj.get_value()))


if __name__ == '__main__':
  absltest.main()
