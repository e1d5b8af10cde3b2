"""Quantize-and-record in Triton's own language (`pallas_kernels.triton_call`): the "blocks"
kernel of `kernel.py`, moved off Pallas' deprecated Triton lowering, the same program.

Grid (token tiles,): a program loads x [BLOCK_T, NBP, B] (the next power of two of the nb blocks
a token, masked outside [T, nb]), optionally takes its RMSNorm, and writes the codes, record
bits, scales, NVFP4's row global and on request the values, in the quant core's byte layout.

The Pallas kernel calls the quant core's jnp scale rules (`BlockFormat.scales_from_amax`,
`to_grid`, `from_grid`) as they are; here they are the same float32 steps written in Triton's
language, in the core's order (`trace_jax.quant.formats`: each multiplication, each correctly
rounded reciprocal, NVFP4's tiny blocks and rows taken 2^64 up), and the tests check every byte
against the core in Triton's interpreter and on the GPU. E4M3's round-to-nearest-even is
written in integers (the interpreter has no FP8), as the casts to bf16 are under INTERPRET
(`decode_attention.triton_kernel.bf16_rne`: the interpreter's casts truncate).
Imported through `triton_call.load`. Module constants are `tl.constexpr`, as the compiler
requires of a global a kernel reads (the interpreter does not check).
"""

import triton
import triton.language as tl

from pallas_kernels.decode_attention.triton_kernel import bf16_rne

F32_MAX = tl.constexpr(3.4028234663852886e38)
# float32(1 / (6 x 448)), as the core's `_f32_reciprocal`
NVFP4_GLOBAL_RECIP = tl.constexpr(1.0 / 2688.0)
SIXTH = tl.constexpr(1.0 / 6.0)  # float32(1 / 6)
# NVFP4's block maxima and globals under it are computed 2^64 up
UP_BELOW = tl.constexpr(2.0**-62)
TINY = tl.constexpr(2.0**-126)  # the smallest normal float32


@triton.jit
def _f32(bits):
  return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2i(n):
  """2^n as float32 for integer n in [-126, 127], from the exponent bits (`codecs.exp2i`)."""
  return _f32(((n + 127) << 23).to(tl.uint32))


@triton.jit
def _flush_subnormal(x):
  """float32 x with its subnormal values as signed zeros, in integers (`codecs.flush_subnormal`)."""
  bits = x.to(tl.uint32, bitcast=True)
  return tl.where((bits & 0x7F800000) == 0, _f32(bits & 0x80000000), x)


@triton.jit
def _recip(v, INTERPRET: tl.constexpr):
  """1 / v in float32, correctly rounded (`codecs.reciprocal`): PTX rcp.rn on the GPU, numpy's
  float32 division in the interpreter."""
  if INTERPRET:
    return 1.0 / v
  return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [v], dtype=tl.float32,
                                   is_pure=True, pack=1)


@triton.jit
def _round(x, BF16: tl.constexpr, INTERPRET: tl.constexpr):
  """float32 x rounded to the output's dtype (bf16 to nearest even), kept in float32."""
  if BF16:
    if INTERPRET:  # NaN as it is (its bits carried into the exponent would make it -0)
      return tl.where(x != x, x, bf16_rne(x))
    return x.to(tl.bfloat16).to(tl.float32)
  return x


@triton.jit
def _pow2(where, up: tl.constexpr):
  """2^up where `where`, else 1 (`formats._pow2`)."""
  return tl.where(where, 2.0**up, 1.0)


