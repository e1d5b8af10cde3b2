"""The rollout engine against the training path: KV cache, sampling, records, routing replay."""

import functools
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.models import QuantRecipe, SITES, init_params, logits, pack_weights, tiny
from trace_jax.models.rollout_path import unpack
from trace_jax.models.recipe import WEIGHT_AXES
from trace_jax.rl import metrics as M
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts, sample

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [3]]


@functools.lru_cache(maxsize=None)
def policy(dtype="bfloat16", n_layers=2):
  cfg = tiny(dtype=dtype, n_layers=n_layers)
  return cfg, init_params(cfg, jax.random.PRNGKey(0))


@functools.lru_cache(maxsize=None)
def rollout(precision, records="all", dtype="bfloat16", new=24, temperature=1.0, stops=()):
  cfg, params = policy(dtype)
  recipe = QuantRecipe.uniform(precision)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=new, temperature=temperature,
                                                     stop_tokens=stops),
                         records=records, collect_codes=True, attn_chunk=16)
  tokens, lengths = pad_prompts(PROMPTS)
  batch = engine.generate(pack_weights(cfg, params, recipe), tokens, lengths,
                          jax.random.PRNGKey(7))
  return cfg, params, recipe, batch


def train(cfg, params, recipe, batch, records=None, routes=None, rollout_routes=None):
  return jax.jit(functools.partial(recompute, cfg, recipe=recipe, collect_codes=True))(
      params, batch.tokens, batch.valid, records=records, routes=routes,
      rollout_routes=rollout_routes)


