"""Benchmark of the W4A4 (FP8 tensor core) matmuls against the bf16-decode Mosaic kernels and
bf16, at decode sizes, dense and grouped, in one run.

    python -m pallas_kernels.fp4_matmul.bench_w4a4 [--out=DIR] [--batches=1,16,64]

Rows: XLA's bf16 dot (grouped: the project's bf16 kernel), torch's bf16 (`x @ W`,
`torch._grouped_mm`) where torch sees the GPU, the Mosaic MXFP4 kernel the engine runs today
(bf16 activations, `mosaic.py`), and the W4A4 kernel (each of CONFIGS; "+exact" with the exact
path's check and branch) taking the activation as the rollout's MXFP4 QArray. Each is checked
against the reference (the dequantize-then-dot of the same MXFP4 activation and weight) first.
us: the kernels' device time per matmul (the activation's fold and the epilogue included);
"kernel_us": the matmul kernel alone. Bytes: the weight's (codes and scales, the experts hit),
the activation's and the output's. Writes w4a4_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp4_matmul import layout, mosaic, reference, w4a4
from pallas_kernels.fp4_matmul import w4a4_layout as L
from pallas_kernels.fp4_matmul.api import grouped_bf16_matmul
from pallas_kernels.fp4_matmul.bench import (EXPERTS, TOP_K, _rel, routing, torch_grouped,
                                             torch_time)
from pallas_kernels.timing import KERNELS, copy_bandwidth, time_calls
from trace_jax.quant import MXFP4, dequantize, quantize

DENSE = {"dot 4096x14336": (4096, 14336), "q_proj 2048x4096": (2048, 4096)}
GROUPED = {"gate/up 2048x768": (2048, 768), "down 768x2048": (768, 2048)}
CONFIGS = [dict(), dict(block_k=128), dict(block_k=256, max_concurrent_steps=2),
           dict(block_k=128, splits=2), dict(exact_path="xla"), dict(exact_path="kernel")]
# --sweep: the kernel's K step, copies in flight and K splits
SWEEP = [dict(block_k=bk, max_concurrent_steps=st, splits=sp)
         for bk in (128, 256, 512) for st in (2, 3) for sp in (1, 2, 4, 8)]
# --in_flight: the blocks whose wgmmas are issued before the first is summed
IN_FLIGHT = [dict(block_k=bk, max_concurrent_steps=2, splits=sp, in_flight=f)
             for bk, sp in ((256, 4), (512, 4), (256, 2)) for f in (2, 4, 8)]


def _exact_suffix(cfg: dict) -> str:
  """A row's name for its exact path: "+exact" behind XLA's conditional, "+exact in kernel"."""
  return {"none": "", "xla": "+exact", "kernel": "+exact in kernel"}[cfg["exact_path"]]


def _row(result, shape, m, variant, fn, x, ws, nbytes, ref, extra=None):
  try:
    out = jax.jit(fn)(x, ws[0])
    rel = _rel(out, ref)
    wall, dev = time_calls(fn, x, ws)
    kernel = {k: v for k, v in KERNELS.items() if "wgmma" in k}
    seconds = dev or wall
    row = {"shape": shape, "M": m, "variant": variant, "us": seconds * 1e6,
           "kernel_us": sum(kernel.values()) if kernel else None, "wall_us": wall * 1e6,
           "copy_frac": nbytes / seconds / result["copy_bytes_per_s"], "rel_err": rel,
           "kernels_us": dict(KERNELS), **(extra or {})}
    result["rows"].append(row)
    print(json.dumps(row), flush=True)
  except Exception as e:  # noqa: BLE001 -- a variant that fails is reported, not fatal
    result.setdefault("errors", []).append(f"{shape} M={m} {variant}: {type(e).__name__}: "
                                           f"{str(e)[:400]}")
    print(result["errors"][-1], flush=True)


def run(batches=(1, 16, 64), shapes=(), configs=CONFIGS) -> dict:
  key = jax.random.PRNGKey(0)
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(2.0), "rows": []}
  pick = lambda table: {k: v for k, v in table.items() if not shapes or k.split()[0] in shapes}
  for name, (k, n) in pick(DENSE).items():
    copies = max(4, int(np.ceil(200e6 / (k * n * 2))))
    w32 = [jax.random.normal(jax.random.fold_in(key, i), (k, n)) * 0.05 for i in range(copies)]
    w16 = [w.astype(jnp.bfloat16) for w in w32]
    packed = [quantize(w, MXFP4, axis=0) for w in w32]
    del w32
    tiled, tiled8 = [layout.tile(w) for w in packed], [L.tile(w) for w in packed]
    wbytes = packed[0].nbytes
    for m in batches:
      xq = quantize(jax.random.normal(jax.random.fold_in(key, 1000 + m), (m, k)), MXFP4)
      x16 = dequantize(xq).astype(jnp.bfloat16)
      ref = reference.fp4_matmul(x16, packed[0])
      io = m * k // 2 + m * k // 32 + m * n * 2
      _row(result, name, m, "xla bf16", reference.bf16_matmul, x16, w16,
           (k * n + m * k + m * n) * 2,
           reference.bf16_matmul(x16, w16[0]))
      t = torch_time(m, k, n, copies)
      if t is not None:
        result["rows"].append({"shape": name, "M": m, "variant": "torch bf16", "us": t * 1e6,
                               "copy_frac": (k * n * 2) / t / result["copy_bytes_per_s"]})
      _row(result, name, m, "mosaic mxfp4 (bf16 x)", lambda a, w: mosaic.fp4_matmul(a, w), x16,
           tiled, wbytes + io, ref)
      for cfg in configs:
        cfg = dict({"exact_path": "none"}, **cfg)
        _row(result, name, m, "w4a4" + _exact_suffix(cfg),
             lambda a, w, cfg=cfg: w4a4.w4a4_matmul(a, w, **cfg), xq, tiled8, wbytes + io, ref,
             cfg)
  for name, (k, n) in pick(GROUPED).items():
    copies = max(4, int(np.ceil(200e6 / (TOP_K * k * n * 2))))
    w16, packed = [], []
    for i in range(copies):
      w32 = jax.random.normal(jax.random.fold_in(key, i), (EXPERTS, k, n)) * 0.05
      w16.append(w32.astype(jnp.bfloat16))
      packed.append(quantize(w32, MXFP4, axis=-2))
    del w32
    tiled, tiled8 = [layout.tile(w) for w in packed], [L.tile(w) for w in packed]
    for m in batches:
      t_rows = TOP_K * m
      g = routing(jax.random.fold_in(key, m), m, EXPERTS, TOP_K)
      hit = int(jnp.sum(g > 0))
      xq = quantize(jax.random.normal(jax.random.fold_in(key, 2000 + m), (t_rows, k)), MXFP4)
      x16 = dequantize(xq).astype(jnp.bfloat16)
      ref = reference.grouped_fp4_matmul(x16, packed[0], g)
      io = t_rows * (k // 2 + k // 32 + n * 2)
      wbytes = hit * packed[0].nbytes / EXPERTS
      extra = {"T": t_rows, "experts_hit": hit}
      _row(result, name, m, "pallas bf16",
           lambda a, w: grouped_bf16_matmul(a, w, g, implementation="pallas"), x16, w16,
           (hit * k * n + t_rows * (k + n)) * 2, reference.grouped_bf16_matmul(x16, w16[0], g),
           extra)
      timed = torch_grouped(x16, w16[0], g, copies, None)
      if not isinstance(timed, str):
        result["rows"].append({"shape": name, "M": m, "variant": "torch bf16 grouped_mm",
                               "us": timed[0] * 1e6, **extra})
      _row(result, name, m, "mosaic mxfp4 (bf16 x)",
           lambda a, w: mosaic.grouped_fp4_matmul(a, w, g), x16, tiled, wbytes + io, ref, extra)
      for cfg in [c for c in configs if "max_concurrent_steps" not in c]:
        cfg = dict({"exact_path": "none"}, **cfg)
        _row(result, name, m, "w4a4" + _exact_suffix(cfg),
             lambda a, w, cfg=cfg: w4a4.grouped_w4a4_matmul(a, w, g, **cfg), xq, tiled8,
             wbytes + io, ref, dict(extra, **cfg))
  return result


def table(result: dict) -> str:
  best = {}
  for r in result["rows"]:
    k = (r["shape"], r["M"], r["variant"])
    if k not in best or r["us"] < best[k]["us"]:
      best[k] = r
  lines = ["| shape | M | variant | us | kernel us | % copy | rel err |", "|---|---|---|---|---|---|---|"]
  for (shape, m, variant), r in best.items():
    ku = r.get("kernel_us")
    lines.append(f"| {shape} | {m} | {variant} | {r['us']:.1f} | "
                 f"{'' if ku is None else f'{ku:.1f}'} | {100 * r.get('copy_frac', 0):.0f}% | "
                 f"{r.get('rel_err', float('nan')):.1e} |")
  return "\n".join(lines)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--batches", default="1,16,64")
  p.add_argument("--shapes", default="", help="comma-separated: dot, q_proj, gate/up, down")
  p.add_argument("--quick", action="store_true", help="the default and exact configs only")
  p.add_argument("--sweep", action="store_true", help="SWEEP's configs of the W4A4 kernel")
  p.add_argument("--in_flight", action="store_true", help="IN_FLIGHT's configs")
  a = p.parse_args()
  configs = ([CONFIGS[0], CONFIGS[-1]] if a.quick else SWEEP if a.sweep else
             IN_FLIGHT if a.in_flight else CONFIGS)
  result = run(tuple(int(b) for b in a.batches.split(",")),
               tuple(s for s in a.shapes.split(",") if s), configs)
  with open(os.path.join(a.out, "w4a4_bench.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table(result))
  for e in result.get("errors", []):
    print("error:", e)


if __name__ == "__main__":
  main()
