"""Figures of the ablation, drawn from its committed results: summary.json and curves.json only.

Used by experiments/ablation.py (writes PNGs) and experiments/ablation.ipynb (shows them); every
function takes what `load(out)` returns.
"""

from __future__ import annotations

import os

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg by itself
import numpy as np

from experiments import curves as curves_file
from experiments import seeds

MODES = ("bf16", "fp4_rollout", "fp4_qat", "trace", "trace_all")
COLORS = dict(zip(MODES, ("black", "tab:red", "tab:orange", "tab:blue", "tab:green")))


def load(out: str, families=None) -> curves_file.Results:
  """summary.json and curves.json of a results directory; a missing or mismatched file raises
  curves_file.ResultsError naming it."""
  return curves_file.load(out, families)


def _runs(data, family, mode):
  """The curves of every seed of one family and mode."""
  return [r for key, r in sorted(data.curves["runs"][family].items())
          if key.split("/")[0] == mode]


def _series(run, key):
  """(steps, values) of one run's curve, the steps without a value left out."""
  if key in curves_file.DENSE:
    pts = [(run["rl_step0"] + i, v) for i, v in enumerate(run[key]) if v is not None]
  else:
    pts = [(s, v) for s, v in run[key] if v is not None]
  return np.array(pts).T if pts else (np.array([]), np.array([]))


def _smooth(y, k=20):
  if len(y) < k:
    return y
  return np.convolve(y, np.ones(k) / k, mode="valid")


def _mean_over_seeds(vectors):
  vectors = [np.array([np.nan if v is None else v for v in vec], float) for vec in vectors if vec]
  if not vectors:
    return np.array([])
  n = min(len(v) for v in vectors)
  return np.nanmean([v[:n] for v in vectors], axis=0)


def _panels(families):
  """One axis per family, side by side."""
  fig, axes = plt.subplots(1, len(families), figsize=(5 * len(families), 3.4), squeeze=False)
  return fig, list(zip(axes[0], families))


def _finish(fig, axes_families, xlabel, ylabel, log=False):
  for ax, family in axes_families:
    ax.set_title(family)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
  axes_families[0][0].legend(fontsize=8)
  fig.tight_layout()
  return fig


def curves(data, key: str, ylabel: str, log: bool = False, smooth: int = 20):
  """One panel per family: `key` against step for every mode (mean over seeds, smoothed)."""
  fig, panels = _panels(data.families)
  for ax, family in panels:
    for mode in MODES:
      runs = [_series(r, key) for r in _runs(data, family, mode)]
      runs = [r for r in runs if len(r[0])]
      if not runs:
        continue
      n = min(len(r[0]) for r in runs)
      x, y = runs[0][0][:n], np.mean([r[1][:n] for r in runs], axis=0)
      ys = _smooth(y, smooth)
      if log:  # exact zeros (trace_all's KL at most steps) sit on the floor of the axis
        ys = np.maximum(ys, 1e-12)
      ax.plot(x[len(x) - len(ys):], ys, color=COLORS[mode], label=mode, lw=1.5)
  return _finish(fig, panels, "step", ylabel, log)


def flip_rate_per_layer(data):
  """Mean flip rate of each layer's quantized sites over the run's diagnostic steps."""
  fig, panels = _panels(data.families)
  for ax, family in panels:
    rates = {m: _mean_over_seeds([r["flip_rate_by_layer"] for r in _runs(data, family, m)])
             for m in MODES if m != "bf16"}
    rates = {m: y for m, y in rates.items() if len(y)}
    width = 0.8 / max(len(rates), 1)
    for j, (mode, y) in enumerate(rates.items()):
      layers = np.arange(len(y))
      ax.bar(layers + j * width, y, width, color=COLORS[mode], label=mode)
      ax.set_xticks(layers + 0.4 - width / 2, [str(i) for i in layers])
  return _finish(fig, panels, "layer", "flip rate")


def kl_by_position(data):
  """mismatch/kl_k3_by_position over the last curves.KL_WINDOW RL steps, per mode."""
  fig, panels = _panels(data.families)
  for ax, family in panels:
    for mode in MODES:
      y = _mean_over_seeds([r["mismatch/kl_k3_by_position"] for r in _runs(data, family, mode)])
      if not len(y):
        continue
      x = (np.arange(len(y)) + 0.5) / len(y)
      ax.plot(x, np.maximum(y, 1e-12), "o-", color=COLORS[mode], label=mode)
  return _finish(fig, panels, "response position (fraction of the response)", "KL (k3)",
                 log=True)


