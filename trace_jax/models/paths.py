"""The two execution paths of DESIGN section 4, and the weight sync between them.

`TrainPath`: dense weights fake-quantized from the float32 master params (straight-through),
activations and K/V fake-quantized at the same sites, guided by the rollout's records where they
exist, the full-sequence masked attention of a trainer.

`RolloutPath`: packed weights (`RolloutWeights`, made by `pack_weights`, the weight sync),
activations quantized with plain rounding (their records emitted), K/V written to a packed cache
and attended over with flash-decoding, as an inference engine computes; its matmuls, one-token
attention and quantization by the ops object it is given (`models.ops`: XLA's, or a kernel
backend's such as `pallas_kernels.dispatch.KernelOps`), XLA's where that computes none.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from trace_jax import quant
from trace_jax.models import layers as L
from trace_jax.models.config import ModelConfig
from trace_jax.models.ops import XLA
from trace_jax.models.recipe import WEIGHT_AXES, QuantRecipe
from trace_jax.quant import BF16

Records = dict[int, dict[str, quant.Record]]


def _per_matrix(fn, w: jax.Array, name: str):
  """Applies fn(w, axis) per weight matrix: expert stacks [E, ...] get one call per expert
  (NVFP4's per-tensor global is then per expert)."""
  axis = WEIGHT_AXES[name]
  if w.ndim == 3:
    return jax.vmap(lambda m: fn(m, axis=axis - 1))(w)
  return fn(w, axis=axis)


def _emit(store: dict, layer: int, site: str, value) -> None:
  store.setdefault(layer, {})[site] = value


# ----------------------------------------------------------------------------------------------
# training


class TrainPath:
  """The trainer's computation (see module docstring).

  `routes_LxBxTxk`: experts to replay instead of the trainer's top-k; `rollout_routes_LxBxTxk`
  (default: the replayed ones): the rollout's experts, which moe_mid records are laid out by. A
  moe_mid record guides a slot only where the trainer's expert is among the rollout's for that
  token (with that expert's record); other slots round to nearest.

  `guide_L` (bool [n_layers], traced): which layers' records guide; a layer set False rounds to
  nearest, the same values as without its record. `replay` (bool, traced): whether the given
  routes replace the trainer's top-k. Both let one compiled program serve every guidance and
  replay setting (the mismatch probe), where leaving records or routes out would compile one
  program per setting."""

  def __init__(self, cfg: ModelConfig, valid_BxT: jax.Array, recipe: QuantRecipe = QuantRecipe(),
               records: Records | None = None, routes_LxBxTxk: jax.Array | None = None,
               collect_codes: bool = False, code_recipe: QuantRecipe | None = None,
               rollout_routes_LxBxTxk: jax.Array | None = None, guide_L: jax.Array | None = None,
               replay: jax.Array | None = None):
    self.cfg, self.recipe, self.valid = cfg, recipe, valid_BxT
    self.records = records or {}
    self.guide_L, self.replay = guide_L, replay
    self.routes = routes_LxBxTxk
    self.rollout_routes = (routes_LxBxTxk if rollout_routes_LxBxTxk is None
                           else rollout_routes_LxBxTxk)
    self.collect_codes = collect_codes
    # the formats whose codes the diagnostics compare (the rollout's, also for a bf16 trainer)
    self.code_recipe = code_recipe or recipe
    self.codes: dict[int, dict[str, jax.Array]] = {}
    self.chosen: dict[int, jax.Array] = {}  # per layer, the experts the trainer used

  def weight(self, w: jax.Array, layer: int, name: str) -> jax.Array:
    fmt = self.recipe.weight_format(layer, self.cfg.n_layers)
    if fmt is BF16:
      return w
    return _per_matrix(functools.partial(quant.fake_quant, fmt=fmt), w, name)

  def linear(self, x, w, layer, name):
    return L.dense(x, self.weight(w, layer, name))

  def experts(self, x_MxD, w, group_sizes, layer, name):
    return L.grouped(x_MxD, self.weight(w, layer, name), group_sizes)

  def act(self, x, layer, site):
    fmt = self.recipe.site_format(site, layer, self.cfg.n_layers)
    rec = self.records.get(layer, {}).get(site) if fmt is not BF16 else None
    guided = None  # where the record guides, broadcast against x (None: everywhere)
    if rec is not None and site == "moe_mid":
      rec, guided = self._expert_records(rec, layer)
      guided = guided[..., None]  # per expert slot
    if rec is not None and self.guide_L is not None:
      guided = self.guide_L[layer] if guided is None else guided & self.guide_L[layer]
    if self.collect_codes:
      self._collect(x, layer, site, fmt, rec, guided)
    if fmt is BF16:
      return x
    if rec is None:
      return quant.fake_quant(x, fmt).astype(x.dtype)
    y = quant.guided_quant(x, rec, fmt)  # the rollout's codes, recovered: DESIGN section 5
    if guided is not None:
      y = jnp.where(guided, y, quant.fake_quant(x, fmt))
    return y.astype(x.dtype)

  def _expert_records(self, rec: quant.Record, layer: int):
    """moe_mid records are per (token, rollout slot): each trainer slot takes the record of the
    rollout's slot with its expert; where the rollout did not choose that expert, a record
    would carry another expert's scales and bits, so the slot is left unguided."""
    if self.rollout_routes is None:
      raise ValueError("moe_mid records are laid out by the rollout's experts: pass the "
                       "rollout's routes (recompute(rollout_routes=...) or routes=...)")
    ours_BxTxk = self.chosen[layer]
    guided_BxTxk, src_BxTxk = L.match_experts(
        ours_BxTxk, self.rollout_routes[layer].astype(ours_BxTxk.dtype))

    def take(a):  # [B, T, k, ...]: gather along the slot axis
      src = src_BxTxk.reshape(*src_BxTxk.shape, *(1,) * (a.ndim - 3))
      return jnp.take_along_axis(a, src, axis=2)

    return jax.tree.map(take, rec), guided_BxTxk

  def _collect(self, x, layer, site, fmt, rec, guided):
    code_fmt = self.code_recipe.site_format(site, layer, self.cfg.n_layers)
    if code_fmt is BF16:
      return
    nearest = lambda: quant.element_codes(quant.quantize(x, code_fmt))
    if rec is not None and code_fmt == fmt:
      codes = quant.guided_codes(x, rec, fmt)
      if guided is not None:
        codes = jnp.where(guided, codes, nearest())
    else:
      codes = nearest()
    _emit(self.codes, layer, site, jax.lax.stop_gradient(codes))

  def attention(self, q, k, v, layer):
    k = self.act(k, layer, "k")
    v = self.act(v, layer, "v")
    return L.full_attention(q, k, v, self.valid)

  def route(self, probs, layer):
    if self.routes is not None:  # routing replay: the rollout's experts, the trainer's gates
      idx = self.routes[layer].astype(jnp.int32)
      if self.replay is not None:
        idx = jnp.where(self.replay, idx, L.top_k_experts(probs, self.cfg.top_k))
    else:
      idx = L.top_k_experts(probs, self.cfg.top_k)
    self.chosen[layer] = idx
    return idx


# ----------------------------------------------------------------------------------------------
# rollout weights: the weight sync


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed", "layers", "final_norm", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RolloutWeights:
  """The rollout engine's weights: projections as packed `QArray`s (or in the layout of the
  ops' kernels, `ops.weight_layout`; bf16 arrays in layers the recipe leaves unquantized),
  embeddings and LM head in
  the activation dtype, router and norms as in the master params. A different type from the
  params, made only by `pack_weights`."""

  embed: jax.Array
  layers: list[dict[str, Any]]
  final_norm: jax.Array
  lm_head: jax.Array | None

  def __getitem__(self, key):
    return getattr(self, key)

  @property
  def nbytes(self) -> int:
    leaves = jax.tree.leaves(self)
    return sum(a.size * a.dtype.itemsize for a in leaves)


def pack_weights(cfg: ModelConfig, params: dict, recipe: QuantRecipe,
                 ops=XLA) -> RolloutWeights:
  """The weight sync: master params -> rollout weights, quantized as the recipe says, each
  projection laid out for the ops' kernels (`ops.weight_layout`: for the Pallas kernels the
  same bytes, permuted, once here rather than every step).

  Weights are deterministic functions of the params, so the trainer's fake-quantized weights
  dequantize to exactly these values."""
  dt = cfg.act_dtype
  layers = []
  for i, p in enumerate(params["layers"]):
    fmt = recipe.weight_format(i, cfg.n_layers)
    packed = dict(p)
    for name in WEIGHT_AXES:
      if fmt is BF16:
        packed[name] = p[name].astype(dt)
      else:
        packed[name] = ops.weight_layout(
            _per_matrix(functools.partial(quant.quantize, fmt=fmt), p[name], name))
    layers.append(packed)
  head = None if cfg.tie_embeddings else params["lm_head"].astype(dt)
  return RolloutWeights(embed=params["embed"].astype(dt), layers=layers,
                        final_norm=params["final_norm"], lm_head=head)


def unpack(w) -> jax.Array:
  """A rollout weight (or cache) packed by XLA's ops as a dense array (packed ones dequantized
  to float32); a kernel layout's through its ops' `dense`."""
  return XLA.dense(w)


# ----------------------------------------------------------------------------------------------
# rollout


def new_kv_cache(cfg: ModelConfig, recipe: QuantRecipe, batch: int, slots: int) -> list:
  """Per layer (K, V), each [B, S, K, Dh]: a packed QArray, or an array where unquantized."""
  shape = (batch, slots, cfg.n_kv_heads, cfg.head_dim)
  cache = []
  for i in range(cfg.n_layers):
    pair = []
    for site in ("k", "v"):
      fmt = recipe.site_format(site, i, cfg.n_layers)
      if fmt is BF16:
        pair.append(jnp.zeros(shape, cfg.act_dtype))
      else:  # zero bytes of the packed layout; unwritten slots are never attended to
        layout = jax.eval_shape(lambda f=fmt: quant.quantize(jnp.zeros(shape, cfg.act_dtype), f))
        pair.append(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), layout))
    cache.append(tuple(pair))
  return cache


