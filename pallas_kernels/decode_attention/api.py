"""Dispatch: `decode_attention(q, k, v, mask, implementation="xla" | "pallas")`.

"xla" is the pure-jnp reference and runs anywhere; "pallas" runs the kernel (GPU, or any
backend with interpret=True), differentiable through the reference's VJP (`autodiff`). The
caches are the rollout engine's: [B, S, Kv, Dh] bf16 arrays, or MXFP4 / NVFP4 `QArray`s
quantized along head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.autodiff import reference_vjp
from pallas_kernels.decode_attention import kernel, reference
from pallas_kernels.decode_attention.cache import cache_arrays, cache_format, default_splits
from pallas_kernels.fp4_matmul.kernel import default_decode
from trace_jax.quant import QArray

IMPLEMENTATIONS = ("xla", "pallas")
BACKENDS = ("triton", "mosaic", "jax_triton")  # the kernel of the "pallas" path: Pallas' Triton
# lowering, Mosaic GPU, or the Triton program in Triton's own language through jax-triton
# (`triton_kernel`)
MIN_ROWS = 16  # the smallest matrix-instruction tile: query heads per kv head are padded to a
# power of two of at least this many rows


def _pow2(n: int) -> int:
  return 1 << (n - 1).bit_length()


def supports(slots: int, head_dim: int, block_s: int) -> bool:
  """Whether the compiled kernel takes a cache of these sizes (Triton's tiles are powers of two:
  the query rows are padded to one, head_dim and block_s must be one)."""
  return (block_s >= 16 and _pow2(block_s) == block_s and slots % block_s == 0
          and head_dim >= 32 and _pow2(head_dim) == head_dim)


@reference_vjp(reference.decode_attention)
def decode_attention(q_BxHxDh: jax.Array, k, v, mask_BxS: jax.Array, /, *,
                     implementation: str = "xla", backend: str = "triton", block_s: int = 64,
                     splits: int | None = None, max_concurrent_steps: int = 2,
                     num_warps: int = 4, num_stages: int = 2, decode: str | None = None,
                     interpret: bool = False, poison: bool = False, fold: bool = False,
                     blocks: int = 1, lean: bool = False) -> jax.Array:
  """One query per sequence, q [B, H, Dh], against the caches K, V [B, S, Kv, Dh] at the slots
  where mask [B, S] is true -> [B, H, Dh] bf16 (query head h reads kv head h // (H / Kv)).

  `backend` picks the kernel: "triton" (`kernel.py`; block_s, num_warps, num_stages, decode,
  interpret and poison are its), "jax_triton" (`triton_kernel.py`, the same program in Triton's
  own language; block_s, num_warps, num_stages and decode) or "mosaic" (`mosaic.py`,
  the wgmma kernel, compiled Hopper only; 64-slot blocks, `blocks` of them a pipeline step for
  FP4 caches (one max across the warpgroup and one barrier for all of them),
  max_concurrent_steps copies in flight; `fold`: MXFP4 decoded with the scales folded, one
  multiply a pair of values, `mosaic.FOLD_REF`; `lean`: FP4 caches decoded with fewer
  registers live for less overlap, `mosaic._body`). `decode`
  ("asm" | "bits") picks how the Triton kernel unpacks FP4, as in `fp4_matmul`; `splits` how
  many programs share one sequence (default: enough to fill the device)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  reference.check(q_BxHxDh, k, v, mask_BxS)
  if implementation == "xla":
    return reference.decode_attention(q_BxHxDh, k, v, mask_BxS)
  if cache_format(k) != cache_format(v):
    raise ValueError(f"K ({cache_format(k)}) and V ({cache_format(v)}) caches must share a "
                     "format")
  if backend == "jax_triton" and (interpret or poison):
    raise ValueError("the jax_triton backend runs in Triton's interpreter where there is no GPU "
                     "and starts its outputs as NaN there: no interpret or poison argument")
  if backend == "mosaic":
    if interpret or poison:
      raise ValueError("the mosaic backend has no interpret mode and no poisoned outputs: use "
                       "backend='triton' for those")
    from pallas_kernels.decode_attention import mosaic
    return mosaic.decode_attention(q_BxHxDh, k, v, mask_BxS, splits=splits,
                                   max_concurrent_steps=max_concurrent_steps, fold=fold,
                                   blocks=blocks, lean=lean)
  b, h, dh = q_BxHxDh.shape
  s, kv = k.shape[1], k.shape[2]
  if not supports(s, dh, block_s):
    raise ValueError(f"the pallas kernel needs the cache's {s} slots divisible by block_s "
                     f"({block_s}, a power of two >= 16) and head_dim ({dh}) a power of two "
                     ">= 32 (Triton's tiles are powers of two)")
  (fmt, k_arrays), (_, v_arrays) = cache_arrays(k), cache_arrays(v)
  g = h // kv
  rows = max(_pow2(g), MIN_ROWS)
  q = q_BxHxDh.astype(jnp.bfloat16).reshape(b, kv, g, dh)
  if fmt != "bf16":  # head_dim in [even | odd] order, the order of the decoded nibbles
    q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  splits = splits or default_splits(b * kv, s // block_s)
  if (s // block_s) % splits:
    raise ValueError(f"splits ({splits}) must divide the {s // block_s} blocks of {block_s} "
                     "slots")
  if backend == "jax_triton":
    o, m, l = _jax_triton_partials(q, mask_BxS, k_arrays, v_arrays, fmt=fmt, decode=decode,
                                   block_s=block_s, splits=splits, num_warps=num_warps,
                                   num_stages=num_stages)
  else:
    o, m, l = kernel.decode_attention_partials(
        q, mask_BxS.astype(jnp.int8), kernel.valid_end(mask_BxS), k_arrays, v_arrays, fmt=fmt,
        block_s=block_s, splits=splits, num_warps=num_warps, num_stages=num_stages,
        decode=default_decode(decode, interpret), interpret=interpret, poison=poison)
  out = kernel.combine(o, m, l)[:, :, :g]  # NaN here means an unwritten (poisoned) element
  if fmt != "bf16":
    out = jnp.stack([out[..., :dh // 2], out[..., dh // 2:]], axis=-1)
  return out.reshape(b, h, dh).astype(jnp.bfloat16)


def _jax_triton_partials(q, mask_BxS, k_arrays, v_arrays, *, fmt, decode, block_s, splits,
                         num_warps, num_stages):
  """`kernel.decode_attention_partials` by the programs in Triton's own language
  (`triton_kernel.bf16_attention`, `fp4_attention`; `decode` as there, by default "asm" on a
  GPU and "bits" in the interpreter)."""
  from pallas_kernels import triton_call
  b, kv, rows, dh = q.shape
  s = mask_BxS.shape[1]
  kernels = triton_call.load("pallas_kernels.decode_attention.triton_kernel")
  meta = dict(B=b, S=s, KV=kv, ROWS=rows, DH=dh, BLOCK_S=block_s, SLOTS_PER_SPLIT=s // splits,
              SCALE=dh**-0.5)
  if fmt == "bf16":
    fn, caches = kernels.bf16_attention, (*k_arrays, *v_arrays)
  else:
    decode = default_decode(decode, triton_call.interpreted())
    # codes, scales and NVFP4's globals of each cache (MXFP4's scales again: a global unread)
    per = lambda arrays: (*arrays[:2], arrays[2] if fmt == "nvfp4" else arrays[1])
    fn, caches = kernels.fp4_attention, (*per(k_arrays), *per(v_arrays))
    meta.update(NVFP4=fmt == "nvfp4", ASM=decode == "asm")
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return triton_call.call(
      fn, q, mask_BxS.astype(jnp.int8), kernel.valid_end(mask_BxS), *caches,
      out_shape=[f32(splits, b, kv, rows, dh), f32(splits, b, kv, rows), f32(splits, b, kv, rows)],
      grid=(b, kv, splits), num_warps=num_warps, num_stages=num_stages,
      name="triton_decode_attention", **meta)
