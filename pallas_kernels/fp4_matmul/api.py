"""Dispatch: `fp4_matmul(x, w, implementation="xla" | "pallas")`, its grouped form, bf16 twins.

"xla" is the pure-jnp reference and runs anywhere; "pallas" runs the kernel (GPU, or any
backend with interpret=True). All return bf16; the plain forms accept any leading dims on x,
the grouped ones x [T, K] with its rows sorted by expert, or any rows of x with the gathers
that sort them and take the output back (`rows_in`, `rows_out`), which the kernels compose
with the gathers of their own tiling so that the sorted rows are never written out.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.autodiff import reference_vjp
from pallas_kernels.fp4_matmul import kernel, mosaic, reference
from pallas_kernels.fp4_matmul.layout import TiledFP4, untile
from pallas_kernels.fp4_matmul.tiling import default_splits, place_rows, sorted_rows
from trace_jax.quant import QArray

IMPLEMENTATIONS = ("xla", "pallas")
BACKENDS = ("triton", "jax_triton")  # the Triton kernels': Pallas' Triton lowering, or Triton's
# own language through jax-triton (the bf16 kernels, and the FP4 dot kernel on a [K, N] weight)
VARIANTS = ("dot", "gemv")
# up to this many rows the float32 multiply-add kernel would be the default: 0, since on the H200
# it measured no faster than the dot kernel at M = 1 and 2x slower at M = 4 (BENCHMARKS.md)
GEMV_MAX_ROWS = 0


def _check_impl(implementation: str) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")


def _rows(x):
  lead = x.shape[:-1]
  return x.reshape(math.prod(lead), x.shape[-1]), lead


def _pad_rows(x2, block_m):
  m = x2.shape[0]
  mp = -(-m // block_m) * block_m
  return jnp.pad(x2, ((0, mp - m), (0, 0))), m


def _wgmma(w, implementation: str, interpret: bool) -> bool:
  """Whether a tiled weight runs the Mosaic GPU (wgmma) kernel: compiled on a Hopper GPU. The
  XLA path, interpret mode and other GPUs take the packed weight back (`untile`)."""
  return isinstance(w, TiledFP4) and implementation == "pallas" and not interpret and (
      mosaic.available())


def _check_backend(backend: str, interpret: bool, poison: bool) -> None:
  """The Triton kernels' `backend` (BACKENDS); jax_triton takes no interpret or poison."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if backend == "jax_triton" and (interpret or poison):
    raise ValueError("the jax_triton backend runs in Triton's interpreter where there is no GPU "
                     "and starts its outputs as NaN there: no interpret or poison argument")


