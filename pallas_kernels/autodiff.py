"""Gradients for the kernels: the kernel's forward, its pure-jnp reference's backward.

pallas_call is not differentiated: a kernel computes the same function as its reference up to
the order of float32 sums, so the reference's VJP (XLA) is the kernel's. Integer and boolean
inputs (packed codes, scales, group sizes, masks) get the zero cotangents JAX gives them.
"""

from __future__ import annotations

import functools

import jax


def reference_vjp(reference_fn):
  """Decorates a dispatch `fn(*arrays, /, implementation=..., **static)` (arrays positional
  only: keyword arguments are static, closed over): with implementation="pallas" its forward
  runs the kernel and its VJP is reference_fn's (which takes the same positional arguments);
  "xla" is left as it is."""

  def wrap(fn):
    @functools.wraps(fn)
    def call(*args, implementation: str = "xla", **static):
      if implementation != "pallas":
        return fn(*args, implementation=implementation, **static)
      kernel = lambda *a: fn(*a, implementation="pallas", **static)
      run = jax.custom_vjp(kernel)
      run.defvjp(lambda *a: (kernel(*a), a), lambda a, g: jax.vjp(reference_fn, *a)[1](g))
      return run(*args)

    return call

  return wrap