def test_batch_layout():
  cfg, _, _, b = rollout("mxfp4")
  p, total = b.prompt_width, b.tokens.shape[1]
  assert p == 7 and total == 7 + 24
  np.testing.assert_array_equal(np.asarray(b.valid[:, :p]).sum(1), [len(q) for q in PROMPTS])
  np.testing.assert_array_equal(np.asarray(b.tokens[1, 5:7]), [12, 13])
  assert not np.asarray(b.response_mask[:, :p]).any() and np.asarray(b.response_mask[:, p:]).all()
  assert (np.asarray(b.logp)[:, p:] < 0).all() and (np.asarray(b.logp)[:, :p] == 0).all()
  # records cover every position the trainer recomputes, for every site of every layer
  assert set(b.records) == set(range(cfg.n_layers)) and set(b.records[0]) == set(SITES)
  assert b.records[0]["attn_in"].mant.shape == (4, total - 1, cfg.d_model // 8)
  assert b.records[1]["moe_mid"].scales.shape == (4, total - 1, cfg.top_k, cfg.d_ff // 32)
  assert b.records[1]["k"].mant.shape == (4, total - 1, cfg.n_kv_heads, cfg.head_dim // 8)
  assert b.routes.shape == (cfg.n_layers, 4, total - 1, cfg.top_k) and b.routes.dtype == jnp.uint8


@pytest.mark.parametrize("dtype,tol", [("float32", 2e-4), ("bfloat16", 0.1)])
def test_without_quantization_decode_matches_the_full_forward(dtype, tol):
  """float32 runs its dots at float32 precision: a GPU's default for them is TF32 (10 mantissa
  bits), whose rounding alone moves the log-probabilities past the tolerance."""
  with jax.default_matmul_precision("highest" if dtype == "float32" else None):
    _decode_matches_the_full_forward(dtype, tol)


def _decode_matches_the_full_forward(dtype, tol):
  cfg, params, recipe, b = rollout("bf16", records="none", dtype=dtype)
  out = train(cfg, params, recipe, b)
  mask = np.asarray(b.response_mask)
  diff = np.abs(np.asarray(out.logp) - np.asarray(b.logp))[mask]
  assert diff.max() < tol, diff.max()
  if dtype == "float32":  # the greedy decode is the argmax of the teacher-forced logits
    _, _, _, g = rollout("bf16", records="none", dtype=dtype, temperature=0.0)
    full = np.asarray(logits(cfg, params, g.tokens))
    p = g.prompt_width
    for row in range(len(PROMPTS)):
      pad = p - len(PROMPTS[row])
      ref = np.asarray(logits(cfg, params, g.tokens[row:row + 1, pad:]))[0]
      np.testing.assert_array_equal(np.asarray(g.tokens[row, p:]), ref[p - pad - 1:-1].argmax(-1))
    assert full.shape[1] == g.tokens.shape[1]


# nvfp4 in the slow run: its rounding is tested bit for bit in tests/quant, the engine's records
# path is the same for both formats
@pytest.mark.parametrize("precision", ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_records_for_all_layers_make_recorded_sites_flip_free(precision):
  cfg, params, recipe, b = rollout(precision)
  predicts = b.response_mask[:, 1:]
  plain = train(cfg, params, recipe, b)
  guided = train(cfg, params, recipe, b, records=b.records, routes=b.routes)
  rates = lambda o: M.flip_rates(cfg, recipe, b.codes, o.codes, predicts, routes_rollout=b.routes,
                                 routes_train=o.routes)
  f_plain, f_guided = rates(plain), rates(guided)
  assert f_plain["mismatch/flip_rate"] > 0.01
  assert f_guided["mismatch/flip_rate"] == 0.0
  assert all(v == 0.0 for v in f_guided.values())
  kl = lambda o: M.logp_mismatch(b.logp, o.logp, b.response_mask)["mismatch/kl_k3"]
  assert kl(guided) < 0.1 * kl(plain)
  # without routing replay the experts may differ, and only the moe_mid records can go stale
  no_replay = train(cfg, params, recipe, b, records=b.records, rollout_routes=b.routes)
  f = rates(no_replay)
  assert all(v == 0.0 for v in f.values())


def test_routing_replay_uses_the_rollouts_experts():
  cfg, params, recipe, b = rollout("mxfp4")
  out = train(cfg, params, recipe, b, routes=b.routes)
  assert M.route_flip_rate(b.routes, out.routes, b.response_mask[:, 1:]) == 0.0
  np.testing.assert_array_equal(np.asarray(out.routes), np.asarray(b.routes))


@pytest.mark.parametrize("precision,bits", [("mxfp4", 1.25), ("nvfp4", 1.5)])
def test_record_sizes(precision, bits):
  cfg, _, _, b = rollout(precision)
  positions = b.tokens.shape[0] * (b.tokens.shape[1] - 1)
  per_layer = (2 * cfg.d_model + cfg.q_dim + cfg.top_k * cfg.d_ff + 2 * cfg.kv_dim) * bits / 8
  if precision == "nvfp4":  # plus a float32 global per row: 3 token rows, k slots, 2 x K heads
    per_layer += 4 * (3 + cfg.top_k + 2 * cfg.n_kv_heads)
  assert M.record_bytes_per_token(b.records, positions) == pytest.approx(per_layer * cfg.n_layers)
  last = {1: b.records[1]}
  assert M.record_bytes_per_token(last, positions) == pytest.approx(per_layer)


def test_records_only_for_the_configured_layers():
  cfg, _, _, b = rollout("mxfp4", records="last:1")
  assert set(b.records) == {cfg.n_layers - 1}
  _, _, _, none = rollout("mxfp4", records="none")
  assert none.records == {}


@pytest.mark.parametrize("precision", ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_records_do_not_change_what_the_rollout_samples(precision):
  """Records observe the rollout, they do not perturb it: with records of no layer, of the last
  or of every layer the same sampled tokens and log-probabilities, bit for bit."""
  runs = [rollout(precision, records=r)[3] for r in ("none", "last:1", "all")]
  for b in runs[1:]:
    np.testing.assert_array_equal(b.tokens, runs[0].tokens)
    np.testing.assert_array_equal(b.logp, runs[0].logp)


def test_stop_tokens_and_max_new_tokens():
  _, _, _, b = rollout("bf16", records="none", temperature=0.0, new=16)
  greedy = np.asarray(b.tokens)[:, b.prompt_width:]
  stop = int(greedy[0, 3])  # a token the greedy decode emits: stop there
  _, _, _, s = rollout("bf16", records="none", temperature=0.0, new=16, stops=(stop,))
  toks, resp = np.asarray(s.tokens)[:, s.prompt_width:], np.asarray(s.response_mask)[:, s.prompt_width:]
  for row in range(len(PROMPTS)):
    hits = np.where(greedy[row] == stop)[0]
    end = hits[0] + 1 if len(hits) else 16
    assert resp[row].sum() == end and resp[row, :end].all()
    np.testing.assert_array_equal(toks[row, :end], greedy[row, :end])
    assert (toks[row, end:] == 0).all()


def test_sampling_temperature_and_top_p():
  logits_ = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 4000))
  keys = jax.random.PRNGKey(0)
  tok, lp = sample(keys, logits_, 1.0, 0.6)  # keeps the two tokens reaching 0.6 (0.5 + 0.3)
  counts = np.bincount(np.asarray(tok), minlength=4) / 4000
  assert counts[2] == counts[3] == 0 and abs(counts[0] - 0.625) < 0.03
  np.testing.assert_allclose(np.asarray(lp), np.log([0.5, 0.3, 0.15, 0.05])[np.asarray(tok)],
                             rtol=1e-5)
  tok, _ = sample(keys, logits_, 0.0, 1.0)
  assert (np.asarray(tok) == 0).all()
  with pytest.raises(ValueError, match="top_p"):
    SamplingConfig(top_p=0.0)


def test_top_p_with_a_rollout_correction_is_refused():
  """The rollout's log-probabilities are those of softmax(logits / temperature), the
  distribution the trainer recomputes; under top_p < 1 the tokens come from the renormalised
  nucleus, so tis / mis would weigh by a ratio against a distribution nothing sampled from."""
  from configs import reasoning
  from trace_jax.rl.validate import validate
  c = reasoning.get_config("smoke,mesh.data=1,rl.top_p=0.9,rl.correction=tis")
  with pytest.raises(ValueError, match=r"^rl.top_p=0.9 with rl.correction='tis': .*rl.top_p=1"):
    validate(c)
  c.rl.correction = "mis"
  with pytest.raises(ValueError, match="rl.correction='mis'"):
    validate(c)
  c.rl.correction = "none"
  validate(c)  # PPO's ratio and the mismatch metrics compare the same distribution
  c.rl.top_p, c.rl.correction = 1.0, "tis"
  validate(c)


def test_bad_prompts():
  with pytest.raises(ValueError, match="at least one token"):
    pad_prompts([[1, 2], []])
  cfg, params = policy()
  engine = RolloutEngine(cfg, QuantRecipe(), SamplingConfig(max_new_tokens=2))
  with pytest.raises(ValueError, match=r"\[B, P\].*\(2, 3\).*\(3,\)"):
    engine.generate(pack_weights(cfg, params, QuantRecipe()), np.ones((2, 3)), np.ones(3),
                    jax.random.PRNGKey(0))


def _kernel_rollouts(precision, max_new_tokens=6, backends=("xla", "pallas")):
  cfg, params = policy()
  recipe = QuantRecipe.uniform(precision)
  tokens, lengths = pad_prompts(PROMPTS)
  out = []
  for kernels in backends:
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    engine = RolloutEngine(cfg, recipe, sampling, records="all", attn_chunk=16, kernels=kernels)
    weights = pack_weights(cfg, params, recipe, ops=engine.ops)
    out.append(engine.generate(weights, tokens, lengths, jax.random.PRNGKey(7)))
  return out


# nvfp4 in the slow run: its kernels are compared with the reference in tests/pallas_kernels
@pytest.mark.parametrize("precision",
                         ["mxfp4", pytest.param("nvfp4", marks=pytest.mark.slow), "bf16"])
def test_pallas_kernels_compute_what_xla_computes(precision):
  """kernels="pallas", weights packed for the kernels (interpret mode here, the Triton kernels
  on the packed weights; compiled on a Hopper GPU, the Mosaic FP4 kernels on the tiled ones):
  FP4 weights and caches decode to the very bf16 values XLA's dequantization gives (NVFP4's
  global folded into each value first), and activations and K/V quantize to the quant core's
  codes and records bit for bit for the same input (tests/pallas_kernels), so only the order of
  float32 sums differs. In interpret mode the sums run in XLA's order while the cache is one
  attention block, as here (16 slots): every record is equal (past one block, see the next
  test).
  Compiled, another order can move a bf16 rounding, and past it an FP4 code, in a later layer:
  in one run on the H200 (NVFP4, this policy and seed) 1, 3 and 15 record bytes of three
  second-layer sites of 384-768 (at most 2%), the first layer's all equal, the same tokens and
  log-probabilities; the bounds below leave room for other GPUs' orders."""
  _assert_same_rollouts(*_kernel_rollouts(precision))


def test_the_norms_before_attention_and_experts_run_in_the_quantize_kernel(monkeypatch):
  """Under kernels="pallas" the RMSNorm before the attention and the one before the experts
  are computed by the quantize kernel of the site they feed (attn_in, moe_in), one call each a
  layer; the other sites' quantizations take no norm."""
  from pallas_kernels import dispatch
  calls = []
  quantize = dispatch.quantize_and_record

  def spy(x, fmt, **kw):
    calls.append((x.shape[-1], kw.get("rms_norm") is not None))
    return quantize(x, fmt, **kw)

  monkeypatch.setattr(dispatch, "quantize_and_record", spy)
  cfg, _ = policy()
  _kernel_rollouts("mxfp4", max_new_tokens=2, backends=("pallas",))
  normed = [d for d, norm in calls if norm]
  assert normed and set(normed) == {cfg.d_model}
  # two norms in each traced layer (a scan traces its layer once), the other sites without
  assert len(normed) % 2 == 0 and len(calls) > len(normed)


def _assert_same_rollouts(xla, pallas):
  np.testing.assert_array_equal(np.asarray(pallas.tokens), np.asarray(xla.tokens))
  np.testing.assert_allclose(np.asarray(pallas.logp), np.asarray(xla.logp), atol=1e-5)
  compiled = jax.default_backend() == "gpu"
  for layer, sites in xla.records.items():
    for site, rec in sites.items():
      got, want = np.asarray(pallas.records[layer][site].mant), np.asarray(rec.mant)
      if compiled and layer > 0:
        assert np.mean(got != want) < 0.05, (layer, site, np.mean(got != want))
      else:
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer} {site}")


class _Tokamax:
  """A stand-in for the tokamax package with its two functions' signatures, computed as the
  engine computes them (`jax.lax.ragged_dot`, the decode attention's reference): what
  `TokamaxOps` hands them (the experts' rows, the decode query and mask) is checked on any
  machine; the package itself on the GPU below."""

  def __init__(self):
    self.calls = []

  def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, *,
                 implementation=None):
    self.calls.append("ragged_dot")
    assert lhs.dtype == rhs.dtype == jnp.bfloat16 and group_sizes.shape == rhs.shape[:1]
    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=preferred_element_type)

  def dot_product_attention(self, query, key, value, mask=None, *, implementation=None):
    self.calls.append("dot_product_attention")
    b, t, h, dh = query.shape
    assert t == 1 and key.shape[0] == b and mask.shape == (b, 1, 1, key.shape[1])
    # the engine's own rounding (float32 scores, bf16 probabilities; the package's: GPU test)
    from pallas_kernels.decode_attention import reference
    return reference.decode_attention(query[:, 0], key, value, mask[:, 0, 0])[:, None]


