"""What one rollout decode step computes outside its kernels, as it would run on a Hopper GPU, from
any machine (no GPU needed).

    python experiments/decode_ops.py [--layers=2] [--batch=64] [--context=4080] \
        [--variants=mxfp4:pallas+pairs,mxfp4:pallas,bf16:pallas] [--out=FILE] [--where]

For each variant (`bench_rollout`'s names) the engine's decode step is traced with the kernel
choices the dispatch makes on a Hopper GPU (the Mosaic GPU matmuls and attention, the Triton
quantize-and-record kernel; `pallas_kernels.dispatch`), on `bench_rollout`'s random weights as
shapes only: nothing is compiled or run. Counted are the step's primitives outside the kernels,
each call site once (a jitted function called four times counts four times; the decode loop's
body once): the data movement that becomes XLA fusions around the kernels (transposes, gathers,
slices, pads, concatenations, reductions, optimization barriers, type conversions), and the
kernel calls; and the bytes each kind of primitive writes (its outputs, an update in place its
update: an upper bound on what XLA's fusions of them write, since a fused producer writes
nothing). These are counts before
XLA fuses them, not times: a profile on the GPU
(`bench_rollout --profile --hlo`) says what they cost. `--where` also prints each counted
primitive's source line. Writes the counts as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import bench_rollout  # noqa: E402
from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.fp4_matmul import mosaic  # noqa: E402
from trace_jax.models import QuantRecipe  # noqa: E402
from trace_jax.models.config import preset as model_preset  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig  # noqa: E402

# the primitives that become data movement around the kernels
MOVEMENT = ("transpose", "gather", "slice", "dynamic_slice", "dynamic_update_slice", "pad",
            "concatenate", "reduce_sum", "reduce_max", "optimization_barrier",
            "convert_element_type")


@contextlib.contextmanager
def hopper_dispatch():
  """The dispatch's choices as on a Hopper GPU, for tracing only: the kernels compiled (not
  interpreted), the Mosaic GPU kernels available."""
  with mock.patch.object(dispatch, "_interpret", lambda: False), \
       mock.patch.object(dispatch, "_mosaic_attention_runs", lambda: True), \
       mock.patch.object(mosaic, "available", lambda: True):
    yield


# a Pallas kernel's call (Triton lowering: pallas_call; Mosaic GPU's `plgpu.kernel`: mpmd_map
# or core_map, depending on the jax version)
KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map", "core_map")


def _kernel_name(eqn) -> str:
  """The kernel body's function name, where the jax version records it."""
  info = eqn.params.get("name_and_src_info")
  if info is not None:
    return str(info).split()[0]
  bodies = [eqn.params.get("jaxpr"), *(eqn.params.get("jaxprs") or ())]
  for j in bodies:
    debug = getattr(getattr(j, "jaxpr", j), "debug_info", None)
    if getattr(debug, "func_name", None):
      return debug.func_name.split()[0]
  return eqn.primitive.name


def _subjaxprs(eqn):
  for p in eqn.params.values():
    for v in p if isinstance(p, (list, tuple)) else (p,):
      if hasattr(v, "eqns"):
        yield v
      elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
        yield v.jaxpr


def _written_bytes(eqn) -> int:
  """What a primitive writes: its outputs; an update in place (dynamic_update_slice) its
  update only; an optimization barrier (an identity) nothing."""
  if eqn.primitive.name == "optimization_barrier":
    return 0
  outs = eqn.invars[1:2] if eqn.primitive.name == "dynamic_update_slice" else eqn.outvars
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in outs
             if hasattr(v.aval, "dtype"))


def census(jaxpr, counts=None, where=None, nbytes=None, where_bytes=None):
  """Primitive counts of `jaxpr` and the jaxprs inside it, each call site once; a kernel
  (`pallas_call` or Mosaic GPU's) counts as "kernel: NAME" and is not entered. `where`, a
  Counter, also gets (primitive, source line) pairs of MOVEMENT's primitives; `nbytes`, a
  Counter, the bytes each of MOVEMENT's primitives writes (its outputs, before fusion), and
  `where_bytes` (with `where`) those bytes by (primitive, source line)."""
  from jax._src import source_info_util
  counts = collections.Counter() if counts is None else counts
  for e in jaxpr.eqns:
    name = e.primitive.name
    if name in KERNEL_PRIMITIVES:
      counts[f"kernel: {_kernel_name(e)}"] += 1
      continue
    subs = list(_subjaxprs(e))
    if subs:
      for s in subs:
        census(s, counts, where, nbytes, where_bytes)
      continue
    counts[name] += 1
    if nbytes is not None and name in MOVEMENT:
      nbytes[name] += _written_bytes(e)
    if where is not None and name in MOVEMENT:
      frames = source_info_util.user_frames(e.source_info.traceback) if (
          e.source_info.traceback) else []
      line = next((f"{os.path.relpath(f.file_name)}:{f.start_line} ({f.function_name})"
                   for f in frames), "?")
      where[name, line] += 1
      if where_bytes is not None:
        where_bytes[name, line] += _written_bytes(e)
  return counts


