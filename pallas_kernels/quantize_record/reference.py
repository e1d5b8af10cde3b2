"""Pure-jnp reference of quantize-and-record: the quant core's `quantize` and `make_record`.

The rollout quantizes each activation site along its last axis and, for recorded layers, keeps
the record of DESIGN section 5 (one mantissa bit per element, the block scales, NVFP4's row
global). The kernel must emit the same bytes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.quant import QArray, Record, get_format, make_record, quantize

FORMATS = ("mxfp4", "nvfp4")  # activation formats: MXFP4, NVFP4 with a per-row (token) global


def check(x: jax.Array, fmt: str) -> None:
  if fmt not in FORMATS:
    raise ValueError(f"quantize_and_record supports {FORMATS}, got {fmt!r}")
  block = get_format(fmt).block_size
  if x.ndim < 1 or x.shape[-1] % block:
    raise ValueError(f"{fmt} quantizes the last axis in blocks of {block}: it must divide the "
                     f"last dimension of x, shape {x.shape}")


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """Qwen3's RMSNorm along the last axis, the model's arithmetic (`trace_jax.models.layers`):
  the mean of squares in float32, x times its reciprocal square root cast back to x's dtype,
  then times the weight in that dtype."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * xf.astype(x.dtype)


def quantize_and_record(x: jax.Array, fmt: str) -> tuple[QArray, Record]:
  check(x, fmt)
  qa = quantize(x, fmt, axis=-1)
  return qa, make_record(qa)
