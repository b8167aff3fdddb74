"""Answer formats of the synthetic tasks: how to ask for an answer, and how to read it back (strictly or not).

Formats: 'tag' `<answer>42</answer>`, 'boxed' `\\boxed{42}`, 'hash' `#### 42` (GSM8K style), 'plain' `42`.
Strict reading: exactly one answer in the format, an integer literal `-?\\d+` with no spaces, and nothing
after it (text before it, e.g. reasoning, is allowed). Lenient reading: the last answer in the format,
tolerating spaces, a leading `+` and thousands separators.
"""

from __future__ import annotations

import re

FORMATS = ('tag', 'boxed', 'hash', 'plain')

_INSTRUCTIONS = {
    'tag': 'Give the final answer as <answer>N</answer>.',
    'boxed': 'Give the final answer as \\boxed{N}.',
    'hash': 'Give the final answer as #### N.',
    'plain': 'Reply with the final answer only.',
}

_STRICT = {
    'tag': re.compile(r'(?s).*<answer>(-?\d+)</answer>'),
    'boxed': re.compile(r'(?s).*\\boxed\{(-?\d+)\}'),
    'hash': re.compile(r'(?s)(?:.*\n)?#### (-?\d+)'),
    'plain': re.compile(r'(-?\d+)'),
}
_MARKERS = {'tag': '<answer>', 'boxed': '\\boxed{', 'hash': '####'}
# Lenient: candidates first (no nested quantifiers: linear in the text), then the number check on each.
_LENIENT = {
    'tag': re.compile(r'<answer>([^<]*)</answer>'),
    'boxed': re.compile(r'\\boxed\{([^{}]*)\}'),
    'hash': re.compile(r'####\s*([+-]?[\d,]+)'),
    'plain': re.compile(r'([+-]?\d[\d,]*)'),
}
_LENIENT_NUMBER = re.compile(r'[+-]?[\d,\s]+')


def check_format(fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f'answer format {fmt!r} is not one of {list(FORMATS)}')


def instruction(fmt: str) -> str:
  check_format(fmt)
  return _INSTRUCTIONS[fmt]


def render(value: int | str, fmt: str) -> str:
  """The canonical correct response for `value` in `fmt`."""
  check_format(fmt)
  return {'tag': f'<answer>{value}</answer>', 'boxed': f'\\boxed{{{value}}}', 'hash': f'#### {value}',
          'plain': f'{value}'}[fmt]


def parse(text: str, fmt: str, *, strict: bool = True) -> str | None:
  """The integer answer (canonical string, e.g. '-12') in `text`, or None if the format is not respected."""
  check_format(fmt)
  text = text.strip()
  if strict:
    if fmt in _MARKERS and text.count(_MARKERS[fmt]) != 1:
      return None
    m = _STRICT[fmt].fullmatch(text)
    return None if m is None else str(int(m.group(1)))
  matches = [m.strip() for m in _LENIENT[fmt].findall(text)]
  matches = [m for m in matches if _LENIENT_NUMBER.fullmatch(m)]
  if not matches:
    return None
  digits = re.sub(r'[\s,+]', '', matches[-1])
  try:
    return str(int(digits))
  except ValueError:
    return None
