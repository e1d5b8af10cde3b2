"""The ablation script end to end in its smoke setting, the notebook that reads it, and the
rollout benchmark on CPU (its kernels interpreted)."""

import json
import os

import pytest

from experiments import ablation, bench_rollout

pytestmark = pytest.mark.slow  # minutes: short RL runs, a probe, an interpreted benchmark


def run_notebook(path, out):
  """Executes the notebook's code cells with OUT pointed at `out`."""
  scope = {}
  with open(path) as fh:
    cells = [c for c in json.load(fh)["cells"] if c["cell_type"] == "code"]
  for cell in cells:
    exec("".join(cell["source"]).replace("OUT = 'experiments/results' if",
                                         f"OUT = {out!r} if"), scope)
  return scope


def test_ablation_smoke_writes_summary_figures_and_the_notebook_runs(tmp_path):
  out, figs = str(tmp_path / "results"), str(tmp_path / "figures")
  ablation.main(["--smoke", f"--out={out}", f"--figures={figs}", "--families=reasoning",
                 "--modes=bf16,trace_all", f"--data_dir={tmp_path / 'tfds'}"])
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
  # rerunning skips the finished runs
  ablation.main(["--smoke", f"--out={out}", f"--figures={figs}", "--families=reasoning",
                 "--modes=bf16", f"--data_dir={tmp_path / 'tfds'}"])
  os.remove(os.path.join(out, "table.md"))
  ablation.main(["--figures_only", f"--out={out}", f"--figures={figs}", "--families=reasoning"])
  assert "| reasoning | bf16 |" in open(os.path.join(out, "table.md")).read()
  scope = run_notebook(os.path.join(os.path.dirname(ablation.__file__), "ablation.ipynb"), out)
  assert scope["FAMILIES"] == ["reasoning"]


def test_bench_rollout_runs_its_variants():
  result = bench_rollout.run(2, [4], 112, 16, ["bf16:xla", "mxfp4:pallas"], preset="small")
  rows = result["rows"]
  assert not result["errors"] and [r["variant"] for r in rows] == ["bf16:xla", "mxfp4:pallas"]
  assert all(r["tokens_per_s"] > 0 and r["roofline_frac"] > 0 for r in rows)
  assert rows[1]["bytes_per_step"]["total"] < rows[0]["bytes_per_step"]["total"] / 2
  print(bench_rollout.table(result))
  # a cache with room for more than it holds (--slots): the step reads the filled part
  longer = bench_rollout.run(2, [4], 112, 16, ["bf16:xla"], preset="small", slots=256)
  assert not longer["errors"] and longer["slots"] == 256
  kv, kv_full = (r["rows"][0]["bytes_per_step"]["kv_cache"] for r in (longer, result))
  assert kv == int(kv_full * 256 / 128 * (112 + 8) / 256)
