"""FP4 matmul kernel against its reference: interpret mode on CPU, compiled on a GPU (-m gpu)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp4_matmul import (bf16_matmul, fp4_matmul, grouped_bf16_matmul,
                                       grouped_fp4_matmul)
from pallas_kernels.fp4_matmul import reference
from pallas_kernels.fp4_matmul.kernel import E2M1_ASM, E2M1_NV_ASM, block_scale, decode_nibbles
from tests.pallas_kernels import ptx_emu
from tests.pallas_kernels.routes import routed_rows
from trace_jax.models import layers as L
from trace_jax.quant import MXFP4, NVFP4, NVFP4_TENSOR, dequantize, quantize
from trace_jax.quant.codecs import E2M1

FORMATS = [MXFP4, NVFP4_TENSOR]


def inputs(seed, m, k, n, fmt):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (k, n)) * jnp.exp(jax.random.normal(kw, (1, n)))  # column scales
  return x, quantize(w, fmt, axis=0)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def assert_close(got, want):
  """A kernel against the reference: the same bf16 weight values and float32 sums in another
  order, so a bf16 output rounding apart here and there, nothing more (a weight decoded
  differently, such as NVFP4's global multiplied after the dot, moves ~40% of the outputs)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert not np.isnan(got).any()
  assert rel(got, want) < 2e-3
  assert np.mean(got != want) < 0.05


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reference_is_the_rollout_engines_xla_matmul(fmt):
  """Bit for bit the rollout engine's L.dense(x, dequantize(w)), from the [K, N] weight and from
  its K-major transpose."""
  x, w = inputs(0, 3, 256, 128, fmt)
  want = np.asarray(L.dense(x, dequantize(w)), np.float32)
  for wk in (w, reference.transpose(w)):
    np.testing.assert_array_equal(np.asarray(reference.fp4_matmul(x, wk), np.float32), want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,k,n,splits,rows", [(1, 256, 128, 1, 16), (5, 512, 256, 4, 32),
                                               (33, 96, 128, 1, 16), (2, 256, 128, 2, 64)])
def test_kernel_in_interpret_mode(fmt, m, k, n, splits, rows):
  x, w = inputs(m * k, m, k, n, fmt)
  got = fp4_matmul(x, w, implementation="pallas", splits=splits, rows=rows, interpret=True,
                   poison=True)
  assert_close(got, fp4_matmul(x, w))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 3, 8])
def test_gemv_and_dot_variants_in_interpret_mode(fmt, m):
  x, w = inputs(m, m, 256, 128, fmt)
  want = fp4_matmul(x, w)
  for variant in ("gemv", "dot"):
    got = fp4_matmul(x, w, implementation="pallas", variant=variant, splits=2, rows=32,
                     interpret=True, poison=True)
    assert_close(got, want)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,splits,rows", [(1, 2, 16), (5, 1, 32), (17, 2, 64)])
def test_kmajor_kernel_in_interpret_mode(fmt, m, splits, rows):
  x, w = inputs(m + 100, m, 256, 128, fmt)
  wt = reference.transpose(w)
  assert wt.shape == (128, 256) and wt.axis == -1
  np.testing.assert_array_equal(np.asarray(fp4_matmul(x, wt), np.float32),
                                np.asarray(fp4_matmul(x, w), np.float32))
  got = fp4_matmul(x, wt, implementation="pallas", splits=splits, rows=rows, interpret=True,
                   poison=True)
  assert_close(got, fp4_matmul(x, w))


def grouped_inputs(seed, t, k, n, sizes, fmt, per_expert=True):
  """x, expert weights quantized per expert as the weight sync packs them (NVFP4: a global per
  expert, [E, 1, 1]) or as one stack (one global), and the group sizes."""
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (t, k), jnp.bfloat16)
  w = jax.random.normal(kw, (len(sizes), k, n)) * jnp.exp(jax.random.normal(kw, (len(sizes), 1, n)))
  w = w * jnp.exp2(jnp.arange(len(sizes)))[:, None, None]  # experts of different ranges
  q = jax.vmap(lambda m: quantize(m, fmt, axis=0))(w) if per_expert else quantize(w, fmt, axis=-2)
  return x, q, jnp.asarray(sizes, jnp.int32)


