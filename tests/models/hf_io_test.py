"""Reference tests against HF transformers (torch CPU): load, logits, greedy generation, export, sharded load."""

import copy
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized
from flax import nnx
from jax.sharding import PartitionSpec as P

from sao_jax.models import hf_io
from sao_jax.models import lora
from tests.models import hf_reference

torch = None
transformers = None


def setUpModule():
  global torch, transformers
  torch, transformers = hf_reference.import_hf()


_VOCAB = 96
_KINDS = {
    # Llama 3 rope scaling with a tiny original context so positions 0..20 cross every branch.
    'llama_tied_rope_scaling': ('LlamaConfig', dict(
        tie_word_embeddings=True, rope_theta=500.0,
        rope_scaling={'rope_type': 'llama3', 'factor': 4.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                      'original_max_position_embeddings': 16})),
    'qwen2_bias': ('Qwen2Config', dict(tie_word_embeddings=True, rope_theta=10_000.0)),
    'qwen3_qknorm_untied': ('Qwen3Config', dict(tie_word_embeddings=False, head_dim=24, rope_theta=1e6)),
}
_CACHE = {}


def _hf_model(kind: str):
  """A tiny random HF model (all weights, norms and biases randomised) saved to a temp dir: (model, dir)."""
  if kind in _CACHE:
    return _CACHE[kind]
  cls_name, extra = _KINDS[kind]
  cfg = getattr(transformers, cls_name)(
      vocab_size=_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      intermediate_size=96, max_position_embeddings=128, bos_token_id=1, eos_token_id=None, pad_token_id=0,
      **extra)
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  out_dir = tempfile.mkdtemp(prefix=f'hf_{kind}_')
  model.save_pretrained(out_dir)
  _CACHE[kind] = (model, out_dir)
  return model, out_dir


