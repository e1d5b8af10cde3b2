"""Dispatch: `quantize_and_record(x, fmt, implementation="xla" | "pallas")`.

Both return the quant core's `(QArray, Record)` for x quantized along its last axis; "xla" is
the core itself (any backend), "pallas" the fused kernel (GPU, or interpret=True anywhere).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.quantize_record import kernel, reference
from trace_jax.quant import QArray, Record, get_format

IMPLEMENTATIONS = ("xla", "pallas")


def quantize_and_record(x: jax.Array, fmt: str, *, implementation: str = "xla",
                        block_t: int = 16, num_warps: int = 4, interpret: bool = False
                        ) -> tuple[QArray, Record]:
  """x [..., D] -> (codes, scales and global as a QArray, and its Record), quantized along D."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  reference.check(x, fmt)
  if implementation == "xla":
    return reference.quantize_and_record(x, fmt)
  lead, d = x.shape[:-1], x.shape[-1]
  t = math.prod(lead)
  tp = -(-t // block_t) * block_t
  x2 = jnp.pad(x.reshape(t, d), ((0, tp - t), (0, 0)))  # zero rows: quantized, then dropped
  outs = kernel.quantize_record_2d(x2, fmt=fmt, block_t=block_t, num_warps=num_warps,
                                   interpret=interpret)
  codes, mant, scales = (o[:t].reshape(*lead, o.shape[-1]) for o in outs[:3])
  g = outs[3][:t].reshape(*lead, 1) if fmt == "nvfp4" else None
  f = get_format(fmt)
  return (QArray(codes=codes, scales=scales, global_scale=g, fmt=f, axis=-1),
          Record(mant=mant, scales=scales, global_scale=g, fmt=f, axis=-1))
