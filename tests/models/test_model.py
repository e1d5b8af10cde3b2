"""The decoder: presets, weight sync bit-identity, causality, the recipe."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench_train_attention import heads_apart
from trace_jax import quant
from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.models import (QuantRecipe, TrainPath, init_params, logits, pack_weights,
                              parse_layers, preset, qwen3_30b_a3b, small, tiny)
from trace_jax.models.rollout_path import unpack
from trace_jax.models.recipe import WEIGHT_AXES


def test_presets():
  q = qwen3_30b_a3b(n_layers=2)
  assert (q.d_model, q.n_experts, q.top_k, q.d_ff, q.n_heads, q.n_kv_heads, q.head_dim) == (
      2048, 128, 8, 768, 32, 4, 128)
  assert small().n_layers == 4 and tiny(n_layers=3).n_layers == 3
  with pytest.raises(ValueError, match="unknown model preset 'huge'.*small"):
    preset("huge")
  with pytest.raises(ValueError, match="n_heads \\(6\\) must be a multiple of n_kv_heads \\(4\\)"):
    tiny(n_heads=6, n_kv_heads=4)


@pytest.mark.parametrize("precision", ["mxfp4", "nvfp4", "fp8"])
def test_packed_weights_dequantize_to_the_trainers_fake_quant_weights(precision):
  cfg = tiny(n_layers=3)
  params = init_params(cfg, jax.random.PRNGKey(0))
  recipe = QuantRecipe.uniform(precision, layers=[0, 2])
  packed = pack_weights(cfg, params, recipe)
  path = TrainPath(cfg, jnp.ones((1, 1), bool), recipe)
  for i in range(cfg.n_layers):
    for name in WEIGHT_AXES:
      rollout_w = packed.layers[i][name]
      assert isinstance(rollout_w, quant.QArray) == (i != 1)
      want = np.asarray(path.weight(stacks.take(params["layers"], i)[name], i, name))
      got = np.asarray(unpack(rollout_w).astype(jnp.float32))
      if i == 1:  # unquantized layer: the bf16 weight, the trainer's float32 master
        np.testing.assert_array_equal(got, np.asarray(want.astype(jnp.bfloat16), np.float32))
      else:
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  # packed FP4 weights are a fraction of the bf16 bytes
  if precision != "fp8":
    bf16 = pack_weights(cfg, params, QuantRecipe())
    assert packed.layers[0]["w_gate"].nbytes < 0.3 * bf16.layers[0]["w_gate"].nbytes


def test_nvfp4_weights_have_one_global_per_matrix():
  cfg = tiny()
  packed = pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)), QuantRecipe.uniform("nvfp4"))
  assert packed.layers[0]["w_gate"].global_scale.shape == (cfg.n_experts, 1, 1)
  assert packed.layers[0]["wq"].global_scale.shape == (1, 1)


@pytest.mark.parametrize("precision", ["bf16", "mxfp4"])
def test_causality(precision):
  cfg = tiny()
  params = init_params(cfg, jax.random.PRNGKey(1))
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 12), 0, cfg.vocab_size)
  changed = tokens.at[:, 7:].set((tokens[:, 7:] + 5) % cfg.vocab_size)
  recipe = QuantRecipe.uniform(precision)

  def run(t):
    path = TrainPath(cfg, jnp.ones(t.shape, bool), recipe)
    pos = jnp.broadcast_to(jnp.arange(t.shape[1]), t.shape)
    from trace_jax.models.qwen3_moe import forward
    return np.asarray(jax.jit(lambda t: forward(cfg, params, t, pos, path)[0])(t))

  a, b = run(tokens), run(changed)
  np.testing.assert_array_equal(a[:, :7], b[:, :7])
  assert np.abs(a[:, 7:] - b[:, 7:]).max() > 0


def test_logits_shape_and_errors():
  cfg = tiny()
  params = init_params(cfg, jax.random.PRNGKey(0))
  assert logits(cfg, params, jnp.zeros((3, 5), jnp.int32)).shape == (3, 5, cfg.vocab_size)
  with pytest.raises(ValueError, match=r"\[batch, time\].*\(5,\)"):
    logits(cfg, params, jnp.zeros((5,), jnp.int32))


def test_parse_layers():
  assert parse_layers("none", 4) == () and parse_layers(None, 4) == ()
  assert parse_layers("all", 3) == (0, 1, 2)
  assert parse_layers("last:2", 4) == (2, 3)
  assert parse_layers([3, 1, 1], 4) == (1, 3)
  with pytest.raises(ValueError, match="last:9.*\\[0, 4\\]"):
    parse_layers("last:9", 4)
  with pytest.raises(ValueError, match="indices \\[7\\] out of range"):
    parse_layers([0, 7], 4)
  with pytest.raises(ValueError, match="'some'.*'none', 'all', 'last:N'"):
    parse_layers("some", 4)
  with pytest.raises(ValueError, match="unknown quantization format 'fp4'"):
    QuantRecipe(weights="fp4")


def _count(jaxpr, match) -> int:
  """The equations of a jaxpr and of the jaxprs inside it (a scan's body once) that `match`."""
  n = 0
  for e in jaxpr.eqns:
    for p in e.params.values():
      for sub in p if isinstance(p, (list, tuple)) else (p,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          n += _count(sub, match)
    n += bool(match(e))
  return n


def _gathers(jaxpr, operand, out):
  """Gathers from an `operand`-shaped array to an `out`-shaped one."""
  return _count(jaxpr, lambda e: e.primitive.name == "gather" and (
      e.invars[0].aval.shape, e.outvars[0].aval.shape) == (operand, out))


def test_gate_and_up_take_one_gather_of_the_sorted_tokens():
  """The trainer gathers a layer's tokens sorted by expert once for the gate and the up
  projection (`TrainPath`): their cotangents are summed on the sorted rows before one scatter
  back, the order of sums the trainer has always had (gathered per projection, the gradients
  move by bf16 roundings). The rollout's kernels compose the gathers instead."""
  cfg = tiny(n_layers=1)
  params = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.zeros((2, 5), jnp.int32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(logits(cfg, p, tokens))))(params).jaxpr
  assert _gathers(jaxpr, (2 * 5, cfg.d_model), (2 * 5 * cfg.top_k, cfg.d_model)) == 1


def _float_scatter_adds(jaxpr) -> list:
  """The scatter-adds of floating values in a jaxpr and the jaxprs inside it: (operand shape,
  updates shape) each."""
  found = []
  _count(jaxpr, lambda e: e.primitive.name == "scatter-add" and jnp.issubdtype(
      e.outvars[0].aval.dtype, jnp.floating) and found.append(
          (e.invars[0].aval.shape, e.invars[2].aval.shape)))
  return found


@pytest.mark.parametrize("remat", [False, True])
def test_the_trainers_gradient_scatters_only_into_the_embedding(remat):
  """The gradient of the trainer's log-probabilities gathers where the forward pass gathered
  rows (the experts' sorted rows and back, the gates, the targets' log-probabilities): a
  scatter-add, under XLA's deterministic GPU ops, becomes a sort and a scan of its own, which
  gave a warm-start step of the long-horizon `gpu` policy 3.3x the GPU time. Only
  the embedding's rows, taken by token, are scattered back."""
  from trace_jax.rl.recompute import recompute
  cfg = tiny(n_layers=2)
  params = init_params(cfg, jax.random.PRNGKey(0))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, cfg.vocab_size)
  valid = jnp.ones((2, 6), bool)

  def loss(p):
    return jnp.sum(recompute(cfg, p, tokens, valid, remat=remat).logp)

  found = _float_scatter_adds(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  assert found == [((cfg.vocab_size, cfg.d_model), (2, 5, cfg.d_model))], found


@pytest.mark.parametrize("k", [1, 2, 3])
def test_take_rows_gradient_is_the_gathers(k):
  """`layers.take_rows` (x[idx] for an idx that takes each row k times): the value and the
  gradient of indexing, without a scatter; bit for bit where a row's k cotangents are summed
  in the same order (k <= 2: the scatter-add adds to zero first)."""
  r, d = 7, 5
  flat = jax.random.randint(jax.random.PRNGKey(k), (r * k,), 0, 4)
  order = jnp.argsort(flat, stable=True)
  inverse = jnp.argsort(order)
  x = jax.random.normal(jax.random.PRNGKey(9), (r, d)).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(8), (r * k, d)).astype(jnp.bfloat16)
  src, places = order // k, inverse.reshape(r, k)
  np.testing.assert_array_equal(L.take_rows(x, src, places), x[src])
  want = jax.grad(lambda x: jnp.sum((x[src] * w).astype(jnp.float32)))(x)
  got = jax.grad(lambda x: jnp.sum((L.take_rows(x, src, places) * w).astype(jnp.float32)))(x)
  if k <= 2:
    np.testing.assert_array_equal(got, want)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             rtol=1e-2)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(L.take_rows(x, src, places))))(x).jaxpr
  assert not _float_scatter_adds(jaxpr)