def test_tokamax_ops_compute_what_xla_computes(monkeypatch):
  """kernels="tokamax" (the benchmarks' other bf16 engine): the experts and the decode attention
  on tokamax's functions, here a stand-in of the same signatures; the same tokens as XLA's
  engine, log-probabilities within rounding. FP4 weights and caches stay XLA's."""
  fake = _Tokamax()
  monkeypatch.setitem(sys.modules, "tokamax", fake)
  xla, tk = _kernel_rollouts("bf16", backends=("xla", "tokamax"))
  np.testing.assert_array_equal(np.asarray(tk.tokens), np.asarray(xla.tokens))
  np.testing.assert_allclose(np.asarray(tk.logp), np.asarray(xla.logp), atol=1e-4)
  assert {"ragged_dot", "dot_product_attention"} <= set(fake.calls)
  from pallas_kernels.dispatch import make_ops
  from trace_jax.quant import MXFP4, quantize
  ops = make_ops("tokamax")
  assert ops.experts(jnp.zeros((4, 32)), quantize(jnp.ones((2, 32, 8)), MXFP4, axis=-2),
                     None) is None  # FP4 weights: XLA's path
  monkeypatch.setitem(sys.modules, "tokamax", None)  # not installed
  with pytest.raises(ValueError, match="needs the tokamax package"):
    make_ops("tokamax")


@pytest.mark.gpu
@pytest.mark.xfail(raises=(TypeError, AttributeError), strict=False,
                   reason="tokamax 0.0.12's GPU kernels do not run on jax 0.11.2 (TokamaxOps)")
def test_tokamax_engine_on_gpu():
  """The package itself (installed on the GPU machine), its own kernel choices, against XLA's
  bf16 engine: its attention rounds the scores to bf16 (the engine keeps them in float32), so
  a near tie can take another greedy token (on CPU, tokamax 0.0.12's XLA implementation: one
  of four sequences at its fifth new token, the log-probabilities before it within 7.6e-3).
  The first new token is the same everywhere (the prefill is the engine's own), and until
  each sequence's first other token its log-probabilities are within 1e-2."""
  xla, tk = _kernel_rollouts("bf16", backends=("xla", "tokamax"))
  got, want = np.asarray(tk.tokens), np.asarray(xla.tokens)
  first_new = len(max(PROMPTS, key=len))
  np.testing.assert_array_equal(got[:, :first_new + 1], want[:, :first_new + 1])
  for row in range(got.shape[0]):
    other = np.nonzero(got[row] != want[row])[0]
    until = other[0] if len(other) else got.shape[1]
    np.testing.assert_allclose(np.asarray(tk.logp)[row, :until],
                               np.asarray(xla.logp)[row, :until], atol=1e-2)


