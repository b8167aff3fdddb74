"""Tokenizers and chat templates with assistant masks.

Two implementations share one protocol (`Tokenizer`):

* `CharTokenizer`: a deterministic character-level vocabulary for the synthetic tasks, with control
  tokens (pad, end-of-turn, bos, role markers) and tool tags (`<calc>`, `<result>`, `<answer>`, ...)
  matched whole (longest match first), and a small ChatML-like chat format:
  `<|user|>2+2=<|end|><|assistant|>4<|end|>`.
* `HFTokenizer`: a `tokenizers.Tokenizer` (an HF `tokenizer.json`) plus the model's jinja2 chat template,
  rendered the way `transformers` renders it (sandboxed jinja2, `trim_blocks`, `lstrip_blocks`).

`apply_chat_template` returns `(ids, assistant_mask)`. The mask is True exactly on the tokens the
assistant produced: its content and its end-of-turn token, never the role header (which the template,
not the model, writes) nor any glue after the end-of-turn token (e.g. ChatML's trailing newline).
It is computed message by message (prefix differences of the rendered conversation):

    text_i  = render(messages[:i+1])                         (each a prefix of the next)
    head_i  = render(messages[:i], add_generation_prompt)    (for an assistant message i)
    segment = text_i[len(text_{i-1}):]      -> ids of a non-assistant message, mask False
    header  = head_i[len(text_{i-1}):]      -> mask False
    body    = text_i[len(head_i):]          -> mask True up to and including the first stop token

This is exactly the token stream an agent loop produces (prompt rendered with a generation prompt, then
sampled tokens ending with a stop token), and the concatenation is checked against tokenizing the full
rendered conversation in one go; a template for which they differ is refused with a clear error.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from absl import logging

from sao_jax.errors import ConfigError

Message = Mapping[str, Any]

# ChatML, used when a model directory carries no template but its vocabulary has the ChatML tokens.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@runtime_checkable
class Tokenizer(Protocol):
  """What every tokenizer of the package provides; envs, rollout and eval use only this."""

  vocab_size: int
  bos_id: int | None
  eos_id: int
  pad_id: int
  stop_ids: tuple[int, ...]

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; no special token is added (special strings in the text are matched)."""

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; pad is skipped, control tokens are left out by default."""

  def apply_chat_template(self, messages: Sequence[Message], *,
                          add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
    """(ids, assistant_mask) of a conversation; the mask is True on assistant-produced tokens."""


# ----------------------------------------------------------------------------------------------------
# Shared chat logic.


def _check_messages(messages: Sequence[Message]) -> None:
  if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
    raise TypeError(f'messages must be a list of {{"role", "content"}} dicts, got {type(messages).__name__}.')
  for i, m in enumerate(messages):
    if not isinstance(m, Mapping) or 'role' not in m or 'content' not in m:
      raise ValueError(f'messages[{i}] must be a dict with "role" and "content", got {m!r}.')
    if not isinstance(m['content'], str):
      raise TypeError(f'messages[{i}]["content"] must be a str, got {type(m["content"]).__name__}.')


def _ids_and_assistant_mask(render: Callable[[Sequence[Message], bool], str],
                            encode: Callable[[str], list[int]],
                            stop_ids: Sequence[int],
                            messages: Sequence[Message],
                            add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
  """Prefix-difference tokenization of a conversation (see the module docstring)."""
  _check_messages(messages)
  stops = frozenset(stop_ids)
  ids: list[int] = []
  mask: list[bool] = []
  prev = ''

  def suffix(text: str, prefix: str, what: str) -> str:
    if not text.startswith(prefix):
      raise ValueError(
          f'Chat template is not prefix-stable at {what}: rendering more messages rewrote earlier text, so '
          'per-message assistant masks cannot be derived. Rendered prefix ends with '
          f'{prefix[-60:]!r}, next render has {text[max(0, len(prefix) - 60):len(prefix)]!r} there.')
    return text[len(prefix):]

  for i, message in enumerate(messages):
    text = render(messages[:i + 1], False)
    if message['role'] == 'assistant':
      head = render(messages[:i], True)
      header = suffix(head, prev, f'the generation prompt of messages[{i}]')
      body = suffix(text, head, f'messages[{i}] (assistant)')
      header_ids, body_ids = encode(header), encode(body)
      end = next((j for j, t in enumerate(body_ids) if t in stops), len(body_ids) - 1)
      ids += header_ids + body_ids
      mask += [False] * len(header_ids) + [j <= end for j in range(len(body_ids))]
    else:
      seg_ids = encode(suffix(text, prev, f'messages[{i}] ({message["role"]})'))
      ids += seg_ids
      mask += [False] * len(seg_ids)
    prev = text
  if add_generation_prompt:
    full = render(messages, True)
    tail_ids = encode(suffix(full, prev, 'the final generation prompt'))
    ids += tail_ids
    mask += [False] * len(tail_ids)
  else:
    full = prev
  whole = encode(full)
  if whole != ids:
    k = next((j for j, (a, b) in enumerate(zip(whole, ids)) if a != b), min(len(whole), len(ids)))
    raise ValueError(
        'Tokenizing the conversation message by message differs from tokenizing the whole rendered text '
        f'(first difference at token {k}: {whole[k:k + 4]} vs {ids[k:k + 4]}); the template joins messages '
        'with text that merges across message boundaries.')
  return ids, mask


# ----------------------------------------------------------------------------------------------------
# Character-level tokenizer.

PAD = '<pad>'
END = '<|end|>'  # End of turn (eos): the assistant's stop token.
BOS = '<|bos|>'
UNK = '<unk>'
ROLE_TOKENS = {'system': '<|system|>', 'user': '<|user|>', 'assistant': '<|assistant|>', 'tool': '<|tool|>'}
TOOL_TAGS = ('<calc>', '</calc>', '<result>', '</result>', '<answer>', '</answer>')
_CONTROL = (PAD, END, BOS, UNK) + tuple(ROLE_TOKENS.values())
_OPERATORS = '+-*/=()^.,'
_WHITESPACE = ' \n'
_LETTERS = string.ascii_lowercase + string.ascii_uppercase
_PUNCTUATION = ''.join(c for c in string.punctuation if c not in _OPERATORS) + '\t'


class CharTokenizer:
  """Deterministic character-level tokenizer for the synthetic tasks.

  Vocabulary, in id order: `<pad>`=0, `<|end|>`=1 (eos, end of turn), `<|bos|>`=2, `<unk>`=3, role
  markers (`<|system|>`, `<|user|>`, `<|assistant|>`, `<|tool|>`), tool tags (`<calc>`, `</calc>`,
  `<result>`, `</result>`, `<answer>`, `</answer>`), `extra_tokens`, digits, operators `+-*/=()^.,`,
  space, newline, a-z, A-Z, then the rest of ASCII punctuation and tab. Multi-character tokens are
  matched whole in the text, longest first.

  Args:
    extra_tokens: additional multi-character tokens (e.g. `<think>`), kept as content on decode.
    on_unknown: what `encode` does with a character outside the vocabulary: 'error' (ValueError naming
      it) or 'unk' (map it to `<unk>`).
  """

  def __init__(self, extra_tokens: Sequence[str] = (), *, on_unknown: str = 'error'):
    if on_unknown not in ('error', 'unk'):
      raise ValueError(f"on_unknown must be 'error' or 'unk', got {on_unknown!r}.")
    self.on_unknown = on_unknown
    chars = tuple(string.digits + _OPERATORS + _WHITESPACE + _LETTERS + _PUNCTUATION)
    tokens = _CONTROL + TOOL_TAGS + tuple(extra_tokens) + chars
    if len(set(tokens)) != len(tokens):
      raise ValueError(f'extra_tokens {tuple(extra_tokens)} repeat tokens already in the vocabulary.')
    for t in extra_tokens:
      if len(t) < 2:
        raise ValueError(f'extra token {t!r} must have 2 or more characters (single characters are built in).')
    self._id_to_token: tuple[str, ...] = tokens
    self._token_to_id = {t: i for i, t in enumerate(tokens)}
    multi = sorted((t for t in tokens if len(t) > 1), key=len, reverse=True)
    self._pattern = re.compile('|'.join(map(re.escape, multi)) + '|.', re.DOTALL)
    self.vocab_size = len(tokens)
    self.pad_id = self._token_to_id[PAD]
    self.eos_id = self._token_to_id[END]
    self.bos_id = self._token_to_id[BOS]
    self.unk_id = self._token_to_id[UNK]
    self.stop_ids = (self.eos_id,)
    self._control_ids = frozenset(self._token_to_id[t] for t in _CONTROL)

  def token_to_id(self, token: str) -> int:
    """Id of one token string (KeyError if absent)."""
    return self._token_to_id[token]

  def id_to_token(self, i: int) -> str:
    """Token string of one id."""
    return self._id_to_token[i]

  def encode(self, text: str) -> list[int]:
    """Ids of `text`; multi-character tokens (specials, tool tags) are matched whole, longest first."""
    ids = []
    for m in self._pattern.finditer(text):
      i = self._token_to_id.get(m.group())
      if i is None:
        if self.on_unknown == 'error':
          raise ValueError(f'CharTokenizer cannot encode character {m.group()!r} at offset {m.start()} of '
                           f'{text[:80]!r} (use on_unknown="unk" to map it to <unk>).')
        i = self.unk_id
      ids.append(i)
    return ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`; pad is always skipped, control tokens (eos, bos, roles, unk) unless asked."""
    out = []
    for i in ids:
      i = int(i)
      if not 0 <= i < self.vocab_size:
        raise ValueError(f'token id {i} is outside the CharTokenizer vocabulary [0, {self.vocab_size}).')
      if i == self.pad_id or (skip_special_tokens and i in self._control_ids):
        continue
      out.append(self._id_to_token[i])
    return ''.join(out)

  def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The conversation as text: `<|role|>content<|end|>` per message, then `<|assistant|>` if asked."""
    _check_messages(messages)
    parts = []
    for i, m in enumerate(messages):
      if m['role'] not in ROLE_TOKENS:
        raise ValueError(f'messages[{i}] has role {m["role"]!r}; CharTokenizer knows {sorted(ROLE_TOKENS)}.')
      parts.append(ROLE_TOKENS[m['role']] + m['content'] + END)
    if add_generation_prompt:
      parts.append(ROLE_TOKENS['assistant'])
    return ''.join(parts)

  def apply_chat_template(self, messages: Sequence[Message], *,
                          add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
    """(ids, assistant_mask); the mask covers each assistant's content and its `<|end|>`."""
    return _ids_and_assistant_mask(self.render_chat, self.encode, self.stop_ids, messages,
                                   add_generation_prompt)