class HFReferenceTest(parameterized.TestCase):

  @parameterized.named_parameters((k, k) for k in _KINDS)
  def test_logits_greedy_and_export(self, kind):
    hf, path = _hf_model(kind)
    model, cfg = hf_io.load_hf(path)
    self.assertEqual(cfg.qkv_bias, kind.startswith('qwen2'))
    self.assertEqual(cfg.qk_norm, kind.startswith('qwen3'))
    self.assertEqual(cfg.tie_embeddings, 'untied' not in kind)
    self.assertEqual(cfg.rope_scaling is not None, 'rope_scaling' in kind)

    # Logits of a right-padded batch (rows of 20 and 9 tokens) match on the real tokens.
    rng = np.random.RandomState(1)
    tokens = rng.randint(3, _VOCAB, (2, 20)).astype(np.int32)
    mask = np.arange(20)[None] < np.array([[20], [9]])
    ref = hf_reference.hf_logits(hf, tokens, mask)
    ours = np.asarray(hf_reference.forward(model, jnp.asarray(tokens), jnp.asarray(mask)))
    np.testing.assert_allclose(ours[0], ref[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[1, :9], ref[1, :9], atol=1e-4, rtol=0)
    self.assertGreater(np.abs(ref).max(), 1.0)  # Non-trivial logits.

    # Greedy decoding through our KV cache equals HF generate token for token.
    prompt = rng.randint(3, _VOCAB, (2, 6)).astype(np.int32)
    with torch.no_grad():
      gen = hf.generate(torch.tensor(prompt, dtype=torch.int64), attention_mask=torch.ones(2, 6, dtype=torch.int64),
                        max_new_tokens=12, do_sample=False, pad_token_id=0).numpy()[:, 6:]
    np.testing.assert_array_equal(hf_reference.greedy(model, jnp.asarray(prompt), 12), gen)

    # Export, reload in transformers: same logits.
    out_dir = tempfile.mkdtemp(prefix=f'export_{kind}_')
    hf_io.save_hf(model, cfg, out_dir)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    self.assertEqual(type(reloaded).__name__, type(hf).__name__)
    np.testing.assert_allclose(hf_reference.hf_logits(reloaded, tokens[:1]), ours[:1], atol=1e-4, rtol=0)

  def test_lora_adapters_in_peft_and_merged_exports(self):
    """A LoRA model (adapters on every projection, B drawn non-zero) written both ways: as a PEFT adapter directory
    over the base HF directory (`peft.PeftModel`, transformers' own forward) and merged into a plain HF directory;
    both give our adapter forward's logits. A transposed A or B, a wrong module name or scale, turns it red."""
    import peft  # pylint: disable=g-import-not-at-top
    _, path = _hf_model('qwen3_qknorm_untied')
    model, cfg = hf_io.load_hf(path, lora_rank=3, lora_alpha=5.0, lora_targets=lora.TARGETS, lora_seed=1)
    for i, (p, var) in enumerate(nnx.to_flat_state(nnx.state(model, lora.ADAPTERS))):
      if p[-1] == 'b':
        var[...] = 0.3 * jax.random.normal(jax.random.key(i), var.shape)
    tokens = np.random.RandomState(2).randint(3, _VOCAB, (1, 16)).astype(np.int32)
    ours = np.asarray(model(jnp.asarray(tokens)))
    self.assertGreater(np.abs(ours - np.asarray(hf_io.load_hf(path)[0](jnp.asarray(tokens)))).max(), 0.1)
    adapter_dir = tempfile.mkdtemp(prefix='peft_')
    hf_io.save_peft_adapter(model, adapter_dir, base_model=path)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    np.testing.assert_allclose(hf_reference.hf_logits(with_adapter, tokens), ours, atol=1e-4, rtol=0)
    merged_dir = tempfile.mkdtemp(prefix='merged_')
    hf_io.save_hf(model, cfg, merged_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    np.testing.assert_allclose(hf_reference.hf_logits(merged, tokens), ours, atol=1e-4, rtol=0)

  def test_sharded_load_places_each_param_by_rules(self):
    _, path = _hf_model('qwen3_qknorm_untied')
    plain, _ = hf_io.load_hf(path)
    mesh = jax.make_mesh((4, 2), ('fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    rules = (('embed', 'fsdp'), ('vocab', 'tensor'), ('heads', 'tensor'), ('kv_heads', 'tensor'),
             ('mlp', 'tensor'), ('head_dim', None), ('layers', None), ('norm', None))
    sharded, _ = hf_io.load_hf(path, mesh=mesh, rules=rules)
    attn = sharded.layers.attn
    self.assertEqual(attn.q_proj.get_value().sharding.spec, P(None, 'fsdp', 'tensor', None))
    self.assertEqual(attn.o_proj.get_value().sharding.spec, P(None, 'tensor', None, 'fsdp'))
    self.assertEqual(sharded.lm_head.get_value().sharding.spec, P('fsdp', 'tensor'))
    self.assertEqual(sharded.embed.embedding.get_value().sharding.spec, P('tensor', 'fsdp'))
    shard_shapes = {s.data.shape for s in attn.q_proj.get_value().addressable_shards}
    self.assertEqual(shard_shapes, {(2, 16, 2, 24)})
    flat = lambda m: nnx.to_flat_state(nnx.state(m, nnx.Param))  # noqa: E731
    for (p, a), (_, b) in zip(flat(plain), flat(sharded)):
      np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))

  def test_bfloat16_checkpoint_and_bad_dirs(self):
    hf, _ = _hf_model('qwen2_bias')
    out_dir = tempfile.mkdtemp(prefix='hf_bf16_')
    hf = copy.deepcopy(hf).to(torch.bfloat16)  # A copy: the cached float32 reference stays untouched.
    hf.save_pretrained(out_dir)
    model, _ = hf_io.load_hf(out_dir)
    w = hf.model.layers[1].mlp.down_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.down_proj.get_value()[1]), w.T)
    with self.assertRaisesRegex(FileNotFoundError, 'config.json'):
      hf_io.load_hf(tempfile.mkdtemp())
    os.remove(os.path.join(out_dir, 'model.safetensors'))
    with self.assertRaisesRegex(FileNotFoundError, 'safetensors'):
      hf_io.load_hf(out_dir)


if __name__ == '__main__':
  absltest.main()
