"""The ablation script end to end in its smoke setting, the notebook that reads it, and the
rollout benchmark on CPU (its kernels interpreted), the compile-time benchmark."""

import json
import os
import shutil

import pytest

from experiments import (ablation, bench_compile, bench_episodes, bench_rollout,
                         bench_train_attention, figures)
from tests.test_main import TIMING
from tests.test_results import NOTEBOOK, assert_summary_matches_curves, execute_notebook

pytestmark = pytest.mark.slow  # minutes: short RL runs, a probe, an interpreted benchmark


def test_ablation_smoke_writes_summary_figures_and_the_notebook_runs(tmp_path, monkeypatch):
  out, figs = str(tmp_path / "results"), str(tmp_path / "figures")
  # the runs share JAX's persistent cache, <out>/compile_cache (a process-wide setting: not here)
  monkeypatch.setattr(ablation, "use_compile_cache", lambda path: used.append(path))
  used = []
  ablation.main(["--smoke", f"--out={out}", f"--figures={figs}", "--families=reasoning",
                 "--modes=bf16,trace_all", f"--data_dir={tmp_path / 'tfds'}"])
  assert used == [os.path.join(out, "compile_cache")]
  with open(os.path.join(out, "summary.json")) as fh:
    summary = json.load(fh)
  acc = summary["reasoning"]["final_eval_accuracy"]
  assert {"bf16", "bf16_bf16", "bf16_posthoc_fp4", "trace_all"} <= set(acc)
  records = {r["records"] for r in summary["reasoning"]["probe"]}
  assert records == {"none", "last:1", "last:2", "all"}
  assert sorted(os.listdir(figs)) == sorted(
      f"{n}.png" for n in ("reward_vs_step", "kl_vs_step", "flip_rate_vs_step",
                           "flip_rate_per_layer", "kl_by_position", "record_bytes_vs_kl",
                           "final_accuracy"))
  table = open(os.path.join(out, "table.md")).read()
  assert "| reasoning | trace_all |" in table and "MXFP4 post hoc" in table
  data = figures.load(out)
  assert_summary_matches_curves(data.summary, data.curves)
  run = data.summary["reasoning"]["runs"]["trace_all/seed0"]
  assert run["config"] == json.loads(ablation.run_config("reasoning", "trace_all", 0, True)
                                     .to_json()) | {"data_dir": str(tmp_path / "tfds")}
  fresh = tmp_path / "fresh"  # the two files alone, as a fresh clone holds them
  fresh.mkdir()
  for name in ("summary.json", "curves.json"):
    shutil.copy(os.path.join(out, name), fresh / name)
  # rerunning skips the finished runs
  ablation.main(["--smoke", f"--out={out}", f"--figures={figs}", "--families=reasoning",
                 "--modes=bf16", f"--data_dir={tmp_path / 'tfds'}", "--compile_cache=none"])
  assert used == [os.path.join(out, "compile_cache")]  # none: no cache
  os.remove(os.path.join(out, "table.md"))
  ablation.main(["--figures_only", f"--out={out}", f"--figures={figs}", "--families=reasoning"])
  assert "| reasoning | bf16 |" in open(os.path.join(out, "table.md")).read()
  artists = execute_notebook(NOTEBOOK, tmp_path / "notebook_figures", out=fresh)
  assert len(artists) == len(figures.FIGURES) and all(n > 0 for f in artists for n in f)