@pytest.mark.parametrize("fmt,per_expert", [(MXFP4, True), (NVFP4_TENSOR, True),
                                            (NVFP4_TENSOR, False)],  # MXFP4 has no global
                         ids=["mxfp4", "nvfp4-per-expert", "nvfp4-one-global"])
def test_grouped_reference_is_one_matmul_per_expert(fmt, per_expert):
  """And bit for bit the rollout engine's L.grouped(x, dequantize(w), group_sizes)."""
  x, w, sizes = grouped_inputs(0, 30, 256, 128, [5, 0, 17, 3], fmt, per_expert)
  got = np.asarray(grouped_fp4_matmul(x, w, sizes), np.float32)
  np.testing.assert_array_equal(got, np.asarray(L.grouped(x, dequantize(w), sizes), np.float32))
  start = 0
  for e, size in enumerate([5, 0, 17, 3]):
    g = w.global_scale
    we = type(w)(w.codes[e], w.scales[e], g if g is None else g.reshape(-1)[e % g.size]
                 .reshape(1, 1), w.fmt, -2)
    np.testing.assert_array_equal(got[start:start + size],
                                  np.asarray(fp4_matmul(x[start:start + size], we), np.float32))
    start += size
  assert not got[start:].any()  # rows past the groups


@pytest.mark.parametrize("fmt,sizes,t,per_expert", [
    (MXFP4, [5, 0, 17, 3], 27, True), (NVFP4_TENSOR, [5, 0, 17, 3], 27, True),
    (MXFP4, [0, 0, 1], 1, True), (NVFP4_TENSOR, [40], 40, False)],
    ids=["mxfp4-ragged", "nvfp4-ragged", "mxfp4-one-row", "nvfp4-one-group"])
def test_grouped_kernel_in_interpret_mode(fmt, sizes, t, per_expert):
  x, w, sizes = grouped_inputs(t, t, 256, 128, sizes, fmt, per_expert)
  got = grouped_fp4_matmul(x, w, sizes, implementation="pallas", splits=2, interpret=True,
                           poison=True)
  assert_close(got, grouped_fp4_matmul(x, w, sizes))
  assert not np.asarray(got, np.float32)[int(sizes.sum()):].any()  # rows past the groups


def test_grouped_bf16_kernel_in_interpret_mode():
  sizes = [5, 0, 17, 3]
  x = jax.random.normal(jax.random.PRNGKey(3), (27, 256), jnp.bfloat16)  # 2 rows past the groups
  w = jax.random.normal(jax.random.PRNGKey(4), (4, 256, 128), jnp.bfloat16)
  want = grouped_bf16_matmul(x, w, jnp.asarray(sizes))
  start = 0
  for e, size in enumerate(sizes):  # the reference: one matmul per expert
    np.testing.assert_array_equal(np.asarray(want[start:start + size], np.float32),
                                  np.asarray(bf16_matmul(x[start:start + size], w[e]), np.float32))
    start += size
  got = grouped_bf16_matmul(x, w, jnp.asarray(sizes), implementation="pallas", splits=2,
                            interpret=True, poison=True)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 2e-3
  assert not np.asarray(got, np.float32)[sum(sizes):].any()  # rows past the groups


