"""The ablation's committed per-run curves (curves.json): what the figures draw, from metrics.jsonl.

The runs' metrics files stay out of the repository (megabytes); curves.json keeps, per family
and run (`<mode>/seed<seed>`), only what experiments/figures.py draws, rounded to 4 significant
digits (tens of KB for the whole ablation):

- `rl_step0`: the first RL step; `reward/mean`, `mismatch/kl_k3`, `mismatch/route_flip_rate`:
  one value per RL step from it on (null where a step has none);
- `mismatch/flip_rate`, `eval/accuracy`: [step, value] pairs, at the steps that measured them
  (code flips every `log.flip_rate_every` RL steps; evaluations, the warm start's included);
- `mismatch/kl_k3_by_position`: each response-position bucket's mean over the last
  KL_WINDOW RL steps;
- `flip_rate_by_layer`: each layer's mean over the flip-measuring steps and the layer's sites.

summary.json (the table's numbers) and curves.json are written together, with the same
`provenance` (commit, package versions, time); `load` refuses a pair that is not.
"""

from __future__ import annotations

import collections
import json
import math
import os

DENSE = ("reward/mean", "mismatch/kl_k3", "mismatch/route_flip_rate")
SPARSE = ("mismatch/flip_rate", "eval/accuracy")
KL_WINDOW = 100  # RL steps at the end of a run that the KL-by-position figure averages
FORMAT = "trace_jax ablation curves v1"
SUMMARY, CURVES = "summary.json", "curves.json"

Results = collections.namedtuple("Results", "summary curves families")


class ResultsError(ValueError):
  """Results that cannot be drawn from: a missing or mismatched file, a family not in it."""


def _r(v):
  if v is None or not math.isfinite(v):
    return None
  return float(f"{v:.4g}")


def _mean(values):
  values = [v for v in values if v is not None and math.isfinite(v)]
  return sum(values) / len(values) if values else None


def run_curves(rows: list[dict]) -> dict:
  """A run's curves from its metrics rows (trace_jax.rl.writer.read_metrics)."""
  rl = [r for r in rows if r.get("phase") == "rl"]
  out = {"rl_step0": rl[0]["step"] if rl else None}
  by_step = {r["step"]: r for r in rl}
  steps = range(out["rl_step0"], rl[-1]["step"] + 1) if rl else range(0)
  for key in DENSE:
    out[key] = [_r(by_step.get(s, {}).get(key)) for s in steps]
  for key in SPARSE:
    out[key] = [[r["step"], _r(r[key])] for r in rows if r.get(key) is not None]
  buckets = [r["mismatch/kl_k3_by_position"] for r in rl
             if r.get("mismatch/kl_k3_by_position")][-KL_WINDOW:]
  out["mismatch/kl_k3_by_position"] = [_r(_mean(b)) for b in zip(*buckets)]
  per_layer = collections.defaultdict(list)
  for r in rl:
    if r.get("mismatch/flip_rate") is None:
      continue
    for k, v in r.items():
      if k.startswith("mismatch/flip_rate/") and "/layer_" in k:
        per_layer[int(k.rsplit("/layer_", 1)[1])].append(v)
  out["flip_rate_by_layer"] = [_r(_mean(per_layer[i])) for i in range(len(per_layer))]
  return out


def _dumps_curves(curves: dict) -> str:
  """JSON with one line per run, so that a rerun's diff reads run by run."""
  compact = lambda v: json.dumps(v, separators=(",", ":"))
  head = [f"{json.dumps(k)}: {compact(v)}" for k, v in curves.items() if k != "runs"]
  families = [f"  {json.dumps(family)}: {{\n" + ",\n".join(
      f"   {json.dumps(key)}: {compact(run)}" for key, run in runs.items()) + "}"
      for family, runs in curves["runs"].items()]
  return "{\n " + ",\n ".join(head) + ',\n "runs": {\n' + ",\n".join(families) + "}}\n"


def write(out: str, summary: dict, runs: dict) -> None:
  """summary.json and curves.json of one invocation, with the summary's provenance; each file
  replaced whole, so a stop leaves the old or the new one."""
  curves = {"format": FORMAT, "provenance": summary["provenance"], "kl_window": KL_WINDOW,
            "runs": runs}
  for name, text in ((SUMMARY, json.dumps(summary, indent=1) + "\n"),
                     (CURVES, _dumps_curves(curves))):
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as fh:
      fh.write(text)
    os.replace(path + ".tmp", path)


def load(out: str, families=None) -> Results:
  """summary.json and curves.json of `out`, checked to belong together and to hold `families`
  (default: every family they hold)."""
  data = {}
  for name in (SUMMARY, CURVES):
    path = os.path.join(out, name)
    if not os.path.exists(path):
      hint = (" (the ablation writes it with summary.json: rerun `python experiments/"
              "ablation.py`, which skips finished runs)") if name == CURVES else ""
      raise ResultsError(f"{path} is missing{hint}; nothing is drawn from partial results")
    with open(path) as fh:
      data[name] = json.load(fh)
  summary, curves = data[SUMMARY], data[CURVES]
  if curves.get("format") != FORMAT:
    raise ResultsError(f"{os.path.join(out, CURVES)} is not a {FORMAT!r} file")
  if summary.get("provenance") != curves["provenance"]:
    raise ResultsError(f"{os.path.join(out, SUMMARY)} and {CURVES} come from different "
                       "invocations of the ablation (their provenance differs)")
  held = list(curves["runs"])
  families = list(families or held)
  missing = [f for f in families if f not in held or f not in summary]
  if missing:
    raise ResultsError(f"families {missing} are not in {os.path.join(out, CURVES)} "
                       f"(it holds {held})")
  return Results(summary, curves, families)