def test_pallas_attention_over_a_cache_it_has_not_filled():
  """A rollout's cache has room for its longest answer: with 30 new tokens after 7-token
  prompts it has 48 slots, three of the attention kernel's 16-slot blocks, and until a sequence
  reaches a block the kernel skips it (`valid_end`). Past one block the kernel's online softmax
  rounds its bf16 probabilities against a running max, XLA's flash-decoding against each
  chunk's: bf16 weights and caches give the same tokens, log-probabilities equal up to the
  first step past a block, then within rounding. (In FP4 a rounding can move an activation's
  code and, some steps on, a greedy token: with MXFP4 here, two of four sequences at their 15th
  and 23rd new token.)"""
  xla, pallas = _kernel_rollouts("bf16", max_new_tokens=30)
  assert xla.tokens.shape[1] == 7 + 30  # 36 fed tokens: a 48-slot cache
  np.testing.assert_array_equal(np.asarray(pallas.tokens), np.asarray(xla.tokens))
  got, want = np.asarray(pallas.logp), np.asarray(xla.logp)
  np.testing.assert_array_equal(got[:, :17], want[:, :17])  # one block: XLA's order
  np.testing.assert_allclose(got, want, atol=0.03)


# FP4 in the slow run (40-65 s on 2 cores): the kernel alone is checked against the Pallas one
# bit for bit for every cache format in tests/pallas_kernels
@pytest.mark.parametrize("precision", ["bf16", pytest.param("mxfp4", marks=pytest.mark.slow),
                                       pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_kernels_in_triton_language_in_the_engine(precision, monkeypatch):
  """triton_backend="jax_triton": a rollout's kernels written in Triton's own language too (a
  bf16 rollout's projections, experts and decode attention; an FP4 one's too, and its
  quantize-and-record of activations and K/V) on those
  programs (Triton's interpreter here), over a cache it has not filled (48 slots, three 16-slot
  blocks), against the Pallas kernels' rollout (interpret mode): the same programs, so the same
  tokens and records and, the interpreter summing in numpy's order where Pallas' sums in XLA's,
  log-probabilities within rounding (7.3e-4 apart at most here in bf16)."""
  from pallas_kernels import dispatch as K
  from pallas_kernels import triton_call
  called = set()
  call = triton_call.call
  monkeypatch.setattr(triton_call, "call", lambda kernel, *a, **kw: (
      called.add((kernel.__name__, kw.get("GROUPED"))), call(kernel, *a, **kw))[1])
  cfg, params = policy()
  recipe = QuantRecipe.uniform(precision)
  tokens, lengths = pad_prompts(PROMPTS)
  sampling = SamplingConfig(max_new_tokens=30, temperature=0.0)
  weights = pack_weights(cfg, params, recipe, ops=K.make_ops("pallas"))
  out = {a: RolloutEngine(cfg, recipe, sampling, attn_chunk=16, kernels="pallas", records="all",
                          triton_backend=a).generate(weights, tokens, lengths,
                                                     jax.random.PRNGKey(7))
         for a in ("pallas", "jax_triton")}
  got, want = out["jax_triton"], out["pallas"]
  # the projections, the experts and the attention all ran in Triton's language (FP4: the FP4
  # matmuls, which take the weights where there is no Hopper, as here, and the quantization)
  assert called == ({("bf16_matmul", False), ("bf16_matmul", True), ("bf16_attention", None)}
                    if precision == "bf16" else
                    {("fp4_matmul", False), ("fp4_matmul", True), ("fp4_attention", None),
                     ("quantize_record", None)})
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
  np.testing.assert_allclose(np.asarray(got.logp), np.asarray(want.logp), atol=5e-3)
  for a, b in zip(jax.tree.leaves(got.records), jax.tree.leaves(want.records)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _assert_mosaic_rollouts_are_right(precision, monkeypatch, partials, attention="mosaic"):
  """Greedy rollouts of a policy with sizes the Mosaic kernel takes for every cache format (head_dim
  a multiple of 64; a slot's FP4 scales of all kv heads 16 bytes or more) on the Mosaic attention,
  in splits of 64 slots, its partials computed by `partials`.
  bf16: the Triton attention's tokens for 16 new tokens, and the training path's log-probabilities
  for the rollout's tokens within 0.05 (the Triton rollout's: 0.018).
  FP4: the training path, guided by the rollout's records and routes, rounds every quantized
  value to the rollout's code (no flips at any site, the attention's output among them) and
  gives the rollout's log-probabilities within 1e-4 (on the emulation, MXFP4 and NVFP4: 2.4e-7;
  plain rounding flips 12-14% of the codes there). `attention` "mosaic_fold": the engine with
  `fold_scales` (its attention and FP4 matmuls decode MXFP4 with the scales folded), checked
  the same way, and the unfolded engine's tokens and log-probabilities, bit for bit."""
  from pallas_kernels.decode_attention import mosaic as mosaic_attention
  from pallas_kernels import dispatch as K
  splits = []

  def spy(*args, **kw):
    splits.append(kw["splits"])
    return partials(*args, **kw)

  monkeypatch.setattr(mosaic_attention, "decode_attention_partials", spy)
  monkeypatch.setattr(K, "MOSAIC_SPLIT_SLOTS", 64)
  cfg = tiny(n_heads=8, n_kv_heads=4, head_dim=128)
  assert mosaic_attention.supports(4, 128, 2, precision)  # precision names the cache format
  params = init_params(cfg, jax.random.PRNGKey(0))
  recipe = QuantRecipe.uniform(precision)
  weights = pack_weights(cfg, params, recipe, ops=K.make_ops("pallas"))
  tokens, lengths = pad_prompts(PROMPTS)
  sampling = SamplingConfig(max_new_tokens=60, temperature=0.0)  # 66 fed: a 128-slot cache
  kernels = ("mosaic", "triton") if precision == "bf16" else ("mosaic", attention)
  fold = {"mosaic": False, "mosaic_fold": True}  # the Mosaic kernel, MXFP4's scales folded
  out = {a: RolloutEngine(cfg, recipe, sampling, attn_chunk=64, kernels="pallas", records="all",
                          collect_codes=True, attention_kernel=a.split("_")[0],
                          fold_scales=fold.get(a, False)).generate(
                              weights, tokens, lengths, jax.random.PRNGKey(7))
         for a in set(kernels)}
  assert splits and set(splits) == {2}  # two splits of 64 slots, one trace a layer
  b = out[attention]
  if attention != "mosaic":  # the folded engine: the unfolded one's tokens and log-probabilities
    for got, want in ((b.tokens, out["mosaic"].tokens), (b.logp, out["mosaic"].logp)):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if precision == "bf16":
    first = 7 + 16
    np.testing.assert_array_equal(np.asarray(b.tokens)[:, :first],
                                  np.asarray(out["triton"].tokens)[:, :first])
    np.testing.assert_allclose(np.asarray(b.logp)[:, :first],
                               np.asarray(out["triton"].logp)[:, :first], atol=0.03)
    trained, atol = train(cfg, params, recipe, b, routes=b.routes), 0.05
  else:
    trained, atol = train(cfg, params, recipe, b, records=b.records, routes=b.routes), 1e-4
    flips = M.flip_rates(cfg, recipe, b.codes, trained.codes, b.response_mask[:, 1:],
                         routes_rollout=b.routes, routes_train=trained.routes)
    assert not any(flips.values()), {k: v for k, v in flips.items() if v}
  diff = np.abs(np.asarray(trained.logp) - np.asarray(b.logp))
  assert diff[np.asarray(b.response_mask)].max() < atol


def test_mosaic_attention_in_the_engine(monkeypatch):
  """attention_kernel="mosaic": the decode attention on the Mosaic kernel (no interpret mode:
  here its jnp emulation from tests/pallas_kernels; compiled in the GPU test below), in splits
  of at most K.MOSAIC_SPLIT_SLOTS slots. The emulation keeps p in float32 where the kernels
  (and XLA) round it to bf16, so the rollouts may part by rounding (in FP4 here within three new
  tokens, as a rounding moves a code): hence the checks of `_assert_mosaic_rollouts_are_right`."""
  from tests.pallas_kernels.test_decode_attention import _emulated_partials
  from pallas_kernels import dispatch as K
  monkeypatch.setattr(K, "_mosaic_attention_runs", lambda: True)
  _assert_mosaic_rollouts_are_right("bf16", monkeypatch, _emulated_partials("bf16"))


@pytest.mark.gpu
@pytest.mark.parametrize("precision,attention", [("bf16", "mosaic"), ("mxfp4", "mosaic"),
                                                ("nvfp4", "mosaic"), ("mxfp4", "mosaic_fold")])
def test_compiled_mosaic_attention_in_the_engine(precision, attention, monkeypatch):
  """On a Hopper GPU, compiled: the engine on the Mosaic attention kernel, checked as the
  emulation is above; with MXFP4's scales folded too."""
  from pallas_kernels.decode_attention import mosaic as mosaic_attention
  from pallas_kernels import dispatch as K
  if not K._mosaic_attention_runs():
    pytest.fail("the Mosaic attention's GPU test needs a Hopper GPU")
  _assert_mosaic_rollouts_are_right(precision, monkeypatch,
                                    mosaic_attention.decode_attention_partials, attention)


def test_mosaic_attention_splits():
  from pallas_kernels import dispatch as K
  assert K.MOSAIC_SPLIT_SLOTS == 1024
  assert K._mosaic_splits(1024, 64, 64) == 4  # occupancy asks 1; 4096 slots in fours
  assert K._mosaic_splits(8, 64, 64) == 64  # a small batch: the occupancy's
  assert K._mosaic_splits(1024, 40, 64) == 4  # 2560 slots: 3 do not divide 40 blocks, 4 do
  assert K._mosaic_splits(1024, 8, 64) == 1


@pytest.mark.parametrize("precision,head_dim,backend,runs", [
    ("mxfp4", 128, "mosaic", True), ("mxfp4", 64, "triton", True), ("nvfp4", 128, "mosaic", True),
    ("nvfp4", 64, "triton", True), ("bf16", 128, "triton", True), ("mxfp4", 128, "triton", False),
    ("nvfp4", 128, "triton", False)])
def test_auto_attention_takes_the_backend_measured_faster_for_the_cache(precision, head_dim,
                                                                        backend, runs,
                                                                        monkeypatch):
  """attention_kernel "auto" (the default): where it runs (Hopper), the Mosaic kernel for FP4
  caches whose V it takes from registers (head_dim a multiple of 128, the FP4 caches it takes);
  the Triton one for bf16 caches, for FP4 ones of other head dims and off Hopper
  (BENCHMARKS.md)."""
  from tests.pallas_kernels.test_decode_attention import inputs
  from pallas_kernels import dispatch as K
  from trace_jax.quant import MXFP4, NVFP4
  called = []
  monkeypatch.setattr(K, "_mosaic_attention_runs", lambda: runs)
  monkeypatch.setattr(K, "decode_attention",
                      lambda *a, **kw: called.append(kw.get("backend", "triton")))
  fmt = {"mxfp4": MXFP4, "nvfp4": NVFP4, "bf16": None}[precision]
  kv = 8 if head_dim == 64 else 4  # a slot's scale rows of 16 bytes: sizes the kernel takes
  q, k, v, mask = inputs(0, 2, 128, kv, 2, head_dim, fmt)
  K._attention(q, k, v, mask)
  assert called == [backend]


@pytest.mark.parametrize("fold", [False, True])
def test_fold_scales_reach_the_mosaic_kernels(fold, monkeypatch):
  """make_ops(fold_scales=...): the Mosaic attention and the FP4 matmuls are told to fold
  MXFP4's scales (weights in the Mosaic layout only); the bf16 ones are not."""
  from tests.pallas_kernels.test_decode_attention import inputs
  from pallas_kernels import dispatch as K
  from pallas_kernels.fp4_matmul.layout import tile
  from trace_jax.quant import MXFP4, quantize
  called = []
  monkeypatch.setattr(K, "_mosaic_attention_runs", lambda: True)
  spy = lambda name: lambda *a, **kw: called.append((name, kw.get("fold")))
  for name in ("decode_attention", "fp4_matmul", "grouped_fp4_matmul", "bf16_matmul"):
    monkeypatch.setattr(K, name, spy(name))
  ops = K.make_ops("pallas", fold_scales=fold)
  ops.attention(*inputs(0, 2, 128, 4, 2, 128, MXFP4))
  w = jax.random.normal(jax.random.PRNGKey(0), (128, 64))
  ops.linear(jnp.ones((2, 128), jnp.bfloat16), tile(quantize(w, MXFP4, axis=0)))
  ops.linear(jnp.ones((2, 128), jnp.bfloat16), w.astype(jnp.bfloat16))
  rows = types.SimpleNamespace(group_sizes=jnp.array([2, 0]), src=None, back=None, slots=None)
  ops.experts(jnp.ones((2, 128), jnp.bfloat16),
              tile(quantize(jnp.stack([w, w]), MXFP4, axis=1)), rows)
  assert called == [("decode_attention", fold), ("fp4_matmul", fold or None),
                    ("bf16_matmul", None), ("grouped_fp4_matmul", fold or None)]
  with pytest.raises(ValueError, match="fold_scales runs the Pallas kernels"):
    K.make_ops("xla", fold_scales=True)


def test_attention_blocks_reach_the_mosaic_attention(monkeypatch):
  """make_ops(attention_blocks=2): the Mosaic attention over an FP4 cache whose slots 128
  divide takes two blocks a step, with splits of those steps; slots that 128 does not divide,
  one; a bf16 cache runs the Triton attention (`auto`), or the Mosaic one block a step."""
  from tests.pallas_kernels.test_decode_attention import inputs
  from pallas_kernels import dispatch as K
  from trace_jax.quant import MXFP4
  called = []
  monkeypatch.setattr(K, "_mosaic_attention_runs", lambda: True)
  monkeypatch.setattr(K, "decode_attention", lambda *a, **kw: called.append(
      (a[1].shape[1], kw.get("backend"), kw.get("blocks"), kw.get("splits"))))
  ops = K.make_ops("pallas", attention_blocks=2)
  ops.attention(*inputs(0, 2, 1024, 4, 2, 128, MXFP4))
  ops.attention(*inputs(0, 2, 192, 4, 2, 128, MXFP4))
  ops.attention(*inputs(0, 2, 1024, 4, 2, 128, None))
  K.make_ops("pallas", "mosaic", attention_blocks=2).attention(
      *inputs(0, 2, 1024, 4, 2, 128, None))
  [(s, backend, blocks, splits), odd, bf16, bf16_mosaic] = called
  assert (s, backend, blocks) == (1024, "mosaic", 2) and (1024 // 128) % splits == 0
  assert odd[:3] == (192, "mosaic", 1) and bf16[1:3] == (None, None)
  assert bf16_mosaic[:3] == (1024, "mosaic", 1)
  with pytest.raises(ValueError, match="attention_blocks > 1 runs the Pallas kernels"):
    K.make_ops("xla", attention_blocks=2)
  with pytest.raises(ValueError, match="attention_blocks must be one of \\(1, 2\\)"):
    K.make_ops("pallas", attention_blocks=4)


@pytest.mark.parametrize("precision,order", [("mxfp4", "pairs"), ("nvfp4", "pairs"),
                                             ("mxfp4", "halves")])
def test_weight_sync_for_the_kernels_tiles_fp4_projections(precision, order):
  """pack_weights with the kernels' ops lays every FP4 projection out for the Mosaic kernels (in
  the ops' nibble order): the same bytes as the plain packing, permuted (`untile` gives them
  back bit for bit); q, k and v packed as one weight too, where they are."""
  from pallas_kernels.fp4_matmul.layout import TiledFP4, untile
  cfg, params = policy()
  recipe = QuantRecipe.uniform(precision)
  plain = pack_weights(cfg, params, recipe)
  from pallas_kernels import dispatch
  fused = pack_weights(cfg, params, recipe, ops=dispatch.make_ops("pallas", fp4_order=order))
  for layer in fused.layers:
    w = layer.get("wq+wk+wv", layer.get("wq"))  # (NVFP4's apart)
    w = getattr(w, "w", w)
    assert isinstance(w, TiledFP4) and w.order == order
  ops = dispatch.KernelOps(fp4_order=order, fuse=())  # each projection on its own
  tiled = jax.jit(functools.partial(pack_weights, cfg, recipe=recipe, ops=ops))(params)
  ones = 0  # the tiled MXFP4 weights' globals (their fold references, 4 bytes each)
  for layer_t, layer_p in zip(tiled.layers, plain.layers):
    for name in WEIGHT_AXES:
      assert isinstance(layer_t[name], TiledFP4) and layer_t[name].order == order, name
      ones += layer_t[name].global_scale.nbytes if precision == "mxfp4" else 0
      back = untile(layer_t[name])
      assert jax.tree.structure(back) == jax.tree.structure(layer_p[name])
      for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(layer_p[name])):
        np.testing.assert_array_equal(a, b)
  assert tiled.nbytes == plain.nbytes + ones
  layer_t, layer_p = tiled.layers[0], plain.layers[0]  # XLA's fallback reads either layout
  np.testing.assert_array_equal(ops.dense(layer_t["w_up"]), unpack(layer_p["w_up"]))
  with pytest.raises(ValueError, match="kernels must be one of"):
    dispatch.make_ops("mosaic")
  with pytest.raises(ValueError, match=r"fp4_order must be one of \('pairs', 'halves'\), got 'x'"):
    dispatch.make_ops("pallas", fp4_order="x")


def test_weight_sync_leaves_fp4_untiled_on_gpus_without_the_mosaic_kernels(monkeypatch):
  """There the Triton kernels run, and they would take a tiled weight back every step."""
  from pallas_kernels import dispatch as K
  from trace_jax.quant import MXFP4, QArray, quantize
  w = quantize(jnp.ones((128, 64)), MXFP4, axis=0)
  ops = K.make_ops("pallas")
  assert not isinstance(ops.weight_layout(w), QArray)  # here (CPU): tiled, for the tests
  monkeypatch.setattr(K.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(K.mosaic, "available", lambda: False)
  assert ops.weight_layout(w) is w


def test_kernel_switch_errors():
  cfg, _ = policy()
  with pytest.raises(ValueError, match="kernels must be one of"):
    RolloutEngine(cfg, QuantRecipe(), SamplingConfig(), kernels="triton")
  with pytest.raises(ValueError, match="attention_kernel must be one of.*'flash'"):
    RolloutEngine(cfg, QuantRecipe(), SamplingConfig(), kernels="pallas",
                  attention_kernel="flash")
  cfg32, _ = policy("float32")
  with pytest.raises(ValueError, match="bf16 activations"):
    RolloutEngine(cfg32, QuantRecipe(), SamplingConfig(), kernels="pallas")


def test_kernel_switch_leaves_what_no_kernel_takes_to_xla():
  """Formats without a kernel (fp8) and sizes the kernels' power-of-two tiles (or blocks) do not
  fit: None, and the rollout path computes them with XLA."""
  from pallas_kernels import dispatch as K
  ops = K.make_ops("pallas")
  from trace_jax.quant import FP8, MXFP4, dequantize, make_record, quantize
  x = jnp.ones((2, 64), jnp.bfloat16)
  assert ops.linear(x, jnp.ones((64, 24), jnp.bfloat16)) is None  # 24 outputs: no tile
  assert ops.linear(x, quantize(jnp.ones((64, 64)), FP8, axis=0)) is None
  assert ops.linear(x, quantize(jnp.ones((64, 64)), MXFP4, axis=0)) is not None
  assert ops.linear(x, jnp.ones((64, 64), jnp.bfloat16)) is not None
  many = jnp.ones((K.BF16_XLA_FROM, 64), jnp.bfloat16)  # XLA's dot: faster at this many tokens
  assert ops.linear(many, jnp.ones((64, 64), jnp.bfloat16)) is None
  q = jnp.ones((1, 2, 96), jnp.bfloat16)
  cache = quantize(jnp.ones((1, 64, 1, 96)), MXFP4)  # head_dim 96
  assert ops.attention(q, cache, cache, jnp.ones((1, 64), bool)) is None
  assert ops.quantize(x, FP8) is None and ops.quantize(jnp.ones((2, 48)), MXFP4) is None
  x = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64), jnp.bfloat16)
  qa, rec = ops.quantize(x, MXFP4)  # the fused kernel: the quant core's bits
  want = quantize(x, MXFP4)
  assert jax.tree.structure(qa) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves((qa, rec)), jax.tree.leaves((want, make_record(want)))):
    np.testing.assert_array_equal(a, b)
  _, _, y = ops.quantize(x, MXFP4, values=True)  # and the values an engine computes with
  assert y.dtype == x.dtype
  np.testing.assert_array_equal(y.astype(jnp.float32), dequantize(want).astype(x.dtype))


def _w4a4_rollouts(monkeypatch, max_new_tokens=8):
  """Greedy MXFP4 rollouts on XLA and on the W4A4 kernels (here their arithmetic by XLA,
  `w4a4.emulated_*`; compiled on Hopper), and what each W4A4 matmul was handed."""
  from pallas_kernels import dispatch as K
  taken = []
  for name in ("_w4a4_linear", "_w4a4_experts"):
    real = getattr(K, name)

    def spy(*args, _real=real, _name=name):
      y = _real(*args)
      taken.append((_name, args[1].shape[-1], y is not None))
      return y

    monkeypatch.setattr(K, name, spy)
  cfg, params = policy()
  recipe = QuantRecipe.uniform("mxfp4")
  tokens, lengths = pad_prompts(PROMPTS)
  sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
  out = []
  for kernels, w4a4 in (("xla", False), ("pallas", True)):
    engine = RolloutEngine(cfg, recipe, sampling, records="all", collect_codes=True,
                           attn_chunk=16, kernels=kernels, w4a4=w4a4)
    weights = pack_weights(cfg, params, recipe, ops=engine.ops)
    out.append(engine.generate(weights, tokens, lengths, jax.random.PRNGKey(7)))
  return cfg, params, recipe, out, taken


# the W4A4 engine is off by default (engine.w4a4): its minute of CPU in the slow selection, which
# the GPU run of this file selects too (-m "gpu or slow or not slow")
@pytest.mark.slow
def test_w4a4_engine_takes_the_activations_codes_and_keeps_the_records_exact(monkeypatch):
  """engine w4a4: every projection and expert matmul of an MXFP4 policy runs the W4A4 kernel on
  its activation's QArray (the experts' inputs reordered by the dispatch with their codes),
  giving XLA's tokens and log-probabilities up to float32 summation order; the trainer guided
  by its records rounds every quantized value to its codes; no activation block was outside
  the kernel's fold (the engine's count is 0, and XLA's engine reports none)."""
  from pallas_kernels.fp4_matmul.w4a4_layout import TiledW4
  cfg, params, recipe, (xla, b), taken = _w4a4_rollouts(monkeypatch)
  assert taken and all(ok for *_, ok in taken), [t for t in taken if not t[-1]]
  # wq, wk and wv as one weight, wo, the experts' gate and up as one weight, and down: every
  # output width, both kinds
  assert {(n, width) for n, width, _ in taken} == {
      ("_w4a4_linear", cfg.q_dim + 2 * cfg.kv_dim), ("_w4a4_linear", cfg.d_model),
      ("_w4a4_experts", 2 * cfg.d_ff), ("_w4a4_experts", cfg.d_model)}
  from pallas_kernels import dispatch as K
  packed = pack_weights(cfg, params, recipe, ops=K.make_ops("pallas", w4a4=True))
  layer = packed.layers[0]
  assert all(isinstance(layer[w], TiledW4) for w in ("wo", "w_down"))
  assert all(isinstance(layer[w].w, TiledW4) for w in ("wq+wk+wv", "w_gate+w_up"))
  np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(xla.tokens))
  np.testing.assert_allclose(np.asarray(b.logp), np.asarray(xla.logp), atol=2e-2)
  assert set(b.stats) == {"w4a4_fold_misses"} and int(b.stats["w4a4_fold_misses"]) == 0
  assert xla.stats == {}
  trained = train(cfg, params, recipe, b, records=b.records, routes=b.routes)
  flips = M.flip_rates(cfg, recipe, b.codes, trained.codes, b.response_mask[:, 1:],
                       routes_rollout=b.routes, routes_train=trained.routes)
  assert not any(flips.values()), {k: v for k, v in flips.items() if v}
  diff = np.abs(np.asarray(trained.logp) - np.asarray(b.logp))
  assert diff[np.asarray(b.response_mask)].max() < 1e-4


