"""Two processes of 4 fake CPU devices each, joined by jax.distributed, compute what one process
of 8 devices computes: the mismatch probe's rows, the RL run's metrics and checkpoints; each
resumes the other's checkpoints, and a signal to one process stops both after the same step.

One process of 8 devices sums across devices with XLA's own CPU collectives; several processes
with gloo's, which add in another order: the RL reference is therefore one process that also
runs under jax.distributed (gloo's collectives, no other change), and comparing it with a
plain one would only show float32 rounding of the gradients' sums.
"""

import json
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from configs import mismatch as mismatch_config
from tests import multiprocess as mp
from trace_jax import mismatch
from trace_jax.rl.writer import read_metrics

TIMING = ("time/", "rollout/tokens_per_s", "memory/")
PROBE = dict(precisions="mxfp4", guidance="none,all", routing_replay="off", batch=8,
             max_new_tokens=8)


def comparable(rows):
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices: tests/conftest.py")
def test_the_probe_in_two_processes_gives_the_rows_of_one_with_eight_devices(tmp_path):
  out = tmp_path / "rows.jsonl"
  overrides = [f"--config.{k}={v}" for k, v in PROBE.items()]
  procs = mp.Processes(["-m", "trace_jax.mismatch", "--config=configs/mismatch.py:quick",
                        "--config.mesh.data=2", "--config.mesh.expert=4", f"--config.output={out}",
                        *overrides])
  # the reference, in this process (8 devices) while the two run: the same mesh
  c = mismatch_config.get_config("quick")
  c.update(dict(PROBE, mesh=dict(data=2, expert=4)))
  want = mismatch.run(c, log=lambda *_: None)
  (code0, text0), (code1, text1) = procs.wait(timeout_s=300)
  assert (code0, code1) == (0, 0), f"exit {code0}:\n{mp.why(text0)}\n\nexit {code1}:\n{mp.why(text1)}"
  got = [json.loads(line) for line in out.read_text().splitlines()]
  assert len(got) == 2 and comparable(got) == comparable(want)
  assert "8 devices in 2 processes" in text0 and '"mismatch/kl_k3"' in text0
  assert '"mismatch/kl_k3"' not in text1 and "| rollout" not in text1  # process 0 reports


def test_when_one_process_fails_the_other_stops_too(tmp_path):
  """A process that fails leaves at once; the one left waiting for it in a collective is
  stopped by jax.distributed when its heartbeats stop (here 5 s), not left hanging."""
  a_file = tmp_path / "file"
  a_file.write_text("")
  procs = mp.Processes(["-m", "trace_jax.main", "--config=configs/reasoning.py:smoke",
                        f"--config.data_dir={tmp_path / 'tfds'}", "--noprogress"], heartbeat_s=5,
                       extra=[[f"--workdir={tmp_path / 'w'}"], [f"--workdir={a_file}"]])
  # (a hang would end in wait's TimeoutError; -6: JAX's client aborts the process)
  (code0, text0), (code1, text1) = procs.wait(timeout_s=120, ok=(0, 1, 2, 134, -6))
  assert code1 == 2 and f"error: workdir {a_file} is a file" in text1, text1[-2000:]
  assert code0 != 0, text0[-2000:]


def main_args(workdir, data_dir):
  return ["-m", "trace_jax.main", "--config=configs/reasoning.py:smoke", f"--workdir={workdir}",
          f"--config.data_dir={data_dir}", "--noprogress", "--config.sft.steps=2",
          "--config.rl.steps=2", "--config.checkpoint.every=2"]


def drop_checkpoints_after(workdir, step):
  for d in os.listdir(workdir / "checkpoints"):
    if d.isdigit() and int(d) > step:
      shutil.rmtree(workdir / "checkpoints" / d)


@pytest.mark.slow
def test_rl_in_two_processes_runs_stops_and_resumes_as_one(tmp_path):
  data = tmp_path / "tfds"
  ref = tmp_path / "ref"  # one process of 8 devices (gloo's collectives: the module docstring)
  mp.run(main_args(ref, data), n=1, devices=8)
  want = comparable(read_metrics(str(ref)))
  assert [r["step"] for r in want] == [0, 1, 2, 3]

  # two processes; a SIGTERM to process 1 alone stops both after the same step, with one
  # checkpoint, and the same command resumes them
  two = tmp_path / "two"
  procs = mp.Processes(main_args(two, data))
  deadline = time.time() + 600
  while not ((two / "metrics.jsonl").exists() and (two / "metrics.jsonl").read_text()):
    assert time.time() < deadline and all(p.poll() is None for p in procs.procs), "no step done"
    time.sleep(0.1)
  procs.signal(1, signal.SIGTERM)
  (code0, text0), (code1, text1) = procs.wait(timeout_s=600, ok=(0, 128 + signal.SIGTERM))
  assert code0 == code1 == 128 + signal.SIGTERM, f"{mp.why(text0)}\n\n{mp.why(text1)}"
  assert "interrupted by SIGTERM: the newest checkpoint is step" in text0
  assert "interrupted" not in text1  # process 0 speaks for the run
  stopped = len(read_metrics(str(two)))
  assert 1 <= stopped < 4
  out = mp.run(main_args(two, data))
  assert f"resumed from step {stopped}" in out[0]
  assert comparable(read_metrics(str(two))) == want  # every row once: process 0 wrote them
  # one event file for each of the two launches: process 0's
  assert len(os.listdir(two / "tensorboard")) == 2 and (two / "curves.png").exists()

  # a checkpoint of one process resumes in two ...
  one_to_two = tmp_path / "one_to_two"
  shutil.copytree(ref, one_to_two)
  drop_checkpoints_after(one_to_two, 2)
  out = mp.run(main_args(one_to_two, data))
  assert "resumed from step 2" in out[0]
  assert comparable(read_metrics(str(one_to_two))) == want

  # ... also one whose layers were saved one array per layer (as before they were stacked),
  # regrouped as each process restores it
  from tests.rl.test_loop import layers_as
  from trace_jax.models import stacks
  from trace_jax.rl.checkpoint import Checkpointer
  from trace_jax.rl.loop import load_run

  per_layer = tmp_path / "per_layer"
  shutil.copytree(ref, per_layer)
  drop_checkpoints_after(per_layer, 2)
  run, state, step = load_run(str(per_layer), data_dir=str(data))
  ckpt = Checkpointer(str(per_layer))
  meta = ckpt.meta(step)
  shutil.rmtree(ckpt.path(step))
  ckpt.manager.reload()
  ckpt.save(step, layers_as(state, stacks.unstack), meta)
  assert ckpt.check_layout(step, run.abstract_state(run.has_reference(step)))  # to regroup
  ckpt.close()
  out = mp.run(main_args(per_layer, data))
  assert "resumed from step 2" in out[0]
  assert comparable(read_metrics(str(per_layer))) == want

  # ... and one of two in one (here, plainly: no jax.distributed), holding what one wrote
  _, state_two, step_two = load_run(str(two), data_dir=str(data))
  _, state_ref, step_ref = load_run(str(ref), data_dir=str(data))
  assert step_two == step_ref == 4
  assert state_two["params"]["embed"].sharding.num_devices == 8
  for a, b in zip(jax.tree.leaves(state_two), jax.tree.leaves(state_ref)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
