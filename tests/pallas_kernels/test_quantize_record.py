"""Quantize-and-record kernels against the quant core, bit for bit: interpret mode on CPU, the
Triton lowering on CPU (lowered for CUDA, not compiled), compiled on a GPU (-m gpu); the kernel
in Triton's own language (backend="jax_triton") in Triton's interpreter on CPU, through
jax-triton on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.quantize_record import quantize_and_record
from pallas_kernels.quantize_record.kernel import e2m1_decode, e2m1_encode
from trace_jax.quant import dequantize, guided_quant
from trace_jax.quant.codecs import E2M1

FORMATS = ["mxfp4", "nvfp4"]


def assert_same(a, b):
  for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    assert u.shape == v.shape and u.dtype == v.dtype
    np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


def hostile(key, shape):
  """Normal values over many binades, plus NaN, Inf, signed zeros, ties and tiny rows."""
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, shape) * jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -20, 20))
  flat = x.reshape(-1)
  n = flat.size
  special = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 0.0, -0.0, 1e-39, -3e-40, 0.25, 1.25, 5.0])
  idx = jax.random.choice(k3, n, (min(n // 8, 40),), replace=False)
  flat = flat.at[idx].set(special[jnp.arange(idx.size) % special.size])
  x = flat.reshape(shape)
  return x.at[0].set(x[0] * 1e-38)  # a row far in the subnormal range


def tie_rich(key, shape):
  """Small integer multiples of a power of two a row: the block maxima are multiples of the
  other values, so many x / scale land exactly on a midpoint of the E2M1 grid (a 1-ulp error in
  NVFP4's grid multiplier changes about a tenth of the codes)."""
  k1, k2 = jax.random.split(key)
  steps = jax.random.randint(k1, shape, -12, 13).astype(jnp.float32)
  return steps * jnp.exp2(jax.random.randint(k2, shape[:-1] + (1,), -10, 10).astype(jnp.float32))


def test_e2m1_encode_matches_the_core_on_every_bf16_value_and_ties():
  bits = jnp.arange(1 << 16, dtype=jnp.uint32) << 16
  y = jax.lax.bitcast_convert_type(bits, jnp.float32)
  ties = jnp.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 4.9999995, 5.0000005])
  y = jnp.concatenate([y, ties, -ties, jnp.nextafter(ties, 0.0), jnp.nextafter(ties, 9.0),
                       jax.random.uniform(jax.random.PRNGKey(0), (4096,)) * 9])
  np.testing.assert_array_equal(np.asarray(jax.jit(e2m1_encode)(y)), np.asarray(E2M1.encode(y)))


# (17, 2, 128) with 4 tokens a program: a last program that is part outside T; 96: 3 MXFP4
# blocks, 6 NVFP4 blocks, not powers of two (masked in "blocks", padded in "strided")
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, layout, block_t", [
    ((1, 32), "blocks", None), ((17, 2, 128), "blocks", 4), ((5, 96), "blocks", 2),
    ((5, 96), "blocks", None), ((5, 96), "strided", 8)])
def test_kernel_in_interpret_mode_is_bit_exact(fmt, shape, layout, block_t):
  x = hostile(jax.random.PRNGKey(sum(shape)), shape)
  want = quantize_and_record(x, fmt)
  got = quantize_and_record(x, fmt, implementation="pallas", layout=layout, block_t=block_t,
                            interpret=True)
  assert_same(got, want)
  qa, rec = got
  assert qa.codes.shape == shape[:-1] + (shape[-1] // 2,) and rec.mant.shape[-1] == shape[-1] // 8
  # the record reproduces the rollout's values through guided rounding
  finite = np.isfinite(np.asarray(x))
  np.testing.assert_array_equal(np.asarray(guided_quant(x, rec, fmt))[finite],
                                np.asarray(dequantize(qa))[finite])


def assert_same_values(got, want):
  """Bit for bit, NaN for NaN (a NaN's sign and payload are the backend's)."""
  assert got.shape == want.shape and got.dtype == want.dtype
  g, w = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
  np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
  ok = ~np.isnan(w)
  np.testing.assert_array_equal(g[ok].view(np.uint32), w[ok].view(np.uint32))


def _with_negation_as_subtraction(jaxpr, *args):
  """Evaluates a jaxpr with `neg` as 0 - x, as the Triton lowering computes it (which makes
  -(+0) +0); every other primitive as it is."""
  env = dict(zip(jaxpr.jaxpr.invars, args))
  env.update(zip(jaxpr.jaxpr.constvars, jaxpr.consts))
  read = lambda v: v.val if hasattr(v, "val") else env[v]  # a literal, or a variable
  for e in jaxpr.jaxpr.eqns:
    ins = [read(v) for v in e.invars]
    if e.primitive is jax.lax.neg_p:
      outs = [jnp.zeros_like(ins[0]) - ins[0]]
    else:
      outs = e.primitive.bind(*ins, **e.params)
      outs = outs if e.primitive.multiple_results else [outs]
    env.update(zip(e.outvars, outs))
  return [read(v) for v in jaxpr.jaxpr.outvars]


def test_e2m1_decode_is_the_cores_on_every_code():
  """Bit for bit, -0 included, also where negation is a subtraction from zero (Triton's: a
  decode that negated its magnitudes gave +0 for code 8 on the GPU)."""
  codes = jnp.arange(16, dtype=jnp.int32)
  want = np.asarray(E2M1.decode(codes)).view(np.uint32)
  np.testing.assert_array_equal(np.asarray(e2m1_decode(codes)).view(np.uint32), want)
  got, = _with_negation_as_subtraction(jax.make_jaxpr(e2m1_decode)(codes), codes)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want)


