"""The rollout path's operations, passed in: `XlaOps` computes everything with XLA; a kernel
backend (`pallas_kernels.dispatch.KernelOps`) takes what its kernels take and leaves the rest
to XLA. The model never chooses or imports a kernel: the engine hands its path one of these,
built once from the config (`pallas_kernels.dispatch.make_ops`).

Each op returns None where the backend does not compute it, and the path then computes it
with XLA (`linear`, `experts`, `attention`, `quantize`); `weight_layout` is applied once by
the weight sync (the layout the backend's matmuls read), `dense` turns any weight of that
layout back into the array XLA multiplies by.
"""

from __future__ import annotations

import jax

from trace_jax import quant
from trace_jax.quant import QArray


class XlaOps:
  """Every rollout operation by XLA (the reference the kernels are checked against)."""

  name = "xla"
  # groups of projections of one input the weight sync packs as one weight (`Fused`), which
  # one matmul computes: none here (XLA's rollout is the reference, weight by weight)
  fuse: tuple[tuple[str, ...], ...] = ()

  def weight_layout(self, w):
    return w

  def dense(self, w) -> jax.Array:
    """A rollout weight as a dense array (packed weights dequantized to float32)."""
    return quant.dequantize(w) if isinstance(w, QArray) else w

  def linear(self, x, w, xq=None):
    """x [..., K] @ w [K, N], or None (then XLA's dot computes it). xq: x's QArray where the
    path quantized x (x its dequantization), for kernels that take the codes."""
    return None

  def experts(self, x_RxD, w, rows, xq=None):
    """x's rows through their experts' w [E, K, N] as `layers.grouped_rows` computes them
    (`rows`: a `layers.ExpertRows`), or None; xq: x's QArray as in `linear`, its rows x's."""
    return None

  def attention(self, q_BxHxDh, k, v, mask_BxS):
    return None

  def quantize(self, x, fmt, values: bool = False, rms_norm=None):
    """x quantized along its last axis and its record, (QArray, Record), by a fused kernel,
    or None (then the quant core does it); with `values` also what the codes stand for in x's
    dtype (the values the engine computes with, `quant.dequantize`), (QArray, Record, values).
    With `rms_norm` (w, eps), x's RMSNorm (`layers.rms_norm`) is what is quantized, and it is
    returned after the Record: (QArray, Record, normed x[, values])."""
    return None

  def activation_stats(self, xq) -> dict:
    """Counts of a quantized activation the backend reports ({name: int32 scalar}), summed by
    the engine over layers and steps into the rollout's `stats`."""
    return {}


XLA = XlaOps()
