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


class MetricsWriter:
  """Appends one JSON object per step. Started at `start_step`, it first drops lines of later
  steps (written after the checkpoint the run resumes from), so the file reads as if the run
  had never stopped."""

  def __init__(self, workdir: str, start_step: int = 0, tensorboard: bool = True):
    self.path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(self.path):
      with open(self.path) as fh:
        keep = [line for line in fh if line.strip() and json.loads(line)["step"] < start_step]
      with open(self.path, "w") as fh:
        fh.writelines(keep)
    self._fh = open(self.path, "a")
    self._tb = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"), purge_step=start_step)

  def write(self, step: int, metrics: dict) -> dict:
    row = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
    self._fh.write(json.dumps(row) + "\n")
    self._fh.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step" and isinstance(v, float):
          self._tb.add_scalar(k, v, step)
    return row

  def close(self) -> None:
    self._fh.close()
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl")) as fh:
    return [json.loads(line) for line in fh if line.strip()]
