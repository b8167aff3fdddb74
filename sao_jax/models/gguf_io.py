"""Import of llama-architecture GGUF files (llama.cpp) into Hugging Face form.

`load_gguf(path)` reads a GGUF with the `gguf` package and returns a `GGUFCheckpoint`: an HF
`LlamaForCausalLM` config dict, float32 tensors under HF names, an HF `tokenizers.Tokenizer` rebuilt from
the GGUF vocabulary, merges and token types, the chat template and the special token ids.
`save_hf_dir(ckpt, out_dir)` writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json
and generation_config.json, a directory that `transformers` and `sao_jax.models.hf_io.load_hf` load.

Weights. Quantized tensors are dequantized with `gguf.quants.dequantize` (numpy layout `[out, in]`, the
HF `nn.Linear` layout). llama.cpp's converter permutes the rows of the q and k projections so that RoPE
rotates adjacent pairs (GPT-J style) instead of HF's two halves (NeoX style): for a projection with `h`
heads of size `d`, row `(head, j, half)` of HF (`half` in {0, 1}, `j < d/2`) is stored as row
`(head, 2j + half)`. `unpermute_qk` is the inverse, `permute_qk` the forward map (llama.cpp's `permute`).

Tokenizer. `tokenizer.ggml.model == "gpt2"` (byte-level BPE) is supported: the vocabulary is already
written in GPT-2's byte alphabet, merges are `"a b"` strings, token type 3 (control) becomes a special
added token and 4 (user defined) a plain added token. The pre-tokenizer follows `tokenizer.ggml.pre`;
for `smollm` it is SmolLM2's own (`Digits(individual_digits=True)` then byte-level GPT-2 splitting; the
SmolLM2 vocabulary has no multi-digit token, so on that file it agrees with `transformers`' GGUF loader,
which uses plain GPT-2 splitting for `smollm`).

Special ids. The end-of-turn token is the GGUF eos (for SmolLM2-Instruct `<|im_end|>` = 2). The GGUF pad
id equals eos in SmolLM2's file, which would make padding indistinguishable from a finished turn, so a pad
equal to eos is replaced by `<|endoftext|>` (id 0) when the vocabulary has it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np
from absl import logging

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNUSED, _TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Per-layer GGUF tensor name -> HF name (format with the layer index).
_LAYER_NAMES = {
    'attn_norm.weight': 'model.layers.{}.input_layernorm.weight',
    'ffn_norm.weight': 'model.layers.{}.post_attention_layernorm.weight',
    'attn_q.weight': 'model.layers.{}.self_attn.q_proj.weight',
    'attn_k.weight': 'model.layers.{}.self_attn.k_proj.weight',
    'attn_v.weight': 'model.layers.{}.self_attn.v_proj.weight',
    'attn_output.weight': 'model.layers.{}.self_attn.o_proj.weight',
    'attn_q.bias': 'model.layers.{}.self_attn.q_proj.bias',
    'attn_k.bias': 'model.layers.{}.self_attn.k_proj.bias',
    'attn_v.bias': 'model.layers.{}.self_attn.v_proj.bias',
    'ffn_gate.weight': 'model.layers.{}.mlp.gate_proj.weight',
    'ffn_up.weight': 'model.layers.{}.mlp.up_proj.weight',
    'ffn_down.weight': 'model.layers.{}.mlp.down_proj.weight',
}
_GLOBAL_NAMES = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
}
_LAYER_RE = re.compile(r'^blk\.(\d+)\.(.+)$')


@dataclasses.dataclass
class GGUFCheckpoint:
  """A GGUF file in HF form.

  Attributes:
    hf_config: config.json contents (LlamaForCausalLM).
    tensors: HF parameter name -> float32 array (q/k already un-permuted).
    tokenizer: the `tokenizers.Tokenizer` rebuilt from the GGUF vocabulary.
    chat_template: jinja2 source (the file's, else ChatML when the vocabulary has its tokens, else None).
    bos_id, eos_id, pad_id, unk_id: special ids (eos = end of an assistant turn).
    stop_ids: ids that end an assistant turn (eos first).
    metadata: the GGUF key/values except the large tokenizer arrays.
  """
  hf_config: dict[str, Any]
  tensors: dict[str, np.ndarray]
  tokenizer: Any
  chat_template: str | None
  bos_id: int | None
  eos_id: int
  pad_id: int
  unk_id: int | None
  stop_ids: tuple[int, ...]
  metadata: dict[str, Any]


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """llama.cpp's permutation of HF q/k projection rows (HF half-split RoPE -> interleaved RoPE).

  `w` is `[n_head * d, ...]` (weight or bias); HF row `(h, half, j)` moves to `(h, j, half)`.
  """
  if w.shape[0] % (2 * n_head):
    raise ValueError(f'cannot permute a q/k tensor of {w.shape[0]} rows into {n_head} heads of even size.')
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of `permute_qk`: GGUF q/k rows back to HF's layout (`unpermute_qk(permute_qk(w)) == w`)."""
  if w.shape[0] % (2 * n_head):
    raise ValueError(f'cannot un-permute a q/k tensor of {w.shape[0]} rows into {n_head} heads of even size.')
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader) -> dict[str, Any]:
  """GGUF key/values as Python values (all but tensor data; tokenizer arrays included)."""
  out = {}
  for key, field in reader.fields.items():
    if key.startswith('GGUF.'):
      continue
    out[key] = field.contents()
  return out


