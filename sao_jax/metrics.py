"""Run metrics: `WORKDIR/metrics.jsonl`, TensorBoard events, optional wandb, and the console progress line.

    writer = MetricsWriter(workdir, resume_step=restored_step)   # drops rows past a restored checkpoint
    writer.write(step, {'reward_mean': 0.4, 'learner/loss': ...})
    progress = Progress(total_steps=config.trainer.num_steps, start_step=restored_step)
    logging.info(progress.line(step, metrics))
    writer.close()

`metrics.jsonl` holds one JSON object per learner step, `{"step": s, ...}`, each step exactly once across
resumes: opening a writer with `resume_step=s` first drops every row with `step > s` (rows written after the
checkpoint the run resumed from). Non-finite floats are written as `null` (JSON has no NaN). Only process 0
writes; on other processes the writer does nothing.

The workdir may be a URI (`gs://bucket/run`, `sao_jax.paths`): an object cannot be appended to, so the file and the
TensorBoard events are then written in a local staging directory and uploaded whole every `sync_every_s`, at
`flush()` (the trainer flushes before each checkpoint, so the rows up to a checkpoint are in the bucket when it is)
and at `close()`. A local workdir is written in place, each row flushed as it is written.
"""

from __future__ import annotations

import collections
import json
import logging as logging_std
import math
import numbers
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from absl import logging
import jax
import numpy as np

from sao_jax import paths
from sao_jax.errors import RunError

METRICS_FILE = 'metrics.jsonl'


class _LibraryInfoFilter(logging_std.Filter):
  """Drops INFO lines from the given libraries' source files (orbax logs every file rename of a save), and the
  tracebacks of their errors (a failed save logs its error, with a traceback, from each of its threads: the
  message line stays; the run reports the error itself, `trainer`'s save)."""

  def __init__(self, packages: tuple[str, ...]):
    super().__init__()
    self._parts = tuple(f'{os.sep}{p}{os.sep}' for p in packages)

  def filter(self, record: logging_std.LogRecord) -> bool:
    ours = any(p in record.pathname for p in self._parts) or (  # Or asyncio's report of their failed tasks.
        record.name == 'asyncio' and any(p in record.getMessage() for p in self._parts))
    if not ours:
      return True
    if record.exc_info and record.exc_info[1] is not None:
      error = record.exc_info[1]
      record.exc_info, record.exc_text = None, f'{type(error).__name__}: {str(error).splitlines()[0][:300]}'
    return record.levelno >= logging_std.WARNING


