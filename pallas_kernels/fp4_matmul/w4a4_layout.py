"""MXFP4 x MXFP4 on FP8 tensor cores: the weight's layout, the activations' E4M3 fold, and the
exact values both decode to.

Hopper's wgmma multiplies E4M3 operands (A from registers) into float32; an MXFP4 value is an
E2M1 code times a power of two, so both operands are exact in E4M3 once their block scales are
taken out or folded in:

- Weights (`TiledW4`, made once by the weight sync): every code decodes to E2M1 x 2^6 in E4M3
  (a byte-permute table, `DECODE_ASM`: eight instructions for eight values), whatever its block
  scale; the kernel multiplies each block's float32 product by the block's scale relative to
  its row's largest, 2^(s - R_n), and the row's 2^(R_n - 127) is applied once at the end. No
  weight block is outside what this holds (scales more than 2^127 below their row's largest
  are 0 in float32: `tile` refuses such rows where it can see them).
- Activations (`activation_e4m3`, per call): each token's blocks folded relative to its largest
  scale R_t, E2M1 x 2^(s - R_t + 6), exact in E4M3 while s >= R_t - 14 (E4M3's subnormals hold
  the smallest, 0.5 x 2^-8); a block further below (or a NaN scale) is counted, and the call
  then takes an exact path of its own (`w4a4.py`): the activation unfolded, every code E2M1 x
  2^6 as the weight's (`activation_unfolded`), and each block's 2^(s - R_t) applied with the
  weight block's relative scale to the block's float32 product, inside the kernel; or XLA's
  dequantize-then-dot.

One wgmma of 32 K values is one block of each operand: its 32 products E2M1 x E2M1 x a common
power of two are small integers (|sum| <= 32 x 144 < 2^13), which the FP8 tensor core sums
exactly even in its 13-bit-mantissa accumulator, so each block's product is exact and the
blocks are summed in float32 registers (never in the tensor core's accumulator): the result
is the reference's up to the order of float32 sums.

The weight layout: for each 64-row tile and 64-K chunk, 512 32-bit words [128 threads, 4]:
thread t = 32 w + l of the warpgroup holds rows r = 16 w + l // 4 and r + 8 of the wgmma A
fragment, at columns 4 (l % 4) + {0..3} and + 16 of each 32-K block; word 2 b + h holds the
eight codes of row r + 8 h in block b, its bits arranged so that two byte permutes decode them
(`_word_bits`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.quant import QArray

ROWS = 64  # weight rows (N) a tile: wgmma's M
CHUNK_K = 64  # K values a chunk: two MXFP4 blocks, 512 words
BLOCK = 32  # MXFP4's block, and the K of one FP8 wgmma
WEIGHT_SHIFT = 6  # every weight value decodes to E2M1 x 2^6
ACT_SHIFT = 6  # the largest activation block decodes to E2M1 x 2^6 (6 x 64 = 384 < 448)
ACT_SPREAD = 14  # activation blocks down to 2^-14 of their token's largest are exact in E4M3

# E2M1 magnitudes 0..7 -> E4M3 bytes of E2M1 x 2^6: [0, 0.5, 1, 1.5] and [2, 3, 4, 6] x 64
LUT = (0x6C686000, 0x7C787470)

# Two E4M3 registers from one word w ($2): $0 takes the codes whose magnitudes are w's low
# nibbles (bit 3 of each cleared) and whose signs are bits 7, 15, 23, 31; $1 those in w's
# high half with signs at bits 3, 11, 19, 27 (shifted to each byte's top bit).
DECODE_ASM = """{
 .reg .b32 s, m, lo, hi;
 mov.b32 lo, 0x6C686000;
 mov.b32 hi, 0x7C787470;
 and.b32 s, $2, 0x7777;
 prmt.b32 m, lo, hi, s;
 lop3.b32 $0, m, $2, 0x80808080, 0xF8;
 shr.b32 s, $2, 16;
 and.b32 s, s, 0x7777;
 prmt.b32 m, lo, hi, s;
 shl.b32 s, $2, 4;
 lop3.b32 $1, m, s, 0x80808080, 0xF8;
}"""


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["words", "scales", "row_exp"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TiledW4:
  """An MXFP4 weight [K, N] (or per-expert [E, K, N]) quantized along K, in the FP8 kernel's
  layout: words uint32 [(E,) N/64, K/64, 512]; scales uint8 [(E,) N/64, K/32, 64], each
  block's E8M0 byte relative to its row's largest (s - R_n + 127, 0 for a scale over 2^127
  below it); row_exp int32 [(E,) N], R_n (255: a NaN scale in the row). Made by `tile`."""

  words: jax.Array
  scales: jax.Array
  row_exp: jax.Array

  @property
  def grouped(self) -> bool:
    return self.words.ndim == 4

  @property
  def shape(self) -> tuple[int, ...]:
    *lead, n_tiles, chunks, _ = self.words.shape
    return (*lead, chunks * CHUNK_K, n_tiles * ROWS)

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in (self.words, self.scales, self.row_exp))


def _thread_coords():
  """For word slot (t, j) of a chunk ([128, 4]): (row in the tile, block in the chunk, the
  first K column of its low four codes within the block)."""
  t, j = np.meshgrid(np.arange(128), np.arange(4), indexing="ij")
  w, lane = t // 32, t % 32
  row = 16 * w + lane // 4 + 8 * (j % 2)
  return row, j // 2, 4 * (lane % 4)


def _word_bits(c_lo, c_hi):
  """Two groups of four codes (uint32 [..., 4] each: the low register's, the high one's) ->
  their word: magnitudes of c_lo in nibbles 0-3 (bits 0-2, 4-6, ...), its signs at bits
  8i + 7; magnitudes of c_hi in nibbles 4-7, its signs at bits 8i + 3."""
  i = jnp.arange(4, dtype=jnp.uint32)
  mag = lambda c: c & 7
  sign = lambda c: c >> 3
  w = (mag(c_lo) << (4 * i)) | (sign(c_lo) << (8 * i + 7))
  w |= (mag(c_hi) << (16 + 4 * i)) | (sign(c_hi) << (8 * i + 3))
  return jnp.bitwise_or.reduce(w, axis=-1)


def _nibbles(codes_u8):
  """Packed bytes [..., K/2] -> codes [..., K] (low nibble = even index)."""
  c = codes_u8.astype(jnp.uint32)
  return jnp.stack([c & 15, c >> 4], axis=-1).reshape(*c.shape[:-1], -1)


def _kmajor(w: QArray):
  if w.axis == -1:
    return w.codes, w.scales
  return jnp.swapaxes(w.codes, -1, -2), jnp.swapaxes(w.scales, -1, -2)


def tile(w: QArray) -> TiledW4:
  """A packed MXFP4 weight ([K, N] or K-major [N, K], or per-expert [E, K, N], quantized along
  K) -> `TiledW4`. Every value stays exact: see the module docstring."""
  if not isinstance(w, QArray) or w.fmt.name != "mxfp4":
    raise ValueError(f"the FP8 (W4A4) kernels take MXFP4 weights (QArray), got "
                     f"{getattr(getattr(w, 'fmt', None), 'name', type(w).__name__)}")
  codes, scales = _kmajor(w)  # [..., N, K/2], [..., N, K/32]
  *lead, n, k2 = codes.shape
  if n % ROWS or (2 * k2) % CHUNK_K:
    raise ValueError(f"the W4A4 kernels need N ({n}) divisible by {ROWS} and K ({2 * k2}) by "
                     f"{CHUNK_K}")
  k = 2 * k2
  c = _nibbles(codes).astype(jnp.uint8)
  c = c.reshape(*lead, n // ROWS, ROWS, k // CHUNK_K, 2, BLOCK)
  row, blk, col = _thread_coords()  # [128, 4]
  cols = col[..., None] + np.arange(4)  # [128, 4, 4]
  # the advanced indices' axes come first: [128, 4, 4, ..., n_tiles, chunks]
  lo = c[..., row[..., None], :, blk[..., None], cols].astype(jnp.uint32)
  hi = c[..., row[..., None], :, blk[..., None], cols + 16].astype(jnp.uint32)
  nd = len(lead) + 2
  lo, hi = (jnp.moveaxis(a, (0, 1, 2), (nd, nd + 1, nd + 2)) for a in (lo, hi))
  words = _word_bits(lo, hi).reshape(*lead, n // ROWS, k // CHUNK_K, 512)
  s = scales.astype(jnp.int32)  # [..., N, K/32]
  r = jnp.max(s, axis=-1)
  rel = jnp.where(s >= r[..., None] - 127, s - r[..., None] + 127, 0).astype(jnp.uint8)
  rel = jnp.swapaxes(rel.reshape(*lead, n // ROWS, ROWS, k // BLOCK), -1, -2)
  return TiledW4(words.astype(jnp.uint32), rel, r.astype(jnp.int32))


def e4m3_values(t: TiledW4) -> jax.Array:
  """The E4M3 values the kernel decodes each weight element to (float32 [..., K, N]): E2M1 x
  2^6, read back from the words by the decode's own rule (the byte table and the sign bits)."""
  lut = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], jnp.float32) * 2.0 ** WEIGHT_SHIFT
  w = t.words.astype(jnp.uint32)[..., None]  # [..., n_tiles, chunks, 512, 1]
  i = jnp.arange(4, dtype=jnp.uint32)
  signed = lambda mag, sign: jnp.where(sign == 1, -lut[mag], lut[mag])
  lo = signed((w >> (4 * i)) & 7, (w >> (8 * i + 7)) & 1)
  hi = signed((w >> (16 + 4 * i)) & 7, (w >> (8 * i + 3)) & 1)
  *lead, n_tiles, chunks, _, _ = lo.shape
  out = jnp.zeros((*lead, n_tiles, ROWS, chunks, 2, BLOCK), jnp.float32)
  row, blk, col = _thread_coords()
  cols = col[..., None] + np.arange(4)
  nd = len(lead) + 2
  for vals, offset in ((lo, 0), (hi, 16)):
    vals = jnp.moveaxis(vals.reshape(*lead, n_tiles, chunks, 128, 4, 4), (nd, nd + 1, nd + 2),
                        (0, 1, 2))  # the advanced indices' axes first, as `.at` takes them
    out = out.at[..., row[..., None], :, blk[..., None], cols + offset].set(vals)
  return jnp.swapaxes(out.reshape(*lead, n_tiles * ROWS, chunks * CHUNK_K), -1, -2)


