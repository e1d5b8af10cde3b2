"""What both decode-attention kernels (`kernel.py`, Triton; `mosaic.py`, Mosaic GPU) and their
dispatch (`api.py`) share: a cache's format and arrays, and the splits over the sequence."""

from __future__ import annotations

import jax.numpy as jnp

from trace_jax.quant import QArray


def default_splits(programs: int, blocks: int, target: int = 4 * 132) -> int:
  """Sequence splits that give each of the H200's 132 multiprocessors several programs (powers
  of two dividing the blocks of slots, at most 64)."""
  splits = 1
  while programs * splits < target and blocks % (splits * 2) == 0 and splits < 64:
    splits *= 2
  return splits


def cache_format(c) -> str:
  """A cache's format name: "bf16" for an array, else its `QArray`'s."""
  return c.fmt.name if isinstance(c, QArray) else "bf16"


def cache_arrays(c):
  """(format, the kernel's arrays: bf16 values, or codes and scales (and NVFP4's globals))."""
  fmt = cache_format(c)
  if fmt == "bf16":
    return fmt, (c.astype(jnp.bfloat16),)
  return fmt, (c.codes, c.scales) + ((c.global_scale,) if fmt == "nvfp4" else ())
