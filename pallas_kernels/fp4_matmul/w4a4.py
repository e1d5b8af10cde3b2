"""Pallas (Mosaic GPU, Hopper) MXFP4 x MXFP4 matmul on FP8 tensor cores (W4A4).

y^T = W^T x^T as in `mosaic.py` (the weight wgmma's A operand, in registers; tokens its N), but
both operands E4M3 (`w4a4_layout` says why every value is exact): each warpgroup loads a
chunk's 512 words of codes as 16-byte vectors, decodes each word to two E4M3 registers by two
byte permutes (`w4a4_layout.DECODE_ASM`, one instruction a value), and issues one FP8 wgmma of
32 K values (one MXFP4 block of each operand) into an accumulator of its own; that block's
exact product is then added to the float32 sum, times the weight block's relative scale
(`promote`), so the tensor core never sums two blocks. x arrives as E4M3 already folded per
token (`w4a4_layout.activation_e4m3`, from the rollout's QArray of codes and scales), its
blocks in shared memory K-major as 8-bit wgmma needs them; the rows' and tokens' powers of two
are applied to the partial sums outside, in the pass that adds the K splits.

A call whose activation holds a block the fold cannot represent exactly (more than 2^14 below
its token's largest, or a NaN scale) takes an exact path instead (`exact_path`): "kernel", a
branch of the same kernel on a device flag, with the activation unfolded (every code E2M1 x
2^6, as the weight's) and each block's 2^(s - R_t) applied with the weight block's scale in the
per-block FMA (one more multiply an accumulator element, only on that branch); or "xla",
XLA's dequantize-then-dot (`reference.fp4_matmul`) behind a `lax.cond`, whose predicate XLA's
GPU backend copies to the host at every call. Either way every call gives the reference's
numbers up to float32 summation order. `fold_misses` counts such blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import numpy as np

from pallas_kernels.fp4_matmul import reference, tiling
from pallas_kernels.fp4_matmul.mosaic import _load, _store, _transposed, available
from pallas_kernels.fp4_matmul.w4a4_layout import (ACT_SHIFT, BLOCK, CHUNK_K, DECODE_ASM, ROWS,
                                                   WEIGHT_SHIFT, TiledW4, activation_e4m3,
                                                   activation_unfolded, e4m3_values,
                                                   row_scale, scale_multipliers, untile)
from trace_jax.quant import QArray

MAX_M = 64  # tokens a dense call: accumulators of M / 2 registers, two in flight, and the sum
SMEM_BYTES = 227 * 1024


def _decode(words):
  """A chunk's words (WG_STRIDED [512], four a thread) -> the A operands of its two blocks,
  E4M3 [64, 32] each in the 8-bit wgmma layout: word 2 b + h gives block b's registers of rows
  r + 8 h (its low-register codes at columns 4 (l % 4) + 0..3, its high ones at + 16)."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import llvm

  a_layout = plgpu.Layout.WGMMA_8BIT
  out = plgpu.ShapeDtypeStruct((64, BLOCK), jnp.float8_e4m3fn, a_layout)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_STRIDED((128, 4), vec_size=4),),
                     return_type=(out, out))
  def decode(_, words):
    i32 = ir.IntegerType.get_signless(32)
    quad = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
    [vec] = words.registers.flat
    word = [llvm.extractelement(vec, mgpu_utils.c(j, i32)) for j in range(4)]
    blocks = []
    for b in range(2):
      pair = llvm.StructType.get_literal([i32, i32])
      lo_r, hi_r = (llvm.inline_asm(pair, [word[2 * b + h]], DECODE_ASM, "=r,=r,r")
                    for h in range(2))
      regs = [[llvm.extractvalue(i32, s, [p]) for p in range(2)] for s in (lo_r, hi_r)]
      # registers_shape (1, 2, 1, 1, 2, 1, 1, 1, 1): [column tile (0-15, 16-31), row half]
      grid = np.empty((1, 2, 1, 1, 2, 1, 1, 1, 1), dtype=object)
      for tile in range(2):
        for h in range(2):
          grid[0, tile, 0, 0, h, 0, 0, 0, 0] = mgpu_utils.bitcast(regs[h][tile], quad)
      blocks.append(mgpu.FragmentedArray(_registers=grid, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                         _is_signed=None))
    return tuple(blocks)

  return decode(words)


