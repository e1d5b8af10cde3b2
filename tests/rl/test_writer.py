"""metrics.jsonl under kills: a row torn by a kill is dropped, earlier rows are never lost."""

import io
import json

import pytest

from trace_jax.rl import writer as W
from trace_jax.rl.writer import MetricsWriter, read_metrics


def write_rows(workdir, n):
  w = MetricsWriter(str(workdir), tensorboard=False)
  for step in range(n):
    w.write(step, {"train/loss": float(step), "phase": "sft"})
  w.close()


def test_a_row_torn_by_a_kill_is_dropped(tmp_path):
  write_rows(tmp_path, 3)
  with open(tmp_path / "metrics.jsonl", "a") as fh:  # killed while writing step 3's row
    fh.write('{"step": 3, "train/lo')
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2]
  MetricsWriter(str(tmp_path), start_step=2, tensorboard=False).close()  # resumed from step 2
  assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1]


def test_a_row_that_is_not_json_is_named(tmp_path):
  write_rows(tmp_path, 3)
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
  lines[1] = "not json\n"
  (tmp_path / "metrics.jsonl").write_text("".join(lines))
  with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not a JSON row"):
    read_metrics(str(tmp_path))


class _Killed(Exception):
  pass


class _DiesHalfway(io.StringIO):
  """A file that takes half of what is written to it, then the process is killed."""

  def __init__(self, real):
    super().__init__()
    self.real = real

  def write(self, s):
    self.real.write(s[:len(s) // 2])
    self.real.flush()
    raise _Killed()

  def writelines(self, lines):
    self.write("".join(lines))

  def __exit__(self, *exc):
    self.real.close()


def test_a_kill_while_the_file_is_rewritten_loses_no_row(tmp_path, monkeypatch):
  """Resuming rewrites metrics.jsonl without the rows past the checkpoint; killed halfway
  through, the old file (or the new one) is still there whole."""
  write_rows(tmp_path, 4)
  before = (tmp_path / "metrics.jsonl").read_text()

  def dying_open(path, mode="r", *args, **kw):
    f = open(path, mode, *args, **kw)
    return _DiesHalfway(f) if "w" in mode else f

  monkeypatch.setattr(W, "open", dying_open, raising=False)
  with pytest.raises(_Killed):
    MetricsWriter(str(tmp_path), start_step=2, tensorboard=False)
  monkeypatch.undo()
  assert (tmp_path / "metrics.jsonl").read_text() == before
  assert [json.loads(line)["step"] for line in before.splitlines()] == [0, 1, 2, 3]
