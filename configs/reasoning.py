"""RL on the reasoning family (reasoning-gym chain_sum): warm start, then GRPO with FP4 rollouts.

  python -m trace_jax.main --config=configs/reasoning.py --workdir=runs/reasoning
  python -m trace_jax.main --config=configs/reasoning.py:fp4_qat --workdir=runs/qat
  python -m trace_jax.main --config=configs/reasoning.py:trace_all,rl.routing_replay=true ...

The default (the README's main job) trains a 2-layer, 4-expert policy from scratch on sums of
two 1-2 digit numbers: a 100-step supervised warm start (bf16), then 500 GRPO steps in `trace`
mode (MXFP4 weights, activations and KV cache in the rollout; QAT guided by the last layer's
records). About 3 minutes on 2 CPU cores; greedy eval accuracy of the FP4 policy rises from
0.37 after the warm start to 0.57, the mean training reward from 0.24 to 0.54. Variants: one
per mode (bf16, fp4_rollout, fp4_qat, trace, trace_all), `smoke` (a few steps of everything, for
tests), `gpu` (a 12-layer, d_model-512, 16-expert policy and larger batches, for one H200:
`configs/reasoning.py:gpu,trace_all`), and any key=value, e.g. `rl.correction=tis`. All keys:
trace_jax/rl/defaults.py.
"""

from trace_jax.rl.defaults import VARIANTS, config

__all__ = ["VARIANTS", "get_config"]


def get_config(arg=None):
  return config({}, arg)