# ----------------------------------------------------------------------------------------------------
# Hugging Face tokenizer + jinja2 chat template.


def _template_error(message: str):
  import jinja2  # pylint: disable=g-import-not-at-top
  raise jinja2.exceptions.TemplateError(message)


def compile_chat_template(source: str):
  """Compiles a chat template the way `transformers` does (sandboxed jinja2, trim/lstrip blocks)."""
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  import jinja2.sandbox  # pylint: disable=g-import-not-at-top

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = _template_error
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def _token_content(value: Any) -> str | None:
  """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
  if isinstance(value, Mapping):
    return value.get('content')
  return value


class HFTokenizer:
  """An HF `tokenizers.Tokenizer` with a jinja2 chat template and explicit eos/pad/stop ids.

  Args:
    tokenizer: the fast tokenizer (`tokenizer.json`).
    chat_template: jinja2 source, or None (then `apply_chat_template` raises).
    eos_token: the end-of-turn token (string or id): what ends an assistant turn.
    pad_token: padding token (string or id); None = `eos_token`.
    bos_token: beginning-of-sequence token or None (never added by `encode`).
    stop_tokens: additional tokens that end an assistant turn (eos is always one).
    template_vars: extra variables for the template (e.g. `{"enable_thinking": False}` for Qwen3).
  """

  def __init__(self, tokenizer, chat_template: str | None, *, eos_token: str | int,
               pad_token: str | int | None = None, bos_token: str | int | None = None,
               stop_tokens: Sequence[str | int] = (), template_vars: Mapping[str, Any] | None = None):
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    self.eos_id = self._id(eos_token, 'eos_token')
    self.pad_id = self.eos_id if pad_token is None else self._id(pad_token, 'pad_token')
    self.bos_id = None if bos_token is None else self._id(bos_token, 'bos_token')
    stops = [self.eos_id] + [self._id(t, 'stop_tokens') for t in stop_tokens]
    self.stop_ids = tuple(dict.fromkeys(stops))
    self.chat_template = chat_template
    self._template = compile_chat_template(chat_template) if chat_template else None
    self.template_vars = dict(template_vars or {})

  def _id(self, token: str | int, what: str) -> int:
    if isinstance(token, int):
      if not 0 <= token < self.vocab_size:
        raise ValueError(f'{what} id {token} is outside the vocabulary [0, {self.vocab_size}).')
      return token
    i = self.tokenizer.token_to_id(token)
    if i is None:
      raise ValueError(f'{what} {token!r} is not in the tokenizer vocabulary.')
    return i

  @classmethod
  def from_dir(cls, path: str | os.PathLike[str], **overrides) -> 'HFTokenizer':
    """Reads `tokenizer.json`, `tokenizer_config.json` (special tokens, chat template),
    `chat_template.jinja` (transformers >= 4.50 saves it there), `generation_config.json` (stop ids)
    and `config.json` (fallback ids) of an HF model directory. `overrides` go to the constructor."""
    import tokenizers  # pylint: disable=g-import-not-at-top
    path = os.fspath(path)
    tok_file = os.path.join(path, 'tokenizer.json')
    if not os.path.isfile(tok_file):
      raise FileNotFoundError(f'{tok_file} not found: an HF tokenizer directory needs tokenizer.json.')
    tokenizer = tokenizers.Tokenizer.from_file(tok_file)

    def read_json(name):
      f = os.path.join(path, name)
      if not os.path.isfile(f):
        return {}
      with open(f, encoding='utf-8') as fh:
        return json.load(fh)

    tcfg, gcfg, mcfg = read_json('tokenizer_config.json'), read_json('generation_config.json'), read_json(
        'config.json')
    template = tcfg.get('chat_template')
    jinja_file = os.path.join(path, 'chat_template.jinja')
    if os.path.isfile(jinja_file):
      with open(jinja_file, encoding='utf-8') as fh:
        template = fh.read()
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      named = {t['name']: t['template'] for t in template}
      template = named.get('default', next(iter(named.values()), None))

    def as_ids(v):
      if v is None:
        return []
      return [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]

    eos: str | int | None = _token_content(tcfg.get('eos_token'))
    gen_eos = as_ids(gcfg.get('eos_token_id')) or as_ids(mcfg.get('eos_token_id'))
    if eos is None:
      if not gen_eos:
        raise ValueError(f'{path}: no eos token in tokenizer_config.json, generation_config.json or config.json.')
      eos = gen_eos[0]
    pad: str | int | None = _token_content(tcfg.get('pad_token'))
    if pad is None:
      pad = gcfg.get('pad_token_id', mcfg.get('pad_token_id'))
    bos: str | int | None = _token_content(tcfg.get('bos_token'))
    if bos is None:
      bos = mcfg.get('bos_token_id')
    if template is None and tokenizer.token_to_id('<|im_start|>') is not None and tokenizer.token_to_id(
        '<|im_end|>') is not None:
      logging.info('%s has no chat template; using ChatML (its vocabulary has <|im_start|>/<|im_end|>).', path)
      template = CHATML_TEMPLATE
    kwargs: dict[str, Any] = dict(chat_template=template, eos_token=eos, pad_token=pad, bos_token=bos,
                                  stop_tokens=gen_eos)
    kwargs.update(overrides)
    return cls(tokenizer, **kwargs)

  def token_to_id(self, token: str) -> int | None:
    return self.tokenizer.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self.tokenizer.id_to_token(i)

  def encode(self, text: str) -> list[int]:
    """Ids of `text` without added special tokens (special strings in the text are matched whole)."""
    return self.tokenizer.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
    """Text of `ids`; pad is always skipped, special tokens unless `skip_special_tokens=False`."""
    return self.tokenizer.decode([int(i) for i in ids if int(i) != self.pad_id],
                                 skip_special_tokens=skip_special_tokens)

  def _token_str(self, i: int | None) -> str:
    return '' if i is None else (self.tokenizer.id_to_token(i) or '')

  def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The conversation rendered by the chat template (as `transformers`' apply_chat_template, tokenize=False)."""
    if self._template is None:
      raise ValueError('This tokenizer has no chat template (none in the model directory and no ChatML '
                       'tokens); pass chat_template= to HFTokenizer.')
    _check_messages(messages)
    return self._template.render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        bos_token=self._token_str(self.bos_id), eos_token=self._token_str(self.eos_id),
        pad_token=self._token_str(self.pad_id), **self.template_vars)

  def apply_chat_template(self, messages: Sequence[Message], *,
                          add_generation_prompt: bool) -> tuple[list[int], list[bool]]:
    """(ids, assistant_mask); the mask covers each assistant's content and its end-of-turn token."""
    return _ids_and_assistant_mask(self.render_chat, self.encode, self.stop_ids, messages,
                                   add_generation_prompt)


