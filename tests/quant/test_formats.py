"""Formats against ml_dtypes, bit for bit: element codes, scale bytes, globals, special values."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.quant import reference as ref
from tests.quant.conftest import spanning
from trace_jax.quant import (BF16, FP8, MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR, dequantize,
                             fake_quant, quantize)
from trace_jax.quant import codecs

seeds = st.integers(0, 2**32 - 1)
# shapes come from small sets so that hypothesis varies values without recompiling every example
FP4_FORMATS = [MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR]
ALL_FORMATS = FP4_FORMATS + [FP8, BF16]


def unpacked(qa):
  block = qa.fmt.axis_block(qa.shape[-1])
  codes = np.asarray(codecs.unpack_nibbles(qa.codes))
  return codes.reshape(*codes.shape[:-1], -1, block)


def test_e2m1_codec_matches_ml_dtypes_on_ties_grid_points_and_saturation():
  grid = ref.GRID[7:]  # 0, 0.5, ..., 6
  mids = (grid[1:] + grid[:-1]) / 2
  beyond = np.array([6.0, 6.5, 7.0, 7.99, 8.0, 1e30, np.inf])
  near = np.concatenate([np.nextafter(mids, 0), np.nextafter(mids, 10)])
  mags = np.concatenate([grid, mids, beyond, near, [0.0]]).astype(np.float32)
  y = np.concatenate([mags, -mags, [-0.0]]).astype(np.float32)
  got = np.asarray(codecs.E2M1.encode(jnp.asarray(y)))
  np.testing.assert_array_equal(got, ref.f4_codes(y))
  back = np.asarray(codecs.E2M1.decode(jnp.asarray(got)))
  np.testing.assert_array_equal(back, ref.f4_values(got).astype(np.float32))
  assert np.signbit(back[-1])  # -0 keeps its sign


@given(seed=seeds)
def test_e2m1_codec_random(seed):
  rng = np.random.default_rng(seed)
  y = (rng.standard_normal(4096) * np.exp2(rng.integers(-4, 5, 4096))).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(codecs.E2M1.encode(jnp.asarray(y))), ref.f4_codes(y))


def test_e4m3_codec_matches_ml_dtypes():
  every = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  finite = every[np.isfinite(every)]
  mids = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2
  y = np.concatenate([finite, mids, [460.0, 470.0, 1e9, -1e9]]).astype(np.float32)
  want = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
  np.testing.assert_array_equal(np.asarray(codecs.E4M3.encode(jnp.asarray(y))), want)


@given(seed=seeds, ceil=st.booleans(), rows=st.sampled_from([1, 3]), blocks=st.sampled_from([1, 4]),
       bf16=st.booleans())
def test_mxfp4_bit_exact(seed, ceil, rows, blocks, bf16):
  x = spanning(np.random.default_rng(seed), rows, 32 * blocks, block=32)
  if bf16:
    x = x.astype(ml_dtypes.bfloat16)
  qa = quantize(jnp.asarray(x), MXFP4_CEIL if ceil else MXFP4)
  codes, scales = ref.mxfp4(x.astype(np.float32), ceil=ceil)
  np.testing.assert_array_equal(unpacked(qa), codes)
  np.testing.assert_array_equal(np.asarray(qa.scales), scales)
  assert qa.global_scale is None


@given(seed=seeds, tensor=st.booleans(), rows=st.sampled_from([1, 3]), blocks=st.sampled_from([1, 5]),
       bf16=st.booleans())
def test_nvfp4_bit_exact(seed, tensor, rows, blocks, bf16):
  x = spanning(np.random.default_rng(seed), rows, 16 * blocks, block=16)
  # NVFP4 covers a 6 * 448 * 448 range per row; keep each row's spread inside a few decades
  x = (x / np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), 1e-30)).astype(np.float32)
  x = x * np.exp2(np.random.default_rng(seed).integers(-60, 60, (rows, 1))).astype(np.float32)
  x = ref.ftz(x)  # the formats read float32 subnormal inputs as zero
  if bf16:
    x = x.astype(ml_dtypes.bfloat16)
  qa = quantize(jnp.asarray(x), NVFP4_TENSOR if tensor else NVFP4)
  codes, scales, g = ref.nvfp4(x.astype(np.float32), tensor_global=tensor)
  np.testing.assert_array_equal(unpacked(qa), codes)
  np.testing.assert_array_equal(np.asarray(qa.scales), scales)
  np.testing.assert_array_equal(np.broadcast_to(np.asarray(qa.global_scale), g.shape), g)


def test_round_reciprocal_corrects_estimates_within_three_ulp():
  """What XLA's GPU division gives (a few ulp off) comes back correctly rounded, across binades,
  at their edges and for both signs; zero, Inf and NaN pass as the backend divides them."""
  rng = np.random.default_rng(0)
  edges = np.float32(2.0) ** np.arange(-120, 120, dtype=np.float32)
  v = np.concatenate([rng.uniform(1e-3, 1e3, 1 << 16).astype(np.float32), edges,
                      np.nextafter(edges, np.float32(0)), 3 * edges])
  v = np.concatenate([v, -v[:1000]])
  want = (np.float32(1) / v).view(np.int32)
  for off in (-3, -2, -1, 0, 1, 2, 3):
    got = codecs.round_reciprocal(jnp.asarray(v), jnp.asarray((want + off).view(np.float32)))
    np.testing.assert_array_equal(np.asarray(got).view(np.int32), want, err_msg=f"{off} ulp")
  special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)
  got = np.asarray(codecs.reciprocal(jnp.asarray(special)))
  np.testing.assert_array_equal(got, [np.inf, -np.inf, 0.0, -0.0, np.nan])
  assert np.signbit(got[3]) and not np.signbit(got[2])


@pytest.mark.parametrize("device", ["default", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_reciprocals_and_nvfp4_ties_match_numpy(device):
  """On the default device (-m gpu: the GPU, whose division XLA approximates): the reciprocal is
  numpy's, and NVFP4 of values whose x / scale lands on E2M1 midpoints (small integer multiples
  of a power of two a row) is the numpy reference's, codes and scales."""
  if device == "gpu":
    import jax
    assert jax.default_backend() == "gpu", "-m gpu selects this test for a GPU machine"
  rng = np.random.default_rng(1)
  v = rng.uniform(1e-3, 1e3, 1 << 16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(codecs.reciprocal(jnp.asarray(v))), np.float32(1) / v)
  x = rng.integers(-12, 13, (64, 1024)) * np.exp2(rng.integers(-10, 10, (64, 1)))
  x = x.astype(ml_dtypes.bfloat16)
  for fmt, tensor in ((NVFP4, False), (NVFP4_TENSOR, True)):
    qa = quantize(jnp.asarray(x), fmt)
    codes, scales, _ = ref.nvfp4(x.astype(np.float32), tensor_global=tensor)
    np.testing.assert_array_equal(unpacked(qa), codes)
    np.testing.assert_array_equal(np.asarray(qa.scales), scales)