def _jax_triton_bf16(x2, w, tile_expert=None, *, block_m, block_n, block_k, splits, num_warps,
                     num_stages, interpret, poison):
  """`kernel.bf16_matmul_partials` (or, given tile_expert, `grouped_bf16_partials`) by the
  program in Triton's own language (`triton_kernel.bf16_matmul`)."""
  from pallas_kernels import triton_call
  del interpret, poison  # refused by _check_backend
  m, k = x2.shape
  n = w.shape[-1]
  grouped = tile_expert is not None
  tiles = tile_expert if grouped else jnp.zeros((1,), jnp.int32)
  kernels = triton_call.load("pallas_kernels.fp4_matmul.triton_kernel")
  (out,) = triton_call.call(
      kernels.bf16_matmul, x2, w, tiles.astype(jnp.int32),
      out_shape=[jax.ShapeDtypeStruct((splits, m, n), jnp.float32)],
      grid=(n // block_n, m // block_m, splits), num_warps=num_warps, num_stages=num_stages,
      name="triton_bf16_grouped" if grouped else "triton_bf16_matmul", M=m, K=k, N=n,
      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, K_PER_SPLIT=k // splits,
      GROUPED=grouped)
  return out


def _jax_triton_fp4(xe, xo, codes, scales, global_scale, tile_expert=None, *, fmt, block_m,
                    block_n, splits, rows, num_warps, num_stages, decode):
  """`kernel.fp4_matmul_partials` (or, given tile_expert, `grouped_fp4_partials`) by the program
  in Triton's own language (`triton_kernel.fp4_matmul`; `decode` as there, by default "asm" on
  a GPU and "bits" in the interpreter)."""
  from pallas_kernels import triton_call
  decode = kernel.default_decode(decode, triton_call.interpreted())
  m, k2 = xe.shape
  n = codes.shape[-1]
  grouped = tile_expert is not None
  g = kernel._globals(global_scale)
  if grouped and g.shape[0] == 1:
    g = jnp.broadcast_to(g, codes.shape[:1])
  tiles = tile_expert if grouped else jnp.zeros((1,), jnp.int32)
  kernels = triton_call.load("pallas_kernels.fp4_matmul.triton_kernel")
  (out,) = triton_call.call(
      kernels.fp4_matmul, xe, xo, codes, scales, g, tiles.astype(jnp.int32),
      out_shape=[jax.ShapeDtypeStruct((splits, m, n), jnp.float32)],
      grid=(n // block_n, m // block_m, splits), num_warps=num_warps, num_stages=num_stages,
      name="triton_fp4_grouped" if grouped else "triton_fp4", M=m, K2=k2, N=n,
      BLOCK_M=block_m, BLOCK_N=block_n, ROWS=rows, ROWS_PER_SPLIT=k2 // splits,
      NVFP4=fmt == "nvfp4", ASM=decode == "asm", GROUPED=grouped)
  return out


@reference_vjp(reference.fp4_matmul)
def fp4_matmul(x: jax.Array, w: QArray | TiledFP4, /, *, implementation: str = "xla",
               block_m: int = 16, block_n: int = 64, splits: int | None = None, rows: int = 32,
               num_warps: int = 4, num_stages: int = 4, decode: str | None = None,
               variant: str | None = None, interpret: bool = False,
               poison: bool = False, fold: bool = False, backend: str = "triton") -> jax.Array:
  """x [..., K] @ W [K, N] (MXFP4 or per-tensor NVFP4, packed along K) -> [..., N] bf16.

  `w` is either [K, N] quantized along axis 0, or its K-major transpose [N, K] quantized along
  axis 1 (`reference.transpose(w)`, the layout of a [out, in] linear weight), which the pallas
  implementation multiplies with the "kmajor" kernel (the decoded weight in registers), or
  either in the Mosaic GPU kernel's layout (`layout.tile`): compiled on a Hopper GPU, pallas
  then runs `mosaic.fp4_matmul` (faster; its own tiles, `splits` passed on, the Triton tile
  arguments unused), elsewhere the packed weight taken back.

  `decode` picks how the kernel unpacks FP4: "asm" (PTX, compiled GPU kernels; the default
  there) or "bits" (jnp integer operations; the default in interpret mode). `variant`: "dot"
  (matrix instructions over block_m-row tiles) or "gemv" (float32 multiply-adds, M <= 8; the
  default for M <= GEMV_MAX_ROWS). `fold`: the Mosaic kernel decodes an MXFP4 weight with its
  scales folded (`mosaic._body`: one multiply a pair of values; the same outputs); the other
  paths compute as they do. `backend`: the Triton kernel's (`BACKENDS`; "jax_triton" runs the
  dot kernel on the [K, N] weight in Triton's own language, `triton_kernel.fp4_matmul`)."""
  _check_impl(implementation)
  _check_backend(backend, interpret, poison)
  if _wgmma(w, implementation, interpret):
    return mosaic.fp4_matmul(x, w, splits=splits, fold=fold and w.kernel_fmt == "mxfp4")
  w = untile(w) if isinstance(w, TiledFP4) else w
  reference.check_weight(w)
  k, n = w.shape[::-1] if w.axis == -1 else w.shape
  if x.shape[-1] != k:
    raise ValueError(f"x has {x.shape[-1]} features, the weight {w.shape} expects {k}")
  if implementation == "xla":
    return reference.fp4_matmul(x, w)
  if backend == "jax_triton" and (w.axis == -1 or variant == "gemv"):
    raise ValueError("the jax_triton backend runs the dot kernel on the [K, N] weight: no "
                     "K-major weight (reference.transpose converts), no 'gemv' variant")
  if w.axis == -1:
    if variant not in (None, "dot"):
      raise ValueError(f"variant {variant!r} takes the [K, N] weight; a K-major weight runs the "
                       "dot kernel (reference.transpose converts between the two)")
    return _kmajor(x, w, k, n, block_m=block_m, block_n=block_n, splits=splits, rows=rows,
                   num_warps=num_warps, num_stages=num_stages, decode=decode,
                   interpret=interpret, poison=poison)
  if n % block_n or k % (2 * rows) or rows % 16:
    raise ValueError(f"the pallas kernel needs N ({n}) divisible by block_n ({block_n}), rows "
                     f"({rows}) a multiple of 16 and K ({k}) divisible by 2 x rows")
  x2, lead = _rows(x.astype(jnp.bfloat16))
  variant = variant or ("gemv" if x2.shape[0] <= GEMV_MAX_ROWS else "dot")
  if variant not in VARIANTS or (variant == "gemv" and x2.shape[0] > 8):
    raise ValueError(f"variant must be one of {VARIANTS} ('gemv' for at most 8 rows), got "
                     f"{variant!r} for {x2.shape[0]} rows")
  fmt = "mxfp4" if w.fmt.name == "mxfp4" else "nvfp4"
  steps = (k // 2) // rows
  if variant == "gemv":
    decode = kernel.default_decode(decode, interpret)
    x2, m = _pad_rows(x2, 1 << (x2.shape[0] - 1).bit_length())  # a power of two of rows
    splits = splits or default_splits(1, n // block_n, steps)
    partials = kernel.fp4_gemv_partials(
        x2[:, 0::2].T, x2[:, 1::2].T, w.codes, w.scales, w.global_scale, fmt=fmt,
        block_n=block_n, splits=splits, rows=rows, num_warps=num_warps, num_stages=num_stages,
        decode=decode, interpret=interpret, poison=poison)
    return _finish(partials, m, lead, n)
  x2, m = _pad_rows(x2, block_m)
  splits = splits or default_splits(x2.shape[0] // block_m, n // block_n, steps)
  tiles = dict(fmt=fmt, block_m=block_m, block_n=block_n, splits=splits, rows=rows,
               num_warps=num_warps, num_stages=num_stages)
  if backend == "jax_triton":
    partials = _jax_triton_fp4(x2[:, 0::2], x2[:, 1::2], w.codes, w.scales, w.global_scale,
                               decode=decode, **tiles)
  else:
    partials = kernel.fp4_matmul_partials(
        x2[:, 0::2], x2[:, 1::2], w.codes, w.scales, w.global_scale,
        decode=kernel.default_decode(decode, interpret), interpret=interpret, poison=poison,
        **tiles)
  return _finish(partials, m, lead, n)


def _kmajor(x, w, k, n, *, block_m, block_n, splits, rows, num_warps, num_stages, decode,
            interpret, poison):
  if n % block_n or k % (2 * rows) or rows % 16:
    raise ValueError(f"the pallas kernel needs N ({n}) divisible by block_n ({block_n}), rows "
                     f"({rows}) a multiple of 16 and K ({k}) divisible by 2 x rows")
  x2, lead = _rows(x.astype(jnp.bfloat16))
  x2, m = _pad_rows(x2, block_m)
  steps = (k // 2) // rows
  splits = splits or default_splits(x2.shape[0] // block_m, n // block_n, steps)
  partials = kernel.fp4_kmajor_partials(
      x2[:, 0::2].T, x2[:, 1::2].T, w.codes, w.scales, w.global_scale,
      fmt="mxfp4" if w.fmt.name == "mxfp4" else "nvfp4", block_m=block_m, block_n=block_n,
      splits=splits, rows=rows, num_warps=num_warps, num_stages=num_stages,
      decode=kernel.default_decode(decode, interpret), interpret=interpret, poison=poison)
  return _finish(jnp.swapaxes(partials, 1, 2), m, lead, n)


def _check_grouped(name, x, w_shape, group_sizes, rows_in=None, rows_out=None):
  e, k, _ = w_shape
  if x.ndim != 2 or x.shape[-1] != k or group_sizes.shape != (e,):
    raise ValueError(f"{name} takes x [T, {k}] and group_sizes [{e}] for weights {w_shape}, "
                     f"got x {x.shape} and group_sizes {group_sizes.shape}")
  for arg, a in (("rows_in", rows_in), ("rows_out", rows_out)):
    if a is not None and (a.ndim != 1 or not jnp.issubdtype(a.dtype, jnp.integer)):
      raise ValueError(f"{name} takes {arg} as a vector of row indices, got {a.dtype} "
                       f"{a.shape}")


def _group_tiles(x, group_sizes, block_m, rows_in=None, rows_out=None, slots=None):
  """Rows sorted by expert (x[rows_in]) -> (x2, tile_expert, dest) of `tile_rows` (or, given the
  dispatch's `slots`, `tiling.place_rows`), x2 in bf16 with each group padded to whole
  block_m-row tiles (unused rows zero), dest per output row (rows_out). x2 is one gather from x
  (each padded row's source row, or none), which XLA runs as one pass fused with what the
  kernel's layout asks next; a scatter of the rows was 4x slower on the H200."""
  src, tile_expert, dest = place_rows(group_sizes, sorted_rows(x, rows_in), block_m, rows_in,
                                      rows_out, x.shape[0], slots)
  x2 = jnp.take(x.astype(jnp.bfloat16), src, axis=0, mode="fill", fill_value=0)
  return x2, tile_expert, dest


@reference_vjp(reference.grouped_fp4_matmul)
def grouped_fp4_matmul(x: jax.Array, w: QArray | TiledFP4, group_sizes: jax.Array,
                       rows_in: jax.Array | None = None, rows_out: jax.Array | None = None,
                       slots: tuple[jax.Array, jax.Array] | None = None, /, *,
                       implementation: str = "xla", block_m: int = 16, block_n: int = 64,
                       splits: int | None = None, rows: int = 32, num_warps: int = 4,
                       num_stages: int = 4, decode: str | None = None, interpret: bool = False,
                       poison: bool = False, fold: bool = False,
                       backend: str = "triton") -> jax.Array:
  """The MoE expert matmul: x [T, K], rows sorted by expert (group_sizes[e] rows for expert e,
  as `jax.lax.ragged_dot` takes them) @ W[e] [K, N] for per-expert FP4 weights w [E, K, N]
  -> [T, N] bf16; rows past sum(group_sizes) come out zero. With rows_in [R] and rows_out [S]
  (the MoE dispatch: tokens or (token, expert slot) rows in, slots out) it computes
  y[rows_out] for the sorted rows x[rows_in], as `reference.grouped_fp4_matmul` writes it, in
  the kernels' own gathers: the padded tiles are gathered from x and the output from the
  kernel's, each in one pass. `slots` (the dispatch's (expert, input row) of each output row,
  `layers.ExpertRows`): the same rows per slot, which the kernels place with no sort
  (`tiling.tile_slots`; decode-sized dispatches).

  The pallas implementation pads each group to whole block_m-row tiles (`_group_tiles`) and
  runs the dot kernel with each tile's expert read from a small table; the padding tiles past
  the ones in use skip their K loop. Weights in the Mosaic GPU kernel's layout (`layout.tile`)
  run `mosaic.grouped_fp4_matmul` when compiled on a Hopper GPU, as in `fp4_matmul` (`fold`
  and `backend` too)."""
  _check_impl(implementation)
  _check_backend(backend, interpret, poison)
  if _wgmma(w, implementation, interpret):
    return mosaic.grouped_fp4_matmul(x, w, group_sizes, splits=splits, rows_in=rows_in,
                                     rows_out=rows_out, slots=slots,
                                     fold=fold and w.kernel_fmt == "mxfp4")
  w = untile(w) if isinstance(w, TiledFP4) else w
  reference.check_weight(w, grouped=True)
  _check_grouped("grouped_fp4_matmul", x, w.shape, group_sizes, rows_in, rows_out)
  if implementation == "xla":
    return reference.grouped_fp4_matmul(x, w, group_sizes, rows_in, rows_out)
  _, k, n = w.shape
  if n % block_n or k % (2 * rows) or rows % 16:
    raise ValueError(f"the pallas kernel needs N ({n}) divisible by block_n ({block_n}), rows "
                     f"({rows}) a multiple of 16 and K ({k}) divisible by 2 x rows")
  x2, tile_expert, dest = _group_tiles(x, group_sizes, block_m, rows_in, rows_out, slots)
  m = x2.shape[0]
  splits = splits or default_splits(m // block_m, n // block_n, (k // 2) // rows)
  tiles = dict(fmt="mxfp4" if w.fmt.name == "mxfp4" else "nvfp4", block_m=block_m,
               block_n=block_n, splits=splits, rows=rows, num_warps=num_warps,
               num_stages=num_stages)
  if backend == "jax_triton":
    partials = _jax_triton_fp4(x2[:, 0::2], x2[:, 1::2], w.codes, w.scales, w.global_scale,
                               tile_expert, decode=decode, **tiles)
  else:
    partials = kernel.grouped_fp4_partials(
        x2[:, 0::2], x2[:, 1::2], w.codes, w.scales, tile_expert, w.global_scale,
        decode=kernel.default_decode(decode, interpret), interpret=interpret, poison=poison,
        **tiles)
  y = jnp.sum(partials, axis=0)  # NaN here means an unwritten (poisoned) element
  return y.astype(jnp.bfloat16).at[dest].get(mode="fill", fill_value=0)


def _finish(partials, m, lead, n):
  y = jnp.sum(partials, axis=0)[:m]  # NaN here means an unwritten (poisoned) element
  return y.astype(jnp.bfloat16).reshape(*lead, n)


@reference_vjp(reference.bf16_matmul)
def bf16_matmul(x: jax.Array, w: jax.Array, /, *, implementation: str = "xla", block_m: int = 16,
                block_n: int = 128, block_k: int = 64, splits: int | None = None,
                num_warps: int = 4, num_stages: int = 3, interpret: bool = False,
                poison: bool = False, backend: str = "triton") -> jax.Array:
  """x [..., K] @ W [K, N] in bf16 with float32 accumulation, by XLA or the kernel: `backend`
  "triton" (Pallas' Triton lowering) or "jax_triton" (the same program in Triton's own language,
  `triton_kernel`; Triton's interpreter where there is no GPU, its outputs started as NaN there:
  no interpret or poison argument)."""
  _check_impl(implementation)
  k, n = w.shape
  if implementation == "xla":
    return reference.bf16_matmul(x, w)
  _check_backend(backend, interpret, poison)
  if n % block_n or k % block_k:
    raise ValueError(f"the pallas kernel needs N ({n}) divisible by block_n ({block_n}) and K "
                     f"({k}) divisible by block_k ({block_k})")
  x2, lead = _rows(x.astype(jnp.bfloat16))
  x2, m = _pad_rows(x2, block_m)
  splits = splits or default_splits(x2.shape[0] // block_m, n // block_n, k // block_k)
  partials = (_jax_triton_bf16 if backend == "jax_triton" else kernel.bf16_matmul_partials)(
      x2, w.astype(jnp.bfloat16), block_m=block_m, block_n=block_n, block_k=block_k,
      splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret,
      poison=poison)
  return jnp.sum(partials, axis=0)[:m].astype(jnp.bfloat16).reshape(*lead, n)


@reference_vjp(reference.grouped_bf16_matmul)
def grouped_bf16_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                        rows_in: jax.Array | None = None, rows_out: jax.Array | None = None,
                        slots: tuple[jax.Array, jax.Array] | None = None, /, *,
                        implementation: str = "xla", block_m: int = 16, block_n: int = 128,
                        block_k: int = 64, splits: int | None = None, num_warps: int = 4,
                        num_stages: int = 3, interpret: bool = False,
                        poison: bool = False, backend: str = "triton") -> jax.Array:
  """The bf16 twin of `grouped_fp4_matmul`: x [T, K], rows sorted by expert, @ W[e] [K, N] for
  per-expert bf16 weights w [E, K, N] -> [T, N] bf16, float32 accumulation; rows past
  sum(group_sizes) come out zero; rows_in / rows_out / slots as there. "xla" is
  `jax.lax.ragged_dot`; "pallas" pads the groups to block_m-row tiles as the FP4 form does and
  runs the bf16 kernel of `backend`, as `bf16_matmul`'s."""
  _check_impl(implementation)
  if getattr(w, "ndim", None) != 3:
    raise ValueError(f"grouped_bf16_matmul expects per-expert weights [E, K, N], got "
                     f"{type(w).__name__} {getattr(w, 'shape', None)}")
  _check_grouped("grouped_bf16_matmul", x, w.shape, group_sizes, rows_in, rows_out)
  if implementation == "xla":
    return reference.grouped_bf16_matmul(x, w, group_sizes, rows_in, rows_out)
  _, k, n = w.shape
  if n % block_n or k % block_k:
    raise ValueError(f"the pallas kernel needs N ({n}) divisible by block_n ({block_n}) and K "
                     f"({k}) divisible by block_k ({block_k})")
  _check_backend(backend, interpret, poison)
  x2, tile_expert, dest = _group_tiles(x, group_sizes, block_m, rows_in, rows_out, slots)
  splits = splits or default_splits(x2.shape[0] // block_m, n // block_n, k // block_k)
  partials = (_jax_triton_bf16 if backend == "jax_triton" else kernel.grouped_bf16_partials)(
      x2, w.astype(jnp.bfloat16), tile_expert, block_m=block_m, block_n=block_n,
      block_k=block_k, splits=splits, num_warps=num_warps, num_stages=num_stages,
      interpret=interpret, poison=poison)
  y = jnp.sum(partials, axis=0).astype(jnp.bfloat16)
  return y.at[dest].get(mode="fill", fill_value=0)
