"""A format registered by a user (MXFP4 with 16-element blocks) runs through the mismatch probe
and a few RL steps, by name, with no list of formats edited anywhere."""

import pytest

from configs import mismatch as mismatch_config
from tests.test_main import data_dir, smoke  # noqa: F401 (data_dir: a fixture)
from trace_jax import mismatch
from trace_jax.quant import FORMATS, register
from trace_jax.quant.formats import MXFP4Format
from trace_jax.rl.loop import train
from trace_jax.rl.writer import read_metrics

NAME = "mxfp4_b16"


@pytest.fixture
def registered():
  fmt = register(MXFP4Format(name=NAME, block_size=16))
  yield fmt
  del FORMATS[NAME]


def test_probe_takes_a_registered_format(registered):
  c = mismatch_config.get_config("quick,max_new_tokens=8")
  c.precisions, c.guidance, c.routing_replay = NAME, "none,all", "on"
  rows = mismatch.run(c, log=lambda *_: None)
  assert [r["rollout_quant"] for r in rows] == [NAME, NAME]
  guided = next(r for r in rows if r["records"] == "all")
  unguided = next(r for r in rows if r["records"] == "none")
  assert guided["mismatch/flip_rate"] == 0.0 and unguided["mismatch/flip_rate"] > 0
  # 16-element blocks: a record byte of scales every 16 elements, not 32
  assert guided["record/bytes_per_token"] > 0


# a minute or two of CPU: the registered format's rollout, records and recompute are checked by
# the probe's test above; the RL run around them in the slow selection
@pytest.mark.slow
def test_rl_runs_with_a_registered_format_and_a_mixed_recipe(registered, data_dir, tmp_path):
  c = smoke(data_dir, "trace_all", f"rl.fp4={NAME}", "rl.steps=2", "sft.steps=2",
            "log.flip_rate_every=1")
  # (set here, as --config.rl.rollout_recipe=... would: a variant string splits at commas)
  c.rl.rollout_recipe = c.rl.train_recipe = f"weights=mxfp4,acts={NAME},kv={NAME}"
  train(c, str(tmp_path), progress=False, log=lambda *_: None)
  rl = [r for r in read_metrics(str(tmp_path)) if r.get("phase") == "rl"]
  assert len(rl) == 2 and all(r["mismatch/flip_rate"] == 0.0 for r in rl)
