"""Element codecs (E2M1, E4M3), exact powers of two and sub-byte packing, as pure jnp functions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# Magnitudes of the E2M1 element, indexed by the 3-bit magnitude code m (DESIGN section 2).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def exp2i(n: jax.Array) -> jax.Array:
  """2**n as float32, exactly, for integer n in [-126, 127] (built from the exponent bits)."""
  n = jnp.asarray(n, jnp.int32)
  return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def flush_subnormal(x: jax.Array) -> jax.Array:
  """float32 x with its subnormal values as signed zeros, whether or not the backend flushes
  them (the formats' rule: a float32 subnormal reads as zero, on every backend). In integers:
  where floating-point operations flush subnormal operands (Triton on the GPU), a compare or
  copysign would see a negative subnormal as +0 and drop its sign."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
  sign_only = jax.lax.bitcast_convert_type(bits & jnp.uint32(0x80000000), jnp.float32)
  return jnp.where((bits & jnp.uint32(0x7F800000)) == 0, sign_only, x)


def biased_exponent(x: jax.Array) -> jax.Array:
  """The 8 exponent bits of float32 |x| as int32 (255 for Inf/NaN, 0 for zero and subnormals)."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
  return ((bits >> 23) & 0xFF).astype(jnp.int32)


def significand_bits(x: jax.Array) -> jax.Array:
  """The 23 fraction bits of float32 x as int32."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
  return (bits & 0x7FFFFF).astype(jnp.int32)


def _above_midpoint(a: jax.Array, c: jax.Array) -> jax.Array:
  """For positive normal float32 a and c: whether a x (c + ulp(c) / 2) > 1, exactly. With
  a = A 2^ea and the midpoint (2C + 1) 2^(ec - 1) (A, C the 24-bit significands), the product
  A (2C + 1) (under 2^49) is formed in 16-bit limbs as 32-bit words hi, lo and compared with the
  power of two that 1 is at that exponent. It is never equal: A (2C + 1) is not a power of two."""
  u32 = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint32)
  ba, bc = u32(a), u32(c)
  big_a = (ba & 0x7FFFFF) | 0x800000
  big_b = (((bc & 0x7FFFFF) | 0x800000) << 1) | 1
  a0, a1 = big_a & 0xFFFF, big_a >> 16
  b0, b1 = big_b & 0xFFFF, big_b >> 16
  low = a0 * b0
  mid = a1 * b0 + a0 * b1
  lo = low + ((mid & 0xFFFF) << 16)
  hi = a1 * b1 + (mid >> 16) + (lo < low).astype(jnp.uint32)
  # a = A 2^(ea - 150), the midpoint (2C + 1) 2^(ec - 151) (ea, ec the exponent fields): against
  # A (2C + 1), 1 is 2^k with k = 301 - ea - ec
  k = 301 - ((ba >> 23) & 0xFF).astype(jnp.int32) - ((bc >> 23) & 0xFF).astype(jnp.int32)
  one_hi = jnp.left_shift(jnp.uint32(1), jnp.clip(k - 32, 0, 31).astype(jnp.uint32))
  return jnp.where(k >= 64, False, jnp.where(k < 32, True,  # far off: r was no estimate
                                              (hi > one_hi) | ((hi == one_hi) & (lo > 0))))


def round_reciprocal(v: jax.Array, r: jax.Array) -> jax.Array:
  """1 / v correctly rounded (to nearest), from r, an estimate within 3 ulp of it: r moved up
  while 1 / v lies above its upper midpoint, down while below its lower one, decided exactly in
  integers (`_above_midpoint`). Where v or 1 / v is not a normal float32 (zero, subnormal, Inf,
  NaN), r as it is."""
  a, r_abs = jnp.abs(v), jnp.abs(r)
  bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
  f32 = lambda b: jax.lax.bitcast_convert_type(b, jnp.float32)
  for _ in range(3):  # 1 / v above r's upper midpoint: r is too small
    r_abs = jnp.where(_above_midpoint(a, r_abs), r_abs, f32(bits(r_abs) + 1))
  for _ in range(3):  # below the midpoint under r: r is too large
    prev = f32(bits(r_abs) - 1)
    r_abs = jnp.where(_above_midpoint(a, prev), prev, r_abs)
  normal = lambda x: (biased_exponent(x) > 0) & (biased_exponent(x) < 255)
  return jnp.where(normal(a) & normal(r_abs), jnp.where(v < 0, -r_abs, r_abs), r)


