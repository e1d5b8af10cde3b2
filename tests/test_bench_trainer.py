"""The trainer-cost benchmark: its refusals, and (slow) two modes end to end at tiny size."""

import json

import pytest

from experiments import bench_trainer


@pytest.mark.parametrize("flag,message", [
    ("--modes=fp4_qat,nope", "--modes: ['nope']; choose from"), ("--steps=0", "--steps must be"),
    ("--family=nope", "no configs/nope.py"), ("--step=rl", "--step: invalid choice: 'rl'")])
def test_bad_arguments_are_named(capsys, flag, message):
  with pytest.raises(SystemExit):
    bench_trainer.main([flag])
  assert message in capsys.readouterr().err


def test_a_batch_the_minibatches_do_not_split_is_refused():
  with pytest.raises(SystemExit, match="--sequences=7 does not split into rl.minibatches=2"):
    bench_trainer.main(["--config_arg=smoke", "--sequences=7"])


def test_table_states_each_mode_against_unguided_qat():
  row = dict(records="none", first_call_s=1.0, step_ms=10.0, step_ms_min=9.0, step_ms_max=11.0,
             record_bytes_per_token=0.0)
  table = bench_trainer.table([dict(row, mode="fp4_qat"),
                               dict(row, mode="trace", records="last:1", step_ms=10.5,
                                    record_bytes_per_token=120.0)])
  assert "| trace | last:1 | 10.5 (9.0-11.0) | 1.050x | 120.0 | 1.0 |" in table
  assert "| warm-start step ms (median; min-max) |" in bench_trainer.table(
      [dict(row, mode="warm start")], "sft")


@pytest.mark.slow  # ~1 minute on 2 cores
def test_quick_run_times_the_warm_start_once_for_every_mode():
  result = bench_trainer.main(["--quick", "--modes=fp4_qat,trace", "--step=sft",
                               "--deterministic"])
  [row] = result["rows"]
  assert row["mode"] == "warm start" and row["records"] == "none"
  assert result["step"] == "sft" and result["deterministic"]
  assert row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]


@pytest.mark.slow  # ~2 minutes on 2 cores: two modes compiled and stepped
def test_quick_run_times_each_mode_and_counts_the_records_bytes(tmp_path):
  out = tmp_path / "trainer.json"
  result = bench_trainer.main(["--quick", "--modes=fp4_qat,trace_all", f"--out={out}"])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  qat, trace_all = result["rows"]
  assert qat["record_bytes_per_token"] == 0 and trace_all["record_bytes_per_token"] > 0
  for row in result["rows"]:
    assert row["step_ms_min"] <= row["step_ms"] <= row["step_ms_max"]
    assert row["tokens_per_step"] == 8 * (8 + 16 - 1)