def _accumulate(*args, **kwargs):
  """plgpu.wgmma_accumulator_load where this jax has it (wait for all but `wait_n` wgmmas);
  else the plain read, which waits for all."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  load = getattr(plgpu, "wgmma_accumulator_load", None)
  acc, = args
  return load(acc, **kwargs) if load is not None else acc[...]


def _chunk_sums(m, block_k, in_flight):
  """-> sums(total, x_smem, words_smem, scales_smem, mult_smem=None): one K step's blocks added
  to the float32 total [64, m] (each block's exact wgmma product times its relative weight
  scale, and with `mult_smem` [blocks, m] times each token's block scale too: the exact
  path's unfolded activation)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  wgmma_l = plgpu.Layout.WGMMA
  row_l, col_l = wgmma_l.reduce(1), wgmma_l.reduce(0)
  blocks = block_k // BLOCK

  def multiplier(scales_smem, b):
    """Block b's relative weight scales, 2^(s - R_n), a [64] row vector."""
    rel = _load(scales_smem.at[0, b], row_l).astype(jnp.int32)
    return plgpu.layout_cast(jax.lax.bitcast_convert_type(rel << 23, jnp.float32), row_l)

  def promote(total, part, scale, tokens=None):
    full = plgpu.layout_cast(jax.lax.broadcast_in_dim(scale, (ROWS, m), [0]), wgmma_l)
    if tokens is not None:
      full = full * plgpu.layout_cast(jax.lax.broadcast_in_dim(tokens, (ROWS, m), [1]), wgmma_l)
    return total + part * full

  def sums(total, x_smem, words_smem, scales_smem, mult_smem=None):
    for g in range(0, blocks, in_flight):  # `in_flight` blocks' wgmmas issued, then summed
      a = []
      for j in range(g // 2, (g + in_flight) // 2):
        a += _decode(_load(words_smem.at[0, j], plgpu.Layout.WG_STRIDED((128, 4), vec_size=4)))
      group = range(g, g + in_flight)

      def issue(*accs):
        for acc, b in zip(accs, group):
          plgpu.wgmma(acc, a[b - g], plgpu.transpose_ref(x_smem[b], (1, 0)))
        return tuple(_accumulate(acc, wait_n=len(accs) - 1 - i) for i, acc in enumerate(accs))

      parts = pl.run_scoped(issue, *[plgpu.ACC((ROWS, m)) for _ in group])
      for part, b in zip(parts, group):
        tokens = None if mult_smem is None else _load(mult_smem.at[b], col_l)
        total = promote(total, part, multiplier(scales_smem, b), tokens)
    return total

  return sums


def _specs(m, block_k, x_block, k_block, w_block, exact=False):
  """The pipeline's BlockSpecs for step q: x's blocks (K-major, 32-byte swizzle, as 8-bit
  wgmma reads B), the weight tile's words and relative scales; `exact`: also the tokens'
  block scales [blocks, m]."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  chunks, blocks = block_k // CHUNK_K, block_k // BLOCK
  x = [plgpu.BlockSpec((m, BLOCK), lambda q, b=b: (x_block(q), blocks * k_block(q) + b),
                       transforms=(plgpu.TilingTransform((8, BLOCK)),
                                   plgpu.SwizzleTransform(BLOCK)))
       for b in range(blocks)]
  mult = [plgpu.BlockSpec((blocks, m), lambda q: (k_block(q), x_block(q)))] if exact else []
  return [*x, plgpu.BlockSpec((1, chunks, 128, 4), lambda q: (w_block(q), k_block(q), 0, 0)),
          plgpu.BlockSpec((1, blocks, 64), lambda q: (w_block(q), k_block(q), 0)), *mult]


def _body(x_gmem, words_gmem, scales_gmem, mult_gmem, exact_gmem, *rest, block_k, steps,
          max_concurrent_steps, in_flight, tile_m=None):
  """One [64, M] tile of y^T (dense), or with `tile_m` and a table (`rest` = tile_expert, out)
  one [64, tile_m] tile of the grouped product (token tile t of x against expert
  tile_expert[t]'s rows); tiles past the table's last entry do nothing. `in_flight` (2, 4 or 8,
  dividing the step's blocks): the blocks whose wgmmas are issued before the first is
  summed. `exact_gmem` [1] int32: 0 for an x folded per token (`activation_e4m3`), else the
  exact path: x unfolded and its block scales `mult_gmem` [K/32, M] applied per block
  (`activation_unfolded`); a branch inside the kernel, so nothing waits on the host."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  *table, out_gmem = rest
  ni, si = jax.lax.axis_index("n"), jax.lax.axis_index("s")
  ti = jax.lax.axis_index("t") if table else 0
  m = tile_m or x_gmem.shape[0]
  blocks = block_k // BLOCK
  wi = ni
  if table:
    wi = table[0][ti] * jax.lax.axis_size("n") + ni
  sums = _chunk_sums(m, block_k, in_flight)
  k0 = si * steps

  def pipeline(exact):
    n_in = blocks + 2 + exact
    return plgpu.emit_pipeline(
        lambda _, *smem: sums(smem[-1], smem[:blocks], *smem[blocks:n_in]),
        grid=(steps,),
        in_specs=_specs(m, block_k, lambda q: ti if table else 0, lambda q: k0 + q,
                        lambda q: wi, exact=exact),
        max_concurrent_steps=max_concurrent_steps,
        init_carry=plgpu.layout_cast(jnp.zeros((ROWS, m), jnp.float32), plgpu.Layout.WGMMA),
    )

  def tile(exact):
    total = pipeline(exact)(*[x_gmem] * blocks, words_gmem, scales_gmem,
                            *[mult_gmem] * exact)
    _store(total, out_gmem, si, ni, ROWS, cols=pl.ds(ti * m, m) if table else slice(None))

  def run():
    flag = exact_gmem[0]
    pl.when(flag == 0)(lambda: tile(False))
    pl.when(flag != 0)(lambda: tile(True))

  if table:
    pl.when(ti < table[0][table[0].shape[0] - 1])(run)
  else:
    run()


def _kernel(name, body, out_shape, grid, names):
  from jax.experimental.pallas import mosaic_gpu as plgpu
  body.__name__ = name  # the kernel's name in profiles
  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, jnp.float32), grid=grid,
                      grid_names=names, compiler_params=plgpu.CompilerParams(
                          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))


def pipeline(m: int, k: int, block_k: int | None = None,
             max_concurrent_steps: int | None = None) -> tuple[int, int]:
  """(block_k, steps in flight) for M tokens and K: what is given, the rest as measured best on
  the H200 (BENCHMARKS.md, "W4A4 on FP8 tensor cores"): K steps of 512 values up to 32 tokens,
  256 past them (smaller where K takes no more), two steps in flight; checked against shared
  memory."""
  if block_k is None:
    fits = [bk for bk in ((512, 256) if m <= 32 else (256,)) + (128, 64) if k % bk == 0]
    if not fits:
      raise ValueError(f"K ({k}) must be a multiple of {CHUNK_K}")
    block_k = fits[0]
  steps = max_concurrent_steps or 2
  stage = block_k * m + block_k // CHUNK_K * 2048 + block_k // BLOCK * ROWS
  if k % block_k or block_k % CHUNK_K or steps * stage + ROWS * m * 4 + 4096 > SMEM_BYTES:
    raise ValueError(f"block_k ({block_k}) must be a multiple of {CHUNK_K} dividing K ({k}) "
                     f"whose {steps} steps in flight fit shared memory at M = {m}")
  return block_k, steps


def default_splits(m: int, n: int, k_steps: int) -> int:
  """K splits, as measured best on the H200: enough for four blocks of the grid per
  multiprocessor up to 32 tokens, two past them (their partial sums cost a pass each)."""
  return tiling.default_splits(1, n // ROWS, k_steps, programs=(4 if m <= 32 else 2) * 132,
                            max_splits=8)


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "max_concurrent_steps",
                                             "in_flight"))
