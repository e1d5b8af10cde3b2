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
