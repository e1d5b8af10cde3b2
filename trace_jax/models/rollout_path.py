"""The rollout's execution path of DESIGN section 4, and the weight sync that feeds it.

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
from trace_jax.models import stacks
from trace_jax.models.config import ModelConfig
from trace_jax.models.ops import XLA
from trace_jax.models.paths import per_matrix
from trace_jax.models.recipe import SITES, WEIGHT_AXES, QuantRecipe
from trace_jax.quant import BF16, QArray


# ----------------------------------------------------------------------------------------------
# rollout weights: the weight sync


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["embed", "layers", "final_norm", "lm_head"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class RolloutWeights:
  """The rollout engine's weights: projections as packed `QArray`s (or in the layout of the
  ops' kernels, `ops.weight_layout`; bf16 arrays in layers the recipe leaves unquantized),
  embeddings and LM head in the activation dtype, router and norms as in the master params;
  `layers` one item per layer, or stacks of layers (`models.stacks`). A different type from the
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


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["sizes"])
@dataclasses.dataclass(frozen=True)
class Fused:
  """Projections of one input packed as one weight, their columns side by side (`sizes` of
  them each, in order), which one matmul computes; `_RolloutLayer.linears` splits its output.
  Stored under the projections' names joined by "+" (`fused_name`)."""

  w: Any
  sizes: tuple[int, ...]


def fused_name(names) -> str:
  return "+".join(names)


def _split(y, sizes) -> list:
  """A `Fused` weight's output, y [..., sum(sizes)], as its projections' outputs."""
  ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
  return [y[..., lo:hi] for lo, hi in zip([0] + ends[:-1], ends)]


def _side_by_side(ws: list):
  """Packed [..., K, N_i] weights (projections, or expert stacks) as one [..., K, sum N_i]
  whose columns are theirs, or None where their packing is not column by column (NVFP4's
  per-matrix global) or they differ in kind."""
  if all(isinstance(w, jax.Array) for w in ws) and len({w.dtype for w in ws}) == 1:
    return jnp.concatenate(ws, axis=-1)
  if not all(isinstance(w, QArray) for w in ws):
    return None
  first = ws[0]
  if any(w.fmt.name != first.fmt.name or w.axis != -2 or w.global_scale is not None
         or (w.scales is None) != (first.scales is None) for w in ws):
    return None
  cat = lambda arrays: jnp.concatenate(arrays, axis=-1)
  return QArray(cat([w.codes for w in ws]),
                None if first.scales is None else cat([w.scales for w in ws]), None,
                first.fmt, first.axis)


def lay_out(layer: dict, ops) -> dict:
  """A layer's packed weights as the ops' kernels read them: the groups the ops fuse
  (`ops.fuse`, projections of one input) side by side as one `Fused` weight where their packing
  allows, then each quantized weight in the ops' layout (`ops.weight_layout`)."""
  layer = dict(layer)
  for names in getattr(ops, "fuse", ()):
    w = _side_by_side([layer[n] for n in names])
    if w is not None:
      layer[fused_name(names)] = Fused(w, tuple(layer[n].shape[-1] for n in names))
      for n in names:
        del layer[n]

  def one(w):
    if isinstance(w, Fused):
      return Fused(one(w.w), w.sizes)
    return ops.weight_layout(w) if isinstance(w, QArray) else w
  return {k: one(w) for k, w in layer.items()}


def _pack_layer(cfg: ModelConfig, p: dict, fmt, ops) -> dict:
  """One layer's weights, each projection quantized as the recipe says, laid out for the ops
  (`lay_out`)."""
  packed = dict(p)
  for name in WEIGHT_AXES:
    packed[name] = (p[name].astype(cfg.act_dtype) if fmt is BF16 else
                    per_matrix(functools.partial(quant.quantize, fmt=fmt), p[name], name))
  return lay_out(packed, ops)


