"""Pure-jnp reference of decode attention: one query per sequence against its KV cache.

The numerics the kernel follows, written plainly: a packed cache dequantizes to bf16 as the
rollout engine's XLA path does (NVFP4's per-(slot, head) global folded into each value before
its rounding to bf16), scores are float32 sums of bf16 products scaled by head_dim^-1/2, masked
slots are left out of the softmax, the probabilities are rounded to bf16 and multiply V with
float32 sums. A sequence with no valid slot attends to nothing and returns zeros. The kernel
differs from this only in the order of the sums (an online softmax over blocks of slots, then
over splits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trace_jax.quant import QArray, dequantize

FORMATS = ("mxfp4", "nvfp4")


def check(q_BxHxDh, k, v, mask_BxS) -> None:
  """Shapes, formats and layouts the kernels take; a ValueError naming what is off."""
  if isinstance(k, QArray) != isinstance(v, QArray):
    raise ValueError(f"K and V must both be packed or both be arrays, got {type(k).__name__} "
                     f"and {type(v).__name__}")
  for name, c in (("K", k), ("V", v)):
    if len(c.shape) != 4:
      raise ValueError(f"the {name} cache must be [batch, slots, kv_heads, head_dim], got "
                       f"shape {c.shape}")
    if isinstance(c, QArray) and (c.fmt.name not in FORMATS or c.axis != -1):
      raise ValueError(f"a packed {name} cache must be one of {FORMATS} quantized along "
                       f"head_dim (axis -1), got {c.fmt.name} along axis {c.axis}")
  if k.shape != v.shape:
    raise ValueError(f"K {k.shape} and V {v.shape} caches differ in shape")
  b, s, kv, dh = k.shape
  if q_BxHxDh.ndim != 3 or q_BxHxDh.shape[0] != b or q_BxHxDh.shape[2] != dh:
    raise ValueError(f"q must be [batch={b}, heads, head_dim={dh}] for a cache of {k.shape}, "
                     f"got {q_BxHxDh.shape}")
  if q_BxHxDh.shape[1] % kv:
    raise ValueError(f"q's {q_BxHxDh.shape[1]} heads are not a multiple of the cache's {kv} "
                     "kv heads")
  if mask_BxS.shape != (b, s):
    raise ValueError(f"mask must be [batch, slots] = {(b, s)}, got {mask_BxS.shape}")


def as_bf16(c) -> jax.Array:
  return (dequantize(c) if isinstance(c, QArray) else c).astype(jnp.bfloat16)


def decode_attention(q_BxHxDh, k, v, mask_BxS) -> jax.Array:
  """q [B, H, Dh] against caches [B, S, Kv, Dh] (H = Kv x G; query head h reads kv head h // G)
  where mask [B, S] is true -> [B, H, Dh] bf16."""
  b, h, dh = q_BxHxDh.shape
  kv = k.shape[2]
  q = q_BxHxDh.astype(jnp.bfloat16).reshape(b, kv, h // kv, dh)
  s = jnp.einsum("bkgd,bskd->bkgs", q, as_bf16(k), preferred_element_type=jnp.float32)
  s = s * dh**-0.5
  valid = mask_BxS[:, None, None, :]
  s = jnp.where(valid, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(valid, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bkgs,bskd->bkgd", p.astype(jnp.bfloat16), as_bf16(v),
                 preferred_element_type=jnp.float32)
  o = o / jnp.maximum(l, 1e-30)
  return o.reshape(b, h, dh).astype(jnp.bfloat16)
