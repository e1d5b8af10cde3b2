"""The Mosaic GPU (wgmma) matmul kernels: layout and lowering on CPU, numerics on a GPU (-m gpu).

Mosaic GPU has no interpret mode; on CPU the kernels are lowered for CUDA (layout inference and
the kernel's own checks run there), and compiled only on a Hopper GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp4_matmul import api, kernel, layout, mosaic, reference
from tests.pallas_kernels import ptx_emu
from tests.pallas_kernels.routes import routed_rows
from trace_jax.quant import FP8, MXFP4, NVFP4_TENSOR, QArray, quantize

FORMATS = [MXFP4, NVFP4_TENSOR]


def kmajor_weight(seed, k, n, fmt):
  w = jax.random.normal(jax.random.PRNGKey(seed), (k, n))
  w = w * jnp.exp(jax.random.normal(jax.random.PRNGKey(seed + 1), (1, n)))  # column scales
  return reference.transpose(quantize(w, fmt, axis=0))


def _halves_bytes(codes):
  """Packed K-major codes [..., K/2] -> the "halves" order, element by element: byte p of each
  8 holds values p (low nibble) and p + 8 (high) of its 16."""
  codes = np.asarray(codes)
  nib = np.empty((*codes.shape[:-1], 2 * codes.shape[-1]), np.uint8)
  nib[..., 0::2], nib[..., 1::2] = codes & 15, codes >> 4  # value k of the row
  out = np.empty_like(codes)
  for b in range(codes.shape[-1]):
    group, p = divmod(b, 8)
    out[..., b] = nib[..., 16 * group + p] | nib[..., 16 * group + p + 8] << 4
  return out


@pytest.mark.parametrize("order", layout.ORDERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tile_is_a_layout_change(fmt, order):
  """Every code byte and scale lands in the tile the kernel reads for its row and K range (in
  the "halves" order each byte holds the two values the docstring says), and `untile` gives
  the packed weight back, bit for bit, from either input layout."""
  n, k = 128, 256
  w = kmajor_weight(0, k, n, fmt)
  t = layout.tile(w, order)
  codes, scales = np.asarray(t.codes), np.asarray(t.scales)
  assert codes.shape == (n // 64, k // 64, 64, 32) and t.shape == (k, n) and not t.grouped
  assert t.order == order
  want = np.asarray(w.codes) if order == "pairs" else _halves_bytes(w.codes)
  if order == "halves":
    assert (want != np.asarray(w.codes)).mean() > 0.5  # a permutation that moves bytes
  rows, cols = np.meshgrid(np.arange(n), np.arange(k // 2), indexing="ij")
  np.testing.assert_array_equal(codes[rows // 64, cols // 32, rows % 64, cols % 32], want)
  block = fmt.block_size
  rows, blocks = np.meshgrid(np.arange(n), np.arange(k // block), indexing="ij")
  np.testing.assert_array_equal(scales[rows // 64, blocks, rows % 64], np.asarray(w.scales))
  if w.global_scale is None:  # MXFP4: the fold's reference, 2^(R - 127)
    s = np.asarray(w.scales).astype(int)
    want_g = 2.0 ** (max(127, s[s < 255].max() - 1) - 127)
  else:
    want_g = float(np.asarray(w.global_scale).reshape(()))
  assert float(t.global_scale) == want_g
  kn = reference.transpose(w)  # the [K, N] weight the rollout engine holds
  for a, b in zip(jax.tree.leaves(t), jax.tree.leaves(layout.tile(kn, order))):
    np.testing.assert_array_equal(a, b)
  back = layout.untile(t)
  assert jax.tree.structure(back) == jax.tree.structure(kn)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(kn)):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


def test_tile_names_what_is_wrong():
  w = kmajor_weight(0, 256, 128, MXFP4)
  with pytest.raises(ValueError, match="QArray"):
    layout.tile(jnp.zeros((256, 128)))
  with pytest.raises(ValueError, match="MXFP4 and per-tensor NVFP4.*fp8"):
    layout.tile(quantize(jnp.ones((256, 128)), FP8, axis=0))
  with pytest.raises(ValueError, match="divisible by 64"):
    layout.tile(kmajor_weight(0, 256, 96, MXFP4))
  with pytest.raises(ValueError, match=r"order must be one of \('pairs', 'halves'\), got 'odd'"):
    layout.tile(w, "odd")
  halves = layout.tile(w, "halves")
  with pytest.raises(ValueError, match="'asm' for the 'halves' order"):
    mosaic.fp4_matmul(jnp.zeros((2, 256), jnp.bfloat16), halves, decode="jnp")
  x = jnp.zeros((16, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"takes x as \(x,\), got 2 arrays"):
    mosaic.fp4_wgmma_partials((x, x), halves.codes, halves.scales, halves.global_scale,
                              fmt="mxfp4", order="halves")
  with pytest.raises(ValueError, match=r"takes x as \(xe_t, xo_t\), got 1 arrays"):
    mosaic.fp4_wgmma_partials((x.T,), halves.codes, halves.scales, halves.global_scale,
                              fmt="mxfp4")
  with pytest.raises(ValueError, match="layout.tile"):
    mosaic.fp4_matmul(jnp.zeros((2, 256), jnp.bfloat16), w)
  with pytest.raises(ValueError, match="features"):
    mosaic.fp4_matmul(jnp.zeros((2, 128), jnp.bfloat16), layout.tile(w))
  with pytest.raises(ValueError, match="shared memory"):
    mosaic.pipeline(256, 1024, "mxfp4", block_k2=512)


@pytest.mark.parametrize("m", [16, 32, 64, 96, 128, 192, 256])
def test_pipeline_fits_shared_memory(m):
  """The default K step keeps three or four steps in flight within a block's shared memory."""
  for fmt, per_scale in (("mxfp4", 16), ("nvfp4", 8)):
    bk, steps = mosaic.pipeline(m, 1024, fmt)
    stage = 2 * bk * m * 2 + bk * 64 + bk // per_scale * 64
    assert 3 <= steps <= 4 and steps * stage + 64 * min(m, 32) * 4 <= mosaic.SMEM_BYTES


