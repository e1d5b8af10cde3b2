"""The trainer's optimizer: AdamW with clipping, the warm start's and RL's learning rates."""

import jax.numpy as jnp
import numpy as np

from trace_jax.rl.trainer import make_optimizer


def test_the_warm_start_ramps_its_learning_rate_over_its_warmup_steps():
  """sft.warmup_steps: the warm start's learning rate rises linearly to sft.lr over its first
  steps (lr x (step + 1) / warmup), then stays; RL takes rl.lr. Adam's step on a constant
  gradient is the learning rate times its sign, so the updates show the schedule."""
  lr_sft, lr_rl, warmup, sft_steps = 1e-2, 1e-3, 4, 6
  opt = make_optimizer(lr_sft, lr_rl, sft_steps, sft_warmup=warmup)
  params = {"w": jnp.zeros(3)}
  state, grads, steps = opt.init(params), {"w": jnp.array([0.1, -0.2, 0.3])}, []
  for _ in range(sft_steps + 2):
    updates, state = opt.update(grads, state, params)
    steps.append(float(jnp.abs(updates["w"]).mean()))
  expected = [lr_sft * min(1, (k + 1) / warmup) for k in range(sft_steps)] + [lr_rl] * 2
  np.testing.assert_allclose(steps, expected, rtol=1e-3)
  flat = make_optimizer(lr_sft, lr_rl, sft_steps)  # no warmup: sft.lr from the first step
  updates, _ = flat.update(grads, flat.init(params), params)
  np.testing.assert_allclose(float(jnp.abs(updates["w"]).mean()), lr_sft, rtol=1e-3)