def scale_multipliers(t: TiledW4) -> jax.Array:
  """float32 [..., K/32, N]: each weight block's scale relative to its row's largest, 2^(s -
  R_n), as the kernel multiplies each block's product by it."""
  rel = jnp.swapaxes(t.scales, -1, -2).astype(jnp.int32)  # [..., n_tiles, 64, K/32]
  *lead, n_tiles, rows, blocks = rel.shape
  m = jax.lax.bitcast_convert_type(rel << 23, jnp.float32)
  return jnp.swapaxes(m.reshape(*lead, n_tiles * rows, blocks), -1, -2)


def row_scale(row_exp: jax.Array, offset: int) -> jax.Array:
  """float32 2^(R - offset) for exponent bytes R (255, a NaN scale: NaN)."""
  e = row_exp.astype(jnp.int32) - offset
  v = jnp.ldexp(jnp.ones(e.shape, jnp.float32), e)
  return jnp.where(row_exp == 255, jnp.nan, v)


def untile(t: TiledW4) -> QArray:
  """`TiledW4` -> the packed MXFP4 [K, N] (or [E, K, N]) weight it holds, for the exact path
  and the tests: the codes read back from the words, the scales from R_n and the relative
  bytes (a scale flushed to 0 at `tile` comes back as R_n - 127)."""
  from trace_jax.quant import MXFP4
  v = e4m3_values(t) / 2.0 ** WEIGHT_SHIFT  # the E2M1 values [..., K, N]
  mags = jnp.abs(v)
  table = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], jnp.float32)
  m = jnp.argmax(mags[..., None] == table, axis=-1).astype(jnp.uint8)
  code = m | (jnp.signbit(v).astype(jnp.uint8) << 3)
  packed = code[..., 0::2, :] | (code[..., 1::2, :] << 4)
  rel = jnp.swapaxes(t.scales, -1, -2).astype(jnp.int32)  # [..., n_tiles, 64, K/32]
  *lead, n_tiles, rows, blocks = rel.shape
  rel = rel.reshape(*lead, n_tiles * rows, blocks)
  s = (rel + t.row_exp[..., None] - 127).astype(jnp.uint8)
  return QArray(packed, jnp.swapaxes(s, -1, -2), None, MXFP4, -2)