def test_w4a4_fold_misses_are_counted():
  """The ops' count is the kernel's: the blocks of an activation more than 2^14 below their
  token's largest (which take the kernel's exact branch), whatever the activation's leading
  axes; the bf16-activation ops count nothing."""
  from pallas_kernels import dispatch as K
  from pallas_kernels.fp4_matmul import w4a4
  from trace_jax.quant import MXFP4, quantize
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 256))
  xq = quantize(x, MXFP4)
  assert int(K.make_ops("pallas", w4a4=True).activation_stats(xq)["w4a4_fold_misses"]) == 0
  scales = np.asarray(xq.scales).copy()
  scales[1, 2, 1::2] = scales[1, 2].max() - 20  # 4 of the token's 8 blocks far below
  far = type(xq)(xq.codes, jnp.asarray(scales), None, MXFP4, xq.axis)
  assert int(K.make_ops("pallas", w4a4=True).activation_stats(far)["w4a4_fold_misses"]) == 4
  assert int(w4a4.fold_misses(K._rows(far))) == 4
  assert K.make_ops("pallas").activation_stats(far) == {}


def test_w4a4_needs_the_pallas_kernels():
  from pallas_kernels import dispatch as K
  with pytest.raises(ValueError, match="w4a4 runs the Pallas kernels"):
    K.make_ops("xla", w4a4=True)
  cfg, _ = policy()
  with pytest.raises(ValueError, match="w4a4 runs the Pallas kernels"):
    RolloutEngine(cfg, QuantRecipe.uniform("mxfp4"), SamplingConfig(), w4a4=True)