@pytest.mark.parametrize("device", ["default", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_nvfp4_under_jit_keeps_the_scale_rules_two_roundings(device):
  """s = RN((amax x f32(1/6)) x (1/g)): under jit XLA's simplifier would rewrite the product of
  two broadcast factors as amax x broadcast(f32(1/6) / g), one ulp off at times (the block
  maxima below, from an RMSNorm output, gave the tie 336 as 336.00003: E4M3 byte 123, not 122);
  jitted quantization is the numpy reference's, codes and scales, on those and on random rows."""
  import jax
  if device == "gpu":
    assert jax.default_backend() == "gpu", "-m gpu selects this test for a GPU machine"
  amax = np.array([2.109375, 2.140625, 3.125, 0.953125, 2.0625, 2.375, 1.7265625, 2.34375],
                  np.float32)
  row = np.zeros((8, 16), np.float32)
  row[:, 3], row[:, 9] = amax, -amax / 3
  rng = np.random.default_rng(2)
  x = np.concatenate([row.reshape(1, 128), rng.normal(size=(255, 128)) * 3]).astype(
      ml_dtypes.bfloat16).astype(np.float32)
  for fmt, tensor in ((NVFP4, False), (NVFP4_TENSOR, True)):
    qa = jax.jit(lambda x: quantize(x, fmt))(jnp.asarray(x))
    codes, scales, _ = ref.nvfp4(x, tensor_global=tensor)
    assert tensor or scales[0, 7] == 122  # 320: the tie 336 to the even mantissa
    np.testing.assert_array_equal(np.asarray(qa.scales), scales)
    np.testing.assert_array_equal(unpacked(qa), codes)


@given(seed=seeds, rows=st.sampled_from([1, 3]), n=st.sampled_from([8, 200]))
def test_fp8_bit_exact(seed, rows, n):
  x = spanning(np.random.default_rng(seed), rows, n, block=8)
  x = ref.ftz(x / np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), 1e-30))
  qa = quantize(jnp.asarray(x), FP8)
  codes, scales = ref.fp8_rows(x.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(qa.codes), codes[..., 0, :])
  np.testing.assert_array_equal(np.asarray(qa.scales), scales)