# ----------------------------------------------------------------------------------------------------


def get_tokenizer(name_or_config: Any, hf_dir: str | None = None) -> CharTokenizer | HFTokenizer:
  """The tokenizer named by a string or by a config.

  Args:
    name_or_config: 'char'; 'hf' (needs `hf_dir`); a directory with tokenizer.json; or a config
      (the full config or its `model` section) whose `model.tokenizer` is one of those and whose
      `model.hf_dir` is the directory.
    hf_dir: directory of an HF tokenizer (overrides the config's `model.hf_dir`).
  """
  field = 'tokenizer'
  if isinstance(name_or_config, str):
    name = name_or_config
  else:
    cfg = name_or_config
    if hasattr(cfg, 'model') and hasattr(cfg.model, 'tokenizer'):
      cfg = cfg.model
    if not hasattr(cfg, 'tokenizer'):
      raise TypeError(f'get_tokenizer needs a name or a config with model.tokenizer, got {type(cfg).__name__}.')
    name, field = cfg.tokenizer, 'config.model.tokenizer'
    hf_dir = hf_dir or getattr(cfg, 'hf_dir', '') or None
  if name == 'char':
    return CharTokenizer()
  if name == 'hf':
    if not hf_dir:
      raise ConfigError(f"{field}='hf' needs config.model.hf_dir (a directory with tokenizer.json).")
    return HFTokenizer.from_dir(hf_dir)
  if os.path.isdir(name):
    return HFTokenizer.from_dir(name)
  raise ConfigError(f"{field}={name!r}: expected 'char', 'hf' or a tokenizer directory.")
