"""The ablation's `--jobs`: runs trained in processes of their own, a few at a time."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

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


def test_a_failed_runs_last_lines_are_in_the_ablations_output(tmp_path, capsys):
  """A run that fails shows why in the ablation's own output (its log's last lines, each
  marked with the run's name): its train.log may be on a machine that is gone by the time
  anyone reads it."""
  fail = ("import sys\nfor i in range(100): print('line', i)\n"
          "raise MemoryError('RESOURCE_EXHAUSTED: out of memory in jit_flip_counts')\n")
  runs = [("bad", [sys.executable, "-c", fail], str(tmp_path / "bad")),
          ("good", [sys.executable, "-c", RUN, str(tmp_path / "good"), "0"], str(tmp_path / "good"))]
  assert ablation.train_in_processes(runs, 2, poll_s=0.02) == ["bad"]
  out = capsys.readouterr().out
  assert "bad | MemoryError: RESOURCE_EXHAUSTED: out of memory in jit_flip_counts" in out
  assert "bad | line 99" in out and "line 50" not in out  # the tail only
  assert "good |" not in out and "step 1 of 1" not in out  # a run that ended well: nothing


def test_each_run_that_finishes_is_reported_at_once_while_the_others_train(tmp_path):
  """`on_finished(name)` as each run ends well (the ablation records it then: a machine lost
  later keeps it), not for one that fails, and before a longer run beside it has ended."""
  runs = [(f"run{i}", [sys.executable, "-c", RUN.replace("0.4", str(s)), str(tmp_path / f"run{i}"),
                       str(status)], str(tmp_path / f"run{i}"))
          for i, (s, status) in enumerate([(0.1, 0), (0.1, 1), (4.0, 0)])]
  reported = []
  on_finished = lambda name: reported.append((name, (tmp_path / "run2" / "ran.json").exists()))
  failed = ablation.train_in_processes(runs, 3, poll_s=0.02, on_finished=on_finished)
  assert failed == ["run1"]
  assert reported == [("run0", False), ("run2", True)]


def test_train_command_is_the_main_entry_point_on_the_run_config(tmp_path):
  command = ablation.train_command("reasoning", "trace", 1, str(tmp_path / "w"), smoke=True,
                                   scale="gpu", data_dir="/d")
  assert command[1:3] == ["-m", "trace_jax.main"]
  assert command[3].endswith(os.path.join("configs", "ablation.py")
                             + ":family=reasoning,mode=trace,seed=1,scale=gpu,smoke")
  assert command[4:] == [f"--workdir={tmp_path / 'w'}", "--noprogress", "--config.data_dir=/d"]


# a run that trains until a SIGTERM, then notes it and exits as trace_jax.main does
LONG_RUN = """
import os, signal, sys, time
d = sys.argv[1]
def stop(signum, frame):
    open(os.path.join(d, "stopped"), "w").write(str(signum))
    sys.exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(d, "started"), "w").close()
time.sleep(120)
"""

POOL = """
import sys
from experiments import ablation
d = sys.argv[1]
runs = [(f"run{i}", [sys.executable, "-c", sys.argv[2], f"{d}/run{i}"], f"{d}/run{i}")
        for i in range(3)]
try:
    ablation.train_in_processes(runs, 2, poll_s=0.02)
except ablation.Interrupted as e:
    sys.exit(128 + e.signum)
