"""Figures of the ablation, drawn from its results directory (runs' metrics.jsonl, summary.json).

Used by experiments/ablation.py (writes PNGs) and experiments/ablation.ipynb (shows them).
"""

from __future__ import annotations

import json
import os

import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg by itself
import numpy as np

MODES = ("bf16", "fp4_rollout", "fp4_qat", "trace", "trace_all")
COLORS = dict(zip(MODES, ("black", "tab:red", "tab:orange", "tab:blue", "tab:green")))


def load_metrics(out: str, family: str, mode: str, seed: int = 0) -> list[dict]:
  path = os.path.join(out, family, mode, f"seed{seed}", "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as fh:
    return [json.loads(line) for line in fh if line.strip()]


def load_summary(out: str) -> dict:
  with open(os.path.join(out, "summary.json")) as fh:
    return json.load(fh)


def _series(rows, key, rl_only=True):
  pts = [(r["step"], r[key]) for r in rows
         if r.get(key) is not None and (not rl_only or r.get("phase") == "rl")]
  return np.array(pts).T if pts else (np.array([]), np.array([]))


def _smooth(y, k=20):
  if len(y) < k:
    return y
  return np.convolve(y, np.ones(k) / k, mode="valid")


def _seeds(out, family, mode):
  d = os.path.join(out, family, mode)
  return sorted(int(s[4:]) for s in os.listdir(d) if s.startswith("seed")) if os.path.isdir(
      d) else []


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


def curves(out: str, families, key: str, ylabel: str, log: bool = False, smooth: int = 20):
  """One panel per family: `key` against step for every mode (mean over seeds, smoothed)."""
  fig, panels = _panels(families)
  for ax, family in panels:
    for mode in MODES:
      runs = [_series(load_metrics(out, family, mode, s), key) for s in _seeds(out, family, mode)]
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


def flip_rate_per_layer(out: str, families):
  """Mean flip rate of each layer's quantized sites over the run's diagnostic steps."""
  fig, panels = _panels(families)
  for ax, family in panels:
    modes = [m for m in MODES if m != "bf16" and load_metrics(out, family, m)]
    for j, mode in enumerate(modes):
      rows = [r for r in load_metrics(out, family, mode) if "mismatch/flip_rate" in r]
      keys = sorted({k for r in rows for k in r if k.startswith("mismatch/flip_rate/")})
      layers = sorted({int(k.rsplit("_", 1)[1]) for k in keys})
      rates = [np.mean([r[k] for r in rows for k in keys if k.endswith(f"layer_{i}")])
               for i in layers]
      width = 0.8 / max(len(modes), 1)
      ax.bar(np.array(layers) + j * width, rates, width, color=COLORS[mode], label=mode)
      ax.set_xticks(np.array(layers) + 0.4 - width / 2, [str(i) for i in layers])
  return _finish(fig, panels, "layer", "flip rate")


def kl_by_position(out: str, families, last: int = 100):
  """mismatch/kl_k3_by_position over the last `last` RL steps, per mode."""
  fig, panels = _panels(families)
  for ax, family in panels:
    for mode in MODES:
      rows = [r for r in load_metrics(out, family, mode)
              if r.get("mismatch/kl_k3_by_position")][-last:]
      if not rows:
        continue
      buckets = np.array([[np.nan if v is None else v for v in r["mismatch/kl_k3_by_position"]]
                          for r in rows])
      y = np.nanmean(buckets, axis=0)
      x = (np.arange(len(y)) + 0.5) / len(y)
      ax.plot(x, np.maximum(y, 1e-12), "o-", color=COLORS[mode], label=mode)
  return _finish(fig, panels, "response position (fraction of the response)", "KL (k3)",
                 log=True)


def bytes_vs_kl(summary: dict, families):
  """Record bytes per token against the KL they buy (probe of the trained trace_all policy)."""
  fig, panels = _panels(families)
  for ax, family in panels:
    rows = summary.get(family, {}).get("probe", [])
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


def final_accuracy(summary: dict, families):
  """FP4 eval accuracy: TRACE-trained FP4 policies against post-hoc FP4 of the BF16 policy."""
  bars = [("bf16 policy, bf16", "bf16_bf16"), ("bf16 policy, FP4 post-hoc", "bf16_posthoc_fp4"),
          ("fp4_rollout, FP4", "fp4_rollout"), ("fp4_qat, FP4", "fp4_qat"),
          ("trace, FP4", "trace"), ("trace_all, FP4", "trace_all")]
  fig, ax = plt.subplots(figsize=(2.2 * len(families) + 4.5, 3.6))
  width = 0.8 / len(bars)
  for j, (label, key) in enumerate(bars):
    ys = [summary.get(f, {}).get("final_eval_accuracy", {}).get(key, np.nan) for f in families]
    ax.bar(np.arange(len(families)) + j * width, ys, width, label=label)
  ax.set_xticks(np.arange(len(families)) + 0.4 - width / 2, families)
  ax.set_ylabel("greedy eval accuracy")
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
  ax.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  return fig


def make_all(out: str, figures_dir: str, families) -> list[str]:
  os.makedirs(figures_dir, exist_ok=True)
  summary = load_summary(out)
  figs = {
      "reward_vs_step": curves(out, families, "reward/mean", "train reward"),
      "kl_vs_step": curves(out, families, "mismatch/kl_k3", "mismatch KL (k3)", log=True),
      "flip_rate_vs_step": curves(out, families, "mismatch/flip_rate", "flip rate", smooth=3),
      "flip_rate_per_layer": flip_rate_per_layer(out, families),
      "kl_by_position": kl_by_position(out, families),
      "record_bytes_vs_kl": bytes_vs_kl(summary, families),
      "final_accuracy": final_accuracy(summary, families),
  }
  paths = []
  for name, fig in figs.items():
    path = os.path.join(figures_dir, f"{name}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
  return paths
