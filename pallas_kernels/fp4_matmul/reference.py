"""Pure-jnp reference of the FP4 matmul: y = x @ W, W packed FP4 along K with block scales.

The kernel's numerics, written plainly, and the rollout engine's XLA path exactly: the weight
dequantizes as `trace_jax.quant.dequantize` computes it, rounded to bf16 (MXFP4: E2M1 x a power
of two, exact; NVFP4: E2M1 x (E4M3 x the global) in float32, then rounded to bf16), and the
products accumulate in float32. The kernel differs from this only in the order of the sums.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp4_matmul.layout import TiledFP4, untile
from trace_jax.quant import QArray, dequantize


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


def dequantize_bf16(w: QArray | TiledFP4) -> jax.Array:
  """-> the bf16 [..., K, N] weight (from a K-major or a tiled one too), NVFP4's global (per
  tensor, per expert or one for all experts) folded into each value before the rounding to
  bf16."""
  if isinstance(w, TiledFP4):
    w = untile(w)
  check_weight(w, grouped=w.codes.ndim == 3)
  return dequantize(transpose(w) if w.axis == -1 else w).astype(jnp.bfloat16)


def fp4_matmul(x: jax.Array, w: QArray | TiledFP4) -> jax.Array:
  """x [..., K] (bf16) @ W [K, N] -> [..., N] bf16, float32 accumulation."""
  y = jnp.dot(x.astype(jnp.bfloat16), dequantize_bf16(w), preferred_element_type=jnp.float32)
  return y.astype(jnp.bfloat16)


def grouped_fp4_matmul(x: jax.Array, w: QArray | TiledFP4, group_sizes: jax.Array,
                       rows_in: jax.Array | None = None,
                       rows_out: jax.Array | None = None, slots=None) -> jax.Array:
  """MoE expert matmul: x [T, K] (rows sorted by expert, group_sizes[e] rows for expert e) @
  W[e] [K, N] -> [T, N] bf16, float32 accumulation; rows past sum(group_sizes) come out 0.
  rows_in / rows_out: the rows sorted by expert are x[rows_in], and the output is the sorted
  rows' y[rows_out] (the MoE dispatch's gathers, which the kernels compose with their own).
  `slots`, the same rows per slot (`api.grouped_fp4_matmul`), changes nothing here."""
  return grouped_bf16_matmul(x, dequantize_bf16(w), group_sizes, rows_in, rows_out)


def grouped_bf16_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                        rows_in: jax.Array | None = None,
                        rows_out: jax.Array | None = None, slots=None) -> jax.Array:
  """The bf16 twin of `grouped_fp4_matmul`: x [T, K] @ W[e] [K, N] for w [E, K, N] by
  ragged_dot, float32 accumulation -> [T, N] bf16; rows past sum(group_sizes) come out 0."""
  x = x if rows_in is None else x[rows_in]
  y = jax.lax.ragged_dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                         group_sizes.astype(jnp.int32),
                         preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  return y if rows_out is None else y[rows_out]


def bf16_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                 preferred_element_type=jnp.float32).astype(jnp.bfloat16)
