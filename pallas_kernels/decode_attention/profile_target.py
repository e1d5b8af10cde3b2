"""A small program for a kernel profiler: decode attention at one benchmark shape (default
64 sequences x 8K slots, qwen3_30b_a3b's 32 query heads on 4 kv heads, head_dim 128), each
variant jitted and run a few times. Used as

    ncu --clock-control none -k regex:decode_attention -c 6 \
        python -m pallas_kernels.decode_attention.profile_target

(Nsight Compute's per-kernel counters: occupancy, issue slots, stall reasons, memory
throughput). Variants: the Mosaic (wgmma) kernel on MXFP4 and bf16 caches, the Triton one on
bf16 caches (`--variants` picks some).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import api
from pallas_kernels.decode_attention.bench import HEAD_DIM, HEADS, KV_HEADS
from trace_jax.quant import MXFP4, NVFP4, quantize

VARIANTS = ("mosaic:mxfp4", "mosaic:bf16", "triton:bf16", "mosaic:nvfp4", "triton:mxfp4",
            "mosaic:mxfp4:fold",  # fold: the MXFP4 scales folded (`mosaic.FOLD_REF`)
            "mosaic:mxfp4:b2",  # b2: two 64-slot blocks a pipeline step
            "mosaic:mxfp4:lean", "mosaic:mxfp4:b2:lean")  # lean: `mosaic._body`'s


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--context", type=int, default=8192)
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--variants", default=",".join(VARIANTS[:3]))
  args = parser.parse_args()
  variants = [v for v in args.variants.split(",") if v]
  unknown = sorted(set(variants) - set(VARIANTS))
  if unknown:
    parser.error(f"unknown --variants {unknown}; choose from {VARIANTS}")
  b, s = args.batch, args.context
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(k1, (b, HEADS, HEAD_DIM), jnp.bfloat16)
  k = jax.random.normal(k2, (b, s, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  v = jax.random.normal(k3, (b, s, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  mask = jnp.ones((b, s), bool)
  caches = {"bf16": (k, v), "mxfp4": (quantize(k, MXFP4), quantize(v, MXFP4)),
            "nvfp4": (quantize(k, NVFP4), quantize(v, NVFP4))}
  for name in variants:
    backend, fmt, *option = name.split(":")
    extra = {}
    for o in option:  # fold, b2, lean, as the name has them
      extra.update({"fold": {"fold": True}, "b2": {"blocks": 2}, "lean": {"lean": True}}[o])
    f = jax.jit(lambda q, kv, mask, backend=backend, extra=extra: api.decode_attention(
        q, kv[0], kv[1], mask, implementation="pallas", backend=backend, **extra))
    for _ in range(args.reps):
      jax.block_until_ready(f(q, caches[fmt], mask))
    print(name, "ran", args.reps, "times", flush=True)


if __name__ == "__main__":
  main()
