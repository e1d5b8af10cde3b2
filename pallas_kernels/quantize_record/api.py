"""Dispatch: `quantize_and_record(x, fmt, implementation="xla" | "pallas")`.

Both return the quant core's `(QArray, Record)` for x quantized along its last axis, and with
`values=True` also the values the codes stand for in x's dtype (`dequantize(qa)`: what a
rollout computes with); "xla" is the core itself (any backend), "pallas" the fused kernel (GPU,
or interpret=True anywhere), in the layout `layout` (kernel.py: "blocks", or the first
version's "strided"), which writes the values from its own codes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.quantize_record import kernel, reference
from trace_jax.quant import QArray, Record, dequantize, get_format

IMPLEMENTATIONS = ("xla", "pallas")


def quantize_and_record(x: jax.Array, fmt: str, *, implementation: str = "xla",
                        layout: str = "blocks", block_t: int | None = None, num_warps: int = 4,
                        interpret: bool = False, values: bool = False):
  """x [..., D] -> (codes, scales and global as a QArray, and its Record), quantized along D;
  with `values`, (QArray, Record, its values [..., D] in x's dtype). block_t: tokens a program
  (a power of two; None: `kernel.default_block_t`)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if layout not in kernel.LAYOUTS:
    raise ValueError(f"layout must be one of {kernel.LAYOUTS}, got {layout!r}")
  reference.check(x, fmt)
  if implementation == "xla":
    qa, rec = reference.quantize_and_record(x, fmt)
    return (qa, rec, dequantize(qa).astype(x.dtype)) if values else (qa, rec)
  lead, d = x.shape[:-1], x.shape[-1]
  t = math.prod(lead)
  f = get_format(fmt)
  b, nb = f.block_size, d // f.block_size
  block_t = block_t or kernel.default_block_t(layout, d)
  if layout == "blocks":  # masks its own edges: no padding, only free reshapes
    outs = kernel.quantize_record_blocks(x.reshape(t, nb, b), fmt=fmt, block_t=block_t,
                                         num_warps=num_warps, interpret=interpret,
                                         values=values)
    outs = [o.reshape(t, -1) for o in outs]
  else:
    # power-of-two tiles only: pad D to a power of two of blocks with zero blocks (quantized on
    # their own, then dropped; they leave NVFP4's row amax unchanged), T to a multiple of block_t
    tp = -(-t // block_t) * block_t
    dp = (1 << (nb - 1).bit_length()) * b
    x2 = jnp.pad(x.reshape(t, d), ((0, tp - t), (0, dp - d)))
    outs = kernel.quantize_record_strided(x2, fmt=fmt, block_t=block_t, num_warps=num_warps,
                                          interpret=interpret, values=values)
  widths = (d // 2, d // 8, nb) + ((d,) if values else ())
  codes, mant, scales, *y = (o[:t, :w].reshape(*lead, w) for o, w in zip(outs, widths))
  g = outs[len(widths)][:t].reshape(*lead, 1) if fmt == "nvfp4" else None
  out = (QArray(codes=codes, scales=scales, global_scale=g, fmt=f, axis=-1),
         Record(mant=mant, scales=scales, global_scale=g, fmt=f, axis=-1))
  return out + tuple(y)
