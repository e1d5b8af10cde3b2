"""Dispatch: `quantize_and_record(x, fmt, implementation="xla" | "pallas")`.

Both return the quant core's `(QArray, Record)` for x quantized along its last axis, and with
`values=True` also the values the codes stand for in x's dtype (`dequantize(qa)`: what a
rollout computes with); "xla" is the core itself (any backend), "pallas" the fused kernel (GPU,
or interpret=True anywhere), in the layout `layout` (kernel.py: "blocks", or the first
version's "strided"), which writes the values from its own codes. `backend` is how the "blocks"
kernel is called: "triton", Pallas' Triton lowering (`kernel.py`), or "jax_triton", the same
program in Triton's own language (`triton_kernel.py`, through `pallas_kernels.triton_call`:
jax-triton on a GPU, Triton's interpreter elsewhere), Pallas' Triton lowering being deprecated
from jax 0.11. With `rms_norm=(w, eps)` what is quantized is x's RMSNorm (`reference.rms_norm`;
the model's norm before the attention and before the experts), which the "blocks" kernel
computes on the tile it loads: one kernel where the norm was a pass of its own; `normed=True`
also returns the normed x.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.quantize_record import kernel, reference
from trace_jax.quant import QArray, Record, dequantize, get_format

IMPLEMENTATIONS = ("xla", "pallas")
# the "blocks" kernel's: Pallas' Triton lowering, or Triton's own language through jax-triton
BACKENDS = ("triton", "jax_triton")


def quantize_and_record(x: jax.Array, fmt: str, *, implementation: str = "xla",
                        layout: str = "blocks", block_t: int | None = None, num_warps: int = 4,
                        interpret: bool = False, values: bool = False,
                        rms_norm: tuple[jax.Array, float] | None = None, normed: bool = False,
                        backend: str = "triton"):
  """x [..., D] -> (codes, scales and global as a QArray, and its Record), quantized along D;
  with `values`, (QArray, Record, its values [..., D] in x's dtype). block_t: tokens a program
  (a power of two; None: `kernel.default_block_t`). `rms_norm` (w [D], eps): x's RMSNorm is
  quantized, and with `normed` returned after the Record (before the values). `backend`: the
  kernel's (`BACKENDS`; "jax_triton" runs in Triton's interpreter where there is no GPU, so it
  takes no `interpret`, and the "blocks" layout only)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if layout not in kernel.LAYOUTS:
    raise ValueError(f"layout must be one of {kernel.LAYOUTS}, got {layout!r}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "jax_triton" and (interpret or layout != "blocks"):
    raise ValueError("the jax_triton backend runs the 'blocks' layout, in Triton's interpreter "
                     "where there is no GPU: no interpret argument, no other layout")
  reference.check(x, fmt)
  if rms_norm is not None and rms_norm[0].shape != x.shape[-1:]:
    raise ValueError(f"rms_norm's weight must be [{x.shape[-1]}] for x {x.shape}, got "
                     f"{rms_norm[0].shape}")
  if normed and rms_norm is None:
    raise ValueError("normed=True returns the RMSNorm's output: it needs rms_norm=(w, eps)")
  if rms_norm is not None and implementation == "pallas" and layout != "blocks":
    raise ValueError("rms_norm runs in the 'blocks' layout's kernel only")
  if implementation == "xla":
    xn = x if rms_norm is None else reference.rms_norm(x, *rms_norm)
    qa, rec = reference.quantize_and_record(xn, fmt)
    return ((qa, rec) + ((xn,) if normed else ())
            + ((dequantize(qa).astype(x.dtype),) if values else ()))
  lead, d = x.shape[:-1], x.shape[-1]
  t = math.prod(lead)
  f = get_format(fmt)
  b, nb = f.block_size, d // f.block_size
  block_t = block_t or kernel.default_block_t(layout, d)
  if layout == "blocks":  # masks its own edges: no padding, only free reshapes
    norm = {} if rms_norm is None else dict(norm_eps=float(rms_norm[1]), normed=normed)
    blocks = _jax_triton_blocks if backend == "jax_triton" else functools.partial(
        kernel.quantize_record_blocks, interpret=interpret)
    outs = blocks(
        x.reshape(t, nb, b), None if rms_norm is None else rms_norm[0].reshape(nb, b), fmt=fmt,
        block_t=block_t, num_warps=num_warps, values=values, **norm)
    outs = [o.reshape(t, -1) for o in outs]
  else:
    # power-of-two tiles only: pad D to a power of two of blocks with zero blocks (quantized on
    # their own, then dropped; they leave NVFP4's row amax unchanged), T to a multiple of block_t
    tp = -(-t // block_t) * block_t
    dp = (1 << (nb - 1).bit_length()) * b
    x2 = jnp.pad(x.reshape(t, d), ((0, tp - t), (0, dp - d)))
    outs = kernel.quantize_record_strided(x2, fmt=fmt, block_t=block_t, num_warps=num_warps,
                                          interpret=interpret, values=values)
  widths = (d // 2, d // 8, nb) + ((d,) if normed else ()) + ((d,) if values else ())
  codes, mant, scales, *y = (o[:t, :w].reshape(*lead, w) for o, w in zip(outs, widths))
  g = outs[len(widths)][:t].reshape(*lead, 1) if fmt == "nvfp4" else None
  out = (QArray(codes=codes, scales=scales, global_scale=g, fmt=f, axis=-1),
         Record(mant=mant, scales=scales, global_scale=g, fmt=f, axis=-1))
  return out + tuple(y)


@functools.partial(jax.jit, static_argnames=("fmt", "block_t", "num_warps", "values", "norm_eps",
                                             "normed"))
def _jax_triton_blocks(x_TxNxB, norm_w_NxB=None, *, fmt: str, block_t: int, num_warps: int = 4,
                       values: bool = False, norm_eps: float | None = None, normed: bool = False):
  """`kernel.quantize_record_blocks` by the program in Triton's own language
  (`triton_kernel.quantize_record`): the same outputs in the same order."""
  from pallas_kernels import triton_call
  kernels = triton_call.load("pallas_kernels.quantize_record.triton_kernel")
  t, nb, b = x_TxNxB.shape
  norm = norm_eps is not None  # with norm_w_NxB (`quantize_and_record` checked both)
  if x_TxNxB.dtype not in (jnp.float32, jnp.bfloat16):
    raise ValueError(f"the jax_triton kernel takes float32 or bfloat16 x, got {x_TxNxB.dtype}")
  nvfp4 = fmt == "nvfp4"
  out = lambda asked, shape, dtype: jax.ShapeDtypeStruct(shape if asked else (1,), dtype)
  shapes = [out(True, (t, nb, b // 2), jnp.uint8), out(True, (t, nb, b // 8), jnp.uint8),
            out(True, (t, nb), jnp.uint8), out(normed, (t, nb, b), x_TxNxB.dtype),
            out(values, (t, nb, b), x_TxNxB.dtype), out(nvfp4, (t,), jnp.float32)]
  w = norm_w_NxB if norm else jnp.zeros((1,), x_TxNxB.dtype)  # unread without the norm
  codes, mant, scales, xn, y, g = triton_call.call(
      kernels.quantize_record, x_TxNxB, w, out_shape=shapes, grid=(-(-t // block_t),),
      num_warps=num_warps, num_stages=1, name="triton_quantize_record", T=t, NB=nb,
      NBP=1 << (nb - 1).bit_length(), B=b, BLOCK_T=block_t, NVFP4=nvfp4,
      BF16=x_TxNxB.dtype == jnp.bfloat16, NORM=norm, EPS=float(norm_eps or 0.0), NORMED=normed,
      VALUES=values)
  return ([codes, mant, scales] + ([xn] if normed else []) + ([y] if values else [])
          + ([g.reshape(t, 1)] if nvfp4 else []))
