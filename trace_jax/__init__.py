"""trace_jax: RL for Mixture-of-Experts LMs with FP4 rollouts and TRACE rollout-guided QAT."""

import os as _os
import sys as _sys
import warnings as _warnings

# bf16 activations must round as bf16 in every fused op: with XLA's default excess precision a
# fusion may keep them in float32, so results would depend on how XLA happened to fuse (batch
# size, sharding) and an FP4 code could flip between two runs of the same program. Takes effect
# when trace_jax is imported before JAX creates its backends; set the flag to true to opt out.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") +
                              " --xla_allow_excess_precision=false").strip()
  if "jax" in _sys.modules:  # too late if JAX has read XLA_FLAGS already
    try:
      from jax._src.xla_bridge import backends_are_initialized as _started
    except ImportError:  # another jax: nothing to check it with
      _started = lambda: False  # noqa: E731
    if _started():
      _warnings.warn(
          "trace_jax was imported after JAX started its backends: --xla_allow_excess_precision="
          "false cannot take effect, so bf16 rounding may depend on fusion; import trace_jax "
          "first or set XLA_FLAGS=--xla_allow_excess_precision=false", RuntimeWarning,
          stacklevel=2)

__version__ = "0.1.0"
