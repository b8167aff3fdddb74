"""Tests of sao_jax.tokenizers: char vocabulary, HF wrapper, chat templates and assistant masks."""

import json
import os
import tempfile

from absl.testing import absltest, parameterized
from tokenizers import pre_tokenizers

from configs import base as base_config
from sao_jax import config_lib
from sao_jax.models import gguf_io
from sao_jax import tokenizers as tok_lib

# SmolLM2-Instruct's template (as in its GGUF): inserts a default system prompt when there is none.
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

SPECIALS = ('<|endoftext|>', '<|im_start|>', '<|im_end|>')
# Words (in GPT-2's byte alphabet, Ġ = space, Ċ = newline) whose left-to-right merges make the tiny vocab.
WORDS = ('Ġthe', 'Ġanswer', 'Ġis', 'hello', 'Ġworld', 'Ġcapital', 'ing', 'user', 'assistant', 'system',
         'Ġ=', '12', 'ĊĊ', 'Ġcalc', 'ab')


def tiny_vocab():
  """(tokens, merges, token_types) of a small byte-level BPE vocabulary in GGUF form.

  Ids: 0..2 the ChatML control tokens, then the 256 byte symbols, then one token per merge.
  """
  tokens = list(SPECIALS) + sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = []
  for word in WORDS:
    left = word[0]
    for ch in word[1:]:
      merged = left + ch
      if merged not in tokens:
        merges.append(f'{left} {ch}')
        tokens.append(merged)
      left = merged
  types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
  return tokens, merges, types


def tiny_hf_tokenizer(pre='gpt2', template=SMOL_TEMPLATE, **kwargs):
  tokens, merges, types = tiny_vocab()
  tok = gguf_io.build_tokenizer({'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': pre,
                                 'tokenizer.ggml.tokens': tokens, 'tokenizer.ggml.merges': merges,
                                 'tokenizer.ggml.token_type': types})
  kwargs.setdefault('eos_token', '<|im_end|>')
  kwargs.setdefault('pad_token', '<|endoftext|>')
  return tok_lib.HFTokenizer(tok, template, **kwargs)


CONVERSATION = [
    {'role': 'user', 'content': 'What is 12 = 3 * 4?'},
    {'role': 'assistant', 'content': 'Let me check: <calc>3*4</calc>'},
    {'role': 'tool', 'content': '<result>12</result>'},
    {'role': 'assistant', 'content': 'hello world, the answer is 12.'},
]


def masked_runs(ids, mask):
  """Maximal runs of consecutive masked ids."""
  runs, cur = [], []
  for i, m in zip(ids, mask):
    if m:
      cur.append(i)
    elif cur:
      runs.append(cur)
      cur = []
  if cur:
    runs.append(cur)
  return runs


