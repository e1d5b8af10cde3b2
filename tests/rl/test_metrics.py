"""The mismatch metrics: what they compare, and what their numbers can resolve."""

import numpy as np

from trace_jax.rl import grpo
from trace_jax.rl import metrics as M
from trace_jax.rl.loop import format_summary


def test_the_kl_resolution_is_one_ulp_of_a_log_probability():
  lp = np.float32(-1.0)
  r = np.spacing(np.abs(lp))  # the smallest non-zero dlogp at logp = -1
  assert float(grpo.k3(np.float32(r))) == M.KL_RESOLUTION == r * r / 2


def test_the_summary_states_the_kl_floor():
  s = {"mode": "trace_all", "steps": 3, "reward_first": 0.1, "reward_last": 0.2,
       "eval_accuracy_before_rl": None, "eval_accuracy_after": 0.3, "mismatch_kl_k3": 3e-15,
       "flip_rate": 0.0, "route_flip_rate": 0.0, "rollout_tokens_per_s": 10.0,
       "record_bytes_per_token": 360.0}
  line = next(x for x in format_summary(s).splitlines() if "mismatch KL" in x)
  assert "3.00e-15" in line and "resolves 7e-15" in line, line
