"""The matmuls of `kernel.py` in Triton's own language (`pallas_kernels.triton_call`), moved off
Pallas' deprecated Triton lowering, the same programs: `bf16_matmul` (`kernel._bf16_kernel`)
and `fp4_matmul` (`kernel._kernel` on the [K, N] weight: bf16 x packed MXFP4 / NVFP4, the
FP4 matmuls of GPUs without the Mosaic kernels' wgmma).

Grid (N tiles, M tiles, K splits): a program computes one [BLOCK_M, BLOCK_N] tile of one K
split's float32 partial sum, stepping through K. GROUPED: the weight is per expert, tiles[t] is
M tile t's expert and tiles[M / BLOCK_M] the count of tiles in use (`tiling.place_rows`'
table); the tiles past them write zeros without reading the weight.
Imported through `triton_call.load`.
"""

import triton
import triton.language as tl

from pallas_kernels.decode_attention.triton_kernel import decode_pairs, scale_f32


@triton.jit
def bf16_matmul(x_ptr, w_ptr, tiles_ptr, o_ptr, M: tl.constexpr, K: tl.constexpr,
                N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, GROUPED: tl.constexpr,
                INTERPRET: tl.constexpr):
  """x [M, K] bf16, w [K, N] (or [E, K, N] GROUPED) bf16, tiles int32 [M / BLOCK_M + 1]
  (read GROUPED only) -> o [splits, M, N] float32."""
  n_tile = tl.program_id(0)
  m_tile = tl.program_id(1)
  split = tl.program_id(2)
  rm = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
  rk = tl.arange(0, BLOCK_K)
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  w_at = w_ptr
  if GROUPED:
    w_at = w_ptr + tl.load(tiles_ptr + m_tile).to(tl.int64) * K * N
    if m_tile < tl.load(tiles_ptr + M // BLOCK_M):
      acc = _k_steps(x_ptr, w_at, acc, rm, rn, rk, split, K, N, BLOCK_K, K_PER_SPLIT, INTERPRET)
  else:
    acc = _k_steps(x_ptr, w_at, acc, rm, rn, rk, split, K, N, BLOCK_K, K_PER_SPLIT, INTERPRET)
  tl.store(o_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc)


@triton.jit
def _k_steps(x_ptr, w_at, acc, rm, rn, rk, split, K: tl.constexpr, N: tl.constexpr,
             BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
  for i in range(0, K_PER_SPLIT // BLOCK_K):
    k = split * K_PER_SPLIT + i * BLOCK_K + rk
    x = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + k[None, :])
    w = tl.load(w_at + k[:, None].to(tl.int64) * N + rn[None, :])
    if INTERPRET:  # the interpreter's tl.dot takes bf16 as integers: float32, the same products
      x = x.to(tl.float32)
      w = w.to(tl.float32)
    acc += tl.dot(x, w)
  return acc


@triton.jit
def fp4_matmul(xe_ptr, xo_ptr, codes_ptr, scales_ptr, global_ptr, tiles_ptr, o_ptr,
               M: tl.constexpr, K2: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, ROWS: tl.constexpr, ROWS_PER_SPLIT: tl.constexpr,
               NVFP4: tl.constexpr, ASM: tl.constexpr, GROUPED: tl.constexpr,
               INTERPRET: tl.constexpr):
  """x's even and odd K columns xe, xo [M, K / 2] bf16, the weight W [K, N] packed along K:
  codes [K / 2, N] (byte r: rows 2r and 2r + 1 of W in its low and high nibble) and scales
  [K / B, N] uint8, NVFP4's float32 global [1] (read NVFP4 only), or per expert ([E, K / 2, N],
  [E, K / B, N], globals [E]) GROUPED, tiles int32 [M / BLOCK_M + 1] (read GROUPED only)
  -> o [splits, M, N] float32: y = xe @ dec(codes & 15) + xo @ dec(codes >> 4), ROWS packed
  rows a step, decoded from the bits or by PTX (ASM, GPU only) as `kernel.decode_nibbles` does."""
  n_tile = tl.program_id(0)
  m_tile = tl.program_id(1)
  split = tl.program_id(2)
  rm = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
  rn = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
  rr = tl.arange(0, ROWS)
  GROUP: tl.constexpr = 8 if NVFP4 else 16  # packed rows a scale row
  acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
  if GROUPED:
    e = tl.load(tiles_ptr + m_tile).to(tl.int64)
    if m_tile < tl.load(tiles_ptr + M // BLOCK_M):
      acc = _fp4_steps(xe_ptr, xo_ptr, codes_ptr + e * K2 * N,
                       scales_ptr + e * (K2 // GROUP) * N, global_ptr + e, acc, rm, rn, rr,
                       split, K2, N, ROWS, ROWS_PER_SPLIT, GROUP, NVFP4, ASM, INTERPRET)
  else:
    acc = _fp4_steps(xe_ptr, xo_ptr, codes_ptr, scales_ptr, global_ptr, acc, rm, rn, rr, split,
                     K2, N, ROWS, ROWS_PER_SPLIT, GROUP, NVFP4, ASM, INTERPRET)
  tl.store(o_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc)


@triton.jit
def _fp4_steps(xe_ptr, xo_ptr, codes_at, scales_at, global_at, acc, rm, rn, rr, split,
               K2: tl.constexpr, N: tl.constexpr, ROWS: tl.constexpr,
               ROWS_PER_SPLIT: tl.constexpr, GROUP: tl.constexpr, NVFP4: tl.constexpr,
               ASM: tl.constexpr, INTERPRET: tl.constexpr):
  for i in range(0, ROWS_PER_SPLIT // ROWS):
    r = split * ROWS_PER_SPLIT + i * ROWS + rr  # the step's packed rows
    codes = tl.load(codes_at + r[:, None].to(tl.int64) * N + rn[None, :])
    s = tl.load(scales_at + (r // GROUP)[:, None].to(tl.int64) * N + rn[None, :]).to(tl.int32)
    scale = scale_f32(s, NVFP4)
    if NVFP4:
      scale = scale * tl.load(global_at)
    w_even, w_odd = decode_pairs(codes, scale, NVFP4, ASM, INTERPRET)
    xe = tl.load(xe_ptr + rm[:, None].to(tl.int64) * K2 + r[None, :])
    xo = tl.load(xo_ptr + rm[:, None].to(tl.int64) * K2 + r[None, :])
    if INTERPRET:  # the interpreter's tl.dot takes bf16 as integers: float32, the same products
      xe = xe.to(tl.float32)
      xo = xo.to(tl.float32)
    acc = acc + tl.dot(xe, w_even) + tl.dot(xo, w_odd)
  return acc