class CharTokenizerTest(parameterized.TestCase):

  def test_vocabulary_is_deterministic_with_fixed_special_ids(self):
    a, b = tok_lib.CharTokenizer(), tok_lib.CharTokenizer()
    self.assertEqual([a.id_to_token(i) for i in range(a.vocab_size)],
                     [b.id_to_token(i) for i in range(b.vocab_size)])
    self.assertEqual((a.pad_id, a.eos_id, a.bos_id), (0, 1, 2))
    self.assertEqual(a.id_to_token(0), '<pad>')
    self.assertEqual(a.stop_ids, (a.eos_id,))
    self.assertIsInstance(a, tok_lib.Tokenizer)
    for ch in '0123456789+-*/=()^., \nazAZ!?:;_':
      self.assertLen(a.encode(ch), 1, msg=repr(ch))
    self.assertLen({a.id_to_token(i) for i in range(a.vocab_size)}, a.vocab_size)

  @parameterized.parameters('<calc>', '</calc>', '<result>', '</result>', '<answer>', '</answer>',
                            '<|user|>', '<|assistant|>', '<|end|>')
  def test_tags_are_single_tokens(self, tag):
    t = tok_lib.CharTokenizer()
    self.assertEqual(t.encode(tag), [t.token_to_id(tag)])

  def test_longest_match_and_partial_tags(self):
    t = tok_lib.CharTokenizer()
    ids = t.encode('<calc>3*(4+5)</calc><cal <result>27</result>')
    toks = [t.id_to_token(i) for i in ids]
    self.assertEqual(toks, ['<calc>', '3', '*', '(', '4', '+', '5', ')', '</calc>', '<', 'c', 'a', 'l', ' ',
                            '<result>', '2', '7', '</result>'])

  def test_roundtrip(self):
    t = tok_lib.CharTokenizer()
    text = 'Q: 12*(3-4)/5^2 = -0.48, right?\n<answer>-0.48</answer> "ok" [x_1] {y} #1 @a ~b |c| `d` $e %f &g'
    self.assertEqual(t.decode(t.encode(text)), text)

  def test_decode_skips_pad_and_control(self):
    t = tok_lib.CharTokenizer()
    ids = [t.pad_id, t.bos_id, t.token_to_id('<|user|>')] + t.encode('1+1<calc>') + [t.eos_id, t.pad_id]
    self.assertEqual(t.decode(ids), '1+1<calc>')
    self.assertEqual(t.decode(ids, skip_special_tokens=False), '<|bos|><|user|>1+1<calc><|end|>')
    with self.assertRaisesRegex(ValueError, 'outside'):
      t.decode([t.vocab_size])

  def test_unknown_character(self):
    with self.assertRaisesRegex(ValueError, "'é' at offset 2"):
      tok_lib.CharTokenizer().encode('ab\u00e9')
    t = tok_lib.CharTokenizer(on_unknown='unk')
    self.assertEqual(t.encode('a\u00e9'), [t.token_to_id('a'), t.unk_id])

  def test_extra_tokens(self):
    t = tok_lib.CharTokenizer(extra_tokens=('<think>', '</think>'))
    self.assertEqual(t.encode('<think>x</think>'), [t.token_to_id('<think>'), t.token_to_id('x'),
                                                    t.token_to_id('</think>')])
    self.assertEqual(t.decode(t.encode('<think>x</think>')), '<think>x</think>')
    with self.assertRaisesRegex(ValueError, 'repeat'):
      tok_lib.CharTokenizer(extra_tokens=('<calc>',))

  def test_chat_template_and_mask(self):
    t = tok_lib.CharTokenizer()
    ids, mask = t.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    self.assertEqual(ids, t.encode(t.render_chat(CONVERSATION)))
    self.assertLen(mask, len(ids))
    runs = masked_runs(ids, mask)
    self.assertEqual([t.decode(r, skip_special_tokens=False) for r in runs],
                     ['Let me check: <calc>3*4</calc><|end|>', 'hello world, the answer is 12.<|end|>'])
    self.assertEqual(t.decode([i for i, m in zip(ids, mask) if not m], skip_special_tokens=False),
                     '<|user|>What is 12 = 3 * 4?<|end|><|assistant|><|tool|><result>12</result><|end|>'
                     '<|assistant|>')

  def test_generation_prompt(self):
    t = tok_lib.CharTokenizer()
    ids, mask = t.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True)
    self.assertEqual(ids[-1], t.token_to_id('<|assistant|>'))
    self.assertFalse(any(mask))
    # The prompt plus what the sampler generates (content, stop) is the conversation's token stream.
    full_ids, full_mask = t.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)
    gen = t.encode(CONVERSATION[1]['content']) + [t.eos_id]
    self.assertEqual(full_ids, ids + gen)
    self.assertEqual(full_mask, [False] * len(ids) + [True] * len(gen))

  def test_bad_messages(self):
    t = tok_lib.CharTokenizer()
    with self.assertRaisesRegex(ValueError, 'role'):
      t.apply_chat_template([{'role': 'robot', 'content': 'x'}], add_generation_prompt=False)
    with self.assertRaisesRegex(ValueError, r'messages\[0\]'):
      t.apply_chat_template([{'content': 'x'}], add_generation_prompt=False)
    with self.assertRaisesRegex(TypeError, 'content'):
      t.apply_chat_template([{'role': 'user', 'content': ['x']}], add_generation_prompt=False)
    with self.assertRaisesRegex(TypeError, 'list'):
      t.apply_chat_template('hello', add_generation_prompt=False)


