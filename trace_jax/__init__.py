"""trace_jax: RL for Mixture-of-Experts LMs with FP4 rollouts and TRACE rollout-guided QAT."""

import os as _os
import sys as _sys
import warnings as _warnings

# XLA flags that make a program's numbers independent of how XLA happened to compile it. Each takes
# effect when trace_jax is imported before JAX creates its backends, and is left alone when
# XLA_FLAGS already names it (set it to true to opt out).
# - bf16 activations must round as bf16 in every fused op: with XLA's default excess precision a
#   fusion may keep them in float32, so results would depend on how XLA fused (batch size,
#   sharding) and an FP4 code could flip between two runs of the same program.
# - XLA's CPU backend runs bf16 dots on YNNPACK, which picks a kernel per dot shape by a cost
#   model; on CPUs with AMX-BF16 some shapes get AMX kernels, which round otherwise than the
#   AVX-512 ones, so a row's result would depend on how many rows share the dot (8 devices and
#   one disagreed, the Pallas kernels' tiles and XLA's). Without platform-dependent math XLA asks
#   YNNPACK for the kernels it keeps numerically consistent with one another (and computes rsqrt
#   as 1 / sqrt). CPU only: GPU programs ignore it.
_NUMERICS_FLAGS = {"xla_allow_excess_precision": "false",
                   "xla_cpu_enable_platform_dependent_math": "false"}
_missing = [n for n in _NUMERICS_FLAGS if n not in _os.environ.get("XLA_FLAGS", "")]
for _name in _missing:
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") +
                              f" --{_name}={_NUMERICS_FLAGS[_name]}").strip()
if _missing and "jax" in _sys.modules:  # too late if JAX has read XLA_FLAGS already
  try:
    from jax._src.xla_bridge import backends_are_initialized as _started
  except ImportError:  # another jax: nothing to check it with
    _started = lambda: False  # noqa: E731
  if _started():
    _warnings.warn(
        f"trace_jax was imported after JAX started its backends: {', '.join(_missing)} cannot "
        "take effect, so bf16 rounding may depend on fusion and shapes; import trace_jax first "
        "or set XLA_FLAGS=" + " ".join(f"--{n}={_NUMERICS_FLAGS[n]}" for n in _missing),
        RuntimeWarning, stacklevel=2)

__version__ = "0.1.0"
