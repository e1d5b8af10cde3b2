"""Kernels written in Triton's own language, called from JAX.

Pallas' Triton lowering is deprecated from jax 0.11 ("to keep using Triton, switch to the official
Triton bindings and jax_triton", its changelog); the kernels that stay Triton, because Triton is
faster there than Mosaic GPU (BENCHMARKS.md, "The Triton-lowered kernels left"), move to
`@triton.jit` functions called through `call`: `jax_triton.triton_call` on a GPU, and on any
other backend Triton's interpreter, which runs each program in numpy, through
`jax.pure_callback` with torch CPU tensors (the CPU tests; slow, meant for small shapes).

Triton decides at import whether its `@triton.jit` functions (its own reductions among them)
are interpreted, from `TRITON_INTERPRET`, so the modules of kernels are imported by `load`, which
sets it first where there is no GPU. Two things the interpreter computes unlike the compiled
kernel (Triton 3.9): it multiplies bf16 operands of `tl.dot` as their integer bit patterns, and
its casts to bf16 truncate. Kernels take an `INTERPRET` constexpr (`call` passes it) and there
give `tl.dot` float32 operands (the same exact products) and round to bf16 themselves.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["call", "load", "interpreted"]


def interpreted() -> bool:
  """Whether Triton kernels run in the interpreter: where jax has no GPU backend, or wherever
  TRITON_INTERPRET=1 is set (the CPU test suite sets it, `tests/conftest.py`)."""
  return os.environ.get("TRITON_INTERPRET") == "1" or jax.default_backend() != "gpu"


def load(module: str):
  """Imports a module of `@triton.jit` kernels, under Triton's interpreter where `interpreted`.
  Raises if triton was imported before without TRITON_INTERPRET=1 on a machine without a GPU
  (its own functions are then compiled ones, which cannot be interpreted): set it before
  anything imports triton."""
  if interpreted():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
      raise RuntimeError(f"{module}: Triton kernels run in Triton's interpreter without a GPU, "
                         "but triton was imported without TRITON_INTERPRET=1: set it before "
                         "anything imports triton")
    os.environ["TRITON_INTERPRET"] = "1"
  return importlib.import_module(module)


def call(kernel, *args, out_shape: Sequence[jax.ShapeDtypeStruct], grid: tuple[int, ...],
         num_warps: int = 4, num_stages: int = 2, name: str = "", **meta):
  """kernel(*args, *outputs, **meta, INTERPRET=...) over `grid`: args are arrays (pointers) or
  Python scalars, `meta` the kernel's constexprs; returns the outputs (a list, `out_shape`'s
  order), each written by the kernel (none is zeroed first; in the interpreter they start as
  NaN, or -1 for integers, so that a test sees what a kernel failed to write)."""
  out_shape = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_shape]
  if not interpreted():
    import jax_triton  # importable only where jax has a GPU backend
    return jax_triton.triton_call(*args, kernel=kernel, out_shape=out_shape, grid=grid,
                                  num_warps=num_warps, num_stages=num_stages, name=name,
                                  INTERPRET=False, **meta)
  arrays = [i for i, a in enumerate(args) if not isinstance(a, (bool, int, float))]

  def host(*values):
    import torch  # the interpreter's tensors (the test extra installs it)
    tensors = list(args)
    for i, v in zip(arrays, values):
      tensors[i] = _torch(np.asarray(v), torch)
    outs = [torch.full(s.shape, np.nan if jnp.issubdtype(s.dtype, jnp.inexact) else -1,
                       dtype=_torch_dtype(s.dtype, torch)) for s in out_shape]
    kernel[grid](*tensors, *outs, INTERPRET=True, **meta)
    return [_numpy(o, s.dtype) for o, s in zip(outs, out_shape)]

  return jax.pure_callback(host, out_shape, *[args[i] for i in arrays])


def _torch_dtype(dtype, torch):
  dtype = np.dtype(dtype)
  if dtype == np.dtype(jnp.bfloat16):
    return torch.bfloat16
  return torch.from_numpy(np.zeros(0, dtype)).dtype


def _torch(a: np.ndarray, torch):
  if a.dtype == np.dtype(jnp.bfloat16):
    return torch.from_numpy(np.array(a).view(np.int16)).view(torch.bfloat16)
  return torch.from_numpy(np.array(a))  # a copy: the callback's arrays are read-only


def _numpy(t, dtype) -> np.ndarray:
  dtype = np.dtype(dtype)
  if dtype == np.dtype(jnp.bfloat16):
    import torch
    return t.view(torch.int16).numpy().view(dtype)
  return t.numpy()
