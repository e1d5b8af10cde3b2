"""moe_mid records follow experts: without routing replay the trainer's top-k can differ from
the rollout's, and a record guides only the slots whose expert the rollout chose."""

import jax
import numpy as np
import pytest

from tests.rl.test_rollout import rollout, train
from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.rl import metrics as M
from trace_jax.rl.trainer import RLOptions, Trainer, make_optimizer, mode_setup


def _drift_last_router(params, eps=0.02):
  """The rollout's params with the last layer's router nudged: a trainer whose top-k differs
  from the rollout's for some tokens (the random init's router is close to uniform), with every
  value before that layer's experts the same."""
  layers = stacks.unstack(params["layers"])
  last = dict(layers[-1])
  last["router"] = last["router"] + eps * jax.random.normal(jax.random.PRNGKey(3),
                                                            last["router"].shape)
  return {**params, "layers": stacks.stack(layers[:-1] + [last])}


@pytest.mark.parametrize("precision", ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_moe_mid_records_follow_the_experts_when_routes_differ(precision):
  """Without routing replay a moe_mid record guides only the trainer's slots whose expert the
  rollout also chose for that token, with that expert's record (the slot can differ); the
  other slots round to nearest, and the trainer's step passes the rollout's routes."""
  cfg, params, recipe, b = rollout(precision)
  drifted, last = _drift_last_router(params), cfg.n_layers - 1
  predicts = b.response_mask[:, 1:]
  guided = train(cfg, drifted, recipe, b, records=b.records, rollout_routes=b.routes)
  assert M.route_flip_rate(b.routes[last:], guided.routes[last:], predicts) > 0.05
  matched, src = (np.asarray(a) for a in L.match_experts(guided.routes[last], b.routes[last]))
  sel = matched & np.asarray(predicts)[..., None]
  assert (sel & (src != np.arange(cfg.top_k))).any()  # the same expert in another slot
  assert (~matched & np.asarray(predicts)[..., None]).any()  # and experts the rollout lacks
  # matching slots take the rollout's codes of their expert (-0 and +0 are one code)
  canon = lambda c: np.where(np.asarray(c) == 8, 0, np.asarray(c))
  want = np.take_along_axis(canon(b.codes[last]["moe_mid"]), src[..., None], axis=2)
  got = canon(guided.codes[last]["moe_mid"])
  np.testing.assert_array_equal(got[sel], want[sel])
  # the other slots round to nearest: as without that site's record
  records = {i: dict(sites) for i, sites in b.records.items()}
  del records[last]["moe_mid"]
  rtn = train(cfg, drifted, recipe, b, records=records, rollout_routes=b.routes)
  np.testing.assert_array_equal(got[~matched], canon(rtn.codes[last]["moe_mid"])[~matched])
  # no site flips more than unguided; with codes compared expert by expert, none flips
  plain = train(cfg, drifted, recipe, b)
  rates = lambda o: M.flip_rates(cfg, recipe, b.codes, o.codes, predicts, routes_rollout=b.routes,
                                 routes_train=o.routes)
  f_guided, f_plain = rates(guided), rates(plain)
  assert f_plain["mismatch/flip_rate"] > 0.01
  assert all(v == 0.0 for k, v in f_guided.items()), f_guided
  # the trainer's step computes exactly this
  trainer = Trainer(cfg, mode_setup("trace_all", precision), make_optimizer(1e-3, 1e-3, 1),
                    RLOptions())
  batch = {"tokens": b.tokens, "valid": b.valid, "records": b.records, "routes": b.routes}
  step = jax.jit(trainer._forward)(drifted, batch)
  np.testing.assert_array_equal(np.asarray(step.logp), np.asarray(guided.logp))


def test_moe_mid_records_need_the_rollouts_routes():
  cfg, params, recipe, b = rollout("mxfp4")
  with pytest.raises(ValueError, match="moe_mid records.*rollout's routes"):
    train(cfg, params, recipe, b, records=b.records)
