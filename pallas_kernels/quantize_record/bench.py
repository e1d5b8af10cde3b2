"""Benchmark of quantize-and-record against the quant core under XLA, on activation shapes.

    python -m pallas_kernels.quantize_record.bench [--out=DIR] [--quick]

Activations [T, D] in bf16 (D = 2048: a qwen3_30b_a3b-like hidden size; 768: its expert
width), T tokens, MXFP4 and NVFP4: the quant core under XLA, the first kernel ("strided", at its
best measured tile) and the block-row kernel ("blocks") at a few tokens a program and warp
counts (--quick: its default only). Times are the device time of every kernel the call runs,
the strided layout's padding included, from a profiler trace (see
pallas_kernels/timing.py; each row keeps the split per kernel); bytes count x read
once and the codes, record bits, scales (and NVFP4's globals) written once. Each variant is
checked bit for bit against the core first.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.timing import KERNELS, copy_bandwidth, time_calls
from pallas_kernels.quantize_record import quantize_and_record
from pallas_kernels.quantize_record.kernel import default_block_t
from trace_jax.quant import get_format

SHAPES = [(64, 2048), (256, 2048), (4096, 2048), (4096, 768)]
STRIDED = [dict(layout="strided", block_t=8, num_warps=4)]
BLOCKS = [dict(layout="blocks", block_t=t, num_warps=w)
          for t, w in [(1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8)]]


def run(quick: bool = False) -> dict:
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(1.0), "rows": []}
  for t, d in SHAPES:
    # copies larger than the L2 together where that takes at most 32 (small T stays in L2, as a
    # freshly written activation would)
    copies = min(32, max(4, int(np.ceil(200e6 / (t * d * 2)))))
    xs = [jax.random.normal(jax.random.PRNGKey(i), (t, d), jnp.bfloat16) * 3
          for i in range(copies)]
    for fmt in ("mxfp4", "nvfp4"):
      b = get_format(fmt).block_size
      nbytes = t * d * 2 + t * d // 2 + t * d // 8 + t * d // b + (4 * t if fmt == "nvfp4" else 0)
      want = jax.jit(lambda x, fmt=fmt: quantize_and_record(x, fmt))(xs[0])
      blocks = ([dict(layout="blocks", block_t=default_block_t("blocks", d), num_warps=4)]
                if quick else BLOCKS)
      variants = [("xla", {})] + [("pallas", c) for c in STRIDED + blocks]
      for impl, cfg in variants:
        fn = lambda x, w, impl=impl, cfg=cfg, fmt=fmt: quantize_and_record(
            w, fmt, implementation=impl, **cfg)
        row = {"T": t, "D": d, "fmt": fmt, "impl": impl, **cfg}
        if cfg.get("layout") == "blocks":
          row["default"] = cfg["block_t"] == default_block_t("blocks", d)
        try:
          got = jax.jit(lambda w: fn(None, w))(xs[0])
          row["exact"] = all(np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(
              jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)))
          wall, dev = time_calls(fn, None, xs)
          sec = dev or wall
          row.update(us=sec * 1e6, wall_us=wall * 1e6, GBps=nbytes / sec / 1e9,
                     copy_frac=nbytes / sec / result["copy_bytes_per_s"],
                     kernels=dict(KERNELS) if dev else {})
        except Exception as e:  # noqa: BLE001
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--quick", action="store_true", help="the blocks layout's default only")
  args = parser.parse_args()
  result = run(args.quick)
  with open(os.path.join(args.out, "quantize_record_bench.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(f"device {result['device']}, copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s")
  for r in result["rows"]:
    cfg = (f"{r['layout']} t{r['block_t']}w{r['num_warps']}{'*' if r.get('default') else ''}"
           if "block_t" in r else "")
    print(f"{r['T']:5d} x {r['D']:5d} {r['fmt']:6s} {r['impl']:7s} {cfg:16s} "
          + (f"{r['us']:8.1f} us {r['GBps']:7.0f} GB/s {100 * r['copy_frac']:5.1f}% copy "
             f"exact={r['exact']}" if "us" in r else r.get("error", "")))


if __name__ == "__main__":
  main()