@pytest.mark.parametrize("precision", ["mxfp4", "bf16", "nvfp4"])
def test_the_kernels_weight_sync_packs_q_k_and_v_and_gate_and_up_as_one_weight_each(precision):
  """With the kernels' ops the weight sync packs wq, wk and wv side by side as one weight
  (`Fused`: one matmul of the layer's normed input where there were three, at decode three
  kernel launches and their partial sums become one), and each expert's w_gate and w_up (one
  grouped matmul of the dispatched rows where there were two): column for column the values
  of the weights packed apart. NVFP4's per-matrix globals keep them apart. The engine decodes
  the same greedy tokens from either packing, log-probabilities equal up to float32 summation
  order."""
  from pallas_kernels import dispatch
  from trace_jax.models.rollout_path import Fused
  cfg, params = policy()
  recipe = QuantRecipe.uniform(precision)
  ops = dispatch.make_ops("pallas")
  assert ops.fuse == (("wq", "wk", "wv"), ("w_gate", "w_up"))
  fused = pack_weights(cfg, params, recipe, ops=ops)
  apart = pack_weights(cfg, params, recipe, ops=dispatch.make_ops("pallas", fuse=False))
  groups = {("wq", "wk", "wv"): (cfg.q_dim, cfg.kv_dim, cfg.kv_dim),
            ("w_gate", "w_up"): (cfg.d_ff, cfg.d_ff)}
  for layer_f, layer_a in zip(fused.layers, apart.layers):
    for names, sizes in groups.items():
      name = "+".join(names)
      assert all(n in layer_a for n in names) and name not in layer_a
      if precision == "nvfp4":
        assert all(n in layer_f for n in names) and name not in layer_f
        continue
      w = layer_f[name]
      assert isinstance(w, Fused) and not set(names) & set(layer_f)
      assert w.sizes == sizes
      want = np.concatenate([np.asarray(ops.dense(layer_a[n]), np.float32) for n in names],
                            -1)
      got = np.asarray(ops.dense(w.w), np.float32)
      np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=6, temperature=0.0),
                         records="all", attn_chunk=16, kernels="pallas")
  tokens, lengths = pad_prompts(PROMPTS)
  a, b = (engine.generate(w, tokens, lengths, jax.random.PRNGKey(7)) for w in (fused, apart))
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_allclose(np.asarray(a.logp), np.asarray(b.logp), atol=1e-4)
