"""Pallas (Triton lowering) kernel: bf16 activations x packed FP4 weights, unpacked in registers.

Layout: W [K, N] quantized along K, codes [K/2, N] (the low nibble is the even K index),
scales [K/B, N]. Splitting x into its even and odd K columns (x_e, x_o: [M, K/2], a cheap
gather on the small activation) turns the nibble interleave into two dots:

    y = x_e @ dec(codes & 15) + x_o @ dec(codes >> 4)

Each step of the K loop takes 16 packed rows (32 K values: one MXFP4 block, two NVFP4 blocks),
decodes them to exact bf16 (E2M1 x scale) and issues the two dots with float32 accumulation.
The grid is (N tiles, M tiles, K splits): decode batches are small, so the K range is split to
give every multiprocessor work; the splits' float32 partials are summed outside.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 16  # packed rows per step: the smallest bf16 dot depth


def e2m1(codes):
  """4-bit E2M1 codes (int32) -> float32, by arithmetic (no table lookups in the kernel)."""
  m = codes & 7
  big = jnp.left_shift(1, m >> 1).astype(jnp.float32) * (2 + (m & 1)).astype(jnp.float32) * 0.25
  mag = jnp.where(m < 2, m.astype(jnp.float32) * 0.5, big)
  return jnp.where((codes & 8) != 0, -mag, mag)


def e8m0(s):
  """E8M0 scale bytes (int32) -> float32 2^(s - 127) (byte 0 flushes to 0; 255 is not finite)."""
  return jax.lax.bitcast_convert_type(jnp.left_shift(s, 23), jnp.float32)


def e4m3(s):
  return jax.lax.bitcast_convert_type(s.astype(jnp.uint8), jnp.float8_e4m3fn).astype(jnp.float32)


def _kernel(xe_ref, xo_ref, codes_ref, scales_ref, *refs, fmt: str, block_m: int,
            block_n: int, rows_per_split: int):
  out_ref = refs[-1]  # refs[0] is the poisoned output buffer when one is passed (aliased)
  n0 = pl.program_id(0) * block_n
  m0 = pl.program_id(1) * block_m
  base = pl.program_id(2) * rows_per_split
  group = 16 if fmt == "mxfp4" else 8  # packed rows per scale row

  def step(i, acc):
    r0 = base + i * ROWS
    codes = codes_ref[pl.ds(r0, ROWS), pl.ds(n0, block_n)].astype(jnp.int32)
    if fmt == "mxfp4":
      scale = e8m0(scales_ref[pl.ds(r0 // group, 1), pl.ds(n0, block_n)].astype(jnp.int32))
    else:  # two NVFP4 blocks per step: rows 0-7 take the first scale row, 8-15 the second
      first = e4m3(scales_ref[pl.ds(r0 // group, 1), pl.ds(n0, block_n)])
      second = e4m3(scales_ref[pl.ds(r0 // group + 1, 1), pl.ds(n0, block_n)])
      rows = jax.lax.broadcasted_iota(jnp.int32, (ROWS, block_n), 0)
      scale = jnp.where(rows < group, first, second)
    w_even = (e2m1(codes & 15) * scale).astype(jnp.bfloat16)
    w_odd = (e2m1(codes >> 4) * scale).astype(jnp.bfloat16)
    xe = xe_ref[pl.ds(m0, block_m), pl.ds(r0, ROWS)]
    xo = xo_ref[pl.ds(m0, block_m), pl.ds(r0, ROWS)]
    acc += jnp.dot(xe, w_even, preferred_element_type=jnp.float32)
    return acc + jnp.dot(xo, w_odd, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  out_ref[...] = jax.lax.fori_loop(0, rows_per_split // ROWS, step, acc)


def _bf16_kernel(x_ref, w_ref, *refs, block_m: int, block_n: int, block_k: int,
                 k_per_split: int):
  out_ref = refs[-1]
  n0 = pl.program_id(0) * block_n
  m0 = pl.program_id(1) * block_m
  base = pl.program_id(2) * k_per_split

  def step(i, acc):
    k0 = base + i * block_k
    x = x_ref[pl.ds(m0, block_m), pl.ds(k0, block_k)]
    w = w_ref[pl.ds(k0, block_k), pl.ds(n0, block_n)]
    return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  out_ref[...] = jax.lax.fori_loop(0, k_per_split // block_k, step, acc)


def _compiler_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _call(kernel, inputs, out_shape, grid, block_m, block_n, num_warps, num_stages, interpret,
          poison):
  """pallas_call with the [splits, M, N] partial output; with `poison`, the output starts as a
  NaN-filled buffer (aliased), so an element the kernel fails to write stays NaN."""
  out_spec = pl.BlockSpec((None, block_m, block_n), lambda i, j, s: (s, j, i))
  aliases = {}
  in_specs = [pl.no_block_spec] * len(inputs)
  if poison:
    inputs = (*inputs, jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    in_specs.append(out_spec)
    aliases = {len(inputs) - 1: 0}
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
      interpret=interpret)(*inputs)


@functools.partial(jax.jit, static_argnames=("fmt", "block_m", "block_n", "splits", "num_warps",
                                             "num_stages", "interpret", "poison"))
def fp4_matmul_partials(xe, xo, codes, scales, *, fmt: str, block_m: int = 16,
                        block_n: int = 128, splits: int = 1, num_warps: int = 4,
                        num_stages: int = 3, interpret: bool = False, poison: bool = False):
  """-> float32 [splits, M, N] partial products (M a multiple of block_m)."""
  m, k2 = xe.shape
  n = codes.shape[1]
  kernel = functools.partial(_kernel, fmt=fmt, block_m=block_m, block_n=block_n,
                             rows_per_split=k2 // splits)
  return _call(kernel, (xe, xo, codes, scales), jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), block_m, block_n, num_warps, num_stages,
               interpret, poison)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "splits",
                                             "num_warps", "num_stages", "interpret", "poison"))
def bf16_matmul_partials(x, w, *, block_m: int = 16, block_n: int = 128, block_k: int = 64,
                         splits: int = 1, num_warps: int = 4, num_stages: int = 3,
                         interpret: bool = False, poison: bool = False):
  """The same design on a bf16 weight: the baseline the FP4 kernel is measured against."""
  m, k = x.shape
  n = w.shape[1]
  kernel = functools.partial(_bf16_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                             k_per_split=k // splits)
  return _call(kernel, (x, w), jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), block_m, block_n, num_warps, num_stages,
               interpret, poison)
