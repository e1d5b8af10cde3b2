"""Pure-jnp reference of the FP4 matmul: y = x @ W, W packed FP4 along K with block scales.

The kernel's numerics, written plainly: every block-scaled weight dequantizes exactly to bf16
(an E2M1 value times an E8M0 power of two, or times an E4M3 scale: at most 6 significant bits),
the products accumulate in float32, and NVFP4's per-tensor global scale multiplies the float32
result. The kernel differs from this only in the order of the sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.quant import QArray
from trace_jax.quant.codecs import E2M1, E4M3, exp2i, unpack_nibbles


def check_weight(w: QArray, grouped: bool = False) -> None:
  if grouped:
    if not isinstance(w, QArray) or w.codes.ndim != 3 or w.axis != -2:
      raise ValueError("grouped_fp4_matmul expects per-expert weights [E, K, N] quantized along "
                       f"K (axis 1), got {type(w).__name__} {getattr(w, 'shape', None)} axis "
                       f"{getattr(w, 'axis', None)}")
  elif not isinstance(w, QArray) or w.codes.ndim != 2 or w.axis not in (-2, -1):
    raise ValueError("fp4_matmul expects a [K, N] weight quantized along K (axis 0), or its "
                     "K-major transpose [N, K] quantized along K (axis 1), got "
                     f"{type(w).__name__} {getattr(w, 'shape', None)} axis "
                     f"{getattr(w, 'axis', None)}")
  if w.fmt.name not in ("mxfp4", "nvfp4_tensor"):
    raise ValueError(f"fp4_matmul supports MXFP4 and NVFP4 (per-tensor global) weights, got "
                     f"{w.fmt.name}")


def transpose(w: QArray) -> QArray:
  """[K, N] quantized along K <-> its K-major transpose [N, K] quantized along K: the same codes
  and scales, transposed (a layout change, no requantization)."""
  return QArray(w.codes.T, w.scales.T, w.global_scale if w.global_scale is None
                else w.global_scale.T, w.fmt, -1 if w.axis == -2 else -2)


def block_scales(w: QArray) -> jax.Array:
  """float32 [K / block, N] block scales, without NVFP4's global."""
  s = w.scales.astype(jnp.int32)
  if w.fmt.name == "mxfp4":
    return jnp.where(s == 255, jnp.nan, exp2i(jnp.clip(s - 127, -126, 127)))
  return E4M3.decode(w.scales)


def dequantize_bf16(w: QArray) -> tuple[jax.Array, jax.Array]:
  """-> (bf16 [..., K, N] weight without the global, float32 global: a scalar (1.0 for MXFP4),
  or [E] for per-expert weights [E, K, N], whose NVFP4 global is per expert or one for all)."""
  check_weight(w, grouped=w.codes.ndim == 3)
  if w.axis == -1:
    w = transpose(w)
  codes = unpack_nibbles(jnp.moveaxis(w.codes, -2, -1))  # [..., N, K]
  values = jnp.moveaxis(E2M1.decode(codes), -1, -2)  # [..., K, N]
  block = w.fmt.block_size
  scales = jnp.repeat(block_scales(w), block, axis=-2)
  g = jnp.float32(1.0) if w.global_scale is None else w.global_scale
  if w.codes.ndim == 3:
    return (values * scales).astype(jnp.bfloat16), jnp.broadcast_to(jnp.reshape(g, (-1,)),
                                                                     w.codes.shape[:1])
  return (values * scales).astype(jnp.bfloat16), jnp.reshape(g, ())


def fp4_matmul(x: jax.Array, w: QArray) -> jax.Array:
  """x [..., K] (bf16) @ W [K, N] -> [..., N] bf16, float32 accumulation."""
  w_bf16, g = dequantize_bf16(w)
  y = jnp.dot(x.astype(jnp.bfloat16), w_bf16, preferred_element_type=jnp.float32)
  return (y * g).astype(jnp.bfloat16)


def grouped_fp4_matmul(x: jax.Array, w: QArray, group_sizes: jax.Array) -> jax.Array:
  """MoE expert matmul: x [T, K] (rows sorted by expert, group_sizes[e] rows for expert e) @
  W[e] [K, N] -> [T, N] bf16, float32 accumulation; rows past sum(group_sizes) come out 0."""
  w_bf16, g = dequantize_bf16(w)
  sizes = group_sizes.astype(jnp.int32)
  y = jax.lax.ragged_dot(x.astype(jnp.bfloat16), w_bf16, sizes,
                         preferred_element_type=jnp.float32)
  expert_of_row = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right")
  g_rows = g[jnp.minimum(expert_of_row, g.shape[0] - 1)]  # rows past the groups are zeros
  return (y * g_rows[:, None]).astype(jnp.bfloat16)


def grouped_bf16_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """The bf16 twin of `grouped_fp4_matmul`: x [T, K] @ W[e] [K, N] for w [E, K, N] by
  ragged_dot, float32 accumulation -> [T, N] bf16; rows past sum(group_sizes) come out 0."""
  return jax.lax.ragged_dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                            group_sizes.astype(jnp.int32),
                            preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32).astype(jnp.bfloat16)