"""


def _pool_with_two_started(tmp_path):
  pool = subprocess.Popen([sys.executable, "-c", POOL, str(tmp_path), LONG_RUN], cwd=ablation.ROOT,
                          env=dict(os.environ, PYTHONPATH=ablation.ROOT))
  deadline = time.time() + 60
  while not all((tmp_path / f"run{i}" / "started").exists() for i in range(2)):
    assert time.time() < deadline and pool.poll() is None, "the runs did not start"
    time.sleep(0.05)
  return pool


def _stopped_by_sigterm(tmp_path, i, within_s=10.0):
  deadline = time.time() + within_s
  while not (tmp_path / f"run{i}" / "stopped").exists() and time.time() < deadline:
    time.sleep(0.05)
  return (tmp_path / f"run{i}" / "stopped").read_text() == str(int(signal.SIGTERM))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_ablation_stops_its_runs_once_and_starts_no_more(tmp_path, signum):
  pool = _pool_with_two_started(tmp_path)
  pool.send_signal(signum)
  assert pool.wait(timeout=30) == 128 + signum
  assert _stopped_by_sigterm(tmp_path, 0) and _stopped_by_sigterm(tmp_path, 1)
  assert not (tmp_path / "run2").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_runs_stop_when_the_ablation_is_killed(tmp_path):
  pool = _pool_with_two_started(tmp_path)
  pool.kill()  # SIGKILL: nothing of the ablation's own runs
  pool.wait(timeout=30)
  assert _stopped_by_sigterm(tmp_path, 0) and _stopped_by_sigterm(tmp_path, 1)


def test_a_stopped_jobs_invocation_records_the_runs_that_finished(tmp_path, monkeypatch, capsys):
  """--jobs=2 stopped by a signal while one run had finished and another had not: the finished
  one's results are in summary.json before the ablation exits (the machine it ran on may be
  gone before a rerun), the unfinished one is neither recorded nor trained in this process."""
  out = tmp_path / "results"
  done, trained = str(out / "reasoning" / "bf16" / "seed0"), []

  def stopped(runs, jobs, cache=None, on_finished=None):  # bf16 done, trace_all stopped midway
    assert [name for name, *_ in runs] == ["reasoning/bf16/seed0", "reasoning/trace_all/seed0"]
    for _, _, workdir in runs:
      os.makedirs(workdir)
    trained.append(done)
    raise ablation.Interrupted(signal.SIGTERM)

  def results(family, mode, seed, workdir, c, smoke=False, scale="cpu", init_from=""):
    assert workdir == done, f"read the results of {workdir}, which did not finish"
    return {"eval_accuracy_after": 0.25, "config_arg": ablation.config_arg(
        family, mode, seed, smoke, scale)}, {"step": [1]}

  def train(*_, **__):
    raise AssertionError("an unfinished run was trained in the ablation's process after a stop")

  monkeypatch.setattr(ablation, "train_in_processes", stopped)
  monkeypatch.setattr(ablation, "finished", lambda workdir, c: workdir in trained)
  monkeypatch.setattr(ablation, "run_results", results)
  monkeypatch.setattr(ablation, "fp4_eval", lambda workdir: 0.125)
  monkeypatch.setattr(ablation, "train", train)
  with pytest.raises(SystemExit) as stop:
    ablation.main(["--smoke", f"--out={out}", f"--figures={tmp_path / 'f'}", "--jobs=2",
                   "--families=reasoning", "--modes=bf16,trace_all", "--compile_cache=none",
                   f"--data_dir={tmp_path / 'tfds'}"])
  assert stop.value.code == 128 + signal.SIGTERM
  summary = json.load(open(out / "summary.json"))
  assert set(summary["reasoning"]["runs"]) == {"bf16/seed0"}
  assert summary["reasoning"]["runs"]["bf16/seed0"]["posthoc_fp4_accuracy"] == 0.125
  assert "rerunning the same command resumes" in capsys.readouterr().err


def test_a_run_that_finished_in_a_process_is_recorded_before_the_others_end(tmp_path,
                                                                             monkeypatch):
  """--jobs=2 on a machine lost (here: the pool dies) while trace_all still trained: bf16,
  finished before, is in summary.json already (its post-hoc number comes later)."""
  out, trained = tmp_path / "results", set()

  def lost(runs, jobs, cache=None, on_finished=None):
    for _, _, workdir in runs:
      os.makedirs(workdir)
    trained.add(runs[0][2])
    on_finished(runs[0][0])
    raise SystemExit("the machine is gone")

  _fake_results(monkeypatch, trained)
  monkeypatch.setattr(ablation, "train_in_processes", lost)
  with pytest.raises(SystemExit, match="gone"):
    ablation.main(["--smoke", f"--out={out}", f"--figures={tmp_path / 'f'}", "--jobs=2",
                   "--families=reasoning", "--modes=bf16,trace_all", "--compile_cache=none",
                   f"--data_dir={tmp_path / 'tfds'}"])
  runs = json.load(open(out / "summary.json"))["reasoning"]["runs"]
  assert sorted(runs) == ["bf16/seed0"] and "posthoc_fp4_accuracy" not in runs["bf16/seed0"]


def _fake_results(monkeypatch, trained):
  """The ablation with its runs' results faked: a run is finished once `trained` holds it."""
  def results(family, mode, seed, workdir, c, smoke=False, scale="cpu", init_from=""):
    assert c.sft.init_from == init_from
    return {"eval_accuracy_after": 0.25, "config_arg": ablation.config_arg(
        family, mode, seed, smoke, scale, init_from)}, {"step": [1]}

  monkeypatch.setattr(ablation, "finished", lambda workdir, c: workdir in trained)
  monkeypatch.setattr(ablation, "run_results", results)
  monkeypatch.setattr(ablation, "fp4_eval", lambda workdir: 0.125)
  monkeypatch.setattr(ablation, "_report", lambda data, args: None)


