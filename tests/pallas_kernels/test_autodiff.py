"""The kernels differentiate through their references' VJPs (pallas_call itself is not)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.fp4_matmul import fp4_matmul, grouped_bf16_matmul
from trace_jax.quant import MXFP4, quantize


def grads(fn, args, argnums):
  """Gradients of a scalar loss of fn's output, by the pallas kernel (interpret mode) and by
  the xla reference."""
  loss = lambda impl: lambda *a: jnp.sum(
      fn(*a, implementation=impl, **({"interpret": True} if impl == "pallas" else {}))
      .astype(jnp.float32) * jnp.arange(1.0, 1.0 + a[0].shape[-1]) / a[0].shape[-1])
  return [jax.grad(loss(impl), argnums)(*args) for impl in ("pallas", "xla")]


def test_matmul_gradients_are_the_references():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k[0], (3, 128), jnp.bfloat16)
  w32 = jax.random.normal(k[1], (128, 128))
  sizes = jnp.asarray([2, 0, 1], jnp.int32)
  w3 = jax.random.normal(k[2], (3, 128, 128))
  # the four dispatches share one decorator: one plain and one grouped are enough
  for fn, args in ((fp4_matmul, (x, quantize(w32, MXFP4, axis=0))),
                   (grouped_bf16_matmul, (x, w3, sizes))):
    got, want = grads(fn, args, 0)
    assert np.any(np.asarray(want, np.float32) != 0)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_attention_gradients_are_the_references():
  k = jax.random.split(jax.random.PRNGKey(1), 3)
  q = jax.random.normal(k[0], (2, 4, 32), jnp.bfloat16)
  kv = [jax.random.normal(kk, (2, 64, 2, 32), jnp.bfloat16) for kk in k[1:]]
  mask = jnp.arange(64)[None, :] < jnp.asarray([[64], [20]])
  fn = lambda q, kc, vc, m, **kw: decode_attention(q, kc, vc, m, block_s=32, **kw)
  got, want = grads(fn, (q, *kv, mask), (0, 1, 2))
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_arrays_are_positional_only():
  """Keyword arguments of a dispatch are static (closed over by its custom_vjp): an array
  passed by keyword would get no gradient, so it is refused."""
  x = jnp.ones((2, 128), jnp.bfloat16)
  w = jnp.ones((2, 128, 128), jnp.bfloat16)
  with pytest.raises(TypeError, match="group_sizes"):
    grouped_bf16_matmul(x, w, group_sizes=jnp.asarray([1, 1]), implementation="pallas")