@pytest.mark.parametrize("per_token", [True, False], ids=["tokens", "slots"])
def test_grouped_kernels_compose_the_dispatch_rows(per_token):
  """rows_in / rows_out (the MoE dispatch's gathers, composed with the kernel's own tiling) give
  what the model's `grouped_rows` gives: the reference bit for bit, the kernels (interpret
  mode) within their summation order, FP4 and bf16, one row per token or per slot."""
  rows = routed_rows(1, 6, 2, 4, per_token)
  r = 6 if per_token else 12
  x, w, _ = grouped_inputs(2, r, 256, 128, [3] * 4, MXFP4, True)
  args = (rows.group_sizes, rows.src, rows.back)
  want = L.grouped_rows(x, dequantize(w).astype(jnp.bfloat16), rows)
  ref = grouped_fp4_matmul(x, w, *args)
  assert ref.shape == (12, 128)
  np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(want, np.float32))
  got = grouped_fp4_matmul(x, w, *args, implementation="pallas", splits=2, interpret=True,
                           poison=True)
  assert_close(got, ref)
  # the same rows per slot (placed with no sort): the same tiles, the same numbers
  np.testing.assert_array_equal(
      np.asarray(grouped_fp4_matmul(x, w, *args, rows.slots, implementation="pallas", splits=2,
                                    interpret=True, poison=True), np.float32),
      np.asarray(got, np.float32))
  # sorted rows given explicitly: the same numbers as the composed call
  sorted_x = x[rows.src]
  assert_close(got, grouped_fp4_matmul(sorted_x, w, rows.group_sizes, implementation="pallas",
                                       splits=2, interpret=True)[rows.back])
  w16 = jax.random.normal(jax.random.PRNGKey(5), (4, 256, 128), jnp.bfloat16)
  want16 = grouped_bf16_matmul(x, w16, *args)
  np.testing.assert_array_equal(np.asarray(want16, np.float32), np.asarray(
      L.grouped_rows(x, w16, rows), np.float32))
  got16 = grouped_bf16_matmul(x, w16, *args, implementation="pallas", splits=2, interpret=True,
                              poison=True)
  assert rel(got16, want16) < 2e-3
  np.testing.assert_array_equal(np.asarray(grouped_bf16_matmul(
      x, w16, *args, rows.slots, implementation="pallas", splits=2, interpret=True,
      poison=True), np.float32), np.asarray(got16, np.float32))
  with pytest.raises(ValueError, match="rows_in as a vector of row indices"):
    grouped_fp4_matmul(x, w, rows.group_sizes, rows.src.astype(jnp.float32))


