"""Pallas (Mosaic GPU lowering, Hopper) FP4 matmul: the decoded weight fed to wgmma from registers.

The Triton kernels (`kernel.py`) decode a weight tile in registers and then pass it through
shared memory on its way into the matrix instruction (Triton's layout conversion); on the H200
that pass, not DRAM, limits them to ~25% of the copy bandwidth. Here the weight is the
instruction's A operand, which wgmma reads from registers: with y^T = W^T x^T and the codes
stored K-major ([N, K/2], one weight row per output feature), each warpgroup loads a
[64, 32]-byte tile of codes from shared memory straight into the A operand's register layout,
decodes it there and issues

    acc[64, M] += dec(codes & 15) @ x_e^T[32, M] + dec(codes >> 4) @ x_o^T[32, M]

with x_e, x_o the even and odd K columns of x (B operands in shared memory); a weight tiled in
the "halves" nibble order (`layout.ORDERS`) decodes instead to one A tile in K's order, and x's
own [tokens, 64] tile is the B operand, read transposed, so x needs no split. M, the tokens,
is the instruction's N dimension: padded to 16, 32 or a multiple of 32, up to 256 a call
(longer inputs run in calls of 256); past 32 tokens two chunks are decoded side by side for
64-K instructions (`_body`). A pipeline of bulk copies streams codes, scales and x through
shared memory; the grid is (N / 64 row tiles, K splits), whose float32 partials are summed
outside, as in `kernel.py`.

Numerics: each value decodes to the bf16 XLA's dequantization gives it (MXFP4: E2M1 x 2^e,
exact; NVFP4: E2M1 x (E4M3 x global) in float32, rounded once to bf16); products accumulate in
float32. With `fold` (MXFP4) each value decodes to that bf16 over the weight's 2^(R - 127)
(`layout.fold_reference`), and the accumulator is multiplied by it once, so the outputs are the
same. The weight is stored pre-tiled (`layout.TiledFP4`: [64-row, 32-byte] code tiles and
64-row scale vectors, each contiguous), because Mosaic swizzles only contiguous shared-memory
tiles; the tiling is a layout change made once, when weights are packed.

`bf16_wgmma_partials` is the bf16 twin: the same grid and pipeline on a K-major bf16 weight,
both operands of wgmma read from shared memory; `grouped_bf16_wgmma_partials` the grouped one,
on the [E, K, N] expert weights as the engine holds them.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import numpy as np

from pallas_kernels.fp4_matmul.kernel import (e2m1_bf16, e2m1_nibbles_asm, e4m3_f32,
                                              fold_scale_bf16)
from pallas_kernels.fp4_matmul.layout import CHUNK, ORDERS, ROWS, TiledFP4
from pallas_kernels.fp4_matmul.tiling import default_splits, place_rows, sorted_rows

# one 16-bit pair of codes bytes -> the bf16 pairs of its low and of its high nibbles, scaled
E2M1_NIBBLES_ASM = {"mxfp4": e2m1_nibbles_asm(), "nvfp4": e2m1_nibbles_asm(f32_scales=True)}
# the same for MXFP4 with the 2^126 in the scale (`kernel.fold_scale_bf16`): one multiply a pair
FOLDED_NIBBLES_ASM = e2m1_nibbles_asm(folded=True)
TOKEN_GROUP = 32  # tokens (wgmma N) an accumulator: bf16 rows of 64 bytes, K steps of 32
MAX_M = 256  # tokens a dense call multiplies at once (accumulators: M / 2 registers a thread)


def _scale_row(s_u8, fmt, g):
  """A row of scale bytes -> MXFP4: bf16 2^(s - 127) (the byte is bf16's exponent field);
  NVFP4: float32 E4M3(s) x g, the factor XLA's dequantization multiplies each value by."""
  if fmt == "mxfp4":
    return jax.lax.bitcast_convert_type(s_u8.astype(jnp.uint16) << 7, jnp.bfloat16)
  return e4m3_f32(s_u8) * g


def _decode(codes16, scale, fmt):
  """uint16 nibbles and their scale tile -> bf16 values: E2M1 x 2^e exactly (MXFP4), or
  bf16(E2M1 x (E4M3 x g)) rounded once from float32 (NVFP4, as XLA dequantizes)."""
  if fmt == "mxfp4":
    return e2m1_bf16(codes16) * scale
  return (e2m1_bf16(codes16).astype(jnp.float32) * scale).astype(jnp.bfloat16)


def interleave_column_tiles(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
  """Two WGMMA-layout register arrays of [64, C] tiles (registers_shape (1, C/8, 1, 1, 2, ...):
  axis 1 the 8-column tiles) -> the register array of their [64, 2C] tile with column tiles
  lo_0, hi_0, lo_1, hi_1, ...: the "halves" order's A operand in K's order."""
  return np.stack([lo, hi], axis=2).reshape(lo.shape[0], 2 * lo.shape[1], *lo.shape[2:])


def _decode_asm(tiles, rows, fmt, order="pairs", folded=False):
  """uint8 codes tiles ([64, CHUNK] each, consecutive along K) in the A operand's layout and
  the scale rows of their blocks ([64] each, `_scale_row`) -> the bf16 values of the low and of
  the high nibbles, [64, CHUNK x tiles] each (the tiles side by side), by the PTX of the Triton
  kernels, both nibbles of a pair of bytes in one asm (`E2M1_NIBBLES_ASM`: ~3.5 instructions a
  value, exact). Each register holds two codes bytes of one row; which block's scale it takes
  is fixed by its place in the layout (WGMMA: [64, 8]-column tiles, rows r and r + 8 a thread),
  so no select. Codes in the "halves" order (`layout.ORDERS`) give instead one [64, 2 x CHUNK x
  tiles] tile of the values in K's order: a codes column tile's low-nibble registers are the
  bf16 column tile 2j's, its high-nibble ones 2j + 1's (nothing moves but register names).
  `folded` (MXFP4): the rows are `kernel.fold_scale_bf16`'s multipliers and the decode is
  `FOLDED_NIBBLES_ASM` (the values come out over the fold's 2^(ref - 127))."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm

  if folded and fmt != "mxfp4":
    raise ValueError(f"the folded decode takes MXFP4 codes, got {fmt}")
  wgmma = plgpu.Layout.WGMMA
  out = plgpu.ShapeDtypeStruct((64, CHUNK * len(tiles)), jnp.bfloat16, wgmma)
  both_out = plgpu.ShapeDtypeStruct((64, 2 * CHUNK * len(tiles)), jnp.bfloat16, wgmma)
  cols_per_block = (16 if fmt == "mxfp4" else 8) // 8  # [64, 8] column tiles a block

  @plgpu.inline_mgpu(arg_types=(tuple(wgmma for _ in tiles),
                                tuple(wgmma.reduce(1) for _ in rows)),
                     return_type=(out, out) if order == "pairs" else both_out)
  def decode(_, tiles, rows):
    i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    # rows' registers: [rows r, r + 8] of the thread, one value each
    scale_regs = [[mgpu_utils.bitcast(r, i16 if fmt == "mxfp4" else i32)
                   for r in row.registers.flat] for row in rows]
    if fmt == "mxfp4":  # the bf16 scale in both halves of a pair
      scale_regs = [[arith.ori(arith.extui(i32, r), arith.shli(arith.extui(i32, r),
                                                               mgpu_utils.c(16, i32)))
                     for r in regs] for regs in scale_regs]
    asm = FOLDED_NIBBLES_ASM if folded else E2M1_NIBBLES_ASM[fmt]
    constraints = "=r,=r,r,r" if fmt == "mxfp4" else "=r,=r,r,r,r"
    struct = llvm.StructType.get_literal([i32, i32])
    parts = {"lo": [], "hi": []}
    for t, codes in enumerate(tiles):
      regs = {"lo": np.empty_like(codes.registers), "hi": np.empty_like(codes.registers)}
      for idx, reg in np.ndenumerate(codes.registers):
        col_tile, row_half = idx[1], idx[4]  # registers_shape (1, C/8, 1, 1, 2, 1, 1, 1, 1)
        s = scale_regs[(t * (CHUNK // 8) + col_tile) // cols_per_block][row_half]
        code = arith.extui(i32, mgpu_utils.bitcast(reg, i16))
        operands = [code, s] if fmt == "mxfp4" else [code, s, s]
        both = llvm.inline_asm(struct, operands, asm, constraints)
        for i, nibble in enumerate(("lo", "hi")):
          regs[nibble][idx] = mgpu_utils.bitcast(llvm.extractvalue(i32, both, [i]), pair)
      for nibble in parts:
        parts[nibble].append(regs[nibble])
    lo, hi = (np.concatenate(parts[nibble], axis=1) for nibble in ("lo", "hi"))
    if order == "halves":
      return mgpu.FragmentedArray(_registers=interleave_column_tiles(lo, hi),
                                  _layout=tiles[0].layout, _is_signed=None)
    return tuple(mgpu.FragmentedArray(_registers=r, _layout=tiles[0].layout, _is_signed=None)
                 for r in (lo, hi))

  return decode(tuple(tiles), tuple(rows))


def _load(ref, layout):
  """plgpu.load of a whole (already indexed) ref: jax 0.10 takes the index as an argument,
  later versions take it from the ref alone."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
    return plgpu.load(ref, (), layout=layout)
  return plgpu.load(ref, layout=layout)


def _body(xe_gmem, xo_gmem, codes_gmem, scales_gmem, g_gmem, *rest, fmt, block_n, block_k2,
          steps, max_concurrent_steps, decode, tile_m=None, order="pairs", row_tiles=1,
          out_rows=False, fold=False):
  """One [64, M] tile of y^T (dense), or with `tile_m` and a table (`rest` = tile_expert, out)
  one [64, tile_m] tile of the grouped product: token tile t of x times expert tile_expert[t]'s
  weight (codes and scales with the experts' row tiles stacked, [E x N/64, ...], globals [E]);
  tiles past the table's last entry (the tiles in use) do nothing. `row_tiles` (the "halves"
  order): that many consecutive 64-row tiles of y^T a block, each with its own accumulator,
  all from the one x tile the pipeline brings (x read once for them all). `out_rows`: the tile
  goes out as y's [tokens, 64] (`_store_rows`), not y^T's.

  Tokens are wgmma's N. x's rows in shared memory are swizzled by their width in bytes (up to
  128), and an instruction must take a whole swizzle's worth of K values: 32-token rows (64
  bytes) let one decoded chunk (32 K values) go in alone; 64 tokens and more (128-byte rows)
  need 64, so two chunks are decoded side by side. The "jnp" decode instead takes the tokens in
  groups of 32, each group with its own accumulator. Either way a chunk is decoded once for all
  the tokens.

  With codes in the "halves" order (`layout.ORDERS`; "asm" decode only) xe_gmem is x itself,
  [M, K] (xo_gmem unused): a chunk decodes to one [64, 64] A tile in K's order, and the
  instruction's B is x's [tokens, 64] tile of shared memory read transposed (K-major, one
  128-byte swizzle a row), for every M in one accumulator.

  `fold` (MXFP4, "asm" decode): the decode's 2^126 folded into each block's multiplier against
  the weight's reference R (`layout.fold_reference`, in g_gmem as 2^(R - 127)): one bf16x2
  multiply a pair of values instead of two, and the accumulator times 2^(R - 127) once, before
  it is stored."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  *table, out_gmem = rest
  ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
  ti = jax.lax.axis_index("t") if table else 0
  halves = order == "halves"
  m = tile_m or xe_gmem.shape[0 if halves else 1]
  # 32 K values an instruction while x's rows are at most 64 bytes (16 or 32 tokens; the
  # "jnp" decode at any M, in groups of 32 tokens), else 64: two chunks decoded side by side
  wide = m > TOKEN_GROUP and decode == "asm" and block_k2 % (2 * CHUNK) == 0
  k_tiles = 2 if wide else 1  # code tiles an instruction
  width = m if wide or halves else min(m, TOKEN_GROUP)  # tokens an accumulator
  groups = m // width
  per_scale = 16 if fmt == "mxfp4" else 8  # packed columns per scale
  wgmma = plgpu.Layout.WGMMA
  row_l = wgmma.reduce(1)  # a [64] vector, one value per row of the A operand

  wi = ni  # the weight's row tile (of `row_tiles` tiles); grouped weights are
  # [E x N/64, ...], expert-major
  if table:
    expert = table[0][ti]
    wi = expert * jax.lax.axis_size("n") + ni
    g = g_gmem[expert] if fmt == "nvfp4" or fold else None
  else:
    g = g_gmem[0] if fmt == "nvfp4" or fold else None

  def scale_row(s):
    """A row of scale bytes -> what the decode multiplies by (`_scale_row`, or folded against
    the reference g = 2^(R - 127))."""
    return fold_scale_bf16(s, g) if fold else _scale_row(s, fmt, g)

  def scale_tile(scales_smem, j, shape):
    """The scale of every element of chunk j's [64, CHUNK] codes, in the A layout."""
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=wgmma) // per_scale
    tile = None
    for b in range(CHUNK // per_scale):
      row = _load(scales_smem.at[0, j * (CHUNK // per_scale) + b], row_l)
      row = plgpu.layout_cast(_scale_row(row, fmt, g), row_l)
      full = plgpu.layout_cast(jax.lax.broadcast_in_dim(row, shape, [0]), wgmma)
      tile = full if tile is None else jnp.where(col == b, full, tile)
    return tile

  def step_halves(_, x_smem, codes_smem, scales_smem, accs):
    per = CHUNK // per_scale
    for j in range(block_k2 // CHUNK):
      x_t = plgpu.transpose_ref(x_smem.at[:, pl.ds(j * 2 * CHUNK, 2 * CHUNK)], (1, 0))
      for r, acc in enumerate(accs):  # each row tile's chunk j against the same x columns
        rows = [plgpu.layout_cast(scale_row(_load(scales_smem.at[r, j * per + b], row_l)),
                                  row_l) for b in range(per)]
        a = _decode_asm([_load(codes_smem.at[r, j], wgmma)], rows, fmt, order, folded=fold)
        plgpu.wgmma(acc, a, x_t)
    plgpu.wgmma_wait(0)
    return accs

  def step(_, *smem, accs):
    if halves:
      return step_halves(_, *smem, accs)
    xe_smem, xo_smem = smem[:groups], smem[groups:2 * groups]
    codes_smem, scales_smem = smem[2 * groups:]
    for j in range(0, block_k2 // CHUNK, k_tiles):
      cols = pl.ds(j * CHUNK, CHUNK * k_tiles)
      if decode == "asm":
        tiles = [_load(codes_smem.at[0, j + t], wgmma) for t in range(k_tiles)]
        per = CHUNK // per_scale
        rows = [plgpu.layout_cast(scale_row(_load(scales_smem.at[0, j * per + b], row_l)),
                                  row_l) for b in range(per * k_tiles)]
        lo, hi = _decode_asm(tiles, rows, fmt, folded=fold)
      else:
        codes = _load(codes_smem.at[0, j], wgmma)
        codes = codes.astype(jnp.uint16)
        scale = scale_tile(scales_smem, j, codes.shape)
        lo = plgpu.layout_cast(_decode(codes & 15, scale, fmt), wgmma)
        hi = plgpu.layout_cast(_decode(codes >> 4, scale, fmt), wgmma)
      for acc_ref, xe, xo in zip(accs, xe_smem, xo_smem):
        plgpu.wgmma(acc_ref, lo, xe.at[cols])
        plgpu.wgmma(acc_ref, hi, xo.at[cols])
    plgpu.wgmma_wait(0)
    return accs

  scale_cols, chunks = block_k2 // per_scale, block_k2 // CHUNK
  k0 = si * steps
  if halves:  # x [M, K] itself: the tokens' rows, 2 x block_k2 K values a step
    x_specs = [plgpu.BlockSpec((m, 2 * block_k2), lambda k: (ti, k0 + k))]
    x_gmems = [xe_gmem]
  else:  # each token group's columns of x_e^T, then of x_o^T
    x_specs = [plgpu.BlockSpec((block_k2, width), lambda k, c=c: (k0 + k, ti if table else c))
               for c in range(groups)] * 2
    x_gmems = [xe_gmem] * groups + [xo_gmem] * groups

  def acc_scope(*accs):
    plgpu.emit_pipeline(
        functools.partial(step, accs=accs),
        grid=(steps,),
        in_specs=[
            *x_specs,
            plgpu.BlockSpec((row_tiles, chunks, 64, CHUNK), lambda k: (wi, k0 + k, 0, 0)),
            plgpu.BlockSpec((row_tiles, scale_cols, 64), lambda k: (wi, k0 + k, 0)),
        ],
        max_concurrent_steps=max_concurrent_steps,
    )(*x_gmems, codes_gmem, scales_gmem)
    return tuple(acc_ref[...] for acc_ref in accs)

  def tile():  # an accumulator a row tile and token group (row_tiles > 1: one group)
    accs = pl.run_scoped(acc_scope,
                         *[plgpu.ACC((block_n, width)) for _ in range(row_tiles * groups)])
    for i, acc in enumerate(accs):
      r, c = divmod(i, groups)
      tokens = pl.ds((ti if table else c) * width, width)
      if fold:  # the power of two the folded values are short of
        acc = acc * g
      if out_rows:
        _store_rows(acc, out_gmem, si, ni * row_tiles + r, block_n, tokens)
      else:
        _store(acc, out_gmem, si, ni * row_tiles + r, block_n, cols=tokens)

  if table:
    pl.when(ti < table[0][table[0].shape[0] - 1])(tile)
  else:
    tile()


def _store(acc, out_gmem, si, ni, block_n, cols=slice(None)):
  """The accumulator tile [block_n, M] -> out_gmem[si, ni-th block_n rows, cols], via shared
  memory, in out_gmem's dtype (float32, or bf16 rounded once from the float32 sums)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu

  @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM(acc.shape, out_gmem.dtype))
  def _(o_smem):
    o_smem[...] = acc if out_gmem.dtype == jnp.float32 else acc.astype(out_gmem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[si, pl.ds(ni * block_n, block_n), cols])
    plgpu.wait_smem_to_gmem(0)


def _store_rows(acc, out_gmem, si, ni, block_n, rows):
  """The accumulator tile [block_n, M] (of y^T) -> out_gmem[si, rows, ni-th block_n columns] (of
  y, in out_gmem's dtype): the registers shuffled into wgmma's transposed layout and stored
  through a transposed view of swizzled shared memory tiled in 8 rows of 128 bytes (as
  tokamax's Hopper ragged dot stores its swapped product), then one copy of [M, block_n] rows
  to global memory."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  m, dtype = acc.shape[1], out_gmem.dtype
  smem = plgpu.SMEM((m, block_n), dtype,
                    transforms=(plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
                                plgpu.SwizzleTransform(128)))

  @functools.partial(pl.run_scoped, o_smem=smem)
  def _(o_smem):
    plgpu.transpose_ref(o_smem, (1, 0))[...] = plgpu.layout_cast(
        acc.astype(dtype), plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_gmem.at[si, rows, pl.ds(ni * block_n, block_n)])
    plgpu.wait_smem_to_gmem(0)


def _check_out_dtype(out_dtype, splits: int):
  if jnp.dtype(out_dtype) not in (jnp.float32, jnp.bfloat16) or (
      jnp.dtype(out_dtype) == jnp.bfloat16 and splits != 1):
    raise ValueError(f"out_dtype must be float32, or bfloat16 with one split (partials are "
                     f"summed in float32); got {jnp.dtype(out_dtype).name} with {splits} splits")


def _without_xo(body):
  """`_body` for the "halves" order, which has x alone (no odd columns)."""
  def with_x(x_gmem, *refs):
    return body(x_gmem, None, *refs)
  return with_x


def _x_operands(xs, order: str, decode: str) -> tuple[int, int]:
  """(K/2, M) of the kernels' x operands: "pairs" x's even and odd K columns transposed
  (xe_t, xo_t [K/2, M]), "halves" x itself ([M, K], "asm" decode only)."""
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
  if decode not in ("asm", "jnp") or order == "halves" and decode != "asm":
    raise ValueError(f"decode must be 'asm' or 'jnp' ('asm' for the 'halves' order), got "
                     f"{decode!r}")
  if len(xs) != (2 if order == "pairs" else 1):
    raise ValueError(f"the {order!r} order takes x as "
                     f"{'(xe_t, xo_t)' if order == 'pairs' else '(x,)'}, got {len(xs)} arrays")
  if order == "pairs":
    return xs[0].shape
  return xs[0].shape[1] // 2, xs[0].shape[0]


def _check_fold(fold: bool, fmt: str, decode: str):
  if fold and (fmt != "mxfp4" or decode != "asm"):
    raise ValueError(f"fold takes MXFP4 weights and the 'asm' decode, got {fmt} with "
                     f"{decode!r}")


@functools.partial(jax.jit, static_argnames=("fmt", "block_k2", "splits",
                                             "max_concurrent_steps", "decode", "order",
                                             "out_rows", "fold"))
def fp4_wgmma_partials(xs, codes, scales, global_scale, *, fmt: str,
                       block_k2: int = 256, splits: int = 1, max_concurrent_steps: int = 4,
                       decode: str = "asm", order: str = "pairs", out_rows: bool = False,
                       fold: bool = False):
  """x (`xs`: for codes in the "pairs" order x's even and odd K columns transposed, (xe_t,
  xo_t) [K/2, M]; for "halves", (x,) [M, K]; M 16, 32 or a multiple of 32), a weight in the
  layout of `layout.tile` (codes [N/64, K/64, 64, 32] in that `order`, scales
  [N/64, K/block, 64]), NVFP4's float32 global [1] (for MXFP4 the fold's reference, read with
  `fold` alone) -> float32 [splits, N, M] partials of y^T (`out_rows`: of y, [splits, M, N]).
  decode: "asm" (the PTX of `_decode_asm`) or "jnp" (integer operations and a select chain).
  `fold` (MXFP4, "asm"): one multiply a decoded pair (`_body`); the same partials."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if fmt not in ("mxfp4", "nvfp4"):
    raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
  _check_fold(fold, fmt, decode)
  k2, m = _x_operands(xs, order, decode)
  n = codes.shape[0] * 64
  if codes.shape[1:] != (k2 // CHUNK, 64, CHUNK) or m % (16 if m <= 32 else 32) or m > MAX_M \
      or k2 % (block_k2 * splits) or block_k2 % CHUNK:
    raise ValueError(f"the wgmma kernel needs tiled codes [N/64, K/64, 64, 32] (got "
                     f"{codes.shape} for K/2 = {k2}), M ({m}) 16, 32 or a multiple of 32 up to "
                     f"{MAX_M} and K/2 divisible by block_k2 ({block_k2}, a multiple of "
                     f"{CHUNK}) x splits ({splits})")
  want = (n // 64, k2 // (16 if fmt == "mxfp4" else 8), 64)  # one scale per block
  if scales.shape != want:
    raise ValueError(f"{fmt} scales for this weight are tiled [N/64, K/block, 64] = {want}, got "
                     f"{scales.shape}: a weight of the other format, or not from layout.tile")
  steps = k2 // block_k2 // splits
  body = functools.partial(_body, fmt=fmt, block_n=64, block_k2=block_k2, steps=steps,
                           max_concurrent_steps=min(max_concurrent_steps, steps), decode=decode,
                           order=order, out_rows=out_rows, fold=fold)
  if order == "halves":
    body = _without_xo(body)
  body.__name__ = "fp4_wgmma"  # the kernel's name in profiles
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((splits, m, n) if out_rows else (splits, n, m),
                                          jnp.float32),
      grid=(n // 64, splits), grid_names=("n", "s"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(*xs, codes, scales, jnp.reshape(global_scale, (1,)).astype(jnp.float32))


@functools.partial(jax.jit, static_argnames=("fmt", "block_k2", "splits",
                                             "max_concurrent_steps", "decode", "order",
                                             "out_dtype", "row_tiles", "out_rows",
                                             "tile_m", "fold"))
def grouped_fp4_wgmma_partials(xs, codes, scales, global_scale, tile_expert, *,
                               fmt: str, block_k2: int = 128, splits: int = 1,
                               max_concurrent_steps: int = 4, decode: str = "asm",
                               order: str = "pairs", out_dtype=jnp.float32,
                               row_tiles: int = 1, out_rows: bool = False, tile_m: int = 16,
                               fold: bool = False):
  """The grouped form of `fp4_wgmma_partials`: x in tile_m-token tiles (`xs`: "pairs" (xe_t,
  xo_t) [K/2, tile_m x tiles], "halves" (x,) [tile_m x tiles, K]), per-expert tiled weights
  (codes [E, N/64, K/64, 64, 32] in that `order`, scales [E, N/64, K/block, 64], globals [E]),
  tile_expert [tiles + 1] (each tile's expert, then the tiles in use) -> float32
  [splits, N, tile_m x tiles] partials of y^T (`out_dtype` bf16, with one split: y^T rounded
  once to bf16 in the kernel); the columns of unused tiles are left unwritten. `row_tiles`
  ("halves" order: 1, 2 or 4): the 64-row tiles of y^T a block computes from one x tile.
  `out_rows` (one split, bf16): y itself, [1, tile_m x tiles, N], its unused tiles' rows
  unwritten. `tile_m`: 16 tokens a tile (wgmma's N), or 8 ("halves" order only): each expert's
  rows padded to a multiple of 8, half the padding where experts get a few rows each. `fold`:
  as in `fp4_wgmma_partials`, each expert against its own reference (globals [E])."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if fmt not in ("mxfp4", "nvfp4"):
    raise ValueError(f"fmt must be 'mxfp4' or 'nvfp4', got {fmt!r}")
  _check_fold(fold, fmt, decode)
  _check_out_dtype(out_dtype, splits)
  if out_rows and jnp.dtype(out_dtype) != jnp.bfloat16:
    raise ValueError("out_rows writes y in bf16, from one split: out_dtype must be bfloat16, "
                     f"got {jnp.dtype(out_dtype).name}")
  k2, r = _x_operands(xs, order, decode)
  e, n = codes.shape[0], codes.shape[1] * 64
  _check_row_tiles(row_tiles, order, codes.shape[1])
  _check_tile_m(tile_m, order)
  want = (e, n // 64, k2 // (16 if fmt == "mxfp4" else 8), 64)
  if (codes.shape[2:] != (k2 // CHUNK, 64, CHUNK) or scales.shape != want or r % tile_m
      or tile_expert.shape != (r // tile_m + 1,) or k2 % (block_k2 * splits)
      or block_k2 % CHUNK):
    raise ValueError(f"the grouped wgmma kernel needs tiled {fmt} codes [E, N/64, K/64, 64, 32] "
                     f"and scales {want} (got {codes.shape}, {scales.shape} for K/2 = {k2}), "
                     f"x in {tile_m}-token tiles with one table entry a tile and one more (got {r} "
                     f"columns, {tile_expert.shape} entries), K/2 divisible by block_k2 "
                     f"({block_k2}, a multiple of {CHUNK}) x splits ({splits})")
  steps = k2 // block_k2 // splits
  body = functools.partial(_body, fmt=fmt, block_n=64, block_k2=block_k2, steps=steps,
                           max_concurrent_steps=min(max_concurrent_steps, steps), decode=decode,
                           tile_m=tile_m, order=order, row_tiles=row_tiles, out_rows=out_rows,
                           fold=fold)
  if order == "halves":
    body = _without_xo(body)
  # the last grid axis is CUDA's x (up to 2^31 blocks), the others y and z (up to 65535): the
  # token tiles go on x when there are more (prefill)
  blocks_n = n // (64 * row_tiles)
  tiles = r // tile_m
  grid, names = ((blocks_n, tiles, splits), ("n", "t", "s")) if tiles <= 65535 else (
      (blocks_n, splits, tiles), ("n", "s", "t"))
  body.__name__ = "grouped_fp4_wgmma"  # the kernel's name in profiles
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((1, r, n) if out_rows else (splits, n, r), out_dtype),
      grid=grid, grid_names=names,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(*xs, codes.reshape(-1, *codes.shape[2:]), scales.reshape(-1, *scales.shape[2:]),
    jnp.reshape(global_scale, (e,)).astype(jnp.float32), tile_expert.astype(jnp.int32))


def _check_tile_m(tile_m: int, order: str):
  if tile_m not in (8, 16) or tile_m == 8 and order != "halves":
    raise ValueError(f"tile_m must be 16, or 8 for a weight in the 'halves' order; got {tile_m} "
                     f"for the {order!r} order")


def _check_row_tiles(row_tiles: int, order: str, n_tiles: int):
  if row_tiles != 1 and (row_tiles not in (2, 4) or order != "halves" or n_tiles % row_tiles):
    raise ValueError(f"row_tiles must be 1, or 2 or 4 dividing the 64-row tiles of a weight in "
                     f"the 'halves' order; got {row_tiles} for the {order!r} order and "
                     f"{n_tiles} tiles")


def _bf16_body(x_gmem, w_gmem, out_gmem, *, block_n, block_k, steps, max_concurrent_steps):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
  m = x_gmem.shape[1]
  k0 = si * steps

  def step(_, x_smem, w_smem, acc_ref):
    plgpu.wgmma(acc_ref, w_smem, x_smem)
    plgpu.wgmma_wait(0)
    return acc_ref

  def acc_scope(acc_ref):
    plgpu.emit_pipeline(
        functools.partial(step, acc_ref=acc_ref), grid=(steps,),
        in_specs=[plgpu.BlockSpec((block_k, m), lambda k: (k0 + k, 0)),
                  plgpu.BlockSpec((block_n, block_k), lambda k: (ni, k0 + k))],
        max_concurrent_steps=max_concurrent_steps,
    )(x_gmem, w_gmem)
    return acc_ref[...]

  _store(pl.run_scoped(acc_scope, plgpu.ACC((block_n, m))), out_gmem, si, ni, block_n)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "splits",
                                             "max_concurrent_steps"))
def bf16_wgmma_partials(x_t, w_t, *, block_n: int = 64, block_k: int = 128, splits: int = 1,
                        max_concurrent_steps: int = 4):
  """x transposed (x_t [K, M], M a multiple of 16), a K-major bf16 weight w_t [N, K] -> float32
  [splits, N, M] partials of y^T."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  k, m = x_t.shape
  n = w_t.shape[0]
  if m % 16 or m > 256 or n % block_n or block_n % 64 or k % (block_k * splits) or block_k % 64:
    raise ValueError(f"the wgmma kernel needs M ({m}) a multiple of 16 up to 256, N ({n}) "
                     f"divisible by block_n ({block_n}, a multiple of 64) and K ({k}) by "
                     f"block_k ({block_k}, a multiple of 64) x splits ({splits})")
  steps = k // block_k // splits  # no more copies in flight than steps
  body = functools.partial(_bf16_body, block_n=block_n, block_k=block_k, steps=steps,
                           max_concurrent_steps=min(max_concurrent_steps, steps))
  body.__name__ = "bf16_wgmma"  # the kernel's name in profiles
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((splits, n, m), jnp.float32),
      grid=(n // block_n, splits), grid_names=("n", "s"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x_t, w_t.astype(jnp.bfloat16))


def _grouped_bf16_body(x_gmem, w_gmem, tile_expert, out_gmem, *, block_k, steps,
                       max_concurrent_steps):
  """One [64, 16] tile of y^T: token tile t of x ([16 x tiles, K], rows as they are) times
  expert tile_expert[t]'s weight ([E, K, N], N contiguous), both operands of wgmma read from
  shared memory transposed; tiles past the table's last entry (the tiles in use) do
  nothing."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  ni, ti, si = (jax.lax.axis_index(a) for a in ("n", "t", "s"))
  expert = tile_expert[ti]
  k0 = si * steps

  def step(_, x_smem, w_smem, acc_ref):
    plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem.at[0], (1, 0)),
                plgpu.transpose_ref(x_smem, (1, 0)))
    plgpu.wgmma_wait(0)
    return acc_ref

  def acc_scope(acc_ref):
    plgpu.emit_pipeline(
        functools.partial(step, acc_ref=acc_ref), grid=(steps,),
        in_specs=[plgpu.BlockSpec((16, block_k), lambda k: (ti, k0 + k)),
                  plgpu.BlockSpec((1, block_k, ROWS), lambda k: (expert, k0 + k, ni))],
        max_concurrent_steps=max_concurrent_steps,
    )(x_gmem, w_gmem)
    return acc_ref[...]

  @pl.when(ti < tile_expert[tile_expert.shape[0] - 1])
  def _():
    acc = pl.run_scoped(acc_scope, plgpu.ACC((ROWS, 16)))
    _store(acc, out_gmem, si, ni, ROWS, cols=pl.ds(ti * 16, 16))


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "max_concurrent_steps",
                                             "out_dtype"))
def grouped_bf16_wgmma_partials(x, w, tile_expert, *, block_k: int = 128, splits: int = 1,
                                max_concurrent_steps: int = 4, out_dtype=jnp.float32):
  """The bf16 twin of `grouped_fp4_wgmma_partials` (the "halves" order's operands): x's rows
  in 16-token tiles ([16 x tiles, K]), per-expert bf16 weights w [E, K, N] as the engine holds
  them, tile_expert [tiles + 1] -> float32 [splits, N, 16 x tiles] partials of y^T (`out_dtype`
  bf16, with one split: y^T in bf16); the columns of unused tiles are left unwritten."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _check_out_dtype(out_dtype, splits)
  r, k = x.shape
  e, _, n = w.shape
  if (w.shape[1] != k or r % 16 or n % ROWS or tile_expert.shape != (r // 16 + 1,)
      or k % (block_k * splits) or block_k % 64):
    raise ValueError(f"the grouped bf16 wgmma kernel needs x [16 x tiles, K] and weights "
                     f"[E, K, N] with N a multiple of {ROWS}, one table entry a tile and one "
                     f"more, K divisible by block_k ({block_k}, a multiple of 64) x splits "
                     f"({splits}); got x {x.shape}, w {w.shape}, {tile_expert.shape} entries")
  steps = k // block_k // splits
  body = functools.partial(_grouped_bf16_body, block_k=block_k, steps=steps,
                           max_concurrent_steps=min(max_concurrent_steps, steps))
  body.__name__ = "grouped_bf16_wgmma"  # the kernel's name in profiles
  # the token tiles on CUDA's x axis when there are more than y and z take (as the FP4 kernel)
  grid, names = ((n // ROWS, r // 16, splits), ("n", "t", "s")) if r // 16 <= 65535 else (
      (n // ROWS, splits, r // 16), ("n", "s", "t"))
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((splits, n, r), out_dtype),
      grid=grid, grid_names=names,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), tile_expert.astype(jnp.int32))


def grouped_bf16_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                        block_k: int = 128, splits: int | None = None,
                        max_concurrent_steps: int = 4, rows_in: jax.Array | None = None,
                        rows_out: jax.Array | None = None, slots=None) -> jax.Array:
  """`api.grouped_bf16_matmul` (x [T, K], rows sorted by expert, @ w[e] [K, N]) by the Mosaic
  wgmma kernel (compiled Hopper only), as `grouped_fp4_matmul` runs a weight in the "halves"
  order: each group padded to 16-token tiles gathered in one pass, each tile against its
  expert's weight read as the engine holds it -> [T, N] bf16; rows past sum(group_sizes) come
  out zero. rows_in / rows_out / slots as in `api.grouped_fp4_matmul`."""
  e, k, n = w.shape
  if x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (e,):
    raise ValueError(f"grouped_bf16_matmul takes x [T, {k}] and group_sizes [{e}] for this "
                     f"weight, got x {x.shape} and group_sizes {group_sizes.shape}")
  src, tile_expert, dest = place_rows(group_sizes, sorted_rows(x, rows_in), 16, rows_in,
                                      rows_out, x.shape[0], slots)
  splits = splits or default_splits(src.shape[0] // 16, n // ROWS, k // block_k,
                                    programs=2 * 132, max_splits=8)
  partials = grouped_bf16_wgmma_partials(_tiled_rows(x, src), w, tile_expert, block_k=block_k,
                                         splits=splits, max_concurrent_steps=max_concurrent_steps,
                                         out_dtype=_out_dtype(splits))
  return _rows_back(partials, dest)


def _out_dtype(splits: int):
  """What the grouped kernels write: y^T in bf16 from one split (the rounding the wrapper
  would make, done in the kernel: half the bytes written and read back), else float32
  partials."""
  return jnp.bfloat16 if splits == 1 else jnp.float32


def _tiled_rows(x, src):
  """x [T, K]'s rows placed in 16-token tiles (`tile_rows`' src; zeros where a tile's row holds
  none) -> [16 x tiles, K] bf16, in one gather."""
  return jnp.take(x.astype(jnp.bfloat16), src, axis=0, mode="fill", fill_value=0)


def _rows_back(partials, dest):
  """A grouped kernel's partials of y^T [splits, N, 16 x tiles] (float32, or y^T itself in bf16
  from one split, `_out_dtype`) -> y [T, N] bf16: the splits summed, each row's column gathered
  (along memory) in bf16 (`dest`; zeros past the groups), then transposed."""
  y_t = (partials[0] if partials.shape[0] == 1 else jnp.sum(partials, axis=0)).astype(
      jnp.bfloat16)
  return _transposed(jnp.take(y_t, dest, axis=1, mode="fill", fill_value=0))


def _tokens(x):
  """x [..., K] -> (bf16 [M', K] with M' the rows padded to 16, 32 or a multiple of 32 (whole
  token groups), M, lead dims)."""
  lead = x.shape[:-1]
  x2 = x.reshape(-1, x.shape[-1]).astype(jnp.bfloat16)
  m = x2.shape[0]
  multiple = 16 if m <= 16 else TOKEN_GROUP
  return jnp.pad(x2, ((0, -m % multiple), (0, 0))), m, lead


def available() -> bool:
  """Whether the wgmma kernels compile here: a Hopper (sm_90) GPU as the default device."""
  if jax.default_backend() != "gpu":
    return False
  return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


SMEM_BYTES = 227 * 1024  # shared memory a block may take on the H200


def pipeline(m: int, k2: int, fmt: str, block_k2: int | None = None,
             max_concurrent_steps: int | None = None, row_tiles: int = 1) -> tuple[int, int]:
  """(block_k2, steps in flight) for M token columns and K/2 packed columns: what is given, the
  rest chosen so that the pipeline's shared memory (x's even and odd columns, codes, scales;
  `row_tiles` row tiles of them), with 4 KiB and a [64, 32] float32 tile to spare, fits: the
  largest K step of 128, 64 or 32 packed columns dividing K/2 (64 and up past 32 tokens) that
  keeps at least three steps in flight, at most four. The output tile is staged after the
  pipeline's buffers are released (scoped shared memory is a stack), so it does not add to
  them."""
  per_scale = 16 if fmt == "mxfp4" else 8

  def steps(bk):
    stage = 2 * bk * m * 2 + row_tiles * (bk * ROWS + bk // per_scale * ROWS)
    return min(max_concurrent_steps or 4,
               (SMEM_BYTES - ROWS * min(m, TOKEN_GROUP) * 4 - 4096) // stage)

  if block_k2 is None:
    fits = [bk for bk in (128, 64, 32) if k2 % bk == 0]  # 64 K values an instruction above
    fits = [bk for bk in fits if bk > CHUNK or m <= TOKEN_GROUP] or fits  # 32 tokens: 2 chunks
    if not fits:
      raise ValueError(f"K/2 ({k2}) must be a multiple of {CHUNK}")
    block_k2 = next((bk for bk in fits if steps(bk) >= 3), fits[-1])
  if steps(block_k2) < 1:
    raise ValueError(f"block_k2 {block_k2} at M = {m} needs more shared memory than a block "
                     f"has ({SMEM_BYTES} bytes)")
  return block_k2, steps(block_k2)


def _check_tiled(w, grouped: bool, name: str):
  if not isinstance(w, TiledFP4) or w.grouped != grouped:
    what = "per-expert [E, K, N]" if grouped else "[K, N] (not per-expert)"
    raise ValueError(f"{name} takes a {what} weight in the kernel's layout (layout.tile), got "
                     f"{type(w).__name__} {getattr(w, 'shape', None)}")


def grouped_fp4_matmul(x: jax.Array, w: TiledFP4, group_sizes: jax.Array, *,
                       block_k2: int | None = None, splits: int | None = None,
                       max_concurrent_steps: int | None = None,
                       decode: str = "asm", row_tiles: int = 1,
                       rows_in: jax.Array | None = None,
                       rows_out: jax.Array | None = None, out_rows: bool = True,
                       tile_m: int | None = None, slots=None, fold: bool = False) -> jax.Array:
  """The MoE expert matmul of `api.grouped_fp4_matmul` (x [T, K], rows sorted by expert, or
  the rows rows_in of x with the output's rows_out, composed with the gathers here) for
  per-expert weights in the kernel's layout (`layout.tile` of an [E, K, N] weight), by the wgmma
  kernel (compiled Hopper only): each group padded to tile_m-token tiles (16, or 8 for "halves"
  weights: `grouped_fp4_wgmma_partials`; by default 8 for those, 16 for "pairs"), each tile
  against its expert's weight -> [T, N] bf16; rows past sum(group_sizes) come out zero. At
  decode most experts hold a few rows, so 16-token tiles are mostly padding: at B = 64, 8-token
  tiles gather 1 536 rows instead of 2 560, and the 48-layer MXFP4 decode went from 3 307 to
  3 464 tokens/s on an H100 (BENCHMARKS.md). A weight in the "halves" order (`layout.ORDERS`)
  takes the gathered rows of x as they are; `row_tiles` 2 or 4 computes that many 64-row tiles
  of the output a block from one x tile (that order only).
  `out_rows` (the default; used with one split): the kernel writes y's rows (`_store_rows`),
  which are then gathered along rows; off, y^T's columns are gathered and transposed (a slower
  column gather: 56 against 65 us a down call at B = 64 on an H100, BENCHMARKS.md). `slots`:
  the dispatch's rows per slot, placed with no sort (`tiling.place_rows`). `fold`: MXFP4's
  scales folded, one multiply a decoded pair (`_body`); the same outputs."""
  _check_tiled(w, True, "grouped_fp4_matmul")
  e, k, n = w.shape
  if x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (e,):
    raise ValueError(f"grouped_fp4_matmul takes x [T, {k}] and group_sizes [{e}] for this "
                     f"weight, got x {x.shape} and group_sizes {group_sizes.shape}")
  _check_row_tiles(row_tiles, w.order, n // ROWS)
  tile_m = (8 if w.order == "halves" else 16) if tile_m is None else tile_m
  _check_tile_m(tile_m, w.order)
  block_k2, stages = pipeline(tile_m, k // 2, w.kernel_fmt, block_k2, max_concurrent_steps,
                              row_tiles)
  if (k // 2) % block_k2:
    raise ValueError(f"K/2 ({k // 2}) must be a multiple of block_k2 ({block_k2})")
  src, tile_expert, dest = place_rows(group_sizes, sorted_rows(x, rows_in), tile_m, rows_in,
                                      rows_out, x.shape[0], slots)
  if w.order == "halves":  # the padded rows gathered, [tile_m x tiles, K]: one pass
    xs = (_tiled_rows(x, src),)
  else:
    xs = _even_odd_columns(x, src)
  splits = splits or default_splits(src.shape[0] // tile_m, n // (ROWS * row_tiles),
                                    (k // 2) // block_k2, programs=2 * 132, max_splits=8)
  out_rows = out_rows and splits == 1
  partials = grouped_fp4_wgmma_partials(
      xs, w.codes, w.scales, w.global_scale, tile_expert, fmt=w.kernel_fmt, block_k2=block_k2,
      splits=splits, max_concurrent_steps=stages, decode=decode, order=w.order,
      out_dtype=_out_dtype(splits), row_tiles=row_tiles, out_rows=out_rows, tile_m=tile_m,
      fold=fold)
  if out_rows:  # y's rows gathered (zeros past the groups)
    return jnp.take(partials[0], dest, axis=0, mode="fill", fill_value=0)
  return _rows_back(partials, dest)  # likewise out: y^T's columns gathered, then transposed


def _even_odd_columns(x, src):
  """x [T, K] -> its rows `src` (the padded tiles' sources) as the even and odd rows of x^T,
  [K/2, len(src)] each: the "pairs" order's x operands.

  x^T in a pass of its own (a tiled transpose), then the padded rows gathered as its columns:
  gathered and transposed in one fused pass, x's rows were read across the transpose (46 us
  for 2048 rows of 2048 features on the H200; split this way, the decode step's kernel time
  fell by 0.7% and its throughput did not move, BENCHMARKS.md)."""
  xt = jax.lax.optimization_barrier(x.astype(jnp.bfloat16).T)
  xt = jnp.take(xt, src, axis=1, mode="fill", fill_value=0)  # [K, 16 x tiles]
  return xt[0::2], xt[1::2]


def _transposed(y_t):
  """y^T [N, M] -> y [M, N], by a transpose pass of its own (not fused with what made y^T, which
  would read y^T across the transpose)."""
  return jax.lax.optimization_barrier(y_t).T


def fp4_matmul(x: jax.Array, w: TiledFP4, *, block_k2: int | None = None,
               splits: int | None = None, max_concurrent_steps: int | None = None,
               decode: str = "asm", out_rows: bool = True, fold: bool = False) -> jax.Array:
  """x [..., K] @ W -> [..., N] bf16 for a [K, N] weight in the kernel's layout (`layout.tile`),
  by the wgmma kernel (compiled Hopper only). Tokens go in calls of up to 256 (the instruction's
  N); block_k2 and the steps in flight default to what fits shared memory at that M (`pipeline`).
  decode: "asm" (PTX) or "jnp". A weight in the "halves" order (`layout.ORDERS`) takes x's
  rows as they are; the "pairs" order x^T's even and odd rows. `out_rows` (the default): the
  kernel writes the partials of y's rows (`_store_rows`), summed into y with no transpose pass;
  off, the partials of y^T, summed and then transposed. `fold`: MXFP4's scales folded, one
  multiply a decoded pair (`_body`); the same outputs."""
  _check_tiled(w, False, "fp4_matmul")
  k, n = w.shape
  x2, m, lead = _tokens(x)
  if x2.shape[1] != k:
    raise ValueError(f"x has {x2.shape[1]} features, the weight expects {k}")
  if x2.shape[0] > MAX_M:  # calls of MAX_M tokens, one after another
    x2 = jnp.pad(x2, ((0, -x2.shape[0] % MAX_M), (0, 0))).reshape(-1, MAX_M, k)
  rows = x2.shape[-2]
  block_k2, stages = pipeline(rows, k // 2, w.kernel_fmt, block_k2, max_concurrent_steps)
  if (k // 2) % block_k2:
    raise ValueError(f"K/2 ({k // 2}) must be a multiple of block_k2 ({block_k2})")
  splits = splits or default_splits(1, n // ROWS, (k // 2) // block_k2, programs=2 * 132,
                                        max_splits=8)

  def call(xc):  # -> y^T [N, tokens] (y [tokens, N] with out_rows) in bf16
    if w.order == "halves":
      xs = (xc,)
    else:
      xt = xc.T  # at most 256 tokens: small enough to transpose in the split's pass
      xs = (xt[0::2], xt[1::2])
    partials = fp4_wgmma_partials(xs, w.codes, w.scales, w.global_scale, fmt=w.kernel_fmt,
                                  block_k2=block_k2, splits=splits, max_concurrent_steps=stages,
                                  decode=decode, order=w.order, out_rows=out_rows, fold=fold)
    return jnp.sum(partials, axis=0).astype(jnp.bfloat16)

  if out_rows:
    y = call(x2) if x2.ndim == 2 else jax.lax.map(call, x2).reshape(-1, n)
    return y[:m].reshape(*lead, n)
  y_t = call(x2) if x2.ndim == 2 else jnp.moveaxis(jax.lax.map(call, x2), 0, 1).reshape(n, -1)
  return _transposed(y_t)[:m].reshape(*lead, n)


def bf16_matmul(x: jax.Array, w_t: jax.Array, *, block_n: int = 64, block_k: int = 128,
                splits: int | None = None, max_concurrent_steps: int = 4) -> jax.Array:
  """x [..., K] @ w_t.T -> [..., N] bf16 for a K-major bf16 weight w_t [N, K], by the wgmma
  kernel (compiled Hopper only)."""
  n, k = w_t.shape
  x2, m, lead = _tokens(x)
  splits = splits or default_splits(1, n // block_n, k // block_k, programs=2 * 132,
                                        max_splits=8)
  partials = bf16_wgmma_partials(x2.T, w_t, block_n=block_n, block_k=block_k, splits=splits,
                                 max_concurrent_steps=max_concurrent_steps)
  return jnp.sum(partials, axis=0).T[:m].astype(jnp.bfloat16).reshape(*lead, n)
