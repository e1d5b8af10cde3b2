"""The ablation's committed results: the curves file, figures and notebook drawn from it alone,
and the committed files' agreement with each other."""

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
from matplotlib.container import BarContainer

from experiments import ablation, curves, figures
from trace_jax.rl.writer import MetricsWriter

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS, FIGURES = ROOT / "experiments" / "results", ROOT / "experiments" / "figures"
NOTEBOOK = ROOT / "experiments" / "ablation.ipynb"
SITES = ("attn_in", "attn_out", "moe_in", "moe_mid", "k", "v")
# RESULTS.md says this of its figures while the committed results cannot redraw them
NOTICE = "drawn before `experiments/results/curves.json` existed"


def fake_run(workdir, mode, sft=6, rl=24, flip_every=5, layers=3, seed=0):
  """metrics.jsonl as the loop writes it: warm-start rows, then RL rows with the mismatch
  metrics, code flips every `flip_every` RL steps (none in bf16), evaluations now and then."""
  rng = np.random.default_rng([seed, ablation.MODES.index(mode)])
  os.makedirs(workdir, exist_ok=True)
  writer = MetricsWriter(str(workdir), tensorboard=False)
  for step in range(sft + rl):
    row = {"phase": "sft" if step < sft else "rl", "train/loss": float(rng.uniform(1, 2))}
    if step >= sft:
      kl = 10 ** rng.uniform(-9, -2) * (1 if rng.uniform() < 0.8 else -1)  # float32 noise
      buckets = list(10 ** rng.uniform(-6, -2, 4))
      buckets[3] = None if step % 7 == 0 else buckets[3]  # a bucket no response reached
      row.update({"reward/mean": float(rng.uniform()), "mismatch/kl_k3": kl,
                  "mismatch/route_flip_rate": float(rng.uniform(0, 0.1)),
                  "mismatch/kl_k3_by_position": buckets})
      if mode != "bf16" and (step - sft) % flip_every == 0:
        sites = {f"mismatch/flip_rate/{s}/layer_{i}": float(rng.uniform(0, 0.1 * (i + 1)))
                 for i in range(layers) for s in SITES}
        row.update(sites)
        row["mismatch/flip_rate"] = float(np.mean(list(sites.values())))
    if step in (sft - 1, sft + rl // 2, sft + rl - 1):
      row["eval/accuracy"] = float(rng.uniform())
    writer.write(step, row)
  writer.close()


def fake_results(out, families=("reasoning", "long_horizon"), modes=ablation.MODES, sft=6):
  """A results directory as the ablation leaves it, from fake runs through the ablation's own
  summary and curves code; the runs' directories removed, as in a fresh clone."""
  summary, runs = {"provenance": ablation.provenance(), "runtime_s": 1.0}, {}
  for family in families:
    summary[family] = {"runs": {}, "final_eval_accuracy": {}, "probe": [
        {"records": r, "routing_replay": replay, "record/bytes_per_token": b,
         "mismatch/kl_k3": kl / (10 if replay else 1)}
        for r, b, kl in (("none", 0, 1e-2), ("last:1", 120, 1e-3), ("all", 360, 1e-9))
        for replay in (False, True)]}
    runs[family] = {}
    for mode in modes:
      workdir = os.path.join(out, family, mode, "seed0")
      fake_run(workdir, mode, sft=sft)
      c = ablation.run_config(family, mode, 0, smoke=True)
      c.sft.steps = sft
      summary[family]["runs"][f"{mode}/seed0"], runs[family][f"{mode}/seed0"] = (
          ablation.run_results(family, mode, 0, workdir, c, smoke=True))
      summary[family]["final_eval_accuracy"][mode] = summary[family]["runs"][
          f"{mode}/seed0"]["eval_accuracy_after"]
    summary[family]["final_eval_accuracy"].update(bf16_bf16=0.5, bf16_posthoc_fp4=0.4)
    shutil.rmtree(os.path.join(out, family))
  curves.write(out, summary, runs)
  return summary


def execute_notebook(notebook, figures_dir, out=None, cwd=None) -> list[list[int]]:
  """Runs the notebook's code cells top to bottom in a fresh interpreter with a headless
  matplotlib (no Jupyter kernel needed) and saves every figure it drew to `figures_dir`;
  returns, per figure, the number of artists on each of its axes."""
  script = textwrap.dedent("""
      import json, os, sys
      import matplotlib
      matplotlib.use("Agg")
      import matplotlib.pyplot as plt
      notebook, figures_dir = sys.argv[1:3]
      scope = {"__name__": "__main__"}
      for cell in json.load(open(notebook))["cells"]:
        if cell["cell_type"] == "code":
          exec(compile("".join(cell["source"]), notebook, "exec"), scope)
      artists = []
      for num in plt.get_fignums():
        fig = plt.figure(num)
        fig.savefig(os.path.join(figures_dir, f"figure_{num}.png"))
        artists.append([len(a.lines) + len(a.patches) + len(a.collections) for a in fig.axes])
      print(json.dumps(artists))
      """)
  env = {k: v for k, v in os.environ.items() if k != "ABLATION_RESULTS"}
  env.update({"MPLBACKEND": "Agg", **({"ABLATION_RESULTS": str(out)} if out else {})})
  os.makedirs(figures_dir, exist_ok=True)
  proc = subprocess.run([sys.executable, "-c", script, str(notebook), str(figures_dir)],
                        cwd=cwd or NOTEBOOK.parent, env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_summary_matches_curves(summary, curves_json):
  """The table's numbers (trace_jax.rl.loop.summarize, over the runs' metrics) recomputed
  from the curves: both files describe the same runs."""
  def close(a, b, scale):
    assert (a is None) == (b is None), (a, b)
    assert a is None or math.isclose(a, b, rel_tol=0, abs_tol=1e-3 * scale + 1e-12), (a, b)

  mean = lambda vs: sum(vs) / len(vs) if vs else None
  for family, runs in curves_json["runs"].items():
    assert set(runs) == set(summary[family]["runs"])
    for key, run in runs.items():
      s = summary[family]["runs"][key]
      reward = [v for v in run["reward/mean"] if v is not None]
      n = max(1, min(10, len(run["reward/mean"]) // 4))  # summarize's first/last window
      close(mean(reward[:n]), s["reward_first"], 1)
      close(mean(reward[-n:]), s["reward_last"], 1)
      for name, ckey in (("mismatch_kl_k3", "mismatch/kl_k3"),
                         ("route_flip_rate", "mismatch/route_flip_rate")):
        values = [v for v in run[ckey] if v is not None]
        close(mean(values), s[name], mean([abs(v) for v in values]) or 0)
      close(mean([v for _, v in run["mismatch/flip_rate"]]), s["flip_rate"], 1)
      evals = dict(run["eval/accuracy"])
      assert evals[run["rl_step0"] - 1] == pytest.approx(s["eval_accuracy_before_rl"], abs=1e-4)
      assert run["eval/accuracy"][-1][1] == pytest.approx(s["eval_accuracy_after"], abs=1e-4)


def test_curves_hold_what_the_figures_draw(tmp_path, monkeypatch):
  fake_run(tmp_path, "trace", sft=6, rl=24)
  monkeypatch.setattr(curves, "KL_WINDOW", 10)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  run = curves.run_curves(rows)
  rl = [r for r in rows if r["phase"] == "rl"]
  assert run["rl_step0"] == 6 and len(run["reward/mean"]) == len(rl) == 24
  assert run["mismatch/kl_k3"][3] == float(f"{rl[3]['mismatch/kl_k3']:.4g}")
  assert [s for s, _ in run["mismatch/flip_rate"]] == [6, 11, 16, 21, 26]
  assert [s for s, _ in run["eval/accuracy"]] == [5, 18, 29]  # the warm start's last included
  last = np.array([[np.nan if v is None else v for v in r["mismatch/kl_k3_by_position"]]
                   for r in rl[-10:]])
  np.testing.assert_allclose(run["mismatch/kl_k3_by_position"], np.nanmean(last, 0), rtol=1e-3)
  diag = [r for r in rl if "mismatch/flip_rate" in r]
  for i in range(3):
    want = np.mean([r[f"mismatch/flip_rate/{s}/layer_{i}"] for r in diag for s in SITES])
    assert run["flip_rate_by_layer"][i] == pytest.approx(want, rel=1e-3)
  assert curves.run_curves(rows[:6])["reward/mean"] == []  # no RL step yet


def test_final_accuracy_bars_are_each_policys_mean_over_its_seeds():
  """The final-accuracy figure draws each policy's mean over the seeds recorded, with its 95%
  interval as the error bar, not the lowest seed's headline number; post-hoc FP4 from every
  bf16 seed's own evaluation."""
  runs = {f"{mode}/seed{seed}": {"eval_accuracy_after": a, "eval_accuracy_before_rl": 0.5}
          for mode, values in (("bf16", (0.5, 0.6, 0.7)), ("trace", (0.2, 0.4, 0.3)))
          for seed, a in enumerate(values)}
  for seed, p in enumerate((0.1, 0.2, 0.6)):
    runs[f"bf16/seed{seed}"]["posthoc_fp4_accuracy"] = p
  family = {"runs": runs, "final_eval_accuracy": {  # seed 0's, as the ablation keeps them
      "bf16": 0.5, "bf16_bf16": 0.5, "bf16_posthoc_fp4": 0.1, "trace": 0.2}}
  data = types.SimpleNamespace(families=["reasoning"], summary={"reasoning": family})
  ax = figures.final_accuracy(data).axes[0]
  bars = {c.get_label(): c for c in ax.containers if isinstance(c, BarContainer)}
  height = {label: c.patches[0].get_height() for label, c in bars.items()}
  assert height["bf16 policy, bf16"] == pytest.approx(0.6)
  assert height["bf16 policy, FP4 post-hoc"] == pytest.approx(0.3)
  assert height["trace, FP4"] == pytest.approx(0.3)
  assert np.isnan(height["fp4_qat, FP4"])  # no run of it
  (lo, hi), = [seg[:, 1] for seg in bars["trace, FP4"].errorbar.lines[2][0].get_segments()]
  half = 4.302653 * 0.1 / math.sqrt(3)  # Student's t, 2 degrees of freedom, sd 0.1
  assert (lo, hi) == pytest.approx((0.3 - half, 0.3 + half), rel=1e-5)


def test_results_are_one_summary_and_one_small_curves_file(tmp_path):
  out = tmp_path / "results"
  summary = fake_results(str(out))
  assert sorted(os.listdir(out)) == ["curves.json", "summary.json"]
  data = figures.load(str(out))
  assert data.families == ["reasoning", "long_horizon"]
  assert_summary_matches_curves(data.summary, data.curves)
  prov = data.summary["provenance"]
  assert {"jax", "jaxlib", "numpy", "optax", "orbax-checkpoint", "ml-collections",
          "reasoning-gym"} <= set(prov["packages"])
  if (ROOT / ".git").exists():
    assert re.fullmatch(r"[0-9a-f]{40}", prov["git_commit"]) and prov["git_dirty"] in (0, 1)
  # each run names its config and the one command that reruns it
  run = summary["long_horizon"]["runs"]["trace/seed0"]
  assert run["command"].startswith(
      "python -m trace_jax.main --config=configs/ablation.py:family=long_horizon,mode=trace,")
  assert run["config"]["rl"]["mode"] == "trace" and run["config"]["model"]["n_layers"] == 3
  table = ablation.markdown_table(summary, data.families)
  assert "`family=long_horizon,mode=trace,seed=0,smoke` |" in table
  assert "`experiments/ablation.py --families=reasoning --modes=bf16 --seeds=0` |" in table


def test_figures_only_draws_from_the_two_files_and_refuses_without_them(tmp_path, capsys):
  out, figs = tmp_path / "results", tmp_path / "figures"
  out.mkdir()
  figs.mkdir()
  shutil.copy(RESULTS / "summary.json", out / "summary.json")
  (figs / "reward_vs_step.png").write_bytes(b"the committed figure")
  with pytest.raises(SystemExit, match=r"^--figures_only: \S+curves.json is missing"):
    ablation.main(["--figures_only", f"--out={out}", f"--figures={figs}"])
  assert (figs / "reward_vs_step.png").read_bytes() == b"the committed figure"
  assert sorted(os.listdir(out)) == ["summary.json"]  # no table.md either


def test_figures_refuse_a_summary_and_curves_of_different_runs(tmp_path):
  out = tmp_path / "results"
  fake_results(str(out), families=("coding",), modes=("bf16", "trace"))
  with pytest.raises(curves.ResultsError, match="families \\['reasoning'\\] are not in"):
    figures.load(str(out), ["reasoning"])
  summary = json.loads((out / "summary.json").read_text())
  summary["provenance"]["written"] = "another time"
  (out / "summary.json").write_text(json.dumps(summary))
  with pytest.raises(curves.ResultsError, match="come from different invocations"):
    figures.load(str(out))


def test_notebook_runs_top_to_bottom_on_the_results_files_alone(tmp_path):
  out = tmp_path / "results"
  fake_results(str(out))
  artists = execute_notebook(NOTEBOOK, tmp_path / "figures", out=out)
  assert len(artists) == len(figures.FIGURES)
  assert all(n > 0 for fig in artists for n in fig), artists  # no empty axes
  paths = figures.make_all(str(out), str(tmp_path / "script_figures"))
  assert [os.path.basename(p) for p in paths] == [f"{n}.png" for n in figures.FIGURES]


def check_committed(root: pathlib.Path, tmp_path, sub: str = "") -> None:
  """The committed PNGs of `root` are the figures its committed results draw; until curves.json
  is committed RESULTS.md says they predate it and --figures_only refuses to overwrite them.
  sub: "gpu" for the --scale=gpu results and figures (experiments/{results,figures}/gpu)."""
  results, figs = root / "experiments" / "results" / sub, root / "experiments" / "figures" / sub
  assert sorted(p.name for p in figs.glob("*.png")) == sorted(f"{n}.png" for n in figures.FIGURES)
  results_md = (root / "RESULTS.md").read_text()
  for name in figures.FIGURES:
    assert f"(experiments/figures/{sub + '/' if sub else ''}{name}.png)" in results_md
  if not (results / "curves.json").exists():
    assert NOTICE in results_md and "python experiments/ablation.py" in results_md
    with pytest.raises(SystemExit, match="curves.json is missing"):
      ablation.main(["--figures_only", f"--out={results}", f"--figures={tmp_path}"])
    return
  assert NOTICE not in results_md
  data = figures.load(str(results))
  n_runs = sum(len(family) for family in data.curves["runs"].values())
  assert (results / "curves.json").stat().st_size < 12_000 * n_runs  # compact: ~8 KB a run
  assert_summary_matches_curves(data.summary, data.curves)
  assert data.summary["provenance"]["git_commit"]
  import matplotlib.image
  for path in figures.make_all(str(results), str(tmp_path / "redrawn")):
    committed = figs / os.path.basename(path)
    assert matplotlib.image.imread(path).shape == matplotlib.image.imread(committed).shape, path
  if sub:  # the notebook reads the CPU-scale results
    return
  artists = execute_notebook(root / "experiments" / "ablation.ipynb", tmp_path / "notebook",
                             cwd=root / "experiments")  # on the committed results
  assert len(artists) == len(figures.FIGURES) and all(n > 0 for f in artists for n in f)


def test_committed_figures_and_results_agree(tmp_path):
  check_committed(ROOT, tmp_path)


def test_committed_gpu_scale_figures_and_results_agree(tmp_path):
  check_committed(ROOT, tmp_path, "gpu")


def test_the_check_holds_once_a_full_run_is_committed(tmp_path):
  """check_committed on a clone holding what the next full run commits: the two files, the
  figures drawn from them, RESULTS.md without the notice; and a figure of another run fails."""
  root = tmp_path / "clone"
  (root / "experiments").mkdir(parents=True)
  for name in ("__init__.py", "curves.py", "figures.py", "seeds.py", "ablation.ipynb"):
    shutil.copy(ROOT / "experiments" / name, root / "experiments" / name)
  fake_results(str(root / "experiments" / "results"))
  figures.make_all(str(root / "experiments" / "results"), str(root / "experiments" / "figures"))
  (root / "RESULTS.md").write_text("".join(
      f"![{n}](experiments/figures/{n}.png)\n" for n in figures.FIGURES))
  check_committed(root, tmp_path / "check")
  shutil.copy(root / "experiments" / "figures" / "final_accuracy.png",
              root / "experiments" / "figures" / "kl_vs_step.png")
  with pytest.raises(AssertionError, match="kl_vs_step.png"):
    check_committed(root, tmp_path / "check_again")


def _fake_runs_schedule(monkeypatch):
  """The ablation's configs with the 6 supervised steps fake_results' runs have."""
  config = ablation.run_config

  def six_sft_steps(family, mode, seed, smoke=False, scale="cpu", init_from=""):
    c = config(family, mode, seed, smoke, scale, init_from)
    c.sft.steps = 6
    return c

  monkeypatch.setattr(ablation, "run_config", six_sft_steps)


def test_more_seeds_of_one_family_keep_every_other_result(tmp_path, monkeypatch, capsys):
  """Results accumulate: a later invocation for one family and new seeds, on a machine without
  the earlier runs' directories (a fresh clone with the committed files), keeps the other
  families and the recorded runs, trains only what is not recorded, and says which it kept."""
  out, figs = tmp_path / "results", tmp_path / "figures"
  before = fake_results(str(out), modes=("bf16", "trace"))
  before["provenance"]["device"] = "Earlier Device"  # the earlier runs' machine, not this one
  curves.write(str(out), before, curves.load(str(out)).curves["runs"])
  trained = []

  def train(c, workdir, progress=True):  # a fake run where the ablation trains one
    trained.append(os.path.relpath(workdir, out))
    fake_run(workdir, c.rl.mode, sft=6, seed=c.seed)

  monkeypatch.setattr(ablation, "train", train)
  monkeypatch.setattr(ablation, "finished", lambda w, c: os.path.exists(
      os.path.join(w, "metrics.jsonl")))
  # post hoc FP4 of each bf16 policy trained now (kept runs have no checkpoint here)
  monkeypatch.setattr(ablation, "fp4_eval", lambda w: 0.25 if w.endswith(
      os.path.join("bf16", "seed1")) else pytest.fail(f"no checkpoint in {w}"))
  _fake_runs_schedule(monkeypatch)
  ablation.main(["--smoke", f"--out={out}", f"--figures={figs}", "--families=long_horizon",
                 "--modes=bf16,trace", "--seeds=0,1"])
  assert sorted(trained) == [os.path.join("long_horizon", m, "seed1") for m in ("bf16", "trace")]
  assert "long_horizon / bf16 / seed 0: kept from" in capsys.readouterr().out
  data = figures.load(str(out))
  # kept runs: the commit and the device that produced them
  made = {"git_commit": before["provenance"]["git_commit"], "device": "Earlier Device"}
  assert data.summary["reasoning"]["runs"] == {
      k: {**r, **made} for k, r in before["reasoning"]["runs"].items()}
  assert data.summary["reasoning"]["probe"] == before["reasoning"]["probe"]
  lh = data.summary["long_horizon"]
  assert sorted(lh["runs"]) == ["bf16/seed0", "bf16/seed1", "trace/seed0", "trace/seed1"]
  assert lh["runs"]["trace/seed0"] == {**before["long_horizon"]["runs"]["trace/seed0"], **made}
  for key in ("git_commit", "device"):  # runs trained now: this invocation's
    assert lh["runs"]["trace/seed1"][key] == data.summary["provenance"][key]
  # the headline numbers stay the lowest seed's; what needs a checkpoint is kept
  assert lh["final_eval_accuracy"] == before["long_horizon"]["final_eval_accuracy"]
  assert lh["probe"] == before["long_horizon"]["probe"]
  assert_summary_matches_curves(data.summary, data.curves)
  assert lh["runs"]["bf16/seed1"]["posthoc_fp4_accuracy"] == 0.25
  table = (out / "table.md").read_text()
  assert "| long_horizon | trace | 2 |" in table
  posthoc = before["long_horizon"]["final_eval_accuracy"]["bf16_posthoc_fp4"]  # seed 0's
  assert f"| long_horizon | bf16 policy, MXFP4 post hoc | | -> {posthoc:.3f} |" in table
  assert "| long_horizon | bf16 policy, MXFP4 post hoc | | -> 0.250 |" in table
  assert "| long_horizon | bf16 policy, MXFP4 post hoc | 2 | " in table
  # the table and the figures (drawn from the same data) are of every family the results
  # hold, not only of the one this invocation trained
  assert "| reasoning | bf16 |" in table


def test_a_stop_during_a_family_keeps_the_runs_it_finished(tmp_path, monkeypatch):
  """The results are written after every run, not every family: a GPU call stopped by its time
  limit in a family's second run keeps the first, and the next call (a fresh machine, none of
  the run directories) trains only the missing run."""
  out, figs = tmp_path / "results", tmp_path / "figures"
  fake_results(str(out), modes=("bf16", "trace"))
  trained, stops = [], [KeyboardInterrupt]  # the first call's time limit, in its second run

  def train(c, workdir, progress=True):
    if c.rl.mode == "trace" and stops:
      raise stops.pop()
    trained.append(os.path.relpath(workdir, out))
    fake_run(workdir, c.rl.mode, sft=6, seed=c.seed)

  monkeypatch.setattr(ablation, "train", train)
  monkeypatch.setattr(ablation, "finished", lambda w, c: os.path.exists(
      os.path.join(w, "metrics.jsonl")))
  monkeypatch.setattr(ablation, "fp4_eval", lambda w: 0.25)
  _fake_runs_schedule(monkeypatch)
  args = ["--smoke", f"--out={out}", f"--figures={figs}", "--families=long_horizon",
          "--modes=bf16,trace", "--seeds=1"]
  with pytest.raises(KeyboardInterrupt):
    ablation.main(args)
  runs = figures.load(str(out)).summary["long_horizon"]["runs"]
  assert "bf16/seed1" in runs and "trace/seed1" not in runs
  shutil.rmtree(out / "long_horizon")  # the next call's machine has none of the directories
  ablation.main(args)
  assert trained == [os.path.join("long_horizon", m, "seed1") for m in ("bf16", "trace")]
  data = figures.load(str(out))
  assert {"bf16/seed1", "trace/seed1"} <= set(data.summary["long_horizon"]["runs"])
  assert_summary_matches_curves(data.summary, data.curves)


def test_a_stop_while_evaluating_post_hoc_keeps_every_run_that_finished(tmp_path, monkeypatch):
  """Post-hoc FP4 and the probe (a compile and an evaluation each) come after a family's runs
  are recorded: a call stopped by its time limit there keeps every run it trained (the bf16
  one without its post-hoc number), and the next call on the same machine adds that number
  without training again."""
  out, figs = tmp_path / "results", tmp_path / "figures"
  trained, stops = [], [KeyboardInterrupt]

  def train(c, workdir, progress=True):
    trained.append(os.path.relpath(workdir, out))
    fake_run(workdir, c.rl.mode, sft=6, seed=c.seed)

  def fp4_eval(workdir):
    if stops:
      raise stops.pop()
    return 0.25

  monkeypatch.setattr(ablation, "train", train)
  monkeypatch.setattr(ablation, "finished", lambda w, c: os.path.exists(
      os.path.join(w, "metrics.jsonl")))
  monkeypatch.setattr(ablation, "fp4_eval", fp4_eval)
  _fake_runs_schedule(monkeypatch)
  args = ["--smoke", f"--out={out}", f"--figures={figs}", "--families=reasoning",
          "--modes=bf16,trace", "--seeds=0"]
  with pytest.raises(KeyboardInterrupt):
    ablation.main(args)
  runs = json.load(open(out / "summary.json"))["reasoning"]["runs"]
  assert sorted(runs) == ["bf16/seed0", "trace/seed0"]
  assert "posthoc_fp4_accuracy" not in runs["bf16/seed0"]
  ablation.main(args)
  assert trained == [os.path.join("reasoning", m, "seed0") for m in ("bf16", "trace")]
  data = figures.load(str(out))
  assert data.summary["reasoning"]["runs"]["bf16/seed0"]["posthoc_fp4_accuracy"] == 0.25
  assert data.summary["reasoning"]["final_eval_accuracy"]["bf16_posthoc_fp4"] == 0.25
  assert "| reasoning | bf16 policy, MXFP4 post hoc | | -> 0.250 |" in open(out / "table.md").read()


def test_training_refuses_results_it_cannot_add_to(tmp_path, capsys):
  out = tmp_path / "results"
  out.mkdir()
  shutil.copy(RESULTS / "summary.json", out / "summary.json")  # its curves.json missing
  with pytest.raises(SystemExit):
    ablation.main([f"--out={out}", f"--figures={tmp_path / 'figures'}", "--families=coding"])
  assert re.search(r"--out: \S+ holds summary.json without the other of summary.json and "
                   r"curves.json; move the results aside to start afresh$",
                   capsys.readouterr().err.strip())
  assert sorted(os.listdir(out)) == ["summary.json"]


def test_the_table_lists_each_seed_s_modes_in_order_whatever_order_they_ran_in():
  run = {"reward_first": 0.1, "reward_last": 0.2, "eval_accuracy_before_rl": 0.3,
         "eval_accuracy_after": 0.4, "mismatch_kl_k3": 1e-3, "flip_rate": 0.1,
         "record_bytes_per_token": 0}
  ran = ["trace_all/seed1", "bf16/seed0", "trace/seed1", "bf16/seed1", "trace/seed0"]
  summary = {"coding": {"runs": {k: dict(run) for k in ran}, "final_eval_accuracy": {}}}
  rows = ablation.markdown_table(summary, ["coding"]).splitlines()[2:]
  assert [r.split("`")[1] for r in rows] == [
      "family=coding,mode=bf16,seed=0", "family=coding,mode=trace,seed=0",
      "family=coding,mode=bf16,seed=1", "family=coding,mode=trace,seed=1",
      "family=coding,mode=trace_all,seed=1"]


def test_the_gpu_scale_is_the_gpu_policy_on_harder_tasks_with_its_own_command(capsys):
  """--scale=gpu (issue 21's RL at depth): the `gpu` policy, harder tasks, and a config argument
  that reproduces the run through configs/ablation.py alone."""
  from configs import ablation as ablation_config
  c = ablation.run_config("long_horizon", "trace", 2, scale="gpu")
  assert (c.model.n_layers, c.model.d_model, c.model.n_experts) == (12, 512, 16)
  # ~1 500-token episodes: without recomputing each layer in the backward pass the warm start's
  # step took over 30 GB at a batch of 8 on CPU (a quarter of the schedule's 32)
  assert c.rl.remat == "layer" and c.sft.batch_size == 32
  assert c.rl.trace_layers == "last:4" and c.task.long_horizon.turns == 256 and c.seed == 2
  # the engine's kernels where they are the faster rollout at that size (BENCHMARKS.md: 1.55x
  # XLA's on long-horizon episodes on an H100; XLA 1.4-1.6x the faster on reasoning's prefill)
  assert c.engine.kernels == "pallas"
  arg = ablation.config_arg("long_horizon", "trace", 2, scale="gpu")
  assert arg == "family=long_horizon,mode=trace,seed=2,scale=gpu"
  assert ablation_config.get_config(arg) == c
  r = ablation.run_config("reasoning", "bf16", 0, scale="gpu")
  assert (r.task.reasoning.min_terms, r.task.reasoning.max_terms, r.task.reasoning.max_digits) == (
      3, 3, 2)
  assert (r.sft.steps, r.rl.steps) == (500, 200) and r.engine.kernels == "xla"
  assert ablation.config_arg("reasoning", "bf16", 0) == "family=reasoning,mode=bf16,seed=0"
  with pytest.raises(SystemExit):
    ablation.main(["--scale=tpu"])
  assert "--scale: invalid choice: 'tpu'" in capsys.readouterr().err
  with pytest.raises(ValueError,
                     match=r"unknown ablation scale 'tpu'; choose one of \('cpu', 'gpu'\)"):
    ablation_config.get_config("scale=tpu")


def test_the_post_hoc_row_s_command_names_the_scale_its_bf16_run_was_trained_at():
  """A `--scale=gpu` bf16 run's post-hoc row reproduces through a command with `--scale=gpu`
  (without it, the command evaluates the CPU-scale run of that seed)."""
  run = {"reward_first": 0.1, "reward_last": 0.2, "eval_accuracy_before_rl": 0.3,
         "eval_accuracy_after": 0.4, "mismatch_kl_k3": 1e-3, "flip_rate": None,
         "record_bytes_per_token": 0, "posthoc_fp4_accuracy": 0.35}
  for scale, flag in (("cpu", ""), ("gpu", " --scale=gpu")):
    arg = ablation.config_arg("reasoning", "bf16", 0, scale=scale)
    summary = {"reasoning": {"runs": {"bf16/seed0": {**run, "config_arg": arg}},
                             "final_eval_accuracy": {}}}
    row = ablation.markdown_table(summary, ["reasoning"]).splitlines()[-1]
    assert row.endswith(f"| `experiments/ablation.py{flag} --families=reasoning --modes=bf16 "
                        f"--seeds=0` |"), row


def test_merge_adds_the_runs_another_machine_recorded(tmp_path, capsys):
  """--merge: a results directory brought back from another machine, which started from an
  older copy of <out>, adds the runs <out> lacks (curves, headline numbers, probe) and redraws;
  a run both hold alike stays; one they hold with other numbers stops it, named, before
  anything is written."""
  here, there = tmp_path / "here", tmp_path / "there"
  fake_results(str(there), families=("reasoning",), modes=("bf16", "trace"))
  both = json.loads((there / "summary.json").read_text())
  theirs = curves.load(str(there))
  # <out> holds bf16 alone (the older copy the other machine started from)
  here.mkdir()
  mine = {"provenance": {**both["provenance"], "device": "Here Device"}, "reasoning": {
      "runs": {"bf16/seed0": both["reasoning"]["runs"]["bf16/seed0"]},
      "final_eval_accuracy": {k: v for k, v in both["reasoning"]["final_eval_accuracy"].items()
                              if k.startswith("bf16")}}}
  curves.write(str(here), mine, {"reasoning": {
      "bf16/seed0": theirs.curves["runs"]["reasoning"]["bf16/seed0"]}})
  figs = tmp_path / "figs"
  ablation.main([f"--out={here}", f"--figures={figs}", f"--merge={there}"])
  assert "from " + str(there) + ": reasoning/trace/seed0" in capsys.readouterr().out
  merged = curves.load(str(here))
  assert set(merged.summary["reasoning"]["runs"]) == {"bf16/seed0", "trace/seed0"}
  # each run keeps the device it ran on, though <out>'s provenance is of another machine
  assert merged.summary["provenance"]["device"] == "Here Device"
  assert {k: r["device"] for k, r in merged.summary["reasoning"]["runs"].items()} == {
      "bf16/seed0": "Here Device", "trace/seed0": both["provenance"]["device"]}
  assert merged.summary["reasoning"]["final_eval_accuracy"]["trace"] == (
      both["reasoning"]["runs"]["trace/seed0"]["eval_accuracy_after"])
  assert merged.curves["runs"]["reasoning"]["trace/seed0"] == (
      theirs.curves["runs"]["reasoning"]["trace/seed0"])
  assert merged.summary["reasoning"]["probe"] == both["reasoning"]["probe"]
  assert (figs / "reward_vs_step.png").exists()
  ablation.main([f"--out={here}", f"--figures={figs}", f"--merge={there}"])  # again: alike
  assert "nothing new" in capsys.readouterr().out
  changed = json.loads((there / "summary.json").read_text())
  changed["reasoning"]["runs"]["trace/seed0"]["eval_accuracy_after"] += 0.1
  (there / "summary.json").write_text(json.dumps(changed))
  before = (here / "summary.json").read_text()
  with pytest.raises(SystemExit) as e:
    ablation.main([f"--out={here}", f"--figures={figs}", f"--merge={there}"])
  assert e.value.code == 2 and "reasoning/trace/seed0 is recorded in" in capsys.readouterr().err
  assert (here / "summary.json").read_text() == before
  with pytest.raises(SystemExit):
    ablation.main([f"--out={here}", f"--merge={here}"])
  assert "is --out itself" in capsys.readouterr().err