def pack_weights(cfg: ModelConfig, params: dict, recipe: QuantRecipe, ops=XLA, *,
                 stacked: bool = False) -> RolloutWeights:
  """The weight sync: master params -> rollout weights, quantized as the recipe says, each
  projection laid out for the ops' kernels (`ops.weight_layout`: for the Pallas kernels the
  same bytes, permuted, once here rather than every step). One item per layer, as the
  unrolled decode step reads them; `stacked`: in the master params' stacks (split where the
  recipe's weight format changes), as a scanned decode step reads them.

  Weights are deterministic functions of the params, so the trainer's fake-quantized weights
  dequantize to exactly these values."""
  dt, n = cfg.act_dtype, cfg.n_layers
  fmt = lambda i: recipe.weight_format(i, n)
  if stacked:
    layers = []
    for lo, hi in stacks.runs(n, fmt, stacks.starts(params["layers"])[1:-1]):
      run = stacks.run_stack(params["layers"], lo, hi)
      layers.append(jax.vmap(lambda p, f=fmt(lo): _pack_layer(cfg, p, f, ops))(run))
  else:
    layers = [_pack_layer(cfg, stacks.take(params["layers"], i), fmt(i), ops) for i in range(n)]
  head = None if cfg.tie_embeddings else params["lm_head"].astype(dt)
  return RolloutWeights(embed=params["embed"].astype(dt), layers=layers,
                        final_norm=params["final_norm"], lm_head=head)


def unpack(w) -> jax.Array:
  """A rollout weight (or cache) packed by XLA's ops as a dense array (packed ones dequantized
  to float32); a kernel layout's through its ops' `dense`."""
  return XLA.dense(w)


# ----------------------------------------------------------------------------------------------
# rollout


def layer_cache(cfg: ModelConfig, recipe: QuantRecipe, layer: int, batch: int, slots: int,
                stack: int | None = None) -> tuple:
  """(K, V) of one layer (or of `stack` layers alike, a leading layer axis), each
  [B, S, K, Dh]: a packed QArray, or an array where unquantized; zero bytes (unwritten slots
  are never attended to)."""
  shape = (batch, slots, cfg.n_kv_heads, cfg.head_dim)
  lead = () if stack is None else (stack,)
  pair = []
  for site in ("k", "v"):
    fmt = recipe.site_format(site, layer, cfg.n_layers)
    if fmt is BF16:
      pair.append(jnp.zeros(lead + shape, cfg.act_dtype))
    else:  # the packed layout's shapes
      layout = jax.eval_shape(lambda f=fmt: quant.quantize(jnp.zeros(shape, cfg.act_dtype), f))
      pair.append(jax.tree.map(lambda a: jnp.zeros(lead + a.shape, a.dtype), layout))
  return tuple(pair)


def new_kv_cache(cfg: ModelConfig, recipe: QuantRecipe, batch: int, slots: int) -> list:
  """Per layer (K, V), each [B, S, K, Dh] (`layer_cache`): the unrolled decode step's cache."""
  return [layer_cache(cfg, recipe, i, batch, slots) for i in range(cfg.n_layers)]


def write_slots(buffer, new, start, axis: int = 1):
  """Writes `new` (any pytree of arrays) into `buffer` at `start` along `axis`."""
  return jax.tree.map(lambda b, n: jax.lax.dynamic_update_slice_in_dim(b, n.astype(b.dtype),
                                                                         start, axis), buffer, new)


