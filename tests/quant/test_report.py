"""The quantization report (the main job until the RL entry point exists)."""

import json

import pytest

from trace_jax.quant import report


def test_report_rows_and_bits():
  rows = {r["format"]: r for r in report.report(tokens=32, d_model=256, d_ff=64)}
  assert set(rows) >= {"bf16", "fp8", "mxfp4", "nvfp4"}
  assert rows["mxfp4"]["storage_bits"] == 4.25 and rows["mxfp4"]["record_bits"] == 1.25
  assert rows["nvfp4"]["storage_bits"] == 4.5 and rows["nvfp4"]["record_bits"] == 1.5
  # NVFP4's finer blocks and E4M3 scales beat MXFP4 on the same tensor
  assert rows["nvfp4"]["rel_rmse"] < rows["mxfp4"]["rel_rmse"] < 0.3
  assert rows["bf16"]["rel_rmse"] < rows["fp8"]["rel_rmse"] < rows["nvfp4"]["rel_rmse"]
  for name in ("fp8", "mxfp4", "nvfp4"):
    assert rows[name]["flip_rate_plain"] > 0 and rows[name]["flip_rate_guided"] == 0


def test_main_prints_table_and_json(capsys):
  # the sizes of the test above: JAX's caches then hold every op this needs
  report.main(["--tokens=32", "--d_model=256", "--d_ff=64"])
  out = capsys.readouterr().out
  assert "mxfp4" in out and "nvfp4" in out and "4.25" in out and "1.50" in out
  report.main(["--tokens=32", "--d_model=256", "--d_ff=64", "--json"])
  lines = capsys.readouterr().out.strip().splitlines()
  assert [json.loads(line)["format"] for line in lines] == [f.name for f in report.REPORT_FORMATS]


def test_main_rejects_bad_sizes(capsys):
  with pytest.raises(SystemExit):
    report.main(["--d_model=100"])
  assert "multiples of 32" in capsys.readouterr().err
