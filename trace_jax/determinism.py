"""GPU runs that repeat themselves: XLA's deterministic ops, asked for before JAX starts.

On a GPU, XLA's scatters (the gradients of gathers: embeddings, the MoE dispatch) add with
atomics in whatever order the threads arrive, and its autotuner may pick a different kernel in
another process, so two runs of one config need not compute the same: the GPU ablation's runs
of one seed started RL from warm starts as far apart as the modes it compares (RESULTS.md).
`--xla_gpu_deterministic_ops=true` asks XLA for ops that repeat bit for bit on the same GPU and
software (`tests/test_determinism.py` checks two runs on a GPU). XLA reads XLA_FLAGS once, when JAX
starts its backends, so `enable` runs before anything asks JAX for a device. CPUs compute the
same either way.
"""

from __future__ import annotations

import os

import jax
from jax._src import xla_bridge

FLAG = "--xla_gpu_deterministic_ops=true"


def is_on() -> bool:
  return FLAG in os.environ.get("XLA_FLAGS", "").split()


def enable(on: bool) -> None:
  """Asks XLA for deterministic GPU ops (`on`), through XLA_FLAGS. Once JAX has started on a
  GPU without them it is too late, and that is said in one line (a ValueError): set
  XLA_FLAGS before JAX starts, or run with `deterministic=false`."""
  if not on or is_on():
    return
  if xla_bridge.backends_are_initialized():
    if jax.default_backend() == "gpu":
      raise ValueError(f"deterministic=true needs XLA_FLAGS={FLAG} before JAX starts, and JAX "
                       "has started on this GPU without it: set XLA_FLAGS in the environment "
                       "(or call trace_jax.determinism.enable first), or pass "
                       "--config.deterministic=false")
    return  # (CPU: the same values either way)
  os.environ["XLA_FLAGS"] = " ".join([*os.environ.get("XLA_FLAGS", "").split(), FLAG])
