"""JAX's own Mosaic GPU (Hopper, wgmma) grouped bf16 matmul, a baseline for the grouped kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_bf16_matmul(x_TxK: jax.Array, w: jax.Array, group_sizes_E: jax.Array, *,
                        block_m: int = 64, block_n: int = 128, block_k: int = 64,
                        max_concurrent_steps: int = 4, grid_block_n: int = 1,
                        transpose_rhs: bool = False) -> jax.Array:
  """jax.lax.ragged_dot(x, w, group_sizes) in x's dtype by
  `jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot` (one signature in jax 0.10.2 and
  0.11.2): rows sorted by group, w [E, K, N] or, with transpose_rhs, [E, N, K], of x's dtype.

  Its constraints: block_m a multiple of 64 (the wgmma M); K a multiple of block_k; the
  pipeline's max_concurrent_steps x (block_m + block_n) x block_k operands plus a
  [block_m, block_n] output tile within shared memory (an error when lowered); int32 group
  sizes. It walks ceil(T / block_m) + E - 1 row tiles, and an empty group that does not start
  on a block_m boundary still gets one, which streams that expert's whole weight: at decode
  (most of 128 experts empty) it reads nearly every expert, not only those hit. Its grid
  assumes 132 SMs (H100 / H200).
  """
  # imported here: the module imports jax's test utilities (absl) and Mosaic GPU
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  return ragged_dot_mgpu.ragged_dot(
      x_TxK, w, group_sizes=group_sizes_E.astype(jnp.int32), block_m=block_m,
      block_n=block_n, block_k=block_k, max_concurrent_steps=max_concurrent_steps,
      grid_block_n=grid_block_n, transpose_rhs=transpose_rhs)
