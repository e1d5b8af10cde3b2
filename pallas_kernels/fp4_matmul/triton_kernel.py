"""The bf16 matmul, dense and grouped, in Triton's own language (`pallas_kernels.triton_call`):
`kernel._bf16_kernel` moved off Pallas' deprecated Triton lowering, the same program.

Grid (N tiles, M tiles, K splits): a program computes one [BLOCK_M, BLOCK_N] tile of one K
split's float32 partial sum, stepping BLOCK_K columns at a time. GROUPED: the weight is per
expert [E, K, N], tiles[t] is M tile t's expert and tiles[M / BLOCK_M] the count of tiles in
use (`tiling.place_rows`' table); the tiles past them write zeros without reading the weight.
Imported through `triton_call.load`.
"""

import triton
import triton.language as tl


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