def bytes_vs_kl(data):
  """Record bytes per token against the KL they buy (probe of the trained trace_all policy)."""
  fig, panels = _panels(data.families)
  for ax, family in panels:
    rows = data.summary[family].get("probe", [])
    for replay, marker in ((False, "o"), (True, "s")):
      pts = [(r["record/bytes_per_token"], r["mismatch/kl_k3"], r["records"]) for r in rows
             if r["routing_replay"] == replay]
      if not pts:
        continue
      x, y, labels = zip(*pts)
      ax.plot(x, np.maximum(y, 1e-12), marker + "-",
              label=f"routing replay {'on' if replay else 'off'}")
      for xi, yi, label in zip(x, y, labels):
        ax.annotate(label, (xi, max(yi, 1e-12)), fontsize=7, textcoords="offset points",
                    xytext=(3, 3))
  return _finish(fig, panels, "record bytes per token", "KL (k3)", log=True)


def _final_accuracies(family: dict) -> dict[str, list[float]]:
  """Greedy eval accuracy after RL of every recorded seed, per bar of `final_accuracy`: each
  mode's runs (the bf16 policy in bf16 as "bf16") and post-hoc FP4 of each bf16 policy."""
  out: dict[str, list[float]] = {}
  for key, run in sorted(family["runs"].items()):
    if run.get("eval_accuracy_after") is not None:
      out.setdefault(key.split("/")[0], []).append(run["eval_accuracy_after"])
  out["posthoc"] = list(seeds.posthoc(family).values())
  return out


def final_accuracy(data):
  """Greedy eval accuracy after RL: the FP4-trained policies against the bf16 policy in bf16 and
  post-hoc FP4. A bar is the mean over the seeds recorded, its error bar the 95% interval
  (experiments/seeds.py), the dots the seeds."""
  bars = [("bf16 policy, bf16", "bf16"), ("bf16 policy, FP4 post-hoc", "posthoc"),
          ("fp4_rollout, FP4", "fp4_rollout"), ("fp4_qat, FP4", "fp4_qat"),
          ("trace, FP4", "trace"), ("trace_all, FP4", "trace_all")]
  families = data.families
  values = [_final_accuracies(data.summary[f]) for f in families]
  fig, ax = plt.subplots(figsize=(2.2 * len(families) + 4.5, 3.6))
  width = 0.8 / len(bars)
  for j, (label, key) in enumerate(bars):
    stats = [seeds.interval(v.get(key, [])) for v in values]
    x = np.arange(len(families)) + j * width
    ys = [np.nan if s["mean"] is None else s["mean"] for s in stats]
    ax.bar(x, ys, width, yerr=[s["ci95"] or 0.0 for s in stats], capsize=2, label=label,
           error_kw={"elinewidth": 0.8})
    for xi, v in zip(x, values):
      ax.plot([xi] * len(v.get(key, [])), v.get(key, []), ".", color="black", ms=3)
  ax.set_xticks(np.arange(len(families)) + 0.4 - width / 2, families)
  ax.set_ylabel("greedy eval accuracy\n(seeds, mean, 95% interval)")
  ax.set_ylim(0, min(1.05, ax.get_ylim()[1]))  # an accuracy: intervals past 1 cut there
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  return fig


FIGURES = {  # name: how it is drawn; every one of them is in RESULTS.md
    "reward_vs_step": lambda d: curves(d, "reward/mean", "train reward"),
    "kl_vs_step": lambda d: curves(d, "mismatch/kl_k3", "mismatch KL (k3)", log=True),
    "flip_rate_vs_step": lambda d: curves(d, "mismatch/flip_rate", "flip rate", smooth=3),
    "flip_rate_per_layer": flip_rate_per_layer,
    "kl_by_position": kl_by_position,
    "record_bytes_vs_kl": bytes_vs_kl,
    "final_accuracy": final_accuracy,
}


def make_all(out: str, figures_dir: str, families=None) -> list[str]:
  """Every figure of FIGURES, from `out`'s summary.json and curves.json; checks them before
  drawing, so a missing file leaves the figures there untouched."""
  data = load(out, families)
  os.makedirs(figures_dir, exist_ok=True)
  paths = []
  for name, draw in FIGURES.items():
    fig = draw(data)
    path = os.path.join(figures_dir, f"{name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
  return paths
