"""Curves of a run, drawn from its metrics.jsonl (matplotlib's Agg canvas, without pyplot:
no display needed, and no backend chosen for the program that imports this)."""

from __future__ import annotations

import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trace_jax.rl.writer import read_metrics

PANELS = [("reward/mean", "train reward", False), ("eval/accuracy", "eval accuracy", False),
          ("mismatch/kl_k3", "mismatch KL (k3)", True), ("mismatch/flip_rate", "flip rate", False)]


def plot_run(workdir: str, title: str = "") -> str:
  """Writes <workdir>/curves.png: reward, eval accuracy, mismatch KL and flip rate vs step."""
  rows = read_metrics(workdir)
  fig = Figure(figsize=(4 * len(PANELS), 3.2))
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(PANELS))
  rl_start = next((r["step"] for r in rows if r.get("phase") == "rl"), None)
  for ax, (key, label, log) in zip(axes, PANELS):
    if rl_start is not None:  # where the warm start ends and RL begins
      ax.axvline(rl_start, color="0.6", ls="--", lw=1)
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if pts:
      x, y = np.array(pts).T
      ax.plot(x, y, ".-" if len(pts) < 30 else "-", lw=1, ms=3)
      if len(pts) >= 30 and key == "reward/mean":  # a running mean over 20 steps
        k = np.ones(20) / 20
        ax.plot(x[19:], np.convolve(y, k, mode="valid"), lw=2)
    if log and pts and np.all(np.array(pts)[:, 1] > 0):
      ax.set_yscale("log")
    ax.set_title(label)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  path = os.path.join(workdir, "curves.png")
  fig.savefig(path, dpi=100)
  return path
