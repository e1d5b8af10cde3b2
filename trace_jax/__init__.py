"""trace_jax: RL for Mixture-of-Experts LMs with FP4 rollouts and TRACE rollout-guided QAT."""

import os as _os

# bf16 activations must round as bf16 in every fused op: with XLA's default excess precision a
# fusion may keep them in float32, so results would depend on how XLA happened to fuse (batch
# size, sharding) and an FP4 code could flip between two runs of the same program. Takes effect
# when trace_jax is imported before JAX creates its backends; set the flag to true to opt out.
if "xla_allow_excess_precision" not in _os.environ.get("XLA_FLAGS", ""):
  _os.environ["XLA_FLAGS"] = (_os.environ.get("XLA_FLAGS", "") +
                              " --xla_allow_excess_precision=false").strip()

__version__ = "0.1.0"
