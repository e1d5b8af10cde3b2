"""Pallas (Triton lowering) decode attention: one query per sequence, GQA, split over slots.

Grid (batch, kv head, split). A program takes the G query heads that share its kv head (padded
to 16 rows, the smallest matrix-instruction tile) and walks its split's slots in blocks of
`block_s`, keeping an online softmax (running max m, sum l, unnormalized output) in float32;
the splits' (m, l, o) are combined outside (`combine`).

Programs read only the blocks before their sequence's last valid slot (`valid_end`): a rollout's
cache holds the prompt and the tokens so far, not yet its whole length.

Packed caches (codes [B, S, Kv, Dh/2], scales [B, S, Kv, Dh/block], NVFP4's global
[B, S, Kv, 1]) are unpacked in registers by the FP4 matmul's decode: the low nibbles are the
even head_dim entries, the high nibbles the odd ones. q comes in with its head_dim permuted to
[even | odd] (done once outside), so with q_e, q_o its halves and K_e, K_o the decoded nibbles

    s = q_e K_e^T + q_o K_o^T,    o_e = p V_e,  o_o = p V_o,

and the output comes back in the same [even | odd] order. The decoded values are the rollout
engine's XLA dequantization, bit for bit: NVFP4's per-(slot, head) global multiplies each block
scale in float32 (E4M3 x g) and each value is rounded to bf16 after its product with that, as
`dequantize(cache).astype(bf16)` computes it; nothing multiplies the scores or probabilities.
A bf16 cache takes the same kernel with one part instead of two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.fp4_matmul.kernel import block_scale, check_decode, decode_nibbles

FORMATS = ("bf16", "mxfp4", "nvfp4")
_MASKED = -1e30  # a finite running-max start: no inf - inf in the rescale


def _scale_tile(scales_ref, b, s0, h, *, fmt, block_s, half, g=None):
  """The scale (`block_scale`: bf16, or NVFP4's float32 E4M3 x g with g [block_s, 1]) of every
  packed column of a [block_s, Dh/2] codes tile: one scale column per `group` packed columns
  (16 for MXFP4's 32-element blocks, 8 for NVFP4's 16), selected per column."""
  group = 16 if fmt == "mxfp4" else 8
  raw = lambda j: block_scale(scales_ref[b, pl.ds(s0, block_s), h, pl.ds(j, 1)], fmt, g)
  tile = jnp.broadcast_to(raw(0), (block_s, half))
  which = jax.lax.broadcasted_iota(jnp.int32, (block_s, half), 1) // group
  for j in range(1, half // group):
    tile = jnp.where(which == j, raw(j), tile)
  return tile


def _load(refs, b, s0, h, *, fmt, block_s, head_dim, decode):
  """One block of a cache -> its parts [block_s, Dh / parts], bf16."""
  if fmt == "bf16":
    return (refs[0][b, pl.ds(s0, block_s), h, :],)
  codes = refs[0][b, pl.ds(s0, block_s), h, :]
  g = refs[2][b, pl.ds(s0, block_s), h, pl.ds(0, 1)] if fmt == "nvfp4" else None
  scale = _scale_tile(refs[1], b, s0, h, fmt=fmt, block_s=block_s, half=head_dim // 2, g=g)
  return decode_nibbles(codes, scale, decode)


def _kernel(q_ref, mask_ref, end_ref, *refs, fmt: str, n_cache_refs: int, block_s: int,
            slots_per_split: int, head_dim: int, decode: str):
  k_refs, v_refs = refs[:n_cache_refs], refs[n_cache_refs:2 * n_cache_refs]
  o_ref, m_ref, l_ref = refs[-3:]  # before them, poisoned output buffers when passed (aliased)
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  parts = 1 if fmt == "bf16" else 2
  width = head_dim // parts
  qs = [q_ref[b, h, :, pl.ds(i * width, width)] for i in range(parts)]
  rows = qs[0].shape[0]
  base = split * slots_per_split
  load = functools.partial(_load, b=b, h=h, fmt=fmt, block_s=block_s, head_dim=head_dim,
                           decode=decode)
  contract_last = (((1,), (1,)), ((), ()))

  def step(i, carry):
    m, l, accs = carry
    s0 = pl.multiple_of(base + i * block_s, block_s)
    ks = load(k_refs, s0=s0)
    s = sum(jax.lax.dot_general(q, k, contract_last, preferred_element_type=jnp.float32)
            for q, k in zip(qs, ks))
    s = s * head_dim**-0.5
    valid = mask_ref[b, pl.ds(s0, block_s)][None, :] != 0
    s = jnp.where(valid, s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(valid, jnp.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + jnp.sum(p, axis=1)
    vs = load(v_refs, s0=s0)
    p = p.astype(jnp.bfloat16)
    accs = tuple(acc * alpha[:, None] + jnp.dot(p, v, preferred_element_type=jnp.float32)
                 for acc, v in zip(accs, vs))
    return m_new, l, accs

  init = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
          tuple(jnp.zeros((rows, width), jnp.float32) for _ in range(parts)))
  # the blocks before the sequence's end: the slots past it (a cache longer than what it holds
  # so far) are not read
  blocks = jnp.clip((end_ref[b] - base + block_s - 1) // block_s, 0, slots_per_split // block_s)
  m, l, accs = jax.lax.fori_loop(0, blocks, step, init)
  for i, acc in enumerate(accs):
    o_ref[:, pl.ds(i * width, width)] = acc
  m_ref[...] = m
  l_ref[...] = l


_STATIC = ("fmt", "block_s", "splits", "num_warps", "num_stages", "decode", "interpret",
           "poison")


@functools.partial(jax.jit, static_argnames=_STATIC)
def decode_attention_partials(q, mask, end, k_refs, v_refs, *, fmt: str, block_s: int = 64,
                              splits: int = 1, num_warps: int = 4, num_stages: int = 2,
                              decode: str = "bits", interpret: bool = False,
                              poison: bool = False):
  """q [B, Kv, R, Dh] (R >= 16 query rows per kv head, head_dim in [even | odd] order for the
  packed formats), mask [B, S] int8, end [B] int32 (`valid_end` of the mask: no block from it
  on is read), the caches' arrays (codes, scales[, global] or the bf16 array) -> per split:
  o [splits, B, Kv, R, Dh] (unnormalized), m and l [splits, B, Kv, R]."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
  if fmt != "bf16":
    check_decode(decode, interpret)
  b, kv, rows, dh = q.shape
  s = mask.shape[1]
  kernel = functools.partial(_kernel, fmt=fmt, n_cache_refs=len(k_refs), block_s=block_s,
                             slots_per_split=s // splits, head_dim=dh, decode=decode)
  out_shape = (jax.ShapeDtypeStruct((splits, b, kv, rows, dh), jnp.float32),
               jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32),
               jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32))
  out_specs = (pl.BlockSpec((None, None, None, rows, dh), lambda i, j, t: (t, i, j, 0, 0)),
               pl.BlockSpec((None, None, None, rows), lambda i, j, t: (t, i, j, 0)),
               pl.BlockSpec((None, None, None, rows), lambda i, j, t: (t, i, j, 0)))
  inputs = (q, mask, end.astype(jnp.int32), *k_refs, *v_refs)
  in_specs = [pl.no_block_spec] * len(inputs)
  aliases = {}
  if poison:  # NaN-filled outputs, aliased: an element the kernel fails to write stays NaN
    for o, (shape, spec) in enumerate(zip(out_shape, out_specs)):
      aliases[len(inputs)] = o
      inputs = (*inputs, jnp.full(shape.shape, jnp.nan, shape.dtype))
      in_specs.append(spec)
  params = None
  if not interpret:
    from jax.experimental.pallas import triton as pltriton
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
  return pl.pallas_call(
      kernel, grid=(b, kv, splits), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=params, interpret=interpret,
      name="triton_decode_attention")(*inputs)


def valid_end(mask):
  """mask [B, S] (nonzero: valid) -> [B] int32: one past each row's last valid slot (0 for a row
  with none)."""
  mask = mask != 0
  s = mask.shape[1]
  last = s - jnp.argmax(mask[:, ::-1], axis=1)
  return jnp.where(jnp.any(mask, axis=1), last, 0).astype(jnp.int32)


def combine(o, m, l, dh_axis: int = -1):
  """The splits' online-softmax states (o [splits, B, Kv, R, Dh], m and l [splits, B, Kv, R])
  -> the normalized output [B, Kv, R, Dh] (float32); rows with no valid slot (l = 0 in every
  split) come out zero. dh_axis=-2: o is O^T's [splits, B, Kv, Dh, R], and so is the output
  (read along memory, the transpose left to the smaller result)."""
  m_all = jnp.max(m, axis=0)
  w = jnp.exp(m - m_all)
  l_all = jnp.sum(w * l, axis=0)
  per_dh = lambda a: jnp.expand_dims(a, dh_axis)
  return jnp.sum(per_dh(w) * o, axis=0) / per_dh(jnp.maximum(l_all, 1e-30))