def _check_activation(xq) -> None:
  if not isinstance(xq, QArray) or xq.fmt.name != "mxfp4" or xq.codes.ndim != 2 or (
      xq.axis not in (-1, 1)):
    raise ValueError(f"the W4A4 kernels take an MXFP4 activation [M, K] quantized along K, got "
                     f"{type(xq).__name__} {getattr(xq, 'shape', None)}")


def activation_e4m3(xq: QArray):
  """An MXFP4 activation [M, K] quantized along K -> (E4M3 [M, K] with each token's blocks
  folded relative to its largest scale, E2M1 x 2^(s - R_t + 6); R_t int32 [M]; how many of its
  blocks that fold cannot hold (nonzero blocks more than 2^14 below their token's largest, and
  NaN scales): the call's exact path runs when any)."""
  _check_activation(xq)
  codes = _nibbles(xq.codes)  # [M, K]
  m, k = codes.shape
  s = xq.scales.astype(jnp.int32)  # [M, K/32]
  r = jnp.max(s, axis=-1)
  d = s - r[:, None] + ACT_SHIFT  # the fold's exponent, -8..6 where exact
  e2m1 = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], jnp.float32)[codes & 7]
  e2m1 = jnp.where(codes >= 8, -e2m1, e2m1).reshape(m, k // BLOCK, BLOCK)
  folded = e2m1 * jnp.ldexp(jnp.ones_like(d, jnp.float32), jnp.maximum(d, -8))[..., None]
  nonzero = jnp.any((codes & 7).reshape(m, k // BLOCK, BLOCK) != 0, axis=-1)
  out_of_range = (nonzero & (d < -ACT_SPREAD + ACT_SHIFT)) | (s == 255)
  x8 = folded.reshape(m, k).astype(jnp.float8_e4m3fn)
  return x8, r, jnp.sum(out_of_range, dtype=jnp.int32)


def activation_unfolded(xq: QArray):
  """An MXFP4 activation [M, K] for the exact path -> (E4M3 [M, K], every code E2M1 x 2^6;
  float32 [K/32, M], each block's 2^(s - R_t), NaN for a NaN scale, K-major as the kernel
  reads it). With R_t and the token's 2^(R_t - 127 - 12) as in `activation_e4m3`, any spread of
  scales is exact: what 2^(s - R_t) loses below float32's range (s < R_t - 149) is a product
  under 2^-149 of its token's largest block."""
  _check_activation(xq)
  codes = _nibbles(xq.codes)
  m, k = codes.shape
  s = xq.scales.astype(jnp.int32)
  e2m1 = jnp.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], jnp.float32)[codes & 7] * 2.0 ** ACT_SHIFT
  x8 = jnp.where(codes >= 8, -e2m1, e2m1).astype(jnp.float8_e4m3fn)
  rel = s - jnp.max(s, axis=-1, keepdims=True)
  mult = jnp.where(s == 255, jnp.nan, jnp.ldexp(jnp.ones(rel.shape, jnp.float32), rel))
  return x8, mult.T