@pytest.mark.parametrize("block_m", [8, 16])
def test_group_tiles_places_each_group_at_its_tiles(block_m):
  """Each expert's rows start at a tile boundary, in order, after the previous expert's tiles;
  every other row of x2 is zero; the table lists each tile's expert and the tiles in use; dest
  says where each row went (out of range past the groups)."""
  from pallas_kernels.fp4_matmul.api import _group_tiles
  rng = np.random.default_rng(block_m)
  # the edges (one expert, one row, none used; every row used), then random cases (each shape
  # compiles once: a few suffice)
  cases = [(1, 1, 0), (6, 49, 49), (3, 2 * block_m, 2 * block_m - 1)]
  for _ in range(9):
    t = int(rng.integers(1, 50))
    cases.append((int(rng.integers(1, 7)), t, int(rng.integers(0, t + 1))))
  for e, t, used in cases:
    cuts = np.sort(rng.integers(0, used + 1, e - 1))
    sizes = np.diff(np.concatenate([[0], cuts, [used]])).astype(np.int32)
    x = rng.normal(size=(t, 3)).astype(np.float32)
    x2, table, dest = _group_tiles(jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes), block_m)
    want = np.zeros((-(-t // block_m) + e) * block_m, np.int64) - 1  # source row of each slot
    tile_experts, start, row = [], 0, 0
    for expert, size in enumerate(sizes):
      want[start * block_m:start * block_m + size] = np.arange(row, row + size)
      tiles = -(-size // block_m)
      tile_experts += [expert] * tiles
      start, row = start + tiles, row + size
    x_bf16 = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    np.testing.assert_array_equal(np.asarray(x2, np.float32),
                                  np.where(want[:, None] >= 0, x_bf16[np.maximum(want, 0)], 0))
    assert int(table[-1]) == start and list(np.asarray(table[:start])) == tile_experts
    slots = np.asarray(dest)
    assert (slots[used:] >= len(want)).all() and (want[slots[:used]] == np.arange(used)).all()


def test_tile_rows_is_loop_free():
  """The row placement runs inside every decode step, once a grouped matmul: it compiles to
  no loop (a searchsorted by scan is a while loop of log2(E) steps, and each step of a GPU
  while loop waits on the host for its condition)."""
  from pallas_kernels.fp4_matmul.tiling import tile_rows
  text = jax.jit(lambda s: tile_rows(s, 512, 16)).lower(
      jnp.zeros((128,), jnp.int32)).as_text()
  assert "while" not in text and "stablehlo.case" not in text


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(64, 8, 128, 8), (5, 2, 4, 16),
                                                         (33, 4, 16, 16), (1, 1, 4, 8)])
def test_tile_slots_is_tile_rows_of_the_dispatch(tokens, top_k, experts, block_m, per_token):
  """`tile_slots` (each slot's expert and input row, no sort) places the rows exactly where
  `tile_rows` places the dispatch's sorted rows."""
  from pallas_kernels.fp4_matmul.tiling import tile_rows, tile_slots
  keys = jax.random.split(jax.random.PRNGKey(tokens * top_k), tokens)
  idx = jax.vmap(lambda k: jax.random.permutation(k, experts)[:top_k])(keys)
  d = L.Dispatch(idx, experts)
  rows = d.of_tokens if per_token else d.of_slots
  s = tokens * top_k
  x_rows = tokens if per_token else s
  source = jnp.arange(s) // top_k if per_token else jnp.arange(s)
  want = tile_rows(rows.group_sizes, s, block_m, rows.src, rows.back, x_rows)
  got = tile_slots(idx.reshape(-1), source, rows.group_sizes, block_m, x_rows)
  for name, g, w in zip(("src", "tile_expert", "dest"), got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_a_decode_dispatch_through_the_kernels_compiles_without_its_sort():
  """The dispatch's rows handed to a grouped kernel per slot (`ExpertRows.slots`): its tiling
  needs no sort, and XLA drops the dispatch's argsort from the compiled program (the tokens'
  top-k is the program's input here); the output is that of the sorted rows'."""
  x, w, _ = grouped_inputs(0, 16, 256, 128, [8, 8, 8, 8], MXFP4)
  keys = jax.random.split(jax.random.PRNGKey(3), 16)
  idx = jax.vmap(lambda k: jax.random.permutation(k, 4)[:2])(keys)

  def experts(x, idx, per_slot):
    rows = L.Dispatch(idx, 4).of_tokens
    rows = rows if per_slot else rows._replace(slots=None)
    return grouped_fp4_matmul(x, w, rows.group_sizes, rows.src, rows.back, rows.slots,
                              implementation="pallas", interpret=True)

  sorts = [len(re.findall(r"\bsort\(", jax.jit(experts, static_argnums=2).lower(x, idx, s)
                          .compile().as_text())) for s in (True, False)]
  assert sorts[0] == 0 and sorts[1] > 0, sorts
  np.testing.assert_array_equal(np.asarray(experts(x, idx, True)),
                                np.asarray(experts(x, idx, False)))


def test_grouped_errors():
  x, w, sizes = grouped_inputs(0, 8, 256, 128, [4, 4], MXFP4)
  rows = jnp.arange(8)
  with pytest.raises(ValueError, match="two vectors of 8; got"):
    grouped_fp4_matmul(x, w, sizes, rows, rows, (rows[:4], rows[:4]), implementation="pallas",
                       interpret=True)
  with pytest.raises(ValueError, match=r"group_sizes \[2\]"):
    grouped_fp4_matmul(x, w, sizes[:1])
  with pytest.raises(ValueError, match="per-expert weights"):
    grouped_fp4_matmul(x, w.codes, sizes)
  w16 = jnp.ones((2, 256, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"group_sizes \[2\]"):
    grouped_bf16_matmul(x, w16, sizes[:1])
  with pytest.raises(ValueError, match="per-expert weights"):
    grouped_bf16_matmul(x, w16[0], sizes)
  with pytest.raises(ValueError, match="block_k"):
    grouped_bf16_matmul(x, w16, sizes, implementation="pallas", block_k=96, interpret=True)


def test_decode_asm_bit_for_bit():
  """The PTX decode, run by an emulator: every byte, random E8M0 and E4M3 scales, against the
  E2M1 table times the scale (signed zeros included)."""
  rng = np.random.default_rng(0)
  table = np.asarray(E2M1.decode(jnp.arange(16)), np.float32)
  for trial in range(400):
    b = (np.arange(4) * 64 + trial) % 256 if trial < 256 else rng.integers(0, 256, 4)
    if trial % 2:  # E8M0 powers of two, subnormal-producing ones included
      scale = np.ldexp(np.float32(1), rng.integers(-127, 100, 4)).astype(np.float32)
    else:  # E4M3 values (any bf16 with a few significant bits)
      scale = np.asarray(jnp.asarray(rng.standard_normal(4) * 50, jnp.float8_e4m3fn),
                         np.float32)
    sbits = [ptx_emu.f32_to_bf16_bits(s) for s in scale]
    q = int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24
    ins = [q, sbits[0] | sbits[1] << 16, sbits[2] | sbits[3] << 16]
    lo01, lo23 = ptx_emu.run(E2M1_ASM["lo"], 2, ins)
    hi01, hi23 = ptx_emu.run(E2M1_ASM["hi"], 2, ins)
    lo = [lo01 & 0xFFFF, lo01 >> 16, lo23 & 0xFFFF, lo23 >> 16]
    hi = [hi01 & 0xFFFF, hi01 >> 16, hi23 & 0xFFFF, hi23 >> 16]
    for i in range(4):
      for got, code in ((lo[i], b[i] & 15), (hi[i], b[i] >> 4)):
        want = np.float32(table[code] * scale[i])
        assert ptx_emu.bf16_bits_to_f32(got) == want, (b, i, code, scale[i])
        assert np.signbit(ptx_emu.bf16_bits_to_f32(got)) == np.signbit(want) or want != 0


def test_nvfp4_decode_asm_bit_for_bit():
  """The NVFP4 PTX decode, run by the emulator, against the rule bf16(E2M1 x (E4M3 x g)) in
  IEEE float32 (numpy): every byte under random E4M3 scale bytes (NaN and subnormals among
  them) and random globals (tiny ones give subnormal scales and products, huge ones overflow
  bf16). Away from subnormals the jnp decode and the quant core's rule give the same bits;
  below, XLA's CPU backend flushes float32 subnormals to zero where the asm (like XLA's GPU
  backend) keeps them: only globals below about 2^-116 (a max |x| below about 2^-105) get
  there."""
  rng = np.random.default_rng(1)
  n = 4096
  b = np.concatenate([np.arange(256)] * (n // 256)).astype(np.uint8)  # each byte 16 times
  s = rng.integers(0, 256, n).astype(np.uint8)
  g = np.exp2(rng.uniform(-126, 8, n)).astype(np.float32)
  g[:256] = np.exp2(rng.uniform(-126, -115, 256))
  g[256:512] = np.exp2(rng.uniform(114, 117, 256))
  s[256:384] = rng.integers(0x78, 0x7F, 128)  # E4M3 256..448: with the largest g, inf in bf16
  sg = s.view(jnp.float8_e4m3fn).astype(np.float32) * g  # IEEE float32, no flush
  table = np.asarray(E2M1.decode(jnp.arange(16)), np.float32)
  with np.errstate(all="ignore"):
    products = [table[c] * sg for c in (b & 15, b >> 4)]
  ieee = [p.astype(jnp.bfloat16).view(np.uint16) for p in products]
  got = [np.zeros(n, np.uint16), np.zeros(n, np.uint16)]
  for i in range(0, n, 4):
    ins = [int(b[i:i + 4].view(np.uint32)[0])] + [int(v) for v in sg[i:i + 4].view(np.uint32)]
    for nibble, out in zip(("lo", "hi"), got):
      pair01, pair23 = ptx_emu.run(E2M1_NV_ASM[nibble], 2, ins)
      out[i:i + 4] = [pair01 & 0xFFFF, pair01 >> 16, pair23 & 0xFFFF, pair23 >> 16]
  jnp_sg = block_scale(jnp.asarray(s), "nvfp4", jnp.asarray(g))
  bits = [np.asarray(v).view(np.uint16) for v in decode_nibbles(jnp.asarray(b), jnp_sg, "bits")]
  xla = [np.asarray(  # the quant core's rule on n blocks of one value
      NVFP4.from_grid(E2M1.decode(jnp.asarray(c))[:, None], jnp.asarray(s), jnp.asarray(g))
      [:, 0].astype(jnp.bfloat16)).view(np.uint16) for c in (b & 15, b >> 4)]
  tiny = np.finfo(np.float32).tiny
  for product, want, asm, jnp_bits, xla_bits in zip(products, ieee, got, bits, xla):
    nan = (want & 0x7FFF) > 0x7F80
    np.testing.assert_array_equal((asm & 0x7FFF) > 0x7F80, nan)
    np.testing.assert_array_equal(asm[~nan], want[~nan])
    normal = ~nan & (np.abs(sg) >= tiny) & ((product == 0) | (np.abs(product) >= tiny))
    np.testing.assert_array_equal(jnp_bits[normal], want[normal])
    np.testing.assert_array_equal(xla_bits[normal], want[normal])
    assert nan.any() and (~normal & ~nan).any() and ((want[~nan] & 0x7FFF) == 0x7F80).any()


def test_bf16_kernel_in_interpret_mode():
  x = jax.random.normal(jax.random.PRNGKey(1), (7, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(2), (256, 128), jnp.bfloat16)
  got = bf16_matmul(x, w, implementation="pallas", splits=2, interpret=True, poison=True)
  assert rel(got, bf16_matmul(x, w)) < 2e-3


@pytest.mark.parametrize("block_k,splits", [(64, 2), (32, 1)])
def test_bf16_kernels_in_triton_language_compute_what_the_pallas_ones_do(block_k, splits):
  """backend="jax_triton": the same programs in Triton's own language, run by Triton's
  interpreter here (outputs started as NaN: an element not written shows), dense and grouped
  (the rows past the groups zero), the dispatch's rows composed too: the Pallas kernels'
  numbers in interpret mode, bit for bit (the same exact products, each tile's float32 sums
  in the same order here)."""
  kw = dict(implementation="pallas", block_k=block_k, splits=splits)
  x = jax.random.normal(jax.random.PRNGKey(1), (7, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(2), (256, 128), jnp.bfloat16)
  got = bf16_matmul(x.reshape(7, 1, 256), w, backend="jax_triton", **kw)
  np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(7, 128), np.asarray(
      bf16_matmul(x, w, interpret=True, poison=True, **kw), np.float32))
  sizes = jnp.asarray([5, 0, 17, 3])
  x = jax.random.normal(jax.random.PRNGKey(3), (27, 256), jnp.bfloat16)  # 2 rows past the groups
  w = jax.random.normal(jax.random.PRNGKey(4), (4, 256, 128), jnp.bfloat16)
  got = np.asarray(grouped_bf16_matmul(x, w, sizes, backend="jax_triton", **kw), np.float32)
  np.testing.assert_array_equal(got, np.asarray(grouped_bf16_matmul(
      x, w, sizes, interpret=True, poison=True, **kw), np.float32))
  assert not got[25:].any() and rel(got, grouped_bf16_matmul(x, w, sizes)) < 2e-3
  rows = routed_rows(1, 6, 2, 4, False)
  x = jax.random.normal(jax.random.PRNGKey(5), (12, 256), jnp.bfloat16)
  args = (rows.group_sizes, rows.src, rows.back, rows.slots)
  np.testing.assert_array_equal(
      np.asarray(grouped_bf16_matmul(x, w, *args, backend="jax_triton", **kw), np.float32),
      np.asarray(grouped_bf16_matmul(x, w, *args, interpret=True, **kw), np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fp4_kernels_in_triton_language_compute_what_the_pallas_ones_do(fmt):
  """backend="jax_triton" on FP4 weights: the dot kernel's program in Triton's own language
  (`triton_kernel.fp4_matmul`, the FP4 matmuls off Hopper), in Triton's interpreter here: the
  Pallas kernel's interpret-mode numbers bit for bit, dense (x with leading dims, a split K)
  and grouped (NVFP4 with a global per expert; the rows past the groups zero; the dispatch's
  rows composed), the decode from the bits."""
  kw = dict(implementation="pallas", splits=2, rows=16)
  x, w = inputs(3, 7, 256, 128, fmt)
  got = fp4_matmul(x.reshape(7, 1, 256), w, backend="jax_triton", **kw)
  want = fp4_matmul(x, w, interpret=True, poison=True, **kw)
  np.testing.assert_array_equal(np.asarray(got, np.float32).reshape(7, 128),
                                np.asarray(want, np.float32))
  assert_close(got.reshape(7, 128), fp4_matmul(x, w))
  x, w, sizes = grouped_inputs(4, 27, 256, 128, [5, 0, 17, 3], fmt)  # 2 rows past the groups
  got = np.asarray(grouped_fp4_matmul(x, w, sizes, backend="jax_triton", **kw), np.float32)
  np.testing.assert_array_equal(got, np.asarray(grouped_fp4_matmul(
      x, w, sizes, interpret=True, poison=True, **kw), np.float32))
  assert not got[25:].any()
  rows = routed_rows(1, 6, 2, 4, False)
  x = jax.random.normal(jax.random.PRNGKey(5), (12, 256), jnp.bfloat16)
  args = (rows.group_sizes, rows.src, rows.back, rows.slots)
  np.testing.assert_array_equal(
      np.asarray(grouped_fp4_matmul(x, w, *args, backend="jax_triton", **kw), np.float32),
      np.asarray(grouped_fp4_matmul(x, w, *args, interpret=True, **kw), np.float32))
  x, w = inputs(0, 4, 256, 128, fmt)
  for w, variant in ((reference.transpose(w), None), (w, "gemv")):
    with pytest.raises(ValueError, match=r"dot kernel on the \[K, N\] weight"):
      fp4_matmul(x, w, implementation="pallas", backend="jax_triton", variant=variant)


def test_the_bf16_kernels_backend_names_what_is_wrong():
  x = jnp.ones((4, 64), jnp.bfloat16)
  w = jnp.ones((64, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="backend must be one of"):
    bf16_matmul(x, w, implementation="pallas", backend="mosaic")
  with pytest.raises(ValueError, match="no interpret or poison"):
    grouped_bf16_matmul(x, w[None], jnp.asarray([4]), implementation="pallas",
                        backend="jax_triton", poison=True)


def test_leading_dims_and_errors():
  x, w = inputs(0, 6, 256, 128, MXFP4)
  y = fp4_matmul(x.reshape(2, 3, 256), w)
  np.testing.assert_array_equal(np.asarray(y).reshape(6, 128), np.asarray(fp4_matmul(x, w)))
  with pytest.raises(ValueError, match="implementation must be one of"):
    fp4_matmul(x, w, implementation="cuda")
  with pytest.raises(ValueError, match="x has 255 features"):
    fp4_matmul(x[:, :255], w)
  with pytest.raises(ValueError, match="block_n"):
    fp4_matmul(x, w, implementation="pallas", block_n=96, interpret=True)
  with pytest.raises(ValueError, match="'gemv' for at most 8 rows"):
    fp4_matmul(x.repeat(2, 0), w, implementation="pallas", variant="gemv", interpret=True)
  with pytest.raises(ValueError, match="a K-major weight runs the dot kernel"):
    fp4_matmul(x, reference.transpose(w), implementation="pallas", variant="gemv",
               interpret=True)
  with pytest.raises(ValueError, match="not interpretable"):
    fp4_matmul(x, w, implementation="pallas", decode="asm", interpret=True)
  with pytest.raises(ValueError, match="MXFP4 and NVFP4"):
    fp4_matmul(x, quantize(jnp.ones((256, 128)), "fp8", axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,variant", [(1, "gemv"), (3, "gemv"), (8, "gemv"), (1, "dot"),
                                       (16, "dot"), (64, "dot"), (256, "dot")])
@pytest.mark.parametrize("k,n,decode", [(2048, 768, "asm"), (768, 2048, "asm"),
                                        (2048, 4096, "asm"), (2048, 768, "bits")])
def test_kernel_on_gpu(fmt, m, variant, k, n, decode):
  for seed in range(2):  # fresh inputs each time
    x, w = inputs(seed * 7919 + m, m, k, n, fmt)
    for rows in (16, 32, 64):
      outs = [fp4_matmul(x, w, implementation="pallas", rows=rows, decode=decode,
                         variant=variant, poison=True)]
      if variant == "dot":  # and the K-major weight through the kmajor kernel
        outs.append(fp4_matmul(x, reference.transpose(w), implementation="pallas", rows=rows,
                               decode=decode, poison=True))
      for got in outs:
        assert_close(got, fp4_matmul(x, w))
  w16 = w.codes.astype(jnp.bfloat16)[:k // 2].repeat(2, 0)  # (the bf16 twin, same inputs)
  got = bf16_matmul(x, w16, implementation="pallas", poison=True)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, bf16_matmul(x, w16)) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("sizes", [[1, 0, 7, 3, 2, 0, 0, 5], [64] * 4, [3, 200, 1, 60]])
def test_grouped_kernel_on_gpu(fmt, sizes):
  for seed in range(2):  # fresh inputs each time
    t = sum(sizes) + 3  # and rows past the groups
    x, w, group_sizes = grouped_inputs(seed * 31 + t, t, 2048, 768, sizes, fmt)
    for rows in (16, 32):
      got = grouped_fp4_matmul(x, w, group_sizes, implementation="pallas", rows=rows,
                               poison=True)  # the default decode on a GPU: "asm"
      assert_close(got, grouped_fp4_matmul(x, w, group_sizes))
      # the same program in Triton's own language (jax-triton), both decodes
      for decode in ("asm", "bits"):
        jt = grouped_fp4_matmul(x, w, group_sizes, implementation="pallas", rows=rows,
                                decode=decode, backend="jax_triton")
        assert not np.asarray(jt, np.float32)[sum(sizes):].any()
        assert_close(jt, grouped_fp4_matmul(x, w, group_sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("decode", ["asm", "bits"])
def test_fp4_kernel_in_triton_language_on_gpu(fmt, m, decode):
  for seed in range(2):  # fresh inputs each time
    x, w = inputs(seed * 7919 + m, m, 2048, 768, fmt)
    for rows in (16, 32):
      got = fp4_matmul(x, w, implementation="pallas", rows=rows, decode=decode,
                       backend="jax_triton")
      assert_close(got, fp4_matmul(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [[1, 0, 7, 3, 2, 0, 0, 5], [64] * 4, [3, 200, 1, 60]])
def test_grouped_bf16_kernel_on_gpu(sizes):
  for seed in range(2):  # fresh inputs each time
    t = sum(sizes) + 3  # and rows past the groups
    kx, kw = jax.random.split(jax.random.PRNGKey(seed * 31 + t))
    x = jax.random.normal(kx, (t, 2048), jnp.bfloat16)
    w = jax.random.normal(kw, (len(sizes), 2048, 768), jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    for block_k in (64, 128):
      got = grouped_bf16_matmul(x, w, group_sizes, implementation="pallas", block_k=block_k,
                                poison=True)
      assert not np.isnan(np.asarray(got, np.float32)).any()
      assert rel(got, grouped_bf16_matmul(x, w, group_sizes)) < 2e-3
      assert not np.asarray(got, np.float32)[sum(sizes):].any()
      # the same program in Triton's own language (jax-triton): the rows past the groups are
      # written zero there too, and the numbers within the order of float32 sums
      jt = grouped_bf16_matmul(x, w, group_sizes, implementation="pallas", block_k=block_k,
                               backend="jax_triton")
      assert not np.asarray(jt, np.float32)[sum(sizes):].any()
      assert rel(jt, got) < 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_bf16_kernel_in_triton_language_on_gpu(m):
  kx, kw = jax.random.split(jax.random.PRNGKey(m))
  x = jax.random.normal(kx, (m, 4096), jnp.bfloat16)
  w = jax.random.normal(kw, (4096, 2048), jnp.bfloat16)
  got = bf16_matmul(x, w, implementation="pallas", backend="jax_triton")
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, bf16_matmul(x, w)) < 2e-3
  assert rel(got, bf16_matmul(x, w, implementation="pallas")) < 2e-3