@pytest.mark.parametrize("shape, experts, k", [((64, 1), 128, 8), ((3, 5), 6, 2), ((7,), 16, 1),
                                               ((2, 9), 16, 16)])
def test_routing_sorts_once(shape, experts, k):
  """Top-k ids in ascending order and the dispatch's way back to slot order are what sorts give
  (ties of probability among them), with one sort a layer: the experts' rows by expert. On the
  GPU each sort is a kernel of its own, where the ranks and the inverse permutation fuse."""
  key = jax.random.PRNGKey(sum(shape) + k)
  probs = jax.nn.softmax(jax.random.normal(key, (*shape, experts)), axis=-1)
  probs = probs.at[..., 1].set(probs[..., 0])  # a tie
  idx = L.top_k_experts(probs, k)
  np.testing.assert_array_equal(idx, jnp.sort(jax.lax.top_k(probs, k)[1], axis=-1))
  flat = idx.reshape(-1, k)
  d = L.Dispatch(flat, experts)
  order = jnp.argsort(flat.reshape(-1), stable=True)
  np.testing.assert_array_equal(d.order, order)
  np.testing.assert_array_equal(d.inverse, jnp.argsort(order))
  np.testing.assert_array_equal(d.group_sizes, jnp.bincount(flat.reshape(-1), length=experts))

  def route(p):
    d = L.Dispatch(L.top_k_experts(p, k).reshape(-1, k), experts)
    return d.of_tokens, d.of_slots

  assert _count(jax.make_jaxpr(route)(probs).jaxpr, lambda e: e.primitive.name == "sort") == 1


