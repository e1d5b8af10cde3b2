"""Across seeds: mean and 95% confidence interval of a run's numbers, and collapsed runs.

The interval is Student's t over the seeds (n - 1 degrees of freedom; scipy, which jax itself
depends on, gives the quantile): with 3 seeds the half-width is 2.48 standard deviations, so
a difference between modes inside it is not one the data resolves. A run has collapsed when
its greedy eval accuracy after RL is below half its accuracy after the warm start (RL undid
what SFT taught), or it has none (it stopped on a non-finite loss). The modes of one seed start
RL from one warm start, so `paired` takes their differences within each seed (the interval of
those) as well.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

FIELDS = ("eval_accuracy_after", "reward_last", "mismatch_kl_k3", "flip_rate")


def interval(values) -> dict:
  """{"n", "mean", "ci95"}: the half-width of the 95% interval (None below 2 values; values
  that are None are left out)."""
  v = np.asarray([x for x in values if x is not None], np.float64)
  if v.size == 0:
    return {"n": 0, "mean": None, "ci95": None}
  half = None
  if v.size > 1:
    half = float(stats.t.ppf(0.975, v.size - 1) * v.std(ddof=1) / math.sqrt(v.size))
  return {"n": int(v.size), "mean": float(v.mean()), "ci95": half}


def collapsed(run: dict) -> bool:
  after, before = run.get("eval_accuracy_after"), run.get("eval_accuracy_before_rl")
  return after is None or (before is not None and after < 0.5 * before)


def by_mode(runs: dict) -> dict:
  """summary[family]["runs"] ({"mode/seedS": run}) -> per mode: seeds, collapsed runs, and the
  interval of each of FIELDS."""
  modes: dict[str, list[dict]] = {}
  for key, run in runs.items():
    modes.setdefault(key.split("/")[0], []).append(run)
  return {mode: {"seeds": len(rs), "collapsed": sum(map(collapsed, rs)),
                 **{f: interval(r.get(f) for r in rs) for f in FIELDS}}
          for mode, rs in modes.items()}


def posthoc(family: dict) -> dict[int, float]:
  """{seed: greedy eval accuracy of that seed's bf16-trained policy on the MXFP4 engine} of a
  family's summary: each bf16 run's `posthoc_fp4_accuracy`, and for the lowest bf16 seed,
  where its run predates that key, the family's headline `bf16_posthoc_fp4`."""
  runs = {int(k.split("/seed")[1]): r for k, r in family.get("runs", {}).items()
          if k.split("/")[0] == "bf16"}
  out = {seed: r["posthoc_fp4_accuracy"] for seed, r in runs.items()
         if r.get("posthoc_fp4_accuracy") is not None}
  headline = family.get("final_eval_accuracy", {}).get("bf16_posthoc_fp4")
  if runs and min(runs) not in out and headline is not None:
    out[min(runs)] = headline
  return dict(sorted(out.items()))


POSTHOC = "bf16 policy, MXFP4 post hoc"
# (a, b): what a - b within a seed says; POSTHOC is each seed's bf16 policy on the MXFP4 engine
PAIRS = (("trace", "fp4_qat"), ("trace_all", "fp4_qat"), ("trace", POSTHOC),
         ("trace_all", POSTHOC), ("bf16", "trace"), ("bf16", "trace_all"))


def paired(family: dict, pairs=PAIRS) -> list[dict]:
  """Eval accuracy after RL, a - b within each seed that has both (one warm start a seed, so
  the pair shares its start): per pair {"a", "b", "seeds", "above" (seeds where a > b)} and the
  interval of the differences. Pairs with no common seed are left out."""
  acc: dict[str, dict[int, float]] = {POSTHOC: posthoc(family)}
  for key, run in family.get("runs", {}).items():
    mode, seed = key.split("/seed")
    if run.get("eval_accuracy_after") is not None:
      acc.setdefault(mode, {})[int(seed)] = run["eval_accuracy_after"]
  out = []
  for a, b in pairs:
    common = sorted(set(acc.get(a, {})) & set(acc.get(b, {})))
    if common:
      diffs = [acc[a][s] - acc[b][s] for s in common]
      out.append({"a": a, "b": b, "seeds": common, "above": sum(d > 0 for d in diffs),
                  **interval(diffs)})
  return out


def paired_markdown(summary: dict, families) -> str:
  """One row per family and pair of `paired` with more than one common seed."""
  lines = ["| family | difference (eval acc. after RL) | seeds | mean ± 95% | a above b in |",
           "|---|---|---|---|---|"]
  for family in families:
    for p in paired(summary[family]):
      if p["n"] > 1:
        mean = round(p["mean"], 3) + 0.0  # (no "-0.000")
        lines.append(f"| {family} | {p['a']} - {p['b']} | {p['n']} | {mean:+.3f} ± "
                     f"{p['ci95']:.3f} | {p['above']} of {p['n']} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def markdown(summary: dict, families) -> str:
  """One row per family and mode with more than one seed: mean +- 95% half-width; and one for
  post-hoc FP4 of the bf16 policies (its collapsed count: below half the bf16 policy's own
  accuracy)."""
  def cell(s, spec):
    if s["mean"] is None:
      return "-"
    return spec.format(s["mean"]) + ("" if s["ci95"] is None else " ± " + spec.format(s["ci95"]))

  lines = ["| family | mode | seeds | collapsed | eval acc. after RL | reward, last RL steps | "
           "mismatch KL | flip rate |", "|---|---|---|---|---|---|---|---|"]
  rows = 0
  for family in families:
    for mode, s in by_mode(summary[family]["runs"]).items():
      if s["seeds"] < 2:
        continue
      rows += 1
      lines.append(f"| {family} | {mode} | {s['seeds']} | {s['collapsed']} | "
                   f"{cell(s['eval_accuracy_after'], '{:.3f}')} | "
                   f"{cell(s['reward_last'], '{:.3f}')} | {cell(s['mismatch_kl_k3'], '{:.1e}')} | "
                   f"{cell(s['flip_rate'], '{:.4f}')} |")
    fp4 = posthoc(summary[family])
    if len(fp4) > 1:
      rows += 1
      runs = summary[family]["runs"]
      lost = sum(1 for seed, acc in fp4.items()
                 if acc < 0.5 * (runs[f"bf16/seed{seed}"].get("eval_accuracy_after") or 0))
      lines.append(f"| {family} | bf16 policy, MXFP4 post hoc | {len(fp4)} | {lost} | "
                   f"{cell(interval(fp4.values()), '{:.3f}')} | - | - | - |")
  return "\n".join(lines) if rows else ""