# the values the rollout computes with, from the kernel's own codes: the quant core's
# dequantization in x's dtype, so no XLA pass decodes them again
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, layout, block_t, dtype", [
    ((17, 2, 128), "blocks", 4, jnp.float32), ((5, 96), "blocks", None, jnp.bfloat16),
    # the first version's layout, which no engine calls: 30 s in interpret mode
    pytest.param((5, 96), "strided", 8, jnp.bfloat16, marks=pytest.mark.slow)])
def test_values_are_the_cores_dequantization(fmt, shape, layout, block_t, dtype):
  x = hostile(jax.random.PRNGKey(sum(shape) + 1), shape).astype(dtype)
  qa, rec, values = quantize_and_record(x, fmt, implementation="pallas", layout=layout,
                                        block_t=block_t, values=True, interpret=True)
  want = quantize_and_record(x, fmt, values=True)  # the core's, with values the same way
  assert_same((qa, rec), want[:2])
  assert_same_values(values, dequantize(qa).astype(dtype))
  assert_same_values(want[2], values)
  from tests.quant.test_magnitudes import magnitudes
  tiny = jnp.asarray(magnitudes(5, low=True))  # 2^-149 .. 2^-100: NVFP4 computed 2^64 up
  qa, _, values = quantize_and_record(tiny, fmt, implementation="pallas", layout=layout,
                                      values=True, interpret=True)
  assert_same_values(values, dequantize(qa))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_tiny_rows_in_interpret_mode_are_the_cores(fmt, layout):
  """Rows at 2^-149 .. 2^-100, subnormal inputs among them: the kernel takes the core's scale
  rule and grid (computed 2^64 up where NVFP4's would be subnormal), bit for bit."""
  from tests.quant.test_magnitudes import magnitudes
  x = jnp.asarray(magnitudes(5, low=True))
  want = quantize_and_record(x, fmt)
  assert_same(quantize_and_record(x, fmt, implementation="pallas", layout=layout,
                                  interpret=True), want)
  assert np.count_nonzero(np.asarray(dequantize(want[0]))) > x.size // 4


@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_interpret_mode_keeps_the_cores_order_of_multiplications(layout):
  """NVFP4's block scale is (amax x f32(1/6)) x (1/g), two roundings; XLA's simplifier would
  make it amax x (f32(1/6) x (1/g)), both being broadcasts, which differs in the last bit (here
  336.00003 for the exact tie 336: E4M3 byte 123 in place of 122). A row of 8 blocks whose
  maxima are those of an RMSNorm output that showed it."""
  amax = np.array([2.109375, 2.140625, 3.125, 0.953125, 2.0625, 2.375, 1.7265625, 2.34375],
                  np.float32)
  x = np.zeros((8, 16), np.float32)
  x[:, 3] = amax
  x[:, 5] = -amax / 3
  x = jnp.asarray(x.reshape(1, 128))
  want = quantize_and_record(x, "nvfp4")
  assert np.asarray(want[0].scales)[0, 7] == 122  # 320: the tie 336 to the even mantissa
  assert_same(quantize_and_record(x, "nvfp4", implementation="pallas", layout=layout,
                                  interpret=True), want)
  if layout == "blocks":  # and the program in Triton's language, its own steps
    assert_same(quantize_and_record(x, "nvfp4", implementation="pallas", backend="jax_triton"),
                want)


@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_bf16_input(layout):
  x = jax.random.normal(jax.random.PRNGKey(3), (5, 64), jnp.bfloat16)
  assert_same(quantize_and_record(x, "mxfp4", implementation="pallas", layout=layout,
                                  interpret=True),
              quantize_and_record(x, "mxfp4"))