@triton.jit
def _e4m3_byte(s):
  """float32 s in [0, 448] -> its E4M3 byte, rounded to nearest even: in integers on the
  float32 bits from 2^-6 (E4M3's normals: 3 mantissa bits), by s x 2^9 rounded to an integer
  below it (the subnormals, steps of 2^-9; 8 is the byte of 2^-6 too)."""
  bits = s.to(tl.uint32, bitcast=True)
  r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
  normal = ((((r >> 23) - 120) << 3) | ((r >> 20) & 7)).to(tl.int32)
  q = ((s * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # 2^23: float32's integer rounding
  return tl.where(s >= 2.0**-6, normal, q)


@triton.jit
def _e4m3_value(byte):
  """An E4M3 byte (int32, 0x7F: NaN) -> float32 (`codecs.E4M3.decode`)."""
  e = (byte >> 3) & 15
  m = (byte & 7).to(tl.float32)
  v = tl.where(e == 0, m * 2.0**-9, (1.0 + m * 0.125) * _exp2i(e - 7))
  return tl.where((byte & 0x7F) == 0x7F, float("nan"), v)


@triton.jit
def _e2m1_encode(y):
  """E2M1 codes of y (int32), as `kernel.e2m1_encode`: the magnitude code counts the midpoints
  |y| is past (a tie to the even code); NaN passes none, its sign bit kept as the core keeps it."""
  a = tl.abs(y)
  m = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
       + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
       + (a > 5.0).to(tl.int32))
  return m | ((y.to(tl.uint32, bitcast=True) >> 28) & 8).to(tl.int32)


@triton.jit
def _e2m1_value(codes):
  """float32 E2M1 values of codes (int32), -0 for code 8 (`kernel.e2m1_decode`)."""
  m = codes & 7
  low = m.to(tl.float32) * 0.5
  high = (2 + (m & 1)).to(tl.float32) * _exp2i((m >> 1) - 2)
  mag = tl.where(m < 2, low, high).to(tl.uint32, bitcast=True)
  return _f32(mag | ((codes & 8).to(tl.uint32) << 28))


@triton.jit
def quantize_record(x_ptr, w_ptr, codes_ptr, mant_ptr, scales_ptr, normed_ptr, values_ptr,
                    global_ptr, T: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr,
                    B: tl.constexpr, BLOCK_T: tl.constexpr, NVFP4: tl.constexpr, BF16: tl.constexpr,
                    NORM: tl.constexpr, EPS: tl.constexpr, NORMED: tl.constexpr,
                    VALUES: tl.constexpr, INTERPRET: tl.constexpr):
  """x [T, NB, B] (bf16 when BF16, else float32), w [NB, B] (read when NORM) -> codes
  [T, NB, B / 2], mant [T, NB, B / 8], scales [T, NB] (uint8), normed and values [T, NB, B] in
  x's dtype (written when NORMED, VALUES), global [T] float32 (written when NVFP4). MXFP4: B = 32,
  the E8M0 rule `MXFP4Format.scales_from_amax` ("floor"); NVFP4: B = 16, the per-token global."""
  t0 = tl.program_id(0) * BLOCK_T
  rt = t0 + tl.arange(0, BLOCK_T)
  rn = tl.arange(0, NBP)
  rb = tl.arange(0, B)
  ok_tn = (rt[:, None] < T) & (rn[None, :] < NB)  # [BLOCK_T, NBP]
  at = (rt[:, None, None].to(tl.int64) * NB + rn[None, :, None]) * B + rb[None, None, :]
  ok = ok_tn[:, :, None] & (rb[None, None, :] < B)
  x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
  if NORM:  # the RMSNorm before the quantization, as `reference.rms_norm`
    w = tl.load(w_ptr + rn[:, None] * B + rb[None, :], mask=(rn < NB)[:, None] & (rb < B)[None, :],
                other=0.0).to(tl.float32)
    ms = tl.sum(tl.sum(x * x, axis=2), axis=1) / (NB * B)
    xn = _round(x * tl.math.rsqrt(ms + EPS)[:, None, None], BF16, INTERPRET)
    x = _round(w[None, :, :] * xn, BF16, INTERPRET)
    if NORMED:
      tl.store(normed_ptr + at, x.to(normed_ptr.dtype.element_ty), mask=ok)
  x = _flush_subnormal(x)
  a = tl.abs(x)
  finite = a <= F32_MAX  # NaN compares false
  amax = tl.max(tl.where(finite, a, 0.0), axis=2)  # [BLOCK_T, NBP]
  bad = tl.max(tl.where(finite, 0, 1), axis=2) > 0
  # the scale rule (blocks outside [T, nb] are zero: NVFP4's row max unchanged; not stored)
  if NVFP4:
    amax_t = tl.max(amax, axis=1)  # [BLOCK_T]
    g = tl.maximum(amax_t * NVFP4_GLOBAL_RECIP, TINY)
    g = tl.where(amax_t > 0, g, 1.0)
    tiny = amax < UP_BELOW  # amax / 6 is subnormal under 6 x 2^-126: taken 2^64 up
    s = ((amax * _pow2(tiny, 64)) * SIXTH) * _recip(g, INTERPRET)[:, None]
    s = s * _pow2(tiny, -64)
    s = tl.minimum(tl.maximum(s, 0.0), 448.0)
    scales = tl.maximum(_e4m3_byte(s), 1)  # at least 2^-9, E4M3's smallest subnormal
    scales = tl.where(bad, 0x7F, scales)
    tiny_t = g < UP_BELOW  # s g could be subnormal: taken 2^64 up (`_element_scale`)
    sg = _e4m3_value(scales) * (g * _pow2(tiny_t, 64))[:, None]
    # the reciprocal first: where both are NaN (a NaN x in a NaN block) the CPU's product takes
    # the first operand's sign, and the core's code is the reciprocal's (on a GPU NaN has one)
    y = _recip(sg, INTERPRET)[:, :, None] * (x * _pow2(tiny_t, 64)[:, None, None])
  else:
    scales = (amax.to(tl.uint32, bitcast=True) >> 23).to(tl.int32) - 2  # floor(log2 amax) - 2
    scales = tl.where(bad, 255, tl.minimum(tl.maximum(scales, 0), 252))
    y = x * _exp2i(tl.minimum(tl.maximum(127 - scales, -126), 127))[:, :, None]
  codes = _e2m1_encode(y)
  rt2 = rt[:, None] * NB + rn[None, :]  # [BLOCK_T, NBP]: (token, block) in [T, NB]
  # nibbles: element 2k in the low nibble of byte k
  pairs = tl.reshape(codes, (BLOCK_T, NBP, B // 2, 2))
  packed = tl.sum(pairs << (tl.arange(0, 2) * 4)[None, None, None, :], axis=3)
  rh = tl.arange(0, B // 2)
  tl.store(codes_ptr + rt2[:, :, None].to(tl.int64) * (B // 2) + rh[None, None, :],
           packed.to(tl.uint8), mask=ok_tn[:, :, None] & (rh < B // 2)[None, None, :])
  # record bits: element 8k + j in bit j of byte k
  octets = tl.reshape(codes & 1, (BLOCK_T, NBP, B // 8, 8))
  bits = tl.sum(octets << tl.arange(0, 8)[None, None, None, :], axis=3)
  r8 = tl.arange(0, B // 8)
  tl.store(mant_ptr + rt2[:, :, None].to(tl.int64) * (B // 8) + r8[None, None, :],
           bits.to(tl.uint8), mask=ok_tn[:, :, None] & (r8 < B // 8)[None, None, :])
  tl.store(scales_ptr + rt2, scales.to(tl.uint8), mask=ok_tn)
  if VALUES:  # `kernel._values`: the core's dequantization of these codes
    v = _e2m1_value(codes)
    if NVFP4:
      v = (v * sg[:, :, None]) * _pow2(tiny_t, -64)[:, None, None]
    else:
      e = scales - 127  # 2^-127 (byte 0) is subnormal: the element halved, times 2^-126
      v = v * tl.where(e < -126, 0.5, 1.0)[:, :, None]
      scale = tl.where(scales == 255, float("nan"),
                       _exp2i(tl.minimum(tl.maximum(e, -126), 127)))
      v = v * scale[:, :, None]
    v = _round(_flush_subnormal(v), BF16, INTERPRET)
    tl.store(values_ptr + at, v.to(values_ptr.dtype.element_ty), mask=ok)
  if NVFP4:
    tl.store(global_ptr + rt, g, mask=rt < T)
