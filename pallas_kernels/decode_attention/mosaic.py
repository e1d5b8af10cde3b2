"""Pallas (Mosaic GPU lowering, Hopper) decode attention: K and V decoded into wgmma's A operand.

The Triton kernel (`kernel.py`) passes every decoded K and V tile through shared memory on its
way into a matrix instruction. Here the scores are computed transposed,

    S^T [slots, q heads] = K [slots, Dh] Q^T [Dh, q heads],

so the K block (64 slots) is wgmma's A operand, which it reads from registers: the codes are
loaded from shared memory straight into the A layout and decoded there (`fp4_matmul.mosaic`'s
PTX decode; the low nibbles are the even head_dim entries, the high nibbles the odd ones, and Q^T
comes in split into its even and odd rows). The query heads of the kv head (padded to 16) are
the instruction's N. The softmax runs down the columns of S^T. Then

    O^T [Dh, q heads] = V^T [Dh, slots] P^T [slots, q heads]

takes V^T from registers too, P^T from shared memory: each warp loads its 32 rows of V^T's codes
(one MXFP4 block, two NVFP4 ones) with `ldmatrix.trans`, which gives each thread one codes byte
pair at two consecutive slots, the two columns of an A-operand register, and decodes them there
with the two slots' block scales (read from rows that the block's scale bytes are converted
into once, in shared memory). Rows of O^T come out in the order `v_rows` gives and the wrapper
puts them back. FP4 caches are taken at head_dim a multiple of 128 only (`unsupported`): V
decoded to shared memory instead would make O^T tiles of head_dim / 2 rows, which wgmma takes
only in multiples of 64. A bf16 cache skips the decodes (K and V read by wgmma from shared
memory). Grid (batch, kv head, split); each program walks its
split's slots in a pipeline of bulk copies (codes, scales, NVFP4's globals, the mask), keeping
an online softmax in float32, and writes its unnormalized O^T with (m, l), combined outside as
the Triton kernel's splits are (`kernel.combine`). A split that starts past its sequence's last
valid slot reads nothing (the Triton kernel skips such blocks one by one).

The scales of all kv heads of a slot are copied together (a bulk copy's rows must be 16 bytes
or more); each head's columns are loaded as the half of the row that holds them and picked out
in registers, four bytes a 32-bit word (one masked integer sum across the four threads that
share a row, `_head_words`). The softmax's row sum is kept per slot row and reduced across the
warpgroup once, after the last block; its max is reduced every pipeline step, which takes one
64-slot block or, with `blocks=2` (FP4 caches), two: their scores meet in one max across the
warpgroup and their probabilities pass one barrier, and the second block's V^T is decoded
after the first one's wgmma is issued (so that the two can overlap). Numerics are the Triton
kernel's: each value is the engine's XLA dequantization in bf16; products accumulate in
float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.decode_attention import kernel
from pallas_kernels.decode_attention.cache import cache_arrays, cache_format, default_splits
from pallas_kernels.decode_attention.kernel import _MASKED
from pallas_kernels.fp4_matmul.kernel import e2m1_nibbles_asm, fold_scale_bf16
from pallas_kernels.fp4_matmul.mosaic import _decode_asm, _load, _scale_row

CHUNK = 32  # code bytes (64 head_dim values) a decode and its two instructions take
BLOCK_S = 64  # slots a step: wgmma's M
ROWS = 16  # query heads a kv head, padded: wgmma's N
BLOCKS = (1, 2)  # 64-slot blocks a pipeline step
_N_CACHE = {"bf16": 1, "mxfp4": 2, "nvfp4": 3}  # arrays a cache: values; codes, scales[, globals]
# `fold` (MXFP4): each block's scale carries the decode's 2^126 (`kernel.fold_scale_bf16`), so a
# pair of values takes one bf16x2 multiply instead of two, and K and V come out over 2^(FOLD_REF
# - 127), which the scores' 1/sqrt(head_dim) and the stored O^T multiply back. Every decoded
# value is a normal bf16, exactly E2M1 x 2^(s - FOLD_REF), for block scales 2^-60 to 2^66 (scale
# bytes 67 to 193); bytes 60 to 66 give exact subnormals, smaller ones round (byte 0 gives 0, as
# unfolded); bytes 194 to 254 give Inf where the unfolded decode is finite, and so NaN even in
# a masked slot of a block that is read (0 x Inf). The products and sums are the unfolded
# kernel's times a power of two, but for terms of P V below 2^-61, which underflow: the same
# outputs for caches within that range.
FOLD_REF = 192


def _head_words(ref, hi, n):
  """Bytes hi x n ... hi x n + n - 1 (hi traced) of each row of a [64, C] byte ref in shared
  memory -> ceil(n / 4) [64] int32 vectors in the row layout, byte 4w + j of the head at bits
  8j..8j+7 of word w. Only the `width`-column tiles that hold them are loaded, width = C / 2
  (at least 8; narrower loads of these rows conflict on shared-memory banks, which Mosaic
  refuses); each word is one masked sum along each row of its tile (exact: the bytes, shifted
  into place, do not overlap), so four bytes cost one reduction across the threads of a row."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  wgmma = plgpu.Layout.WGMMA
  width = max(8, ref.shape[1] // 2)
  tiles, out = {}, []
  for w in range((n + 3) // 4):
    j0, size = 4 * w, min(4, n - 4 * w)
    if n % width == 0:
      key, start, c0 = j0 // width, hi * n + j0 // width * width, j0 % width
    else:
      key, start, c0 = 0, hi * n // width * width, hi * n % width + j0
    if key not in tiles:
      tile = _load(ref.at[:, pl.ds(pl.multiple_of(start, width), width)], wgmma)
      tiles[key] = tile.astype(jnp.int32)
    tile = tiles[key]
    rel = plgpu.broadcasted_iota(jnp.int32, tile.shape, 1, layout=wgmma) - c0
    inside = (rel >= 0) & (rel < size)
    out.append(jnp.sum(jnp.where(inside, tile << ((rel & 3) * 8), 0), axis=1))
  return out


def _head_bytes(ref, hi, n):
  """`_head_words` split into the n bytes, [64] int32 each (0..255)."""
  words = _head_words(ref, hi, n)
  return [(words[j // 4] >> (8 * (j % 4))) & 0xFF for j in range(n)]


# V^T from registers (FP4 caches, head_dim a multiple of 128). Each warp loads its rows of V^T with
# `ldmatrix.trans`, which hands every thread the two bytes of one codes column at two
# consecutive slots: the pair of slots (s, s + 1) that one A-operand register holds. Warp w of
# the warpgroup takes the 16 code bytes (32 head_dim entries: one MXFP4 block) at byte
# 16 (4 pi + w) of each slot's row, for the pi-th pair of 64-row tiles of O^T; its thread t gets
# head_dim entries 128 pi + 32 w + 4 (t // 4) + n, n = 0..3 (the low and high nibbles of two
# bytes), and places entry n in tile 2 pi + n // 2, row 16 w + t // 4 + 8 (n % 2): the row
# layout of wgmma's A operand. So O^T's rows come out in the order `v_rows` gives, undone by the
# wrapper. The block scale of a thread's rows is one per slot (its block: the warp's, for MXFP4;
# one of the warp's two, for NVFP4), applied in the decode, one slot a half of the pair.
_V_LDMATRIX = ("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {$0, $1, $2, $3}, [$4];",
               "=r,=r,=r,=r,r")


# one register of four codes bytes (two slots x two bytes, as ldmatrix.trans gives them) and the
# two slots' scales (MXFP4: a bf16 pair; NVFP4: two float32) -> the scaled bf16 pairs of the low
# and of the high nibbles of bytes 0 and 2 (the first byte of each slot) or 1 and 3, one slot a
# half ("mxfp4_folded": the scales folded, `FOLD_REF`)
V_PAIR_ASM = {fmt: {sel: e2m1_nibbles_asm(sel, fmt == "nvfp4", fmt.endswith("folded"))
                    for sel in ("0x2404", "0x3414")}
              for fmt in ("mxfp4", "nvfp4", "mxfp4_folded")}


def v_in_registers(fmt: str, head_dim: int) -> bool:
  """Whether the kernel takes V^T into wgmma from registers (FP4 caches, head_dim a multiple of
  128) rather than decoding V's block to shared memory first."""
  return fmt in ("mxfp4", "nvfp4") and head_dim % 128 == 0


def v_rows(head_dim: int):
  """The head_dim entry of each row of O^T (tiles of 64 rows, in order) when V^T comes from
  registers (`v_in_registers`)."""
  rho = np.arange(64)
  return np.concatenate([128 * (m // 2) + 32 * (rho // 16) + 4 * (rho % 8) + 2 * (m % 2)
                         + (rho % 16) // 8 for m in range(head_dim // 64)])


def _thread_index():
  """The thread's index in the warpgroup's block, as an i32 (inside `inline_mgpu`)."""
  from jax.experimental.mosaic.gpu import utils as mu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith
  tid = mu.thread_idx()
  if isinstance(tid.type, ir.IndexType):  # an index on some jax versions
    tid = arith.index_cast(ir.IntegerType.get_signless(32), tid)
  return tid


def _store_rows(ref, rows):
  """Row vectors ([64] each, in the layout of wgmma's rows: each value in the four threads of
  its row) -> ref [len(rows), 64] in shared memory, each thread storing its own values (the
  four store the same). A plain store of such a vector synchronizes the warpgroup around each
  store; this one leaves that to the barrier that follows (`commit_smem`)."""
  from jax.experimental.mosaic.gpu import utils as mu
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm

  row_l = plgpu.Layout.WGMMA.reduce(1)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), tuple(row_l for _ in rows)))
  def store(_, ref, rows):
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    c = lambda v: mu.c(v, i32)
    tid = _thread_index()
    # the thread's rows: 16 w + t // 4 (+ 8), w the warp
    first = arith.addi(arith.shli(arith.andi(arith.shrui(tid, c(5)), c(3)), c(4)),
                       arith.andi(arith.shrui(tid, c(2)), c(7)))
    ptr = mu.memref_ptr(ref)
    for b, row in enumerate(rows):
      for h, reg in enumerate(row.registers.flat):  # rows first, first + 8
        size = mu.bitwidth(ir.VectorType(reg.type).element_type) // 8  # one value a register
        value = mu.bitcast(reg, ir.IntegerType.get_signless(8 * size))
        off = arith.muli(arith.addi(first, c(64 * b + 8 * h)), c(size))
        llvm.store(value, mu.getelementptr(ptr, [off], i8))
    return ()

  store(ref, tuple(rows))


def _v_operands(codes_ref, scales_ref, head_dim, fmt, fold=False):
  """A block's V^T as wgmma A operands from registers: codes [64 slots, head_dim / 2] and this
  kv head's block scales, [blocks, 64 slots] (bf16 for MXFP4, float32 E4M3 x global for NVFP4,
  what `_scale_row` makes), in shared memory -> head_dim / 64 bf16 tiles [64, 64] in the WGMMA
  layout (rows in `v_rows` order, columns the slots). `fold`: MXFP4 scales folded (`FOLD_REF`)."""
  from jax.experimental.mosaic import gpu as mgpu
  from jax.experimental.mosaic.gpu import utils as mu
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jaxlib.mlir import ir
  from jaxlib.mlir.dialects import arith, llvm

  wgmma = plgpu.Layout.WGMMA
  tiles = head_dim // 64
  out = plgpu.ShapeDtypeStruct((64, BLOCK_S), jnp.bfloat16, wgmma)
  nv = fmt == "nvfp4"

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()),
                     return_type=tuple(out for _ in range(tiles)))
  def operands(_, codes, scales):
    i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
    pair = ir.VectorType.get((2,), ir.BF16Type.get())
    c = lambda v: mu.c(v, i32)
    tid = _thread_index()
    lane = arith.andi(tid, c(31))
    warp = arith.andi(arith.shrui(tid, c(5)), c(3))
    codes_row = ir.MemRefType(codes.type).get_strides_and_offset()[0][0]
    codes_ptr, scales_ptr = mu.memref_ptr(codes), mu.memref_ptr(scales)
    shape = mgpu.WGMMA_LAYOUT.registers_shape((64, BLOCK_S))
    regs = [np.empty(shape, dtype=object) for _ in range(tiles)]
    quad = arith.shli(arith.andi(lane, c(3)), c(1))  # 2 (t % 4): the thread's first slot
    struct2 = llvm.StructType.get_literal([i32, i32])
    struct4 = llvm.StructType.get_literal([i32] * 4)
    asm = V_PAIR_ASM["mxfp4_folded" if fold else fmt]
    for pi in range(tiles // 2):
      col = arith.shli(arith.addi(warp, c(4 * pi)), c(4))  # the warp's 16 code bytes
      if nv:  # 16-entry blocks: the thread's 4 entries in the first or second of the warp's two
        block = arith.addi(arith.addi(arith.shli(warp, c(1)), arith.shrui(lane, c(4))),
                           c(8 * pi))
      else:  # one 32-entry block a warp
        block = arith.addi(warp, c(4 * pi))
      block_base = arith.muli(block, c(BLOCK_S))

      def scale_word(slot):  # MXFP4: the bf16 pair of slot, slot + 1; NVFP4: slot's float32
        off = arith.muli(arith.addi(block_base, slot), c(4 if nv else 2))
        return llvm.load(i32, mu.getelementptr(scales_ptr, [off], i8))

      for k in range(BLOCK_S // 32):
        row = arith.addi(lane, c(32 * k))
        addr = mu.getelementptr(codes_ptr, [arith.addi(arith.muli(row, c(codes_row)), col)], i8)
        got = llvm.inline_asm(struct4, [addr], *_V_LDMATRIX, has_side_effects=True)
        words = [llvm.extractvalue(i32, got, [q]) for q in range(4)]
        for q, word in enumerate(words):
          s0 = arith.addi(quad, c(32 * k + 8 * q))
          if nv:
            operands = [word, scale_word(s0), scale_word(arith.addi(s0, c(1)))]
          else:
            operands = [word, scale_word(s0)]
          for b, sel in enumerate(("0x2404", "0x3414")):  # bytes 0, 2 then 1, 3: n = 2b + h
            res = llvm.inline_asm(struct2, operands, asm[sel],
                                  "=r,=r" + ",r" * len(operands))
            for h in range(2):
              idx = [0] * len(shape)
              idx[1], idx[4] = 4 * k + q, h
              regs[2 * pi + b][tuple(idx)] = mu.bitcast(llvm.extractvalue(i32, res, [h]), pair)
    return tuple(mgpu.FragmentedArray(_registers=r, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)
                 for r in regs)

  return operands(codes_ref, scales_ref)


def _body(q_gmem, mask_gmem, end_gmem, *refs, fmt, head_dim, kv_heads, steps,
          max_concurrent_steps, fold=False, blocks=1, lean=False):
  """One (batch, kv head, split) program: its split's blocks of 64 slots in a pipeline, `blocks`
  of them a step (FP4 caches: each block's scores, then one max across the warpgroup and one
  barrier for all of them). `fold` (MXFP4): the decode's 2^126 folded into the scales
  (`FOLD_REF`). `lean` (FP4 caches): fewer registers live for less overlap, so that more
  programs fit an SM: each chunk of K's codes decoded after the matrix instruction of the chunk
  before has finished with its registers, and with two blocks a step the second block's V^T
  after the first block's instruction has (`wgmma_wait`)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  n_cache = _N_CACHE[fmt]
  k_gmem, v_gmem = refs[:n_cache], refs[n_cache:2 * n_cache]
  o_gmem, m_gmem, l_gmem = refs[2 * n_cache:]
  bi, hi, si = (jax.lax.axis_index(a) for a in ("b", "h", "s"))
  wgmma = plgpu.Layout.WGMMA
  row_l, col_l = wgmma.reduce(1), wgmma.reduce(0)
  parts = 1 if fmt == "bf16" else 2  # the even and odd head_dim entries, or all of them
  width = head_dim // parts
  v_regs = fmt != "bf16"  # V^T from registers (FP4, `v_in_registers`): O^T in 64-row tiles
  o_parts, o_width = (head_dim // 64, 64) if v_regs else (1, head_dim)
  nb = head_dim // (32 if fmt == "mxfp4" else 16)  # scale blocks of a head's row
  chunks = head_dim // 2 // CHUNK
  if blocks > 1 and not v_regs:
    raise ValueError(f"blocks > 1 takes FP4 caches, got {fmt}")
  span = BLOCK_S * blocks  # slots a pipeline step
  if fold and fmt != "mxfp4":
    raise ValueError(f"fold takes MXFP4 caches, got {fmt}")
  unfold = 2.0 ** (FOLD_REF - 127) if fold else 1.0  # what the folded values are short of
  score_scale = head_dim**-0.5 * unfold

  def scale_rows(scales_smem, g_smem):
    """This kv head's scale rows (`_scale_row`), one [64] vector a block."""
    g = None
    if g_smem is not None:  # NVFP4's float32 global of each (slot, head), from its four bytes
      [word] = _head_words(g_smem, hi, 4)
      g = jax.lax.bitcast_convert_type(word, jnp.float32)
    if fold:
      return [plgpu.layout_cast(fold_scale_bf16(s, unfold), row_l)
              for s in _head_bytes(scales_smem, hi, nb)]
    return [plgpu.layout_cast(_scale_row(s.astype(jnp.uint8), fmt, g), row_l)
            for s in _head_bytes(scales_smem, hi, nb)]

  def decode(cache_smem):
    """A block's codes -> each chunk's (low, high) nibbles' bf16 values, [64, CHUNK] each, as
    a generator: a chunk is decoded when it is asked for."""
    codes_smem, scales_smem = cache_smem[:2]
    rows = scale_rows(scales_smem, cache_smem[2] if fmt == "nvfp4" else None)
    per = nb // chunks  # scale blocks a chunk
    return (_decode_asm([_load(codes_smem.at[:, pl.ds(j * CHUNK, CHUNK)], wgmma)],
                        rows[j * per:(j + 1) * per], fmt, folded=fold) for j in range(chunks))

  def step(_, mask_smem, *cache_smem, q_smem, vs_smem, p_smem):
    *cache_smem, carry = cache_smem
    m, l_rows, o = carry
    k_smem, v_smem = cache_smem[:n_cache], cache_smem[n_cache:]

    def block(refs, i):  # the i-th 64 slots of a step's refs
      return refs if blocks == 1 else [r.at[pl.ds(i * BLOCK_S, BLOCK_S)] for r in refs]

    def scores(k_refs):
      def run(acc_ref):
        if fmt == "bf16":
          plgpu.wgmma(acc_ref, k_refs[0], q_smem[0])
        else:
          pairs = decode(k_refs)
          if not lean:  # every chunk decoded before the first instruction
            pairs = list(pairs)
          for j, pair in enumerate(pairs):
            for nibbles, q_part in zip(pair, q_smem):
              plgpu.wgmma(acc_ref, nibbles, q_part.at[pl.ds(j * CHUNK, CHUNK)])
            if lean and j + 1 < chunks:  # this chunk's registers free before the next's
              plgpu.wgmma_wait(0)
        return acc_ref[...]
      return pl.run_scoped(run, plgpu.ACC((BLOCK_S, ROWS), jnp.float32)) * score_scale

    ss, valids = [], []
    for i in range(blocks):
      s = scores(block(k_smem, i))
      [mask_i] = block([mask_smem], i)
      valid = _load(mask_i, row_l) != 0
      valid = plgpu.layout_cast(jax.lax.broadcast_in_dim(valid, s.shape, [0]), wgmma)
      ss.append(jnp.where(valid, s, _MASKED))
      valids.append(valid)
    top = ss[0]
    for s in ss[1:]:  # the blocks' scores meet in one max across the warpgroup
      top = jnp.maximum(top, s)
    m_new = jnp.maximum(m, jnp.max(top, axis=0))
    alpha = jnp.exp(m - m_new)
    # l stays per slot row (summed over the rows once, after the last block): no reduction
    # across the warpgroup a step
    l_rows = l_rows * jax.lax.broadcast_in_dim(alpha, top.shape, [1])
    for i, (s, valid) in enumerate(zip(ss, valids)):
      p = jnp.where(valid, jnp.exp(s - jax.lax.broadcast_in_dim(m_new, s.shape, [1])), 0.0)
      l_rows = l_rows + p
      p_smem[i][...] = p.astype(jnp.bfloat16)
      if v_regs:  # V's scales, one row a block, from where each thread reads its slots' own
        v_i = block(v_smem, i)
        _store_rows(vs_smem[i], scale_rows(v_i[1], v_i[2] if fmt == "nvfp4" else None))
    plgpu.commit_smem()  # (a warpgroup barrier too)
    v_ops = lambda i: _v_operands(block(v_smem, i)[0], vs_smem[i], head_dim, fmt, fold)
    first = v_ops(0) if v_regs else None
    rescale = jax.lax.broadcast_in_dim(alpha, (o_width, ROWS), [1])

    def pv(acc_refs):
      if v_regs:  # a later block's V^T decoded while the wgmma before it runs (lean: after)
        for i in range(blocks):
          for acc_ref, v_op in zip(acc_refs, first if i == 0 else v_ops(i)):
            plgpu.wgmma(acc_ref, v_op, p_smem[i])
          if lean and i + 1 < blocks:
            plgpu.wgmma_wait(0)
        return
      [acc_ref], [v_ref] = acc_refs, v_smem  # bf16: V as it is, read transposed
      # .at[:]: a transformed ref, which transposes on every jax version
      plgpu.wgmma(acc_ref, v_ref.at[:].transpose((1, 0)), p_smem[0])

    o = pl.run_state(pv)(tuple(plgpu.ACC.init(acc * rescale) for acc in o))
    return m_new, l_rows, o

  def empty():
    """(m, l, o) of no slot: what a split past the sequence's end writes."""
    return (plgpu.layout_cast(jnp.full((ROWS,), _MASKED, jnp.float32), col_l),
            plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), col_l),
            tuple(plgpu.layout_cast(jnp.zeros((o_width, ROWS), jnp.float32), wgmma)
                  for _ in range(o_parts)))

  def run(q_smem, vs_smem, p_smem, barrier):
    for i, q_part in enumerate(q_smem):  # Q^T's even and odd rows (or all), once
      plgpu.copy_gmem_to_smem(q_gmem.at[bi, hi, pl.ds(i * width, width)], q_part, barrier)
      plgpu.barrier_wait(barrier)
    s0 = si * steps
    # the values (or codes) of this kv head; the scales and globals of all heads
    cache_specs = [plgpu.BlockSpec((None, span, k_gmem[0].shape[2] // kv_heads),
                                   lambda k: (bi, s0 + k, hi))]
    cache_specs += [plgpu.BlockSpec((None, span, a.shape[2]), lambda k: (bi, s0 + k, 0))
                    for a in k_gmem[1:]]
    m0, _, o0 = empty()
    l_rows0 = plgpu.layout_cast(jnp.zeros((BLOCK_S, ROWS), jnp.float32), wgmma)
    m, l_rows, o = plgpu.emit_pipeline(
        functools.partial(step, q_smem=q_smem, vs_smem=vs_smem, p_smem=p_smem),
        grid=(steps,),
        in_specs=[plgpu.BlockSpec((None, span), lambda k: (bi, s0 + k)),
                  *cache_specs, *cache_specs],
        max_concurrent_steps=max_concurrent_steps, init_carry=(m0, l_rows0, o0),
    )(mask_gmem, *k_gmem, *v_gmem)
    return m, jnp.sum(l_rows, axis=0), o

  scoped = dict(q_smem=[plgpu.SMEM((width, ROWS), jnp.bfloat16) for _ in range(parts)],
                vs_smem=[plgpu.SMEM((nb, BLOCK_S), jnp.float32 if fmt == "nvfp4"
                                    else jnp.bfloat16) for _ in range(blocks)] if v_regs else None,
                p_smem=[plgpu.SMEM((BLOCK_S, ROWS), jnp.bfloat16) for _ in range(blocks)],
                barrier=plgpu.Barrier())

  def store(m, l, o):
    # each bulk copy's shared-memory side in an allocation of its own (aligned as copies need)
    @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((head_dim, ROWS), jnp.float32),
                       m_smem=plgpu.SMEM((ROWS,), jnp.float32),
                       l_smem=plgpu.SMEM((ROWS,), jnp.float32))
    def _(o_smem, m_smem, l_smem):
      for i, acc in enumerate(o):
        o_smem[pl.ds(i * o_width, o_width)] = acc * unfold if fold else acc
      m_smem[...] = m
      l_smem[...] = l
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[si, bi, hi])
      plgpu.copy_smem_to_gmem(m_smem, m_gmem.at[si, bi, hi])
      plgpu.copy_smem_to_gmem(l_smem, l_gmem.at[si, bi, hi])
      plgpu.wait_smem_to_gmem(0)

  # a split that starts at or past the sequence's end (a cache longer than what it holds so far)
  # reads nothing and writes the empty state
  reads = si * steps * span < end_gmem[bi]
  pl.when(reads)(lambda: store(*pl.run_scoped(run, **scoped)))
  pl.when(jnp.logical_not(reads))(lambda: store(*empty()))



@functools.partial(jax.jit, static_argnames=("fmt", "splits", "max_concurrent_steps", "fold",
                                             "blocks", "lean"))
def decode_attention_partials(q_t, mask, end, k_arrays, v_arrays, *, fmt: str, splits: int = 1,
                              max_concurrent_steps: int = 2, fold: bool = False,
                              blocks: int = 1, lean: bool = False):
  """Q^T q_t [B, Kv, Dh, 16] bf16 (the query heads of each kv head padded to 16; for the packed
  formats head_dim in [even | odd] order), mask [B, S] int32 (a block's 256 bytes keep every
  pipeline slot aligned for its bulk copy), end [B] int32 (`kernel.valid_end` of the mask:
  splits that start from it on read nothing), each cache as 3-D arrays of [B, S, bytes a slot]
  (bf16 [B, S, Kv x Dh]; codes [B, S, Kv x Dh/2], scales [B, S, Kv x Dh/block] bytes and
  NVFP4's globals [B, S, Kv x 4] bytes), the kv heads of a slot side by side ->
  per split: o^T [splits, B, Kv, Dh, 16] (unnormalized; Dh in q's order for a bf16 cache, in
  `v_rows` order for an FP4 one, whose V^T comes from registers), m and l
  [splits, B, Kv, 16]. `fold` (MXFP4): the scales carry the decode's 2^126 (`FOLD_REF`).
  `blocks`: 64-slot blocks a pipeline step (FP4 caches; the slots a multiple of 64 x blocks x
  splits). `lean`: fewer registers for less overlap (`_body`; FP4 caches)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _check(fmt)
  b, kv, dh, rows = q_t.shape
  s = mask.shape[1]
  if rows != ROWS or s % (BLOCK_S * blocks * splits) or dh % (2 * CHUNK) or (
      fmt != "bf16" and not v_in_registers(fmt, dh)) or blocks not in BLOCKS or (
      blocks > 1 and fmt == "bf16"):
    raise ValueError(f"the wgmma decode attention needs q^T [B, Kv, Dh, {ROWS}] (got "
                     f"{q_t.shape}), the slots ({s}) divisible by {BLOCK_S} x blocks ({blocks}, "
                     f"one of {BLOCKS}; above 1 for FP4 caches only) x splits ({splits}) and "
                     f"head_dim a multiple of {2 * CHUNK} (of 128 for an FP4 cache)")
  steps = s // BLOCK_S // blocks // splits
  body = functools.partial(_body, fmt=fmt, head_dim=dh, kv_heads=kv, steps=steps,
                           max_concurrent_steps=min(max_concurrent_steps, steps), fold=fold,
                           blocks=blocks, lean=lean and fmt != "bf16")
  body.__name__ = "decode_attention_wgmma"
  out_type = (jax.ShapeDtypeStruct((splits, b, kv, dh, rows), jnp.float32),
              jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32),
              jax.ShapeDtypeStruct((splits, b, kv, rows), jnp.float32))
  return plgpu.kernel(
      body, out_type=out_type, grid=(b, kv, splits), grid_names=("b", "h", "s"),
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
          approx_math=True),  # exp as ex2.approx(x log2 e), as Triton's exp
  )(q_t, mask, end.astype(jnp.int32), *k_arrays, *v_arrays)


def _check(fmt):
  if fmt not in _N_CACHE:
    raise ValueError(f"fmt must be one of {tuple(_N_CACHE)}, got {fmt!r}")


def unsupported(kv_heads: int, head_dim: int, group: int, fmt: str, slots: int) -> str | None:
  """Why the wgmma kernel cannot take these sizes, or None if it can: at most 16 query heads a kv
  head, head_dim a multiple of 64 (of 128 for FP4 caches, whose V it reads from registers: V
  through shared memory would make O^T tiles of head_dim / 2 rows, below wgmma's 64 at 64 and
  not a multiple of it at 192), the slots a multiple of 64, and each bulk-copied row of the
  scales (and NVFP4's globals), all kv heads of a slot side by side, a multiple of 16 bytes
  whose halves hold whole heads."""
  if group > ROWS:
    return f"at most {ROWS} query heads a kv head (got {group})"
  if head_dim % (2 * CHUNK) or slots % BLOCK_S:
    return (f"head_dim ({head_dim}) and the slots ({slots}) multiples of {2 * CHUNK} and "
            f"{BLOCK_S}")
  if fmt == "bf16":
    return None
  if not v_in_registers(fmt, head_dim):
    return f"head_dim ({head_dim}) a multiple of 128 for a {fmt} cache"
  per_head = {"scales": head_dim // (32 if fmt == "mxfp4" else 16)}
  if fmt == "nvfp4":
    per_head["globals"] = 4
  for what, n in per_head.items():
    width = max(8, kv_heads * n // 2)  # `_head_words`
    if (kv_heads * n) % 16 or (width % n and n % width):
      return (f"the {fmt} {what} of a slot's {kv_heads} kv heads ({kv_heads} x {n} bytes) a "
              f"multiple of 16 bytes whose halves hold whole heads")
  return None


def supports(kv_heads: int, head_dim: int, group: int, fmt: str, slots: int = BLOCK_S) -> bool:
  """Whether the wgmma kernel takes these sizes (`unsupported`)."""
  return unsupported(kv_heads, head_dim, group, fmt, slots) is None


def _slot_rows(cache, b, s):
  """A cache (bf16 [B, S, Kv, Dh] or a packed `QArray`) -> the Triton kernel's arrays
  (`cache.cache_arrays`) as this kernel's [B, S, bytes a slot]; NVFP4's float32 globals as
  their four bytes each."""
  fmt, arrays = cache_arrays(cache)
  if fmt == "nvfp4":
    arrays = (*arrays[:2], jax.lax.bitcast_convert_type(arrays[2].astype(jnp.float32), jnp.uint8))
  return tuple(a.reshape(b, s, -1) for a in arrays)


def decode_attention(q_BxHxDh: jax.Array, k, v, mask_BxS: jax.Array, *,
                     splits: int | None = None, max_concurrent_steps: int = 2,
                     fold: bool = False, blocks: int = 1, lean: bool = False) -> jax.Array:
  """`api.decode_attention`'s "pallas" path on the wgmma kernel (compiled Hopper only): q
  [B, H, Dh], caches [B, S, Kv, Dh] (bf16, or MXFP4 / NVFP4 `QArray`s along head_dim), mask
  [B, S] -> [B, H, Dh] bf16. Inputs are checked by the caller (`api`). `fold`: MXFP4 caches
  decoded with the scales folded (`FOLD_REF`; ignored for the other formats). `blocks`: 64-slot
  blocks a pipeline step, for FP4 caches (bf16 ones take 1 whatever is asked). `lean`: fewer
  registers live for less overlap (`_body`; FP4 caches, ignored for bf16 ones)."""
  b, h, dh = q_BxHxDh.shape
  s, kv = k.shape[1], k.shape[2]
  fmt = cache_format(k)
  g = h // kv
  why = unsupported(kv, dh, g, fmt, s)
  if why:
    raise ValueError(f"the wgmma decode attention needs {why}")
  q = q_BxHxDh.astype(jnp.bfloat16).reshape(b, kv, g, dh)
  if fmt != "bf16":  # head_dim in [even | odd] order, the order of the decoded nibbles
    q = jnp.concatenate([q[..., 0::2], q[..., 1::2]], axis=-1)
  q_t = jnp.swapaxes(jnp.pad(q, ((0, 0), (0, 0), (0, ROWS - g), (0, 0))), -1, -2)
  if blocks not in BLOCKS:
    raise ValueError(f"blocks must be one of {BLOCKS}, got {blocks!r}")
  blocks = 1 if fmt == "bf16" else blocks
  span = BLOCK_S * blocks
  if s % span:
    raise ValueError(f"the slots ({s}) must be a multiple of {span} ({blocks} blocks of "
                     f"{BLOCK_S} a step)")
  splits = splits or default_splits(b * kv, s // span)
  if (s // span) % splits:
    raise ValueError(f"splits ({splits}) must divide the {s // span} steps of {span} slots")
  o_t, m, l = decode_attention_partials(
      q_t, mask_BxS.astype(jnp.int32), kernel.valid_end(mask_BxS), _slot_rows(k, b, s),
      _slot_rows(v, b, s), fmt=fmt, splits=splits, max_concurrent_steps=max_concurrent_steps,
      fold=fold and fmt == "mxfp4", blocks=blocks, lean=lean)
  # the splits combined along O^T's memory, then its g real rows of 16 transposed
  out_t = kernel.combine(o_t, m, l, dh_axis=-2)[..., :g]  # [B, Kv, Dh, g]
  if fmt != "bf16":  # O^T's rows in `v_rows` order (V^T from registers)
    out_t = out_t[:, :, np.argsort(v_rows(dh))]
  return jnp.swapaxes(out_t, -1, -2).reshape(b, h, dh).astype(jnp.bfloat16)
