"""Decode attention in Triton's own language (`pallas_kernels.triton_call`): the Pallas kernel of
`kernel.py`, moved off Pallas' deprecated Triton lowering; `bf16_attention` over bf16 caches,
`fp4_attention` over MXFP4 and NVFP4 ones (their decode: `kernel.py`'s, from the bits or by the
same PTX).

The same program: grid (batch, kv head, split); a program takes the query rows of its kv head
(padded to at least 16, a matrix-instruction tile) and walks its split's slots in blocks of
BLOCK_S up to its sequence's end (`kernel.valid_end`: no block past it is read), keeping an
online softmax in float32 (running max m, sum l, unnormalized output); the splits' (m, l, o)
are combined outside (`kernel.combine`). Imported through `triton_call.load`.
"""

import triton
import triton.language as tl

from pallas_kernels.fp4_matmul.kernel import E2M1_ASM, E2M1_NV_ASM

# a finite running-max start, as kernel.py's: no inf - inf in the rescale
MASKED = tl.constexpr(-1e30)
# the FP4 decode's PTX (`fp4_matmul.kernel`: four codes bytes and their scales an instance)
ASM_MX_LO = tl.constexpr(E2M1_ASM["lo"])
ASM_MX_HI = tl.constexpr(E2M1_ASM["hi"])
ASM_NV_LO = tl.constexpr(E2M1_NV_ASM["lo"])
ASM_NV_HI = tl.constexpr(E2M1_NV_ASM["hi"])


