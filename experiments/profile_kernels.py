"""The engine's decode kernels at the 48-layer bench's sizes, called alone: a target for Nsight
Compute (a rollout would launch thousands of other kernels first).

    ncu --clock-control none -k regex:"grouped_fp4|decode_attention" --launch-count 6 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        python experiments/profile_kernels.py [--kernels=gate,down,attn] [--batch=64]

qwen3_30b_a3b's sizes: the grouped MXFP4 expert matmuls (gate/up 2048 x 768, down 768 x 2048;
128 experts, each token routed to 8 drawn uniformly) on weights tiled in the engine's nibble
order (`dispatch.FP4_ORDER`), and the decode attention over an MXFP4 cache of 4096 slots (32
query heads on 4 kv heads, head_dim 128) as the dispatch runs it. Each kernel is called twice
(the second call is compiled already). Inputs are made on the host, so the GPU runs little
besides the kernels. Needs a Hopper GPU; prints each kernel's name when it has run.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import dispatch  # noqa: E402
from pallas_kernels.fp4_matmul import layout, mosaic  # noqa: E402
from trace_jax import cli  # noqa: E402
from trace_jax.quant import MXFP4, quantize  # noqa: E402

KERNELS = ("gate", "down", "attn")
EXPERTS, TOP_K, SHAPES = 128, 8, {"gate": (2048, 768), "down": (768, 2048)}
SLOTS, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 4, 128


def main(argv=None):
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--kernels", default=",".join(KERNELS), help=f"of {KERNELS}")
  parser.add_argument("--batch", type=int, default=64, help="sequences (tokens a decode step)")
  parser.add_argument("--row_tiles", type=int, default=1, help="the grouped kernel's")
  args = parser.parse_args(argv)
  kernels = [k for k in args.kernels.split(",") if k]
  if any(k not in KERNELS for k in kernels):
    parser.error(f"--kernels={args.kernels!r}: choose from {KERNELS}")
  if not mosaic.available():
    sys.exit("profile_kernels needs a Hopper GPU (the Mosaic GPU kernels)")
  rng = np.random.default_rng(0)
  m = args.batch
  choice = np.argsort(rng.random((m, EXPERTS)), axis=1)[:, :TOP_K]
  sizes = jnp.asarray(np.bincount(choice.ravel(), minlength=EXPERTS).astype(np.int32))
  for name in (k for k in ("gate", "down") if k in kernels):
    k, n = SHAPES[name]
    w = quantize(jnp.asarray(rng.standard_normal((EXPERTS, k, n), np.float32) * 0.05), MXFP4,
                 axis=-2)
    w = layout.tile(w, dispatch.FP4_ORDER)
    x = jnp.asarray(rng.standard_normal((m * TOP_K, k), np.float32), jnp.bfloat16)
    f = jax.jit(lambda x, w, s: mosaic.grouped_fp4_matmul(x, w, s, row_tiles=args.row_tiles))
    for _ in range(2):
      f(x, w, sizes).block_until_ready()
    print(name, "ran", flush=True)
  if "attn" in kernels:
    q = jnp.asarray(rng.standard_normal((m, HEADS, HEAD_DIM), np.float32), jnp.bfloat16)
    cache = [quantize(jnp.asarray(rng.standard_normal((m, SLOTS, KV_HEADS, HEAD_DIM),
                                                      np.float32)), MXFP4) for _ in range(2)]
    mask = jnp.ones((m, SLOTS), bool)
    f = jax.jit(dispatch.KernelOps().attention)
    for _ in range(2):
      f(q, *cache, mask).block_until_ready()
    print("attn ran", flush=True)


if __name__ == "__main__":
  main()