def test_nibbles_asm_is_the_triton_decode_of_two_bytes():
  """The Mosaic kernels' PTX (`E2M1_NIBBLES_ASM`: both nibbles of a pair of codes bytes, emulated)
  gives the bits of the four-byte one the Triton kernels run (checked bit for bit in
  test_fp4_matmul) for codes bytes 0 and 1, and `e2m1_nibbles_asm`'s other byte choices those
  of bytes 0 and 2, 1 and 3."""
  rng = np.random.default_rng(2)
  with np.errstate(over="ignore", invalid="ignore"):  # random scale bits: Inf, NaN products
    for _ in range(300):
      q = int(rng.integers(0, 1 << 32, dtype=np.uint64))
      bf = [int(v) for v in rng.integers(0, 1 << 16, 2)]
      f32 = [int(v) for v in rng.integers(0, 1 << 32, 2, dtype=np.uint64)]
      lo, hi = (ptx_emu.run(kernel.E2M1_ASM[n], 2, [q, bf[0] | bf[0] << 16, bf[1]])[0]
                for n in ("lo", "hi"))
      assert ptx_emu.run(mosaic.E2M1_NIBBLES_ASM["mxfp4"], 2,
                         [q & 0xFFFF, bf[0] | bf[0] << 16]) == [lo, hi]
      lo, hi = (ptx_emu.run(kernel.E2M1_NV_ASM[n], 2, [q, *f32, 0, 0])[0] for n in ("lo", "hi"))
      assert ptx_emu.run(mosaic.E2M1_NIBBLES_ASM["nvfp4"], 2, [q & 0xFFFF, *f32]) == [lo, hi]
      for sel, picked in (("0x2404", (0, 2)), ("0x3414", (1, 3))):
        two = (q >> 8 * picked[0] & 0xFF) | (q >> 8 * picked[1] & 0xFF) << 8
        want = ptx_emu.run(mosaic.E2M1_NIBBLES_ASM["mxfp4"], 2, [two, bf[0] | bf[1] << 16])
        assert ptx_emu.run(kernel.e2m1_nibbles_asm(sel), 2, [q, bf[0] | bf[1] << 16]) == want


def test_folded_nibbles_asm_gives_each_code_over_the_fold_reference():
  """`FOLDED_NIBBLES_ASM` (emulated) with `fold_scale_bf16`'s multiplier, for every scale byte
  and every code in both nibbles of both bytes: E2M1 x 2^(s - ref), bit for bit, for s in
  [ref - 132, ref + 1], and where an E8M0 byte holds 2^(s - ref) (s >= ref - 126) the bits the
  unfolded decode gives at that scale; below that range the values round to bf16's subnormals,
  above it they are not finite (Inf, or NaN for the zero codes)."""
  ref = 192
  values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6] * 2) * np.repeat([1, -1], 8)
  words = [(c | (c + 1) % 16 << 4) | ((c + 5) % 16 | (c + 9) % 16 << 4) << 8 for c in range(16)]
  with np.errstate(over="ignore", invalid="ignore"):
    for s in range(256):
      mult = int(np.asarray(kernel.fold_scale_bf16(np.int32(s), 2.0 ** (ref - 127))).view(
          np.uint16))
      unfolded = s - ref + 127  # the E8M0 byte of the same power of two, where there is one
      for word in words:
        lo, hi = ptx_emu.run(mosaic.FOLDED_NIBBLES_ASM, 2, [word, mult | mult << 16])
        got = [ptx_emu.bf16_bits_to_f32(r >> 16 * e & 0xFFFF) for r in (lo, hi) for e in (0, 1)]
        codes = [word & 15, word >> 8 & 15, word >> 4 & 15, word >> 12 & 15]
        exact = [values[c] * 2.0 ** (s - ref) for c in codes]
        if s > ref + 1:
          assert all(np.isinf(g) or np.isnan(g) for g in got), s
          continue
        if s >= ref - 132:
          assert got == [np.float32(w) for w in exact], (s, word)
        else:  # rounded to the subnormals' last place, 2^-133
          assert all(abs(float(g) - w) <= 2.0**-134 for g, w in zip(got, exact)), (s, word)
        if unfolded >= 1:  # (byte 0 the unfolded decode reads as 0)
          bits = (unfolded << 7) | (unfolded << 7) << 16
          assert [lo, hi] == ptx_emu.run(mosaic.E2M1_NIBBLES_ASM["mxfp4"], 2, [word, bits]), s


