"""`TiledFP4`: an FP4 weight in the layout of the Mosaic GPU (wgmma) kernels, made once.

The wgmma kernels (`mosaic.py`) stream a weight through shared memory in [64-row, 32-byte] code
tiles and 64-row scale vectors, and Mosaic swizzles only contiguous shared-memory tiles, so the
weight is stored pre-tiled: codes [(E,) N/64, K/64, 64, 32] (output rows 64 at a time, K in
chunks of 64 values, a chunk's 64 x 32 bytes contiguous) and scales [(E,) N/64, K/block, 64].
The tiling is a permutation of the packed bytes, done where weights are packed (the weight
sync), never per step; `untile` gives back the [K, N] (or [E, K, N]) `QArray`, bit for bit.

Within a tile row the nibbles come in one of two orders (`ORDERS`):
- "pairs": the packed bytes as they are, byte b holding K values 2b (low nibble) and 2b + 1;
  the kernel decodes each register's low nibbles and its high nibbles into two separate A
  operands and multiplies them with x's even and odd K columns (`mosaic._body`), which the
  caller splits out of x beforehand.
- "halves": each group of 16 K values (8 bytes) holds values p and p + 8 in byte p, the first
  half of the group in the low nibbles and the second in the high ones. A thread of wgmma's
  A-operand layout then decodes from one register of two bytes (at columns 2q, 2q + 1 of an
  8-byte column tile) the low-nibble pair of K values 16j + 2q, 16j + 2q + 1 and the
  high-nibble pair 16j + 8 + 2q, 16j + 9 + 2q: exactly the two registers it holds of a
  [64, 64] bf16 tile in K's own order. The decode is the same PTX; x is multiplied as it is,
  no even/odd split. A 16-value group lies inside one MXFP4 (32) or NVFP4 (16) block, so the
  scales do not move.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trace_jax.quant import QArray
from trace_jax.quant.formats import Format

ROWS = 64  # output rows (N) a tile: the wgmma A operand's M
CHUNK = 32  # code bytes a tile row: 64 K values, two MXFP4 blocks, four NVFP4 ones
FORMATS = ("mxfp4", "nvfp4_tensor")
ORDERS = ("pairs", "halves")  # the nibbles' order within a tile row (module docstring)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["codes", "scales", "global_scale"],
                   meta_fields=["fmt", "order"])
@dataclasses.dataclass(frozen=True)
class TiledFP4:
  """An MXFP4 or per-tensor NVFP4 weight [K, N] (or per-expert [E, K, N]) quantized along K, in
  the wgmma kernels' layout: codes uint8 [(E,) N/64, K/64, 64, 32], scales uint8
  [(E,) N/64, K/block, 64], global_scale float32 [] (or [E]: NVFP4's global; for MXFP4 the
  power of two 2^(R - 127) that the folded decode leaves out, `fold_reference`, 1 unless a block
  scale exceeds 2^1); `order` the nibbles' order in a tile row (`ORDERS`). Made by `tile`."""

  codes: jax.Array
  scales: jax.Array
  global_scale: jax.Array
  fmt: Format
  order: str = "pairs"

  @property
  def grouped(self) -> bool:
    return self.codes.ndim == 5

  @property
  def shape(self) -> tuple[int, ...]:
    """The weight's [K, N] (or [E, K, N]), as the matmul sees it."""
    *lead, n_tiles, k_chunks, _, _ = self.codes.shape
    return (*lead, k_chunks * 2 * CHUNK, n_tiles * ROWS)

  @property
  def kernel_fmt(self) -> str:
    """The kernels' name of the format: "mxfp4" or "nvfp4"."""
    return "mxfp4" if self.fmt.name == "mxfp4" else "nvfp4"

  @property
  def nbytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in (self.codes, self.scales, self.global_scale))


def _kmajor(w: QArray) -> tuple[jax.Array, jax.Array]:
  """codes [..., N, K/2] and scales [..., N, K/block] of a [K, N] or K-major [N, K] weight."""
  if w.axis == -1:
    return w.codes, w.scales
  return jnp.swapaxes(w.codes, -1, -2), jnp.swapaxes(w.scales, -1, -2)


def _halves(codes: jax.Array) -> jax.Array:
  """Packed K-major codes [..., K/2] (byte b: K values 2b, 2b + 1) -> the "halves" order (byte
  p of each 8: values p and p + 8 of its 16)."""
  nib = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], -1, 2, 8)
  return (nib[..., 0, :] | nib[..., 1, :] << 4).reshape(codes.shape)