def run(variants, layers: int = 2, batch: int = 64, context: int = 4080,
        preset: str = "qwen3_30b_a3b", where: bool = False) -> dict:
  cfg = model_preset(preset, n_layers=layers)
  result = {"preset": preset, "layers": layers, "batch": batch, "context": context, "rows": []}
  for variant in variants:
    (precision, kernels, attention, scan, w4a4, order, fuse, fold, blocks,
     triton_backend) = bench_rollout.parse_variant(variant)
    if kernels == "xla":
      raise ValueError(f"{variant}: decode_ops counts what surrounds the kernels; take a "
                       "pallas or triton variant")
    layout = "pallas" if kernels == "pallas" else "xla"  # "triton": FP4 weights packed plainly
    recipe = QuantRecipe.uniform(precision)
    with hopper_dispatch():
      ops = dispatch.make_ops(layout, w4a4=w4a4, fp4_order=order, fuse=fuse)
      weights = jax.eval_shape(
          lambda k: bench_rollout.random_weights(cfg, recipe, ops, k, stacked=scan),
          jax.random.PRNGKey(0))
      engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=4, temperature=1.0),
                             kernels="pallas", attention_kernel=attention, scan_decode=scan,
                             w4a4=w4a4, fold_scales=fold, attention_blocks=blocks,
                             triton_backend=triton_backend)
      state = jax.eval_shape(
          lambda k: bench_rollout.decode_state(engine, weights, batch, context, 4, k),
          jax.random.PRNGKey(1))
      state = {**state, "limit": jax.ShapeDtypeStruct((), jnp.int32)}
      jaxpr = jax.make_jaxpr(engine._decode)(weights, state).jaxpr  # the decode loop
    lines = collections.Counter() if where else None
    nbytes = collections.Counter()
    line_bytes = collections.Counter()
    counts = census(jaxpr, where=lines, nbytes=nbytes, where_bytes=line_bytes)
    row = {"variant": variant,
           "movement": {k: counts[k] for k in MOVEMENT},
           "movement_mb": {k: round(nbytes[k] / 1e6, 2) for k in MOVEMENT},
           "kernels": {k[len("kernel: "):]: v for k, v in sorted(counts.items())
                       if k.startswith("kernel: ")},
           "primitives": sum(v for k, v in counts.items() if not k.startswith("kernel: "))}
    if where:
      # the sites by the bytes they write, then by count
      row["where"] = [[p, line, n, round(line_bytes[p, line] / 1e6, 3)]
                      for (p, line), n in sorted(lines.items(),
                                                 key=lambda kv: (-line_bytes[kv[0]], -kv[1]))]
    result["rows"].append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "where"}), flush=True)
  return result


def table(result: dict) -> str:
  """Counts, then the MB each kind writes a step where the run has them (before fusion)."""
  cols = [c for c in MOVEMENT if any(r["movement"][c] for r in result["rows"])]
  head = ["variant", *cols, "kernel calls", "all primitives"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in result["rows"]:
    lines.append("| " + " | ".join([r["variant"], *(str(r["movement"][c]) for c in cols),
                                    str(sum(r["kernels"].values())), str(r["primitives"])])
                 + " |")
  rows = [r for r in result["rows"] if "movement_mb" in r]
  if rows:
    head = ["variant (MB written a step)", *cols, "all"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
      mb = r["movement_mb"]
      lines.append("| " + " | ".join([r["variant"], *(f"{mb[c]:.1f}" for c in cols),
                                      f"{sum(mb.values()):.1f}"]) + " |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--context", type=int, default=4080)
  parser.add_argument("--preset", default="qwen3_30b_a3b")
  parser.add_argument("--variants", default="mxfp4:pallas+pairs,mxfp4:pallas,bf16:pallas")
  parser.add_argument("--where", action="store_true", help="each primitive's source lines too")
  parser.add_argument("--out", default="", help="a JSON file for the counts")
  args = parser.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v]
  try:
    for v in variants:
      bench_rollout.parse_variant(v)
  except ValueError as e:
    parser.error(str(e))
  result = run(variants, args.layers, args.batch, args.context, args.preset, args.where)
  if args.where:
    for r in result["rows"]:
      print(f"\n{r['variant']}:")
      print(f"  {'calls':>5s} {'MB':>8s} {'primitive':22s} source")
      for p, line, n, mb in r["where"]:
        print(f"  {n:5d} {mb:8.2f} {p:22s} {line}")
  print(table(result))
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)


if __name__ == "__main__":
  main()
