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


def test_moe_mid_flip_rates_compare_codes_of_the_same_expert():
  """moe_mid codes are per (token, expert slot): where the two paths' top-k differ, slot j of one
  holds another expert than slot j of the other. Rollout {2, 3}, trainer {1, 2} (ascending ids):
  expert 2 is the rollout's slot 0 and the trainer's slot 1; experts 3 and 1 have no
  counterpart (a route flip, not a code flip)."""
  import jax.numpy as jnp
  import pytest
  from trace_jax.models import QuantRecipe, tiny
  cfg = tiny(n_layers=1)
  recipe = QuantRecipe.uniform("mxfp4")
  a, b, c = (np.full((32,), v, np.uint8) for v in (1, 5, 3))
  codes_r = {0: {"moe_mid": jnp.asarray(np.stack([a, b])[None, None])}}  # [B, T, k, F]
  codes_t = {0: {"moe_mid": jnp.asarray(np.stack([c, a])[None, None])}}
  routes_r = jnp.asarray([[[[2, 3]]]], jnp.uint8)  # [layers, B, T, k]
  routes_t = jnp.asarray([[[[1, 2]]]], jnp.uint8)
  mask = jnp.ones((1, 1), bool)
  f = M.flip_rates(cfg, recipe, codes_r, codes_t, mask, routes_rollout=routes_r,
                   routes_train=routes_t)
  assert f["mismatch/flip_rate/moe_mid/layer_0"] == 0.0 and f["mismatch/flip_rate"] == 0.0
  codes_t = {0: {"moe_mid": jnp.asarray(np.stack([c, b])[None, None])}}  # expert 2: a -> b
  f = M.flip_rates(cfg, recipe, codes_r, codes_t, mask, routes_rollout=routes_r,
                   routes_train=routes_t)
  assert f["mismatch/flip_rate/moe_mid/layer_0"] == 1.0  # 32 of expert 2's 32 codes
  with pytest.raises(ValueError, match="moe_mid codes are per expert slot"):
    M.flip_rates(cfg, recipe, codes_r, codes_t, mask)