def test_errors():
  x = jax.random.normal(jax.random.PRNGKey(3), (5, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="supports"):
    quantize_and_record(x, "fp8")
  with pytest.raises(ValueError, match="blocks of 32"):
    quantize_and_record(x[:, :48], "mxfp4")
  with pytest.raises(ValueError, match="implementation must be one of"):
    quantize_and_record(x, "mxfp4", implementation="cuda")
  with pytest.raises(ValueError, match="layout must be one of"):
    quantize_and_record(x, "mxfp4", implementation="pallas", layout="rows")


# interpret mode does not apply the Triton lowering's rules (power-of-two tiles, the operations
# it has); lowering for CUDA does, on any host
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", ["blocks", "strided"])
def test_kernel_lowers_to_triton(fmt, layout):
  for shape, block_t in [((64, 2048), None), ((4096, 768), None), ((17, 96), 4), ((1, 32), 1)]:
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    for values in (False, True):
      f = lambda x: quantize_and_record(x, fmt, implementation="pallas", layout=layout,
                                        block_t=block_t, values=values)
      text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
      assert "xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout, backend", [("blocks", "triton"), ("strided", "triton"),
                                             ("blocks", "jax_triton")])
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (256, 768), (1000, 128)])
def test_kernel_on_gpu_is_bit_exact(fmt, layout, backend, shape):
  kernel = dict(implementation="pallas", layout=layout, backend=backend)
  for seed in range(3):  # fresh inputs each time
    x = hostile(jax.random.PRNGKey(seed * 1000 + shape[0]), shape).astype(
        jnp.bfloat16 if seed == 2 else jnp.float32)
    assert_same(quantize_and_record(x, fmt, **kernel), quantize_and_record(x, fmt))
  x = hostile(jax.random.PRNGKey(7), (shape[0] + 3, shape[1]))  # T not a multiple of block_t
  assert_same(quantize_and_record(x, fmt, block_t=8, **kernel), quantize_and_record(x, fmt))
  x = tie_rich(jax.random.PRNGKey(11), shape).astype(jnp.bfloat16)  # reciprocals rounded right
  assert_same(quantize_and_record(x, fmt, **kernel), quantize_and_record(x, fmt))
  for x in (hostile(jax.random.PRNGKey(5), shape).astype(jnp.bfloat16), x):  # and the values
    qa, rec, values = quantize_and_record(x, fmt, values=True, **kernel)
    assert_same((qa, rec), quantize_and_record(x, fmt))
    assert_same_values(values, dequantize(qa).astype(x.dtype))


def _norm_inputs(shape, seed):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  x = (jax.random.normal(k1, shape) * 3.0).astype(jnp.bfloat16)
  w = (1.0 + 0.2 * jax.random.normal(k2, shape[-1:])).astype(jnp.bfloat16)
  return x, w


def _check_norm_then_quantize(fmt, x, w, **kw):
  """The kernel's normed x is the model's RMSNorm of x (all but a few last-bit differences of
  its float32 sum order), and its codes, record and values are exactly the core's of the
  normed x it wrote: the norm and the quantization of one kernel agree with each other."""
  from trace_jax.models.layers import rms_norm
  eps = 1e-6
  qa, rec, xn, values = quantize_and_record(x, fmt, implementation="pallas", values=True,
                                            rms_norm=(w, eps), normed=True, **kw)
  want = np.asarray(rms_norm(x, w, eps), np.float32)
  got = np.asarray(xn, np.float32)
  assert xn.dtype == x.dtype and np.mean(got != want) < 1e-3
  np.testing.assert_allclose(got, want, rtol=2 ** -7)
  assert_same((qa, rec), quantize_and_record(xn, fmt))
  assert_same_values(values, dequantize(qa).astype(x.dtype))
  qa2, rec2 = quantize_and_record(x, fmt, implementation="pallas", rms_norm=(w, eps), **kw)
  assert_same((qa2, rec2), (qa, rec))  # the same codes without the extra outputs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, block_t", [((5, 96), None), ((17, 2, 256), 4)])
def test_norm_then_quantize_in_one_kernel(fmt, shape, block_t):
  """RMSNorm in the quantize kernel (the model's norms before the attention and the experts):
  blocks past a power of two (96 = 3 blocks of 32) and tokens past the last full tile."""
  x, w = _norm_inputs(shape, sum(shape))
  _check_norm_then_quantize(fmt, x, w, block_t=block_t, interpret=True)
  eps = 1e-6  # the xla implementation: the reference norm, then the core
  from pallas_kernels.quantize_record import reference
  assert_same(quantize_and_record(x, fmt, rms_norm=(w, eps)),
              quantize_and_record(reference.rms_norm(x, w, eps), fmt))


