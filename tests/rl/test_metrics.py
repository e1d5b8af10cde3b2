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


def _site_codes(n_layers, b, t):
  """Code shapes of every site of a layer (the `gpu` policy's widths), as abstract arrays."""
  import jax
  import jax.numpy as jnp
  shapes = {"attn_in": (b, t, 512), "attn_out": (b, t, 512), "moe_in": (b, t, 512),
            "moe_mid": (b, t, 2, 512), "k": (b, t, 2, 64), "v": (b, t, 2, 64)}
  codes = {layer: {site: jax.ShapeDtypeStruct(shape, jnp.uint8) for site, shape in shapes.items()}
           for layer in range(n_layers)}
  return codes, sum(int(np.prod(s)) for s in shapes.values())


def test_flip_counts_need_no_memory_that_grows_with_the_codes(monkeypatch):
  """The long-horizon `gpu` run's RL step stopped asking for 19.75 GiB in the flip counts of 128
  episodes of 1 539 positions (12 layers): every site's comparison was kept at once, 4 bytes a
  code of every layer. The counts' scratch memory stays within a chunk of positions
  (`FLIP_CHUNK` codes, here 2^22) however many rows, positions and layers are compared: 8
  layers of 32 rows are 92M codes a path (369 MB at 4 bytes a code)."""
  import jax
  import jax.numpy as jnp
  from trace_jax.models import QuantRecipe, tiny
  monkeypatch.setattr(M, "FLIP_CHUNK", 2**22)
  recipe = QuantRecipe.uniform("mxfp4")
  b, t = 32, 128
  for n in (1, 8):
    codes, per_layer = _site_codes(n, b, t)
    routes = jax.ShapeDtypeStruct((n, b, t, 2), jnp.uint8)
    compiled = jax.jit(M.flip_counts, static_argnums=(0, 1)).lower(
        tiny(n_layers=n), recipe, codes, codes, jax.ShapeDtypeStruct((b, t), bool), routes,
        routes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert n * per_layer > 2 * 2**22 and temp <= 1.5 * 4 * 2**22, (n, temp)


def test_flip_counts_are_exact_past_float32s_integers():
  """A site of more than 2^24 compared codes (one rollout's moe_mid codes at 128 x 1 539
  positions: 2e8) counts every one of them: one flip in 4097 x 4097 codes is that rate."""
  import jax.numpy as jnp
  from trace_jax.models import QuantRecipe, tiny
  n = 4097
  codes_r = np.zeros((1, n, n), np.uint8)
  codes_t = codes_r.copy()
  codes_t[0, 5, 7] = 3
  f = M.flip_rates(tiny(n_layers=1), QuantRecipe.uniform("mxfp4"),
                   {0: {"attn_in": jnp.asarray(codes_r)}}, {0: {"attn_in": jnp.asarray(codes_t)}},
                   jnp.ones((1, n), bool))
  assert n * n > 2**24 and f["mismatch/flip_rate"] == 1 / (n * n)


def test_flip_counts_by_chunks_are_the_counts_at_once(monkeypatch):
  """Positions compared a chunk at a time, the last chunk overlapping the one before (37
  positions in chunks of 5), count what one chunk of every position counts, per site, row and
  position, moe_mid's expert matching included."""
  import jax.numpy as jnp
  from trace_jax.models import QuantRecipe, tiny
  rng = np.random.default_rng(0)
  b, t, layers = 3, 37, 2
  shapes = {"attn_in": (b, t, 8), "moe_mid": (b, t, 2, 4), "k": (b, t, 2, 4)}
  codes = lambda: {layer: {s: jnp.asarray(rng.integers(0, 3, shape, np.uint8))
                           for s, shape in shapes.items()} for layer in range(layers)}
  routes = lambda: jnp.asarray(np.sort(rng.choice(4, (layers, b, t, 2)), axis=-1), jnp.uint8)
  args = (tiny(n_layers=layers), QuantRecipe.uniform("mxfp4"), codes(), codes(),
          jnp.asarray(rng.random((b, t)) < 0.8), routes(), routes())
  counts = {}
  for chunk in (2**30, 5 * sum(int(np.prod(s[::2])) for s in shapes.values()) * layers):
    monkeypatch.setattr(M, "FLIP_CHUNK", chunk)
    counts[chunk] = {k: np.asarray(v) for k, v in M.flip_counts(*args).items()}
  once, chunked = counts.values()
  assert once.keys() == chunked.keys() and once["flips_SxB"].sum() > 0
  for k in once:
    np.testing.assert_array_equal(once[k], chunked[k], err_msg=k)
