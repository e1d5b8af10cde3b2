"""The formats over the whole float32 range, 2^-149 to 2^127: eager and jitted quantization write
the same bytes, and dequantize(quantize(x)) is the format's definition computed exactly
(tests/quant/reference.py: float64, each operation rounded to float32's significand, no
subnormal range), so blocks that are representable never collapse to zero. Subnormal inputs
read as zero, dequantized values below 2^-126 come back as +-0."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.quant import reference as ref
from trace_jax.quant import (FP8, MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR, dequantize, fake_quant,
                             quantize)
from trace_jax.quant import codecs

FORMATS = [MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR, FP8]
SHAPE = (6, 128)  # one shape: hypothesis varies the values, not the programs
TINY = np.finfo(np.float32).tiny


def magnitudes(seed: int, low: bool = False, spread: int = 12) -> np.ndarray:
  """float32 SHAPE: each row at its own binade in [-149, 127] (`low`: [-149, -100], the whole
  tensor tiny), its 16-element blocks up to `spread` binades below it, some elements many
  binades further down; zeros sprinkled."""
  rng = np.random.default_rng(seed)
  rows, n = SHAPE
  top = -100 if low else 128
  e = rng.integers(-149, top, (rows, 1, 1)) - rng.integers(0, spread + 1, (rows, n // 16, 1))
  e = e - np.where(rng.random((rows, n // 16, 16)) < 0.1, rng.integers(0, 40, (rows, n // 16, 16)),
                   0)
  x = rng.uniform(-2, 2, (rows, n // 16, 16)) * np.exp2(e.astype(np.float64))  # |x| < 2^128
  x = np.where(rng.random(x.shape) < 0.05, 0.0, x)
  return x.reshape(SHAPE).astype(np.float32)


@functools.lru_cache(maxsize=None)
def jitted(fmt):
  return jax.jit(lambda x: quantize(x, fmt)), jax.jit(dequantize), jax.jit(
      lambda x: fake_quant(x, fmt))


def _bytes(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@given(seed=st.integers(0, 2**32 - 1), low=st.booleans())
def test_eager_and_jit_write_the_same_bytes(fmt, seed, low):
  x = jnp.asarray(magnitudes(seed, low))
  q, deq, fq = jitted(fmt)
  eager, compiled = quantize(x, fmt), q(x)
  for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(compiled), strict=True):
    np.testing.assert_array_equal(_bytes(a), _bytes(b))
  y = np.asarray(dequantize(eager))
  np.testing.assert_array_equal(_bytes(y), _bytes(deq(compiled)))
  np.testing.assert_array_equal(_bytes(y), _bytes(fq(x)))


def _unpacked(qa, block):
  codes = np.asarray(codecs.unpack_nibbles(qa.codes))
  return codes.reshape(*codes.shape[:-1], -1, block)


def _definition(fmt, x):
  """-> (codes [..., N, B], scale bytes or floats [..., N], global or None, values like x)."""
  if fmt in (NVFP4, NVFP4_TENSOR):
    codes, scales, g = ref.nvfp4(x, tensor_global=fmt is NVFP4_TENSOR)
    return codes, scales, g, ref.nvfp4_values(codes, scales, g).reshape(x.shape)
  if fmt in (MXFP4, MXFP4_CEIL):
    codes, scales = ref.mxfp4(x, ceil=fmt is MXFP4_CEIL)
    scale = scales.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return codes, scales, None, ref.ftz(ref.f4_values(codes) * scale[..., None]).reshape(x.shape)
  codes, scales = ref.fp8_rows(ref.ftz(x))
  values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64) * scales[..., None]
  return codes, scales, None, ref.ftz(values).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@given(seed=st.integers(0, 2**32 - 1), low=st.booleans())
def test_the_definition_at_every_magnitude(fmt, seed, low):
  x = magnitudes(seed, low)
  codes, scales, g, values = _definition(fmt, x)
  qa = jitted(fmt)[0](jnp.asarray(x))
  if fmt is FP8:
    np.testing.assert_array_equal(np.asarray(qa.codes), codes[..., 0, :])
  else:
    np.testing.assert_array_equal(_unpacked(qa, fmt.block_size), codes)
  np.testing.assert_array_equal(np.asarray(qa.scales), scales)
  if g is not None:
    np.testing.assert_array_equal(np.broadcast_to(np.asarray(qa.global_scale), g.shape), g)
  np.testing.assert_array_equal(np.asarray(dequantize(qa)), values)


@pytest.mark.parametrize("fmt", [NVFP4, NVFP4_TENSOR, MXFP4, FP8], ids=lambda f: f.name)
def test_tiny_blocks_keep_their_values(fmt):
  """Rows whose maxima are 2^-126 .. 2^-100 (normal float32, below 6 x 2^-126 for the first
  few): every block keeps its maximum to FP4's precision, eager and jitted alike."""
  rng = np.random.default_rng(0)
  e = np.arange(-126, -100)
  x = rng.uniform(0.25, 1, (len(e), 32)) * np.exp2(e[:, None].astype(np.float64))
  x[:, ::2] *= -1
  x[:, 0] = np.exp2(e + 0.5)  # the block maximum
  x = x.astype(np.float32)
  # one global for the whole tensor: then a row at a time
  rows = [x[i:i + 1] for i in range(len(x))] if fmt is NVFP4_TENSOR else [x]
  y = np.concatenate([np.asarray(jitted(fmt)[2](jnp.asarray(r))) for r in rows])
  eager = np.concatenate([np.asarray(fake_quant(jnp.asarray(r), fmt)) for r in rows])
  np.testing.assert_array_equal(y, eager)
  np.testing.assert_allclose(y[:, 0], x[:, 0], rtol=0.25)
  assert (np.abs(y) >= TINY).mean() > 0.9, (np.abs(y) >= TINY).mean()


def test_subnormal_inputs_read_as_zero():
  x = np.zeros((3, 32), np.float32)
  x[0, :4] = [2.0**-127, -(2.0**-140), 2.0**-149, -(2.0**-126.5)]  # all subnormal: a zero row
  x[1, :2] = [2.0**-127, 2.0**-120]  # a subnormal next to a normal value
  x[2, :] = 2.0**-149
  for fmt in FORMATS:
    y = np.asarray(jitted(fmt)[2](jnp.asarray(x)))
    np.testing.assert_array_equal(y[[0, 2]], 0.0)
    assert np.signbit(y[0, 1]) and np.signbit(y[0, 3])
    assert y[1, 0] == 0.0 and y[1, 1] > 0.0, (fmt.name, y[1, :2])