def _f32(x: Any) -> float:
  """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
  return float(str(np.float32(x)))


def _require(meta: Mapping[str, Any], key: str) -> Any:
  if key not in meta:
    raise ValueError(f'GGUF metadata lacks {key!r}, which a llama-architecture file must have.')
  return meta[key]


def hf_config_from_metadata(meta: Mapping[str, Any], *, tie_embeddings: bool, bos_id: int | None,
                            eos_ids: list[int], pad_id: int) -> dict[str, Any]:
  """config.json for `LlamaForCausalLM` from llama.cpp's `llama.*` keys."""
  arch = _require(meta, 'general.architecture')
  if arch != 'llama':
    raise ValueError(f'GGUF architecture {arch!r} is not supported (only "llama").')
  p = 'llama.'
  hidden = int(_require(meta, p + 'embedding_length'))
  heads = int(_require(meta, p + 'attention.head_count'))
  kv_heads = int(meta.get(p + 'attention.head_count_kv', heads))
  head_dim = int(meta.get(p + 'attention.key_length', hidden // heads))
  rope_dim = int(meta.get(p + 'rope.dimension_count', head_dim))
  if rope_dim != head_dim:
    raise ValueError(f'llama.rope.dimension_count={rope_dim} != head_dim={head_dim}: partial RoPE is not supported.')
  if p + 'rope.scaling.type' in meta and meta[p + 'rope.scaling.type'] not in ('none',):
    raise ValueError(f"llama.rope.scaling.type={meta[p + 'rope.scaling.type']!r} is not supported.")
  vocab = int(meta.get(p + 'vocab_size', len(_require(meta, 'tokenizer.ggml.tokens'))))
  theta = _f32(meta.get(p + 'rope.freq_base', 10000.0))
  return {
      'architectures': ['LlamaForCausalLM'],
      'model_type': 'llama',
      'vocab_size': vocab,
      'hidden_size': hidden,
      'intermediate_size': int(_require(meta, p + 'feed_forward_length')),
      'num_hidden_layers': int(_require(meta, p + 'block_count')),
      'num_attention_heads': heads,
      'num_key_value_heads': kv_heads,
      'head_dim': head_dim,
      'max_position_embeddings': int(meta.get(p + 'context_length', 2048)),
      'rms_norm_eps': _f32(meta.get(p + 'attention.layer_norm_rms_epsilon', 1e-5)),
      'rope_theta': theta,
      'rope_parameters': {'rope_type': 'default', 'rope_theta': theta},
      'hidden_act': 'silu',
      'attention_bias': False,
      'mlp_bias': False,
      'tie_word_embeddings': tie_embeddings,
      'bos_token_id': bos_id,
      'eos_token_id': eos_ids[0] if len(eos_ids) == 1 else list(eos_ids),
      'pad_token_id': pad_id,
      'torch_dtype': 'float32',
      'dtype': 'float32',
  }


def dequantize_tensors(reader, hf_config: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """All tensors of the file as float32 under HF names, q/k un-permuted (and biases, if any)."""
  from gguf import quants  # pylint: disable=g-import-not-at-top
  heads, kv_heads = hf_config['num_attention_heads'], hf_config['num_key_value_heads']
  layers = hf_config['num_hidden_layers']
  out: dict[str, np.ndarray] = {}
  for t in reader.tensors:
    m = _LAYER_RE.match(t.name)
    if m and m.group(2) in _LAYER_NAMES and int(m.group(1)) < layers:
      name = _LAYER_NAMES[m.group(2)].format(int(m.group(1)))
    elif t.name in _GLOBAL_NAMES:
      name = _GLOBAL_NAMES[t.name]
    elif t.name == 'rope_freqs.weight':
      raise ValueError('GGUF has rope_freqs.weight (Llama-3 RoPE scaling stored as frequency factors), which '
                       'this importer does not support.')
    else:
      raise ValueError(f'GGUF tensor {t.name!r} has no HF llama counterpart.')
    w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    expected = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first.
    if w.shape != expected:
      w = w.reshape(expected)
    if '.attn_q.' in t.name:
      w = unpermute_qk(w, heads)
    elif '.attn_k.' in t.name:
      w = unpermute_qk(w, kv_heads)
    out[name] = np.ascontiguousarray(w)
  missing = [n for n in ('model.embed_tokens.weight', 'model.norm.weight') if n not in out]
  for i in range(layers):
    missing += [f.format(i) for k, f in _LAYER_NAMES.items() if k.endswith('weight') and f.format(i) not in out]
  if missing:
    raise ValueError(f'GGUF lacks tensors for {missing[:4]}{"..." if len(missing) > 4 else ""}.')
  return out


def _pre_tokenizer(pre: str | None):
  """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (byte-level BPE vocabularies)."""
  from tokenizers import Regex, pre_tokenizers  # pylint: disable=g-import-not-at-top
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=True)
  if pre in ('smollm',):  # SmolLM / SmolLM2: every digit is a token, then GPT-2's splitting.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  if pre in (None, 'default', 'gpt2', 'gpt-2'):
    return byte_level
  split = {'llama3': _LLAMA3_SPLIT, 'llama-v3': _LLAMA3_SPLIT, 'llama-bpe': _LLAMA3_SPLIT,
           'qwen2': _QWEN2_SPLIT}.get(pre)
  if split is None:
    raise ValueError(f'tokenizer.ggml.pre={pre!r} is not supported (smollm, gpt2, default, llama-bpe, qwen2).')
  return pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(split), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def build_tokenizer(meta: Mapping[str, Any]):
  """HF `tokenizers.Tokenizer` (byte-level BPE) from the GGUF vocabulary, merges and token types."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, processors  # pylint: disable=g-import-not-at-top
  kind = meta.get('tokenizer.ggml.model')
  if kind != 'gpt2':
    raise ValueError(f'tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, "gpt2").')
  tokens = list(_require(meta, 'tokenizer.ggml.tokens'))
  types = list(meta.get('tokenizer.ggml.token_type', [_TOKEN_NORMAL] * len(tokens)))
  merges = [tuple(m.split(' ')) for m in _require(meta, 'tokenizer.ggml.merges')]
  bad = [m for m in merges if len(m) != 2]
  if bad:
    raise ValueError(f'GGUF merges must be "left right" pairs; got {bad[:3]}.')
  vocab = {}
  for i, t in enumerate(tokens):
    if t in vocab:  # llama.cpp allows duplicates; the first id wins, as in transformers' converter.
      logging.warning('GGUF token %r repeats (ids %d and %d); keeping id %d.', t, vocab[t], i, vocab[t])
      continue
    vocab[t] = i
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
  tok.pre_tokenizer = _pre_tokenizer(meta.get('tokenizer.ggml.pre'))
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  added = []
  for i, (t, ty) in enumerate(zip(tokens, types)):
    if ty == _TOKEN_CONTROL:
      added.append(AddedToken(t, special=True, normalized=False))
    elif ty == _TOKEN_USER_DEFINED:
      added.append(AddedToken(t, special=False, normalized=False))
  if added:
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
  for a in added:  # Added tokens must keep their GGUF ids.
    if tok.token_to_id(a.content) != vocab[a.content]:
      raise ValueError(f'added token {a.content!r} got id {tok.token_to_id(a.content)}, GGUF says {vocab[a.content]}.')
  return tok


def _special_ids(meta: Mapping[str, Any], tok, chat_template: str | None):
  """(bos, eos, pad, unk, stop_ids) with the corrections described in the module docstring."""
  def get(key):
    v = meta.get(f'tokenizer.ggml.{key}')
    return None if v is None else int(v)

  bos, eos, pad, unk = get('bos_token_id'), get('eos_token_id'), get('padding_token_id'), get('unknown_token_id')
  im_end = tok.token_to_id('<|im_end|>')
  if chat_template and '<|im_end|>' in chat_template and im_end is not None and eos != im_end:
    logging.warning('GGUF eos id %s is not the ChatML end of turn <|im_end|> (%d) the template uses; using %d.',
                    eos, im_end, im_end)
    eos = im_end
  if eos is None:
    raise ValueError('GGUF has no tokenizer.ggml.eos_token_id and no ChatML <|im_end|> token.')
  if pad is None or pad == eos:
    eot = tok.token_to_id('<|endoftext|>')
    if eot is not None and eot != eos:
      pad = eot
    elif unk is not None and unk != eos:
      pad = unk
    else:
      pad = eos
  stops = [eos] + [i for i in (get('eot_token_id'), get('eom_token_id')) if i is not None]
  return bos, eos, pad, unk, tuple(dict.fromkeys(stops))


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
  """Reads and dequantizes a llama-architecture GGUF file into HF form (see the module docstring)."""
  from gguf import GGUFReader  # pylint: disable=g-import-not-at-top
  from sao_jax import tokenizers as tokenizers_lib  # pylint: disable=g-import-not-at-top
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f'GGUF file {path} not found.')
  reader = GGUFReader(path)
  meta = read_metadata(reader)
  tok = build_tokenizer(meta)
  template = meta.get('tokenizer.chat_template')
  if template is None and tok.token_to_id('<|im_start|>') is not None and tok.token_to_id('<|im_end|>') is not None:
    template = tokenizers_lib.CHATML_TEMPLATE
  bos, eos, pad, unk, stops = _special_ids(meta, tok, template)
  tie = all(t.name != 'output.weight' for t in reader.tensors)
  cfg = hf_config_from_metadata(meta, tie_embeddings=tie, bos_id=bos, eos_ids=list(stops), pad_id=pad)
  tensors = dequantize_tensors(reader, cfg)
  emb = tensors['model.embed_tokens.weight']
  if emb.shape != (cfg['vocab_size'], cfg['hidden_size']):
    raise ValueError(f'token_embd has shape {emb.shape}, expected (vocab_size, hidden)='
                     f'{(cfg["vocab_size"], cfg["hidden_size"])}.')
  small_meta = {k: v for k, v in meta.items()
                if k not in ('tokenizer.ggml.tokens', 'tokenizer.ggml.merges', 'tokenizer.ggml.token_type',
                             'tokenizer.ggml.scores')}
  return GGUFCheckpoint(hf_config=cfg, tensors=tensors, tokenizer=tok, chat_template=template, bos_id=bos,
                        eos_id=eos, pad_id=pad, unk_id=unk, stop_ids=stops, metadata=small_meta)


def save_hf_dir(ckpt: GGUFCheckpoint, out_dir: str | os.PathLike[str]) -> None:
  """Writes config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json (with the chat
  template) and generation_config.json."""
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  out_dir = os.fspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  tok = ckpt.tokenizer

  def name(i):
    return None if i is None else tok.id_to_token(i)

  def dump(fname, obj):
    with open(os.path.join(out_dir, fname), 'w', encoding='utf-8') as f:
      json.dump(obj, f, indent=2, ensure_ascii=False)
      f.write('\n')

  dump('config.json', ckpt.hf_config)
  save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in ckpt.tensors.items()},
            os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
  tok.save(os.path.join(out_dir, 'tokenizer.json'))
  tcfg = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'bos_token': name(ckpt.bos_id),
      'eos_token': name(ckpt.eos_id),
      'pad_token': name(ckpt.pad_id),
      'unk_token': name(ckpt.unk_id),
      'add_bos_token': bool(ckpt.metadata.get('tokenizer.ggml.add_bos_token', False)),
      'add_eos_token': bool(ckpt.metadata.get('tokenizer.ggml.add_eos_token', False)),
      'clean_up_tokenization_spaces': False,
      'model_max_length': ckpt.hf_config['max_position_embeddings'],
  }
  if ckpt.chat_template:
    tcfg['chat_template'] = ckpt.chat_template
  dump('tokenizer_config.json', tcfg)
  stops = list(ckpt.stop_ids)
  dump('generation_config.json', {
      'bos_token_id': ckpt.bos_id,
      'eos_token_id': stops[0] if len(stops) == 1 else stops,
      'pad_token_id': ckpt.pad_id,
  })


def convert_gguf_to_hf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> GGUFCheckpoint:
  """`load_gguf` then `save_hf_dir`; returns the checkpoint."""
  ckpt = load_gguf(gguf_path)
  save_hf_dir(ckpt, out_dir)
  logging.info('Converted %s -> %s (%d tensors, vocab %d, eos %d, pad %d).', gguf_path, out_dir,
               len(ckpt.tensors), ckpt.hf_config['vocab_size'], ckpt.eos_id, ckpt.pad_id)
  return ckpt