def test_mxfp4_exact_ties_and_values_beyond_six_times_scale():
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 6.5, 7.0, 7.75, 0.0, 1.0, 4.0])
  block = np.resize(np.concatenate([ties, -ties]), 32)
  block[0] = 4.0  # pins the scale: floor(log2 4) - 2 = 0
  rows = [block * 2.0**k for k in (-120, -30, -1, 0, 1, 7, 100)]
  x = np.stack(rows).astype(np.float32)
  for fmt, ceil in ((MXFP4, False), (MXFP4_CEIL, True)):
    qa = quantize(jnp.asarray(x), fmt)
    codes, scales = ref.mxfp4(x, ceil=ceil)
    np.testing.assert_array_equal(unpacked(qa)[:, 0], codes[:, 0])
    np.testing.assert_array_equal(np.asarray(qa.scales)[:, 0], scales[:, 0])
  # with the floor rule the scale is 2^k, so 7.75 saturates to 6 and 5.0 ties to 4 (even)
  y = np.asarray(dequantize(quantize(jnp.asarray(x[3:4]), MXFP4)))[0]
  assert y[list(block).index(7.75)] == 6.0 and y[list(block).index(5.0)] == 4.0
  assert y[list(block).index(-2.5)] == -2.0


def test_subnormal_scales():
  rng = np.random.default_rng(0)
  # MXFP4: blocks near the bottom of the float32 range give E8M0 bytes 0..3
  tiny = (rng.uniform(0.5, 1, (4, 32)) * np.exp2([[-124], [-123], [-122], [-121]])).astype(
      np.float32)
  qa = quantize(jnp.asarray(tiny), MXFP4)
  codes, scales = ref.mxfp4(tiny)
  np.testing.assert_array_equal(np.asarray(qa.scales), scales)
  np.testing.assert_array_equal(unpacked(qa), codes)
  assert set(np.asarray(qa.scales)[:, 0]) == {0, 1, 2, 3}
  # NVFP4: blocks far below the row maximum get E4M3 subnormal scales (bytes 1..7)
  x = rng.standard_normal((3, 16 * 12)).astype(np.float32)
  x *= np.repeat(np.exp2(-2 * np.arange(12.0)), 16).astype(np.float32)
  for fmt, tensor in ((NVFP4, False), (NVFP4_TENSOR, True)):
    qa = quantize(jnp.asarray(x), fmt)
    codes, scales, _ = ref.nvfp4(x, tensor_global=tensor)
    np.testing.assert_array_equal(np.asarray(qa.scales), scales)
    np.testing.assert_array_equal(unpacked(qa), codes)
    assert (np.asarray(qa.scales) < 8).any()