@pytest.mark.parametrize("h,kv", [(8, 2), (4, 4)])
def test_the_trainers_attention_is_the_heads_apart_one_bit_for_bit(h, kv):
  """`full_attention` lays a kv head's query heads out as one run of rows (for its backward
  pass's matmuls): its outputs and the gradients of q, K and V are those of the attention
  with heads and positions apart, bit for bit, on left-padded rows."""
  b, t, dh = 3, 40, 16
  ks = jax.random.split(jax.random.PRNGKey(7), 4)
  q = jax.random.normal(ks[0], (b, t, h, dh), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kv, dh), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kv, dh), jnp.bfloat16)
  valid = jnp.arange(t)[None, :] >= jnp.asarray([0, 5, 39])[:, None]
  w = jax.random.normal(ks[3], (b, t, h, dh))

  def grads(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v, valid).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  np.testing.assert_array_equal(L.full_attention(q, k, v, valid),
                                heads_apart(q, k, v, valid))
  for got, want in zip(jax.tree.leaves(grads(L.full_attention)),
                       jax.tree.leaves(grads(heads_apart))):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("h,kv", [(8, 2), (4, 4)])
def test_the_fused_attention_computes_the_full_one(h, kv):
  """`rl.attention=fused` (`jax.nn.dot_product_attention`: cuDNN's fused kernel on a GPU,
  XLA's composition here) takes the same causal, padding-masked attention: on rows padded on
  the left, on the right and not at all, its outputs and the gradients of q, K and V are the
  full attention's up to bf16 rounding, and a row with no valid slot before a query stays
  finite."""
  fused_against_full(h, kv, 40)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [40, 39])
