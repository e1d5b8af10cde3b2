"""RL from a Hugging Face checkpoint (model.hf_path): a tiny random Qwen3-MoE written by
transformers (offline), with a tokenizer and chat template of its own, loads straight into the
training sharding and runs GRPO; the run's checkpoint reloads and resumes without the
checkpoint's weights; the mismatch probe runs on the checkpoint."""

import pathlib
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import mismatch as mismatch_config
from tests.data.test_pipeline import write_hf_tokenizer
from tests.models.test_hf import tiny_hf
from tests.rl.test_loop import compile_once  # noqa: F401 (autouse: the resume compiles nothing)
from tests.test_main import comparable, data_dir, smoke  # noqa: F401 (data_dir: a fixture)
from trace_jax import mismatch
from trace_jax import sharding as S
from trace_jax.data.tokenizer import HFTokenizer
from trace_jax.models import load_hf
from trace_jax.models.hf import read_hf_config
from trace_jax.rl.checkpoint import Checkpointer
from trace_jax.rl.loop import Run, load_run, train
from trace_jax.rl.validate import validate
from trace_jax.rl.writer import read_metrics

RL_STEPS = 3


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """Per-expert tensors, new config keys; d_ff 64, so that MXFP4 blocks of 32 tile it."""
  _, path = tiny_hf(tmp_path_factory.mktemp("hf"), fused=False, old_keys=False, norm_topk=True,
                    n_layers=1, d_ff=64)
  write_hf_tokenizer(pathlib.Path(path))
  return path


def config(data_dir, hf_path, *extra, mode="bf16"):
  # no warm start: RL from the checkpoint's weights, whose KL reference they are; prompts in
  # the chat template (~24 tokens). bf16: what the checkpoint changes is the same in every mode
  # (the FP4 modes' own tests are tests/test_main.py's; one here is slow)
  return smoke(data_dir, mode, f"model.hf_path={hf_path}", "model.chat_template=true",
               "sft.steps=0", f"rl.steps={RL_STEPS}", "rl.kl_coef=0.1", "max_prompt_len=32",
               "log.flip_rate_every=0", "checkpoint.every=2", "eval.every=100", *extra)


@pytest.fixture(scope="module")
def run(hf_dir, data_dir, tmp_path_factory):
  """-> (the run's workdir, the checkpoint it started from: a copy of its own)."""
  hf_path = str(tmp_path_factory.mktemp("hf_of_run") / "model")
  shutil.copytree(hf_dir, hf_path)
  workdir = str(tmp_path_factory.mktemp("hf_run"))
  train(config(data_dir, hf_path), workdir, progress=False, log=lambda *_: None)
  return workdir, hf_path


def test_grpo_runs_from_the_checkpoint_and_reloads_without_it(run, data_dir, tmp_path):
  run_dir, hf_path = run
  rows = read_metrics(run_dir)
  assert [(r["step"], r["phase"]) for r in rows] == [(s, "rl") for s in range(RL_STEPS)]
  assert all(np.isfinite(r["train/loss"]) for r in rows) and rows[-1]["eval/accuracy"] >= 0

  # the weights, config and tokenizer come back from the run's checkpoint alone
  moved = str(tmp_path / "moved")
  shutil.copytree(run_dir, moved)
  _, start = load_hf(hf_path)
  for f in pathlib.Path(hf_path).glob("*.safetensors"):
    f.unlink()  # from here on, nothing can read the checkpoint's weights
  loaded, state, step = load_run(moved)
  assert step == RL_STEPS and loaded.cfg == read_hf_config(hf_path)
  assert isinstance(loaded.tok, HFTokenizer) and loaded.tok.stop_ids == (2, 0)
  assert loaded.engine.sampling.stop_tokens == (2, 0) and loaded.engine.sampling.pad_id == 0
  assert loaded.task.prompt(loaded.eval_records[0]).startswith("<|im_start|>user\n")
  for got, want in zip(jax.tree.leaves(state["ref_params"]), jax.tree.leaves(start)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # RL started there
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state["params"]),
                                                       jax.tree.leaves(start)))

  # a resumed run continues exactly as the uninterrupted one, from its own checkpoint
  resumed = str(tmp_path / "resumed")
  shutil.copytree(run_dir, resumed)
  shutil.rmtree(Checkpointer(resumed).path(RL_STEPS))
  messages = []
  train(config(data_dir, hf_path), resumed, progress=False, log=messages.append)
  assert "resumed from step 2" in "\n".join(messages)
  assert comparable(read_metrics(resumed)) == comparable(read_metrics(run_dir))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")
def test_the_weights_load_straight_into_the_training_sharding(hf_dir, data_dir, tmp_path):
  c = config(data_dir, hf_dir, "mesh.data=4", "mesh.expert=2")
  validate(c)
  run = Run(c, str(tmp_path), HFTokenizer.from_directory(hf_dir))
  state = run.initial_state()
  params = state["params"]
  want = S.param_shardings(params, run.mesh, S.TRAIN_RULES)
  assert all(a.sharding == sh for a, sh in zip(jax.tree.leaves(params), jax.tree.leaves(want)))
  w_gate = params["layers"][0]["w_gate"]  # [layers, experts, D, F], experts over `expert`
  assert w_gate.sharding.spec == P(None, "expert", None, None)
  assert {s.data.shape[1:] for s in w_gate.addressable_shards} == {(3, 64, 64)}
  # a checkpoint of the run restores into the same placement
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, run.place_state(state), {"step": 1})
  restored, _ = ckpt.restore(1, run.abstract_state())
  ckpt.close()
  for a, b in zip(jax.tree.leaves(restored["params"]), jax.tree.leaves(params)):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_probe_runs_on_the_checkpoint(hf_dir):
  c = mismatch_config.get_config("quick,max_new_tokens=8,batch=2")
  c.hf_path, c.precisions, c.guidance, c.routing_replay = hf_dir, "mxfp4", "all", "on"
  (row,) = mismatch.run(c, log=lambda *_: None)
  assert row["records"] == "all" and row["record/bytes_per_token"] > 0
  assert row["mismatch/flip_rate"] == 0.0 == mismatch.recorded_flip_rate(row, n_layers=1)


@pytest.mark.slow
def test_an_fp4_trace_run_from_the_checkpoint(hf_dir, data_dir, tmp_path):
  c = config(data_dir, hf_dir, "log.flip_rate_every=2", mode="trace")
  train(c, str(tmp_path), progress=False, log=lambda *_: None)
  rows = read_metrics(str(tmp_path))
  assert len(rows) == RL_STEPS and all(r["record/bytes_per_token"] > 0 for r in rows)
  assert "mismatch/flip_rate" in rows[0]


def test_model_keys_that_contradict_the_checkpoint_are_refused(hf_dir, data_dir):
  with pytest.raises(ValueError, match=r"model.d_model=256 contradicts model.hf_path=.*"
                                       r"\(d_model=64\).*leave model.d_model at its default"):
    validate(config(data_dir, hf_dir, "model.d_model=256"))
  validate(config(data_dir, hf_dir, "model.d_model=64", "rl.trace_layers=last:1"))
  with pytest.raises(ValueError, match="rl.trace_layers"):
    validate(config(data_dir, hf_dir, "rl.trace_layers=last:2"))  # the checkpoint has 1
  with pytest.raises(ValueError, match="model.chat_template=True needs model.hf_path"):
    validate(smoke(data_dir, "model.chat_template=true"))
