"""Pallas kernels: tiles of tokens x the whole feature axis in, FP4 codes, scales and records out.

x [T, D] is read once; B is the block size (32 MXFP4, 16 NVFP4), nb = D / B blocks per token.
The scale rule is the format's own (`scales_from_amax`, `to_grid`; subnormal inputs read as
zero, `codecs.flush_subnormal`) and the element rounding is the quant core's E2M1
round-half-to-even (tests check both against the core on every kind of value). Outputs are in the core's byte layout: codes [T, D/2] (element 2k in the low
nibble of byte k), record bits [T, D/8] (element 8k+j in bit j of byte k), scales [T, nb],
NVFP4's global [T, 1], and on request the values the codes stand for, in x's dtype [T, D] (what
the rollout computes with: no XLA pass decodes them again). Two layouts of the same computation:

"blocks" (the default): x viewed as [T, nb, B] (a free reshape), a program loads
[block_t, nb, B] as contiguous block rows, takes each block's max along B and the token's
(NVFP4's global) along nb, and packs nibbles and record bits by viewing the codes tile as
[.., B/2, 2] and [.., B/8, 8] and summing shifted codes over the last axis; every output is a
contiguous store of its [T, nb, ...] view. The Triton lowering takes power-of-two tiles only:
a program covers the next power of two of blocks and of tokens, and masks the loads and stores
outside [T, nb] (nothing is padded in memory).

"strided" (the first version): element j of every block of a row is the strided view
x[:, j::B] ([block_t, nb]), so the B views hold each block's elements side by side; the block
max is an elementwise max over the views; outputs are strided stores. Each load touches one
element per block; BENCHMARKS.md has what that costs. It needs T a multiple of block_t and nb
a power of two (the dispatch pads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from trace_jax.quant import codecs, get_format

LAYOUTS = ("blocks", "strided")
_F32_MAX = float(np.finfo(np.float32).max)
# E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours, and whether a tie
# rounds up (to the neighbour with the even code)
_E2M1_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                   (3.5, True), (5.0, False))


def e2m1_encode(y):
  """E2M1 codes of y (uint8), as `trace_jax.quant.codecs.E2M1.encode`: the magnitude code counts
  the midpoints |y| is past (a tie goes to the even code), seven compares where rounding takes
  several times the operations; NaN passes none (code 0, as in the core), Inf all (6)."""
  a = jnp.abs(y)
  m = jnp.zeros(y.shape, jnp.int32)
  for mid, tie_up in _E2M1_MIDPOINTS:
    m = m + ((a >= mid) if tie_up else (a > mid)).astype(jnp.int32)
  sign = jnp.where(jnp.signbit(y), 8, 0)
  return (sign | m).astype(jnp.uint8)


def e2m1_decode(codes):
  """float32 E2M1 values of codes (int32), as `trace_jax.quant.codecs.E2M1.decode` without its
  table look-up (a gather Triton does not lower): 0.5 m below 2, else (2 + m % 2) 2^(m/2 - 2)
  for the magnitude code m, and bit 3 as the sign bit, set in integers (the Triton lowering
  negates by subtracting from zero, which makes code 8 +0 where the core has -0)."""
  m = codes & 7
  low = m.astype(jnp.float32) * 0.5
  high = (2 + (m & 1)).astype(jnp.float32) * codecs.exp2i((m >> 1) - 2)
  mag = jax.lax.bitcast_convert_type(jnp.where(m < 2, low, high), jnp.uint32)
  sign = (codes & 8).astype(jnp.uint32) << 28
  return jax.lax.bitcast_convert_type(mag | sign, jnp.float32)


def _values(f, codes, scales, g):
  """What the core's `dequantize` gives for the codes (int32) of a [.., B] tile and their
  block's scales: the format's decode with `e2m1_decode` for its look-up."""
  return codecs.flush_subnormal(f.from_grid(e2m1_decode(codes), scales, g))


# rcp.rn: the correctly rounded float32 reciprocal, in one instruction, as the scale rules take
# it (the quant core's `codecs.reciprocal` gets it from XLA's approximate GPU division by a
# correction in integers; interpret mode runs that)
_RCP_RN = "rcp.rn.f32 $0, $1;"


def reciprocal(v, interpret: bool):
  """1 / v (float32), correctly rounded, as the quant core computes it."""
  if interpret:
    return codecs.reciprocal(v)
  out = pltriton.elementwise_inline_asm(
      _RCP_RN, args=[v.astype(jnp.float32)], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, jnp.float32)])
  return out[0]


def _next_pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def default_block_t(layout: str, d: int) -> int:
  """Tokens a program by default: "blocks" about 4096 elements a program (32 a thread at 4
  warps), "strided" 8 (its best measured)."""
  return max(1, 4096 // _next_pow2(d)) if layout == "blocks" else 8


def _blocks_kernel(x_ref, *refs, fmt: str, block_t: int, t: int, nb: int, interpret: bool,
                   values: bool, norm_eps: float | None = None, normed: bool = False):
  f = get_format(fmt)
  recip = functools.partial(reciprocal, interpret=interpret)
  w_ref, refs = (refs[0], refs[1:]) if norm_eps is not None else (None, refs)
  codes_ref, mant_ref, scales_ref, *rest = refs
  normed_ref, rest = (rest[0], rest[1:]) if normed else (None, rest)
  values_ref, global_ref = (rest[0], rest[1:]) if values else (None, rest)
  b = f.block_size
  nbp = _next_pow2(nb)
  t0 = pl.multiple_of(pl.program_id(0) * block_t, block_t)

  def mask(shape):
    """The tile's elements inside [T, nb, ...] (tokens on axis 0, blocks on 1), None if all."""
    ok = None
    if t % block_t:
      ok = t0 + jax.lax.broadcasted_iota(jnp.int32, shape, 0) < t
    if nbp != nb and shape[1] == nbp:
      in_nb = jax.lax.broadcasted_iota(jnp.int32, shape, 1) < nb
      ok = in_nb if ok is None else ok & in_nb
    return ok

  def store(ref, value):
    idx = (pl.ds(t0, block_t), pl.ds(0, value.shape[1]), *[slice(None)] * (value.ndim - 2))
    pltriton.store(ref.at[idx], value, mask=mask(value.shape))

  shape = (block_t, nbp, b)
  m = mask(shape)
  x_TxNxB = pltriton.load(x_ref.at[pl.ds(t0, block_t), pl.ds(0, nbp), :], mask=m,
                          other=None if m is None else 0)
  if norm_eps is not None:  # the RMSNorm before the quantization, as `reference.rms_norm`
    x_TxNxB = _rms_norm(x_TxNxB, w_ref, nb, norm_eps)
    if normed:
      store(normed_ref, x_TxNxB)
  x_TxNxB = codecs.flush_subnormal(x_TxNxB.astype(jnp.float32))
  a = jnp.abs(x_TxNxB)
  finite = a <= _F32_MAX  # NaN compares false
  amax_TxN = jnp.max(jnp.where(finite, a, 0.0), axis=-1)
  bad_TxN = jnp.max(jnp.where(finite, 0, 1), axis=-1) > 0
  # blocks outside [T, nb] are zero: they leave NVFP4's row max unchanged and are not stored
  scales_TxN, g_Tx1 = f.scales_from_amax(amax_TxN, bad_TxN, recip)
  codes = e2m1_encode(f.to_grid(x_TxNxB, scales_TxN, g_Tx1, recip)).astype(jnp.int32)
  pairs = codes.reshape(block_t, nbp, b // 2, 2)
  nibble_shift = jax.lax.broadcasted_iota(jnp.int32, pairs.shape, 3) * 4
  store(codes_ref, jnp.sum(pairs << nibble_shift, axis=-1).astype(jnp.uint8))
  octets = (codes & 1).reshape(block_t, nbp, b // 8, 8)
  bit = jax.lax.broadcasted_iota(jnp.int32, octets.shape, 3)
  store(mant_ref, jnp.sum(octets << bit, axis=-1).astype(jnp.uint8))
  store(scales_ref, scales_TxN)
  if values:
    store(values_ref, _values(f, codes, scales_TxN, g_Tx1).astype(values_ref.dtype))
  if global_ref:
    store(global_ref[0], g_Tx1)


def _rms_norm(x_TxNxB, w_ref, nb: int, eps: float):
  """`reference.rms_norm` of a tile holding whole tokens (blocks past nb zero): the mean of
  squares in float32 over the token's nb x B elements, x times its reciprocal square root cast
  back to x's dtype, then times the weight in that dtype."""
  nbp, b = x_TxNxB.shape[1:]
  in_nb = None if nbp == nb else jax.lax.broadcasted_iota(jnp.int32, (nbp, b), 0) < nb
  w_NxB = pltriton.load(w_ref.at[pl.ds(0, nbp), :], mask=in_nb,
                        other=None if in_nb is None else 0)
  xf = x_TxNxB.astype(jnp.float32)
  ms = jnp.sum(jnp.sum(xf * xf, axis=2), axis=1) / (nb * b)
  xf = xf * jax.lax.rsqrt(ms + eps)[:, None, None]
  return w_NxB.astype(x_TxNxB.dtype)[None] * xf.astype(x_TxNxB.dtype)


def _strided_kernel(x_ref, codes_ref, mant_ref, scales_ref, *rest, fmt: str, block_t: int,
                    nb: int, interpret: bool, values: bool):
  f = get_format(fmt)
  recip = functools.partial(reciprocal, interpret=interpret)
  values_ref, global_ref = (rest[0], rest[1:]) if values else (None, rest)
  b = f.block_size
  t0 = pl.multiple_of(pl.program_id(0) * block_t, block_t)
  rows = pl.ds(t0, block_t)
  views = [codecs.flush_subnormal(x_ref[rows, pl.ds(j, nb, stride=b)].astype(jnp.float32))
           for j in range(b)]
  amax = jnp.zeros((block_t, nb), jnp.float32)
  bad = jnp.zeros((block_t, nb), jnp.bool_)
  for v in views:
    finite = ~(jnp.isnan(v) | jnp.isinf(v))
    amax = jnp.maximum(amax, jnp.where(finite, jnp.abs(v), 0.0))
    bad = bad | ~finite
  scales, g = f.scales_from_amax(amax, bad, recip)
  codes = [e2m1_encode(f.to_grid(v[..., None], scales, g, recip)[..., 0]).astype(jnp.int32)
           for v in views]
  for j in range(0, b, 2):  # bytes 2k, 2k + 1 -> byte k: B / 2 bytes per block
    codes_ref[rows, pl.ds(j // 2, nb, stride=b // 2)] = (
        codes[j] | (codes[j + 1] << 4)).astype(jnp.uint8)
  for j in range(0, b, 8):  # elements 8k .. 8k + 7 -> bits of byte k: B / 8 bytes per block
    byte = codes[j] & 1
    for i in range(1, 8):
      byte = byte | ((codes[j + i] & 1) << i)
    mant_ref[rows, pl.ds(j // 8, nb, stride=b // 8)] = byte.astype(jnp.uint8)
  scales_ref[rows, :] = scales
  if values:
    for j, c in enumerate(codes):
      values_ref[rows, pl.ds(j, nb, stride=b)] = _values(
          f, c[..., None], scales, g)[..., 0].astype(values_ref.dtype)
  if global_ref:
    global_ref[0][rows, :] = g


def _call(kernel, inputs, out_shapes, grid, num_warps, num_stages, interpret):
  compiler_params = None
  if not interpret:
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * len(out_shapes), out_shape=out_shapes,
      compiler_params=compiler_params, interpret=interpret)(*inputs)


_STATIC = ("fmt", "block_t", "num_warps", "num_stages", "interpret", "values")


@functools.partial(jax.jit, static_argnames=_STATIC + ("norm_eps", "normed"))
def quantize_record_blocks(x_TxNxB, norm_w_NxB=None, *, fmt: str, block_t: int,
                           num_warps: int = 4, num_stages: int = 1, interpret: bool = False,
                           values: bool = False, norm_eps: float | None = None,
                           normed: bool = False):
  """x [T, nb, B] (any T, nb; block_t a power of two) -> (codes [T, nb, B/2], mant
  [T, nb, B/8], scales [T, nb], with `values` x's dequantized values [T, nb, B] in x's dtype,
  global [T, 1] for NVFP4). With `norm_eps`, what is quantized is x's RMSNorm with the weight
  norm_w [nb, B] (`reference.rms_norm`), and with `normed` that is returned too, in x's dtype,
  before the values."""
  t, nb, b = x_TxNxB.shape
  norm = norm_eps is not None
  if norm != (norm_w_NxB is not None) or normed and not norm:
    raise ValueError("an RMSNorm before the quantization takes both norm_w and norm_eps "
                     "(and `normed` returns its output)")
  outs = [jax.ShapeDtypeStruct((t, nb, b // 2), jnp.uint8),
          jax.ShapeDtypeStruct((t, nb, b // 8), jnp.uint8),
          jax.ShapeDtypeStruct((t, nb), jnp.uint8)]
  if normed:
    outs.append(jax.ShapeDtypeStruct((t, nb, b), x_TxNxB.dtype))
  if values:
    outs.append(jax.ShapeDtypeStruct((t, nb, b), x_TxNxB.dtype))
  if fmt == "nvfp4":
    outs.append(jax.ShapeDtypeStruct((t, 1), jnp.float32))
  kernel = functools.partial(_blocks_kernel, fmt=fmt, block_t=block_t, t=t, nb=nb,
                             interpret=interpret, values=values, norm_eps=norm_eps,
                             normed=normed)
  inputs = (x_TxNxB,) + ((norm_w_NxB,) if norm else ())
  return _call(kernel, inputs, outs, (pl.cdiv(t, block_t),), num_warps, num_stages, interpret)


@functools.partial(jax.jit, static_argnames=_STATIC)
def quantize_record_strided(x, *, fmt: str, block_t: int = 8, num_warps: int = 4,
                            num_stages: int = 1, interpret: bool = False, values: bool = False):
  """x [T, D] (T a multiple of block_t, D / B a power of two) -> (codes [T, D/2], mant [T, D/8],
  scales [T, D/B], with `values` x's dequantized values [T, D] in x's dtype, global [T, 1] for
  NVFP4)."""
  t, d = x.shape
  nb = d // get_format(fmt).block_size
  outs = [jax.ShapeDtypeStruct((t, d // 2), jnp.uint8),
          jax.ShapeDtypeStruct((t, d // 8), jnp.uint8), jax.ShapeDtypeStruct((t, nb), jnp.uint8)]
  if values:
    outs.append(jax.ShapeDtypeStruct((t, d), x.dtype))
  if fmt == "nvfp4":
    outs.append(jax.ShapeDtypeStruct((t, 1), jnp.float32))
  kernel = functools.partial(_strided_kernel, fmt=fmt, block_t=block_t, nb=nb,
                             interpret=interpret, values=values)
  return _call(kernel, (x,), outs, (t // block_t,), num_warps, num_stages, interpret)
