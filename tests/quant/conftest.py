"""Shared input generators for the quantization tests."""

import numpy as np
import pytest
from hypothesis import settings

settings.register_profile("quant", deadline=None, max_examples=30, derandomize=False)
settings.load_profile("quant")


def spanning(rng: np.random.Generator, rows: int, n: int, block: int = 16) -> np.ndarray:
  """float32 [rows, n]: each block of `block` elements at its own magnitude, 2^-100 .. 2^100,
  with exact zeros, negative zeros and all-zero blocks sprinkled in (no float32 subnormals)."""
  exps = rng.integers(-100, 100, size=(rows, n // block, 1))
  x = rng.standard_normal((rows, n // block, block)) * np.exp2(exps)
  x = np.where(rng.random(x.shape) < 0.05, 0.0, x)
  x = np.where(rng.random(x.shape) < 0.03, -0.0, x)
  x = np.where(rng.random((rows, n // block, 1)) < 0.05, 0.0, x)
  return x.reshape(rows, n).astype(np.float32)


def within_row_range(rng: np.random.Generator, rows: int, n: int, block: int = 16,
                     octaves: int = 10, row_spread: int = 60) -> np.ndarray:
  """float32 [rows, n] whose block maxima lie within 2^-octaves of their row's maximum, the
  range where NVFP4's E4M3 block scales stay normal; rows at 2^-row_spread .. 2^row_spread."""
  exps = rng.integers(-octaves, 1, size=(rows, n // block, 1))
  exps = exps + rng.integers(-row_spread, row_spread + 1, (rows, 1, 1))
  x = rng.standard_normal((rows, n // block, block)) * np.exp2(exps)
  return x.reshape(rows, n).astype(np.float32)


@pytest.fixture
def rng():
  return np.random.default_rng(1234)