def w4a4_partials(x8, words, scales, mult=None, exact=None, *, block_k: int = 256,
                  splits: int = 1, max_concurrent_steps: int = 2, in_flight: int = 2):
  """x8 E4M3 [M, K] (M a multiple of 16, at most 64), a weight's words [N/64, K/64, 512] and
  relative scales [N/64, K/32, 64] (`w4a4_layout.tile`) -> float32 [splits, N, M] partials of
  y^T, before the rows' and tokens' powers of two. `exact` (int32 [1], traced; default 0):
  nonzero where x8 is the unfolded activation, whose block scales `mult` [K/32, M] the kernel
  then applies (`w4a4_layout.activation_unfolded`)."""
  m, k = x8.shape
  n = words.shape[0] * ROWS
  if m % 16 or m > MAX_M or words.shape[1:] != (k // CHUNK_K, 512) or k % (block_k * splits):
    raise ValueError(f"the W4A4 kernel needs x [M, K] with M ({m}) a multiple of 16 up to "
                     f"{MAX_M}, words [N/64, K/64, 512] (got {words.shape} for K = {k}) and K "
                     f"divisible by block_k ({block_k}) x splits ({splits})")
  _check_in_flight(in_flight, block_k)
  mult, exact = _exact_args(mult, exact, k, m)
  steps = k // block_k // splits
  body = functools.partial(_body, block_k=block_k, steps=steps, in_flight=in_flight,
                           max_concurrent_steps=min(max_concurrent_steps, steps))
  return _kernel("w4a4_wgmma", body, (splits, n, m), (n // ROWS, splits), ("n", "s"))(
      x8, words.reshape(*words.shape[:2], 128, 4), scales, mult, exact)


@functools.partial(jax.jit, static_argnames=("block_k", "splits", "max_concurrent_steps",
                                             "in_flight"))
def grouped_w4a4_partials(x8, words, scales, tile_expert, mult=None, exact=None, *,
                          block_k: int = 128, splits: int = 1, max_concurrent_steps: int = 4,
                          in_flight: int = 2):
  """The grouped form: x8 E4M3 [16 x tiles, K] (rows in 16-token tiles), per-expert words
  [E, N/64, K/64, 512] and scales [E, N/64, K/32, 64], tile_expert [tiles + 1] (each tile's
  expert, then the tiles in use) -> float32 [splits, N, 16 x tiles]; unused tiles' columns are
  left unwritten. `mult` [K/32, 16 x tiles] and `exact` as in `w4a4_partials`."""
  r, k = x8.shape
  e, n = words.shape[0], words.shape[1] * ROWS
  if r % 16 or tile_expert.shape != (r // 16 + 1,) or words.shape[2:] != (k // CHUNK_K, 512) \
      or k % (block_k * splits):
    raise ValueError(f"the grouped W4A4 kernel needs x in 16-token tiles with one table entry a "
                     f"tile and one more (got {r} rows, {tile_expert.shape} entries), words "
                     f"[E, N/64, K/64, 512] (got {words.shape} for K = {k}) and K divisible by "
                     f"block_k ({block_k}) x splits ({splits})")
  _check_in_flight(in_flight, block_k)
  mult, exact = _exact_args(mult, exact, k, r)
  steps = k // block_k // splits
  body = functools.partial(_body, block_k=block_k, steps=steps, in_flight=in_flight,
                           max_concurrent_steps=min(max_concurrent_steps, steps), tile_m=16)
  grid, names = ((n // ROWS, r // 16, splits), ("n", "t", "s")) if r // 16 <= 65535 else (
      (n // ROWS, splits, r // 16), ("n", "s", "t"))
  return _kernel("grouped_w4a4_wgmma", body, (splits, n, r), grid, names)(
      x8, words.reshape(-1, words.shape[2], 128, 4), scales.reshape(-1, *scales.shape[2:]),
      mult, exact, tile_expert.astype(jnp.int32))


def _exact_args(mult, exact, k: int, m: int):
  """The exact path's inputs, checked; by default the folded path (exact 0, mult unread)."""
  mult = jnp.zeros((k // BLOCK, m), jnp.float32) if mult is None else mult
  exact = jnp.zeros((1,), jnp.int32) if exact is None else jnp.reshape(exact, (1,))
  if mult.shape != (k // BLOCK, m) or mult.dtype != jnp.float32:
    raise ValueError(f"the exact path's block scales must be float32 [K/32, M] = "
                     f"{(k // BLOCK, m)}, got {mult.dtype} {mult.shape}")
  return mult, exact.astype(jnp.int32)


def _check_in_flight(in_flight: int, block_k: int) -> None:
  if in_flight not in (2, 4, 8) or (block_k // BLOCK) % in_flight:
    raise ValueError(f"in_flight must be 2, 4 or 8 and divide the step's {block_k // BLOCK} "
                     f"blocks (block_k {block_k}), got {in_flight}")


def fold_misses(xq: QArray) -> jax.Array:
  """How many of the activation's blocks the E4M3 fold cannot hold (the exact path's cause)."""
  return activation_e4m3(xq)[2]


def _check(w, grouped: bool, name: str):
  if not isinstance(w, TiledW4) or w.grouped != grouped:
    what = "per-expert [E, K, N]" if grouped else "[K, N]"
    raise ValueError(f"{name} takes a {what} MXFP4 weight in the W4A4 layout "
                     f"(w4a4_layout.tile), got {type(w).__name__} {getattr(w, 'shape', None)}")


def _scaled(partials, row_exp, token_exp):
  """The K splits summed, each row's 2^(R_n - 127) and token's 2^(R_t - 127 - 12) applied."""
  shift = 127 + WEIGHT_SHIFT + ACT_SHIFT
  y_t = jnp.sum(partials, axis=0) * row_scale(row_exp, 127)[:, None]
  return y_t * row_scale(token_exp, shift)[None, :]


def w4a4_matmul(xq: QArray, w: TiledW4, *, block_k: int | None = None,
                splits: int | None = None, max_concurrent_steps: int | None = None,
                in_flight: int = 2, exact_path: str = "kernel") -> jax.Array:
  """An MXFP4 activation xq [M, K] (quantized along K) @ an MXFP4 weight in the W4A4 layout
  -> [M, N] bf16, on FP8 tensor cores (compiled Hopper only); calls of up to 64 tokens.
  exact_path, for a call whose activation has blocks the fold cannot hold (`fold_misses`):
  "kernel" (the kernel's own branch: the activation unfolded, its block scales applied per
  block; decided on the device), "xla" (the call by XLA's dequantize-then-dot instead, behind
  a `lax.cond`, whose predicate XLA's GPU backend reads on the host) or "none" (no check: such
  blocks are then rounded)."""
  _check(w, False, "w4a4_matmul")
  k, n = w.shape
  if xq.shape[-1] != k:
    raise ValueError(f"x has {xq.shape[-1]} features, the weight expects {k}")
  x8, token_exp, misses = activation_e4m3(xq)
  x8, mult, exact = _exact_operands(xq, x8, misses, exact_path)
  m = x8.shape[0]
  mp = 16 if m <= 16 else -(-m // 32) * 32 if m <= MAX_M else -(-m // MAX_M) * MAX_M
  rows = min(mp, MAX_M)
  x8 = jnp.pad(x8, ((0, mp - m), (0, 0)))
  mult = jnp.pad(mult, ((0, 0), (0, mp - m)))
  token_exp = jnp.pad(token_exp, (0, mp - m), constant_values=127)
  block_k, stages = pipeline(rows, k, block_k, max_concurrent_steps)
  splits = splits or default_splits(rows, n, k // block_k)

  def call(x8c, multc, expc):
    partials = w4a4_partials(x8c, w.words, w.scales, multc, exact, block_k=block_k,
                             splits=splits, max_concurrent_steps=stages, in_flight=in_flight)
    return _scaled(partials, w.row_exp, expc)

  if mp <= MAX_M:
    y_t = call(x8, mult, token_exp)
  else:
    y_t = jax.lax.map(lambda a: call(a[0], a[1].T, a[2]),
                      (x8.reshape(-1, MAX_M, k), mult.T.reshape(-1, MAX_M, k // BLOCK),
                       token_exp.reshape(-1, MAX_M)))
    y_t = jnp.moveaxis(y_t, 0, 1).reshape(n, -1)
  y = _transposed(y_t.astype(jnp.bfloat16))[:m]
  if exact_path != "xla":
    return y
  exact = lambda: reference.fp4_matmul(_dequantized(xq), untile(w))
  return jax.lax.cond(misses > 0, exact, lambda: y)


EXACT_PATHS = ("kernel", "xla", "none")


def _exact_operands(xq: QArray, x8, misses, exact_path: str):
  """(x8, mult [K/32, M], exact int32) the kernel takes: under "kernel", the unfolded
  activation and its block scales where the call has fold misses, else the folded x8."""
  if exact_path not in EXACT_PATHS:
    raise ValueError(f"exact_path must be one of {EXACT_PATHS}, got {exact_path!r}")
  m, k = x8.shape
  if exact_path != "kernel":
    return x8, jnp.zeros((k // BLOCK, m), jnp.float32), jnp.zeros((1,), jnp.int32)
  unfolded, mult = activation_unfolded(xq)
  exact = misses > 0
  return jnp.where(exact, unfolded, x8), mult, exact.astype(jnp.int32)[None]


def _dequantized(xq: QArray) -> jax.Array:
  from trace_jax.quant import dequantize
  return dequantize(xq).astype(jnp.bfloat16)


def grouped_w4a4_matmul(xq: QArray, w: TiledW4, group_sizes: jax.Array, *,
                        block_k: int | None = None, splits: int | None = None,
                        max_concurrent_steps: int | None = None, in_flight: int = 2,
                        exact_path: str = "kernel", rows_in: jax.Array | None = None,
                        rows_out: jax.Array | None = None, slots=None) -> jax.Array:
  """The MoE expert matmul on FP8 tensor cores: xq [T, K] (MXFP4, rows sorted by expert) @
  W[e] -> [T, N] bf16 for per-expert weights in the W4A4 layout; rows past sum(group_sizes)
  come out zero. exact_path as in `w4a4_matmul`; rows_in / rows_out / slots as in
  `api.grouped_fp4_matmul` (composed with the tiles' gathers)."""
  _check(w, True, "grouped_w4a4_matmul")
  e, k, n = w.shape
  if xq.shape[-1] != k or group_sizes.shape != (e,):
    raise ValueError(f"grouped_w4a4_matmul takes x [T, {k}] and group_sizes [{e}] for this "
                     f"weight, got x {xq.shape} and group_sizes {group_sizes.shape}")
  x8, token_exp, misses = activation_e4m3(xq)
  x8, mult, exact = _exact_operands(xq, x8, misses, exact_path)
  # the grouped kernel's measured defaults: K steps of 256 values (or fewer), four in flight
  block_k = block_k or next((bk for bk in (256, 128, 64) if k % bk == 0), CHUNK_K)
  block_k, stages = pipeline(16, k, block_k, max_concurrent_steps or 4)
  src, tile_expert, dest = tiling.place_rows(group_sizes, tiling.sorted_rows(x8, rows_in), 16,
                                             rows_in, rows_out, x8.shape[0], slots)
  xt = jnp.take(x8, src, axis=0, mode="fill", fill_value=0)  # [16 x tiles, K]
  exp_t = jnp.take(token_exp, src, mode="fill", fill_value=127)
  mult_t = jnp.take(mult, src, axis=1, mode="fill", fill_value=0)
  splits = splits or tiling.default_splits(xt.shape[0] // 16, n // ROWS, k // block_k,
                                        programs=2 * 132, max_splits=8)
  partials = grouped_w4a4_partials(xt, w.words, w.scales, tile_expert, mult_t, exact,
                                   block_k=block_k, splits=splits,
                                   max_concurrent_steps=stages, in_flight=in_flight)
  # each tile's rows take their expert's row scales
  y_t = jnp.sum(partials, axis=0)  # [N, 16 x tiles]
  rows_of = jnp.repeat(tile_expert[:-1], 16)  # each column's expert
  y_t = y_t * jnp.take(row_scale(w.row_exp, 127), rows_of, axis=0).T
  y_t = y_t * row_scale(exp_t, 127 + WEIGHT_SHIFT + ACT_SHIFT)[None, :]
  y = _transposed(jnp.take(y_t.astype(jnp.bfloat16), dest, axis=1, mode="fill", fill_value=0))
  if exact_path != "xla":
    return y
  exact = lambda: reference.grouped_fp4_matmul(_dequantized(xq), untile(w), group_sizes,
                                               rows_in, rows_out)
  return jax.lax.cond(misses > 0, exact, lambda: y)


# ----------------------------------------------------------------------------------------------
# the kernels' arithmetic in XLA, for backends without them (the engine's CPU path and tests)


def _emulated_t(xq: QArray, w: TiledW4) -> jax.Array:
  """y^T [..., N, M] float32 before the rows' and tokens' powers of two, for a [K, N] weight
  (or [E, K, N], each expert against every token): each block's exact product times the
  weight block's relative scale (and, on the exact branch, the token block's), summed over the
  blocks in float32; the branch chosen, as in the kernel, by the call's fold misses."""
  x8, _, misses = activation_e4m3(xq)
  unfolded, mult = activation_unfolded(xq)
  *lead, k, n = w.shape
  exact = misses > 0
  a = jnp.where(exact, unfolded, x8).astype(jnp.float32).reshape(-1, k // BLOCK, BLOCK)
  wv = e4m3_values(w).reshape(*lead, k // BLOCK, BLOCK, n)
  parts = jnp.einsum("mbk,...bkn->...bnm", a, wv, precision="highest")  # exact: small integers
  scale = scale_multipliers(w)[..., :, :, None]  # [..., K/32, N, 1]
  scale = scale * jnp.where(exact, mult, 1.0)[:, None, :]  # [K/32, 1, M]
  return jnp.sum(parts * scale, axis=-3)


def emulated_matmul(xq: QArray, w: TiledW4) -> jax.Array:
  """`w4a4_matmul`'s numbers by XLA (any backend; the "kernel" exact path): xq [M, K] MXFP4,
  w [K, N] in the W4A4 layout -> [M, N] bf16."""
  _check(w, False, "emulated_matmul")
  token_exp = activation_e4m3(xq)[1]
  return _scaled(_emulated_t(xq, w)[None], w.row_exp, token_exp).T.astype(jnp.bfloat16)


def emulated_grouped_matmul(xq: QArray, w: TiledW4, group_sizes: jax.Array,
                            rows_in: jax.Array | None = None,
                            rows_out: jax.Array | None = None, slots=None) -> jax.Array:
  """`grouped_w4a4_matmul`'s numbers by XLA: rows sorted by expert, each through its expert's
  weight (every expert computed for every row, then the row's taken: for small tests and
  backends without the kernel); rows past sum(group_sizes) come out zero; rows_in / rows_out
  as there (`slots`, the same rows per slot, changes nothing here)."""
  _check(w, True, "emulated_grouped_matmul")
  if rows_in is not None:
    xq = QArray(xq.codes[rows_in], xq.scales[rows_in], xq.global_scale, xq.fmt, xq.axis)
  if rows_out is not None:
    return emulated_grouped_matmul(xq, w, group_sizes)[rows_out]
  e = w.shape[0]
  m = xq.shape[0]
  token_exp = activation_e4m3(xq)[1]
  y_t = _emulated_t(xq, w) * row_scale(w.row_exp, 127)[..., None]  # [E, N, M]
  y_t = y_t * row_scale(token_exp, 127 + WEIGHT_SHIFT + ACT_SHIFT)[None, None, :]
  expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(m), side="right")
  y = jnp.take_along_axis(jnp.moveaxis(y_t, -1, 0),  # [M, E, N]
                          jnp.minimum(expert, e - 1)[:, None, None], axis=1)[:, 0]
  return jnp.where((expert < e)[:, None], y, 0.0).astype(jnp.bfloat16)