@pytest.mark.parametrize("fmt", FP4_FORMATS + [FP8])
def test_all_zero_block_gets_the_smallest_scale(fmt):
  x = np.ones((2, 64), np.float32)
  x[:, 32:] = 0.0
  x[1, :] = 0.0
  qa = quantize(jnp.asarray(x), fmt)
  y = np.asarray(dequantize(qa))
  np.testing.assert_array_equal(y[:, 32:], 0.0)
  np.testing.assert_array_equal(y[0, :32], 1.0)
  if fmt in FP4_FORMATS:
    smallest = 0 if fmt.name.startswith("mxfp4") else 1  # E8M0 2^-127, E4M3 2^-9
    scales = np.asarray(qa.scales)
    assert (scales[:, -1] == smallest).all() and (scales[1] == smallest).all()
    assert (unpacked(qa)[1] == 0).all()


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_blocks_never_come_back_finite(fmt, bad):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((3, 64)).astype(np.float32)
  x[1, 5] = bad
  y = np.asarray(dequantize(quantize(jnp.asarray(x), fmt)))
  block = fmt.axis_block(64)
  hit = slice(0, block)
  if fmt is BF16:  # a cast: the non-finite value itself stays non-finite
    assert not np.isfinite(y[1, 5])
  else:
    assert np.isnan(y[1, hit]).all()
  assert np.isfinite(np.delete(y, 1, axis=0)).all()
  if block < 64:  # the other blocks of the row are untouched
    assert np.isfinite(y[1, block:]).all()
    clean = x.copy()
    clean[1, hit] = 0.0
    y_clean = np.asarray(dequantize(quantize(jnp.asarray(clean), fmt)))
    np.testing.assert_array_equal(y[1, block:], y_clean[1, block:])
  assert not np.isfinite(np.asarray(fake_quant(jnp.asarray(x), fmt))[1, 5])


@pytest.mark.parametrize("fmt", FP4_FORMATS)
def test_negative_zero(fmt):
  x = np.zeros((1, 32), np.float32)
  x[0, 0] = 1.0
  x[0, 1] = -0.0
  x[0, 2] = -1e-3  # rounds to zero, keeps its sign, as the ml_dtypes cast does
  codes = unpacked(quantize(jnp.asarray(x), fmt)).reshape(-1)
  assert codes[1] == 8 and codes[2] == 8 and codes[3] == 0
  y = np.asarray(dequantize(quantize(jnp.asarray(x), fmt)))[0]
  assert np.signbit(y[1]) and y[1] == 0.0


@given(seed=seeds)
def test_dequantize_is_code_value_times_scale(seed):
  x = spanning(np.random.default_rng(seed), 4, 128, block=32)
  x = x / np.maximum(np.max(np.abs(x), axis=-1, keepdims=True), 1e-30) * 1e3
  x = ref.ftz(x)  # the formats read float32 subnormal inputs as zero
  codes, scales = ref.mxfp4(x)
  scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
  want = ref.ftz((ref.f4_values(codes) * scale[..., None]).reshape(x.shape))
  np.testing.assert_array_equal(np.asarray(dequantize(quantize(jnp.asarray(x), MXFP4))), want)
  codes, scales, g = ref.nvfp4(x)
  eff = scales.view(ml_dtypes.float8_e4m3fn).astype(np.float32) * g
  want = ref.ftz((ref.f4_values(codes).astype(np.float32) * eff[..., None]).reshape(x.shape))
  np.testing.assert_array_equal(np.asarray(dequantize(quantize(jnp.asarray(x), NVFP4))), want)


def test_extreme_magnitudes_stay_finite():
  # rows near the bottom of the float32 range keep their values (no flush of the global/scale)
  tiny = np.zeros((1, 32), np.float32)
  tiny[0, :3] = [1e-35, -5e-36, 3e-36]
  for fmt in (NVFP4, FP8):
    y = np.asarray(fake_quant(jnp.asarray(tiny), fmt))
    assert np.isfinite(y).all() and abs(y[0, 0] - 1e-35) < 0.2e-35, (fmt.name, y[0, :3])
  # near float32 max the ceil rule saturates instead of overflowing
  big = np.zeros((1, 32), np.float32)
  big[0, 0] = 3.4e38
  for fmt in (MXFP4, MXFP4_CEIL):
    y = np.asarray(fake_quant(jnp.asarray(big), fmt))
    assert np.isfinite(y).all() and y[0, 0] > 2e38
