"""Layers scanned (one lax.scan per run of layers alike) compute what layers unrolled compute:
the trainer's log-probs, codes and routes, the engine's tokens, records and cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax import quant
from trace_jax.models import QuantRecipe, init_params, pack_weights, parse_layers, stacks, tiny
from trace_jax.models.qwen3_moe import forward
from trace_jax.models.rollout_path import RolloutPath
from trace_jax.rl import metrics as M
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts
from trace_jax.rl.trainer import mode_setup

PROMPTS = [[5, 6, 7, 8, 9], [12, 13], [14, 15, 16]]
N_LAYERS = 4  # records last:1 leaves a run of three layers: a real scan, not one inlined step


def same(a, b):
  """Bit for bit: the same tree, shapes, dtypes and bytes."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes(), np.abs(x.astype(float) - y.astype(float)).max()


@functools.lru_cache(maxsize=None)
def rollout(precision):
  cfg = tiny(n_layers=N_LAYERS)
  params = init_params(cfg, jax.random.PRNGKey(0), groups=(3, 1))
  recipe = QuantRecipe.uniform(precision)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=6), records="all",
                         collect_codes=True, attn_chunk=16)
  tokens, lengths = pad_prompts(PROMPTS)
  batch = engine.generate(pack_weights(cfg, params, recipe), tokens, lengths,
                          jax.random.PRNGKey(3))
  return cfg, params, recipe, batch


def recomputed(precision, records, scan):
  cfg, params, recipe, b = rollout(precision)
  kept = {i: b.records[i] for i in parse_layers(records, N_LAYERS) if i in b.records}

  @jax.jit
  def run(params, replay):  # replay traced: one program for both settings
    return recompute(cfg, params, b.tokens, b.valid, recipe, records=kept, routes=b.routes,
                     rollout_routes=b.routes, replay=replay, collect_codes=True, scan=scan)

  return [run(params, jnp.asarray(r)) for r in (False, True)]


@pytest.mark.parametrize("precision,records", [
    ("bf16", "last:1"), ("bf16", "all"), ("mxfp4", "last:1"),
    *(pytest.param(p, r, marks=pytest.mark.slow)
      for p, r in (("mxfp4", "all"), ("nvfp4", "last:1"), ("nvfp4", "all")))])
def test_the_scanned_trainer_computes_what_the_unrolled_one_does(precision, records):
  """Log-probs, aux loss, codes and routes, routing replay off and on, bit for bit."""
  for scanned, unrolled in zip(recomputed(precision, records, True),
                               recomputed(precision, records, False)):
    same(scanned, unrolled)
    assert scanned.routes.shape[0] == N_LAYERS
    if precision != "bf16":
      assert sorted(scanned.codes) == list(range(N_LAYERS))


def grads(scan, remat, groups=(3, 1)):
  cfg, params, recipe, b = rollout("mxfp4")
  params = {**params, "layers": stacks.regroup(params["layers"], groups)}
  kept = {N_LAYERS - 1: b.records[N_LAYERS - 1]}

  def loss(params):
    out = recompute(cfg, params, b.tokens, b.valid, recipe, records=kept, routes=b.routes,
                    rollout_routes=b.routes, scan=scan, remat=remat)
    return jnp.sum(jnp.where(b.response_mask, out.logp, 0.0)) + 1e-3 * out.aux_loss

  g = jax.jit(jax.grad(loss))(params)
  return {**g, "layers": stacks.unstack(g["layers"])}


def close(a, b):
  """Equal up to the order of float32 sums: each element within one bf16 step of the other
  (a weight gradient is a bf16 dot's, rounded), and few elements differing at all."""
  differ = total = 0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(y), 1e-30))) - 7)
    assert (np.abs(x - y) <= step).all()
    differ, total = differ + int((x != y).sum()), total + x.size
  assert differ <= 1e-3 * total


def test_gradients_match_with_and_without_scan_and_remat():
  """The values are the same, and so are the gradients up to the order of float32 sums: XLA
  may compile a dot inside a loop (or recomputed in the backward pass) otherwise than the same
  dot unrolled, and a gradient rounded to bf16 then lands a bf16 step away (seen on CPU with 8
  devices: a handful of elements in the whole model; often none)."""
  scanned = grads(True, False)
  close(grads(True, True), scanned)
  close(grads(False, False), scanned)


