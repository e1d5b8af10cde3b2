"""Pallas (Triton lowering) kernel: bf16 activations x packed FP4 weights, unpacked in registers.

Layout: W [K, N] quantized along K, codes [K/2, N] (the low nibble is the even K index),
scales [K/B, N]. Splitting x into its even and odd K columns (x_e, x_o: [M, K/2], a cheap
gather on the small activation) turns the nibble interleave into two dots:

    y = x_e @ dec(codes & 15) + x_o @ dec(codes >> 4)

Each step of the K loop takes `rows` packed rows (16 rows: 32 K values, one MXFP4 block or two
NVFP4 blocks), builds their bf16 values from bits and issues the two dots with float32
accumulation. The values are the rollout engine's XLA dequantization, bit for bit: MXFP4's
E2M1 x 2^e is exact in bf16; NVFP4's is bf16(E2M1 x (E4M3 x g)), the scale times the global
(per tensor, or per expert) in float32, then the product rounded to bf16, as
`NVFP4Format.from_grid` and the cast to bf16 compute it. Nothing multiplies the dots' results.
The grid is (N tiles, M tiles, K splits): decode batches are small, so the K range is split to
give every multiprocessor work; the splits' float32 partials are summed outside.

Variants, all with the same numerics: the decode in jnp integer operations ("bits") or in PTX
("asm", about a third of the instructions); the weight N-major as above or K-major (codes
[N, K/2], the decoded tile first in the product); and a few-row kernel of float32
multiply-adds instead of matrix instructions (`fp4_gemv_partials`). BENCHMARKS.md has what
each measured on the H200. The bf16 twins (`bf16_matmul_partials`, `grouped_bf16_partials`) run
the same grid on a bf16 weight, the baseline.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

ROWS = 16  # packed rows per K step by default; 16 is the smallest bf16 dot depth
DECODES = ("bits", "asm")


def e2m1_bf16(codes):
  """4-bit E2M1 codes (int32, or uint16 as the Mosaic kernel has them) -> bf16 by building the
  bits: E2M1's exponent and mantissa sit next to each other, so for magnitude codes m >= 2 the
  bf16 pattern is 0x3F00 + (m << 6); m = 1 is 0.5 (0x3F00) and m = 0 is zero. A few integer
  operations, no table, no float math."""
  m = codes & 7
  bits = jnp.where(m > 1, (m << 6) + 0x3F00, m * 0x3F00) | ((codes & 8) << 12)
  return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


# PTX: packed codes -> scaled bf16 values, four codes bytes per asm instance (Triton hands it
# four u8 elements in one register and their four scales in two registers (bf16) or four
# (float32); it returns four bf16 in two). PRMT moves bytes 0 and 1 (then 2 and 3) into the
# high byte of each 16-bit half; the chosen nibble's sign then lands on bf16's sign bit and its
# 3 exponent/mantissa bits on bf16 bits 8..6 with a shift and two masks: the E2M1 value times
# 2^-126 (0.5 lands on a bf16 subnormal, exactly). One bf16x2 FMA by 2^126 makes it the exact
# E2M1 pair. MXFP4 (`E2M1_ASM`): one more bf16x2 FMA by the power-of-two scale, exact; about
# 3.5 operations per element. NVFP4 (`E2M1_NV_ASM`): the pair split into two float32, each
# multiplied by its float32 scale (E4M3 x global) and the two rounded back to bf16 together,
# XLA's rounding; about 5.5 operations per element. One asm per nibble: jax lowers single-result
# asm.
_PAIR = """
  prmt.b32 d, {codes}, z, {sel};
  {sign}
  and.b32 u, u, 0x80008000;
  shr.b32 t, d, {shift};
  and.b32 t, t, 0x01C001C0;
  or.b32 u, u, t;
  fma.rn.bf16x2 u, u, bias, nz;
