"""Independent NumPy + ml_dtypes reference of the formats in DESIGN section 2, for the tests.

Written from the spec, not from trace_jax.quant: element codes come from ml_dtypes casts, scale
exponents from np.frexp, E4M3/E8M0 bytes from ml_dtypes casts.
"""

import ml_dtypes
import numpy as np

F4 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu

# the signed E2M1 grid g_0 < ... < g_14 of DESIGN section 2
GRID = np.array([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def blocks(x, block):
  x = np.asarray(x, np.float32)
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(xb):
  finite = np.isfinite(xb)
  return np.max(np.where(finite, np.abs(xb), 0), axis=-1), ~np.all(finite, axis=-1)


def f4_codes(y):
  return np.asarray(y).astype(F4).view(np.uint8)


def mxfp4(x, ceil=False):
  """-> (unpacked codes [..., N, 32], E8M0 scale bytes [..., N]); subnormal inputs read as
  zero."""
  xb = blocks(ftz(x), 32)
  amax, bad = _amax(xb)
  _, ex = np.frexp(amax.astype(np.float64))
  k = ex - 1 - 2  # floor(log2 amax) - 2
  if ceil:
    k = k + (amax.astype(np.float64) > 6 * np.exp2(k.astype(np.float64)))
  k = np.clip(k, -127, 125)  # E8M0 byte <= 252: no dequantized value overflows float32
  scale = np.exp2(k.astype(np.float64))
  code = scale.astype(np.float32).astype(E8M0).view(np.uint8)
  code = np.where(amax == 0, 0, code)
  code = np.where(bad, 255, code).astype(np.uint8)
  with np.errstate(invalid="ignore"):
    codes = f4_codes(xb.astype(np.float64) / scale[..., None])
  return codes, code


def f32u(a):
  """float64 -> the nearest value with float32's 24-bit significand (ties to even) and an
  unbounded exponent: one float32 operation as if float32 had no subnormal range."""
  a = np.asarray(a, np.float64)
  m, e = np.frexp(a)  # m in [0.5, 1)
  with np.errstate(invalid="ignore"):
    return np.ldexp(np.round(m * 2.0**24) / 2.0**24, e)  # np.round: half to even


def _rcp(v):
  return f32u(1.0 / np.asarray(v, np.float64))


_C6, _C2688 = float(np.float32(1) / np.float32(6)), float(np.float32(1) / np.float32(2688))


def nvfp4(x, tensor_global=False):
  """-> (unpacked codes [..., N, 16], E4M3 scale bytes [..., N], global [..., 1]).

  DESIGN: g = amax_row / (6 * 448), s = RN_e4m3(amax / 6 / g), y = x / (s * g); divisions by
  constants and broadcast scales are multiplications by float32 reciprocals (formats.py says
  why). Each operation is rounded to float32's significand with no subnormal range (`f32u`);
  subnormal inputs read as zero."""
  xb = blocks(ftz(x), 16).astype(np.float64)
  amax, bad = _amax(xb)
  amax_row = np.max(amax, axis=-1, keepdims=True)
  if tensor_global:
    amax_row = np.full_like(amax_row, np.max(amax))
  g = np.maximum(f32u(amax_row * _C2688), float(np.finfo(np.float32).tiny))
  g = np.where(amax_row > 0, g, 1.0)
  s = np.clip(f32u(f32u(amax * _C6) * _rcp(g)), 0, 448).astype(E4M3)
  s = np.maximum(s.astype(np.float64), 2.0**-9).astype(E4M3)
  code = np.where(bad, 0x7F, s.view(np.uint8)).astype(np.uint8)
  eff = f32u(s.astype(np.float64) * g)
  with np.errstate(invalid="ignore"):
    codes = f4_codes(f32u(xb * _rcp(eff)[..., None]))
  return codes, code, g.astype(np.float32)


def nvfp4_values(codes, scales, g):
  """Dequantized NVFP4 [..., N, 16]: E2M1 x f32(s x g), rounded once more; below 2^-126, +-0."""
  eff = f32u(scales.view(E4M3).astype(np.float64) * np.asarray(g, np.float64))
  return ftz(f32u(f4_values(codes) * eff[..., None]))


def fp8_rows(x):
  """Per-row E4M3 -> (codes [..., 1, n], float32 scales [..., 1])."""
  xb = blocks(x, np.shape(x)[-1])
  amax, bad = _amax(xb)
  scale = np.maximum(amax * (np.float32(1) / np.float32(448)), np.finfo(np.float32).tiny)
  scale = np.where(amax > 0, scale, np.float32(1))
  scale = np.where(bad, np.nan, scale).astype(np.float32)
  with np.errstate(invalid="ignore"):
    y = np.clip(xb * (np.float32(1) / scale)[..., None], -448, 448)
  return y.astype(E4M3).view(np.uint8), scale


def f4_values(codes):
  return codes.view(F4).astype(np.float64)


def mant_bits(codes):
  return codes & 1


def bracketing(y):
  """The two neighbouring grid values g_i <= y < g_{i+1} (i clamped to [0, 13])."""
  i = np.clip(np.searchsorted(GRID, y, side="right") - 1, 0, 13)
  return GRID[i], GRID[i + 1]


def ftz(a):
  """float32 with subnormal (and smaller) values flushed to signed zero: the formats' rule for
  inputs and for dequantized values."""
  a = np.asarray(a, np.float64)
  tiny = np.finfo(np.float32).tiny
  with np.errstate(invalid="ignore"):
    return np.where(np.abs(a) < tiny, np.copysign(0.0, a), a).astype(np.float32)
