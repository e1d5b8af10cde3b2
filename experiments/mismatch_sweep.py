"""Mismatch against depth and response length: the probe on briefly warm-started policies.

    python experiments/mismatch_sweep.py --out=DIR                  # 4, 8, 16, 32 layers, GPU-sized
    python experiments/mismatch_sweep.py --out=DIR --quick          # 2 and 4 tiny layers, CPU minutes
    python experiments/mismatch_sweep.py --out=DIR --figures_only   # redraw from DIR/rows.jsonl

For each depth, a policy of the family's config (`configs/<family>.py:<variant>` with
`model.n_layers` set to the depth) is warm-started by `--sft_steps` steps of supervised training
(the RL loop with `rl.steps=0` in mode bf16, in DIR/warm_<L>, so a stopped sweep resumes), then probed by
`trace_jax.mismatch` on the first `--batch` prompts of the run's eval set: one rollout per
precision with records for every layer, then the trainer's recomputation with records none,
last:1, last:L/4, last:L/2 and all, routing replay off and on. The probe applies no stop token,
so every response is `--max_new_tokens` long: past the task's short answer the policy writes
what its warm start makes likely, which is what a long generation's mismatch needs.
The rollout's decode step runs as one scan over the layers (`--no-scan_decode`: unrolled, the
same rows, but a compile time that grows with depth).

DIR/rows.jsonl holds one row per (depth, precision, records, replay): the probe's row (KL k3,
flip rates per site and layer, KL and flip rate by response-position bucket) with `layers`,
`records_of` (the guidance as a share of depth: none, last:1, L/4, L/2, all) and `kernels` (the
rollout engine's; one engine a directory), appended as each (depth, precision) finishes; one
already in it is skipped, so a stopped sweep loses at most the probe it was in. The figures,
drawn from rows.jsonl alone: kl_by_depth.png, flips_by_depth.png (flip rate at the sites of
every layer), kl_by_position.png (each precision's deepest depth).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROWS = "rows.jsonl"
FIGURES = ("kl_by_depth.png", "flips_by_depth.png", "kl_by_position.png")
SHARES = ("none", "last:1", "L/4", "L/2", "all")
QUICK = dict(depths="2,4", variant="smoke", sft_steps=3, max_new_tokens=24, batch=4,
             n_buckets=4, precisions="mxfp4")


def guidances(n_layers: int) -> list[tuple[str, str]]:
  """(records, its share label) for a depth; last:N that equal another share are dropped."""
  out, seen = [], set()
  for share in SHARES:
    if share.startswith("L/"):
      spec = f"last:{max(1, n_layers // int(share[2:]))}"
    else:
      spec = share
    if spec in seen or (spec == f"last:{n_layers}"):
      continue
    seen.add(spec)
    out.append((spec, share))
  return out


def family_config(family: str, variant: str, n_layers: int, sft_steps: int):
  c = importlib.import_module(f"configs.{family}").get_config(variant or None)
  c.model.n_layers = n_layers
  c.sft.steps, c.rl.steps = sft_steps, 0
  c.eval.every = c.checkpoint.every = max(sft_steps, 1)
  c.rl.mode, c.rl.trace_layers = "bf16", "last:1"  # supervised only: no records to keep
  return c


def probe_config(args, workdir: str, n_layers: int, precision: str):
  c = importlib.import_module("configs.mismatch").get_config()
  c.checkpoint = workdir
  c.batch, c.max_new_tokens, c.n_buckets = args.batch, args.max_new_tokens, args.n_buckets
  c.precisions, c.kernels, c.routing_replay = precision, args.kernels, "off,on"
  c.scan_decode = args.scan_decode
  c.guidance = ",".join(spec for spec, _ in guidances(n_layers))
  return c


def read_rows(out: str) -> list[dict]:
  path = os.path.join(out, ROWS)
  if not os.path.exists(path):
    return []
  with open(path) as fh:
    return [json.loads(line) for line in fh if line.strip()]


def sweep_depth(args, n_layers: int, precision: str, log=print) -> list[dict]:
  """Warm start (resumed if DIR/warm_<L> has it) and probe one depth at one rollout precision
  -> its rows."""
  from trace_jax import mismatch
  from trace_jax.rl.loop import train
  from trace_jax.rl.validate import validate

  workdir = os.path.join(args.out, f"warm_{n_layers}")
  c = family_config(args.family, args.variant, n_layers, args.sft_steps)
  validate(c)
  start = time.perf_counter()
  train(c, workdir, progress=args.progress)
  warm_s = time.perf_counter() - start
  pc = probe_config(args, workdir, n_layers, precision)
  start = time.perf_counter()
  rows = mismatch.run(pc, log=lambda line: log(line) if line.startswith("#") else None)
  share = dict(guidances(n_layers))
  for row in rows:
    row.update(layers=n_layers, records_of=share[row["records"]], family=args.family,
               variant=args.variant, kernels=args.kernels, scan_decode=args.scan_decode,
               sft_steps=args.sft_steps, warm_s=warm_s,
               probe_s=time.perf_counter() - start)
  log(f"# {n_layers} layers, {precision}: warm start {warm_s:.0f}s, probe "
      f"{time.perf_counter() - start:.0f}s")
  return rows


def deepest(rows: list[dict], precision: str) -> int:
  """The largest depth swept at a rollout precision (the position figure's, per panel)."""
  return max(r["layers"] for r in rows if r["rollout_quant"] == precision)


def _by(rows, **match):
  return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def draw(rows: list[dict], out: str) -> list[str]:
  """The sweep's figures from its rows -> the paths written."""
  import matplotlib.pyplot as plt  # headless: matplotlib falls back to Agg by itself

  if not rows:
    raise ValueError(f"{os.path.join(out, ROWS)}: no rows to draw")
  precisions = sorted({r["rollout_quant"] for r in rows})
  depths = sorted({r["layers"] for r in rows})
  paths = []
  # linear below `floor` (so an exact 0 has a place): a flip rate's is one code in a billion,
  # under the few that records=all leaves at depth
  for name, key, label, floor in (
      ("kl_by_depth.png", "mismatch/kl_k3", "KL k3 (rollout || trainer)", 1e-6),
      ("flips_by_depth.png", "mismatch/flip_rate", "code flip rate", 1e-9)):
    fig, axes = plt.subplots(1, len(precisions), figsize=(5 * len(precisions), 3.6),
                             squeeze=False)
    for ax, precision in zip(axes[0], precisions):
      for share in SHARES:
        for replay, style in ((False, "-"), (True, "--")):
          pts = [(r["layers"], r.get(key)) for r in _by(rows, rollout_quant=precision,
                                                          records_of=share, routing_replay=replay)]
          pts = sorted((d, v) for d, v in pts if v is not None)
          if pts:
            ax.plot(*zip(*pts), style, marker="o", color=f"C{SHARES.index(share)}",
                    label=f"records {share}" + (", replay" if replay else ""))
      ax.set(title=f"{precision} (dashed: routing replay)", xlabel="layers", ylabel=label,
             xscale="log")
      ax.minorticks_off()
      ax.set_xticks(depths, [str(d) for d in depths])
      ax.set_yscale("symlog", linthresh=floor)
      ax.set_ylim(bottom=0)
      ax.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(out, name))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

  fig, axes = plt.subplots(1, len(precisions), figsize=(5 * len(precisions), 3.6), squeeze=False)
  for ax, precision in zip(axes[0], precisions):
    n_layers = deepest(rows, precision)
    buckets = 0
    for row in _by(rows, rollout_quant=precision, layers=n_layers, routing_replay=False):
      kl = row["mismatch/kl_k3_by_position"]
      buckets = max(buckets, len(kl))
      pts = [(i, v) for i, v in enumerate(kl) if v is not None]
      if pts:
        ax.plot(*zip(*pts), marker="o", color=f"C{SHARES.index(row['records_of'])}",
                label=f"records {row['records_of']}")
    ax.set(title=f"{precision}, {n_layers} layers, replay off",
           xlabel=f"response position bucket (of {buckets})", ylabel="KL k3")
    ax.set_yscale("symlog", linthresh=1e-6)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=6)
  fig.tight_layout()
  paths.append(os.path.join(out, "kl_by_position.png"))
  fig.savefig(paths[-1], dpi=90)
  plt.close(fig)
  return paths


