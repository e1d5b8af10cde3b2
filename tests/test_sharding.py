"""Rollout and training on 8 fake CPU devices give what one device gives."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import sharding as S
from trace_jax.models import QuantRecipe, init_params, pack_weights, tiny
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices; "
                                "tests/conftest.py sets them up unless JAX was imported first")

PROMPTS = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [3], [5, 5, 5, 5], [9, 8], [7, 7, 7], [1, 1]]


@pytest.mark.parametrize("precision", [pytest.param("bf16", marks=pytest.mark.slow), "mxfp4"])
def test_rollout_and_training_sharded_match_one_device(precision):
  cfg = tiny()
  params = init_params(cfg, jax.random.PRNGKey(0))
  recipe = QuantRecipe.uniform(precision)
  weights = pack_weights(cfg, params, recipe)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=20), records="all",
                         attn_chunk=16)
  prompts, lengths = pad_prompts(PROMPTS)
  key = jax.random.PRNGKey(3)
  one = engine.generate(weights, prompts, lengths, key)

  # 4 sequences a device: XLA's CPU backend gives a dot of one row to its own emitter, not
  # YNNPACK, so a device holding one sequence would part from one device by float32 rounding
  mesh = S.make_mesh(data=2, expert=4)
  w_sh = S.place(weights, S.param_shardings(weights, mesh, S.ROLLOUT_RULES))
  expert_leaf = jax.tree.leaves(w_sh.layers[0]["w_gate"])[0]
  assert expert_leaf.sharding.spec[0] == "expert"
  inputs = S.place((jnp.asarray(prompts), jnp.asarray(lengths)),
                   S.batch_shardings((prompts, lengths), mesh, S.ROLLOUT_RULES))
  many = engine.generate(w_sh, *inputs, key)
  assert many.tokens.sharding.spec[0] == "data"
  np.testing.assert_array_equal(np.asarray(many.tokens), np.asarray(one.tokens))
  np.testing.assert_array_equal(np.asarray(many.logp), np.asarray(one.logp))
  for a, b in zip(jax.tree.leaves(many.records), jax.tree.leaves(one.records)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  train = jax.jit(functools.partial(recompute, cfg, recipe=recipe))
  ref = train(params, one.tokens, one.valid, records=one.records, routes=one.routes)
  p_sh = S.place(params, S.param_shardings(params, mesh, S.TRAIN_RULES))
  batch = S.place((one.tokens, one.valid, one.records),
                  S.batch_shardings((one.tokens, one.valid, one.records), mesh, S.TRAIN_RULES))
  routes = S.place(one.routes, S.batch_shardings(one.routes, mesh, S.TRAIN_RULES, batch_axis=1))
  out = train(p_sh, *batch[:2], records=batch[2], routes=routes)
  assert out.logp.sharding.spec[0] == ("data", "expert")
  # one sequence per device changes XLA's reduction order in norms and softmax (float32 sums
  # agree to ~1e-6); in bf16 that is at most an ulp of a logit
  np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), atol=0.05)
  assert np.abs(np.asarray(out.logp) - np.asarray(ref.logp)).mean() < 5e-3


def test_training_sharded_float32_agrees_to_rounding():
  cfg = tiny(dtype="float32")
  params = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  train = jax.jit(functools.partial(recompute, cfg))
  ref = train(params, tokens, valid)
  mesh = S.make_mesh(data=2, expert=4)
  out = train(S.place(params, S.param_shardings(params, mesh, S.TRAIN_RULES)),
              *S.place((tokens, valid), S.batch_shardings((tokens, valid), mesh, S.TRAIN_RULES)))
  np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), atol=1e-5)


def test_mesh_and_rule_errors():
  with pytest.raises(ValueError, match="data=3 x expert=4 needs 12 devices, have 8"):
    S.make_mesh(data=3, expert=4)
  sub = S.make_mesh(data=2, expert=1)  # a mesh over the first devices only
  assert sub.devices.shape == (2, 1) and list(sub.devices.flat) == jax.devices()[:2]
  mesh = S.make_mesh(data=2, expert=4)
  with pytest.raises(ValueError, match="batch of 6 does not split.*size 8"):
    S.batch_shardings(jnp.zeros((6, 3)), mesh, S.TRAIN_RULES)
  cfg = tiny(n_experts=6)
  params = init_params(cfg, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"layers/0/w_\w+: 6 experts do not split over mesh axis 'expert' of size 4"):
    S.param_shardings(params, mesh, S.TRAIN_RULES)


def test_a_layout_puts_a_process_rows_and_brings_them_back():
  # one process holds every row; tests/test_distributed.py runs two, each with its half
  mesh = S.make_mesh(data=2, expert=4)
  rollout, train = S.Layout(mesh, S.ROLLOUT_RULES), S.Layout(mesh, S.TRAIN_RULES)
  x = np.arange(16 * 3).reshape(16, 3)
  assert rollout.rows(16) == train.rows(16) == slice(0, 16)
  placed = train.put({"x": x}, 16)["x"]
  assert placed.sharding.spec[0] == ("data", "expert") and len(placed.addressable_shards) == 8
  np.testing.assert_array_equal(train.local(placed), x)
  np.testing.assert_array_equal(rollout.gather(x, 16), x)
  np.testing.assert_array_equal(S.fetch(placed), x)
  with pytest.raises(ValueError, match="batch of 6 does not split.*size 8"):
    train.rows(6)
  none = S.Layout(None, {})  # no mesh: the host's arrays, as they are
  assert none.put(x, 16) is x and none.rows(16) == slice(0, 16)


def test_weights_the_kernels_pack_as_one_shard_as_theirs_would():
  """A rollout weight the kernels' weight sync packs from several (`Fused`, named by theirs
  joined by +) shards as they do: the experts' gate and up over the expert axis, q, k and v
  replicated."""
  from jax.sharding import PartitionSpec as P

  from pallas_kernels import dispatch
  cfg = tiny()
  weights = pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)),
                         QuantRecipe.uniform("mxfp4"), ops=dispatch.make_ops("pallas"))
  specs = S.param_logical_specs(weights).layers[0]
  leaves = lambda name: jax.tree.leaves(specs[name], is_leaf=lambda s: isinstance(s, P))
  assert leaves("w_gate+w_up") and all(s[0] == "experts" for s in leaves("w_gate+w_up"))
  assert all(s[0] == "experts" for s in leaves("w_down"))
  assert leaves("wq+wk+wv") and not any("experts" in s for s in leaves("wq+wk+wv"))
  mesh = S.make_mesh(data=2, expert=4)
  placed = S.place(weights, S.param_shardings(weights, mesh, S.ROLLOUT_RULES))
  assert jax.tree.leaves(placed.layers[0]["w_gate+w_up"])[0].sharding.spec[0] == "expert"
