"""Number formats as frozen dataclasses: MXFP4, NVFP4, FP8 (E4M3) and the BF16 passthrough.

Every function here works on the *blocked layout*: the quantized axis moved last and split into
blocks, `x_NxB` meaning any leading dims, then N blocks of B elements. The public functions in
`trace_jax.quant.api` do the axis bookkeeping and validation.

To add a format, subclass `BlockFormat` (a block scale rule and an element codec) or `Format`
(anything else), make an instance and pass it to `register`; nothing else needs editing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import codecs

_NAN = float("nan")


def _f32_reciprocal(c: float) -> np.float32:
  return np.float32(1.0) / np.float32(c)


@dataclasses.dataclass(frozen=True)
class Format:
  """A quantization format: how an axis is split into blocks and how a block is stored."""

  name: str
  block_size: int | None  # None: the whole axis is one block
  codes_per_byte: int = 1

  # --- what every format implements (blocked layout, float32 in, float32 out) ---
  def encode(self, x_NxB: jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """-> (codes [..., N, B] uint8 (unpacked), scales [..., N] or None, global [..., 1] or None)."""
    raise NotImplementedError

  def decode(self, codes_NxB, scales_N, global_1) -> jax.Array:
    raise NotImplementedError

  def guided(self, x_NxB, mant_NxB, scales_N, global_1) -> tuple[jax.Array, jax.Array]:
    """DESIGN section 5 rule. -> (values, inside-range mask for the straight-through gradient)."""
    raise NotImplementedError

  def clip_mask(self, x_NxB, scales_N, global_1) -> jax.Array:
    """True where x is inside the representable range (straight-through gradient is 1 there)."""
    raise NotImplementedError

  # --- static facts ---
  @property
  def element_bits(self) -> int:
    raise NotImplementedError

  @property
  def scale_bits(self) -> int:
    return 0

  @property
  def has_record(self) -> bool:
    return True

  def for_weights(self) -> Format:
    """The format a weight matrix of this format is stored in (NVFP4: one global per matrix,
    not per row); weights are quantized once, so a per-row global buys them nothing."""
    return self

  def axis_block(self, n: int) -> int:
    """Block length for an axis of length n."""
    return n if self.block_size is None else self.block_size

  def storage_bits(self, n: int) -> float:
    """Bits per element for an axis of length n, scales included (NVFP4's row global is not)."""
    return self.element_bits + self.scale_bits / self.axis_block(n)

  def record_bits(self, n: int) -> float:
    """Record bits per element: one mantissa bit plus the scales (DESIGN section 5)."""
    return (1 + self.scale_bits / self.axis_block(n)) if self.has_record else 0.0


@dataclasses.dataclass(frozen=True)
class BlockFormat(Format):
  """A block-scaled format: values map onto an element grid by a per-block scale.

  Subclasses define `scales_from_amax` (the stored scale rule, from each block's max |x|),
  `to_grid` (x -> element grid; by default x times `grid_multiplier`) and `from_grid`;
  quantization, dequantization and guided rounding follow from those and the element codec,
  and so do kernels that compute the block maxima their own way (pallas_kernels/quantize_record).
  Subnormal inputs read as zero and dequantized values below 2^-126 come back as +-0, on every
  backend (`codecs.flush_subnormal`; XLA's CPU flushes them, not every GPU program does).
  """

  @property
  def codec(self) -> codecs.ElementCodec:
    raise NotImplementedError

  @property
  def element_bits(self) -> int:
    return self.codec.bits

  def scales(self, x_NxB) -> tuple[jax.Array, jax.Array | None]:
    return self.scales_from_amax(*_block_amax(x_NxB))

  def scales_from_amax(self, amax_N, bad_N,
                       recip=codecs.reciprocal) -> tuple[jax.Array, jax.Array | None]:
    """The stored block scales (and global) from each block's max |x| over its finite values
    and whether it holds a NaN or Inf: the whole scale rule, so that kernels which reduce the
    blocks their own way share it. `recip`: the correctly rounded float32 reciprocal
    (`codecs.reciprocal`, or a kernel's own)."""
    raise NotImplementedError

  def grid_multiplier(self, scales_N, global_1, recip=codecs.reciprocal) -> jax.Array:
    """Per block, the float32 factor that maps x onto the element grid ([..., N])."""
    raise NotImplementedError

  def to_grid(self, x_NxB, scales_N, global_1, recip=codecs.reciprocal) -> jax.Array:
    """x on the element grid of its block (subnormal x as zero)."""
    x_NxB = codecs.flush_subnormal(x_NxB)
    return x_NxB * self.grid_multiplier(scales_N, global_1, recip)[..., None]

  def from_grid(self, v_NxB, scales_N, global_1) -> jax.Array:
    raise NotImplementedError

  def encode(self, x_NxB):
    scales_N, global_1 = self.scales(x_NxB)
    return self.codec.encode(self.to_grid(x_NxB, scales_N, global_1)), scales_N, global_1

  def decode(self, codes_NxB, scales_N, global_1):
    values = self.from_grid(self.codec.decode(codes_NxB), scales_N, global_1)
    return codecs.flush_subnormal(values)

  def clip_mask(self, x_NxB, scales_N, global_1):
    return jnp.abs(self.to_grid(x_NxB, scales_N, global_1)) <= self.codec.max_value

  def guided_codes(self, x_NxB, mant_NxB, scales_N, global_1) -> tuple[jax.Array, jax.Array]:
    """The codes the guided rule picks, and x on the recorded grid."""
    codec = self.codec
    y = self.to_grid(x_NxB, scales_N, global_1)
    # i = max{i : g_i <= y} as a signed ordinal: round to nearest, step down if that overshot
    nearest = codec.encode(y)
    lo = codec.ordinal(nearest) - (codec.decode(nearest) > y).astype(jnp.int32)
    lo = jnp.clip(lo, -codec.max_ordinal, codec.max_ordinal - 1)
    # of lo and lo + 1 exactly one has the recorded lowest bit; that is the rollout's code
    pick = jnp.where((lo & 1) == mant_NxB.astype(jnp.int32), lo, lo + 1)
    codes = codec.from_ordinal(pick)
    # the record has no sign for zero: take y's, as rounding a tiny negative value would
    codes = jnp.where((pick == 0) & jnp.signbit(y), jnp.uint8(codec.sign_bit), codes)
    return codes, y

  def guided(self, x_NxB, mant_NxB, scales_N, global_1):
    codes, y = self.guided_codes(x_NxB, mant_NxB, scales_N, global_1)
    values = codecs.flush_subnormal(self.from_grid(self.codec.decode(codes), scales_N, global_1))
    # non-finite input never comes back finite; a finite x far beyond a tiny recorded scale
    # (y overflowing to +-inf) saturates like any other out-of-range value
    values = jnp.where(jnp.isfinite(x_NxB), values, _NAN)
    return values, jnp.abs(y) <= self.codec.max_value


def _block_amax(x_NxB):
  """Per-block max |x| (subnormals as zero), and whether the block holds a NaN or Inf."""
  x_NxB = codecs.flush_subnormal(x_NxB)
  finite = jnp.isfinite(x_NxB)
  amax_N = jnp.max(jnp.where(finite, jnp.abs(x_NxB), 0.0), axis=-1)
  return amax_N, ~jnp.all(finite, axis=-1)


@dataclasses.dataclass(frozen=True)
class MXFP4Format(BlockFormat):
  """OCP MX v1.0 MXFP4: E2M1 elements, 32-element blocks, E8M0 power-of-two scales.

  scale = 2^(floor(log2 amax) - 2), so the block maximum lands in [4, 8) and values above 6 are
  clipped; `scale_rounding="ceil"` picks the smallest power of two with amax / scale <= 6 instead.
  The E8M0 byte is the scale's biased exponent; 0xFF marks a block with NaN or Inf.
  """

  name: str = "mxfp4"
  block_size: int | None = 32
  codes_per_byte: int = 2
  scale_rounding: Literal["floor", "ceil"] = "floor"

  def __post_init__(self):
    if self.scale_rounding not in ("floor", "ceil"):
      raise ValueError(f"scale_rounding must be 'floor' or 'ceil', got {self.scale_rounding!r}")

  codec = codecs.E2M1
  scale_bits = 8

  def scales_from_amax(self, amax_N, bad_N, recip=codecs.reciprocal):
    # floor(log2 amax) is the unbiased exponent of amax, so the E8M0 byte is exponent - 2
    code = codecs.biased_exponent(amax_N) - 2
    if self.scale_rounding == "ceil":  # amax / 2^e > 6 exactly when amax's significand is > 1.5
      code = code + (codecs.significand_bits(amax_N) > 0x400000).astype(jnp.int32)
    # at most 252, floor's largest: above it a block maximum rounding up to 4 x 2^126 would
    # overflow float32, so the topmost binade saturates at 6 x 2^125 instead
    code = jnp.clip(code, 0, 252)
    return jnp.where(bad_N, 255, code).astype(jnp.uint8), None

  def grid_multiplier(self, scales_N, global_1, recip=codecs.reciprocal):
    # the exact inverse power of two: 2^(127 - code) is a normal float32 for every code the
    # rule produces, where the scale itself (2^-127 for code 0) would be subnormal
    return codecs.exp2i(jnp.clip(127 - scales_N.astype(jnp.int32), -126, 127))

  def from_grid(self, v_NxB, scales_N, global_1):
    e = scales_N.astype(jnp.int32) - 127
    # 2^-127 (byte 0) is subnormal: halve the element (exact) and scale by the normal 2^-126
    v_NxB = v_NxB * jnp.where(e < -126, 0.5, 1.0)[..., None]
    scale = jnp.where(scales_N == 255, _NAN, codecs.exp2i(jnp.clip(e, -126, 127)))
    return v_NxB * scale[..., None]


_E4M3_MIN_SUBNORMAL = 2.0**-9
_F32_TINY = float(np.finfo(np.float32).tiny)  # 2^-126, the smallest normal float32
_E4M3_MAX = 448.0
_NVFP4_GLOBAL_DIVISOR = 6.0 * _E4M3_MAX
# NVFP4's block maxima and globals under 2^-62 are computed 2^64 up (exact), so that no
# intermediate is subnormal
_UP_EXP = 64
_UP_BELOW = 2.0**-62


def _pow2(where: jax.Array, exp: int) -> jax.Array:
  """2^exp where `where`, else 1 (float32)."""
  return jnp.where(where, np.float32(2.0**exp), np.float32(1.0))


@dataclasses.dataclass(frozen=True)
class NVFP4Format(BlockFormat):
  """NVFP4: E2M1 elements, 16-element blocks, E4M3 block scales, an fp32 global scale.

  g = amax / (6 * 448) over a row (`global_scale="row"`, for activations: per token) or the whole
  tensor (`"tensor"`, for weights); s = RN_e4m3(amax_block / 6 / g) clamped to [2^-9, 448];
  element = RNE_e2m1(x / (s * g)). NaN or Inf in a block makes its scale byte NaN (0x7F); the
  global is computed from the finite values, so one bad block leaves the rest of the row intact.

  Every division by a constant or a broadcast scale is written as a multiplication by a float32
  reciprocal, the way kernels compute it (and the way XLA's CPU compiler rewrites such divisions
  anyway): g = max(amax * f32(1/2688), 2^-126), s = RN_e4m3((amax_block * f32(1/6)) * (1/g)),
  element = RNE_e2m1(x * (1/(s*g))), value = element * (s*g), each reciprocal correctly rounded
  (`codecs.reciprocal`: XLA's GPU division is not), each step one float32 rounding as if float32
  had no subnormal range: amax / 6 is subnormal for blocks under 6 x 2^-126 and s*g for rows
  under 2^-62, so such blocks and rows are computed 2^64 up (exact) and brought back down in one
  rounding. No intermediate is subnormal, so the bytes are the same on every backend, eager or
  jitted, at every magnitude; a value dequantizes to zero only where the format's own rounding
  (or a result below 2^-126) makes it zero. g is at least 2^-126, so that it is stored normal.
  """

  name: str = "nvfp4"
  block_size: int | None = 16
  codes_per_byte: int = 2
  global_scale: Literal["row", "tensor"] = "row"

  def __post_init__(self):
    if self.global_scale not in ("row", "tensor"):
      raise ValueError(f"global_scale must be 'row' or 'tensor', got {self.global_scale!r}")

  def for_weights(self) -> Format:
    if self.global_scale == "tensor":
      return self
    name = "nvfp4_tensor" if self.name == "nvfp4" else f"{self.name}_tensor"
    return FORMATS.get(name) or dataclasses.replace(self, name=name, global_scale="tensor")

  codec = codecs.E2M1
  scale_bits = 8

  def scales_from_amax(self, amax_N, bad_N, recip=codecs.reciprocal):
    if self.global_scale == "row":
      amax_1 = jnp.max(amax_N, axis=-1, keepdims=True)
    else:
      amax_1 = jnp.max(amax_N, keepdims=True)
    # at least the smallest normal float32, so that a tiny row's global is stored normal (a
    # subnormal amax / 2688, flushed or not, gives 2^-126); an all-zero row takes 1 (any
    # global works, keep it finite)
    g_1 = jnp.maximum(amax_1 * _f32_reciprocal(_NVFP4_GLOBAL_DIVISOR), _F32_TINY)
    g_1 = jnp.where(amax_1 > 0, g_1, 1.0)
    tiny_N = amax_N < _UP_BELOW  # amax / 6 is subnormal under 6 x 2^-126: take it 2^64 up
    # amax / 6 is never subnormal, so flushing it changes nothing, but it keeps the two
    # roundings: XLA's simplifier would otherwise rewrite (amax x c) x broadcast(1 / g), c a
    # constant, as amax x broadcast(c / g), which is off by one ulp at times (a tie 336 came out
    # 336.00003 and so E4M3 byte 123 in place of 122)
    sixth_N = codecs.flush_subnormal((amax_N * _pow2(tiny_N, _UP_EXP)) * _f32_reciprocal(6.0))
    s_N = sixth_N * recip(g_1)
    # and back: exact for every s E4M3 can round to other than zero (>= 2^-10)
    s_N = s_N * _pow2(tiny_N, -_UP_EXP)
    s_N = jnp.clip(s_N, 0.0, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    s_N = jnp.maximum(s_N.astype(jnp.float32), _E4M3_MIN_SUBNORMAL).astype(jnp.float8_e4m3fn)
    s_N = jax.lax.bitcast_convert_type(s_N, jnp.uint8)
    return jnp.where(bad_N, 0x7F, s_N).astype(jnp.uint8), g_1

  def _element_scale(self, scales_N, global_1):
    """s*g, taken 2^64 up where g < 2^-62 (s*g could be subnormal there, 2^-135 at the least),
    and whether it was: [..., N], [..., 1]."""
    tiny_1 = global_1 < _UP_BELOW
    return codecs.E4M3.decode(scales_N) * (global_1 * _pow2(tiny_1, _UP_EXP)), tiny_1

  def to_grid(self, x_NxB, scales_N, global_1, recip=codecs.reciprocal):
    sg_N, tiny_1 = self._element_scale(scales_N, global_1)
    # x up by the same 2^64: exact for the x of such a row (|x| < 2^-50); a far larger x (a
    # trainer's value against a tiny recorded scale) overflows and saturates, as it would anyway
    x_NxB = codecs.flush_subnormal(x_NxB) * _pow2(tiny_1, _UP_EXP)[..., None]
    return x_NxB * recip(sg_N)[..., None]

  def from_grid(self, v_NxB, scales_N, global_1):
    sg_N, tiny_1 = self._element_scale(scales_N, global_1)
    # the product's one rounding is up there; coming down is exact unless it leaves the normal
    # range (then `decode` flushes it)
    return (v_NxB * sg_N[..., None]) * _pow2(tiny_1, -_UP_EXP)[..., None]


@dataclasses.dataclass(frozen=True)
class FP8Format(BlockFormat):
  """FP8 E4M3 with an fp32 scale max(amax / 448, 2^-126) per row (`block_size=None`) or block."""

  name: str = "fp8"
  block_size: int | None = None
  codes_per_byte: int = 1

  codec = codecs.E4M3
  scale_bits = 32

  def scales_from_amax(self, amax_N, bad_N, recip=codecs.reciprocal):
    # at least the smallest normal float32, so that 1/s stays finite for tiny rows
    s_N = jnp.maximum(amax_N * _f32_reciprocal(_E4M3_MAX), _F32_TINY)
    s_N = jnp.where(amax_N > 0, s_N, 1.0)
    return jnp.where(bad_N, _NAN, s_N), None

  def grid_multiplier(self, scales_N, global_1, recip=codecs.reciprocal):
    return recip(scales_N)  # reciprocal first, as NVFP4 does

  def from_grid(self, v_NxB, scales_N, global_1):
    return v_NxB * scales_N[..., None]


@dataclasses.dataclass(frozen=True)
class BF16Format(Format):
  """No quantization beyond a cast to bfloat16: the baseline of every ablation. No record."""

  name: str = "bf16"
  block_size: int | None = None
  codes_per_byte: int = 1

  element_bits = 16
  has_record = False

  def encode(self, x_NxB):
    return x_NxB.astype(jnp.bfloat16), None, None

  def decode(self, codes_NxB, scales_N, global_1):
    return codes_NxB.astype(jnp.float32)

  def clip_mask(self, x_NxB, scales_N, global_1):
    return jnp.ones(x_NxB.shape, bool)

  def guided(self, x_NxB, mant_NxB, scales_N, global_1):
    return x_NxB.astype(jnp.bfloat16).astype(jnp.float32), self.clip_mask(x_NxB, None, None)


MXFP4 = MXFP4Format()
MXFP4_CEIL = MXFP4Format(name="mxfp4_ceil", scale_rounding="ceil")
NVFP4 = NVFP4Format()
NVFP4_TENSOR = NVFP4Format(name="nvfp4_tensor", global_scale="tensor")
FP8 = FP8Format()
BF16 = BF16Format()

FORMATS: dict[str, Format] = {}


def register(fmt: Format) -> Format:
  """Make `fmt` reachable by name (configs name formats as strings)."""
  if not isinstance(fmt, Format):
    raise ValueError(f"register expects a Format instance, got {type(fmt).__name__}")
  FORMATS[fmt.name] = fmt
  return fmt


for _fmt in (MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR, FP8, BF16):
  register(_fmt)


def get_format(fmt: Format | str) -> Format:
  """A Format, or the registered format of that name; anything else is a ValueError."""
  if isinstance(fmt, Format):
    return fmt
  if isinstance(fmt, str) and fmt.lower() in FORMATS:
    return FORMATS[fmt.lower()]
  raise ValueError(f"unknown quantization format {fmt!r}; known formats: {sorted(FORMATS)}")
