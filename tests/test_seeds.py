"""Across-seed statistics of the ablation table (experiments/seeds.py)."""

import math

import pytest

from experiments import seeds


def test_interval_is_students_t_over_the_seeds():
  s = seeds.interval([0.5, 0.6, None, 0.7])
  assert s["n"] == 3 and s["mean"] == pytest.approx(0.6)
  # t_{0.975, 2} = 4.302653, sd 0.1, over sqrt(3)
  assert s["ci95"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-6)
  assert seeds.interval([0.4]) == {"n": 1, "mean": 0.4, "ci95": None}
  assert seeds.interval([None]) == {"n": 0, "mean": None, "ci95": None}


def test_collapse_is_rl_undoing_the_warm_start():
  assert seeds.collapsed({"eval_accuracy_before_rl": 0.6, "eval_accuracy_after": 0.2})
  assert not seeds.collapsed({"eval_accuracy_before_rl": 0.6, "eval_accuracy_after": 0.31})
  assert seeds.collapsed({"eval_accuracy_before_rl": 0.6, "eval_accuracy_after": None})


def test_table_has_a_row_per_mode_with_several_seeds():
  run = lambda acc, kl: {"eval_accuracy_before_rl": 0.5, "eval_accuracy_after": acc,
                         "reward_last": acc, "mismatch_kl_k3": kl, "flip_rate": None}
  summary = {"reasoning": {"runs": {"trace/seed0": run(0.6, 1e-4), "trace/seed1": run(0.1, 3e-4),
                                    "bf16/seed0": run(0.7, 0.0)}}}
  table = seeds.markdown(summary, ["reasoning"])
  rows = [line for line in table.splitlines() if line.startswith("| reasoning")]
  assert len(rows) == 1 and rows[0].startswith("| reasoning | trace | 2 | 1 | 0.350 ± ")
  assert rows[0].endswith("| 2.0e-04 ± 1.3e-03 | - |")
  assert seeds.markdown({"reasoning": {"runs": {"bf16/seed0": run(0.7, 0.0)}}},
                        ["reasoning"]) == ""


def test_post_hoc_fp4_of_the_bf16_policies_gets_its_own_row():
  """Post-hoc FP4 (each bf16 seed's trained policy evaluated by the MXFP4 engine) across seeds,
  beside the modes: the baseline TRACE has to beat."""
  run = lambda acc, posthoc: {"eval_accuracy_before_rl": 0.5, "eval_accuracy_after": acc,
                              "reward_last": acc, "mismatch_kl_k3": 0.0, "flip_rate": None,
                              "posthoc_fp4_accuracy": posthoc}
  summary = {"long_horizon": {"runs": {"bf16/seed0": run(0.9, 0.7), "bf16/seed1": run(1.0, 0.4),
                                       "bf16/seed2": run(0.95, None)}}}
  rows = [line for line in seeds.markdown(summary, ["long_horizon"]).splitlines()
          if line.startswith("| long_horizon")]
  assert rows[0].startswith("| long_horizon | bf16 | 3 | 0 | 0.950 ± ")
  # two seeds have it: mean 0.55, t_{0.975, 1} = 12.706205 x sd 0.2121 / sqrt(2) = 1.906; seed 1
  # lost more than half of its bf16 policy's accuracy
  assert rows[1] == ("| long_horizon | bf16 policy, MXFP4 post hoc | 2 | 1 | 0.550 ± 1.906 | - | "
                     "- | - |")


def test_paired_differences_are_taken_within_each_seed():
  """Modes of one seed start RL from one warm start, so their differences within the seed say
  more than the modes' separate intervals: the gpu-size reasoning rows of RESULTS.md (seeds
  0 / 1 / 2) give trace - fp4_qat +0.035 ± 0.099 and trace - post hoc -0.013 ± 0.225."""
  acc = {"bf16": (0.540, 0.530, 0.520), "fp4_qat": (0.395, 0.425, 0.435),
         "trace": (0.390, 0.500, 0.470), "trace_all": (0.420, 0.465, 0.350)}
  posthoc = (0.500, 0.430, 0.470)
  runs = {f"{mode}/seed{s}": {"eval_accuracy_after": a[s], **(
      {"posthoc_fp4_accuracy": posthoc[s]} if mode == "bf16" else {})}
          for mode, a in acc.items() for s in range(3)}
  runs["trace/seed3"] = {"eval_accuracy_after": 0.9}  # a seed fp4_qat lacks: not paired
  pairs = seeds.paired({"runs": runs})
  got = {(p["a"], p["b"]): p for p in pairs}
  qat = got[("trace", "fp4_qat")]
  assert qat["n"] == 3 and qat["mean"] == pytest.approx(0.035)
  # differences -0.005, 0.075, 0.035: sd 0.04, t_{0.975, 2} = 4.302653
  assert qat["ci95"] == pytest.approx(4.302653 * 0.04 / math.sqrt(3), rel=1e-6)
  assert round(qat["ci95"], 3) == 0.099
  ph = got[("trace", "bf16 policy, MXFP4 post hoc")]
  assert round(ph["mean"], 3) == -0.013 and round(ph["ci95"], 3) == 0.225
  assert round(got[("bf16", "trace")]["mean"], 3) == 0.077
  table = seeds.paired_markdown({"reasoning": {"runs": runs}}, ["reasoning"])
  assert "| reasoning | trace - fp4_qat | 3 | +0.035 ± 0.099 | 2 of 3 |" in table
  assert seeds.paired_markdown({"reasoning": {"runs": {"bf16/seed0": runs["bf16/seed0"]}}},
                               ["reasoning"]) == ""