def _main(tmp_path, *extra):
  ablation.main(["--smoke", f"--out={tmp_path / 'results'}", f"--figures={tmp_path / 'f'}",
                 "--families=reasoning", "--modes=bf16,trace", "--seeds=0,1",
                 "--warm_start=shared", "--compile_cache=none",
                 f"--data_dir={tmp_path / 'tfds'}", *extra])


def test_jobs_train_the_shared_warm_starts_first_and_the_runs_start_rl_from_their_seeds(
    tmp_path, monkeypatch):
  """--warm_start=shared --jobs=2: each seed's warm start (the bf16 config with rl.steps=0, in
  <out>/<family>/warm_start/seed<S>) is trained before any run, in processes; every run's
  command takes its seed's as sft.init_from; a warm start that fails fails its seed's runs
  (named at the end), not the other seed's."""
  out, trained, calls = tmp_path / "results", set(), []

  def pool(runs, jobs, cache=None, on_finished=None):
    calls.append(runs)
    for _, _, workdir in runs:
      os.makedirs(workdir)
      if not workdir.endswith(os.path.join("warm_start", "seed1")):
        trained.add(workdir)
    return [name for name, _, workdir in runs if workdir not in trained]

  _fake_results(monkeypatch, trained)
  monkeypatch.setattr(ablation, "train_in_processes", pool)
  monkeypatch.setattr(ablation, "train", lambda *_, **__: pytest.fail("trained in-process"))
  with pytest.raises(SystemExit) as failed:
    _main(tmp_path, "--jobs=2")
  assert failed.value.code == ("failed: reasoning/warm_start/seed1, reasoning/bf16/seed1, "
                               "reasoning/trace/seed1 (each run's train.log says why; "
                               "rerunning the same command resumes them)")
  assert [[name for name, _, _ in runs] for runs in calls] == [
      ["reasoning/warm_start/seed0", "reasoning/warm_start/seed1"],
      ["reasoning/bf16/seed0", "reasoning/trace/seed0"]]
  warm0 = str(out / "reasoning" / "warm_start" / "seed0")
  (_, command, workdir), _ = calls[0]
  assert workdir == warm0
  assert command[3].endswith(":family=reasoning,mode=bf16,seed=0,smoke,rl.steps=0")
  for _, command, _ in calls[1]:
    assert command[3].endswith(f",seed=0,smoke,sft.init_from={warm0}")
  runs = json.load(open(out / "summary.json"))["reasoning"]["runs"]
  assert sorted(runs) == ["bf16/seed0", "trace/seed0"]
  assert runs["trace/seed0"]["config_arg"].endswith(f"sft.init_from={warm0}")


