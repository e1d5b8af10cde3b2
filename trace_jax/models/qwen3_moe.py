"""The Qwen3-MoE decoder, written once for the rollout engine and the trainer.

How each quantization site, projection and attention is computed is the job of the `path`
argument: the trainer's path (`trace_jax.models.paths`) fake-quantizes master params and guides
activations by records; the rollout's (`trace_jax.models.rollout_path`) multiplies packed FP4
weights and attends over a packed KV cache. This file only says what is computed, in which
order; `forward` runs the layers the path computes alike as one `lax.scan` over their stacked
params (`models.stacks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.models.config import ModelConfig
from trace_jax.models.paths import TrainPath

Params = dict[str, Any]


class LayerPath(Protocol):
  """How one layer computes the parts where rollout and training differ, and what it emits."""

  def linear(self, x: jax.Array, w: Any, name: str) -> jax.Array: ...

  def experts(self, x_MxD: jax.Array, w: Any, group_sizes: jax.Array, name: str) -> jax.Array: ...

  def act(self, x: jax.Array, site: str) -> jax.Array: ...

  def attention(self, q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh) -> jax.Array: ...

  def route(self, probs_BxTxE: jax.Array) -> jax.Array: ...

  def finish(self, probs_BxTxE: jax.Array, idx_BxTxk: jax.Array) -> tuple[Any, Any]:
    """-> (the run's carry after this layer, this layer's outputs)."""


class Path(Protocol):
  """A forward pass's computation: which layers run alike (one scan each), each layer's view,
  and what the per-layer outputs become."""

  differentiable: bool  # whether gradients flow to the weights (scanned as the scan's input)

  def runs(self, layers: list) -> tuple[tuple[int, int], ...]: ...

  def carry(self, lo: int, hi: int) -> Any: ...

  def layer(self, lo: int, hi: int, i, carry) -> LayerPath: ...

  def collect(self, outputs: list) -> Any: ...


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
  x = L.rms_norm(h_BxTxD, p["attn_norm"], cfg.norm_eps)
  x = path.act(x, "attn_in")
  q = path.linear(x, p["wq"], "wq").reshape(b, t, cfg.n_heads, cfg.head_dim)
  k = path.linear(x, p["wk"], "wk").reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  v = path.linear(x, p["wv"], "wv").reshape(b, t, cfg.n_kv_heads, cfg.head_dim)
  q = L.rope(L.rms_norm(q, p["q_norm"], cfg.norm_eps), pos_BxT, cfg.rope_theta)
  k = L.rope(L.rms_norm(k, p["k_norm"], cfg.norm_eps), pos_BxT, cfg.rope_theta)
  o = path.attention(q, k, v)  # quantizes K and V at the kv sites first
  o = path.act(o.reshape(b, t, cfg.q_dim), "attn_out")
  h_BxTxD = h_BxTxD + path.linear(o, p["wo"], "wo")

  x = L.rms_norm(h_BxTxD, p["mlp_norm"], cfg.norm_eps)
  probs = L.router_probs(x, p["router"])
  idx = path.route(probs)
  gates = L.gate_weights(probs, idx, cfg.norm_topk_prob)
  x = path.act(x, "moe_in")
  h_BxTxD = h_BxTxD + moe(cfg, p, x, idx, gates, path)
  return h_BxTxD, probs, idx


def moe(cfg: ModelConfig, p: Params, x_BxTxD, idx_BxTxk, gates_BxTxk, path: LayerPath):
  """SwiGLU experts on the tokens routed to them, combined with the gate weights."""
  b, t, d = x_BxTxD.shape
  k = cfg.top_k
  dispatch = L.Dispatch(idx_BxTxk.reshape(b * t, k), cfg.n_experts)
  xs = dispatch.sort_tokens(x_BxTxD.reshape(b * t, d))
  g = path.experts(xs, p["w_gate"], dispatch.group_sizes, "w_gate")
  u = path.experts(xs, p["w_up"], dispatch.group_sizes, "w_up")
  mid = jax.nn.silu(g) * u
  # the moe_mid site is laid out per (token, expert slot), as its records are
  mid = path.act(dispatch.unsort(mid).reshape(b, t, k, cfg.d_ff), "moe_mid")
  ys = path.experts(dispatch.sort_slots(mid.reshape(b * t * k, cfg.d_ff)), p["w_down"],
                    dispatch.group_sizes, "w_down")
  y = dispatch.unsort(ys).reshape(b, t, k, d).astype(jnp.float32) * gates_BxTxk[..., None]
  # slot by slot in float32: a fixed order of adds, whatever batch or sharding XLA sees
  out = y[:, :, 0]
  for j in range(1, k):
    out = out + y[:, :, j]
  return out.astype(x_BxTxD.dtype)


def forward(cfg: ModelConfig, weights: Params, tokens_BxT: jax.Array, pos_BxT: jax.Array,
            path: Path, *, scan: bool = True, remat: bool = False):
  """Logits (float32) and what the path collects from the layers (`path.collect`).

  Layers run in the path's runs (`path.runs`: consecutive layers it computes alike); with
  `scan` each run is one `lax.scan`, compiled once whatever its length, its per-layer outputs
  stacked by the scan; otherwise layer by layer (the same values, one copy of the layer per
  layer in the program). `remat`: each layer's activations are recomputed in the backward pass
  instead of kept (`jax.checkpoint`)."""
  h = jnp.take(weights["embed"], tokens_BxT, axis=0).astype(cfg.act_dtype)
  layers = weights["layers"]
  outputs = []
  for lo, hi in path.runs(layers):

    def one(h, carry, i, p, lo=lo, hi=hi):
      view = path.layer(lo, hi, i, carry)
      h, probs, idx = decoder_layer(cfg, p, h, pos_BxT, view)
      carry, out = view.finish(probs, idx)
      return h, carry, out

    if scan:
      # a stored stack is read in place; weights without gradients are indexed in the body
      w = stacks.run_stack(layers, lo, hi) if path.differentiable else None

      def body(c, x, one=one, lo=lo, hi=hi):
        i, p = x
        p = stacks.take_traced(layers, lo, hi, i) if p is None else p
        h, carry, out = one(*c, i, p)
        return (h, carry), out

      body = jax.checkpoint(body, prevent_cse=False) if remat else body
      (h, carry), out = jax.lax.scan(body, (h, path.carry(lo, hi)), (jnp.arange(lo, hi), w))
      outputs.append((lo, hi, out, carry, True))
    else:
      for i in range(lo, hi):
        step = lambda h, carry, p, i=i, one=one: one(h, carry, i, p)
        step = jax.checkpoint(step) if remat else step
        h, carry, out = step(h, path.carry(i, i + 1), stacks.take(layers, i))
        outputs.append((i, i + 1, out, carry, False))
  h = L.rms_norm(h, weights["final_norm"], cfg.norm_eps)
  head = weights["embed"].T if cfg.tie_embeddings else weights["lm_head"]
  logits = jnp.dot(h, head.astype(h.dtype), preferred_element_type=jnp.float32)
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
