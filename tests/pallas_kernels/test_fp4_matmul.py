"""FP4 matmul kernel against its reference: interpret mode on CPU, compiled on a GPU (-m gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp4_matmul import bf16_matmul, fp4_matmul
from pallas_kernels.fp4_matmul import reference
from trace_jax.quant import MXFP4, NVFP4_TENSOR, dequantize, quantize

FORMATS = [MXFP4, NVFP4_TENSOR]


def inputs(seed, m, k, n, fmt):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (m, k), jnp.bfloat16)
  w = jax.random.normal(kw, (k, n)) * jnp.exp(jax.random.normal(kw, (1, n)))  # column scales
  return x, quantize(w, fmt, axis=0)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_reference_is_the_dequantized_matmul(fmt):
  x, w = inputs(0, 3, 256, 128, fmt)
  dense = jnp.dot(x.astype(jnp.float32), dequantize(w))
  assert rel(reference.fp4_matmul(x, w), dense) < 1e-2  # bf16 output rounding only
  w_bf16, _ = reference.dequantize_bf16(w)
  # every block-scaled value is exact in bf16 (NVFP4: E2M1 x E4M3 has at most 6 bits)
  g = 1.0 if w.global_scale is None else float(w.global_scale.reshape(()))
  # (E2M1 x s) x g against E2M1 x (s x g): a float32 rounding apart for NVFP4, equal for MXFP4
  np.testing.assert_allclose(np.asarray(w_bf16, np.float32) * np.float32(g),
                             np.asarray(dequantize(w)), rtol=3e-7 if g != 1.0 else 0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m,k,n,splits,rows", [(1, 256, 128, 1, 16), (5, 512, 256, 4, 32),
                                               (33, 96, 128, 1, 16), (2, 256, 128, 2, 64)])
def test_kernel_in_interpret_mode(fmt, m, k, n, splits, rows):
  x, w = inputs(m * k, m, k, n, fmt)
  got = fp4_matmul(x, w, implementation="pallas", splits=splits, rows=rows, interpret=True,
                   poison=True)
  want = fp4_matmul(x, w)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 2e-3  # bf16 output rounding and the order of the float32 sums


def test_bf16_kernel_in_interpret_mode():
  x = jax.random.normal(jax.random.PRNGKey(1), (7, 256), jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(2), (256, 128), jnp.bfloat16)
  got = bf16_matmul(x, w, implementation="pallas", splits=2, interpret=True, poison=True)
  assert rel(got, bf16_matmul(x, w)) < 2e-3


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
  with pytest.raises(ValueError, match="MXFP4 and NVFP4"):
    fp4_matmul(x, quantize(jnp.ones((256, 128)), "fp8", axis=0))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("m", [1, 16, 64, 256])
@pytest.mark.parametrize("k,n", [(2048, 768), (768, 2048), (2048, 4096)])
def test_kernel_on_gpu(fmt, m, k, n):
  for seed in range(2):  # fresh inputs each time
    x, w = inputs(seed * 7919 + m, m, k, n, fmt)
    for rows in (16, 32, 64):
      got = fp4_matmul(x, w, implementation="pallas", rows=rows, poison=True)
      assert not np.isnan(np.asarray(got, np.float32)).any()
      assert rel(got, fp4_matmul(x, w)) < 2e-3
  got = bf16_matmul(x, w.codes.astype(jnp.bfloat16)[:k // 2].repeat(2, 0), implementation="pallas",
                    poison=True)
  assert not np.isnan(np.asarray(got, np.float32)).any()
