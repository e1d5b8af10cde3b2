"""The W4A4 (FP8 tensor core) matmul: its layout, decode and folds exact on CPU, its Mosaic
lowering for CUDA from CPU, and its numerics on a Hopper GPU (-m gpu)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels.fp4_matmul import reference, w4a4
from pallas_kernels.fp4_matmul import w4a4_layout as L
from tests.pallas_kernels import ptx_emu
from tests.pallas_kernels.routes import routed_rows
from trace_jax.quant import MXFP4, NVFP4, dequantize, quantize

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
tile, e4m3_values, fold = jax.jit(L.tile), jax.jit(L.e4m3_values), jax.jit(L.activation_e4m3)


def weight(seed, k, n, experts=None):
  shape = (k, n) if experts is None else (experts, k, n)
  w = jax.random.normal(jax.random.PRNGKey(seed), shape)
  w = w * jnp.exp(2 * jax.random.normal(jax.random.PRNGKey(seed + 1), shape[:-2] + (1, n)))
  return jax.jit(quantize, static_argnames=("fmt", "axis"))(w, MXFP4, axis=-2)


def activation(seed, m, k, spread=3.0):
  """Heavy-tailed tokens with outlier channels: block scales several binades apart."""
  x = jax.random.normal(jax.random.PRNGKey(seed), (m, k))
  x = x * jnp.exp(spread * jax.random.normal(jax.random.PRNGKey(seed + 1), (1, k)))
  x = x * jnp.exp(jax.random.normal(jax.random.PRNGKey(seed + 2), (m, 1)))
  return jax.jit(quantize, static_argnames="fmt")(x, MXFP4)


def test_decode_asm_is_the_layouts_rule_for_every_bit_pattern():
  """The kernel's PTX (emulated) gives, for random words and every code in every position, the
  E4M3 bytes of E2M1 x 2^6 with the sign, as `e4m3_values` reads the words."""
  rng = np.random.default_rng(0)
  words = np.concatenate([rng.integers(0, 2**32, 3000, dtype=np.uint64),
                          [0, 0xFFFFFFFF, 0x88888888, 0x77777777]]).astype(np.uint32)
  lut = E2M1 * 64
  for w in words:
    r0, r1 = ptx_emu.run(L.DECODE_ASM, 2, [int(w)])
    got = np.frombuffer(np.array([r0, r1], np.uint32).tobytes(), ml_dtypes.float8_e4m3fn)
    got = got.astype(np.float64)
    w = int(w)
    want = [lut[(w >> 4 * i) & 7] * (-1 if w >> (8 * i + 7) & 1 else 1) for i in range(4)]
    want += [lut[(w >> (16 + 4 * i)) & 7] * (-1 if w >> (8 * i + 3) & 1 else 1) for i in range(4)]
    np.testing.assert_array_equal(got, want)
    assert all(np.signbit(g) == (v < 0 or (v == 0 and s)) for g, v, s in zip(
        got, want, [w >> (8 * i + 7) & 1 for i in range(4)] + [w >> (8 * i + 3) & 1
                                                               for i in range(4)]))


@pytest.mark.parametrize("experts", [None, 3])
def test_tile_holds_every_value_exactly(experts):
  """Each element's decoded E4M3 value, times its block's relative scale and its row's power
  of two, is its dequantized value, bit for bit; `untile` gives the packed weight back; every
  code byte lands in the word slot of the thread and register the kernel gives it."""
  k, n = 256, 128
  w = weight(0, k, n, experts)
  t = tile(w)
  lead = () if experts is None else (experts,)
  assert t.words.shape == (*lead, n // 64, k // 64, 512) and t.shape == (*lead, k, n)
  s = w.scales.astype(jnp.int32)
  per_elem = jnp.repeat(L.scale_multipliers(t), 32, axis=-2)
  rows = L.row_scale(t.row_exp, 127)[..., None, :]
  np.testing.assert_array_equal(e4m3_values(t) / 64 * per_elem * rows, dequantize(w))
  back = jax.jit(L.untile)(t)
  np.testing.assert_array_equal(back.codes, w.codes)
  np.testing.assert_array_equal(back.scales, s.astype(jnp.uint8))
  if experts is None:
    # row 37, K 100 and 101: chunk 1, block 1, columns 4 and 5 of it; warp 2, lane 5 x 4 + 1
    # (thread 85), row half 0: word slot 2 of thread 85, the low register's codes 0 and 1
    byte = int(np.asarray(w.codes)[50, 37])
    word = int(np.asarray(t.words)[0, 1, 4 * 85 + 2])
    for i, code in enumerate((byte & 15, byte >> 4)):
      assert (word >> 4 * i) & 7 == code & 7 and (word >> (8 * i + 7)) & 1 == code >> 3


def test_tile_refuses_what_it_cannot_hold():
  with pytest.raises(ValueError, match="MXFP4"):
    L.tile(quantize(jnp.ones((256, 128)), NVFP4, axis=0))
  with pytest.raises(ValueError, match="divisible by 64"):
    jax.eval_shape(L.tile, weight(0, 256, 96))
  with pytest.raises(ValueError, match="W4A4 layout"):
    w4a4.w4a4_matmul(activation(0, 2, 256), weight(0, 256, 128))
  with pytest.raises(ValueError, match="features"):
    w4a4.w4a4_matmul(activation(0, 2, 128), tile(weight(0, 256, 128)))


def test_activation_fold_is_exact_within_its_range():
  """Folded values times 2^(R_t - 133) are the dequantized activation, bit for bit, while the
  token's blocks lie within 2^14 of its largest; a block further below is counted."""
  xq = activation(1, 8, 512, spread=1.5)
  x8, r, misses = fold(xq)
  assert int(misses) == 0
  back = x8.astype(jnp.float32) * L.row_scale(r, 127 + L.ACT_SHIFT)[:, None]
  np.testing.assert_array_equal(back, dequantize(xq))
  s = np.asarray(xq.scales).copy()
  s[3, 5] = s[3].max() - 15  # one block 2^15 below its token's largest
  far = type(xq)(xq.codes, jnp.asarray(s), None, MXFP4, -1)
  if np.any(np.asarray(xq.codes)[3, 80:96] & 0x77):
    assert int(fold(far)[2]) == 1
  s[3, 5] = 255  # a NaN scale
  assert int(fold(type(xq)(xq.codes, jnp.asarray(s), None, MXFP4, -1))[2]) >= 1