def quiet_library_logs(packages: tuple[str, ...] = ('orbax',)) -> None:
  """Keeps the console readable: INFO lines of `packages` are dropped (warnings and errors still show)."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _LibraryInfoFilter) for f in handler.filters):
    handler.addFilter(_LibraryInfoFilter(packages))


def _scalar(value: Any) -> float | int | bool | str | None:
  """A JSON value for one metric: Python numbers as they are, numpy/jax scalars converted, non-finite -> None."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  value = float(np.asarray(value))
  return value if math.isfinite(value) else None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The rows of `WORKDIR/metrics.jsonl` (a torn last line, from a killed process, is skipped)."""
  path = paths.join(workdir, METRICS_FILE)
  if not paths.exists(path):
    return []
  rows = []
  with paths.open_file(path) as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return rows


def truncate_metrics(workdir: str, last_step: int) -> int:
  """Drops rows with `step > last_step` (and torn lines) from `WORKDIR/metrics.jsonl`; returns rows dropped.

  The file is replaced whole (`paths.write_text`: a temporary file renamed over it, or one upload), so a kill
  leaves one or the other.
  """
  path = paths.join(workdir, METRICS_FILE)
  if not paths.exists(path):
    return 0
  with paths.open_file(path) as f:
    lines = f.readlines()
  kept = []
  for line in lines:
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if int(row.get('step', -1)) <= last_step:
      kept.append(line if line.endswith('\n') else line + '\n')
  dropped = len(lines) - len(kept)
  if dropped:
    paths.write_text(path, ''.join(kept))
  return dropped


def _drop_torn_tail(path: str) -> None:
  """Cuts a last line without its newline (a row torn by a kill or a full disk) off a local file."""
  if not os.path.exists(path):
    return
  with open(path, 'rb+') as f:
    size = f.seek(0, os.SEEK_END)
    if not size:
      return
    f.seek(max(0, size - (1 << 20)))
    tail = f.read()
    if tail.endswith(b'\n'):
      return
    cut = tail.rfind(b'\n')
    keep = size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= (1 << 20) else size)
    logging.warning('%s: dropped a torn last line (%d bytes).', path, size - keep)
    f.truncate(keep)


class MetricsWriter:
  """Writes one row per step to `metrics.jsonl`, TensorBoard (`WORKDIR/tensorboard`) and optionally wandb.

  Args:
    workdir: the run's directory (a local path or a URI, module docstring).
    resume_step: the step restored from a checkpoint: rows past it are dropped first (-1: every row, a run
      starting over; None: existing rows are kept). A torn last line is always dropped.
    tensorboard: also write TensorBoard event files.
    wandb_project: log to this wandb project too ('' = off; needs the `wandb` package).
    config: the run's config, recorded by wandb.
    sync_every_s: a remote workdir's files are uploaded at least this often (and at `flush` and `close`).
  """

  def __init__(self, workdir: str, *, resume_step: int | None = None, tensorboard: bool = True,
               wandb_project: str = '', config: Mapping[str, Any] | None = None, sync_every_s: float = 30.0):
    self.workdir = workdir
    self.enabled = jax.process_index() == 0
    self._file = None
    self._tb = None
    self._wandb = None
    self._stage = None
    if not self.enabled:
      return
    paths.makedirs(workdir)
    if resume_step is not None:
      dropped = truncate_metrics(workdir, resume_step)
      if dropped:
        logging.info('metrics.jsonl: dropped %d row(s) past the restored step %d.', dropped, resume_step)
    # The workdir itself when it is local; else a local copy of metrics.jsonl, appended to and uploaded whole.
    self._stage = paths.StagedDir(workdir, fetch=(METRICS_FILE,), sync_every_s=sync_every_s)
    local = os.path.join(self._stage.local, METRICS_FILE)
    _drop_torn_tail(local)
    self._file = open(local, 'ab', buffering=0)  # Unbuffered: a row is in the file or, if its write failed, not.
    if tensorboard:
      # Imported here: tensorboardX imports torch when it is installed (about 2 s of every process's start).
      # Its own gs:// writer would bypass `paths` (google-cloud-storage, the whole file re-sent at each flush):
      # the events go to the staging directory instead, uploaded with metrics.jsonl.
      import tensorboardX  # pylint: disable=g-import-not-at-top
      self._tb = tensorboardX.SummaryWriter(os.path.join(self._stage.local, 'tensorboard'),
                                            purge_step=None if resume_step is None else resume_step + 1)
    if wandb_project:
      import wandb  # pylint: disable=g-import-not-at-top  (optional dependency)
      # wandb keeps its local files in a directory of its own (a remote workdir: a temporary one; wandb uploads them).
      wandb_dir = workdir if paths.is_local(workdir) else tempfile.mkdtemp(prefix='sao_jax_wandb_')
      self._wandb = wandb.init(project=wandb_project, dir=wandb_dir, config=dict(config or {}), resume='allow')

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Appends the row `{"step": step, **metrics}` whole, in one unbuffered write (a kill loses at most this row).

    Raises:
      RunError: the row could not be written (e.g. no space left); the file is left without any part of it.
    """
    if not self.enabled:
      return
    row = {'step': int(step)}
    row.update((k, _scalar(v)) for k, v in metrics.items())
    data = (json.dumps(row, sort_keys=False) + '\n').encode()
    end = self._file.seek(0, os.SEEK_END)
    try:
      view = memoryview(data)
      while view:  # A raw write may write part of it (a disk filling up): the rest, or the OSError that follows.
        view = view[self._file.write(view):]
    except OSError as e:
      try:
        self._file.truncate(end)  # No half-written row is left behind.
      except OSError:
        pass  # (A torn last line is dropped when the file is next opened.)
      raise RunError(f'{os.path.join(self.workdir, METRICS_FILE)}: could not write the row of step {step}: '
                     f'{e.strerror or e}.') from e
    if self._tb is not None:
      for k, v in row.items():
        if k != 'step' and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, global_step=step)
    if self._wandb is not None:
      self._wandb.log({k: v for k, v in row.items() if v is not None}, step=int(step))
    if self._stage.due():
      self.flush()

  def update(self, step: int, metrics: Mapping[str, Any]) -> None:
    """Adds `metrics` to the row of `step` (already written: e.g. the eval of a step that a signal interrupted,
    done by the resumed run). The file is replaced whole (`paths.write_text`), then appended to again."""
    if not self.enabled:
      return
    local = os.path.join(self._stage.local, METRICS_FILE)
    self._file.close()
    with open(local, encoding='utf-8') as f:
      lines = f.readlines()
    for i, line in enumerate(lines):
      row = json.loads(line)
      if row.get('step') == int(step):
        row.update((k, _scalar(v)) for k, v in metrics.items())
        lines[i] = json.dumps(row, sort_keys=False) + '\n'
    paths.write_text(local, ''.join(lines))
    self._file = open(local, 'ab', buffering=0)
    if self._tb is not None:
      for k, v in metrics.items():
        v = _scalar(v)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, global_step=step)

  def flush(self) -> None:
    """Flushes the file and the TensorBoard events; a remote workdir gets them uploaded."""
    if self._file is not None:
      self._file.flush()
    if self._tb is not None:
      self._tb.flush()
    if self._stage is not None:
      self._stage.sync()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None
    if self._stage is not None:
      self._stage.close()
      self._stage = None
    if self._wandb is not None:
      self._wandb.finish()
      self._wandb = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class RateMeter:
  """Events per second over a sliding window of the last `window` seconds (e.g. tokens/s of the actors).

  `add(n)` records n events now; `rate()` is (events in the window) / (time the window spans).
  """

  def __init__(self, window: float = 60.0, clock=time.monotonic):
    self.window = float(window)
    self._clock = clock
    self._events: collections.deque[tuple[float, float]] = collections.deque()
    self._start = clock()
    self.total = 0.0

  def add(self, n: float) -> None:
    now = self._clock()
    self._events.append((now, float(n)))
    self.total += float(n)
    self._trim(now)

  def _trim(self, now: float) -> None:
    while self._events and self._events[0][0] <= now - self.window:
      self._events.popleft()

  def rate(self) -> float:
    now = self._clock()
    self._trim(now)
    span = min(self.window, now - self._start)
    return sum(n for _, n in self._events) / span if span > 0 else 0.0