def test_the_fused_attention_computes_the_full_one_on_gpu(t):
  """The same on cuDNN's kernel, at an even length and at an odd one (padded by a slot no
  query sees: cuDNN differentiates a biased attention at even lengths only)."""
  assert jax.default_backend() == "gpu"
  fused_against_full(8, 2, t)


def fused_against_full(h, kv, t):
  b, dh = 3, 16
  ks = jax.random.split(jax.random.PRNGKey(11), 4)
  q = jax.random.normal(ks[0], (b, t, h, dh), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kv, dh), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kv, dh), jnp.bfloat16)
  pos = jnp.arange(t)[None, :]
  valid = (pos >= jnp.asarray([0, 5, t - 1])[:, None]) & (pos < jnp.asarray([t, 31, t])[:, None])
  w = jax.random.normal(ks[3], (b, t, h, dh)) * valid[:, :, None, None]

  def grads(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v, valid).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  full, fused = L.ATTENTIONS["full"], L.ATTENTIONS["fused"]
  got = fused(q, k, v, valid).astype(jnp.float32)
  assert bool(jnp.all(jnp.isfinite(got)))
  where = valid[:, :, None, None]
  np.testing.assert_allclose(jnp.where(where, got, 0), jnp.where(where, full(q, k, v, valid), 0),
                             atol=2e-2, rtol=2e-2)
  (l1, g1), (l2, g2) = grads(fused), grads(full)
  np.testing.assert_allclose(l1, l2, rtol=1e-2)
  for a, b_ in zip(g1, g2):
    a, b_ = np.asarray(a, np.float32), np.asarray(b_, np.float32)
    assert np.linalg.norm(a - b_) <= 2e-2 * np.linalg.norm(b_)


def test_the_fused_attention_hands_cudnn_an_even_length(monkeypatch):
  """cuDNN's fused attention refuses an odd sequence length with a bias when differentiated
  (jax's `check_is_flash_attention`: the long-horizon warm start's 8 + 1 532 - 1 tokens stopped
  on an H100). On a GPU the fused attention pads an odd length by one masked slot, which leaves
  the real slots' outputs and gradients as they were: here cuDNN is XLA's composition behind a
  check of the length, on a backend that calls itself a GPU."""
  real, seen = jax.nn.dot_product_attention, []

  def cudnn(q, k, v, bias=None, implementation=None, **kw):
    seen.append((q.shape[1], k.shape[1], implementation))
    if implementation == "cudnn" and (q.shape[1] % 2 or k.shape[1] % 2):
      raise NotImplementedError(f"Unsupported sequence length Q {q.shape[1]}, KV {k.shape[1]}.")
    return real(q, k, v, bias=bias, implementation="xla", **kw)

  b, t, h, kv, dh = 2, 39, 4, 2, 16
  ks = jax.random.split(jax.random.PRNGKey(5), 4)
  q = jax.random.normal(ks[0], (b, t, h, dh), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, kv, dh), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, kv, dh), jnp.bfloat16)
  valid = jnp.arange(t)[None, :] < jnp.asarray([39, 30])[:, None]
  w = jax.random.normal(ks[3], (b, t, h, dh)) * valid[:, :, None, None]

  def grads(f):
    loss = lambda q, k, v: jnp.sum(f(q, k, v, valid).astype(jnp.float32) * w)
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  want = grads(L.ATTENTIONS["fused"])  # this backend: XLA's composition, any length
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax.nn, "dot_product_attention", cudnn)
  got = grads(L.ATTENTIONS["fused"])
  assert seen and all(s == (t + 1, t + 1, "cudnn") for s in seen), seen
  for a, b_ in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32),
                               atol=1e-6, rtol=1e-6)
