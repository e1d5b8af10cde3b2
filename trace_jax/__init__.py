"""trace_jax: RL for Mixture-of-Experts LMs with FP4 rollouts and TRACE rollout-guided QAT."""

import os as _os

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
for _name, _value in _NUMERICS_FLAGS.items():
  if _name not in _os.environ.get("XLA_FLAGS", ""):
    _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") + f" --{_name}={_value}").strip()

__version__ = "0.1.0"