@triton.jit
def bf16_rne(x):
  """float32 x rounded to the nearest even bf16, kept in float32: what a cast to bf16 gives on a
  GPU, written in integers for the interpreter, whose cast truncates."""
  bits = x.to(tl.uint32, bitcast=True)
  return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _split_start(end_ptr, b, split, ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                 SLOTS_PER_SPLIT: tl.constexpr):
  """A program's first slot, its count of blocks before its sequence's end (`end_ptr`: one past
  each sequence's last valid slot), and the online softmax's starting max and sum."""
  base = split * SLOTS_PER_SPLIT
  end = tl.load(end_ptr + b)
  blocks = tl.minimum(tl.maximum((end - base + BLOCK_S - 1) // BLOCK_S, 0),
                      SLOTS_PER_SPLIT // BLOCK_S)
  return base, blocks, tl.full((ROWS,), MASKED, tl.float32), tl.zeros((ROWS,), tl.float32)


@triton.jit
def _softmax_step(s, valid, m, l, SCALE: tl.constexpr, INTERPRET: tl.constexpr):
  """One block's scores (float32 dot products [rows, slots]) into the online softmax: scaled,
  the invalid slots left out -> (p, its probabilities in bf16 against the new running max (in
  float32 holding bf16 values under INTERPRET), alpha, the old state's rescale, the new max m
  and sum l)."""
  s = tl.where(valid[None, :], s * SCALE, MASKED)
  m_new = tl.maximum(m, tl.max(s, axis=1))
  alpha = tl.exp(m - m_new)
  p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
  l = l * alpha + tl.sum(p, axis=1)
  if INTERPRET:
    p = bf16_rne(p)
  else:
    p = p.to(tl.bfloat16)
  return p, alpha, m_new, l


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
  base, blocks, m, l = _split_start(end_ptr, b, split, ROWS, BLOCK_S, SLOTS_PER_SPLIT)
  acc = tl.zeros((ROWS, DH), tl.float32)
  for i in range(0, blocks):
    s0 = base + i * BLOCK_S
    # int64: a cache of B x S x KV x DH elements passes 2^31 at 64 x 128K x 4 x 128
    at = ((b.to(tl.int64) * S + s0 + slots[:, None]) * KV + h) * DH + d[None, :]
    k = tl.load(k_ptr + at)
    if INTERPRET:
      k = k.to(tl.float32)
    valid = tl.load(mask_ptr + b * S + s0 + slots) != 0
    p, alpha, m, l = _softmax_step(tl.dot(q, tl.trans(k)), valid, m, l, SCALE, INTERPRET)
    v = tl.load(v_ptr + at)
    if INTERPRET:
      v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v)
  out = (split * B + b) * KV + h
  tl.store(o_ptr + (out.to(tl.int64) * ROWS + rows[:, None]) * DH + d[None, :], acc)
  tl.store(m_ptr + out * ROWS + rows, m)
  tl.store(l_ptr + out * ROWS + rows, l)


@triton.jit
def _e2m1_f32(codes):
  """4-bit E2M1 codes (int32) -> float32 values, from the bits (`kernel.e2m1_bf16`'s pattern,
  shifted into float32's upper half)."""
  m = codes & 7
  bits = tl.where(m > 1, (m << 6) + 0x3F00, m * 0x3F00) | ((codes & 8) << 12)
  return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def scale_f32(s, NVFP4: tl.constexpr):
  """Scale bytes (int32) -> float32, from the bits, as the Pallas kernel's `kernel.block_scale`
  takes them: MXFP4's E8M0 byte as the exponent field (`kernel.e8m0_bf16`: 2^(s - 127), byte
  255 Inf, byte 0 zero), NVFP4's E4M3 (`kernel.e4m3_f32`: 0x7F and 0xFF NaN)."""
  if NVFP4:
    e = (s >> 3) & 15
    mant = s & 7
    v = tl.where(e == 0, mant.to(tl.float32) * 0.001953125,  # subnormal: mant x 2^-9
                 (((e + 120) << 23) | (mant << 20)).to(tl.float32, bitcast=True))
    v = tl.where((s & 127) == 127, float("nan"), v)
    v = tl.where((s & 128) != 0, -v, v)
  else:
    v = (s << 23).to(tl.float32, bitcast=True)
  return v


@triton.jit
def _decode(codes_ptr, scales_ptr, global_ptr, row, HALF: tl.constexpr, NB: tl.constexpr,
            GROUP: tl.constexpr, NVFP4: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr):
  """A [rows, HALF] tile of packed codes (byte j: elements 2j in its low nibble, 2j + 1 in its
  high one) at `row` (each tile row's first byte / HALF, int64 [rows, 1]) -> the bf16 values of
  the even and of the odd elements (float32 under INTERPRET), as the rollout's dequantization
  gives them: E2M1 x MXFP4's power of two, exact; bf16(E2M1 x (E4M3 x g)) for NVFP4, the scale
  times its slot's global in float32 first."""
  j = tl.arange(0, HALF)[None, :]
  codes = tl.load(codes_ptr + row * HALF + j)
  s = tl.load(scales_ptr + row * NB + j // GROUP).to(tl.int32)
  scale = scale_f32(s, NVFP4)
  if NVFP4:
    scale = scale * tl.load(global_ptr + row)
  return decode_pairs(codes, scale, NVFP4, ASM, INTERPRET)


@triton.jit
def decode_pairs(codes, scale, NVFP4: tl.constexpr, ASM: tl.constexpr, INTERPRET: tl.constexpr):
  """Packed codes (uint8, two E2M1 codes a byte) and each byte's scale (float32, `scale_f32`:
  MXFP4's power of two, or NVFP4's E4M3 times its global) -> the bf16 values of the low and of
  the high nibbles (float32 holding them under INTERPRET), as `kernel.decode_nibbles` gives them:
  from the bits, or by the same PTX (ASM, GPU only)."""
  if ASM:  # kernel.E2M1_ASM / E2M1_NV_ASM: the PTX decode (GPU only)
    if NVFP4:
      lo = tl.inline_asm_elementwise(ASM_NV_LO, "=r,=r,r,r,r,r,r",
                                     [codes, scale.to(tl.uint32, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)
      hi = tl.inline_asm_elementwise(ASM_NV_HI, "=r,=r,r,r,r,r,r",
                                     [codes, scale.to(tl.uint32, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
      scale = scale.to(tl.bfloat16)  # a power of two: exact
      lo = tl.inline_asm_elementwise(ASM_MX_LO, "=r,=r,r,r,r", [codes, scale],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)
      hi = tl.inline_asm_elementwise(ASM_MX_HI, "=r,=r,r,r,r", [codes, scale],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)
  else:  # the products rounded to bf16 once (MXFP4's exact)
    c = codes.to(tl.int32)
    lo = _e2m1_f32(c & 15) * scale
    hi = _e2m1_f32(c >> 4) * scale
    if INTERPRET:
      lo = bf16_rne(lo)
      hi = bf16_rne(hi)
    else:
      lo = lo.to(tl.bfloat16)
      hi = hi.to(tl.bfloat16)
  return lo, hi


@triton.jit
def fp4_attention(q_ptr, mask_ptr, end_ptr, kc_ptr, ks_ptr, kg_ptr, vc_ptr, vs_ptr, vg_ptr,
                  o_ptr, m_ptr, l_ptr, B: tl.constexpr, S: tl.constexpr, KV: tl.constexpr,
                  ROWS: tl.constexpr, DH: tl.constexpr, BLOCK_S: tl.constexpr,
                  SLOTS_PER_SPLIT: tl.constexpr, SCALE: tl.constexpr, NVFP4: tl.constexpr,
                  ASM: tl.constexpr, INTERPRET: tl.constexpr):
  """`bf16_attention` over MXFP4 or NVFP4 (NVFP4) caches: codes [B, S, KV, DH / 2], scales
  [B, S, KV, DH / block], NVFP4's globals [B, S, KV, 1] (kg_ptr, vg_ptr; read NVFP4 only), q
  [B, KV, ROWS, DH] with head_dim in [even | odd] order, as the decoded nibbles come; o in that
  order too. `ASM`: the PTX decode, else the bits'."""
  HALF: tl.constexpr = DH // 2
  GROUP: tl.constexpr = 8 if NVFP4 else 16  # packed columns a scale
  NB: tl.constexpr = DH // (2 * GROUP)
  b = tl.program_id(0)
  h = tl.program_id(1)
  split = tl.program_id(2)
  rows = tl.arange(0, ROWS)
  d = tl.arange(0, HALF)
  slots = tl.arange(0, BLOCK_S)
  at_q = ((b * KV + h) * ROWS + rows[:, None]) * DH + d[None, :]
  q_e = tl.load(q_ptr + at_q)
  q_o = tl.load(q_ptr + at_q + HALF)
  if INTERPRET:
    q_e = q_e.to(tl.float32)
    q_o = q_o.to(tl.float32)
  base, blocks, m, l = _split_start(end_ptr, b, split, ROWS, BLOCK_S, SLOTS_PER_SPLIT)
  acc_e = tl.zeros((ROWS, HALF), tl.float32)
  acc_o = tl.zeros((ROWS, HALF), tl.float32)
  for i in range(0, blocks):
    s0 = base + i * BLOCK_S
    row = (b.to(tl.int64) * S + s0 + slots[:, None]) * KV + h  # the slots' (slot, head) rows
    k_e, k_o = _decode(kc_ptr, ks_ptr, kg_ptr, row, HALF, NB, GROUP, NVFP4, ASM, INTERPRET)
    valid = tl.load(mask_ptr + b * S + s0 + slots) != 0
    p, alpha, m, l = _softmax_step(tl.dot(q_e, tl.trans(k_e)) + tl.dot(q_o, tl.trans(k_o)),
                                   valid, m, l, SCALE, INTERPRET)
    v_e, v_o = _decode(vc_ptr, vs_ptr, vg_ptr, row, HALF, NB, GROUP, NVFP4, ASM, INTERPRET)
    acc_e = acc_e * alpha[:, None] + tl.dot(p, v_e)
    acc_o = acc_o * alpha[:, None] + tl.dot(p, v_o)
  out = (split * B + b) * KV + h
  at_o = (out.to(tl.int64) * ROWS + rows[:, None]) * DH + d[None, :]
  tl.store(o_ptr + at_o, acc_e)
  tl.store(o_ptr + at_o + HALF, acc_o)
  tl.store(m_ptr + out * ROWS + rows, m)
  tl.store(l_ptr + out * ROWS + rows, l)