def _wgmma_elements(shape):
  """{(thread, register index): [(row, column) of each element of the register's vector]} of a
  [64, C] array in Mosaic's WGMMA layout, computed from the layout's own tiling (jax's
  `fragmented_array.WGMMA_LAYOUT`: its tile strides, warp and lane dimensions), not from a
  description of it."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  layout = fa.WGMMA_LAYOUT
  strides = layout.tiling.tile_strides((shape[1], 1))
  tiled, rank = layout.tiled_tiling_shape, layout.tiled_tiling_rank
  dims = strides[-rank:]

  def offset(i, which):
    sizes = [tiled[d] for d in which]
    place = [0] * len(tiled)
    for d, n in zip(which, sizes):
      inner = int(np.prod(sizes[which.index(d) + 1:]))
      place[d] = i // inner % n
    return sum(p * s for p, s in zip(place, dims))

  out = {}
  for thread in range(128):
    warp, lane = divmod(thread, 32)
    base = offset(warp, layout.warp_dims) + offset(lane, layout.lane_dims)
    for idx in np.ndindex(layout.registers_shape(shape)):
      flat = base + sum(i * s for i, s in zip(idx, strides))
      out[thread, idx] = [divmod(flat + v, shape[1]) for v in range(layout.vector_length)]
  return out


def test_wgmma_registers_are_what_the_decode_models_assume():
  """The register model of the decodes (`test_halves_registers_hold_a_tile_in_k_order`, and
  `_decode_asm`'s scale choice): in Mosaic's WGMMA layout, for [64, 32] (the codes tile) and
  [64, 64] (a bf16 A tile) alike, thread t's register (1, j, 1, 1, h, ...) holds row
  16 (t // 32) + (t % 32) // 4 + 8 h, columns 8 j + 2 (t % 4) and the next."""
  for shape in ((64, 32), (64, 64)):
    for (thread, idx), elements in _wgmma_elements(shape).items():
      warp, lane = divmod(thread, 32)
      row, col = 16 * warp + lane // 4 + 8 * idx[4], 8 * idx[1] + 2 * (lane % 4)
      assert elements == [(row, col), (row, col + 1)], (shape, thread, idx)


def test_interleaved_registers_are_the_halves_order_in_k_order():
  """`mosaic.interleave_column_tiles`, the register naming `_decode_asm` gives the "halves"
  order: each element of the [64, 64] tile it makes, read through jax's WGMMA layout, is the K
  value the "halves" byte it was decoded from holds there (byte c of a codes row: values
  16 (c // 8) + c % 8 in its low nibble, and 8 more in its high one)."""
  from jax.experimental.mosaic.gpu import fragmented_array as fa
  codes, tile = _wgmma_elements((64, 32)), _wgmma_elements((64, 64))
  names = {}
  for nibble in ("lo", "hi"):  # each register of the two decoded arrays named by its origin
    names[nibble] = np.empty(fa.WGMMA_LAYOUT.registers_shape((64, 32)), object)
    for idx in np.ndindex(names[nibble].shape):
      names[nibble][idx] = (nibble, idx)
  both = mosaic.interleave_column_tiles(names["lo"], names["hi"])
  assert both.shape == fa.WGMMA_LAYOUT.registers_shape((64, 64))
  for (thread, idx), elements in tile.items():
    nibble, src = both[idx]
    (row, byte), (_, byte1) = codes[thread, src]
    ks = [16 * (b // 8) + b % 8 + (8 if nibble == "hi" else 0) for b in (byte, byte1)]
    assert elements == [(row, ks[0]), (row, ks[1])], (thread, idx)


@pytest.mark.parametrize("fmt,fold", [(MXFP4, False), (NVFP4_TENSOR, False), (MXFP4, True)],
                         ids=["mxfp4", "nvfp4_tensor", "mxfp4-fold"])
def test_halves_registers_hold_a_tile_in_k_order(fmt, fold):
  """The "halves" order's A operand, modelled thread by thread from wgmma's register layout
  (thread t of the warpgroup: rows 16 (t // 32) + (t % 32) // 4 and 8 more, columns 2 (t % 4)
  and 2 (t % 4) + 1 of each 8-column tile; a codes register holds two bytes, a bf16 one two
  values): each codes register decoded by the kernels' PTX (emulated) with its block's scale,
  its low-nibble pair named bf16 column tile 2j and its high-nibble pair 2j + 1, as
  `mosaic._decode_asm` names them (`interleave_column_tiles`, checked against jax's layout
  below, as is this register model), gives the weight's bf16 values in K's order, every one.
  `fold`: the folded decode (`FOLDED_NIBBLES_ASM`, each block's multiplier against the weight's
  reference, here above 2^1 by a scaled column) gives those values over the reference's
  2^(R - 127), exactly."""
  n, k = 64, 128
  w = kmajor_weight(11, k, n, fmt)
  if fold:  # one output row's blocks at 2^3 to 2^5: the reference above 127
    w = QArray(w.codes, w.scales.at[5].set(jnp.uint8(130 + jnp.arange(k // 32) % 3)),
               w.global_scale, w.fmt, w.axis)
  t = layout.tile(w, "halves")
  want = np.asarray(reference.dequantize_bf16(t)).T.view(np.uint16)  # [N, K] bf16 bits
  if fold:
    g = np.float32(np.asarray(t.global_scale))
    assert g == 2.0 ** (132 - 1 - 127)  # R: the largest byte (132) less one
    want = (want.astype(np.uint32) << 16).view(np.float32) / g
    want = (want.view(np.uint32) >> 16).astype(np.uint16)  # exact: g is a power of two
  codes, scales = np.asarray(t.codes)[0], np.asarray(t.scales)[0]  # [K/64, 64, 32], [K/b, 64]
  g = np.float32(np.asarray(t.global_scale))
  got = np.zeros((n, k), np.uint16)
  for c in range(k // 64):  # a chunk: one [64, 32]-byte codes tile, a [64, 64] A tile
    for thread in range(128):
      warp, lane = divmod(thread, 32)
      for h in range(2):
        row = 16 * warp + lane // 4 + 8 * h
        for j in range(4):  # the codes tile's 8-byte column tiles
          col = 8 * j + 2 * (lane % 4)
          pair = int(codes[c, row, col]) | int(codes[c, row, col + 1]) << 8
          s = int(scales[(64 * c + 16 * j) // fmt.block_size, row])
          if fold:  # bf16 2^(s - R + 126) in both halves
            bits = int(np.asarray(kernel.fold_scale_bf16(np.int32(s), g)).view(np.uint16))
            scale = [bits | bits << 16]
          elif fmt is MXFP4:  # bf16 2^(s - 127) in both halves
            scale = [s << 7 | s << 23]
          else:  # float32 E4M3(s) x g, one a half
            scale = [ptx_emu.f32_bits(np.asarray(kernel.e4m3_f32(jnp.uint8(s)))[()] * g)] * 2
          asm = mosaic.FOLDED_NIBBLES_ASM if fold else mosaic.E2M1_NIBBLES_ASM[t.kernel_fmt]
          lo, hi = ptx_emu.run(asm, 2, [pair, *scale])
          for tile, word in ((2 * j, lo), (2 * j + 1, hi)):
            kk = 64 * c + 8 * tile + 2 * (lane % 4)
            got[row, kk], got[row, kk + 1] = word & 0xFFFF, word >> 16
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("decode,m,order", [
    ("asm", 3, "pairs"), ("jnp", 3, "pairs"), ("asm", 40, "pairs"), ("asm", 256, "pairs"),
    ("asm", 300, "pairs"), ("asm", 3, "halves"), ("asm", 40, "halves"), ("asm", 256, "halves")])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernels_lower_for_cuda(fmt, decode, m, order):
  """The whole Mosaic lowering (layout inference, wgmma's operand checks) for a CUDA target,
  from CPU: one token group, several (40 -> 64 tokens), the most (256) and calls in sequence;
  weights in either nibble order (the "halves" one with x's tile read transposed)."""
  w = jax.eval_shape(lambda: layout.tile(kmajor_weight(0, 512, 128, fmt), order))
  x = jax.ShapeDtypeStruct((m, 512), jnp.bfloat16)
  for out_rows in (False, True):  # y^T's partials, or y's (stored transposed)
    f = jax.jit(lambda x, w: mosaic.fp4_matmul(x, w, decode=decode, out_rows=out_rows))
    assert jax.export.export(f, platforms=["cuda"])(x, w).out_avals[0].shape == (m, 128)
  if fmt is MXFP4 and decode == "asm":  # the scales folded (one multiply a decoded pair)
    f = jax.jit(lambda x, w: mosaic.fp4_matmul(x, w, fold=True))
    assert jax.export.export(f, platforms=["cuda"])(x, w).out_avals[0].shape == (m, 128)
  if order == "halves" and m <= 40:  # a longer K step: x's tile [tokens, 512]
    g = jax.jit(lambda x, w: mosaic.fp4_matmul(x, w, block_k2=256))
    assert jax.export.export(g, platforms=["cuda"])(x, w).out_avals[0].shape == (m, 128)
  if decode == "jnp" or m != 3 or order != "pairs":
    return
  if fmt is MXFP4:
    g = jax.jit(lambda x, w: mosaic.bf16_matmul(x, w, block_k=128))
    wt = jax.ShapeDtypeStruct((128, 512), jnp.bfloat16)
    assert jax.export.export(g, platforms=["cuda"])(x, wt).mlir_module()


@pytest.mark.gpu
@pytest.mark.parametrize("decode,order", [("asm", "pairs"), ("jnp", "pairs"), ("asm", "halves")])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,k,n,block_k2", [(1, 4096, 1024, 256), (16, 2048, 768, 128),
                                            (40, 768, 2048, 64), (64, 2048, 768, None),
                                            (256, 2048, 512, None), (300, 768, 256, None)])
def test_fp4_kernel_on_gpu(fmt, m, k, n, block_k2, decode, order):
  """Compiled: the same bf16 weight values as the reference (XLA's dequantization), float32
  sums in another order; one to eight token groups, and calls in sequence past 256 tokens;
  weights in either nibble order."""
  w = kmajor_weight(m + k, k, n, fmt)
  x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
  want = np.asarray(reference.fp4_matmul(x, w), np.float32)
  for out_rows in (False, True):  # y^T's partials, or y's (stored transposed)
    got = np.asarray(mosaic.fp4_matmul(x, layout.tile(w, order), block_k2=block_k2,
                                       decode=decode, out_rows=out_rows), np.float32)
    assert not np.isnan(got).any()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    assert np.mean(got != want) < 0.05
    if fmt is MXFP4 and decode == "asm":  # scales folded: the same sums times powers of two
      folded = mosaic.fp4_matmul(x, layout.tile(w, order), block_k2=block_k2, out_rows=out_rows,
                                 fold=True)
      np.testing.assert_array_equal(np.asarray(folded, np.float32), got)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_bf16_kernel_on_gpu(m):
  k, n = 1024, 512
  x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(m + 1), (k, n), jnp.bfloat16)
  got = np.asarray(mosaic.bf16_matmul(x, w.T), np.float32)
  want = np.asarray(reference.bf16_matmul(x, w), np.float32)
  assert not np.isnan(got).any()
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_fold_reference_is_the_largest_finite_scale_less_one_from_127():
  """`layout.fold_reference`: 2^(R - 127), R = max(127, the largest scale byte but NaN's 255,
  less one), per tensor or per expert; tile puts it in an MXFP4 weight's global_scale."""
  s = jnp.array([[[100, 126], [127, 128]], [[131, 5], [255, 3]], [[255, 255], [0, 0]]],
                jnp.uint8)  # [E = 3, 2, 2]
  np.testing.assert_array_equal(layout.fold_reference(s, 1), [1.0, 8.0, 1.0])
  assert float(layout.fold_reference(s[1], 0)) == 8.0
  t = layout.tile(grouped_weight(0, 2, 64, 64, MXFP4))
  np.testing.assert_array_equal(t.global_scale, layout.fold_reference(t.scales, 1))


def grouped_weight(seed, e, k, n, fmt):
  """Per-expert weights [E, K, N], each expert quantized on its own (NVFP4: one global each)."""
  w = jax.random.normal(jax.random.PRNGKey(seed), (e, k, n))
  w = w * jnp.exp(jax.random.normal(jax.random.PRNGKey(seed + 1), (e, 1, n)))
  return jax.vmap(lambda we: quantize(we, fmt, axis=0))(w)


@pytest.mark.parametrize("order", layout.ORDERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_tile_of_experts_is_each_expert_tiled(fmt, order):
  """Per-expert weights: each expert tiled as a weight of its own (in either nibble order, the
  dense test checks the bytes of each), and back."""
  w = grouped_weight(0, 3, 256, 128, fmt)
  t = layout.tile(w, order)
  assert t.grouped and t.shape == (3, 256, 128) and t.order == order
  for i in range(3):
    one = layout.tile(jax.tree.map(lambda a, i=i: a[i], w), order)
    np.testing.assert_array_equal(t.codes[i], one.codes)
    np.testing.assert_array_equal(t.scales[i], one.scales)
    assert float(t.global_scale[i]) == float(one.global_scale)
  back = layout.untile(t)
  assert jax.tree.structure(back) == jax.tree.structure(w)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(w)):
    np.testing.assert_array_equal(a, b)


def test_tile_of_experts_sharing_one_nvfp4_global():
  """Experts quantized as one tensor (one NVFP4 global for all): the global repeated per expert,
  the same values."""
  w = quantize(jax.random.normal(jax.random.PRNGKey(9), (3, 128, 64)), NVFP4_TENSOR, axis=-2)
  assert w.global_scale.size == 1
  t = layout.tile(w)
  assert t.global_scale.shape == (3,) and (t.global_scale == w.global_scale.reshape(())).all()
  np.testing.assert_array_equal(reference.dequantize_bf16(t), reference.dequantize_bf16(w))


@pytest.mark.parametrize("order", layout.ORDERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_grouped_kernel_lowers_for_cuda(fmt, order):
  w = jax.eval_shape(lambda: layout.tile(grouped_weight(0, 4, 256, 128, fmt), order))
  x = jax.ShapeDtypeStruct((20, 256), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  # one split (y's rows by default, or bf16 y^T), two (float32 partials)
  kws = [{}, dict(block_k2=64, splits=2), dict(splits=1, out_rows=False)]
  if order == "halves":  # and two row tiles a block; 8-token tiles
    kws += [dict(row_tiles=2), dict(row_tiles=2, block_k2=64, splits=2),
            dict(row_tiles=2, splits=1, out_rows=False), dict(tile_m=8),
            dict(tile_m=8, out_rows=False), dict(tile_m=8, block_k2=64, splits=2)]
    w4 = jax.eval_shape(lambda: layout.tile(grouped_weight(0, 4, 256, 256, fmt), order))
    f = jax.jit(lambda x, w, s: mosaic.grouped_fp4_matmul(x, w, s, row_tiles=4))
    assert jax.export.export(f, platforms=["cuda"])(x, w4, sizes).out_avals[0].shape == (20, 256)
  if fmt is MXFP4:  # the scales folded, each expert against its own reference
    kws += [dict(fold=True), dict(fold=True, block_k2=64, splits=2)]
  for kw in kws:
    f = jax.jit(lambda x, w, s, kw=kw: mosaic.grouped_fp4_matmul(x, w, s, **kw))
    assert jax.export.export(f, platforms=["cuda"])(x, w, sizes).mlir_module()
  # two 16-token tiles: x's rows ("halves"), or its even and odd K columns transposed ("pairs")
  xs = ((jax.ShapeDtypeStruct((32, 256), jnp.bfloat16),) if order == "halves"
        else (jax.ShapeDtypeStruct((128, 32), jnp.bfloat16),) * 2)
  table = jax.ShapeDtypeStruct((3,), jnp.int32)
  for splits, dtype in ((1, jnp.bfloat16), (2, jnp.float32)):
    part = jax.jit(functools.partial(mosaic.grouped_fp4_wgmma_partials, fmt=w.kernel_fmt,
                                     block_k2=64, splits=splits, order=order, out_dtype=dtype))
    out = jax.export.export(part, platforms=["cuda"])(xs, w.codes, w.scales, w.global_scale,
                                                      table).out_avals[0]
    assert (out.shape, out.dtype) == ((splits, 128, 32), dtype)
  rows = jax.jit(functools.partial(mosaic.grouped_fp4_wgmma_partials, fmt=w.kernel_fmt,
                                   block_k2=64, order=order, out_dtype=jnp.bfloat16,
                                   out_rows=True))
  out = jax.export.export(rows, platforms=["cuda"])(xs, w.codes, w.scales, w.global_scale,
                                                    table).out_avals[0]
  assert (out.shape, out.dtype) == ((1, 32, 128), jnp.bfloat16)  # y's rows
  with pytest.raises(ValueError, match="out_rows writes y in bf16"):
    mosaic.grouped_fp4_wgmma_partials(xs, w.codes, w.scales, w.global_scale, table,
                                      fmt=w.kernel_fmt, block_k2=64, order=order, out_rows=True)
  with pytest.raises(ValueError, match="out_dtype must be float32, or bfloat16 with one split"):
    mosaic.grouped_fp4_wgmma_partials(xs, w.codes, w.scales, w.global_scale, table,
                                      fmt=w.kernel_fmt, block_k2=64, splits=2, order=order,
                                      out_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="row_tiles must be 1, or 2 or 4 dividing the 64-row"):
    mosaic.grouped_fp4_matmul(jnp.zeros((20, 256)), w, jnp.zeros((4,), jnp.int32),
                              row_tiles=2 if order == "pairs" else 3)
  with pytest.raises(ValueError, match="tile_m must be 16, or 8 for a weight in the 'halves'"):
    mosaic.grouped_fp4_matmul(jnp.zeros((20, 256)), w, jnp.zeros((4,), jnp.int32),
                              tile_m=8 if order == "pairs" else 32)
  with pytest.raises(ValueError, match="group_sizes"):
    mosaic.grouped_fp4_matmul(jnp.zeros((20, 256)), w, jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="per-expert"):
    mosaic.grouped_fp4_matmul(jnp.zeros((20, 256)), layout.tile(kmajor_weight(0, 256, 128, fmt)),
                              jnp.zeros((4,), jnp.int32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dispatch_takes_tiled_weights(fmt):
  """`fp4_matmul` / `grouped_fp4_matmul` with a tiled weight: "xla" is the reference on the
  packed weight; "pallas" in interpret mode (no Mosaic interpreter) runs the Triton kernel on
  the packed weight taken back; gradients are the reference's."""
  w = reference.transpose(kmajor_weight(3, 256, 128, fmt))
  t = layout.tile(w)
  x = jax.random.normal(jax.random.PRNGKey(4), (5, 256), jnp.bfloat16)
  np.testing.assert_array_equal(api.fp4_matmul(x, t), reference.fp4_matmul(x, w))
  kw = dict(implementation="pallas", interpret=True)
  np.testing.assert_array_equal(api.fp4_matmul(x, t, **kw), api.fp4_matmul(x, w, **kw))
  loss = lambda x, w: api.fp4_matmul(x, w, **kw).astype(jnp.float32).sum()
  np.testing.assert_array_equal(jax.grad(loss)(x, t), jax.grad(loss)(x, w))
  gw = grouped_weight(5, 3, 256, 128, fmt)
  sizes = jnp.asarray([2, 0, 3], jnp.int32)
  np.testing.assert_array_equal(
      api.grouped_fp4_matmul(x, layout.tile(gw), sizes, **kw),
      api.grouped_fp4_matmul(x, gw, sizes, **kw))
  np.testing.assert_array_equal(api.grouped_fp4_matmul(x, layout.tile(gw), sizes),
                                reference.grouped_fp4_matmul(x, gw, sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("order", layout.ORDERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("sizes,k,n", [((5, 0, 17, 1), 2048, 768), ((40, 3, 0, 9), 768, 2048)])
def test_grouped_kernel_on_gpu(fmt, sizes, k, n, order):
  """Ragged and empty groups, rows past the groups (zeros), against XLA's dequantize-ragged_dot;
  with the default splits (4 and 1 at these sizes) and one split (y's rows, or y^T, written in
  bf16), and ("halves") two and four row tiles a block, and 16-token tiles (8 its default)."""
  e = len(sizes)
  w = grouped_weight(k + n, e, k, n, fmt)
  t = sum(sizes) + 3
  x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  want = np.asarray(reference.grouped_fp4_matmul(x, w, gs), np.float32)
  kws = [dict(splits=None), dict(splits=1), dict(splits=1, out_rows=False)]  # rows, then y^T
  if order == "halves":  # two and four row tiles a block
    kws += [dict(splits=None, row_tiles=2), dict(splits=1, row_tiles=2), dict(row_tiles=4),
            dict(splits=1, row_tiles=2, out_rows=False), dict(splits=None, tile_m=16),
            dict(splits=1, tile_m=16), dict(splits=1, tile_m=16, out_rows=False)]
  for kw in kws:
    got = np.asarray(mosaic.grouped_fp4_matmul(x, layout.tile(w, order), gs, **kw), np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[sum(sizes):], 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
    assert np.mean(got != want) < 0.05
    if fmt is MXFP4:  # scales folded: the same sums times powers of two
      folded = mosaic.grouped_fp4_matmul(x, layout.tile(w, order), gs, fold=True, **kw)
      np.testing.assert_array_equal(np.asarray(folded, np.float32), got)
  rows = routed_rows(e, 16, 2, e, True)  # a MoE dispatch's rows, composed with the tiling
  want = np.asarray(reference.grouped_fp4_matmul(x[:16], w, rows.group_sizes, rows.src,
                                                 rows.back), np.float32)
  for out_rows, tile_m in ((False, 16), (True, 16)) + (((True, 8),) if order == "halves" else ()):
    got = np.asarray(mosaic.grouped_fp4_matmul(x[:16], layout.tile(w, order), rows.group_sizes,
                                               rows_in=rows.src, rows_out=rows.back, splits=1,
                                               out_rows=out_rows, tile_m=tile_m), np.float32)
    assert got.shape == (32, n) and np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_jax_grouped_baseline_lowers_for_cuda():
  """The bench's tiles of JAX's Mosaic GPU grouped bf16 kernel lower at a decode shape."""
  from pallas_kernels.fp4_matmul import bench, mosaic_grouped_baseline
  e, k, n, t = bench.EXPERTS, 2048, 768, bench.TOP_K
  x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
  for cfg in bench.MOSAIC_GROUPED_BF16:
    w = jax.ShapeDtypeStruct((e, n, k) if cfg.get("transpose_rhs") else (e, k, n), jnp.bfloat16)
    f = jax.jit(lambda x, w, s, cfg=cfg:
                mosaic_grouped_baseline.grouped_bf16_matmul(x, w, s, **cfg))
    assert jax.export.export(f, platforms=["cuda"])(x, w, sizes).out_avals[0].shape == (t, n)


def _emulated_partials(w_dense, grouped: bool, order: str):
  """What the wgmma kernels compute, in jnp, for a weight known as its dequantized bf16 values
  w_dense ([K, N] or [E, K, N]) tiled in `order`: y^T from x's even and odd K columns
  transposed ("pairs") or from x ("halves"), as `splits` partials (in the `out_dtype` asked
  for); the columns of unused token tiles NaN (poison: the wrappers must not read them)."""
  w32 = jnp.asarray(w_dense, jnp.float32)

  def partials(xs, codes, scales, global_scale, *table, splits, tile_m=16, **kw):
    assert kw["order"] == order and len(xs) == (2 if order == "pairs" else 1)
    if order == "pairs":
      k2, r = xs[0].shape
      xt = jnp.stack(xs, axis=1).reshape(2 * k2, r).astype(jnp.float32)
    else:
      xt, r = xs[0].T.astype(jnp.float32), xs[0].shape[0]
    if not grouped:
      y_t = w32.T @ xt
    else:
      tile_expert, = table
      tile = jnp.arange(r) // tile_m
      y_t = jnp.einsum("rkn,kr->nr", w32[tile_expert[tile]], xt)
      y_t = jnp.where(tile < tile_expert[-1], y_t, jnp.nan)
    if kw.get("out_rows"):  # y's rows
      y_t = y_t.T
    out = jnp.broadcast_to(y_t / splits, (splits, *y_t.shape))  # exact: splits a power of 2
    return out.astype(kw.get("out_dtype", jnp.float32))

  return partials


@pytest.mark.parametrize("order", layout.ORDERS)
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_wrappers_around_the_kernels_move_rows_right(fmt, order, monkeypatch):
  """`mosaic.fp4_matmul` and `mosaic.grouped_fp4_matmul` around an emulation of their kernels
  (Mosaic has no interpret mode): tokens padded, transposed and split into even and odd K
  columns (or, for weights in the "halves" order, passed as they are), calls of 256 tokens,
  rows padded to tiles and gathered back, partials summed, as the reference computes (up to
  float32 sum order)."""
  from trace_jax.quant import dequantize

  def check(got, want, valid=None):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert not np.isnan(got).any()
    if valid is not None:  # rows past the groups
      np.testing.assert_array_equal(got[valid:], 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
    assert np.mean(got != want) < 0.05

  w = reference.transpose(kmajor_weight(7, 256, 128, fmt))  # [K, N]
  monkeypatch.setattr(mosaic, "fp4_wgmma_partials",
                      _emulated_partials(dequantize(w).astype(jnp.bfloat16), False, order))
  for m in (5, 40, 300):  # one token group, the wide path's M, calls of 256
    x = jax.random.normal(jax.random.PRNGKey(m), (m, 256), jnp.bfloat16)
    for out_rows in (False, True):
      check(mosaic.fp4_matmul(x, layout.tile(w, order), splits=2, out_rows=out_rows),
            reference.fp4_matmul(x, w))
  gw = grouped_weight(8, 4, 256, 128, fmt)
  monkeypatch.setattr(mosaic, "grouped_fp4_wgmma_partials",
                      _emulated_partials(dequantize(gw).astype(jnp.bfloat16), True, order))
  sizes = (5, 0, 17, 1)
  x = jax.random.normal(jax.random.PRNGKey(9), (sum(sizes) + 3, 256), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  # float32 partials summed; one split's y^T in bf16 from the kernel, or y's rows
  for splits, out_rows in ((2, False), (1, False), (1, True)):
    for row_tiles, tile_m in ((1, 16), (2, 16), (1, 8)) if order == "halves" else ((1, 16),):
      check(mosaic.grouped_fp4_matmul(x, layout.tile(gw, order), gs, splits=splits,
                                      row_tiles=row_tiles, out_rows=out_rows, tile_m=tile_m),
            reference.grouped_fp4_matmul(x, gw, gs), sum(sizes))
  # a MoE dispatch's rows: x one row per token (or per slot), its rows gathered into the tiles
  # and the output back in slot order, composed with the wrapper's own gathers
  for per_token, out_rows in ((True, False), (False, False), (True, True), (False, True)):
    rows = routed_rows(3, 10, 2, 4, per_token)
    xr = x[:10] if per_token else x[:20]
    for tile_m in (16, 8) if order == "halves" else (16,):
      want = reference.grouped_fp4_matmul(xr, gw, rows.group_sizes, rows.src, rows.back)
      for slots in (None, rows.slots):  # placed from the sorted rows, or per slot (no sort)
        check(mosaic.grouped_fp4_matmul(xr, layout.tile(gw, order), rows.group_sizes, splits=1,
                                        rows_in=rows.src, rows_out=rows.back,
                                        out_rows=out_rows, tile_m=tile_m, slots=slots), want)


@pytest.mark.parametrize("order,tile_m", [("halves", 8), ("pairs", 16)])
def test_grouped_wrapper_tiles_halves_weights_by_8_tokens(order, tile_m, monkeypatch):
  """By default the grouped wrapper pads each expert's rows to 8-token tiles for "halves"
  weights (the engine's order; measured faster at decode) and 16 for "pairs" (the only size
  that order's kernel takes), and the result is the reference's either way."""
  from trace_jax.quant import dequantize
  gw = grouped_weight(8, 4, 256, 128, MXFP4)
  emulated = _emulated_partials(dequantize(gw).astype(jnp.bfloat16), True, order)
  seen = []

  def partials(*args, tile_m, **kw):
    seen.append((tile_m, args[0][0].shape))
    return emulated(*args, tile_m=tile_m, **kw)

  monkeypatch.setattr(mosaic, "grouped_fp4_wgmma_partials", partials)
  sizes = (5, 0, 17, 1)
  x = jax.random.normal(jax.random.PRNGKey(9), (sum(sizes), 256), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  got = np.float32(mosaic.grouped_fp4_matmul(x, layout.tile(gw, order), gs))
  want = np.float32(reference.grouped_fp4_matmul(x, gw, gs))
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
  padded = seen[0][1][0] if order == "halves" else seen[0][1][1]  # x's rows in tiles
  assert seen[0][0] == tile_m and padded == (-(-sum(sizes) // tile_m) + len(sizes)) * tile_m


def test_grouped_bf16_kernel_lowers_for_cuda_and_names_what_is_wrong():
  """The project's Mosaic grouped bf16 kernel (x and the weight read transposed from shared
  memory) lowers for CUDA at a test size and the qwen3 decode shapes."""
  for t, k, n in ((20, 256, 128), (512, 2048, 768), (512, 768, 2048)):
    x = jax.ShapeDtypeStruct((t, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, k, n), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    f = jax.jit(mosaic.grouped_bf16_matmul)
    assert jax.export.export(f, platforms=["cuda"])(x, w, sizes).out_avals[0].shape == (t, n)
  with pytest.raises(ValueError, match="group_sizes"):
    mosaic.grouped_bf16_matmul(jnp.zeros((20, 256)), jnp.zeros((8, 256, 128)),
                               jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="N a multiple of 64"):
    mosaic.grouped_bf16_wgmma_partials(jnp.zeros((16, 256)), jnp.zeros((8, 256, 96)),
                                       jnp.zeros((2,), jnp.int32))


def test_grouped_bf16_wrapper_moves_rows_right(monkeypatch):
  """`mosaic.grouped_bf16_matmul` around an emulation of its kernel: rows padded to 16-token
  tiles and gathered back, as `jax.lax.ragged_dot` computes (float32 sums in another order)."""
  e, k, n = 4, 256, 128
  w = jax.random.normal(jax.random.PRNGKey(1), (e, k, n), jnp.bfloat16)

  def partials(x, w, tile_expert, *, splits, **kw):
    tile = jnp.arange(x.shape[0]) // 16
    y_t = jnp.einsum("rkn,rk->nr", w[tile_expert[tile]].astype(jnp.float32),
                     x.astype(jnp.float32))
    y_t = jnp.where(tile < tile_expert[-1], y_t, jnp.nan)  # unused tiles: never read
    asked.append(kw["out_dtype"])
    return jnp.broadcast_to(y_t / splits, (splits, *y_t.shape)).astype(kw["out_dtype"])

  asked = []

  monkeypatch.setattr(mosaic, "grouped_bf16_wgmma_partials", partials)
  sizes = (5, 0, 17, 1)
  x = jax.random.normal(jax.random.PRNGKey(2), (sum(sizes) + 3, k), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  want = np.asarray(reference.grouped_bf16_matmul(x, w, gs), np.float32)
  for splits in (2, 1):
    got = np.asarray(mosaic.grouped_bf16_matmul(x, w, gs, splits=splits), np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[sum(sizes):], 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
  assert asked == [jnp.float32, jnp.bfloat16]  # one split: y^T written in bf16 by the kernel
  rows = routed_rows(3, 10, 2, 4, True)  # a MoE dispatch's rows, composed with the tiling
  want = np.asarray(reference.grouped_bf16_matmul(x[:10], w, rows.group_sizes, rows.src,
                                                  rows.back), np.float32)
  for slots in (None, rows.slots):  # placed from the sorted rows, or per slot (no sort)
    got = np.asarray(mosaic.grouped_bf16_matmul(x[:10], w, rows.group_sizes, rows_in=rows.src,
                                                rows_out=rows.back, slots=slots), np.float32)
    assert got.shape == (20, n) and np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("sizes,k,n", [((5, 0, 17, 1), 2048, 768), ((40, 3, 0, 9), 768, 2048)])
def test_grouped_bf16_kernel_on_gpu(sizes, k, n):
  """Compiled: ragged and empty groups, rows past the groups (zeros), against XLA's ragged_dot;
  with the default splits (4 and 2 at these sizes) and one split (y^T written in bf16)."""
  e = len(sizes)
  w = jax.random.normal(jax.random.PRNGKey(k), (e, k, n), jnp.bfloat16)
  t = sum(sizes) + 3
  x = jax.random.normal(jax.random.PRNGKey(t), (t, k), jnp.bfloat16)
  gs = jnp.asarray(sizes, jnp.int32)
  want = np.asarray(reference.grouped_bf16_matmul(x, w, gs), np.float32)
  for splits in (None, 1):
    got = np.asarray(mosaic.grouped_bf16_matmul(x, w, gs, splits=splits), np.float32)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[sum(sizes):], 0)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
  rows = routed_rows(e, 16, 2, e, True)  # a MoE dispatch's rows, composed with the tiling
  want = np.asarray(reference.grouped_bf16_matmul(x[:16], w, rows.group_sizes, rows.src,
                                                  rows.back), np.float32)
  got = np.asarray(mosaic.grouped_bf16_matmul(x[:16], w, rows.group_sizes, rows_in=rows.src,
                                              rows_out=rows.back), np.float32)
  assert got.shape == (32, n) and np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3


def test_grouped_bench_skips_torch_by_name(monkeypatch):
  """`bench --grouped --skip=torch` leaves torch's grouped_mm out like any other variant."""
  from pallas_kernels.fp4_matmul import bench

  def torch_grouped(*_):
    raise AssertionError("torch's row was timed though --skip named it")

  monkeypatch.setattr(bench, "torch_grouped", torch_grouped)
  monkeypatch.setattr(bench, "copy_bandwidth", lambda *_: 1.0)
  monkeypatch.setattr(bench, "weight_copies", lambda *_: 2)
  monkeypatch.setattr(bench, "EXPERTS", 4)
  monkeypatch.setattr(bench, "TOP_K", 2)
  monkeypatch.setattr(bench, "GROUPED_SHAPES", {"down 64x128": (64, 128)})
  result = bench.run_grouped(batches=[2], formats=["mxfp4"], engine=True,
                             skip=("torch", "pallas", "mosaic"))
  assert [r["variant"] for r in result["rows"]] == ["xla bf16 ragged_dot",
                                                    "xla mxfp4 dequant+ragged_dot"]


def test_bench_table_names_every_config_key():
  """The bench's printed table tells apart rows that differ only in a config key (tile_m,
  row_tiles, out_rows as well as the block shapes)."""
  from pallas_kernels.fp4_matmul import bench
  base = {"shape": "down 768x2048", "M": 64, "variant": "mosaic mxfp4 halves", "us": 50.0,
          "wall_us": 90.0, "GB/s": 1.0, "copy_frac": 0.5, "rel_err": 0.0, "kernels_us": {},
          "T": 512, "experts_hit": 124, "splits": 1}
  cfgs = [{}, {"tile_m": 8}, {"row_tiles": 2}, {"out_rows": False}, {"block_k2": 64}]
  result = {"device": "test", "jax": "0", "copy_bytes_per_s": 1e12,
            "rows": [dict(base, **c) for c in cfgs]}
  lines = bench.table(result).splitlines()[2:]  # the same numbers: only labels can differ
  assert len(set(lines)) == len(cfgs), lines
  assert "tile_m=8" in lines[1] and "row_tiles=2" in lines[2] and "out_rows=False" in lines[3]
