"""Metrics to `<workdir>/metrics.jsonl` (the source of truth) and TensorBoard, resume-aware."""

from __future__ import annotations

import json
import math
import os

import numpy as np


def _plain(v):
  if isinstance(v, (list, tuple)):
    return [_plain(x) for x in v]
  if v is None or isinstance(v, str):
    return v
  v = float(np.asarray(v))
  return v if math.isfinite(v) else None  # JSON has no NaN or Inf


def _rows(path: str, text: str) -> list[tuple[str, dict]]:
  """(line, row) pairs of a metrics file's text; a last line without its newline is a row a kill
  cut short: dropped."""
  lines = text.splitlines(keepends=True)
  if lines and not lines[-1].endswith("\n"):
    lines.pop()
  out = []
  for i, line in enumerate(lines):
    if line.strip():
      try:
        out.append((line, json.loads(line)))
      except json.JSONDecodeError:
        raise ValueError(f"{path} line {i + 1} is not a JSON row: {line[:80]!r}") from None
  return out


class MetricsWriter:
  """Appends one JSON object per step. Started at `start_step`, it first drops lines of later
  steps (written after the checkpoint the run resumes from), so the file reads as if the run
  had never stopped. With `write_files=False` (every process of several but the first) it
  writes nothing."""

  def __init__(self, workdir: str, start_step: int = 0, tensorboard: bool = True,
               write_files: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._fh = self._tb = None
    if not write_files:
      return
    if os.path.exists(self.path):
      with open(self.path) as fh:
        old = fh.read()
      keep = "".join(line for line, row in _rows(self.path, old) if row["step"] < start_step)
      if keep != old:  # a new file replaces the old whole: a kill here leaves one or the other
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
          fh.write(keep)
          fh.flush()
          os.fsync(fh.fileno())
        os.replace(tmp, self.path)
    self._fh = open(self.path, "a")
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step)

  def write(self, step: int, metrics: dict) -> dict:
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    if self._fh is None:
      return row
    self._fh.write(json.dumps(row) + "\n")
    self._fh.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
    return row

  def sync(self) -> None:
    """To disk: called before a checkpoint is saved, so no checkpoint counts a row the disk
    has not got, even if the machine goes down."""
    if self._fh is None:
      return
    self._fh.flush()
    os.fsync(self._fh.fileno())

  def close(self) -> None:
    if self._fh is not None:
      self._fh.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as fh:
    return [row for _, row in _rows(path, fh.read())]
