"""Decode attention over a bf16 cache in Triton's own language (`pallas_kernels.triton_call`):
the Pallas kernel of `kernel.py` for bf16 caches, moved off Pallas' deprecated Triton lowering.

The same program: grid (batch, kv head, split); a program takes the query rows of its kv head
(padded to at least 16, a matrix-instruction tile) and walks its split's slots in blocks of
BLOCK_S up to its sequence's end (`kernel.valid_end`: no block past it is read), keeping an
online softmax in float32 (running max m, sum l, unnormalized output); the splits' (m, l, o)
are combined outside (`kernel.combine`). Imported through `triton_call.load`.
"""

import triton
import triton.language as tl

MASKED = -1e30  # a finite running-max start, as kernel.py's: no inf - inf in the rescale


@triton.jit
def bf16_attention(q_ptr, mask_ptr, end_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr,
                   B: tl.constexpr, S: tl.constexpr, KV: tl.constexpr, ROWS: tl.constexpr,
                   DH: tl.constexpr, BLOCK_S: tl.constexpr, SLOTS_PER_SPLIT: tl.constexpr,
                   SCALE: tl.constexpr, INTERPRET: tl.constexpr):
  """q [B, KV, ROWS, DH] bf16, mask [B, S] int8, end [B] int32, K and V [B, S, KV, DH] bf16 ->
  o [splits, B, KV, ROWS, DH], m and l [splits, B, KV, ROWS] (float32)."""
  b = tl.program_id(0)
  h = tl.program_id(1)
  split = tl.program_id(2)
  rows = tl.arange(0, ROWS)
  d = tl.arange(0, DH)
  slots = tl.arange(0, BLOCK_S)
  head = b * KV + h
  q = tl.load(q_ptr + (head * ROWS + rows[:, None]) * DH + d[None, :])
  if INTERPRET:  # the interpreter's tl.dot takes bf16 as integers: float32, the same products
    q = q.to(tl.float32)
  base = split * SLOTS_PER_SPLIT
  end = tl.load(end_ptr + b)
  blocks = tl.minimum(tl.maximum((end - base + BLOCK_S - 1) // BLOCK_S, 0),
                      SLOTS_PER_SPLIT // BLOCK_S)
  m = tl.full((ROWS,), MASKED, tl.float32)
  l = tl.zeros((ROWS,), tl.float32)
  acc = tl.zeros((ROWS, DH), tl.float32)
  for i in range(0, blocks):
    s0 = base + i * BLOCK_S
    # int64: a cache of B x S x KV x DH elements passes 2^31 at 64 x 128K x 4 x 128
    at = ((b.to(tl.int64) * S + s0 + slots[:, None]) * KV + h) * DH + d[None, :]
    k = tl.load(k_ptr + at)
    if INTERPRET:
      k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * SCALE
    valid = tl.load(mask_ptr + b * S + s0 + slots) != 0
    s = tl.where(valid[None, :], s, MASKED)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + at)
    if INTERPRET:  # its cast to bf16 truncates: p rounded to the nearest even bf16 in integers
      bits = p.to(tl.uint32, bitcast=True)
      p = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
      v = v.to(tl.float32)
    else:
      p = p.to(tl.bfloat16)
    acc = acc * alpha[:, None] + tl.dot(p, v)
    m = m_new
  out = (split * B + b) * KV + h
  tl.store(o_ptr + (out.to(tl.int64) * ROWS + rows[:, None]) * DH + d[None, :], acc)
  tl.store(m_ptr + out * ROWS + rows, m)
  tl.store(l_ptr + out * ROWS + rows, l)
