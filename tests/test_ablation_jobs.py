"""The ablation's `--jobs`: runs trained in processes of their own, a few at a time."""

import json
import os
import sys

from experiments import ablation

# a stand-in for a training run: notes when it ran and what it was given, then exits with argv[2]
RUN = """
import os, sys, time
d, status = sys.argv[1], int(sys.argv[2])
start = time.time()
time.sleep(0.4)
with open(os.path.join(d, "ran.json"), "w") as fh:
    fh.write('{"start": %r, "end": %r, "fraction": "%s", "cache": "%s"}' % (
        start, time.time(), os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
        os.environ.get("JAX_COMPILATION_CACHE_DIR", "")))
print("step 1 of 1")
sys.exit(status)
"""


def test_train_in_processes_runs_at_most_jobs_at_once_and_names_the_failures(tmp_path,
                                                                             monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  runs = [(f"run{i}", [sys.executable, "-c", RUN, str(tmp_path / f"run{i}"), str(int(i == 2))],
           str(tmp_path / f"run{i}")) for i in range(5)]
  failed = ablation.train_in_processes(runs, 2, cache=str(tmp_path / "cache"), poll_s=0.02)
  assert failed == ["run2"]
  ran = [json.load(open(tmp_path / f"run{i}" / "ran.json")) for i in range(5)]
  assert {(r["fraction"], r["cache"]) for r in ran} == {("0.450", str(tmp_path / "cache"))}
  events = sorted([(r["start"], 1) for r in ran] + [(r["end"], -1) for r in ran])
  at_once = [sum(e for _, e in events[:i + 1]) for i in range(len(events))]
  assert max(at_once) == 2  # two at a time: never more, and they did overlap
  assert "step 1 of 1" in open(tmp_path / "run4" / "train.log").read()


def test_train_command_is_the_main_entry_point_on_the_run_config(tmp_path):
  command = ablation.train_command("reasoning", "trace", 1, str(tmp_path / "w"), smoke=True,
                                   scale="gpu", data_dir="/d")
  assert command[1:3] == ["-m", "trace_jax.main"]
  assert command[3].endswith(os.path.join("configs", "ablation.py")
                             + ":family=reasoning,mode=trace,seed=1,scale=gpu,smoke")
  assert command[4:] == [f"--workdir={tmp_path / 'w'}", "--noprogress", "--config.data_dir=/d"]
