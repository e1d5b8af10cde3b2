"""Pallas kernel: a tile of tokens x the whole feature axis in, FP4 codes, scales and the record out.

x [T, D] is read once. With B the block size (32 MXFP4, 16 NVFP4) and nb = D / B blocks per
row, element j of every block of a row is the strided view x[:, j::B] ([tile, nb]), so the B
views hold each block's elements side by side without a reshape: the block max is an
elementwise max over the views, the row max (NVFP4's global) a reduction over nb. The scale
rule is the format's own (`scales_from_amax`, `grid_multiplier`); the element rounding is the
E2M1 round-half-to-even of the quant core written with floor (tests check it against the core
on every kind of value). Outputs are written with strided stores in the core's byte
layout: codes [T, D/2] (element 2k in the low nibble of byte k), record bits [T, D/8] (element
8k+j in bit j of byte k), scales [T, nb], NVFP4's global [T, 1].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from trace_jax.quant import get_format


def _rint(v):
  """Round half to even for 0 <= v < 2^23, from floor (the Triton lowering has no round; the
  float32 trick (v + 2^23) - 2^23 is folded away by XLA's simplifier)."""
  t = jnp.floor(v)
  frac = v - t  # exact
  odd = (t.astype(jnp.int32) & 1) == 1
  return t + jnp.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


def e2m1_encode(y):
  """E2M1 codes of y (uint8), as `trace_jax.quant.codecs.E2M1.encode`, in operations the Triton
  lowering has (no round primitive): the magnitude clamps at 8 first, which changes nothing
  (everything from 5 up saturates to 6) and keeps Inf out of the rounding."""
  a = jnp.minimum(jnp.abs(y), 8.0)
  m_lo = _rint(a * 2.0)
  m_mid = _rint(a) + 2.0
  m_hi = jnp.minimum(_rint(a * 0.5), 3.0) + 4.0
  m = jnp.where(a < 2.0, m_lo, jnp.where(a < 4.0, m_mid, m_hi))
  m = jnp.where(jnp.isnan(y), 0.0, m)
  sign = jnp.where(jnp.signbit(y), 8, 0)
  return (sign | m.astype(jnp.int32)).astype(jnp.uint8)


def _kernel(x_ref, codes_ref, mant_ref, scales_ref, *global_ref, fmt: str, block_t: int,
            nb: int):
  f = get_format(fmt)
  b = f.block_size
  t0 = pl.multiple_of(pl.program_id(0) * block_t, block_t)
  rows = pl.ds(t0, block_t)
  views = [x_ref[rows, pl.ds(j, nb, stride=b)].astype(jnp.float32) for j in range(b)]
  amax = jnp.zeros((block_t, nb), jnp.float32)
  bad = jnp.zeros((block_t, nb), jnp.bool_)
  for v in views:
    finite = ~(jnp.isnan(v) | jnp.isinf(v))
    amax = jnp.maximum(amax, jnp.where(finite, jnp.abs(v), 0.0))
    bad = bad | ~finite
  scales, g = f.scales_from_amax(amax, bad)
  mult = f.grid_multiplier(scales, g)
  codes = [e2m1_encode(v * mult).astype(jnp.int32) for v in views]
  for j in range(0, b, 2):  # bytes 2k, 2k + 1 -> byte k: B / 2 bytes per block
    codes_ref[rows, pl.ds(j // 2, nb, stride=b // 2)] = (
        codes[j] | (codes[j + 1] << 4)).astype(jnp.uint8)
  for j in range(0, b, 8):  # elements 8k .. 8k + 7 -> bits of byte k: B / 8 bytes per block
    byte = codes[j] & 1
    for i in range(1, 8):
      byte = byte | ((codes[j + i] & 1) << i)
    mant_ref[rows, pl.ds(j // 8, nb, stride=b // 8)] = byte.astype(jnp.uint8)
  scales_ref[rows, :] = scales
  if global_ref:
    global_ref[0][rows, :] = g


@functools.partial(jax.jit, static_argnames=("fmt", "block_t", "num_warps", "num_stages",
                                             "interpret"))
def quantize_record_2d(x, *, fmt: str, block_t: int = 16, num_warps: int = 4,
                       num_stages: int = 1, interpret: bool = False):
  """x [T, D] (T a multiple of block_t) -> (codes [T, D/2], mant [T, D/8], scales [T, D/B],
  global [T, 1] for NVFP4)."""
  t, d = x.shape
  b = get_format(fmt).block_size
  nb = d // b
  outs = [jax.ShapeDtypeStruct((t, d // 2), jnp.uint8),
          jax.ShapeDtypeStruct((t, d // 8), jnp.uint8), jax.ShapeDtypeStruct((t, nb), jnp.uint8)]
  if fmt == "nvfp4":
    outs.append(jax.ShapeDtypeStruct((t, 1), jnp.float32))
  compiler_params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(
      functools.partial(_kernel, fmt=fmt, block_t=block_t, nb=nb), grid=(t // block_t,),
      in_specs=[pl.no_block_spec], out_specs=[pl.no_block_spec] * len(outs), out_shape=outs,
      compiler_params=compiler_params, interpret=interpret)(x)
