"""The Qwen3-MoE decoder as flax linen modules, written once for the rollout engine and the
trainer.

How each quantization site, projection and attention is computed is the job of the `path` the
modules are given: the trainer's (`trace_jax.models.paths`) fake-quantizes master params and
guides activations by records; the rollout's (`trace_jax.models.rollout_path`) multiplies packed
FP4 weights and attends over a packed KV cache. This file only says what is computed, in which
order. `Qwen3MoE` runs the layers the path computes alike as one `nn.scan` over their stacked
params (`models.stacks`); each layer sows what the path emits (records, routes, codes, aux
losses, new K/V) into the path's variable collection, and the stacked KV cache of a scanned
decode step is the scan's carry, written in place.

Linen rather than NNX: a linen module holds no state of its own, so its variables are whatever
pytree `apply` is given. The master params stay the plain dict of arrays that orbax saves and
that `init_params` makes (the layout checkpoints have always had), and the rollout's packed
weights (`RolloutWeights`: QArrays, or a kernel backend's layout) go in as the same `params`
collection, with no module state to convert either into or out of. `forward` is the function
callers use; it lays the weights out as the modules' variables and applies them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.models.config import ModelConfig
from trace_jax.models.paths import TrainPath

Params = dict[str, Any]


class LayerPath(Protocol):
  """How one layer computes the parts where rollout and training differ, and what it emits."""

  carry: Any  # the run's carry after this layer (the rollout's stacked cache, or None)

  def linear(self, x: jax.Array, w: Any, name: str) -> jax.Array: ...

  def linears(self, x: jax.Array, p: Params, names: tuple[str, ...]) -> list[jax.Array]:
    """`linear` of x by each of the layer's weights p[name]: a backend may hold them as one
    weight (the rollout's `Fused`) and compute them in one matmul."""

  def experts(self, x: jax.Array, p: Params, names: tuple[str, ...],
              rows: L.ExpertRows) -> list[jax.Array]:
    """x [..., D] as rows [R, D] through their experts' weights p[name] [E, D, F] -> one
    [S, F] a name (`rows`: which rows each expert takes, and the output's order;
    `L.grouped_rows`): a backend may hold them as one weight (the rollout's `Fused`) and
    compute them in one grouped matmul."""

  def act(self, x: jax.Array, site: str) -> jax.Array: ...

  def norm_act(self, h: jax.Array, w: jax.Array, eps: float, site: str, keep: bool = False):
    """act(L.rms_norm(h, w, eps), site), or with `keep` the normed h and that, a pair: a
    backend with a kernel for both computes them in one."""

  def attention(self, q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh) -> jax.Array: ...

  def route(self, probs_BxTxE: jax.Array) -> jax.Array: ...

  def emit(self, probs_BxTxE: jax.Array, idx_BxTxk: jax.Array) -> dict[str, Any]:
    """This layer's outputs by name, sown into the path's collection."""


class Path(Protocol):
  """A forward pass's computation: which layers run alike (one scan each), each layer's view,
  and what the layers' sown outputs become."""

  differentiable: bool  # whether gradients flow to the weights (scanned as the scan's input)
  collection: str  # the variable collection its layers sow into

  def runs(self, layers: list) -> tuple[tuple[int, int], ...]: ...

  def carry(self, lo: int, hi: int) -> Any: ...

  def layer(self, lo: int, hi: int, i, carry) -> LayerPath: ...

  def collect(self, outputs: list) -> Any:
    """[(lo, hi, sown outputs, carry, stacked)] per scan or layer -> what forward returns."""


def init_params(cfg: ModelConfig, key: jax.Array, groups: Sequence[int] | None = None) -> Params:
  """float32 master params; std 1/sqrt(fan_in) x cfg.init_scale, norms at one. `layers` is a
  list of stacks of `groups` consecutive layers (default: one stack of all), every array with a
  leading layer axis (`trace_jax.models.stacks`); the values do not depend on the grouping."""
  d, e, f = cfg.d_model, cfg.n_experts, cfg.d_ff
  keys = iter(jax.random.split(key, 3 + 8 * cfg.n_layers))

  def normal(shape, fan_in):
    return jax.random.normal(next(keys), shape, jnp.float32) * (cfg.init_scale / math.sqrt(fan_in))

  def layer():
    return {
        "attn_norm": jnp.ones((d,)), "mlp_norm": jnp.ones((d,)),
        "q_norm": jnp.ones((cfg.head_dim,)), "k_norm": jnp.ones((cfg.head_dim,)),
        "wq": normal((d, cfg.q_dim), d), "wk": normal((d, cfg.kv_dim), d),
        "wv": normal((d, cfg.kv_dim), d), "wo": normal((cfg.q_dim, d), cfg.q_dim),
        "router": normal((d, e), d),
        "w_gate": normal((e, d, f), d), "w_up": normal((e, d, f), d),
        "w_down": normal((e, f, d), f),
    }

  params = {
      "embed": jax.random.normal(next(keys), (cfg.vocab_size, d)) * cfg.init_scale,
      "layers": stacks.stack([layer() for _ in range(cfg.n_layers)], groups),
      "final_norm": jnp.ones((d,)),
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = normal((d, cfg.vocab_size), d)
  return params


def decoder_layer(cfg: ModelConfig, p: Params, h_BxTxD: jax.Array, pos_BxT: jax.Array,
                  path: LayerPath):
  """One block. Returns the new residual stream, the router probabilities and the experts."""
  b, t, _ = h_BxTxD.shape
  x = path.norm_act(h_BxTxD, p["attn_norm"], cfg.norm_eps, "attn_in")
  q, k, v = path.linears(x, p, ("wq", "wk", "wv"))
  q = q.reshape(b, t, cfg.n_heads, cfg.head_dim)
  k = k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  v = v.reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  q = L.rope(L.rms_norm(q, p["q_norm"], cfg.norm_eps), pos_BxT, cfg.rope_theta)
  k = L.rope(L.rms_norm(k, p["k_norm"], cfg.norm_eps), pos_BxT, cfg.rope_theta)
  o = path.attention(q, k, v)  # quantizes K and V at the kv sites first
  o = path.act(o.reshape(b, t, cfg.q_dim), "attn_out")
  h_BxTxD = h_BxTxD + path.linear(o, p["wo"], "wo")

  x, x_moe = path.norm_act(h_BxTxD, p["mlp_norm"], cfg.norm_eps, "moe_in", keep=True)
  probs = L.router_probs(x, p["router"])
  idx = path.route(probs)
  gates = L.gate_weights(probs, idx, cfg.norm_topk_prob)
  h_BxTxD = h_BxTxD + moe(cfg, p, x_moe, idx, gates, path)
  return h_BxTxD, probs, idx


def moe(cfg: ModelConfig, p: Params, x_BxTxD, idx_BxTxk, gates_BxTxk, path: LayerPath):
  """SwiGLU experts on the tokens routed to them, combined with the gate weights."""
  b, t, d = x_BxTxD.shape
  k = cfg.top_k
  dispatch = L.Dispatch(idx_BxTxk.reshape(b * t, k), cfg.n_experts)
  # each grouped matmul gathers its rows sorted by expert and gives them back per (token,
  # expert slot): the layout of the moe_mid site and its records
  g, u = path.experts(x_BxTxD, p, ("w_gate", "w_up"), dispatch.of_tokens)
  mid = path.act((jax.nn.silu(g) * u).reshape(b, t, k, cfg.d_ff), "moe_mid")
  ys, = path.experts(mid, p, ("w_down",), dispatch.of_slots)
  y = ys.reshape(b, t, k, d).astype(jnp.float32) * gates_BxTxk[..., None]
  # slot by slot in float32: a fixed order of adds, whatever batch or sharding XLA sees
  out = y[:, :, 0]
  for j in range(1, k):
    out = out + y[:, :, j]
  return out.astype(x_BxTxD.dtype)


def _keep(_, value):  # a sown value replaces the collection's (one per layer, never appended)
  return value


class DecoderLayer(nn.Module):
  """Layer i of the run [lo, hi) the path computes alike. Its params: the layer's dict (one of
  the scan's slices of the run's stack, or the layer itself unrolled), or with `indexed` the
  model's `layers` items whole, the layer read from them in place inside the scan's body
  (`stacks.take_traced`: weights without gradients need no scanned copy). Called as a scan's
  body: ((h, the run's carry), i, pos) -> ((h, carry), None)."""

  cfg: ModelConfig
  compute: Any  # the Path (linen's own `path` is the module's name path)
  lo: int
  hi: int
  indexed: bool = False

  def __call__(self, c, i, pos_BxT):
    h, carry = c
    p = self.variables["params"]
    if self.indexed:
      p = stacks.take_traced(p["items"], self.lo, self.hi, i)
    view = self.compute.layer(self.lo, self.hi, i, carry)
    h, probs, idx = decoder_layer(self.cfg, p, h, pos_BxT, view)
    for name, value in view.emit(probs, idx).items():
      self.sow(self.compute.collection, name, value, reduce_fn=_keep, init_fn=lambda: None)
    return (h, view.carry), None


class Qwen3MoE(nn.Module):
  """The decoder: embedding, the layers in the path's `runs` (each one `nn.scan` with `scan`,
  else layer by layer; `remat`: each layer recomputed in the backward pass), final norm and
  LM head. -> (float32 logits, each run's carry)."""

  cfg: ModelConfig
  compute: Any  # the Path
  runs: tuple[tuple[int, int], ...]
  scan: bool = True
  remat: bool = False

  @nn.compact
  def __call__(self, tokens_BxT, pos_BxT):
    cfg, path = self.cfg, self.compute
    embed = self.get_variable("params", "embed")
    h = jnp.take(embed, tokens_BxT, axis=0).astype(cfg.act_dtype)
    carries = []
    for lo, hi in self.runs:
      if self.scan:
        layer = nn.remat(DecoderLayer, prevent_cse=False) if self.remat else DecoderLayer
        scanned = {"params": 0} if path.differentiable else {}
        run = nn.scan(layer, variable_axes={path.collection: 0, **scanned},
                      variable_broadcast=False if path.differentiable else "params",
                      in_axes=(0, nn.broadcast), check_constancy_invariants=False)
        (h, carry), _ = run(cfg, path, lo, hi, indexed=not path.differentiable,
                            name=f"run_{lo}")((h, path.carry(lo, hi)), jnp.arange(lo, hi),
                                              pos_BxT)
        carries.append(carry)
      else:
        # i is static: each layer its own copy in the program, its view built with an int
        layer = nn.remat(DecoderLayer, static_argnums=(2,)) if self.remat else DecoderLayer
        for i in range(lo, hi):
          (h, carry), _ = layer(cfg, path, i, i + 1, name=f"layer_{i}")(
              (h, path.carry(i, i + 1)), i, pos_BxT)
          carries.append(carry)
    h = L.rms_norm(h, self.get_variable("params", "final_norm"), cfg.norm_eps)
    head = embed.T if cfg.tie_embeddings else self.get_variable("params", "lm_head")
    logits = jnp.dot(h, head.astype(h.dtype), preferred_element_type=jnp.float32)
    return logits, tuple(carries)


def module_params(cfg: ModelConfig, weights: Params, path: Path,
                  runs: tuple[tuple[int, int], ...], scan: bool) -> Params:
  """The weights (master params or rollout weights, in their stored layout) as `Qwen3MoE`'s
  params: a run's stack where it is scanned (`stacks.run_stack`: the stored stack in place
  where one covers the run), the layers' items whole where its body indexes them, one layer's
  dict per layer unrolled."""
  params = {"embed": weights["embed"], "final_norm": weights["final_norm"]}
  if not cfg.tie_embeddings:
    params["lm_head"] = weights["lm_head"]
  layers = weights["layers"]
  for lo, hi in runs:
    if scan and path.differentiable:
      params[f"run_{lo}"] = stacks.run_stack(layers, lo, hi)
    elif scan:
      params[f"run_{lo}"] = {"items": layers}
    else:
      params.update({f"layer_{i}": stacks.take(layers, i) for i in range(lo, hi)})
  return params


def forward(cfg: ModelConfig, weights: Params, tokens_BxT: jax.Array, pos_BxT: jax.Array,
            path: Path, *, scan: bool = True, remat: bool = False):
  """Logits (float32) and what the path collects from the layers (`path.collect`).

  Layers run in the path's runs (`path.runs`: consecutive layers it computes alike); with
  `scan` each run is one `nn.scan`, compiled once whatever its length, its per-layer outputs
  stacked by the scan; otherwise layer by layer (the same values, one copy of the layer per
  layer in the program). `remat`: each layer's activations are recomputed in the backward pass
  instead of kept (`nn.remat`)."""
  try:
    runs = path.runs(weights["layers"])
  except (KeyError, TypeError, AttributeError):
    keys = sorted(weights) if isinstance(weights, dict) else type(weights).__name__
    raise ValueError(f"weights {keys}: expected the master params ({{embed, layers, "
                     "final_norm, lm_head}}, init_params) or RolloutWeights (pack_weights)"
                     ) from None
  model = Qwen3MoE(cfg, path, runs, scan=scan, remat=remat)
  variables = {"params": module_params(cfg, weights, path, runs, scan)}
  (logits, carries), sown = model.apply(variables, tokens_BxT, pos_BxT,
                                        mutable=[path.collection])
  sown = sown.get(path.collection, {})
  if scan:
    outputs = [(lo, hi, sown.get(f"run_{lo}", {}), carry, True)
               for (lo, hi), carry in zip(runs, carries)]
  else:
    layers = [i for lo, hi in runs for i in range(lo, hi)]
    outputs = [(i, i + 1, sown.get(f"layer_{i}", {}), carry, False)
               for i, carry in zip(layers, carries)]
  return logits, path.collect(outputs)


def logits(cfg: ModelConfig, params: Params, tokens_BxT: jax.Array) -> jax.Array:
  """Teacher-forced logits without quantization, positions 0..T-1 (float32 [B, T, V])."""
  tokens_BxT = jnp.asarray(tokens_BxT)
  if tokens_BxT.ndim != 2:
    raise ValueError(f"tokens must be [batch, time], got shape {tokens_BxT.shape}")
  b, t = tokens_BxT.shape
  path = TrainPath(cfg, valid_BxT=jnp.ones((b, t), bool))  # the trainer's path, no recipe
  pos = jnp.broadcast_to(jnp.arange(t), (b, t))
  return forward(cfg, params, tokens_BxT, pos, path)[0]
