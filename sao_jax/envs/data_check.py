"""The data check of a run's start and of `--dry_run`: what the run would skip, by file and row.

    task, tokenizer = registry.get_task(config.task), tokenizers.get_tokenizer(config)
    report = data_check.check_task_data(config, task, tokenizer)  # Before the model build; filters `task`.
    print(report)

Building a task from files reads every row (`datasets`): a file that cannot be read or has no valid row is a
`ConfigError` there, and malformed and duplicate rows are skipped (each file's `datasets.FileReport`). This
check adds the episode budget. A problem whose prompt leaves no room for one generated token (its token count,
as the episode runner counts it, is >= `config.sampler.max_seq_len`: `rollout.episodes.start_episode` refuses it
with "does not fit") is dropped from the task's train and eval problems (`Task.filter_problems`), counted, and
named (file, row, tokens, budget) in one warning per file; a file left with no problem, or a task left with no
training or eval problem, is a `ConfigError`. The report lists every row of every file that the run will not
use, with its reason: malformed, duplicate, too long, and rows the split leaves out (a training row whose
prompt is an eval problem; eval-file rows beyond `config.task.eval_size`).

Problems without rows (generated tasks: arith, calculator, drift, latency, arith_words without an eval file)
come from an infinite stream that cannot be filtered: only the eval set (`task.eval_set()`, drawn as the
training problems are; a few dozen prompts) is measured, and a prompt of it that does not fit is a
`ConfigError` naming `config.sampler.max_seq_len` (the budget is too small for the task).

A prompt is counted as the runner counts it: `tokenizer.apply_chat_template(example.messages(),
add_generation_prompt=True)` (`BaseEnv.reset` returns `example.messages()`). A prompt the tokenizer cannot
render (a character outside the char tokenizer's vocabulary) is skipped like a too-long one. Bounds on the
token count from the rendered text's length alone (`_Bounds`) spare most tokenizing: a prompt whose floor
reaches the budget is too long (a 60 MB prompt is decided in a fraction of a second), one whose ceiling stays
under it fits; only the prompts between are tokenized. The char tokenizer's count lies between characters /
its longest token and characters; a byte-level BPE's (GPT-2, Llama 3, Qwen, SmolLM) between UTF-8 bytes / its
longest token's bytes and UTF-8 bytes; a SentencePiece-style BPE has a floor only. Other tokenizers (WordPiece,
Unigram) tokenize every prompt, a huge one slowly (seconds a MB).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any, NamedTuple

from absl import logging

from sao_jax.errors import ConfigError
from sao_jax.envs import base
from sao_jax.envs import datasets
from sao_jax.tokenizers import CharTokenizer, HFTokenizer, Tokenizer

_KINDS = ('malformed', 'duplicate', 'too_long', 'unrenderable', 'unused')


@dataclasses.dataclass(frozen=True)
class Skipped:
  """One row the run will not use: `kind` is one of 'malformed', 'duplicate' (skipped at load), 'too_long',
  'unrenderable' (its prompt does not fit, or the tokenizer cannot render it), 'unused' (left out by the split)."""
  row: int
  kind: str
  reason: str


@dataclasses.dataclass
class FileCheck:
  """One data file: `rows` read, `used` by the run (train or eval), every other row in `skipped` (by row)."""
  field: str
  path: str
  rows: int
  used: int
  skipped: list[Skipped]

  def counts(self) -> dict[str, int]:
    """Skipped rows by kind (kinds with none left out)."""
    got = collections.Counter(s.kind for s in self.skipped)
    return {k: got[k] for k in _KINDS if got[k]}


@dataclasses.dataclass
class DataReport:
  """What the run will use of its data: per file, the rows skipped and why; `str()` is the printable report.

  Attributes:
    max_seq_len: the episode budget (`config.sampler.max_seq_len`); a prompt fits with < max_seq_len tokens.
    files: one `FileCheck` per data file read (none for a generated task).
    generated_checked: prompts of a generated task's eval set measured (0 for a task read from files).
    longest_prompt: tokens of the longest prompt kept.
    seconds: how long the check took (the task's build, which read the files, not included).
  """
  max_seq_len: int
  files: list[FileCheck]
  generated_checked: int = 0
  longest_prompt: int = 0
  seconds: float = 0.0

  @property
  def skipped(self) -> int:
    return sum(len(f.skipped) for f in self.files)

  def counts(self) -> dict[str, int]:
    """Skipped rows of all files by kind (kinds with none left out)."""
    total = collections.Counter()
    for f in self.files:
      total.update(f.counts())
    return {k: total[k] for k in _KINDS if total[k]}

  def summary(self) -> str:
    """One line: rows read, used and skipped by kind, the longest prompt kept and the budget."""
    budget = f'at most {self.max_seq_len - 1} prompt tokens: config.sampler.max_seq_len={self.max_seq_len}'
    if not self.files:
      return (f'data check: no rows skipped (generated problems: {self.generated_checked} eval prompts measured, '
              f'longest {self.longest_prompt} tokens; {budget}).')
    rows, used = sum(f.rows for f in self.files), sum(f.used for f in self.files)
    if not self.skipped:
      return (f'data check: no rows skipped ({len(self.files)} file(s), {rows} rows, all used; longest prompt '
              f'{self.longest_prompt} tokens; {budget}).')
    kinds = ', '.join(f'{n} {k}' for k, n in self.counts().items())
    return (f'data check: {rows} rows, {used} used, {self.skipped} skipped ({kinds}); longest prompt kept '
            f'{self.longest_prompt} tokens; {budget}.')

  def format(self, max_rows: int = 50) -> str:
    """The report: the summary line, then per file its counts and up to `max_rows` skipped rows, one a line."""
    lines = [self.summary()]
    for f in self.files if self.skipped else ():
      lines.append(f'config.{f.field}={f.path}: {f.rows} rows, {f.used} used, {len(f.skipped)} skipped')
      lines += [f'  {f.path} row {s.row}: {s.reason}' for s in f.skipped[:max_rows]]
      if len(f.skipped) > max_rows:
        lines.append(f'  ... and {len(f.skipped) - max_rows} more')
    return '\n'.join(lines)

  def __str__(self) -> str:
    return self.format()


def check_task_data(config: Any, task: base.Task, tokenizer: Tokenizer) -> DataReport:
  """Measures every prompt the run will use against the episode budget; filters `task` in place; logs.

  See the module docstring for the rules. Call it once, right after the task and the tokenizer are built and
  before `task.train_iterator` (the run's start, `--dry_run`).

  Raises:
    ConfigError: naming `config.<field>` and the file when no problem of a file fits, or naming
      `config.sampler.max_seq_len` when no training or eval problem is left or a generated problem does not fit.
  """
  t0 = time.perf_counter()
  max_seq_len = int(config.sampler.max_seq_len)
  measure = _Measure(tokenizer, max_seq_len)
  problems = task.file_problems()
  in_files = [ex for ex in problems if 'file' in ex.data]
  if not problems:  # Generated: the eval set only.
    generated = task.eval_set()
    for ex in generated:
      if (verdict := measure(ex)) is not None:
        raise ConfigError(f'config.sampler.max_seq_len={max_seq_len}: the eval problem {ex.uid!r:.80} of task '
                          f'{task.name!r}: {verdict.reason}; generated problems cannot be skipped: raise the '
                          'budget.')
    report = DataReport(max_seq_len, [], len(generated), measure.longest(), time.perf_counter() - t0)
    logging.info('%s', report.summary())
    return report
  for ex in problems:  # Problems in code (a custom task's), not from a file: refused as generated ones are.
    if 'file' not in ex.data and (verdict := measure(ex)) is not None:
      raise ConfigError(f'config.sampler.max_seq_len={max_seq_len}: the problem {ex.uid!r:.80} of task '
                        f'{task.name!r}: {verdict.reason}.')

  too_long: dict[tuple[str, int], _Verdict] = {}
  for ex in in_files:
    key = (ex.data['file'], ex.data['row'])
    if key not in too_long and (verdict := measure(ex)) is not None:
      too_long[key] = verdict
  had_eval = bool(task.eval_set())
  if too_long:
    task.filter_problems(lambda ex: (ex.data.get('file'), ex.data.get('row')) not in too_long)

  in_use = collections.defaultdict(set)
  for ex in in_files:
    in_use[ex.data['file']].add(ex.data['row'])
  files = []
  for rep in task.file_reports:
    skipped = [Skipped(n, 'duplicate' if why.startswith('duplicate') else 'malformed', why)
               for n, why in rep.skipped]
    long_rows = [n for n in rep.kept if (rep.path, n) in too_long]
    skipped += [Skipped(n, too_long[rep.path, n].kind, too_long[rep.path, n].reason) for n in long_rows]
    if 'eval_file' in rep.field:  # Eval-file rows past the eval set's size.
      unused = f'beyond config.task.eval_size={task.eval_size}'
    else:  # Training rows whose prompt is an eval-file problem's (`datasets.split`).
      unused = 'its prompt is also an eval problem (held out of training)'
    skipped += [Skipped(n, 'unused', unused) for n in rep.kept if n not in in_use[rep.path]]
    skipped.sort(key=lambda s: s.row)
    check = FileCheck(rep.field, rep.path, rep.rows, rep.rows - len(skipped), skipped)
    files.append(check)
    if long_rows:
      limit = datasets.MAX_REPORTED_ROWS
      shown = '; '.join(f'row {n} ({too_long[rep.path, n].tokens})' for n in long_rows[:limit])
      more = f' (and {len(long_rows) - limit} more)' if len(long_rows) > limit else ''
      logging.warning('config.%s=%r: skipped %d problem(s) whose prompt does not fit config.sampler.max_seq_len=%d '
                      '(at most %d prompt tokens, so that one generated token fits) or cannot be rendered: %s%s',
                      rep.field, rep.path, len(long_rows), max_seq_len, max_seq_len - 1, shown, more)
      if not check.used:
        raise ConfigError(f'config.{rep.field}={rep.path!r}: no problem of its {len(rep.kept)} fits '
                          f'config.sampler.max_seq_len={max_seq_len} (row {long_rows[0]}: '
                          f'{too_long[rep.path, long_rows[0]].reason}).')
  if isinstance(task, base.DatasetTask) and not task.train_examples():
    raise ConfigError(f'config.sampler.max_seq_len={max_seq_len}: no training problem has a prompt that fits.')
  if had_eval and not task.eval_set():
    raise ConfigError(f'config.sampler.max_seq_len={max_seq_len}: no eval problem has a prompt that fits.')
  report = DataReport(max_seq_len, files, 0, measure.longest(), time.perf_counter() - t0)
  logging.info('%s', report.summary())
  return report


class _Verdict(NamedTuple):
  """Why a prompt is skipped: `kind` ('too_long' or 'unrenderable'), `reason` in full, `tokens` in short ('at
  least 4615392 tokens', 'unrenderable')."""
  kind: str
  reason: str
  tokens: str


class _Measure:
  """`measure(example)`: None when the example's prompt fits the budget, else a `_Verdict`; `longest()` is the
  longest prompt that fitted, in tokens.

  A prompt whose length bounds (`_Bounds`) decide it is not tokenized: a floor at or over the budget is too long,
  a ceiling under it fits; only the prompts between are tokenized as the runner does.
  """

  def __init__(self, tokenizer: Tokenizer, max_seq_len: int):
    self.tokenizer = tokenizer
    self.max_seq_len = max_seq_len
    self.bounds = _Bounds.of(tokenizer)
    self._longest = 0
    self._widest: tuple[int, list[base.Message]] = (0, [])  # The largest ceiling of a prompt not tokenized.

  def _too_long(self, tokens: str) -> _Verdict:
    return _Verdict('too_long', f'a prompt of {tokens} does not fit config.sampler.max_seq_len={self.max_seq_len} '
                    f'(at most {self.max_seq_len - 1} prompt tokens)', tokens)

  def __call__(self, example: base.Example) -> _Verdict | None:
    messages = example.messages()
    if self.bounds is not None:
      try:
        text = self.tokenizer.render_chat(messages, True)  # pytype: disable=attribute-error
      except Exception:  # pylint: disable=broad-except  (apply_chat_template below reports it)
        text = None
      if text is not None:
        floor = self.bounds.floor(text)
        if floor >= self.max_seq_len:
          return self._too_long(f'at least {floor} tokens')
        ceiling = self.bounds.ceiling(text)
        if ceiling < self.max_seq_len:
          self._widest = max(self._widest, (ceiling, messages), key=lambda w: w[0])
          return None
    try:
      n = len(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)[0])
    except (ValueError, TypeError, LookupError) as e:
      return _Verdict('unrenderable', f'the tokenizer cannot render its prompt: {str(e)[:200]}', 'unrenderable')
    if n >= self.max_seq_len:
      return self._too_long(f'{n} tokens')
    self._longest = max(self._longest, n)
    return None

  def longest(self) -> int:
    """Tokens of the longest prompt that fitted (the widest one not tokenized is tokenized now)."""
    if self._widest[0] > self._longest:
      n = len(self.tokenizer.apply_chat_template(self._widest[1], add_generation_prompt=True)[0])
      self._longest, self._widest = max(self._longest, n), (0, [])
    return self._longest


@dataclasses.dataclass(frozen=True)
class _Bounds:
  """Bounds on `len(tokenizer.encode(text))` from the text's length alone: `floor(text) <= tokens <=
  ceiling(text)`.

  Each token covers at least one and at most `longest` units of the text, and no unit is dropped, so
  units / longest <= tokens <= units:
  * char tokenizer: characters; `longest` its longest token (`<|assistant|>`);
  * HF BPE with a byte-level pre-tokenizer (GPT-2, Llama 3, Qwen, SmolLM): UTF-8 bytes of the (normalized) text,
    every byte a symbol of the byte alphabet (all in the vocabulary); a token covers as many bytes as its string
    has characters;
  * HF BPE over characters (SentencePiece-style, Metaspace): characters, every one a vocabulary symbol, a byte
    fallback token (all 256 in the vocabulary) or an unknown token of its own (`fuse_unk` off); floor only (a
    character may take several byte tokens);
  and no pre-tokenizer step may remove text. Added tokens cover their content (the char tokenizer's are made of
  its single characters, so a text of those always encodes). The ceiling of a byte-level BPE
  holds when nothing lengthens the text per piece (no `add_prefix_space`, no normalizer but a Unicode normal
  form); otherwise, and for any other tokenizer (WordPiece, Unigram, a fused unknown token), the bound is
  unknown (floor 0, ceiling infinite) and the prompt is tokenized.
  """
  longest: int
  in_bytes: bool
  normalizer: Any = None
  has_ceiling: bool = False
  alphabet: frozenset[str] | None = None  # The characters it encodes, when others fail (char tokenizer).

  @classmethod
  def of(cls, tokenizer: Tokenizer) -> _Bounds | None:
    """The bounds of `tokenizer`; None when it has none."""
    if isinstance(tokenizer, CharTokenizer):
      tokens = [tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size)]
      alphabet = frozenset(t for t in tokens if len(t) == 1) if tokenizer.on_unknown == 'error' else None
      return cls(max(map(len, tokens)), in_bytes=False, has_ceiling=True, alphabet=alphabet)
    if not isinstance(tokenizer, HFTokenizer):
      return None
    tok = tokenizer.tokenizer
    try:
      from tokenizers import pre_tokenizers  # pylint: disable=g-import-not-at-top  (HF tokenizers only)
      model = tok.model
      if type(model).__name__ != 'BPE':
        return None
      pre = json.loads(tok.pre_tokenizer.__getstate__()) if tok.pre_tokenizer is not None else None
      steps = [] if pre is None else pre.get('pretokenizers', []) if pre.get('type') == 'Sequence' else [pre]
      if any(s.get('type') not in ('ByteLevel', 'Metaspace', 'Digits', 'Split', 'Punctuation')
             or s.get('behavior') in ('Removed', 'removed') for s in steps):
        return None
      vocab = tok.get_vocab(with_added_tokens=False)
      in_bytes = any(s.get('type') == 'ByteLevel' for s in steps)
      if in_bytes:
        if not set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys():
          return None  # A byte without a symbol would be dropped.
      elif not ((model.byte_fallback and all(f'<0x{b:02X}>' in vocab for b in range(256)))
                or (model.unk_token and not model.fuse_unk)):
        return None  # An unknown character could be dropped, or many fused into one token.
      added = [len(t.content.encode('utf-8') if in_bytes else t.content)
               for t in tok.get_added_tokens_decoder().values()]
      normalizer = tok.normalizer
      normal_form = normalizer is None or json.loads(normalizer.__getstate__()).get('type') in (
          'NFC', 'NFD', 'NFKC', 'NFKD')
      has_ceiling = in_bytes and normal_form and not any(s.get('add_prefix_space') for s in steps)
      return cls(max([len(s) for s in vocab] + added), in_bytes, normalizer, has_ceiling)
    except Exception:  # pylint: disable=broad-except  (an unfamiliar tokenizer: no bound, every prompt tokenized)
      return None

  def _units(self, text: str) -> int:
    return len(text.encode('utf-8', errors='surrogatepass')) if self.in_bytes else len(text)

  def _sizes(self, text: str) -> tuple[int, int]:
    """(fewest, most) units of the text before and after the normalizer (NFC shortens e + U+0301 and lengthens
    U+0958)."""
    size = self._units(text)
    if self.normalizer is None:
      return size, size
    normalized = self._units(self.normalizer.normalize_str(text))
    return min(size, normalized), max(size, normalized)

  def floor(self, text: str) -> int:
    return self._sizes(text)[0] // self.longest

  def ceiling(self, text: str) -> int | float:
    """Infinite also for a text the tokenizer may refuse (tokenizing it says why)."""
    if not self.has_ceiling or (self.alphabet is not None and not self.alphabet.issuperset(text)):
      return float('inf')
    return self._sizes(text)[1]
