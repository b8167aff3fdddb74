r"""Converts a llama-architecture GGUF file into a Hugging Face model directory.

  python -m sao_jax.tools.convert_gguf --gguf=SmolLM2-135M-Instruct.Q4_1.gguf --out=/tmp/smollm2-hf

Writes config.json, model.safetensors (float32, dequantized, HF Llama names, q/k in HF's RoPE layout),
tokenizer.json, tokenizer_config.json (with the chat template) and generation_config.json. The directory
loads with `transformers.AutoModelForCausalLM.from_pretrained(out)` and `sao_jax.models.hf_io.load_hf(out)`.
"""

from absl import app, flags, logging

from sao_jax.models import gguf_io

_GGUF = flags.DEFINE_string('gguf', None, 'Path of the .gguf file (llama architecture, byte-level BPE vocab).')
_OUT = flags.DEFINE_string('out', None, 'Output directory (created; existing files are overwritten).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  ckpt = gguf_io.convert_gguf_to_hf(_GGUF.value, _OUT.value)
  c = ckpt.hf_config
  tok = ckpt.tokenizer
  print(f'{_OUT.value}: {c["num_hidden_layers"]} layers, hidden {c["hidden_size"]}, heads {c["num_attention_heads"]}'
        f'/{c["num_key_value_heads"]} kv, vocab {c["vocab_size"]}, rope_theta {c["rope_theta"]:g}, '
        f'tied {c["tie_word_embeddings"]}; eos {ckpt.eos_id} {tok.id_to_token(ckpt.eos_id)!r}, '
        f'pad {ckpt.pad_id} {tok.id_to_token(ckpt.pad_id)!r}, stop ids {list(ckpt.stop_ids)}')
  logging.info('done')


if __name__ == '__main__':
  flags.mark_flags_as_required(['gguf', 'out'])
  app.run(main)
