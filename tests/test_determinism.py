"""Deterministic GPU ops, asked of XLA before JAX starts (trace_jax.determinism); on a GPU, two
runs of one config repeat each other bit for bit."""

import json
import os
import subprocess
import sys

import jax
import pytest

from trace_jax import determinism

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# wall-clock measurements and the allocator's peak: the only numbers that may differ
TIMING = ("time/", "rollout/tokens_per_s", "memory/")


def test_enable_adds_the_flag_once_before_jax_starts_and_keeps_the_others():
  code = ("from trace_jax import determinism as d; d.enable(True); d.enable(True); import os, "
          "jax.numpy as jnp; print(os.environ['XLA_FLAGS']); print(float(jnp.ones(3).sum()))")
  env = dict(os.environ, XLA_FLAGS="--xla_dump_hlo_as_text=false")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True)
  assert out.returncode == 0, out.stderr[-2000:]
  flags, total = out.stdout.split("\n")[:2]
  assert flags.split().count(determinism.FLAG) == 1, flags
  assert "--xla_dump_hlo_as_text=false" in flags.split() and float(total) == 3.0


def test_enable_off_or_after_jax_started_on_a_cpu_changes_nothing(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_hlo_as_text=false")
  jax.numpy.ones(1).block_until_ready()  # (JAX has started)
  determinism.enable(False)
  determinism.enable(True)  # a CPU computes the same either way: nothing to refuse
  assert os.environ["XLA_FLAGS"] == "--xla_dump_hlo_as_text=false"
  assert not determinism.is_on()


def test_enable_after_jax_started_on_a_gpu_without_the_flag_says_how_to_fix_it(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  jax.numpy.ones(1).block_until_ready()
  monkeypatch.setattr(determinism.jax, "default_backend", lambda: "gpu")
  with pytest.raises(ValueError, match="deterministic=true needs XLA_FLAGS=--xla_gpu_determi"
                                       "nistic_ops=true before JAX starts.*deterministic=false"):
    determinism.enable(True)
  determinism.enable(False)  # asked for nothing: nothing to refuse
  monkeypatch.setenv("XLA_FLAGS", determinism.FLAG)
  determinism.enable(True)  # set in the environment before JAX started: as asked


# the entry points, each stopped once it would start training: whether the flag was set when
# JAX started its backends (which is when XLA reads it)
_FIRST_START = """
import sys
from jax._src import xla_bridge
from trace_jax import determinism
backends, seen = xla_bridge.backends, []
def watched(*args, **kwargs):
    seen.append(determinism.is_on())
    return backends(*args, **kwargs)
xla_bridge.backends = watched
def stop(*_, **__):
    print("flag set when JAX started:", seen[0])
    sys.exit(0)
"""
_ENTRY_POINTS = {
    "ablation": _FIRST_START + """
from experiments import ablation
ablation.train = ablation.train_in_processes = stop
ablation.main(["--smoke", "--families=reasoning", "--modes=trace", "--compile_cache=none",
               "--out=" + sys.argv[1], "--figures=" + sys.argv[1], "--data_dir=" + sys.argv[1]])
""",
    "main": _FIRST_START + """
from trace_jax import main
main.train = stop
sys.argv[1:] = ["--config=configs/reasoning.py:smoke", "--workdir=" + sys.argv[1],
                "--config.data_dir=" + sys.argv[1]]
from trace_jax import cli
cli.run(main.main, main._CONFIG)
"""}


@pytest.mark.parametrize("entry", sorted(_ENTRY_POINTS))
def test_the_entry_points_set_the_flag_before_jax_starts(entry, tmp_path):
  """XLA reads XLA_FLAGS once, when JAX starts: the ablation and the main entry point ask for
  deterministic ops (their configs' default) before anything of theirs asks JAX for a device
  (validating a config counts the devices). On a CPU JAX starting first does no harm; on a GPU
  it stopped the ablation at start-up."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out = subprocess.run([sys.executable, "-c", _ENTRY_POINTS[entry], str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "flag set when JAX started: True" in out.stdout, out.stdout[-2000:]


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as fh:
    rows = [json.loads(line) for line in fh]
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("family,mode,sft_steps,rl_steps,eval_size", [
    ("reasoning", "trace", 30, 2, 100),
    # its warm start on cuDNN's fused attention (the schedule's sft.attention), episodes of
    # ~1 500 tokens: each GPU machine makes a seed's warm start again, which must be the same
    ("long_horizon", "bf16", 8, 0, 50)])
def test_two_gpu_runs_of_one_config_repeat_each_other(tmp_path, family, mode, sft_steps,
                                                       rl_steps, eval_size):
  """The `gpu` policy of the GPU ablation (12 layers, 16 experts), a short warm start and two RL
  steps with MXFP4 rollouts and records (or a long-horizon warm start alone), twice from
  scratch by the entry point: every metric of every step equal (losses, gradient norms,
  rewards, greedy accuracy, mismatch). On XLA's defaults (atomic scatter-adds in the gradients
  of the embedding and of the MoE dispatch) the GPU ablation's runs of one seed started RL from
  different warm starts."""
  args = [f"--config=configs/ablation.py:family={family},mode={mode},seed=0,scale=gpu",
          f"--config.sft.steps={sft_steps}", f"--config.rl.steps={rl_steps}",
          f"--config.eval.size={eval_size}", "--config.checkpoint.every=1000",
          "--config.log.tensorboard=false", "--noprogress"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  runs = []
  for i in range(2):
    workdir = str(tmp_path / f"run{i}")
    out = subprocess.run([sys.executable, "-m", "trace_jax.main", f"--workdir={workdir}",
                          *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.append(_metrics(workdir))
  assert len(runs[0]) == sft_steps + rl_steps and any("eval/accuracy" in r for r in runs[0])
  for a, b in zip(*runs):
    assert a == b, {k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)}
