"""Problem files (JSONL, JSON, CSV, Parquet) -> `Example`s, with malformed rows skipped and counted.

Rows are dicts. A task turns each row into an `Example` with a `convert(row_number, row)` function that
raises `BadRow(reason)` for a malformed row; each example built records its source in `data['file']` and
`data['row']`. Malformed rows are skipped, reported in one warning with their row numbers and reasons, and
counted in the file's `FileReport` (which the start-of-run data check, `envs.data_check`, reports): a JSONL/CSV
line that is not valid UTF-8 or not valid JSON, nesting too deep for the parser (`RecursionError`), a missing or
empty field, a second row with the id or the (normalised) prompt of an earlier one. A file that cannot be read
at all (a corrupt Parquet, a JSON file with invalid UTF-8), a file with no valid row, a missing file or an
unknown extension fail with a `ConfigError` naming the config field and the file.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging
import numpy as np

from sao_jax.errors import ConfigError
from sao_jax.envs import base

SPLIT_SEED = 0x5EED  # The eval/train split is fixed by this seed, not by the training seed.
MAX_REPORTED_ROWS = 20  # Rows named in one warning line; the rest are counted.


class BadRow(ValueError):
  """A malformed row; the message says why."""


@dataclasses.dataclass
class FileReport:
  """What loading one data file kept and skipped.

  Attributes:
    field: the config field naming the file, e.g. 'task.kwargs.data_file'.
    path: the file.
    rows: the rows read (row numbers as `read_rows` numbers them).
    kept: the row numbers of the examples built, in order.
    skipped: (row number, reason) of every row skipped at load (malformed or duplicate), in order.
  """
  field: str
  path: str
  rows: int
  kept: list[int]
  skipped: list[tuple[int, str]]


def _jsonl_row(n: int, raw: bytes) -> Any:
  """One JSONL line -> its row, or a `BadRow` saying why not."""
  try:
    line = raw.decode('utf-8')
  except UnicodeDecodeError as e:
    return BadRow(f'invalid UTF-8 at byte {e.start} of the line')
  try:
    return json.loads(line)
  except json.JSONDecodeError as e:
    return BadRow(f'invalid JSON ({e.msg})')
  except RecursionError:
    return BadRow('nested too deeply to parse')
  except ValueError as e:  # E.g. an integer beyond the int-to-str digit limit.
    return BadRow(f'invalid JSON ({e})'[:200])


def _csv_rows(path: str) -> list[tuple[int, Any]]:
  """CSV rows; a row with bytes that are not UTF-8 comes back as a `BadRow`."""
  rows = []
  with open(path, encoding='utf-8', errors='surrogateescape', newline='') as f:
    for n, row in enumerate(csv.DictReader(f), 1):
      bad = [k for k, v in row.items() for x in (k, v) if isinstance(x, str) and _has_surrogates(x)]
      rows.append((n, BadRow(f'invalid UTF-8 in column {bad[0]!r:.40}') if bad else row))
  return rows


def _has_surrogates(text: str) -> bool:
  try:
    text.encode('utf-8')
    return False
  except UnicodeEncodeError:
    return True


def read_rows(path: str, field: str) -> list[tuple[int, Any]]:
  """(row_number, row) pairs; row numbers are 1-based (the line number for JSONL, the data row for CSV).

  A row that cannot be decoded (JSONL: invalid UTF-8 or JSON, nesting too deep; CSV: invalid UTF-8) comes back
  as a `BadRow` instance in place of the row.

  Raises:
    ConfigError: naming `config.<field>` and the file, when it is missing, of an unknown type, or unreadable as
      a whole (a corrupt Parquet file, a JSON file that does not parse).
  """
  if not path:
    raise ConfigError(f'config.{field} is empty; set it to a data file.')
  if not os.path.isfile(path):
    raise ConfigError(f'config.{field}={path!r}: no such file.')
  ext = path.lower().rsplit('.', 1)[-1]
  try:
    if ext == 'jsonl':
      with open(path, 'rb') as f:
        return [(n, _jsonl_row(n, line.removeprefix(b'\xef\xbb\xbf') if n == 1 else line))
                for n, line in enumerate(f, 1) if line.strip()]
    if ext == 'json':
      with open(path, encoding='utf-8') as f:
        data = json.load(f)
      if isinstance(data, dict):
        data = data.get('data', data.get('rows'))
      if not isinstance(data, list):
        raise ConfigError(f'config.{field}={path!r}: a JSON file must hold a list of rows '
                          '(or {"data": [...]}).')
      return list(enumerate(data, 1))
    if ext == 'csv':
      return _csv_rows(path)
    if ext == 'parquet':
      return _parquet_rows(path)
  except RecursionError as e:
    raise ConfigError(f'config.{field}={path!r}: cannot be read: nested too deeply to parse.') from e
  except (OSError, ValueError, csv.Error) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors.
    raise ConfigError(f'config.{field}={path!r}: cannot be read: {type(e).__name__}: {str(e)[:300]}') from e
  raise ConfigError(f'config.{field}={path!r}: unknown file type .{ext} (jsonl, json, csv or parquet).')


def _parquet_rows(path: str) -> list[tuple[int, Any]]:
  import pyarrow  # pylint: disable=g-import-not-at-top  (optional: only Parquet files need it)
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    return list(enumerate(pq.read_table(path).to_pylist(), 1))
  except pyarrow.ArrowException as e:  # ArrowInvalid (not a Parquet file), ArrowIOError, ...
    raise ValueError(f'not a readable Parquet file ({type(e).__name__}: {e})') from e


def build_examples(rows: Sequence[tuple[int, Any]], convert: Callable[[int, dict[str, Any]], base.Example], *,
                   path: str, field: str, reports: list[FileReport] | None = None) -> list[base.Example]:
  """Converts rows, skipping malformed and duplicate ones with one warning; raises if no row is valid.

  A row whose uid or normalised prompt repeats an earlier valid row's is skipped as a duplicate (uids key the
  eval results; a repeated prompt would be counted twice, or with two answers, contradict itself). Each example
  gets `data['file'] = path` and `data['row']` (its uid and prompt are `convert`'s). The file's `FileReport` is
  appended to `reports` when given.
  """
  out, bad = [], []
  first_uid: dict[str, int] = {}
  first_prompt: dict[str, int] = {}
  for n, row in rows:
    try:
      if isinstance(row, BadRow):
        raise row
      if not isinstance(row, dict):
        raise BadRow(f'not an object but {type(row).__name__}')
      try:
        ex = convert(n, row)
      except RecursionError:
        raise BadRow('nested too deeply') from None
      if ex.uid in first_uid:
        raise BadRow(f'duplicate id {ex.uid!r:.60} (first at row {first_uid[ex.uid]})')
      prompt = _norm(ex.prompt)
      if prompt in first_prompt:
        raise BadRow(f'duplicate prompt (first at row {first_prompt[prompt]})')
      first_uid[ex.uid], first_prompt[prompt] = n, n
      out.append(dataclasses.replace(ex, data={**ex.data, 'file': path, 'row': n}))
    except BadRow as e:
      bad.append((n, str(e)))
  if bad:
    shown = '; '.join(f'row {n}: {why}' for n, why in bad[:MAX_REPORTED_ROWS])
    more = f' (and {len(bad) - MAX_REPORTED_ROWS} more)' if len(bad) > MAX_REPORTED_ROWS else ''
    logging.warning('config.%s=%r: skipped %d malformed row(s) of %d: %s%s', field, path, len(bad), len(rows), shown,
                    more)
  if not out:
    raise ConfigError(f'config.{field}={path!r}: no valid row among {len(rows)}'
                      + (f' (first problem: row {bad[0][0]}: {bad[0][1]})' if bad else '') + '.')
  if reports is not None:
    reports.append(FileReport(field, path, len(rows), [ex.data['row'] for ex in out], bad))
  return out


def text_field(row: dict[str, Any], name: str, *, allow_numbers: bool = False) -> str:
  """A required non-empty string field (numbers converted when `allow_numbers`)."""
  if name not in row or row[name] is None:
    raise BadRow(f'missing field {name!r}')
  value = row[name]
  if allow_numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
    if isinstance(value, float) and not math.isfinite(value):
      raise BadRow(f'field {name!r} is {value}')
    value = str(value)
  if not isinstance(value, str) or not value.strip():
    raise BadRow(f'field {name!r} must be a non-empty string, got {value!r:.60}')
  return value.strip()


def _norm(text: str) -> str:
  return ' '.join(text.split()).lower()


def split(examples: Sequence[base.Example], eval_size: int, *,
          eval_examples: Sequence[base.Example] | None = None
          ) -> tuple[list[base.Example], list[base.Example]]:
  """(train, eval): disjoint by normalised prompt text.

  Without `eval_examples`, eval is the first `eval_size` examples of a permutation fixed by `SPLIT_SEED`.
  With them (a separate eval file), eval is their first `eval_size` (all when 0) and train drops any example
  whose prompt also appears in eval.
  """
  if eval_examples is None:
    if eval_size >= len(examples):
      raise ConfigError(f'config.task.eval_size={eval_size} leaves no training problem out of '
                        f'{len(examples)}; lower it or set a separate eval file.')
    order = np.random.default_rng(SPLIT_SEED).permutation(len(examples))
    eval_set = [examples[int(i)] for i in order[:eval_size]]
    rest = [examples[int(i)] for i in sorted(order[eval_size:])]
  else:
    eval_set = list(eval_examples[:eval_size] if eval_size else eval_examples)
    rest = list(examples)
  held = {_norm(e.prompt) for e in eval_set}
  train = [e for e in rest if _norm(e.prompt) not in held]
  if len(train) < len(rest):
    logging.info('Dropped %d training problem(s) that also appear in the eval set.', len(rest) - len(train))
  if not train:
    raise ConfigError('config.task.eval_size: no training problem left after holding out the eval set.')
  return train, eval_set


def load_split(data_file: str, eval_file: str, eval_size: int, convert: Callable[[int, dict[str, Any]], base.Example],
               reports: list[FileReport]) -> tuple[list[base.Example], list[base.Example]]:
  """(train, eval) of a task read from files: the rows of `data_file` (`config.task.kwargs.data_file`) and, when
  given, `eval_file` through `convert` (`build_examples`: bad rows skipped, each file's report appended to
  `reports`), then `split`."""
  def load(path: str, field: str) -> list[base.Example]:
    return build_examples(read_rows(path, field), convert, path=path, field=field, reports=reports)

  examples = load(data_file, 'task.kwargs.data_file')
  evals = load(eval_file, 'task.kwargs.eval_file') if eval_file else None
  return split(examples, eval_size, eval_examples=evals)
