"""Compile time against depth: the first GRPO step's program, the prefill and the decode loop.

    python experiments/bench_compile.py [--layers=2,8,24,48] [--d_model=64] [--out=FILE] \
        [--programs=train,train_remat,prefill,decode,decode_scanned]
    python experiments/bench_compile.py --compare BEFORE.json AFTER.json

For each depth, a tiny-width policy (`tiny` preset, `--d_model`) in the main job's mode (trace,
MXFP4, records of the last layer, two minibatches) is lowered and compiled, from shapes only
(nothing runs): the GRPO step (`Trainer`'s jitted step: recompute, then one optimizer step per
minibatch), with `rl.remat=layer` too where the code has it; the rollout engine's prefill and its
decode loop, with `engine.scan_decode` too where the code has it. Seconds of lower + compile, one
process, no compilation cache; each program's seconds are printed, and the JSON rewritten, as
soon as it is compiled, so a run stopped by a time limit keeps what it finished. Runs on any
code version with these entry points, so "before" is this file run in a checkout of an older
commit; `--compare` prints both runs' table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trace_jax.models import init_params, pack_weights, tiny  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig  # noqa: E402
from trace_jax.rl.trainer import RLOptions, Trainer, make_optimizer, mode_setup  # noqa: E402

BATCH, PROMPT, NEW = 16, 8, 4  # the main job's smoke scale: 8 prompts x 2 samples


def _has(fn, name: str) -> bool:
  return name in inspect.signature(fn).parameters


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


PROGRAMS = ("train", "train_remat", "prefill", "decode", "decode_scanned")


def one_depth(n_layers: int, d_model: int, programs=PROGRAMS, row: dict | None = None,
              done=lambda row: None) -> dict:
  """Seconds to lower and compile each of `programs` at this depth (those the code has), in the
  order of PROGRAMS, put into `row` (a new one if None) as each is compiled; `done(row)` after
  each."""
  cfg = tiny(n_layers=n_layers, d_model=d_model)
  setup = mode_setup("trace", "mxfp4", "last:1")
  groups = setup.layer_groups(n_layers) if hasattr(setup, "layer_groups") else None
  init = (functools.partial(init_params, cfg, groups=groups) if _has(init_params, "groups")
          else functools.partial(init_params, cfg))
  params = jax.eval_shape(init, jax.random.PRNGKey(0))
  row = {"layers": n_layers} if row is None else row
  prompts = jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32)
  lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  total = PROMPT + NEW

  def engine(scanned: bool):
    kw = {"scan_decode": True} if scanned else {}
    e = RolloutEngine(cfg, setup.rollout, SamplingConfig(max_new_tokens=NEW),
                      records=setup.records, **kw)
    pack = functools.partial(pack_weights, cfg, recipe=setup.rollout)
    weights = jax.eval_shape(functools.partial(pack, stacked=True) if scanned else pack, params)
    state = jax.eval_shape(functools.partial(e._prefill, total=total), weights, prompts,
                           lengths, key)
    return e, weights, state

  def prefill():
    e, weights, _ = engine(False)
    e._prefill_jit.lower(weights, prompts, lengths, key, total).compile()

  def decode(scanned: bool):
    e, weights, state = engine(scanned)
    e.compiled_decode(weights, state)

  def train(remat: bool):
    e, _, state = engine(False)
    rollout = jax.eval_shape(lambda s: e.finish(s, PROMPT), state)
    batch = {"tokens": rollout.tokens, "valid": rollout.valid,
             "response_mask": rollout.response_mask, "logp": rollout.logp,
             "advantages": jax.ShapeDtypeStruct((BATCH,), jnp.float32),
             "records": rollout.records, "routes": rollout.routes}
    kw = {"remat": "layer"} if remat else {}
    trainer = Trainer(cfg, setup, make_optimizer(1e-3, 1e-3, 0), RLOptions(minibatches=2, **kw))
    train_state = jax.eval_shape(trainer.init_state, params)
    trainer._rl_jit.lower(train_state, batch, None).compile()

  has = {"train": True, "prefill": True, "decode": True,
         "train_remat": "remat" in {f.name for f in dataclasses.fields(RLOptions)},
         "decode_scanned": _has(RolloutEngine, "scan_decode")}
  compile_ = {"train": lambda: train(False), "train_remat": lambda: train(True),
              "prefill": prefill, "decode": lambda: decode(False),
              "decode_scanned": lambda: decode(True)}
  for name in PROGRAMS:
    if name in programs and has[name]:
      row[f"{name}_s"] = _seconds(compile_[name])
      done(row)
  return row


def run(layers: list[int], d_model: int = 64, programs=PROGRAMS, log=print,
        out: str = "") -> dict:
  """Every depth's row; each program's seconds logged, and the whole result written to `out`
  (if given), as soon as it is compiled."""
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "d_model": d_model,
            "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "rows": []}

  def done(row):
    if out:
      with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
    name, seconds = list(row.items())[-1]
    log(f"{row['layers']} layers: {name} {seconds:.1f}")

  for n in layers:
    result["rows"].append({"layers": n})
    one_depth(n, d_model, programs, row=result["rows"][-1], done=done)
  return result


COLUMNS = (("train_s", "GRPO step"), ("train_remat_s", "GRPO step, remat"),
           ("prefill_s", "prefill"), ("decode_s", "decode loop"),
           ("decode_scanned_s", "decode loop, scanned"))


def table(runs: dict[str, dict]) -> str:
  """One row per depth; a column per program and run (its label), seconds."""
  cols = [(label, key, name) for key, name in COLUMNS for label, r in runs.items()
          if any(key in row for row in r["rows"])]
  head = "| layers | " + " | ".join(f"{name} ({label})" for label, _, name in cols) + " |"
  lines = [head, "|---" * (len(cols) + 1) + "|"]
  depths = sorted({row["layers"] for r in runs.values() for row in r["rows"]})
  for n in depths:
    cells = []
    for label, key, _ in cols:
      row = next((row for row in runs[label]["rows"] if row["layers"] == n), {})
      cells.append(f"{row[key]:.1f}" if key in row else "")
    lines.append(f"| {n} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", default="2,8,24,48")
  p.add_argument("--d_model", type=int, default=64)
  p.add_argument("--out", default="")
  p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
  p.add_argument("--programs", default=",".join(PROGRAMS),
                 help="which to compile, comma-separated: " + ", ".join(PROGRAMS))
  args = p.parse_args(argv)
  if args.compare:
    runs = {}
    for label, path in zip(("before", "after"), args.compare):
      with open(path) as fh:
        runs[label] = json.load(fh)
    print(table(runs))
    return
  programs = tuple(n for n in args.programs.split(",") if n)
  for name in programs:
    if name not in PROGRAMS:
      p.error(f"--programs: {name} is not one of {', '.join(PROGRAMS)}")
  result = run([int(n) for n in args.layers.split(",") if n], args.d_model, programs,
               out=args.out)
  print(table({"this code": result}))


if __name__ == "__main__":
  main()