def reciprocal(v: jax.Array) -> jax.Array:
  """1 / v in float32, correctly rounded on every backend for normal v with a normal 1 / v:
  what the scale rules divide with. XLA's CPU division is correctly rounded; its GPU division is
  an approximation (on the H200, 1 / v for 13% of random float32 v came out differently from the
  CPU's), so off the CPU the quotient is rounded again by `round_reciprocal` (on the H200 equal to
  numpy's on 65 536 random v, tests/quant). Only the branch of the platform compiled for is
  lowered: the CPU's graphs stay as small as a division."""
  v = jnp.asarray(v, jnp.float32)
  return jax.lax.platform_dependent(v, cpu=lambda v: 1.0 / v,
                                    default=lambda v: round_reciprocal(v, 1.0 / v))


@dataclasses.dataclass(frozen=True)
class ElementCodec:
  """A sign-magnitude element format whose codes are monotone in magnitude.

  Codes are `sign_bit | magnitude_code`. Because magnitude codes are monotone, neighbouring grid
  points differ by one in their *ordinal* (signed magnitude code), so the ordinal's lowest bit
  alternates along the grid. That is what makes a one-bit record enough to pick between the two
  candidates that bracket a value (DESIGN section 5).
  """

  name: str
  bits: int
  sign_bit: int
  max_ordinal: int  # magnitude code of the largest finite value
  max_value: float

  def encode(self, y: jax.Array) -> jax.Array:
    """Round-to-nearest-even onto the grid, saturating at +-max_value; returns uint8 codes."""
    raise NotImplementedError

  def decode(self, codes: jax.Array) -> jax.Array:
    """uint8 codes -> float32 values."""
    raise NotImplementedError

  def ordinal(self, codes: jax.Array) -> jax.Array:
    """Signed position on the grid: -m for negative codes, m for positive ones (int32)."""
    codes = codes.astype(jnp.int32)
    mag = codes & (self.sign_bit - 1)
    return jnp.where((codes & self.sign_bit) != 0, -mag, mag)

  def from_ordinal(self, ordinal: jax.Array) -> jax.Array:
    code = jnp.where(ordinal < 0, self.sign_bit | -ordinal, ordinal)
    return code.astype(jnp.uint8)


class _E2M1(ElementCodec):

  def encode(self, y):
    a = jnp.abs(y.astype(jnp.float32))
    # the grid has step 0.5 below 2, step 1 in [2, 4) and step 2 from 4 on; jnp.round is
    # round-half-to-even, and in every binade an even multiple of the step has an even mantissa
    m_lo = jnp.round(a * 2.0)
    m_mid = jnp.round(a) + 2.0
    m_hi = jnp.minimum(jnp.round(a * 0.5), 3.0) + 4.0
    m = jnp.where(a < 2.0, m_lo, jnp.where(a < 4.0, m_mid, m_hi))
    m = jnp.where(jnp.isnan(a), 0.0, m)  # NaN is carried by the block scale, never by the element
    sign = jnp.signbit(y).astype(jnp.uint8) << 3
    return sign | m.astype(jnp.uint8)

  def decode(self, codes):
    codes = codes.astype(jnp.int32)
    mag = jnp.asarray(E2M1_VALUES, jnp.float32)[codes & 7]
    return jnp.where((codes & 8) != 0, -mag, mag)


class _E4M3(ElementCodec):

  def encode(self, y):
    y = jnp.clip(y.astype(jnp.float32), -self.max_value, self.max_value)
    return jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8)

  def decode(self, codes):
    return jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32)


E2M1 = _E2M1(name="e2m1", bits=4, sign_bit=8, max_ordinal=7, max_value=6.0)
E4M3 = _E4M3(name="e4m3", bits=8, sign_bit=128, max_ordinal=126, max_value=448.0)


def pack_nibbles(codes: jax.Array) -> jax.Array:
  """[..., 2n] uint8 codes < 16 -> [..., n] bytes, the even index in the low nibble."""
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2).astype(jnp.uint8)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_nibbles`."""
  pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
  return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


_BIT_WEIGHTS = np.array([1 << i for i in range(8)], np.uint8)


def pack_bits(bits: jax.Array) -> jax.Array:
  """[..., 8n] values in {0, 1} -> [..., n] bytes, element 8k+j in bit j of byte k."""
  groups = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8).astype(jnp.uint8)
  return jnp.sum(groups * _BIT_WEIGHTS, axis=-1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """Inverse of `pack_bits` (uint8 zeros and ones)."""
  bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
  return bits.reshape(*packed.shape[:-1], packed.shape[-1] * 8)
