"""GPU kernels of the FP4 rollout path; each has a pure-jnp reference, a dispatch and a bench."""
