"""Compile time against depth: the first GRPO step's program, the prefill and the decode loop.

    python experiments/bench_compile.py [--layers=2,8,24,48] [--d_model=64] [--out=FILE]
    python experiments/bench_compile.py --compare BEFORE.json AFTER.json

For each depth, a tiny-width policy (`tiny` preset, `--d_model`) in the main job's mode (trace,
MXFP4, records of the last layer, two minibatches) is lowered and compiled, from shapes only
(nothing runs): the GRPO step (`Trainer`'s jitted step: recompute, then one optimizer step per
minibatch), with `rl.remat=layer` too where the code has it; the rollout engine's prefill and its
decode loop, with `engine.scan_decode` too where the code has it. Seconds of lower + compile, one
process, no compilation cache. Runs on any code version with these entry points, so "before" is
this file run in a checkout of an older commit; `--compare` prints both runs' table.
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


def one_depth(n_layers: int, d_model: int) -> dict:
  cfg = tiny(n_layers=n_layers, d_model=d_model)
  setup = mode_setup("trace", "mxfp4", "last:1")
  groups = setup.layer_groups(n_layers) if hasattr(setup, "layer_groups") else None
  init = (functools.partial(init_params, cfg, groups=groups) if _has(init_params, "groups")
          else functools.partial(init_params, cfg))
  params = jax.eval_shape(init, jax.random.PRNGKey(0))
  row = {"layers": n_layers}

  engines = {"": {}}
  if _has(RolloutEngine, "scan_decode"):
    engines["_scanned"] = {"scan_decode": True}
  prompts = jax.ShapeDtypeStruct((BATCH, PROMPT), jnp.int32)
  lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  total = PROMPT + NEW
  for suffix, kw in engines.items():
    engine = RolloutEngine(cfg, setup.rollout, SamplingConfig(max_new_tokens=NEW),
                           records=setup.records, **kw)
    pack = functools.partial(pack_weights, cfg, recipe=setup.rollout)
    if kw:
      pack = functools.partial(pack, stacked=True)
    weights = jax.eval_shape(pack, params)
    if not suffix:
      row["prefill_s"] = _seconds(lambda: engine._prefill_jit.lower(
          weights, prompts, lengths, key, total).compile())
    state = jax.eval_shape(functools.partial(engine._prefill, total=total), weights, prompts,
                           lengths, key)
    row[f"decode{suffix}_s"] = _seconds(lambda: engine.compiled_decode(weights, state))
    if not suffix:
      rollout = jax.eval_shape(lambda s: engine.finish(s, PROMPT), state)

  batch = {"tokens": rollout.tokens, "valid": rollout.valid,
           "response_mask": rollout.response_mask, "logp": rollout.logp,
           "advantages": jax.ShapeDtypeStruct((BATCH,), jnp.float32),
           "records": rollout.records, "routes": rollout.routes}
  variants = {"": {}}
  if "remat" in {f.name for f in dataclasses.fields(RLOptions)}:
    variants["_remat"] = {"remat": "layer"}
  for suffix, kw in variants.items():
    trainer = Trainer(cfg, setup, make_optimizer(1e-3, 1e-3, 0), RLOptions(minibatches=2, **kw))
    state = jax.eval_shape(trainer.init_state, params)
    row[f"train{suffix}_s"] = _seconds(
        lambda: trainer._rl_jit.lower(state, batch, None).compile())
  return row


def run(layers: list[int], d_model: int = 64, log=print) -> dict:
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "d_model": d_model,
            "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "rows": []}
  for n in layers:
    result["rows"].append(one_depth(n, d_model))
    log(json.dumps(result["rows"][-1]))
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
  args = p.parse_args(argv)
  if args.compare:
    runs = {}
    for label, path in zip(("before", "after"), args.compare):
      with open(path) as fh:
        runs[label] = json.load(fh)
    print(table(runs))
    return
  result = run([int(n) for n in args.layers.split(",") if n], args.d_model)
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)
  print(table({"this code": result}))


if __name__ == "__main__":
  main()
