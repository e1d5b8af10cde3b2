"""The mode's recipes checked against each other before any work: a recorded site guides the
trainer only in the format the rollout recorded it in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import reasoning
from tests.rl.test_rollout import policy
from trace_jax.rl.recompute import recompute
from trace_jax.rl.trainer import RLOptions, Trainer, make_optimizer, mode_setup
from trace_jax.rl.validate import validate


def config(*keys, rollout="", trainer=""):
  c = reasoning.get_config(",".join(("smoke", "mesh.data=1") + keys))
  # (set here, as --config.rl.rollout_recipe=... would: a variant string splits at commas)
  c.rl.rollout_recipe, c.rl.train_recipe = rollout, trainer
  return c


@pytest.mark.parametrize("keys,rollout,trainer,message", [
    # the review's case: an NVFP4 rollout records what an MXFP4 trainer would be guided by
    (("trace",), "nvfp4", "", r"layer 1 attn_in: the rollout records nvfp4, the trainer "
                              r"quantizes mxfp4"),
    (("trace_all",), "weights=mxfp4,acts=mxfp4,kv=mxfp4; layers=0,v=fp8", "",
     r"layer 0 v: the rollout records fp8, the trainer quantizes mxfp4"),
    # a recorded site the rollout leaves unquantized has no record to guide by
    (("trace_all",), "mxfp4; layers=1,acts=bf16", "", r"layer 1 attn_in: the rollout records "
                                                      r"nothing \(bf16\)"),
])
def test_a_recorded_site_in_two_formats_is_refused_by_name(keys, rollout, trainer, message):
  with pytest.raises(ValueError, match=message) as e:
    validate(config(*keys, rollout=rollout, trainer=trainer), n_devices=1)
  assert "\n" not in str(e.value) and "rl.rollout_recipe" in str(e.value)


@pytest.mark.parametrize("keys,rollout,trainer", [
    (("trace",), "weights=nvfp4,acts=mxfp4,kv=mxfp4", "weights=nvfp4,acts=mxfp4,kv=mxfp4"),
    # weights are not recorded: the trainer may hold them in another format
    (("trace_all",), "weights=nvfp4,acts=mxfp4,kv=mxfp4", ""),
    # a bf16 trainer uses no record
    (("trace_all", "rl.fp4=nvfp4"), "", "nvfp4; layers=1,bf16"),
    # nor where neither path quantizes
    (("trace_all",), "mxfp4; layers=1,bf16", "mxfp4; layers=1,bf16"),
    (("fp4_rollout",), "nvfp4", ""),
    (("fp4_qat",), "nvfp4", ""),  # no records
])
def test_consistent_recipes_pass(keys, rollout, trainer):
  validate(config(*keys, rollout=rollout, trainer=trainer), n_devices=1)


def test_a_recorded_layer_without_records_rounds_to_nearest():
  """A recorded layer the rollout leaves unquantized has no records (the rollout emits none
  there): the trainer rounds what it quantizes to nearest, as without records."""
  cfg, params = policy()
  spec = "mxfp4; layers=1,bf16"
  setup = mode_setup("trace", trace_layers="last:1", rollout_recipe=spec, train_recipe=spec)
  trainer = Trainer(cfg, setup, make_optimizer(1e-3, 1e-3, 1), RLOptions())
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  routes = jnp.zeros((cfg.n_layers, 2, 11, cfg.top_k), jnp.uint8)
  batch = {"tokens": tokens, "valid": valid, "records": {}, "routes": routes}
  out = jax.jit(trainer._forward)(params, batch)
  want = jax.jit(functools.partial(recompute, cfg, recipe=setup.train))(params, tokens, valid)
  np.testing.assert_array_equal(np.asarray(out.logp), np.asarray(want.logp))


@pytest.mark.parametrize("warmup", [-1, 7])
def test_warmup_steps_outside_the_warm_start_are_refused(warmup):
  c = config("trace", "sft.steps=6", f"sft.warmup_steps={warmup}")
  with pytest.raises(ValueError, match=rf"sft.warmup_steps \({warmup}\) must be within 0 and "
                                       r"sft.steps \(6\)"):
    validate(c, n_devices=1)


def test_the_warm_start_and_rl_each_take_their_own_attention(monkeypatch):
  """sft.attention computes the warm start's loss, rl.attention the GRPO step's; a name
  outside layers.ATTENTIONS is refused by its key before any work."""
  from trace_jax.models import layers as L
  called = []
  for name, attend in list(L.ATTENTIONS.items()):
    def spy(*args, name=name, attend=attend):
      called.append(name)
      return attend(*args)
    monkeypatch.setitem(L.ATTENTIONS, name, spy)
  cfg, params = policy()
  setup = mode_setup("bf16")
  trainer = Trainer(cfg, setup, make_optimizer(1e-3, 1e-3, 1),
                    RLOptions(attention="full", sft_attention="fused"))
  tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 12), 0, cfg.vocab_size)
  valid = jnp.ones(tokens.shape, bool)
  state = trainer.init_state(jax.tree.map(jnp.copy, params))  # the step donates it
  trainer.sft_step(state, {"tokens": tokens, "valid": valid, "loss_mask": valid})
  assert set(called) == {"fused"}
  called.clear()
  routes = jnp.zeros((cfg.n_layers, 2, 11, cfg.top_k), jnp.uint8)
  jax.jit(trainer._forward)(params, {"tokens": tokens, "valid": valid, "records": {},
                                     "routes": routes})
  assert set(called) == {"full"}
  with pytest.raises(ValueError, match=r"sft.attention='flash': choose one of .*'full'"):
    validate(config("trace", "sft.attention=flash"), n_devices=1)