def write_slots(buffer, new, start, axis: int = 1):
  """Writes `new` (any pytree of arrays) into `buffer` at `start` along `axis`."""
  return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype),
                                                                         start, axis), buffer, new)


class RolloutPath:
  """The inference engine's computation for T new positions written at cache slot `start`.

  `ops`: what computes its matmuls and quantization (every T) and its attention (T = 1, the
  decode step): `models.ops.XLA`, or a kernel backend's ops (`pallas_kernels.dispatch`), which
  say which formats and sizes their kernels take; the rest goes to XLA."""

  def __init__(self, cfg: ModelConfig, recipe: QuantRecipe, cache: list, start: jax.Array,
               q_slot_BxT: jax.Array, valid_BxS: jax.Array, record_layers: tuple[int, ...],
               attn_chunk: int, collect_codes: bool = False, ops=XLA):
    self.cfg, self.recipe, self.ops = cfg, recipe, ops
    self.cache, self.start = cache, start
    self.q_slot, self.valid = q_slot_BxT, valid_BxS
    self.record_layers = frozenset(record_layers)
    self.attn_chunk = attn_chunk
    self.collect_codes = collect_codes
    self.new_cache: list = list(cache)
    self.records: Records = {}
    self.codes: dict[int, dict[str, jax.Array]] = {}
    self.routes: list[jax.Array] = []

  def linear(self, x, w, layer, name):
    y = self.ops.linear(x, w)
    return L.dense(x, self.ops.dense(w)) if y is None else y

  def experts(self, x_MxD, w, group_sizes, layer, name):
    y = self.ops.experts(x_MxD, w, group_sizes)
    return L.grouped(x_MxD, self.ops.dense(w), group_sizes) if y is None else y

  def _quantize(self, x, layer, site):
    """-> (what to store: QArray or array, the values the engine computes with)."""
    fmt = self.recipe.site_format(site, layer, self.cfg.n_layers)
    if fmt is BF16:
      return x, x
    fused = self.ops.quantize(x, fmt)
    qa, rec = fused if fused is not None else (quant.quantize(x, fmt), None)
    if layer in self.record_layers:
      _emit(self.records, layer, site, quant.make_record(qa) if rec is None else rec)
    if self.collect_codes:
      _emit(self.codes, layer, site, quant.element_codes(qa))
    return qa, quant.dequantize(qa).astype(x.dtype)

  def act(self, x, layer, site):
    return self._quantize(x, layer, site)[1]

  def attention(self, q, k, v, layer):
    stored = tuple(self._quantize(a, layer, site)[0] for a, site in ((k, "k"), (v, "v")))
    cache = write_slots(self.cache[layer], stored, self.start)
    self.new_cache[layer] = cache
    if q.shape[1] == 1:
      slots = jnp.arange(self.valid.shape[1])
      mask = self.valid & (slots[None, :] <= self.q_slot[:, :1])
      o = self.ops.attention(q[:, 0], *cache, mask)
      if o is not None:
        return o[:, None]
    k_all, v_all = (self.ops.dense(c).astype(q.dtype) for c in cache)
    return L.flash_decode_attention(q, k_all, v_all, self.q_slot, self.valid, self.attn_chunk)

  def route(self, probs, layer):
    idx = L.top_k_experts(probs, self.cfg.top_k)
    self.routes.append(idx.astype(jnp.uint8))
    return idx
