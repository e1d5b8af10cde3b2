"""The public quantization API of DESIGN section 6: QArray, Record and the five functions."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from trace_jax.quant import codecs
from trace_jax.quant.formats import BlockFormat, Format, get_format


def _leaf_bytes(*arrays) -> int:
  return sum(a.size * a.dtype.itemsize for a in arrays if a is not None)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["codes", "scales", "global_scale"],
    meta_fields=["fmt", "axis"],
)
@dataclasses.dataclass(frozen=True)
class QArray:
  """A quantized tensor: packed codes, block scales and an optional global scale.

  `codes` has the input's shape except along `axis`, where `fmt.codes_per_byte` codes share a
  byte (low nibble = even index). `scales` has one entry per block along `axis`; `global_scale`
  (NVFP4 only) has size 1 there. `axis` is stored negative, so vmap and stacking keep it valid.
  """

  codes: jax.Array
  scales: jax.Array | None
  global_scale: jax.Array | None
  fmt: Format
  axis: int

  @property
  def shape(self) -> tuple[int, ...]:
    shape = list(self.codes.shape)
    shape[self.axis] *= self.fmt.codes_per_byte
    return tuple(shape)

  @property
  def nbytes(self) -> int:
    return _leaf_bytes(self.codes, self.scales, self.global_scale)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mant", "scales", "global_scale"],
    meta_fields=["fmt", "axis"],
)
@dataclasses.dataclass(frozen=True)
class Record:
  """What the trainer needs to reproduce a rollout's codes: one mantissa bit per element (packed
  8 per uint8 along `axis`, element 8k+j in bit j of byte k) and the exact scales."""

  mant: jax.Array | None
  scales: jax.Array | None
  global_scale: jax.Array | None
  fmt: Format
  axis: int

  @property
  def nbytes(self) -> int:
    return _leaf_bytes(self.mant, self.scales, self.global_scale)


# --------------------------------------------------------------------------------------------
# validation and layout


def _normalize_axis(axis: int, ndim: int) -> int:
  if not -ndim <= axis < ndim:
    raise ValueError(f"axis {axis} is out of range for an array of rank {ndim}")
  return axis - ndim if axis >= 0 else axis


def _check_axis(shape: tuple[int, ...], axis: int, fmt: Format, *, what: str = "input") -> int:
  """Validates the quantized axis of `shape`; returns its block length."""
  if not shape:
    raise ValueError(f"cannot quantize a scalar {what} (shape ()) with {fmt.name}")
  n = shape[axis]
  block = fmt.axis_block(n)
  axis = axis % len(shape)  # messages name the axis as the caller counts it from the front
  if n == 0 or n % block:
    raise ValueError(
        f"{fmt.name}: the quantized axis {axis} of {what} shape {shape} has length {n}, which is "
        f"not a positive multiple of the block size {block}")
  if n % fmt.codes_per_byte:
    raise ValueError(f"{fmt.name}: the quantized axis {axis} of {what} shape {shape} has odd "
                     f"length {n}; codes are packed {fmt.codes_per_byte} per byte")
  return block


def _to_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """[..., n at axis, ...] -> [..., n / block, block], the quantized axis last."""
  x = jnp.moveaxis(x, axis, -1)
  return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _from_blocks(x_NxB: jax.Array, axis: int) -> jax.Array:
  x = x_NxB.reshape(*x_NxB.shape[:-2], -1)
  return jnp.moveaxis(x, -1, axis)


def _scales_to_blocks(a: jax.Array | None, axis: int) -> jax.Array | None:
  return None if a is None else jnp.moveaxis(a, axis, -1)


def _scales_from_blocks(a: jax.Array | None, axis: int) -> jax.Array | None:
  return None if a is None else jnp.moveaxis(a, -1, axis)


# --------------------------------------------------------------------------------------------
# quantize / dequantize / record


def quantize(x: jax.Array, fmt: Format | str, axis: int = -1) -> QArray:
  """Quantizes `x` (any float dtype, any leading dims) in blocks along `axis`."""
  fmt = get_format(fmt)
  x = jnp.asarray(x)
  axis = _normalize_axis(axis, x.ndim)
  block = _check_axis(x.shape, axis, fmt)
  codes_NxB, scales_N, global_1 = fmt.encode(_to_blocks(x.astype(jnp.float32), axis, block))
  codes = codes_NxB.reshape(*codes_NxB.shape[:-2], -1)
  if fmt.codes_per_byte == 2:
    codes = codecs.pack_nibbles(codes)
  return QArray(
      codes=jnp.moveaxis(codes, -1, axis),
      scales=_scales_from_blocks(scales_N, axis),
      global_scale=_scales_from_blocks(global_1, axis),
      fmt=fmt,
      axis=axis,
  )


def _unpacked_codes_blocks(qa: QArray, block: int) -> jax.Array:
  codes = jnp.moveaxis(qa.codes, qa.axis, -1)
  if qa.fmt.codes_per_byte == 2:
    codes = codecs.unpack_nibbles(codes)
  return codes.reshape(*codes.shape[:-1], codes.shape[-1] // block, block)


def dequantize(qa: QArray) -> jax.Array:
  """float32 values of `qa`, in the shape of the quantized input."""
  fmt = qa.fmt
  block = fmt.axis_block(qa.shape[qa.axis])
  values_NxB = fmt.decode(_unpacked_codes_blocks(qa, block),
                          _scales_to_blocks(qa.scales, qa.axis),
                          _scales_to_blocks(qa.global_scale, qa.axis))
  return _from_blocks(values_NxB, qa.axis)


def make_record(qa: QArray) -> Record:
  """The compact record of a quantized tensor: its mantissa bits and its scales."""
  fmt = qa.fmt
  if not fmt.has_record:
    return Record(mant=None, scales=None, global_scale=None, fmt=fmt, axis=qa.axis)
  n = qa.shape[qa.axis]
  if n % 8:
    raise ValueError(f"{fmt.name}: records pack 8 mantissa bits per byte, but the quantized axis "
                     f"{qa.axis} of shape {qa.shape} has length {n}, not a multiple of 8")
  codes = _unpacked_codes_blocks(qa, fmt.axis_block(n))
  mant = codecs.pack_bits((codes & 1).reshape(*codes.shape[:-2], n))
  return Record(mant=jnp.moveaxis(mant, -1, qa.axis), scales=qa.scales,
                global_scale=qa.global_scale, fmt=fmt, axis=qa.axis)


# --------------------------------------------------------------------------------------------
# differentiable ops: straight-through gradients, zero inside nothing but the clipped range


def _cast_cotangent(g, mask, like):
  return jnp.where(mask, g, 0.0).astype(like.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _fake_quant(x, fmt, axis):
  return _fake_quant_fwd(x, fmt, axis)[0]


def _fake_quant_fwd(x, fmt, axis):
  x_NxB = _to_blocks(x.astype(jnp.float32), axis, fmt.axis_block(x.shape[axis]))
  codes_NxB, scales_N, global_1 = fmt.encode(x_NxB)
  values = _from_blocks(fmt.decode(codes_NxB, scales_N, global_1), axis)
  mask = _from_blocks(fmt.clip_mask(x_NxB, scales_N, global_1), axis)
  return values, (mask, jnp.zeros((), x.dtype))


def _fake_quant_bwd(fmt, axis, res, g):
  mask, like = res
  return (_cast_cotangent(g, mask, like),)


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(x: jax.Array, fmt: Format | str, axis: int = -1) -> jax.Array:
  """dequantize(quantize(x)) as float32, with a clipped straight-through gradient."""
  fmt = get_format(fmt)
  x = jnp.asarray(x)
  axis = _normalize_axis(axis, x.ndim)
  _check_axis(x.shape, axis, fmt)
  return _fake_quant(x, fmt, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _guided_quant(x, rec, fmt, axis):
  return _guided_quant_fwd(x, rec, fmt, axis)[0]


def _record_blocks(x, rec, fmt, axis):
  """x, the mantissa bits, the scales and the global in the blocked layout."""
  n = x.shape[axis]
  block = fmt.axis_block(n)
  x_NxB = _to_blocks(x.astype(jnp.float32), axis, block)
  mant_NxB = None
  if rec.mant is not None:
    mant = codecs.unpack_bits(jnp.moveaxis(rec.mant, axis, -1))
    mant_NxB = mant.reshape(*mant.shape[:-1], n // block, block)
  return (x_NxB, mant_NxB, _scales_to_blocks(rec.scales, axis),
          _scales_to_blocks(rec.global_scale, axis))


def _guided_quant_fwd(x, rec, fmt, axis):
  values_NxB, mask_NxB = fmt.guided(*_record_blocks(x, rec, fmt, axis))
  return _from_blocks(values_NxB, axis), (_from_blocks(mask_NxB, axis), jnp.zeros((), x.dtype))


def _guided_quant_bwd(fmt, axis, res, g):
  mask, like = res
  return _cast_cotangent(g, mask, like), None  # records are data, not parameters


_guided_quant.defvjp(_guided_quant_fwd, _guided_quant_bwd)


def _check_record(x_shape, rec: Record, fmt: Format, axis: int, block: int) -> None:
  if not isinstance(rec, Record):
    raise ValueError(f"guided_quant expects a Record, got {type(rec).__name__}")
  if rec.fmt != fmt:
    raise ValueError(f"record was made with format {rec.fmt.name}, but guided_quant was asked for "
                     f"{fmt.name}")
  if rec.axis != axis:  # both negative
    raise ValueError(f"record was quantized along axis {rec.axis}, but the input shape "
                     f"{tuple(x_shape)} is being quantized along axis {axis}")
  if not fmt.has_record:
    return
  n = x_shape[axis]

  def expect(name, arr, size):
    want = list(x_shape)
    want[axis] = size
    if arr is None or tuple(arr.shape) != tuple(want):
      got = None if arr is None else tuple(arr.shape)
      raise ValueError(f"record {name} has shape {got}, but input shape {tuple(x_shape)} "
                       f"quantized along axis {axis} with {fmt.name} needs {tuple(want)}")

  expect("mant", rec.mant, n // 8)
  expect("scales", rec.scales, n // block)
  if rec.global_scale is not None:
    try:
      jnp.broadcast_shapes(rec.global_scale.shape, tuple(x_shape))
    except ValueError:
      raise ValueError(f"record global_scale shape {tuple(rec.global_scale.shape)} does not "
                       f"broadcast against input shape {tuple(x_shape)}") from None


def guided_quant(x: jax.Array, rec: Record, fmt: Format | str, axis: int = -1) -> jax.Array:
  """Rounds `x` to the rollout's codes using its record (DESIGN section 5), as float32.

  With the recorded scales, x falls between two neighbouring grid points; exactly one of them has
  the recorded mantissa bit, and that is the output. The gradient is straight-through inside the
  representable range and zero where clipped; the record gets no gradient.
  """
  fmt = get_format(fmt)
  x = jnp.asarray(x)
  axis = _normalize_axis(axis, x.ndim)
  block = _check_axis(x.shape, axis, fmt)
  _check_record(x.shape, rec, fmt, axis, block)
  if fmt.has_record and x.shape[axis] % 8:
    raise ValueError(f"{fmt.name}: records need an axis length that is a multiple of 8, "
                     f"got shape {x.shape} along axis {axis}")
  return _guided_quant(x, rec, fmt, axis)


def element_codes(qa: QArray) -> jax.Array:
  """The unpacked element codes of `qa`, uint8 in the shape of the quantized input."""
  if qa.fmt.codes_per_byte == 1:
    return qa.codes
  return jnp.moveaxis(codecs.unpack_nibbles(jnp.moveaxis(qa.codes, qa.axis, -1)), -1, qa.axis)


def guided_codes(x: jax.Array, rec: Record, fmt: Format | str, axis: int = -1) -> jax.Array:
  """The element codes `guided_quant` picks (for flip-rate diagnostics; not differentiable)."""
  fmt = get_format(fmt)
  if not isinstance(fmt, BlockFormat):
    raise ValueError(f"{fmt.name} has no element codes to guide")
  x = jnp.asarray(x)
  axis = _normalize_axis(axis, x.ndim)
  _check_record(x.shape, rec, fmt, axis, _check_axis(x.shape, axis, fmt))
  codes_NxB, _ = fmt.guided_codes(*_record_blocks(x, rec, fmt, axis))
  return _from_blocks(codes_NxB, axis)


def storage_bits_per_element(qa: QArray) -> float:
  """Bits actually stored per element, global scales included."""
  return 8 * qa.nbytes / math.prod(qa.shape)


def record_bits_per_element(rec: Record, shape: tuple[int, ...]) -> float:
  return 8 * rec.nbytes / math.prod(shape)
