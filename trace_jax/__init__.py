"""trace_jax: RL for Mixture-of-Experts LMs with FP4 rollouts and TRACE rollout-guided QAT."""

__version__ = "0.1.0"
