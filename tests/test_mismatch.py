"""The mismatch probe end to end on the tiny model."""

import json

import pytest

from configs import mismatch as mismatch_config
from trace_jax import mismatch


@pytest.fixture(scope="module")
def rows():
  c = mismatch_config.get_config("quick,max_new_tokens=24")
  c.precisions = "bf16,mxfp4"
  c.guidance = "none,last:1,all"
  lines = []
  out = mismatch.run(c, log=lines.append)
  assert sum(1 for line in lines if line.startswith("{")) == len(out)
  return out


def test_rows_have_the_design_keys(rows):
  assert len(rows) == 2 + 6  # bf16: no records to guide with; mxfp4: 3 guidances x 2 replays
  for row in rows:
    json.dumps(row)
    for key in ("rollout_quant", "records", "routing_replay", "mismatch/kl_k3",
                "mismatch/logp_abs_diff_mean", "mismatch/prob_abs_diff_max",
                "mismatch/route_flip_rate", "mismatch/kl_k3_by_position",
                "record/bytes_per_token"):
      assert key in row, key
  mx = [r for r in rows if r["rollout_quant"] == "mxfp4"]
  assert all("mismatch/flip_rate/attn_in/layer_1" in r and "mismatch/flip_rate" in r for r in mx)


def test_the_picture(rows):
  get = lambda q, rec, replay: next(r for r in rows if (r["rollout_quant"], r["records"],
                                                        r["routing_replay"]) == (q, rec, replay))
  trace_all, unguided = get("mxfp4", "all", True), get("mxfp4", "none", True)
  assert mismatch.recorded_flip_rate(trace_all, n_layers=2) == 0.0
  assert trace_all["mismatch/flip_rate"] == 0.0 and unguided["mismatch/flip_rate"] > 0
  assert trace_all["mismatch/kl_k3"] < 0.2 * unguided["mismatch/kl_k3"]
  assert (trace_all["record/bytes_per_token"] > get("mxfp4", "last:1", True)["record/bytes_per_token"]
          > unguided["record/bytes_per_token"] == 0)
  assert get("mxfp4", "all", False)["mismatch/route_flip_rate"] >= 0.0
  assert trace_all["mismatch/route_flip_rate"] == 0.0


def test_table_renders(rows):
  text = mismatch.table(rows, n_layers=2)
  assert text.count("\n") == len(rows) + 1 and "mxfp4" in text


def test_bad_choices_fail_before_work():
  c = mismatch_config.get_config("quick")
  c.precisions = "bf16,fp4"
  with pytest.raises(ValueError, match="precisions='bf16,fp4'.*mxfp4"):
    mismatch.run(c)
  c = mismatch_config.get_config("quick")
  c.guidance = "last:x"
  with pytest.raises(ValueError, match="guidance='last:x'"):
    mismatch.run(c)