class RolloutPath:
  """The inference engine's computation for T new positions written at cache slot `start`.

  `cache`: per layer (K, V) (`new_kv_cache`), read layer by layer; with `stacked_cache` one
  stack per run of layers (`runs`, `layer_cache(stack=)`), each carried through its run's scan
  and written in place; None for a prefill: every layer starts from an empty cache of
  `valid_BxS.shape[1]` slots, only the new entries leave its scan, and the cache comes back in
  the layout `stacked_cache` says.
  `ops`: what computes its matmuls and quantization (every T) and its attention (T = 1, the
  decode step): `models.ops.XLA`, or a kernel backend's ops (`pallas_kernels.dispatch`), which
  say which formats and sizes their kernels take; the rest goes to XLA.

  What it collects (`collect`, from what the layers sow into `collection`): `records` {layer:
  {site: Record}} of `record_layers`, `codes` {layer: {site: codes}} with `collect_codes`,
  `routes` [n_layers, B, T, k] uint8, `cache` the new cache (a stacked one: the runs' scan
  carries), `stats` the ops' counts of its quantized activations (`ops.activation_stats`),
  summed over the layers.

  A matmul whose input is an activation the layer quantized (or its rows reordered by
  `rows`) is handed that activation's QArray too, for kernels that take codes and scales."""

  differentiable = False
  collection = "intermediates"

  def __init__(self, cfg: ModelConfig, recipe: QuantRecipe, cache: list | None,
               start: jax.Array, q_slot_BxT: jax.Array, valid_BxS: jax.Array,
               record_layers: tuple[int, ...], attn_chunk: int, collect_codes: bool = False,
               ops=XLA, stacked_cache: bool = False):
    self.cfg, self.recipe, self.ops = cfg, recipe, ops
    self.cache, self.start, self.stacked_cache = cache, start, stacked_cache
    self.q_slot, self.valid = q_slot_BxT, valid_BxS
    self.record_layers = frozenset(record_layers)
    self.attn_chunk = attn_chunk
    self.collect_codes = collect_codes

  def signature(self, layer: int) -> tuple:
    n = self.cfg.n_layers
    return (self.recipe.weight_format(layer, n),
            tuple(self.recipe.site_format(s, layer, n) for s in SITES),
            layer in self.record_layers)

  def runs(self, layers=None) -> tuple[tuple[int, int], ...]:
    return stacks.runs(self.cfg.n_layers, self.signature)

  def empty_cache(self) -> list:
    """An empty cache in this path's layout: per layer, or per run (`stacked_cache`)."""
    b, slots = self.valid.shape
    if self.stacked_cache:
      return [layer_cache(self.cfg, self.recipe, lo, b, slots, stack=hi - lo)
              for lo, hi in self.runs()]
    return [layer_cache(self.cfg, self.recipe, i, b, slots) for i in range(self.cfg.n_layers)]

  def carry(self, lo, hi):
    starts = [r[0] for r in self.runs()]
    if self.cache is None or not self.stacked_cache or lo not in starts:
      return None
    return self.cache[starts.index(lo)]

  def layer(self, lo, hi, i, carry) -> _RolloutLayer:
    if self.cache is None:
      b, slots = self.valid.shape
      return _RolloutLayer(self, lo, layer_cache(self.cfg, self.recipe, lo, b, slots))
    if self.stacked_cache:
      if isinstance(i, int):
        raise ValueError("a cache stacked per run of layers is read by a scan over them")
      return _RolloutLayer(self, lo, None, carry=carry, index=i - lo)
    if not isinstance(i, int):
      raise ValueError("a per-layer cache is read layer by layer, not by a scan over layers")
    return _RolloutLayer(self, lo, self.cache[i])

  def collect(self, outputs) -> dict:
    records, codes, routes, kv, stats = {}, {}, [], [], {}
    for lo, hi, out, _, stacked in outputs:
      for name, n in out["stats"].items():  # summed over the run's layers
        stats[name] = stats.get(name, 0) + (jnp.sum(n) if stacked else n)
      for j in range(hi - lo):
        one = jax.tree.map(lambda a: a[j], out) if stacked else out
        if one["records"]:
          records[lo + j] = one["records"]
        if one["codes"]:
          codes[lo + j] = one["codes"]
        routes.append(one["routes"])
        kv.append(one.get("kv"))  # none sown where the layers carry the cache
    if self.cache is not None and self.stacked_cache:  # the runs' carries, written in place
      cache = [carry for *_, carry, _ in outputs]
    elif self.cache is not None:
      cache = kv
    else:  # a prefill: only the new entries left its scans; written here into an empty cache
      cache = self.empty_cache()
      if self.stacked_cache:
        new = [jax.tree.map(lambda *a: jnp.stack(a), *kv[lo:hi]) for lo, hi in self.runs()]
        cache = [write_slots(c, n, self.start, axis=2) for c, n in zip(cache, new)]
      else:
        cache = [write_slots(c, n, self.start) for c, n in zip(cache, kv)]
    return {"records": records, "codes": codes, "routes": jnp.stack(routes), "cache": cache,
            "stats": stats}


