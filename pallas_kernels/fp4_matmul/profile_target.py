"""A small program for a kernel profiler: one jitted matmul of the benchmark's big decode shape
(4096 x 14336) per variant, run a few times. Used as

    ncu --clock-control none -k regex:kernel python -m pallas_kernels.fp4_matmul.profile_target

(Nsight Compute's per-kernel counters: issue slots, stall reasons, memory throughput), and with
XLA_FLAGS=--xla_dump_to=DIR to keep the compiled PTX of the Pallas kernels. `--mosaic` profiles
the Mosaic GPU kernels instead: the bf16-decode MXFP4 one the engine runs (`mosaic.py`) and the
W4A4 one on FP8 tensor cores (`w4a4.py`), `-k regex:wgmma`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from pallas_kernels.fp4_matmul import api, layout, mosaic, reference, w4a4, w4a4_layout
from trace_jax.quant import MXFP4, dequantize, quantize


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--m", type=int, default=1)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--mosaic", action="store_true")
  args = parser.parse_args()
  k, n = 4096, 14336
  w = jax.random.normal(jax.random.PRNGKey(0), (k, n)) * 0.05
  x = jax.random.normal(jax.random.PRNGKey(1), (args.m, k), jnp.bfloat16)
  q, w16 = quantize(w, MXFP4, axis=0), w.astype(jnp.bfloat16)
  qt = reference.transpose(q)
  xq = quantize(x.astype(jnp.float32), MXFP4)
  variants = {
      "mosaic mxfp4": lambda t=layout.tile(q): mosaic.fp4_matmul(
          dequantize(xq).astype(jnp.bfloat16), t),
      "w4a4": lambda t=w4a4_layout.tile(q): w4a4.w4a4_matmul(xq, t, exact_path="none"),
  } if args.mosaic else {
      "fp4 asm": lambda: api.fp4_matmul(x, q, implementation="pallas", decode="asm"),
      "fp4 bits": lambda: api.fp4_matmul(x, q, implementation="pallas", decode="bits"),
      "fp4 kmajor": lambda: api.fp4_matmul(x, qt, implementation="pallas", decode="asm"),
      "bf16": lambda: api.bf16_matmul(x, w16, implementation="pallas", block_n=128,
                                      block_k=128, num_warps=8, num_stages=4),
  }
  for name, fn in variants.items():
    f = jax.jit(fn)
    for _ in range(args.reps):
      jax.block_until_ready(f())
    print(name, "ran", args.reps, "times", flush=True)


if __name__ == "__main__":
  main()
