"""The run's summary from its metrics.jsonl (what `train` prints at the end, the ablation's table
reads), and the progress bar's few numbers."""

from __future__ import annotations

import numpy as np

from trace_jax.rl import metrics as M
from trace_jax.rl.writer import read_metrics


def postfix(m: dict) -> dict:
  """The progress bar's numbers of a step's metrics."""
  keys = {"reward/mean": "reward", "train/loss": "loss", "mismatch/kl_k3": "kl",
          "eval/accuracy": "eval"}
  return {short: f"{m[k]:.3g}" for k, short in keys.items() if k in m}


def summarize(workdir: str, c) -> dict:
  rows = read_metrics(workdir)
  rl = [r for r in rows if r.get("phase") == "rl"]
  evals = [r for r in rows if r.get("eval/accuracy") is not None]
  mean = lambda rs, k: float(np.mean([r[k] for r in rs if r.get(k) is not None])) if any(
      r.get(k) is not None for r in rs) else None
  n = max(1, min(10, len(rl) // 4))
  before = next((r for r in evals if r["step"] == c.sft.steps - 1), evals[0] if evals else {})
  return {
      "mode": c.rl.mode, "steps": len(rows),
      "reward_first": mean(rl[:n], "reward/mean"), "reward_last": mean(rl[-n:], "reward/mean"),
      "eval_accuracy_before_rl": before.get("eval/accuracy"),
      "eval_accuracy_after": evals[-1]["eval/accuracy"] if evals else None,
      "mismatch_kl_k3": mean(rl, "mismatch/kl_k3"),
      "flip_rate": mean(rl, "mismatch/flip_rate"),
      "route_flip_rate": mean(rl, "mismatch/route_flip_rate"),
      "rollout_tokens_per_s": mean(rl, "rollout/tokens_per_s"),
      "record_bytes_per_token": mean(rl, "record/bytes_per_token"),
      # the device memory the run's process held at most (a GPU's; None on CPU)
      "peak_memory_gib": max((r["memory/peak_gib"] for r in rows if "memory/peak_gib" in r),
                             default=None),
  }


def format_summary(s: dict) -> str:
  f = lambda v, fmt: "n/a" if v is None else fmt.format(v)
  return "\n".join([
      f"summary ({s['mode']}, {s['steps']} steps)",
      f"  reward (train, first -> last RL steps): {f(s['reward_first'], '{:.3f}')} -> "
      f"{f(s['reward_last'], '{:.3f}')}",
      f"  eval accuracy (rollout precision, greedy): {f(s['eval_accuracy_before_rl'], '{:.3f}')}"
      f" after the warm start -> {f(s['eval_accuracy_after'], '{:.3f}')}",
      f"  mismatch KL (k3, mean over RL steps): {f(s['mismatch_kl_k3'], '{:.2e}')} (float32 "
      f"resolves {M.KL_RESOLUTION:.0e}: one ulp of dlogp at logp = -1)",
      f"  flip rate (mean of diagnostic steps): {f(s['flip_rate'], '{:.4f}')}",
      f"  rollout tokens/s: {f(s['rollout_tokens_per_s'], '{:.0f}')}   "
      f"record bytes/token: {f(s['record_bytes_per_token'], '{:.0f}')}"
      + (f"   peak device memory: {s['peak_memory_gib']:.1f} GiB"
         if s.get("peak_memory_gib") is not None else ""),
  ])