def test_one_process_trains_each_shared_warm_start_once_before_its_seeds_first_run(
    tmp_path, monkeypatch):
  out, trained, order = tmp_path / "results", set(), []

  def train(c, workdir, progress=True):
    order.append((os.path.relpath(workdir, out), c.rl.steps, c.sft.init_from))
    os.makedirs(workdir)
    trained.add(workdir)

  _fake_results(monkeypatch, trained)
  monkeypatch.setattr(ablation, "train", train)
  _main(tmp_path)
  warm = lambda s: str(out / "reasoning" / "warm_start" / f"seed{s}")
  steps = ablation.run_config("reasoning", "bf16", 0, smoke=True).rl.steps
  assert order == [
      (os.path.join("reasoning", "warm_start", "seed0"), 0, ""),
      (os.path.join("reasoning", "bf16", "seed0"), steps, warm(0)),
      (os.path.join("reasoning", "warm_start", "seed1"), 0, ""),
      (os.path.join("reasoning", "bf16", "seed1"), steps, warm(1)),
      (os.path.join("reasoning", "trace", "seed0"), steps, warm(0)),
      (os.path.join("reasoning", "trace", "seed1"), steps, warm(1))]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_seeds_modes_are_trained_from_the_warm_start_its_recorded_runs_took(tmp_path,
                                                                              monkeypatch, jobs,
                                                                              capsys):
  """A shared warm start made again (a fresh machine: the run directories gone, summary.json
  kept) must be the one the seed's recorded runs started from, as their `warm_start_id` (from
  the warm start's rows) says; another (e.g. made on another device kind) stops the invocation
  before any mode trains, naming the runs."""
  out, trained, order = tmp_path / "results", set(), []
  losses = {"value": 1.5}

  def train(c, workdir, progress=True):
    order.append(os.path.relpath(workdir, out))
    os.makedirs(workdir)
    trained.add(workdir)
    if c.rl.steps == 0:  # a warm start: its rows
      with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for step in range(c.sft.steps):
          f.write(json.dumps({"step": step, "train/loss": losses["value"] / (step + 1),
                              "train/grad_norm": 2.0, "phase": "sft"}) + "\n")

  def pool(runs, jobs, cache=None, on_finished=None):  # --jobs: the same, a process a run
    warm = ablation.run_config("reasoning", "bf16", 0, smoke=True)
    warm.rl.steps = 0
    for name, _, workdir in runs:
      is_warm = name.split("/")[1] == ablation.WARM
      train(warm if is_warm else ablation.run_config("reasoning", "bf16", 0, smoke=True),
            workdir)
      if on_finished and not is_warm:
        on_finished(name)
    return []

  def results(family, mode, seed, workdir, c, smoke=False, scale="cpu", init_from=""):
    rows = ablation.read_metrics(init_from)  # a shared warm start's rows, as the run copies them
    return {"eval_accuracy_after": 0.25, "warm_start_id": ablation.warm_start_id(
        rows, c.sft.steps), "config_arg": ablation.config_arg(
            family, mode, seed, smoke, scale, init_from)}, {"step": [1]}

  monkeypatch.setattr(ablation, "finished", lambda workdir, c: workdir in trained)
  monkeypatch.setattr(ablation, "run_results", results)
  monkeypatch.setattr(ablation, "fp4_eval", lambda workdir: 0.125)
  monkeypatch.setattr(ablation, "_report", lambda data, args: None)
  monkeypatch.setattr(ablation, "train", train)
  monkeypatch.setattr(ablation, "train_in_processes", pool)
  main = lambda modes, *more: ablation.main([
      "--smoke", f"--out={out}", f"--figures={tmp_path / 'f'}", "--families=reasoning",
      f"--modes={modes}", "--seeds=0", "--warm_start=shared", "--compile_cache=none",
      f"--data_dir={tmp_path / 'tfds'}", f"--jobs={jobs}", *more])
  main("bf16")
  runs = json.load(open(out / "summary.json"))["reasoning"]["runs"]
  assert runs["bf16/seed0"]["warm_start_id"] is not None
  # a fresh machine: the directories gone; the warm start made again, the same numbers
  shutil.rmtree(out / "reasoning")
  trained.clear()
  main("bf16,trace")
  assert order[-2:] == [os.path.join("reasoning", "warm_start", "seed0"),
                        os.path.join("reasoning", "trace", "seed0")]
  runs = json.load(open(out / "summary.json"))["reasoning"]["runs"]
  assert runs["trace/seed0"]["warm_start_id"] == runs["bf16/seed0"]["warm_start_id"]
  # again, and the warm start now computes other numbers: nothing more trains
  shutil.rmtree(out / "reasoning")
  trained.clear()
  losses["value"] = 1.25
  with pytest.raises(SystemExit, match=r"the warm start of reasoning seed 0 in .* is another "
                                       r"than the one bf16/seed0, trace/seed0 started RL from"):
    main("bf16,trace,fp4_qat")
  assert order[-1] == os.path.join("reasoning", "warm_start", "seed0")
  # the seed's runs were made on another device kind: the warm start would not repeat here
  # (deterministic ops repeat on one kind), so nothing starts, not even the warm start
  summary = json.load(open(out / "summary.json"))
  for run in summary["reasoning"]["runs"].values():
    run["device"] = "NVIDIA H200"
  json.dump(summary, open(out / "summary.json", "w"))
  shutil.rmtree(out / "reasoning")
  trained.clear()
  made = len(order)
  with pytest.raises(SystemExit):
    main("bf16,trace,fp4_qat")
  assert len(order) == made
  assert ("reasoning seed 0's recorded runs (bf16/seed0, trace/seed0) were made on NVIDIA H200, "
          "this device is cpu") in capsys.readouterr().err
  # --any_device makes it, and its fingerprint decides (here another: nothing more trains)
  with pytest.raises(SystemExit, match="is another than the one bf16/seed0, trace/seed0"):
    main("bf16,trace,fp4_qat", "--any_device")
  assert order[made:] == [os.path.join("reasoning", "warm_start", "seed0")]