def table(rows: list[dict]) -> str:
  lines = ["| layers | rollout | records | replay | KL k3 | flip rate | KL first -> last bucket |",
           "|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: (r["layers"], r["rollout_quant"],
                                       SHARES.index(r["records_of"]), r["routing_replay"])):
    b = [x for x in r["mismatch/kl_k3_by_position"] if x is not None]
    flips = r.get("mismatch/flip_rate")
    lines.append(f"| {r['layers']} | {r['rollout_quant']} | {r['records']} | "
                 f"{'on' if r['routing_replay'] else 'off'} | {r['mismatch/kl_k3']:.2e} | "
                 f"{'-' if flips is None else f'{flips:.4f}'} | "
                 f"{f'{b[0]:.1e} -> {b[-1]:.1e}' if b else '-'} |")
  return "\n".join(lines)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="the sweep's directory (rows, warm starts, figures)")
  p.add_argument("--depths", default="4,8,16,32")
  p.add_argument("--family", default="reasoning", help="configs/<family>.py")
  p.add_argument("--variant", default="gpu", help="the family config's variant string")
  p.add_argument("--sft_steps", type=int, default=200)
  p.add_argument("--max_new_tokens", type=int, default=2048)
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--n_buckets", type=int, default=16)
  p.add_argument("--precisions", default="mxfp4,nvfp4")
  p.add_argument("--kernels", default="xla", help="the rollout engine's: xla | pallas")
  p.add_argument("--scan_decode", action=argparse.BooleanOptionalAction, default=True,
                 help="the rollout's decode step as a scan over layers (the same rows as "
                 "unrolled; its compile time does not grow with depth)")
  p.add_argument("--quick", action="store_true", help="tiny depths and lengths: " + str(QUICK))
  p.add_argument("--figures_only", action="store_true")
  p.add_argument("--progress", action="store_true", help="progress bars of the warm starts")
  args = p.parse_args(argv)
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  try:
    args.depths = sorted({int(d) for d in args.depths.split(",")})
  except ValueError:
    p.error(f"--depths={args.depths!r}: comma-separated layer counts, e.g. 4,8,16,32")
  from trace_jax.models.recipe import precisions
  names = [name for name in args.precisions.split(",") if name]
  if not names or set(names) - set(precisions()):
    p.error(f"--precisions={args.precisions!r}: comma-separated rollout precisions, from "
            f"{', '.join(precisions())}")
  args.precisions = names
  if min(args.depths) < 1:
    p.error(f"--depths: every depth must be >= 1, got {args.depths}")
  if not os.path.isfile(os.path.join(ROOT, "configs", f"{args.family}.py")):
    p.error(f"--family={args.family!r}: no configs/{args.family}.py")
  for name in ("sft_steps", "max_new_tokens", "batch", "n_buckets"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv=None):
  args = parse(argv)
  os.makedirs(args.out, exist_ok=True)
  rows = read_rows(args.out)
  if args.figures_only:
    if not rows:
      raise SystemExit(f"{os.path.join(args.out, ROWS)}: no rows to draw figures from")
  else:
    held = {r.get("kernels", "xla") for r in rows} - {args.kernels}
    if held:  # one engine a directory: its figures compare depths, not engines
      print(f"--out={args.out} holds rows of the {', '.join(sorted(held))} engine; sweep "
            f"--kernels={args.kernels} into another directory", file=sys.stderr)
      raise SystemExit(2)
    done = {(r["layers"], r["rollout_quant"]) for r in rows}
    for n_layers in args.depths:
      for precision in args.precisions:
        if (n_layers, precision) in done:
          print(f"# {n_layers} layers, {precision}: in {ROWS} already")
          continue
        new = sweep_depth(args, n_layers, precision)
        with open(os.path.join(args.out, ROWS), "a") as fh:  # a (depth, precision) at a time
          for row in new:
            fh.write(json.dumps(row) + "\n")
        rows += new
  print(table(rows))
  for path in draw(rows, args.out):
    print(f"# wrote {path}")


if __name__ == "__main__":
  main()