class HFTokenizerTest(parameterized.TestCase):

  def test_special_ids(self):
    t = tiny_hf_tokenizer(bos_token='<|im_start|>')
    self.assertEqual((t.pad_id, t.bos_id, t.eos_id, t.stop_ids), (0, 1, 2, (2,)))
    self.assertEqual(t.vocab_size, len(tiny_vocab()[0]))
    self.assertIsInstance(t, tok_lib.Tokenizer)
    with self.assertRaisesRegex(ValueError, "eos_token '<nope>'"):
      tiny_hf_tokenizer(eos_token='<nope>')

  def test_encode_decode(self):
    t = tiny_hf_tokenizer()
    text = 'hello world, the answer is 12.\n\n'
    ids = t.encode(text)
    self.assertEqual(t.decode(ids), text)
    self.assertIn(t.token_to_id('Ġanswer'), ids)
    self.assertEqual(t.encode('<|im_start|>user'), [1, t.token_to_id('user')])
    self.assertEqual(t.decode([0, 1] + t.encode('hi') + [2, 0]), 'hi')
    self.assertEqual(t.decode([0, 1] + t.encode('hi') + [2, 0], skip_special_tokens=False),
                     '<|im_start|>hi<|im_end|>')

  def test_mask_covers_assistant_content_and_end_of_turn(self):
    t = tiny_hf_tokenizer()
    ids, mask = t.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    self.assertEqual(ids, t.encode(t.render_chat(CONVERSATION)))
    runs = masked_runs(ids, mask)
    self.assertEqual([t.decode(r, skip_special_tokens=False) for r in runs],
                     [m['content'] + '<|im_end|>' for m in CONVERSATION if m['role'] == 'assistant'])
    # The role header and ChatML's newline after <|im_end|> are the template's, not the model's.
    for j in range(1, len(ids)):
      if ids[j - 1] == 2 and mask[j - 1]:
        self.assertEqual(t.id_to_token(ids[j]), 'Ċ')
        self.assertFalse(mask[j])

  def test_matches_transformers_apply_chat_template(self):
    from transformers import AutoTokenizer  # pylint: disable=g-import-not-at-top
    t = tiny_hf_tokenizer()
    with tempfile.TemporaryDirectory() as d:
      t.tokenizer.save(os.path.join(d, 'tokenizer.json'))
      with open(os.path.join(d, 'tokenizer_config.json'), 'w') as f:
        json.dump({'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': '<|im_end|>',
                   'pad_token': '<|endoftext|>', 'chat_template': SMOL_TEMPLATE}, f)
      ref = AutoTokenizer.from_pretrained(d)
      loaded = tok_lib.HFTokenizer.from_dir(d)
    for msgs, gen in ((CONVERSATION, False), (CONVERSATION[:3], True), (CONVERSATION[:1], True)):
      want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
      self.assertEqual(loaded.render_chat(msgs, gen), want)
      self.assertEqual(loaded.apply_chat_template(msgs, add_generation_prompt=gen)[0],
                       ref.encode(want, add_special_tokens=False))

  def test_from_dir_reads_jinja_file_and_generation_config(self):
    t = tiny_hf_tokenizer()
    with tempfile.TemporaryDirectory() as d:
      t.tokenizer.save(os.path.join(d, 'tokenizer.json'))
      with open(os.path.join(d, 'tokenizer_config.json'), 'w') as f:
        json.dump({'eos_token': {'content': '<|im_end|>'}, 'chat_template': 'unused'}, f)
      with open(os.path.join(d, 'chat_template.jinja'), 'w') as f:
        f.write(tok_lib.CHATML_TEMPLATE)
      with open(os.path.join(d, 'generation_config.json'), 'w') as f:
        json.dump({'eos_token_id': [2, 0]}, f)
      loaded = tok_lib.HFTokenizer.from_dir(d)
    self.assertEqual((loaded.eos_id, loaded.pad_id, loaded.bos_id, loaded.stop_ids), (2, 2, None, (2, 0)))
    self.assertEqual(loaded.render_chat(CONVERSATION[:1], True),
                     '<|im_start|>user\nWhat is 12 = 3 * 4?<|im_end|>\n<|im_start|>assistant\n')

  def test_from_dir_without_template_uses_chatml_and_needs_tokenizer_json(self):
    t = tiny_hf_tokenizer()
    with tempfile.TemporaryDirectory() as d:
      with self.assertRaisesRegex(FileNotFoundError, 'tokenizer.json'):
        tok_lib.HFTokenizer.from_dir(d)
      t.tokenizer.save(os.path.join(d, 'tokenizer.json'))
      with open(os.path.join(d, 'config.json'), 'w') as f:
        json.dump({'eos_token_id': 2, 'bos_token_id': 1}, f)
      loaded = tok_lib.HFTokenizer.from_dir(d)
    self.assertEqual(loaded.chat_template, tok_lib.CHATML_TEMPLATE)
    self.assertEqual((loaded.eos_id, loaded.bos_id), (2, 1))

  def test_no_template(self):
    with self.assertRaisesRegex(ValueError, 'no chat template'):
      tiny_hf_tokenizer(template=None).apply_chat_template(CONVERSATION, add_generation_prompt=False)

  def test_template_features(self):
    template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
                "{{ '<|im_start|>' + m['role'] + '\n' + (m | tojson) + '<|im_end|>' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    t = tiny_hf_tokenizer(template=template)
    self.assertIn('{"role": "user", "content": "hi"}', t.render_chat([{'role': 'user', 'content': 'hi'}]))
    import jinja2  # pylint: disable=g-import-not-at-top
    with self.assertRaisesRegex(jinja2.TemplateError, 'bad role tool'):
      t.render_chat([{'role': 'tool', 'content': 'hi'}])

  def test_template_that_rewrites_history_is_refused(self):
    t = tiny_hf_tokenizer(template="{{ messages | length }}{% for m in messages %}{{ m['content'] }}<|im_end|>"
                          "{% endfor %}")
    with self.assertRaisesRegex(ValueError, 'not prefix-stable'):
      t.apply_chat_template(CONVERSATION[:2], add_generation_prompt=False)

  def test_template_that_merges_across_messages_is_refused(self):
    # No separator: user "a" + assistant "b" tokenize whole as the merged token "ab".
    t = tiny_hf_tokenizer(template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    msgs = [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]
    with self.assertRaisesRegex(ValueError, 'merges across message boundaries'):
      t.apply_chat_template(msgs, add_generation_prompt=False)

  def test_assistant_without_end_token_masks_its_whole_body(self):
    t = tiny_hf_tokenizer(template="{% for m in messages %}{{ '<|im_start|>' + m['content'] }}{% endfor %}")
    ids, mask = t.apply_chat_template([{'role': 'user', 'content': 'hi'},
                                       {'role': 'assistant', 'content': 'hello'}], add_generation_prompt=False)
    self.assertEqual(t.decode(masked_runs(ids, mask)[0], skip_special_tokens=False), '<|im_start|>hello')


class GetTokenizerTest(absltest.TestCase):

  def test_by_name_and_config(self):
    self.assertIsInstance(tok_lib.get_tokenizer('char'), tok_lib.CharTokenizer)
    config = base_config.get_config()
    config.model.tokenizer = 'char'
    self.assertIsInstance(tok_lib.get_tokenizer(config), tok_lib.CharTokenizer)
    self.assertIsInstance(tok_lib.get_tokenizer(config.model), tok_lib.CharTokenizer)

  def test_hf_dir(self):
    t = tiny_hf_tokenizer()
    config = base_config.get_config()
    config.model.tokenizer = 'hf'
    with self.assertRaisesRegex(config_lib.ConfigError, 'config.model.hf_dir'):
      tok_lib.get_tokenizer(config)
    with tempfile.TemporaryDirectory() as d:
      t.tokenizer.save(os.path.join(d, 'tokenizer.json'))
      with open(os.path.join(d, 'tokenizer_config.json'), 'w') as f:
        json.dump({'eos_token': '<|im_end|>'}, f)
      config.model.hf_dir = d
      self.assertEqual(tok_lib.get_tokenizer(config).eos_id, 2)
      self.assertEqual(tok_lib.get_tokenizer('hf', hf_dir=d).eos_id, 2)
      self.assertEqual(tok_lib.get_tokenizer(d).eos_id, 2)

  def test_bad_name(self):
    config = base_config.get_config()
    config.model.tokenizer = 'sentencepiece'
    with self.assertRaisesRegex(config_lib.ConfigError, "config.model.tokenizer='sentencepiece'"):
      tok_lib.get_tokenizer(config)


if __name__ == '__main__':
  absltest.main()