def emulate(xq, t):
  """The kernel's arithmetic in jnp: one exact product a block, times the weight block's
  relative scale, summed in float32; the rows' and tokens' powers of two at the end."""
  x8, r_t, _ = fold(xq)
  k, n = t.shape
  a = x8.astype(jnp.float32).reshape(-1, k // 32, 32)
  wv = e4m3_values(t).reshape(k // 32, 32, n)
  parts = jnp.einsum("mbk,bkn->bmn", a, wv, precision="highest")  # exact: small integers
  total = jnp.sum(parts * L.scale_multipliers(t)[:, None, :], axis=0)
  y = total * L.row_scale(t.row_exp, 127)[None] * L.row_scale(r_t, 139)[:, None]
  return y.astype(jnp.bfloat16)


def test_kernel_arithmetic_is_the_reference_up_to_sum_order():
  xq, w = activation(2, 16, 1024), weight(3, 1024, 256)
  got = np.asarray(emulate(xq, tile(w)), np.float32)
  want = np.asarray(reference.fp4_matmul(dequantize(xq).astype(jnp.bfloat16), w), np.float32)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
  assert np.mean(got != want) < 0.02


def emulate_exact_path(xq, t):
  """The kernel's exact branch in jnp: the activation unfolded, each block's exact product
  times the weight block's and the token block's relative scales, summed in float32."""
  x8, mult = jax.jit(L.activation_unfolded)(xq)
  r_t = fold(xq)[1]
  k, n = t.shape
  a = x8.astype(jnp.float32).reshape(-1, k // 32, 32)
  wv = e4m3_values(t).reshape(k // 32, 32, n)
  parts = jnp.einsum("mbk,bkn->bmn", a, wv, precision="highest")
  scale = L.scale_multipliers(t)[:, None, :] * mult[:, :, None]  # [K/32, M, N]
  total = jnp.sum(parts * scale, axis=0)
  y = total * L.row_scale(t.row_exp, 127)[None] * L.row_scale(r_t, 139)[:, None]
  return y.astype(jnp.bfloat16)


def spread_out(xq, token=3, below=40):
  """xq with one token's every other block `below` binades under its largest: blocks the fold
  cannot hold."""
  s = np.asarray(xq.scales).copy()
  s[token, 1::2] = np.maximum(s[token].max() - below, 0)
  return type(xq)(xq.codes, jnp.asarray(s), None, MXFP4, -1)


def test_exact_path_arithmetic_is_the_reference_where_the_fold_misses():
  """Unfolded, with the block scales applied per block: the reference up to sum order for any
  spread, where the fold (the fast branch) loses the far blocks."""
  xq, w = spread_out(activation(4, 16, 1024)), weight(5, 1024, 256)
  assert int(fold(xq)[2]) > 0
  want = np.asarray(reference.fp4_matmul(dequantize(xq).astype(jnp.bfloat16), w), np.float32)
  got = np.asarray(emulate_exact_path(xq, tile(w)), np.float32)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
  assert np.mean(got != want) < 0.02
  # the far blocks alone: the exact branch keeps them, the fold loses them
  near = np.asarray(xq.scales).copy()
  far_only = np.asarray(xq.codes).copy()
  far_only[3, :] = 0
  far_only[3].reshape(-1, 16)[1::2] = np.asarray(xq.codes)[3].reshape(-1, 16)[1::2]
  xf = type(xq)(jnp.asarray(far_only), jnp.asarray(near), None, MXFP4, -1)
  ref3 = np.asarray(reference.fp4_matmul(dequantize(xf).astype(jnp.bfloat16), w), np.float32)[3]
  np.testing.assert_allclose(np.asarray(emulate_exact_path(xf, tile(w)), np.float32)[3], ref3,
                             rtol=2e-2, atol=0)
  assert np.abs(ref3).max() > 0
  folded = np.asarray(emulate(xf, tile(w)), np.float32)[3]
  assert np.linalg.norm(folded - ref3) > 0.5 * np.linalg.norm(ref3)  # what the branch is for


# one call (16, with the grouped kernel) and calls in sequence (100) by default; the other sizes
# (about 20-40 s of CPU each) in the slow selection
@pytest.mark.parametrize("m", [pytest.param(m, marks=pytest.mark.slow) if m in (1, 40, 64)
                               else m for m in (1, 16, 40, 64, 100)])
def test_kernels_lower_for_cuda(m):
  """The whole Mosaic lowering (layout inference, the 8-bit wgmma's operand checks) for a CUDA
  target, from CPU: one 16-token call, 64 tokens, and calls in sequence past 64."""
  k, n = 512, 128
  w = jax.eval_shape(lambda: L.tile(weight(0, k, n)))
  x = jax.eval_shape(lambda: activation(0, m, k))
  for exact in w4a4.EXACT_PATHS:
    f = jax.jit(lambda x, w: w4a4.w4a4_matmul(x, w, exact_path=exact))
    assert jax.export.export(f, platforms=["cuda"])(x, w).out_avals[0].shape == (m, n)
  if m == 16:
    we = jax.eval_shape(lambda: L.tile(weight(0, k, n, experts=4)))
    g = jax.ShapeDtypeStruct((4,), jnp.int32)
    f = jax.jit(lambda x, w, g: w4a4.grouped_w4a4_matmul(x, w, g, exact_path="kernel"))
    assert jax.export.export(f, platforms=["cuda"])(x, we, g).out_avals[0].shape == (m, n)
    rows = jax.ShapeDtypeStruct((2 * m,), jnp.int32)  # a dispatch's rows: 2 slots a token
    f = jax.jit(lambda x, w, g, r_in, r_out: w4a4.grouped_w4a4_matmul(
        x, w, g, rows_in=r_in, rows_out=r_out))
    out = jax.export.export(f, platforms=["cuda"])(x, we, g, rows, rows).out_avals[0]
    assert out.shape == (2 * m, n)


def test_exact_path_is_checked():
  with pytest.raises(ValueError, match="exact_path must be one of"):
    w4a4.w4a4_matmul(activation(0, 2, 256), tile(weight(0, 256, 128)), exact_path="yes")


def _reference(xq, w, group_sizes=None):
  x = dequantize(xq).astype(jnp.bfloat16)
  if group_sizes is None:
    return np.asarray(reference.fp4_matmul(x, w), np.float32)
  return np.asarray(reference.grouped_fp4_matmul(x, w, group_sizes), np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1, 4096, 1024), (16, 2048, 768), (40, 768, 2048),
                                   (64, 2048, 512), (100, 1024, 256)])
def test_kernel_on_gpu(m, k, n):
  """Compiled: the reference's numbers up to float32 summation order (each block's product is
  exact), for one to several calls; and the exact path for an activation the fold misses."""
  if not w4a4.available():
    pytest.skip("needs a Hopper GPU")
  xq, w = activation(m + k, m, k), weight(m + n, k, n)
  for x in (xq, spread_out(xq, token=min(3, m - 1))):  # no fold misses, then some
    want = _reference(x, w)
    paths = ("none", "kernel", "xla") if x is xq else ("kernel", "xla")
    for exact in paths:
      got = np.asarray(w4a4.w4a4_matmul(x, L.tile(w), exact_path=exact), np.float32)
      assert not np.isnan(got).any(), exact
      assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3, exact
      assert np.mean(got != want) < 0.02, exact


def test_emulated_grouped_takes_the_dispatch_rows():
  """rows_in / rows_out: the sorted rows gathered from x, the output taken back, as the
  reference computes them (up to sum order) and as the emulation on the sorted rows does."""
  rows = routed_rows(6, 12, 2, 4, True)
  xq, w = activation(9, 12, 256), weight(10, 256, 128, experts=4)
  got = np.asarray(w4a4.emulated_grouped_matmul(xq, tile(w), rows.group_sizes, rows.src,
                                                rows.back, rows.slots), np.float32)
  assert got.shape == (24, 128)
  x = dequantize(xq).astype(jnp.bfloat16)
  want = np.asarray(reference.grouped_fp4_matmul(x, w, rows.group_sizes, rows.src, rows.back),
                    np.float32)
  assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3
  sorted_q = type(xq)(xq.codes[rows.src], xq.scales[rows.src], None, MXFP4, -1)
  np.testing.assert_array_equal(got, np.asarray(w4a4.emulated_grouped_matmul(
      sorted_q, tile(w), rows.group_sizes)[rows.back], np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(5, 0, 17, 2), (0, 0, 0, 40)])
def test_grouped_kernel_on_gpu(sizes):
  if not w4a4.available():
    pytest.skip("needs a Hopper GPU")
  k, n = 1024, 512
  g = jnp.asarray(sizes, jnp.int32)
  xq, w = activation(7, int(sum(sizes)) + 3, k), weight(8, k, n, experts=len(sizes))
  for x in (xq, spread_out(xq)):
    want = _reference(x, w, g)
    for exact in ("kernel", "xla"):
      got = np.asarray(w4a4.grouped_w4a4_matmul(x, L.tile(w), g, exact_path=exact), np.float32)
      assert not np.isnan(got).any(), exact
      assert np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30) < 1e-3, exact
  rows = routed_rows(1, 16, 2, len(sizes), True)  # a dispatch's rows, composed with the tiles
  xq = activation(11, 16, k)
  for x in (xq, spread_out(xq)):
    x16 = dequantize(x).astype(jnp.bfloat16)
    want = np.asarray(reference.grouped_fp4_matmul(x16, w, rows.group_sizes, rows.src,
                                                   rows.back), np.float32)
    for exact, slots in (("kernel", None), ("xla", None), ("kernel", rows.slots)):
      got = np.asarray(w4a4.grouped_w4a4_matmul(x, L.tile(w), rows.group_sizes, exact_path=exact,
                                                rows_in=rows.src, rows_out=rows.back,
                                                slots=slots), np.float32)
      assert got.shape == (32, n), exact
      assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-3, exact