def test_the_kernels_norm_is_the_models():
  """`reference.rms_norm` is the model's RMSNorm, bit for bit."""
  from pallas_kernels.quantize_record import reference
  from trace_jax.models.layers import rms_norm
  x, w = _norm_inputs((7, 2048), 3)
  np.testing.assert_array_equal(np.asarray(reference.rms_norm(x, w, 1e-6), np.float32),
                                np.asarray(rms_norm(x, w, 1e-6), np.float32))


def test_norm_errors():
  x, w = _norm_inputs((5, 64), 0)
  with pytest.raises(ValueError, match=r"rms_norm's weight must be \[64\]"):
    quantize_and_record(x, "mxfp4", rms_norm=(w[:32], 1e-6))
  with pytest.raises(ValueError, match="normed=True .* needs rms_norm"):
    quantize_and_record(x, "mxfp4", normed=True)
  with pytest.raises(ValueError, match="'blocks' layout's kernel only"):
    quantize_and_record(x, "mxfp4", implementation="pallas", layout="strided",
                        rms_norm=(w, 1e-6))


@pytest.mark.parametrize("fmt", FORMATS)
def test_norm_then_quantize_lowers_to_triton(fmt):
  for shape, block_t in [((64, 2048), None), ((17, 96), 4)]:
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    w = jax.ShapeDtypeStruct(shape[-1:], jnp.bfloat16)
    for normed in (False, True):
      f = lambda x, w: quantize_and_record(x, fmt, implementation="pallas", block_t=block_t,
                                           values=True, rms_norm=(w, 1e-6), normed=normed)
      text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
      assert "xla.gpu.triton" in text


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (1000, 768)])
@pytest.mark.parametrize("backend", ["triton", "jax_triton"])
def test_norm_then_quantize_on_gpu(fmt, shape, backend):
  x, w = _norm_inputs(shape, shape[0])
  _check_norm_then_quantize(fmt, x, w, backend=backend)


# Triton's interpreter runs each program in numpy: small shapes
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, block_t, dtype", [
    ((17, 2, 128), 4, jnp.float32), ((5, 96), None, jnp.bfloat16), ((1, 32), None, jnp.float32)])
def test_kernel_in_triton_language_is_bit_exact(fmt, shape, block_t, dtype):
  """The program in Triton's own language (its scale rules written there, not the core's jnp):
  codes, scales, record and values the core's, on hostile and tie-rich inputs, tokens past the
  last full tile and blocks past a power of two."""
  kernel = dict(implementation="pallas", backend="jax_triton", block_t=block_t, values=True)
  for x in (hostile(jax.random.PRNGKey(sum(shape)), shape),
            tie_rich(jax.random.PRNGKey(len(shape)), shape)):
    x = x.astype(dtype)
    qa, rec, values = quantize_and_record(x, fmt, **kernel)
    assert_same((qa, rec), quantize_and_record(x, fmt))
    assert_same_values(values, dequantize(qa).astype(dtype))


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_language_kernel_on_tiny_rows_and_with_the_norm(fmt):
  """Rows at 2^-149 .. 2^-100 (NVFP4 computed 2^64 up, subnormal inputs read as zero), and the
  RMSNorm in the kernel, as in the Pallas kernel's tests."""
  from tests.quant.test_magnitudes import magnitudes
  x = jnp.asarray(magnitudes(5, low=True))
  qa, rec, values = quantize_and_record(x, fmt, implementation="pallas", backend="jax_triton",
                                        values=True)
  assert_same((qa, rec), quantize_and_record(x, fmt))
  assert_same_values(values, dequantize(qa))
  x, w = _norm_inputs((5, 96), 5)
  _check_norm_then_quantize(fmt, x, w, backend="jax_triton")


def test_triton_language_errors():
  x = jax.random.normal(jax.random.PRNGKey(3), (5, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="backend must be one of"):
    quantize_and_record(x, "mxfp4", implementation="pallas", backend="cuda")
  with pytest.raises(ValueError, match="no interpret argument, no other layout"):
    quantize_and_record(x, "mxfp4", implementation="pallas", backend="jax_triton",
                        interpret=True)
  with pytest.raises(ValueError, match="no interpret argument, no other layout"):
    quantize_and_record(x, "mxfp4", implementation="pallas", backend="jax_triton",
                        layout="strided")
  with pytest.raises(ValueError, match="float32 or bfloat16 x, got float16"):
    quantize_and_record(x.astype(jnp.float16), "mxfp4", implementation="pallas",
                        backend="jax_triton")