def test_ablation_jobs_trains_in_processes_what_it_would_train_in_its_own(tmp_path):
  """--jobs=2: each run trained by `python -m trace_jax.main` in a process of its own writes the
  metrics the same run writes trained in the ablation's process (no timing keys). With a
  shared warm start the modes' warm-start rows are its rows (their evaluations aside), and
  each run records the command that trains it."""
  tfds = f"--data_dir={tmp_path / 'tfds'}"
  for jobs, out in ((2, "jobs"), (1, "alone")):
    ablation.main(["--smoke", f"--out={tmp_path / out}", f"--figures={tmp_path / out / 'f'}",
                   "--families=reasoning", "--modes=bf16,trace", f"--jobs={jobs}", tfds,
                   "--compile_cache=none", "--warm_start=shared"])
  assert os.path.exists(tmp_path / "jobs" / "reasoning" / "trace" / "seed0" / "train.log")
  rows = {}
  for mode in ("bf16", "trace", "warm_start"):
    records = [[{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
                for line in open(tmp_path / out / "reasoning" / mode / "seed0" / "metrics.jsonl")]
               for out in ("jobs", "alone")]
    assert records[0] == records[1]
    rows[mode] = [{k: v for k, v in r.items() if not k.startswith("eval/")}
                  for r in records[0] if r["phase"] == "sft"]
  assert rows["bf16"] == rows["trace"] == rows["warm_start"] and rows["bf16"]
  run = json.load(open(tmp_path / "alone" / "summary.json"))["reasoning"]["runs"]["trace/seed0"]
  warm = tmp_path / "alone" / "reasoning" / "warm_start" / "seed0"
  assert run["warm_start_command"] == (
      "python -m trace_jax.main --config=configs/ablation.py:family=reasoning,mode=bf16,seed=0,"
      f"smoke,rl.steps=0 --workdir={warm} --config.data_dir={tmp_path / 'tfds'}")
  assert run["command"].startswith("python -m trace_jax.main --config=configs/ablation.py:"
                                   f"family=reasoning,mode=trace,seed=0,smoke,sft.init_from={warm} ")


def test_bench_rollout_runs_its_variants():
  result = bench_rollout.run(2, [4], 112, 16, ["bf16:xla", "mxfp4:pallas"], preset="small")
  rows = result["rows"]
  assert not result["errors"] and [r["variant"] for r in rows] == ["bf16:xla", "mxfp4:pallas"]
  assert all(r["tokens_per_s"] > 0 and r["roofline_frac"] > 0 for r in rows)
  assert rows[1]["bytes_per_step"]["total"] < rows[0]["bytes_per_step"]["total"] / 2
  for r in rows:  # what the compiled loop holds: its weights as passed, temporaries beside
    memory = r["decode_memory"]
    assert memory["weights_bytes"] > 0 and memory["temp_bytes"] >= 0, memory
  print(bench_rollout.table(result))
  # a cache with room for more than it holds (--slots): the step reads the filled part
  longer = bench_rollout.run(2, [4], 112, 16, ["bf16:xla"], preset="small", slots=256)
  assert not longer["errors"] and longer["slots"] == 256
  kv, kv_full = (r["rows"][0]["bytes_per_step"]["kv_cache"] for r in (longer, result))
  assert kv == int(kv_full * 256 / 128 * (112 + 8) / 256)


def test_bench_compile_times_the_programs_asked_for_and_keeps_each_as_it_finishes(tmp_path,
                                                                                  capsys):
  """--programs picks what is compiled; each program's seconds are printed and written to --out
  as soon as it is compiled, so a run stopped by a time limit keeps what it finished."""
  out = tmp_path / "a.json"
  seen = []

  def log(line):
    seen.append((line, json.load(open(out))["rows"] if out.exists() else None))

  result = bench_compile.run([1], 32, programs=("train", "decode_scanned"), log=log,
                             out=str(out))
  assert set(result["rows"][0]) == {"layers", "train_s", "decode_scanned_s"}
  assert len(seen) == 2 and "train_s" in seen[0][0]
  assert seen[0][1] == [{"layers": 1, "train_s": result["rows"][0]["train_s"]}]
  with pytest.raises(SystemExit):
    bench_compile.main(["--programs=train,nope"])
  assert "--programs: nope is not one of train, train_remat, prefill, decode, decode_scanned" in (
      capsys.readouterr().err)


def test_bench_compile_times_each_program_and_compares_two_runs(tmp_path, capsys):
  bench_compile.main(["--layers=1,3", "--d_model=32", f"--out={tmp_path / 'a.json'}"])
  rows = json.load(open(tmp_path / "a.json"))["rows"]
  assert [r["layers"] for r in rows] == [1, 3]
  assert all(r[k] > 0 for r in rows for k, _ in bench_compile.COLUMNS)
  older = {"rows": [{k: v for k, v in r.items() if k in ("layers", "train_s")} for r in rows]}
  json.dump(older, open(tmp_path / "b.json", "w"))
  capsys.readouterr()
  bench_compile.main(["--compare", str(tmp_path / "b.json"), str(tmp_path / "a.json")])
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("| layers | GRPO step (before) | GRPO step (after) |")
  assert len(lines) == 4 and lines[2].startswith("| 1 | ")


def test_bench_train_attention_times_each_variant_against_the_first(tmp_path):
  bench_train_attention.main(["--batch=2", "--tokens=96", "--reps=2", f"--out={tmp_path}",
                              "--variants=heads_apart,full_attention"])
  rows = json.load(open(tmp_path / "bench_train_attention.json"))["rows"]
  assert [r["variant"] for r in rows] == ["heads_apart", "full_attention"]
  assert all(r["ms"] > 0 and r["repeats"] for r in rows)
  assert rows[1]["loss_rel"] == 0.0 and rows[1]["dq_rel"] == 0.0  # the same numbers
  with pytest.raises(SystemExit):
    bench_train_attention.main(["--variants=flash"])


def test_bench_episodes_times_the_turn_program_and_the_loop_it_replaced(tmp_path):
  bench_episodes.main([
      "--config_arg=family=long_horizon,mode=trace,seed=0,smoke,task.long_horizon.turns=3",
      "--reps=1", f"--workdir={tmp_path / 'run'}", f"--out={tmp_path}"])
  out = json.load(open(tmp_path / "bench_episodes.json"))
  # the two loops, then the environment's share of `turn` timed alone (`host`)
  assert out["turns"] == 3 and [r["loop"] for r in out["rows"]] == ["turn", "extend_run", "host"]
  assert out["rows"][2]["s"] < out["rows"][0]["s"]
  assert all(r["s"] > 0 and r["ms_a_turn"] == pytest.approx(1000 * r["s"] / 3)
             for r in out["rows"])
  with pytest.raises(SystemExit):
    bench_episodes.main(["--config_arg=family=reasoning,smoke", "--reps=1"])