def format_duration(seconds: float) -> str:
  """'1h02m', '3m05s', '42s'; '?' when unknown."""
  if not math.isfinite(seconds) or seconds < 0:
    return '?'
  s = int(round(seconds))
  if s >= 3600:
    return f'{s // 3600}h{s % 3600 // 60:02d}m'
  if s >= 60:
    return f'{s // 60}m{s % 60:02d}s'
  return f'{s}s'


class Progress:
  """The console progress line: step, reward, accuracy, tokens/s and the ETA from recent step times.

  The ETA is (steps left) x (mean wall time of the last `window` steps), so a slow start (compiles) does not
  inflate it for the rest of the run; a run under a time budget (`trainer.max_train_minutes`) passes the training
  time it has left, and the ETA is the sooner of the two.
  """

  def __init__(self, total_steps: int, *, start_step: int = 0, window: int = 20, clock=time.monotonic):
    self.total_steps = int(total_steps)
    self._clock = clock
    self._times: collections.deque[tuple[int, float]] = collections.deque(maxlen=window + 1)
    self._times.append((int(start_step), clock()))

  def seconds_per_step(self) -> float:
    if len(self._times) < 2:
      return math.nan
    (s0, t0), (s1, t1) = self._times[0], self._times[-1]
    return (t1 - t0) / (s1 - s0) if s1 > s0 else math.nan

  def line(self, step: int, metrics: Mapping[str, Any], time_left_s: float | None = None) -> str:
    """Records that `step` just finished and returns its line (`time_left_s`: of the run's time budget)."""
    self._times.append((int(step), self._clock()))
    eta = self.seconds_per_step() * (self.total_steps - step)
    if time_left_s is not None:
      eta = min(eta, max(0.0, float(time_left_s))) if math.isfinite(eta) else max(0.0, float(time_left_s))
    parts = [f'step {step}/{self.total_steps}']
    for key, label, fmt in (('reward_mean', 'reward', '.3f'), ('eval_accuracy', 'acc', '.3f'),
                            ('actor/tokens_per_s', 'actor tok/s', '.0f'),
                            ('learner/tokens_per_s', 'learner tok/s', '.0f'),
                            ('staleness/mean', 'lag', '.2f')):
      value = metrics.get(key)
      if value is not None and math.isfinite(float(value)):
        parts.append(f'{label} {float(value):{fmt}}')
    parts.append(f'{self.seconds_per_step():.2f}s/step' if math.isfinite(self.seconds_per_step()) else '?s/step')
    parts.append(f'ETA {format_duration(eta)}')
    return ' | '.join(parts)