class _RolloutLayer:
  """One layer of the engine's pass, with the formats of layer `rep`. Its cache: `cache_kv`
  before the new entries (a prefill's is empty: only the new entries leave the layer), or
  entry `index` of the run's stacked cache `carry` (written in place, carried on). A view lives
  for one layer's trace: what it gathers leaves through `emit`, sown by the layer's module."""

  def __init__(self, path: RolloutPath, rep: int, cache_kv, carry=None, index=None):
    self.path, self.rep, self.cache_kv = path, rep, cache_kv
    self.carry, self.index = carry, index
    self.records: dict[str, quant.Record] = {}
    self.codes: dict[str, jax.Array] = {}
    self.stats: dict[str, jax.Array] = {}
    self.kv = None
    # the activations this layer quantized, (the values computed with, their QArray): a
    # matmul handed one of those values gets its codes too (`ops.linear(xq=)`)
    self._quantized: list[tuple[jax.Array, quant.QArray]] = []

  def _qarray(self, x):
    return next((qa for value, qa in self._quantized if value is x), None)

  def linear(self, x, w, name):
    y = self.path.ops.linear(x, w, xq=self._qarray(x))
    return L.dense(x, self.path.ops.dense(w)) if y is None else y

  @staticmethod
  def _fused(p, names):
    """The `Fused` weight of the projections `names` in the layer's weights p, or None."""
    return p.get(fused_name(names)) if len(names) > 1 else None

  def linears(self, x, p, names):
    fused = self._fused(p, names)
    if fused is None:
      return [self.linear(x, p[n], n) for n in names]
    return _split(self.linear(x, fused.w, fused_name(names)), fused.sizes)

  def experts(self, x, p, names, rows):
    fused = self._fused(p, names)
    if fused is None:
      return [self._experts(x, p[n], rows) for n in names]
    return _split(self._experts(x, fused.w, rows), fused.sizes)

  def _experts(self, x, w, rows):
    x_RxD = x.reshape(-1, x.shape[-1])
    y = self.path.ops.experts(x_RxD, w, rows, xq=self._qarray(x))
    return L.grouped_rows(x_RxD, self.path.ops.dense(w), rows) if y is None else y

  def _quantize(self, x, site, values=True, rms_norm=None):
    """-> (what to store: QArray or array, the values the engine computes with, with
    `values`); with `rms_norm` (w, eps) x's RMSNorm is quantized, and returned third."""
    p = self.path
    fmt = p.recipe.site_format(site, self.rep, p.cfg.n_layers)
    # a fused kernel writes the values (and computes the norm) too where it can: no pass of
    # their own
    fused = None if fmt is BF16 else p.ops.quantize(x, fmt, values=values, rms_norm=rms_norm)
    if fused is None and rms_norm is not None:
      x = L.rms_norm(x, *rms_norm)
    if fmt is BF16:
      return x, x, x
    if fused is None:
      qa, rec, y = quant.quantize(x, fmt), None, None
    else:
      qa, rec, *rest = fused
      if rms_norm is not None:
        x, rest = rest[0], rest[1:]
      y = rest[0] if rest else None
    if self.rep in p.record_layers:
      self.records[site] = quant.make_record(qa) if rec is None else rec
    if p.collect_codes:
      self.codes[site] = quant.element_codes(qa)
    if values and y is None:
      y = quant.dequantize(qa).astype(x.dtype)
    return qa, y, x

  def act(self, x, site):
    qa, y, _ = self._quantize(x, site)
    return self._computed_with(y, qa)

  def norm_act(self, h, w, eps, site, keep=False):
    qa, y, x = self._quantize(h, site, rms_norm=(w, eps))
    y = self._computed_with(y, qa)
    return (x, y) if keep else y

  def _computed_with(self, y, qa):
    """y, the values a quantized site's QArray qa stands for (or its unquantized input), noted
    for the matmuls that take codes, its counts into the layer's stats."""
    if y is not qa:
      self._quantized.append((y, qa))
      for name, n in self.path.ops.activation_stats(qa).items():
        self.stats[name] = self.stats.get(name, 0) + n
    return y

  def attention(self, q, k, v):
    p = self.path
    stored = tuple(self._quantize(a, site, values=False)[0] for a, site in ((k, "k"), (v, "v")))
    if self.carry is None:
      cache = write_slots(self.cache_kv, stored, p.start)
      self.kv = stored if p.cache is None else cache
    else:  # the new entries into the run's stack, then this layer's part of it
      at = lambda a: (self.index, 0, p.start) + (0,) * (a.ndim - 3)
      self.carry = jax.tree.map(
          lambda c, n: jax.lax.dynamic_update_slice(c, n[None].astype(c.dtype), at(c)),
          self.carry, stored)
      cache = jax.tree.map(lambda c: jax.lax.dynamic_index_in_dim(c, self.index, keepdims=False),
                           self.carry)
    if q.shape[1] == 1:
      slots = jnp.arange(p.valid.shape[1])
      mask = p.valid & (slots[None, :] <= p.q_slot[:, :1])
      o = p.ops.attention(q[:, 0], *cache, mask)
      if o is not None:
        return o[:, None]
    k_all, v_all = (p.ops.dense(c).astype(q.dtype) for c in cache)
    return L.flash_decode_attention(q, k_all, v_all, p.q_slot, p.valid, p.attn_chunk)

  def route(self, probs):
    return L.top_k_experts(probs, self.path.cfg.top_k)

  def emit(self, probs, idx):
    out = {"records": self.records, "codes": self.codes, "routes": idx.astype(jnp.uint8),
           "stats": self.stats}
    return out if self.kv is None else {**out, "kv": self.kv}