def _pairs(codes: jax.Array) -> jax.Array:
  """The inverse of `_halves`."""
  g = codes.reshape(*codes.shape[:-1], -1, 8)
  nib = jnp.concatenate([g & 15, g >> 4], axis=-1).reshape(*g.shape[:-1], 8, 2)
  return (nib[..., 0] | nib[..., 1] << 4).reshape(codes.shape)


def fold_reference(scales: jax.Array, lead: int) -> jax.Array:
  """MXFP4 scale bytes [*lead dims, ...] -> 2^(R - 127) (float32 [*lead dims]), the reference
  of the kernels' folded decode (`mosaic` with fold=True: one multiply by 2^(s - R + 126) a
  pair of values, then the output times 2^(R - 127)): R = max(127, the largest finite scale
  byte - 1), so that every finite block's multiplier is a bf16 power of two; the values then
  decode exactly for block scales down to 2^(R - 259) (2^-132 below the reference)."""
  s = scales.astype(jnp.int32).reshape(*scales.shape[:lead], -1)
  r = jnp.clip(jnp.max(jnp.where(s < 255, s, 0), axis=-1) - 1, 127, 254)
  return jax.lax.bitcast_convert_type(r << 23, jnp.float32)


def tile(w: QArray, order: str = "pairs") -> TiledFP4:
  """A packed FP4 weight -> `TiledFP4` (a layout change; no value changes). Takes [K, N]
  quantized along K (axis 0), its K-major transpose [N, K] (axis 1, `reference.transpose`), or
  per-expert weights [E, K, N] quantized along K (NVFP4: one global per expert, or one for all,
  which is then repeated per expert). `order`: the nibbles' order in a tile row (`ORDERS`)."""
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
  if not isinstance(w, QArray):
    raise ValueError(f"tile takes a packed FP4 weight (QArray), got {type(w).__name__}")
  grouped = w.codes.ndim == 3
  if grouped and w.axis != -2 or not grouped and (w.codes.ndim != 2 or w.axis not in (-2, -1)):
    raise ValueError(f"tile takes [K, N] or K-major [N, K] weights, or per-expert [E, K, N], "
                     f"quantized along K; got {w.shape} quantized along axis {w.axis}")
  if w.fmt.name not in FORMATS:
    raise ValueError(f"the wgmma kernels take MXFP4 and per-tensor NVFP4 weights, got "
                     f"{w.fmt.name}")
  codes, scales = _kmajor(w)
  *lead, n, k2 = codes.shape
  if n % ROWS or k2 % CHUNK:
    raise ValueError(f"the wgmma kernels need N ({n}) divisible by {ROWS} and K ({2 * k2}) by "
                     f"{2 * CHUNK}")
  if order == "halves":
    codes = _halves(codes)
  codes = codes.reshape(*lead, n // ROWS, ROWS, k2 // CHUNK, CHUNK)
  scales = scales.reshape(*lead, n // ROWS, ROWS, scales.shape[-1])
  if w.global_scale is None:  # MXFP4
    g = fold_reference(scales, len(lead))
  else:
    g = w.global_scale.astype(jnp.float32)
    g = jnp.broadcast_to(g.reshape(()), lead) if g.size == 1 else g.reshape(lead)
  return TiledFP4(jnp.swapaxes(codes, -3, -2), jnp.swapaxes(scales, -2, -1), g, w.fmt, order)


def untile(t: TiledFP4) -> QArray:
  """`TiledFP4` -> the packed [K, N] (or [E, K, N]) weight quantized along K it was made from
  (from a K-major [N, K] one: its [K, N] transpose; from experts sharing one NVFP4 global: that
  global per expert)."""
  *lead, n_tiles, k_chunks, rows, chunk = t.codes.shape
  codes = jnp.swapaxes(t.codes, -3, -2).reshape(*lead, n_tiles * rows, k_chunks * chunk)
  if t.order == "halves":
    codes = _pairs(codes)
  scales = jnp.swapaxes(t.scales, -2, -1).reshape(*lead, n_tiles * rows, -1)
  g = None if t.fmt.name == "mxfp4" else t.global_scale.reshape(*lead, 1, 1)
  return QArray(jnp.swapaxes(codes, -1, -2), jnp.swapaxes(scales, -1, -2), g, t.fmt, -2)