"""
_SCALE_BF16 = """  fma.rn.bf16x2 {out}, u, {s[0]}, nz;
"""
_SCALE_F32 = """  shl.b32 f0, u, 16;
  and.b32 f1, u, 0xFFFF0000;
  mul.rn.f32 f0, f0, {s[0]};
  mul.rn.f32 f1, f1, {s[1]};
  cvt.rn.bf16x2.f32 {out}, f1, f0;
"""


def _e2m1_asm(nibble: str, f32_scales: bool, pairs: int = 2) -> str:
  """The decode of `pairs` bf16 pairs (2: Triton's four codes bytes, 1: one 16-bit pair of
  codes bytes). Operands: the outputs $0.. (one a pair), then the codes, then the scales: one
  bf16 pair or two float32 a pair."""
  sign, shift = ("shl.b32 u, d, 4;", 2) if nibble == "lo" else ("mov.b32 u, d;", 6)
  scale = _SCALE_F32 if f32_scales else _SCALE_BF16
  per = 2 if f32_scales else 1
  codes = f"${pairs}"
  body = ""
  for p, sel in enumerate(("0x1404", "0x3424")[:pairs]):
    s = tuple(f"${pairs + 1 + per * p + i}" for i in range(per))
    body += (_PAIR.format(codes=codes, sel=sel, sign=sign, shift=shift)
             + scale.format(out=f"${p}", s=s))
  regs = "d, t, u, z, bias, nz" + (", f0, f1" if f32_scales else "")
  return ("{\n .reg .b32 " + regs + ";\n mov.b32 z, 0;\n mov.b32 bias, 0x7E807E80;\n"
          " mov.b32 nz, 0x80008000;\n" + body + "}")


def e2m1_nibbles_asm(sel: str = "0x1404", f32_scales: bool = False, folded: bool = False) -> str:
  """Both nibbles of two codes bytes in one asm, the byte permute shared: outputs $0 (the low
  nibbles' bf16 pair) and $1 (the high nibbles'); inputs $2, a word of codes bytes, of which
  `sel` picks two into the halves' high bytes ("0x1404": bytes 0 and 1, the Mosaic matmul's
  pairs; "0x2404" / "0x3414": bytes 0 and 2 / 1 and 3), then the scales (one bf16 pair, the
  halves' own; or two float32, one a half). The steps of `_PAIR` and the scale's, per nibble.

  `folded` (bf16 scales only): no multiply by 2^126 of its own; the scale pair it is given
  already holds it (`fold_scale_bf16`: 2^(s - R + 126), the values come out as E2M1 x 2^(s - R)),
  so a pair of values costs one bf16x2 multiply, not two."""
  if folded and f32_scales:
    raise ValueError("the folded decode takes bf16 (MXFP4) scales")
  per = 2 if f32_scales else 1
  scale = _SCALE_F32 if f32_scales else _SCALE_BF16
  s = tuple(f"${3 + i}" for i in range(per))
  body = ""
  for out, (sign, shift) in enumerate((("shl.b32 u, d, 4;", 2), ("mov.b32 u, d;", 6))):
    pair = _PAIR.format(codes="$2", sel=sel, sign=sign, shift=shift)
    if out:  # the permuted word is the first nibble's too
      pair = pair.replace(f"  prmt.b32 d, $2, z, {sel};\n", "")
    if folded:
      pair = pair.replace("  fma.rn.bf16x2 u, u, bias, nz;\n", "")
    body += pair + scale.format(out=f"${out}", s=s)
  regs = "d, t, u, z, bias, nz" + (", f0, f1" if f32_scales else "")
  return ("{\n .reg .b32 " + regs + ";\n mov.b32 z, 0;\n mov.b32 bias, 0x7E807E80;\n"
          " mov.b32 nz, 0x80008000;\n" + body + "}")


E2M1_ASM = {"lo": _e2m1_asm("lo", False), "hi": _e2m1_asm("hi", False)}
E2M1_NV_ASM = {"lo": _e2m1_asm("lo", True), "hi": _e2m1_asm("hi", True)}


def e2m1_pair_asm(codes_u8, scale):
  """Packed codes (uint8, two E2M1 codes a byte) and their scales (same shape; bf16 powers of
  two, or NVFP4's float32 E4M3 x global) -> the scaled bf16 values of the low nibbles and of
  the high nibbles, by the PTX above (GPU only)."""
  from jax.experimental.pallas import triton as pltriton
  out = jax.ShapeDtypeStruct(codes_u8.shape, jnp.bfloat16)
  if scale.dtype == jnp.float32:  # one a register, as the 32-bit integers "r" operands take
    asm, constraints = E2M1_NV_ASM, "=r,=r,r,r,r,r,r"
    scale = jax.lax.bitcast_convert_type(scale, jnp.uint32)
  else:
    asm, constraints = E2M1_ASM, "=r,=r,r,r,r"
  return tuple(pltriton.elementwise_inline_asm(
      asm[nibble], args=[codes_u8, scale], constraints=constraints, pack=4,
      result_shape_dtypes=[out])[0] for nibble in ("lo", "hi"))


def e8m0_bf16(s):
  """E8M0 scale bytes (int32) -> bf16 2^(s - 127): the byte is bf16's exponent field."""
  return jax.lax.bitcast_convert_type((s << 7).astype(jnp.uint16), jnp.bfloat16)


def fold_scale_bf16(s, unfold):
  """E8M0 scale bytes (integers) and the fold's reference as `unfold` = 2^(R - 127) (a float, or
  a float32 scalar) -> the folded decode's multiplier (`e2m1_nibbles_asm(folded=True)`), bf16
  2^(s - R + 126), computed in float32: times the decode's E2M1 x 2^-126 it gives E2M1 x
  2^(s - R), the value over `unfold`, which the caller multiplies back in once, after the matrix
  instruction. Exact while s <= R + 1 (the multiplier is a bf16 power of two) and the value stays
  on bf16's grid (s >= R - 132: 0.5 x 2^(s - R) is at least the smallest subnormal); above that
  range the multiplier is Inf (as the unfolded decode's is for the NaN byte 255), below it the
  values round to bf16's subnormals; byte 0 gives 0, as `e8m0_bf16` does."""
  e8m0 = jax.lax.bitcast_convert_type(s.astype(jnp.int32) << 23, jnp.float32)  # 2^(s - 127)
  return (e8m0 * (2.0**126 / unfold)).astype(jnp.bfloat16)


def e4m3_f32(s):
  """E4M3 bytes -> float32."""
  return jax.lax.bitcast_convert_type(s.astype(jnp.uint8), jnp.float8_e4m3fn).astype(
      jnp.float32)


def block_scale(s, fmt: str, g=None):
  """Scale bytes -> what `decode_nibbles` multiplies by: MXFP4's bf16 power of two, or NVFP4's
  float32 E4M3 x g (g: the global, float32), rounded once as XLA's dequantize rounds it."""
  if fmt == "mxfp4":
    return e8m0_bf16(s.astype(jnp.int32))
  return e4m3_f32(s) * g


def _scale_tile(scales_ref, r0, n0, *, fmt, rows, block_n, k_major=False, expert=(), g=None):
  """The scale of every packed row of the step (`block_scale`), [rows, block_n] ([block_n, rows]
  when `k_major`, scales_ref then being [N, K/B]): one scale row per `group` packed rows (16 for
  MXFP4, 8 for NVFP4), selected per row (no reshapes)."""
  group = 16 if fmt == "mxfp4" else 8
  if k_major:
    load = lambda j: scales_ref[pl.ds(n0, block_n), pl.ds(r0 // group + j, 1)]
  else:  # `expert`: the leading index of a grouped [E, K/B, N] scales_ref
    load = lambda j: scales_ref[(*expert, pl.ds(r0 // group + j, 1), pl.ds(n0, block_n))]
  raw = lambda j: block_scale(load(j), fmt, g)
  tile = raw(0)
  if rows > group:
    shape, axis = ((block_n, rows), 1) if k_major else ((rows, block_n), 0)
    which = jax.lax.broadcasted_iota(jnp.int32, shape, axis) // group
    tile = jnp.broadcast_to(tile, shape)
    for j in range(1, rows // group):
      tile = jnp.where(which == j, raw(j), tile)
  return tile


def decode_nibbles(codes, scale, decode):
  """Packed codes and their scales (`block_scale`, broadcastable) -> bf16 values of the low and
  high nibbles: E2M1 x a bf16 power of two (exact), or bf16(E2M1 x a float32 scale)."""
  if decode == "asm":
    return e2m1_pair_asm(codes, jnp.broadcast_to(scale, codes.shape))
  codes = codes.astype(jnp.int32)
  nibbles = (e2m1_bf16(codes & 15), e2m1_bf16(codes >> 4))
  if scale.dtype == jnp.float32:
    return tuple((v.astype(jnp.float32) * scale).astype(jnp.bfloat16) for v in nibbles)
  return tuple(v * scale for v in nibbles)  # exact: a power of two


def _skip_unused(table_ref, run, zeros):
  """run() for a tile in use; zeros for a grouped call's padding tiles past the ones in use (the
  tile table's last entry), which would otherwise decode and multiply a weight for nothing."""
  if table_ref is None:
    return run()
  return jax.lax.cond(pl.program_id(1) < table_ref[pl.num_programs(1)], run, lambda: zeros)


def _kernel(xe_ref, xo_ref, codes_ref, scales_ref, global_ref, *refs, fmt: str, block_m: int,
            block_n: int, rows_per_split: int, rows: int, decode: str, k_major: bool = False,
            grouped: bool = False):
  """One [block_m, block_n] output tile over one K split. With `k_major` the weight is stored
  K-major (codes [N, K/2], scales [N, K/B]) and comes first in the product, y^T = W^T x^T, so
  the decoded tile is the matrix instruction's A operand, which Hopper can take from registers,
  instead of a B operand that goes through shared memory; x is then transposed (xe_ref
  [K/2, M]) and the output tile is [block_n, block_m] of y^T. With `grouped` the weight is
  per expert ([E, K/2, N] codes) and refs[0] holds each M tile's expert. global_ref: NVFP4's
  float32 global, [1] or per expert [E] (unread for MXFP4)."""
  out_ref = refs[-1]  # before it, the poisoned output buffer when one is passed (aliased)
  n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)  # lets Triton vectorize the loads
  m0 = pl.program_id(1) * block_m
  base = pl.program_id(2) * rows_per_split
  expert = (refs[0][pl.program_id(1)],) if grouped else ()
  g = global_ref[expert[0] if grouped else 0] if fmt == "nvfp4" else None

  def step(i, acc):
    r0 = pl.multiple_of(base + i * rows, rows)
    if k_major:
      codes = codes_ref[pl.ds(n0, block_n), pl.ds(r0, rows)]
      xe = xe_ref[pl.ds(r0, rows), pl.ds(m0, block_m)]
      xo = xo_ref[pl.ds(r0, rows), pl.ds(m0, block_m)]
    else:
      codes = codes_ref[(*expert, pl.ds(r0, rows), pl.ds(n0, block_n))]
      xe = xe_ref[pl.ds(m0, block_m), pl.ds(r0, rows)]
      xo = xo_ref[pl.ds(m0, block_m), pl.ds(r0, rows)]
    scale = _scale_tile(scales_ref, r0, n0, fmt=fmt, rows=rows, block_n=block_n,
                        k_major=k_major, expert=expert, g=g)
    w_even, w_odd = decode_nibbles(codes, scale, decode)
    dot = lambda x, w: jnp.dot(*((w, x) if k_major else (x, w)),
                               preferred_element_type=jnp.float32)
    return acc + dot(xe, w_even) + dot(xo, w_odd)

  acc = jnp.zeros((block_n, block_m) if k_major else (block_m, block_n), jnp.float32)
  out_ref[...] = _skip_unused(refs[0] if grouped else None,
                              lambda: jax.lax.fori_loop(0, rows_per_split // rows, step, acc), acc)


def _gemv_kernel(xe_ref, xo_ref, codes_ref, scales_ref, global_ref, *refs, fmt: str, m: int,
                 block_n: int, rows_per_split: int, rows: int, decode: str):
  """The few-row variant (M <= 8): no matrix instruction, whose operand layout costs a pass
  through shared memory; each step decodes the tile once and accumulates x * w in float32 per
  element (x transposed: xe_ref [K/2, M]), reducing over K once at the end."""
  out_ref = refs[-1]
  n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
  base = pl.program_id(2) * rows_per_split
  g = global_ref[0] if fmt == "nvfp4" else None

  def step(i, accs):
    r0 = pl.multiple_of(base + i * rows, rows)
    codes = codes_ref[pl.ds(r0, rows), pl.ds(n0, block_n)]
    scale = _scale_tile(scales_ref, r0, n0, fmt=fmt, rows=rows, block_n=block_n, g=g)
    w_even, w_odd = decode_nibbles(codes, scale, decode)
    w_even, w_odd = w_even.astype(jnp.float32), w_odd.astype(jnp.float32)
    new = []
    for j, acc in enumerate(accs):
      xe = xe_ref[pl.ds(r0, rows), pl.ds(j, 1)].astype(jnp.float32)
      xo = xo_ref[pl.ds(r0, rows), pl.ds(j, 1)].astype(jnp.float32)
      new.append(acc + xe * w_even + xo * w_odd)
    return tuple(new)

  accs = tuple(jnp.zeros((rows, block_n), jnp.float32) for _ in range(m))
  accs = jax.lax.fori_loop(0, rows_per_split // rows, step, accs)
  for j, acc in enumerate(accs):
    out_ref[pl.ds(j, 1), :] = jnp.sum(acc, axis=0, keepdims=True)


def _bf16_kernel(x_ref, w_ref, *refs, block_m: int, block_n: int, block_k: int,
                 k_per_split: int, grouped: bool = False):
  """One [block_m, block_n] output tile over one K split of a bf16 weight. With `grouped` the
  weight is per expert ([E, K, N]) and refs[0] holds each M tile's expert, as in `_kernel`."""
  out_ref = refs[-1]
  n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
  m0 = pl.program_id(1) * block_m
  base = pl.program_id(2) * k_per_split
  expert = (refs[0][pl.program_id(1)],) if grouped else ()

  def step(i, acc):
    k0 = pl.multiple_of(base + i * block_k, block_k)
    x = x_ref[pl.ds(m0, block_m), pl.ds(k0, block_k)]
    w = w_ref[(*expert, pl.ds(k0, block_k), pl.ds(n0, block_n))]
    return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

  acc = jnp.zeros((block_m, block_n), jnp.float32)
  out_ref[...] = _skip_unused(refs[0] if grouped else None,
                              lambda: jax.lax.fori_loop(0, k_per_split // block_k, step, acc), acc)


def _compiler_params(num_warps: int, num_stages: int):
  from jax.experimental.pallas import triton as pltriton
  return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _call(name, kernel, inputs, out_shape, grid, out_block, out_index, num_warps, num_stages,
          interpret, poison):
  """pallas_call with the [splits, ...] partial output; with `poison`, the output starts as a
  NaN-filled buffer (aliased), so an element the kernel fails to write stays NaN."""
  out_spec = pl.BlockSpec((None, *out_block), out_index)
  aliases = {}
  in_specs = [pl.no_block_spec] * len(inputs)
  if poison:
    inputs = (*inputs, jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
    in_specs.append(out_spec)
    aliases = {len(inputs) - 1: 0}
  return pl.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_spec, out_shape=out_shape,
      input_output_aliases=aliases, name=name,  # the kernel's name in profiles
      compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
      interpret=interpret)(*inputs)


_MN = lambda i, j, s: (s, j, i)  # output tile (M tile j, N tile i) of split s
_NM = lambda i, j, s: (s, i, j)  # the same tile of the transposed output


def check_decode(decode: str, interpret: bool) -> None:
  if decode not in DECODES or (decode == "asm" and interpret):
    raise ValueError(f"decode must be one of {DECODES} ('asm' is not interpretable), got "
                     f"{decode!r} with interpret={interpret}")


def default_decode(decode: str | None, interpret: bool) -> str:
  """`decode`, or by default "asm" (the PTX) for a compiled kernel and "bits" for one that is
  interpreted; checked (`check_decode`)."""
  decode = decode or ("bits" if interpret else "asm")
  check_decode(decode, interpret)
  return decode


def _globals(global_scale):
  """NVFP4's global as the kernels read it: float32 [1] or [E]; ones when there is none (MXFP4,
  whose kernels do not read it)."""
  if global_scale is None:
    return jnp.ones((1,), jnp.float32)
  return jnp.reshape(global_scale, (-1,)).astype(jnp.float32)


_FP4_STATIC = ("fmt", "block_m", "block_n", "splits", "rows", "num_warps", "num_stages",
               "interpret", "poison", "decode")


@functools.partial(jax.jit, static_argnames=_FP4_STATIC)
def fp4_matmul_partials(xe, xo, codes, scales, global_scale=None, *, fmt: str,
                        block_m: int = 16, block_n: int = 128, splits: int = 1, rows: int = ROWS,
                        num_warps: int = 4, num_stages: int = 3, interpret: bool = False,
                        poison: bool = False, decode: str = "bits"):
  """-> float32 [splits, M, N] partial products (M a multiple of block_m). `global_scale`:
  NVFP4's per-tensor global (one float32), None for MXFP4. `decode`: "bits" (jnp integer
  operations, any backend) or "asm" (the PTX pair decode, compiled GPU only)."""
  check_decode(decode, interpret)
  m, k2 = xe.shape
  n = codes.shape[1]
  kernel = functools.partial(_kernel, fmt=fmt, block_m=block_m, block_n=block_n,
                             rows_per_split=k2 // splits, rows=rows, decode=decode)
  return _call("triton_fp4", kernel, (xe, xo, codes, scales, _globals(global_scale)),
               jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), (block_m, block_n), _MN, num_warps,
               num_stages, interpret, poison)


@functools.partial(jax.jit, static_argnames=_FP4_STATIC)
def fp4_kmajor_partials(xe_t, xo_t, codes_t, scales_t, global_scale=None, *, fmt: str,
                        block_m: int = 16, block_n: int = 64, splits: int = 1, rows: int = 32,
                        num_warps: int = 4, num_stages: int = 4, interpret: bool = False,
                        poison: bool = False, decode: str = "bits"):
  """K-major weight (codes_t [N, K/2], scales_t [N, K/B]), x transposed (xe_t, xo_t: [K/2, M],
  M a multiple of block_m) -> float32 [splits, N, M] partials of y^T."""
  check_decode(decode, interpret)
  k2, m = xe_t.shape
  n = codes_t.shape[0]
  kernel = functools.partial(_kernel, fmt=fmt, block_m=block_m, block_n=block_n,
                             rows_per_split=k2 // splits, rows=rows, decode=decode, k_major=True)
  return _call("triton_fp4_kmajor", kernel,
               (xe_t, xo_t, codes_t, scales_t, _globals(global_scale)),
               jax.ShapeDtypeStruct((splits, n, m), jnp.float32),
               (n // block_n, m // block_m, splits), (block_n, block_m), _NM, num_warps,
               num_stages, interpret, poison)


@functools.partial(jax.jit, static_argnames=_FP4_STATIC)
def grouped_fp4_partials(xe, xo, codes, scales, tile_expert, global_scale=None, *, fmt: str,
                         block_m: int = 16, block_n: int = 64, splits: int = 1, rows: int = 32,
                         num_warps: int = 4, num_stages: int = 4, interpret: bool = False,
                         poison: bool = False, decode: str = "bits"):
  """Per-expert weights (codes [E, K/2, N], scales [E, K/B, N]); x's rows in block_m-row tiles,
  tile t multiplied by expert tile_expert[t] (the table's last entry: the tiles in use; the
  rest come out zero); NVFP4's global per expert ([E]) or one for all -> float32
  [splits, M, N] partials."""
  check_decode(decode, interpret)
  m, k2 = xe.shape
  n = codes.shape[-1]
  kernel = functools.partial(_kernel, fmt=fmt, block_m=block_m, block_n=block_n,
                             rows_per_split=k2 // splits, rows=rows, decode=decode, grouped=True)
  g = _globals(global_scale)
  g = jnp.broadcast_to(g, codes.shape[:1]) if g.shape[0] == 1 else g
  return _call("triton_fp4_grouped", kernel, (xe, xo, codes, scales, g, tile_expert),
               jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), (block_m, block_n), _MN, num_warps,
               num_stages, interpret, poison)


@functools.partial(jax.jit, static_argnames=tuple(a for a in _FP4_STATIC if a != "block_m"))
def fp4_gemv_partials(xe_t, xo_t, codes, scales, global_scale=None, *, fmt: str,
                      block_n: int = 128, splits: int = 1, rows: int = ROWS, num_warps: int = 4,
                      num_stages: int = 3, interpret: bool = False, poison: bool = False,
                      decode: str = "bits"):
  """The few-row kernel: x transposed (xe_t, xo_t: [K/2, M], M <= 8) -> float32 [splits, M, N]."""
  check_decode(decode, interpret)
  k2, m = xe_t.shape
  n = codes.shape[1]
  kernel = functools.partial(_gemv_kernel, fmt=fmt, m=m, block_n=block_n,
                             rows_per_split=k2 // splits, rows=rows, decode=decode)
  return _call("triton_fp4_gemv", kernel, (xe_t, xo_t, codes, scales, _globals(global_scale)),
               jax.ShapeDtypeStruct((splits, m, n), jnp.float32), (n // block_n, 1, splits),
               (m, block_n), _MN, num_warps, num_stages, interpret, poison)


_BF16_STATIC = ("block_m", "block_n", "block_k", "splits", "num_warps", "num_stages",
                "interpret", "poison")


@functools.partial(jax.jit, static_argnames=_BF16_STATIC)
def bf16_matmul_partials(x, w, *, block_m: int = 16, block_n: int = 128, block_k: int = 64,
                         splits: int = 1, num_warps: int = 4, num_stages: int = 3,
                         interpret: bool = False, poison: bool = False):
  """The same design on a bf16 weight: the baseline the FP4 kernel is measured against."""
  m, k = x.shape
  n = w.shape[1]
  kernel = functools.partial(_bf16_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                             k_per_split=k // splits)
  return _call("triton_bf16", kernel, (x, w), jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), (block_m, block_n), _MN, num_warps,
               num_stages, interpret, poison)


@functools.partial(jax.jit, static_argnames=_BF16_STATIC)
def grouped_bf16_partials(x, w, tile_expert, *, block_m: int = 16, block_n: int = 128,
                          block_k: int = 64, splits: int = 1, num_warps: int = 4,
                          num_stages: int = 3, interpret: bool = False, poison: bool = False):
  """Per-expert bf16 weights w [E, K, N]; x's rows in block_m-row tiles, tile t multiplied by
  expert tile_expert[t] (then the tiles in use, as in grouped_fp4_partials) -> float32
  [splits, M, N] partials."""
  m, k = x.shape
  n = w.shape[-1]
  kernel = functools.partial(_bf16_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                             k_per_split=k // splits, grouped=True)
  return _call("triton_bf16_grouped", kernel, (x, w, tile_expert),
               jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
               (n // block_n, m // block_m, splits), (block_m, block_n), _MN, num_warps,
               num_stages, interpret, poison)
