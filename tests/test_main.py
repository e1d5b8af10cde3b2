"""The RL entry point end to end: every mode, metrics, resume after a kill, NaN, bad configs."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import coding, long_horizon, reasoning
from trace_jax.rl.checkpoint import Checkpointer
from trace_jax.rl import loop
from trace_jax.rl.loop import _check_same_config, _config_json, saved_config, train
from trace_jax.rl.summary import format_summary
from trace_jax.rl.trainer import MODES
from trace_jax.rl.writer import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# wall-clock measurements and the allocator's peak (a resumed process has its own) differ
# between runs; everything else must not
TIMING = ("time/", "rollout/tokens_per_s", "memory/")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  return str(tmp_path_factory.mktemp("tfds"))


def smoke(data_dir, *extra, config=reasoning):
  # one device: these tests check the run loop; tests/test_sharding.py checks that 8 devices
  # compute the same as one, and programs for 8 fake CPU devices make these tests ~20% slower
  c = config.get_config(",".join(("smoke", "mesh.data=1") + extra))
  c.data_dir = data_dir
  return c


def command(workdir, data_dir, *overrides):
  return [sys.executable, "-m", "trace_jax.main", "--config=configs/reasoning.py:smoke",
          f"--workdir={workdir}", f"--config.data_dir={data_dir}", "--noprogress", *overrides]


# the command-line runs use one device (the in-process tests above run on 8)
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def launch(workdir, data_dir, *overrides, env=ENV, **kw):
  return subprocess.Popen(command(workdir, data_dir, *overrides), cwd=ROOT, env=env, text=True,
                          **kw)


def run_cli(workdir, data_dir, *overrides, env=ENV):
  out = subprocess.run(command(workdir, data_dir, *overrides), cwd=ROOT, env=env,
                       capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout + out.stderr


def comparable(rows):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


# trace_all is trace with records at every layer (tests/rl/test_rollout.py checks those),
# fp4_rollout a bf16 trainer (bf16's) on FP4 rollouts (trace's), and fp4_qat trace without
# records (trace's first layer is unguided QAT): the default run leaves their 30-60 s each to
# the slow selection
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow)
                                  if m in ("trace_all", "fp4_rollout", "fp4_qat") else m
                                  for m in MODES])
def test_every_mode_runs_and_writes_the_metrics(mode, data_dir, tmp_path, monkeypatch):
  c = smoke(data_dir, mode, "rl.routing_replay=true", "rl.correction=tis")
  # a device that counts its memory (a GPU's allocator; a CPU's counts none): its peak so far
  peaks = iter(range(1, 1000))
  monkeypatch.setattr(loop, "peak_memory", lambda: {"memory/peak_gib": float(next(peaks))})
  summary = train(c, str(tmp_path), progress=False, log=lambda *_: None)
  rows = read_metrics(str(tmp_path))
  assert [r["step"] for r in rows] == list(range(c.sft.steps + c.rl.steps))
  rl = [r for r in rows if r["phase"] == "rl"]
  for key in ("reward/mean", "reward/std", "train/loss", "train/grad_norm", "train/clip_frac",
              "rollout/tokens_per_s", "record/bytes_per_token", "time/rollout_s", "time/train_s",
              "mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "mismatch/prob_abs_diff_max",
              "mismatch/route_flip_rate", "mismatch/kl_k3_by_position"):
    assert all(key in r for r in rl), key
  assert any(r.get("eval/accuracy") is not None for r in rows)
  # where a run's time goes, on every row: the whole step, and the evaluation where it ran
  assert all(r["time/step_s"] > 0 for r in rows)
  assert all(("time/eval_s" in r) == ("eval/accuracy" in r) for r in rows)
  assert all(r["time/eval_s"] < r["time/step_s"] for r in rows if "time/eval_s" in r)
  quantized = mode != "bf16"
  assert any("mismatch/flip_rate" in r for r in rl) == quantized
  assert (rl[0]["record/bytes_per_token"] > 0) == mode.startswith("trace")
  assert os.path.exists(tmp_path / "tensorboard") and os.path.exists(tmp_path / "tokenizer.json")
  assert summary["mode"] == mode and summary["reward_last"] is not None
  assert [r["memory/peak_gib"] for r in rows] == list(range(1, len(rows) + 1))
  assert summary["peak_memory_gib"] == len(rows)
  assert f"peak device memory: {len(rows)}.0 GiB" in format_summary(summary)


def test_the_peak_memory_is_the_devices_where_it_counts_it(monkeypatch):
  class Device:
    def __init__(self, stats):
      self.stats = stats

    def memory_stats(self):
      return self.stats

  for stats, want in ((None, {}), ({}, {}), ({"peak_bytes_in_use": 3 << 29, "bytes_in_use": 1},
                                             {"memory/peak_gib": 1.5})):
    monkeypatch.setattr(loop.jax, "local_devices", lambda stats=stats: [Device(stats)])
    assert loop.peak_memory() == want


# the two runs (about 50 and 100 s) under -m slow: the long-horizon episodes (one KV cache,
# observations masked) are checked in tests/tasks/test_long_horizon.py, the coding family's
# sandboxed programs and rewards in tests/tasks/test_coding.py, the run loop by the reasoning runs
@pytest.mark.parametrize("config", [pytest.param(coding, marks=pytest.mark.slow),
                                    pytest.param(long_horizon, marks=pytest.mark.slow)],
                         ids=["coding", "long_horizon"])
def test_the_other_families_run(config, data_dir, tmp_path, allow_unsandboxed):
  c = smoke(data_dir, "trace", f"task.coding.allow_unsandboxed={allow_unsandboxed}",
            config=config)
  summary = train(c, str(tmp_path), progress=False, log=lambda *_: None)
  rows = read_metrics(str(tmp_path))
  rl = [r for r in rows if r["phase"] == "rl"]
  assert len(rl) == c.rl.steps and all(0.0 <= r["reward/mean"] <= 1.0 for r in rl)
  assert all(r["rollout/response_tokens"] > 0 for r in rl)
  if config is long_horizon:  # every policy turn is sampled; observations are not
    assert rl[0]["rollout/response_tokens"] == 16 * c.task.long_horizon.turns * 2
  assert summary["eval_accuracy_after"] is not None


def test_killed_run_resumes_as_if_never_stopped(data_dir, tmp_path):
  overrides = ("--config.rl.steps=10", "--config.checkpoint.every=3",
               "--config.log.flip_rate_every=0")
  # the three processes compile the same programs: JAX's persistent cache compiles them once
  env = dict(ENV, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
  ref = tmp_path / "ref"
  run_cli(ref, data_dir, *overrides, env=env)
  killed = tmp_path / "killed"
  proc = launch(killed, data_dir, *overrides, env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
  metrics = killed / "metrics.jsonl"
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 8:
      proc.send_signal(signal.SIGKILL)
      break
    time.sleep(0.02)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
  partial = len(metrics.read_text().splitlines())
  assert 8 <= partial < 13
  assert "resumed from step 6" in run_cli(killed, data_dir, *overrides, env=env)
  assert comparable(read_metrics(str(killed))) == comparable(read_metrics(str(ref)))


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_run_resumes(data_dir, tmp_path):
  overrides = ("--config.rl.steps=10", "--config.checkpoint.every=100",
               "--config.log.flip_rate_every=0")
  proc = launch(tmp_path, data_dir, *overrides, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  metrics = tmp_path / "metrics.jsonl"
  while proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
      proc.send_signal(signal.SIGTERM)
      break
    time.sleep(0.02)
  out = proc.communicate()[0]
  assert proc.returncode != 0 and "interrupted by SIGTERM: the newest checkpoint is step" in out
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert saved and saved[-1] >= 5
  run_cli(tmp_path, data_dir, *overrides)
  assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(13))


def test_nan_loss_stops_with_a_clear_message_and_keeps_the_last_good_checkpoint(data_dir,
                                                                                tmp_path):
  # a learning rate this large blows the weights up within a few steps
  c = smoke(data_dir, "sft.lr=1e30", "optim.max_grad_norm=1e30", "checkpoint.every=1")
  with pytest.raises(FloatingPointError, match=r"train/loss is nan at step \d+.*last good "
                     r"checkpoint is step \d+"):
    train(c, str(tmp_path), progress=False, log=lambda *_: None)
  rows = read_metrics(str(tmp_path))
  saved = sorted(int(d) for d in os.listdir(tmp_path / "checkpoints") if d.isdigit())
  assert all(np.isfinite(r["train/loss"]) for r in rows)
  assert saved[-1] == len(rows)  # the bad step was neither logged nor saved


def test_bad_config_fails_before_any_work(data_dir, tmp_path):
  for override, message in [("rl.mode=fp8_qat", r"rl.mode='fp8_qat': choose one of \('bf16'"),
                            ("rl.correction=ppo", r"rl.correction='ppo'.*'tis'"),
                            ("engine.kernels=triton", r"engine.kernels='triton'.*'pallas'"),
                            ("engine.attention_kernel=flash",
                             r"engine.attention_kernel='flash'.*'mosaic'"),
                            ("engine.w4a4=true", r"engine.w4a4.*needs engine.kernels=pallas"),
                            ("engine.fold_scales=true",
                             r"engine.fold_scales.*needs engine.kernels=pallas"),
                            ("engine.triton_backend=tl",
                             r"engine.triton_backend='tl'.*'jax_triton'"),
                            ("engine.triton_backend=jax_triton",
                             r"engine.triton_backend='jax_triton'.*needs engine.kernels=pallas"),
                            ("rl.trace_layers=last:7", r"rl.trace_layers='last:7'"),
                            ("rl.group_size=1", "rl.group_size must be >= 2"),
                            ("rl.minibatches=3", "does not split into rl.minibatches=3"),
                            ("mesh.data=9", r"mesh.data=9 x mesh.expert=1 needs more than"),
                            (f"sft.init_from={tmp_path / 'none'}",
                             r"sft.init_from='.*none': .*none/checkpoints holds no checkpoint "
                             r"of step 3 \(sft.steps"),
                            (f"sft.init_from={tmp_path},sft.steps=0",
                             r"sft.init_from=.* with sft.steps=0")]:
    with pytest.raises(ValueError, match=message):
      train(smoke(data_dir, override), str(tmp_path / "w"), progress=False)
    assert not os.path.exists(tmp_path / "w" / "metrics.jsonl")
  with pytest.raises(ValueError, match="unknown config key 'lr'"):
    reasoning.get_config("lr=3")  # the command line's bad input: tests/test_cli.py


def test_resuming_with_another_config_is_refused(data_dir, tmp_path):
  # the config is checked against the newest checkpoint's before any state is built, so a
  # checkpoint that holds only the metadata train() writes is all this needs
  ckpt = Checkpointer(str(tmp_path))
  ckpt.save(1, {"step": np.zeros((), np.int32)},
            {"step": 1, "config": _config_json(smoke(data_dir))})
  ckpt.close()
  with pytest.raises(ValueError, match=r"different config \(keys \['rl.lr'\]\)"):
    train(smoke(data_dir, "rl.lr=0.5"), str(tmp_path), progress=False)
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_a_config_saved_before_a_key_existed_loads_with_its_default(data_dir):
  """Runs written before a key existed load (load_run) and resume: the key takes its default,
  the behaviour those runs had; runs that kept the kernel knobs under rl (before the engine
  section) have them moved there."""
  c = smoke(data_dir)
  old = json.loads(c.to_json())
  del old["engine"]
  assert json.loads(saved_config(old).to_json()) == json.loads(c.to_json())
  old["rl"].update(kernels="pallas", attention_kernel="mosaic")
  moved = saved_config(old)
  assert (moved.engine.kernels, moved.engine.attention_kernel) == ("pallas", "mosaic")
  assert "kernels" not in moved.rl and "attention_kernel" not in moved.rl
  # before sft.attention, rl.attention computed the warm start's loss too
  del old["sft"]["attention"]
  old["rl"]["attention"] = "fused"
  assert (saved_config(old).sft.attention, saved_config(old).rl.attention) == ("fused", "fused")
  old["rl"]["attention"] = "full"
  assert saved_config(old).sft.attention == "full"


def test_a_run_resumes_with_its_data_elsewhere():
  """data_dir (where prepared data lives, e.g. load_run(workdir, data_dir=...)) is not part of
  what must match to resume; any other key is."""
  saved = {"data_dir": "/a", "rl": {"lr": 1.0}}
  _check_same_config(saved, {"data_dir": "/b", "rl": {"lr": 1.0}}, "w")
  with pytest.raises(ValueError, match=r"keys \['rl.lr'\]"):
    _check_same_config(saved, {"data_dir": "/b", "rl": {"lr": 2.0}}, "w")


def test_a_run_resumes_with_deterministic_ops_switched():
  """`deterministic` says how XLA schedules GPU ops, not what the run computes: a run resumes
  with it switched, and from checkpoints written before the key existed."""
  _check_same_config({"deterministic": True, "seed": 0}, {"deterministic": False, "seed": 0}, "w")
  _check_same_config({"seed": 0}, {"deterministic": True, "seed": 0}, "w")
  with pytest.raises(ValueError, match=r"keys \['seed'\]"):
    _check_same_config({"deterministic": True, "seed": 0}, {"deterministic": True, "seed": 1},
                       "w")
