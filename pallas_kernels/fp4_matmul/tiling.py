"""Tiling shared by the FP4 matmul kernels and their dispatch: the K splits that fill the
H200, and where the rows of a grouped (MoE) matmul go when each group is padded to whole tiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def default_splits(m_tiles: int, n_tiles: int, k_steps: int, programs: int = 4 * 132,
                   max_splits: int = 16) -> int:
  """K splits that give each of the H200's 132 multiprocessors several programs (powers of two
  dividing the K steps, at most max_splits): decode-sized M leaves too few tiles otherwise."""
  splits = 1
  while (m_tiles * n_tiles * splits < programs and k_steps % (splits * 2) == 0
         and splits < max_splits):
    splits *= 2
  return splits


def sorted_rows(x, rows_in=None) -> int:
  """How many rows a grouped matmul sorts by expert: x's, or rows_in's where given."""
  return x.shape[0] if rows_in is None else rows_in.shape[0]


def tile_rows(group_sizes, t: int, block_m: int, rows_in=None, rows_out=None,
              x_rows: int | None = None):
  """Where T rows sorted by expert go when each group is padded to whole block_m-row tiles (at
  most ceil(T / block_m) + E tiles, a static bound):
  (src [tiles x block_m]: each padded row's source row, T (out of range) where it holds none;
  tile_expert [tiles + 1]: each tile's expert, then the number of tiles in use;
  dest [T]: each row's place among the padded rows, out of range past sum(group_sizes), so that
  reading an output back with mode="fill" gives those rows zeros).

  A grouped matmul whose sorted rows are a gather of its input, and whose output a gather of
  the sorted rows (the MoE dispatch: `api.grouped_fp4_matmul`'s rows_in and rows_out), composes
  the two with its own: rows_in [T] (the row of x, of x_rows, each sorted row is) makes src
  index x directly (x_rows where none); rows_out [S] (the sorted row each output row takes)
  makes dest [S], per output row. The sorted rows are then never written out."""
  e = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  tiles = -(-sizes // block_m)
  tile_end = jnp.cumsum(tiles)
  n_tiles = -(-t // block_m) + e  # static bound on sum(tiles)
  row_end = jnp.cumsum(sizes)
  rows_i = jnp.arange(t, dtype=jnp.int32)
  # compare_all: one fusion of T x E compares; the default (a scan) is a loop of log2(E) steps,
  # each of which a GPU while loop ends by reading its condition on the host
  expert_of_row = jnp.minimum(
      jnp.searchsorted(row_end, rows_i, side="right", method="compare_all"), e - 1)
  dest = (tile_end - tiles)[expert_of_row] * block_m + rows_i - (row_end - sizes)[expert_of_row]
  dest = jnp.where(rows_i < row_end[-1], dest, n_tiles * block_m)
  tile_expert = jnp.minimum(jnp.searchsorted(tile_end, jnp.arange(n_tiles), side="right",
                                             method="compare_all"), e - 1).astype(jnp.int32)
  slot = jnp.arange(n_tiles * block_m, dtype=jnp.int32)
  slot_expert = tile_expert[slot // block_m]
  offset = slot - (tile_end - tiles)[slot_expert] * block_m
  used = (offset < sizes[slot_expert]) & (slot // block_m < tile_end[-1])
  src = jnp.where(used, (row_end - sizes)[slot_expert] + offset, t)
  if rows_in is not None:
    src = jnp.where(used, rows_in.astype(jnp.int32)[jnp.minimum(src, t - 1)], x_rows)
  if rows_out is not None:
    dest = dest[rows_out]
  # the table's last entry: the tiles in use; the kernels skip the rest (zeros). The barrier
  # makes XLA compute the three index arrays once, in fusions of their own: fused into the
  # gathers that read them, the arithmetic above (T x E compares among it) ran again for every
  # element gathered (the largest XLA kernels of the 48-layer decode step, BENCHMARKS.md)
  return jax.lax.optimization_barrier(
      (src, jnp.append(tile_expert, tile_end[-1].astype(jnp.int32)), dest))


def tile_slots(slot_expert, slot_source, group_sizes, block_m: int, x_rows: int):
  """`tile_rows` of a MoE dispatch, from each output row's expert and input row, with no sort:
  output row j (a (token, expert slot) pair) is its expert's rank-th row, rank the number of
  rows before j with the same expert (the order of a stable sort by expert), and takes input
  row slot_source[j] (j // k for one row per token, j for one per slot). The same (src,
  tile_expert, dest) as `tile_rows(group_sizes, S, block_m, rows_in, rows_out, x_rows)` with
  the sorted rows' rows_in and rows_out (`layers.Dispatch`), where group_sizes counts every row
  (sum(group_sizes) = S), in fewer passes: an [S, S] count for the ranks, a [tiles x block_m,
  S] match for src and an [tiles + 1, E] count for the table, in place of the sort, the
  permutation's inverse and two searchsorted. Quadratic in S: for decode-sized dispatches
  (S = batch x top_k, a few thousand rows at most)."""
  s = slot_expert.shape[0]
  e = group_sizes.shape[0]
  sizes = group_sizes.astype(jnp.int32)
  tiles = -(-sizes // block_m)
  tile_end = jnp.cumsum(tiles)
  n_tiles = -(-s // block_m) + e  # the static bound of tile_rows
  expert = slot_expert.astype(jnp.int32)
  rows_j = jnp.arange(s, dtype=jnp.int32)
  rank = jnp.sum((expert[None, :] == expert[:, None]) & (rows_j[None, :] < rows_j[:, None]),
                 axis=1, dtype=jnp.int32)
  dest = (tile_end - tiles)[expert] * block_m + rank
  slot = jnp.arange(n_tiles * block_m, dtype=jnp.int32)
  hit = dest[None, :] == slot[:, None]
  src = jnp.where(jnp.any(hit, axis=1),
                  jnp.sum(jnp.where(hit, slot_source.astype(jnp.int32)[None, :], 0), axis=1),
                  x_rows)
  t = jnp.arange(n_tiles + 1, dtype=jnp.int32)
  tile_expert = jnp.where(
      t < n_tiles, jnp.minimum(jnp.sum(tile_end[None, :] <= t[:, None], axis=1), e - 1),
      tile_end[-1]).astype(jnp.int32)
  return jax.lax.optimization_barrier((src, tile_expert, dest))


# the largest dispatch `place_rows` places by `tile_slots` (its counts are S x S): a decode
# step's (batch x top_k); a prefill's many more rows take the sort's placement
SLOTS_MAX = 4096


def place_rows(group_sizes, t: int, block_m: int, rows_in=None, rows_out=None,
               x_rows: int | None = None, slots=None):
  """The grouped matmuls' row placement: `tile_slots` where the dispatch's per-slot form
  `slots` (each output row's expert and input row, `layers.ExpertRows`) is given and at most
  SLOTS_MAX rows, else `tile_rows` from the sorted rows' rows_in and rows_out."""
  if slots is None:
    return tile_rows(group_sizes, t, block_m, rows_in, rows_out, x_rows)
  want = rows_out.shape if rows_out is not None else (t,)
  if slots[0].shape != want or slots[1].shape != want:
    raise ValueError(f"slots are each output row's expert and input row, two vectors of "
                     f"{want[0]}; got {slots[0].shape} and {slots[1].shape}")
  if want[0] <= SLOTS_MAX:
    return tile_slots(*slots, group_sizes, block_m, x_rows)
  return tile_rows(group_sizes, t, block_m, rows_in, rows_out, x_rows)