def test_the_trainer_scans_stored_stacks_in_place():
  """With the params grouped as the mode runs them no program copies them (its temporaries are
  less than the layers' bytes: one layer's fake-quantized weights at a time); one stack that
  the records' boundary splits is copied where a run scans a part of it (XLA inlines a scan of
  one layer, which reads its slice in place)."""
  cfg = tiny(n_layers=4, d_model=128, d_ff=128, n_experts=8)
  setup = mode_setup("trace", "mxfp4", "last:1")
  groups = setup.layer_groups(cfg.n_layers)
  assert groups == (3, 1)
  tokens = jnp.zeros((1, 5), jnp.int32)
  t, kv = 4, (cfg.n_kv_heads, cfg.head_dim)
  shapes = {"attn_in": (cfg.d_model,), "attn_out": (cfg.q_dim,), "moe_in": (cfg.d_model,),
            "moe_mid": (cfg.top_k, cfg.d_ff), "k": kv, "v": kv}
  records = {i: {site: quant.make_record(quant.quantize(jnp.zeros((1, t) + shape, jnp.bfloat16),
                                                        quant.MXFP4))
                 for site, shape in shapes.items()} for i in (3,)}
  routes = jnp.zeros((cfg.n_layers, 1, t, cfg.top_k), jnp.uint8)

  def temp_bytes(groups):
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), groups))
    fn = jax.jit(lambda p: recompute(cfg, p, tokens, tokens == 0, setup.train, records=records,
                                     rollout_routes=routes).logp)
    layer_bytes = sum(a.size * 4 for a in jax.tree.leaves(params["layers"]))
    return fn.lower(params).compile().memory_analysis().temp_size_in_bytes, layer_bytes

  grouped, layer_bytes = temp_bytes(groups)
  split, _ = temp_bytes(None)
  assert grouped < layer_bytes and split - grouped > 0.7 * layer_bytes  # 3 of 4 layers copied


def engine_setup():
  cfg = tiny(n_layers=3)
  params = init_params(cfg, jax.random.PRNGKey(0), groups=(2, 1))
  recipe = QuantRecipe.parse("mxfp4; layers=2,weights=nvfp4")  # runs [0, 2), [2, 3)
  tokens, lengths = pad_prompts(PROMPTS)
  return cfg, params, recipe, tokens, lengths


def test_the_prefill_scanned_writes_what_it_writes_unrolled():
  """Logits, records, codes, routes and the new cache, bit for bit."""
  cfg, params, recipe, tokens, lengths = engine_setup()
  b, p = tokens.shape
  pad = p - jnp.asarray(lengths)
  valid = jnp.arange(16)[None, :] >= pad[:, None]
  pos = jnp.maximum(jnp.arange(p)[None, :] - pad[:, None], 0)
  path = lambda: RolloutPath(cfg, recipe, None, 0, jnp.broadcast_to(jnp.arange(p), (b, p)),
                             valid, (2,), 16, collect_codes=True)
  run = lambda scan: jax.jit(lambda w: forward(cfg, w, tokens, pos, path(), scan=scan))(
      pack_weights(cfg, params, recipe))
  same(run(True), run(False))


def episode(scan_decode, stacked, multi_turn):
  """A rollout: prefill, sampled tokens; `multi_turn`: then an observation (extend) and more
  sampled tokens."""
  cfg, params, recipe, tokens, lengths = engine_setup()
  b, p = tokens.shape
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=4), records="last:1",
                         collect_codes=multi_turn, attn_chunk=16, scan_decode=scan_decode)
  w = pack_weights(cfg, params, recipe, stacked=stacked)
  state = engine.start(w, tokens, lengths, jax.random.PRNGKey(5), total=p + 8)
  state = engine.run(w, state, p + (2 if multi_turn else 7))
  if multi_turn:
    state = engine.extend(w, state, jnp.full((b, 2), 9, jnp.int32))
    state = engine.run(w, state, p + 7)
  out = engine.finish(state, p)
  return out.tokens, out.logp, out.records, out.codes, out.routes


@pytest.mark.slow  # the scanned decode (engine.scan_decode) is off by default: 1-2 min of CPU
def test_a_scanned_decode_step_samples_what_the_unrolled_one_does():
  """Stacked weights and a cache stacked per run, across a recipe whose runs split the layers:
  the same tokens, log-probs, records, codes and routes."""
  same(episode(True, True, False), episode(False, False, False))


@pytest.mark.slow
@pytest.mark.parametrize("stacked", [True, False])
def test_a_scanned_decode_step_extends_and_reads_per_layer_weights_too(stacked):
  same(episode(True, stacked, True), episode(False, False, True))


def test_the_fused_attention_keeps_what_the_records_guarantee():
  """`rl.attention=fused`: with the trainer's attention computed otherwise
  (jax.nn.dot_product_attention; its values against the full attention's:
  tests/models/test_model.py), every layer's records and the rollout's routes still make the
  trainer's codes the rollout's at every site."""
  cfg, params, recipe, b = rollout("mxfp4")
  fused = jax.jit(functools.partial(
      recompute, cfg, recipe=recipe, records=dict(b.records), routes=b.routes,
      rollout_routes=b.routes, collect_codes=True, attention="fused"))(params, b.tokens, b.valid)
  flips = M.flip_rates(cfg, recipe, b.codes, fused.codes, b.response_mask[:, 1:],
                       routes_rollout=b.routes, routes_train=fused.routes)
  assert flips["mismatch/flip_rate"] == 0.0 and all(v == 0.0 for v in flips.values())
  with pytest.raises(ValueError, match=r"attention='flash': choose one of \('full', 'fused'\)"):
    recompute(cfg, params, b.tokens, b.valid, recipe, attention="flash")
