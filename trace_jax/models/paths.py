"""The trainer's execution path of DESIGN section 4 (the rollout's: `models.rollout_path`).

`TrainPath`: dense weights fake-quantized from the float32 master params (straight-through),
activations and K/V fake-quantized at the same sites, guided by the rollout's records where they
exist, the full-sequence masked attention of a trainer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from trace_jax import quant
from trace_jax.models import layers as L
from trace_jax.models import stacks
from trace_jax.models.config import ModelConfig
from trace_jax.models.recipe import SITES, WEIGHT_AXES, QuantRecipe
from trace_jax.quant import BF16

Records = dict[int, dict[str, quant.Record]]


def per_matrix(fn, w: jax.Array, name: str):
  """Applies fn(w, axis) per weight matrix: expert stacks [E, ...] get one call per expert
  (NVFP4's per-tensor global is then per expert)."""
  axis = WEIGHT_AXES[name]
  if w.ndim == 3:
    return jax.vmap(lambda m: fn(m, axis=axis - 1))(w)
  return fn(w, axis=axis)


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
  program per setting.

  `attention`: the trainer's attention by name (`layers.ATTENTIONS`: "full", the score matrix
  as XLA computes it, or "fused", jax.nn.dot_product_attention's fused kernel).

  What it collects (`collect`, from what the layers sow into `collection`): `aux` [n_layers]
  the load-balancing losses, `routes` [n_layers, B, T, k] uint8 the experts it used, `codes`
  {layer: {site: codes}} with `collect_codes`."""

  differentiable = True
  collection = "intermediates"

  def __init__(self, cfg: ModelConfig, valid_BxT: jax.Array, recipe: QuantRecipe = QuantRecipe(),
               records: Records | None = None, routes_LxBxTxk: jax.Array | None = None,
               collect_codes: bool = False, code_recipe: QuantRecipe | None = None,
               rollout_routes_LxBxTxk: jax.Array | None = None, guide_L: jax.Array | None = None,
               replay: jax.Array | None = None, attention: str = "full"):
    if attention not in L.ATTENTIONS:
      raise ValueError(f"attention={attention!r}: choose one of {tuple(L.ATTENTIONS)}")
    self.cfg, self.recipe, self.valid = cfg, recipe, valid_BxT
    self.attend = L.ATTENTIONS[attention]
    self.records = records or {}
    self.guide_L, self.replay = guide_L, replay
    self.routes = routes_LxBxTxk
    self.rollout_routes = (routes_LxBxTxk if rollout_routes_LxBxTxk is None
                           else rollout_routes_LxBxTxk)
    self.collect_codes = collect_codes
    # the formats whose codes the diagnostics compare (the rollout's, also for a bf16 trainer)
    self.code_recipe = code_recipe or recipe

  def signature(self, layer: int) -> tuple:
    """What a layer's program depends on besides its arrays: equal for layers scanned alike."""
    n = self.cfg.n_layers
    codes = (tuple(self.code_recipe.site_format(s, layer, n) for s in SITES)
             if self.collect_codes else ())
    return (self.recipe.weight_format(layer, n),
            tuple(self.recipe.site_format(s, layer, n) for s in SITES), codes,
            tuple(sorted(self.records.get(layer, {}))))

  def runs(self, layers) -> tuple[tuple[int, int], ...]:
    # split where the stored stacks are too: a scan reads a stack in place, a part of one copied
    return stacks.runs(self.cfg.n_layers, self.signature, stacks.starts(layers)[1:-1])

  def carry(self, lo, hi):
    return None

  def layer(self, lo, hi, i, carry) -> _TrainLayer:
    records = stacks.select([self.records.get(j, {}) for j in range(lo, hi)], i - lo)
    return _TrainLayer(self, lo, i, records)

  def collect(self, outputs) -> dict:
    per_layer = [out if stacked else jax.tree.map(lambda a: a[None], out)
                 for _, _, out, _, stacked in outputs]
    codes = {}
    for (lo, hi, *_), out in zip(outputs, per_layer):
      for j in range(hi - lo):
        if out["codes"]:
          codes[lo + j] = jax.tree.map(lambda a: a[j], out["codes"])
    return {"aux": jnp.concatenate([o["aux"] for o in per_layer]),
            "routes": jnp.concatenate([o["routes"] for o in per_layer]), "codes": codes}

  def weight(self, w: jax.Array, layer: int, name: str) -> jax.Array:
    fmt = self.recipe.weight_format(layer, self.cfg.n_layers)
    if fmt is BF16:
      return w
    return per_matrix(functools.partial(quant.fake_quant, fmt=fmt), w, name)


class _TrainLayer:
  """One layer of the trainer's pass: layer `i` (an int, or traced inside a scan), computed
  with the formats of layer `rep` (every layer of its run has them). A view lives for one
  layer's trace: what it gathers (codes, the experts it chose) leaves through `emit`, as the
  scan's per-layer outputs, sown by the layer's module."""

  carry = None  # the trainer's runs carry nothing from layer to layer

  def __init__(self, path: TrainPath, rep: int, i, records: dict):
    self.path, self.rep, self.i, self.records = path, rep, i, records
    self.codes: dict[str, jax.Array] = {}
    self.chosen = None  # the experts the trainer used
    # (x, rows, x's rows sorted by expert): gate and up take one gather, so that their
    # cotangents are summed on the sorted rows before one gather back (`L.take_rows`)
    self._sorted: list[tuple[jax.Array, L.ExpertRows, jax.Array]] = []

  def _format(self, site):
    return self.path.recipe.site_format(site, self.rep, self.path.cfg.n_layers)

  def linear(self, x, w, name):
    return L.dense(x, self.path.weight(w, self.rep, name))

  def linears(self, x, p, names):
    return [self.linear(x, p[n], n) for n in names]

  def experts(self, x, p, names, rows):
    return [self._experts(x, p[n], rows, n) for n in names]

  def _experts(self, x, w, rows, name):
    xs = next((s for a, r, s in self._sorted if a is x and r is rows), None)
    if xs is None:
      x_RxD = x.reshape(-1, x.shape[-1])
      xs = L.take_rows(x_RxD, rows.src, rows.back.reshape(x_RxD.shape[0], -1))
      self._sorted.append((x, rows, xs))
    ys = L.grouped(xs, self.path.weight(w, self.rep, name), rows.group_sizes)
    return L.take_rows(ys, rows.back, rows.order[:, None])

  def norm_act(self, h, w, eps, site, keep=False):
    x = L.rms_norm(h, w, eps)
    return (x, self.act(x, site)) if keep else self.act(x, site)

  def act(self, x, site):
    fmt = self._format(site)
    rec = self.records.get(site) if fmt is not BF16 else None
    guided = None  # where the record guides, broadcast against x (None: everywhere)
    if rec is not None and site == "moe_mid":
      rec, guided = self._expert_records(rec)
      guided = guided[..., None]  # per expert slot
    if rec is not None and self.path.guide_L is not None:
      guide = self.path.guide_L[self.i]
      guided = guide if guided is None else guided & guide
    if self.path.collect_codes:
      self._collect(x, site, fmt, rec, guided)
    if fmt is BF16:
      return x
    if rec is None:
      return quant.fake_quant(x, fmt).astype(x.dtype)
    y = quant.guided_quant(x, rec, fmt)  # the rollout's codes, recovered: DESIGN section 5
    if guided is not None:
      y = jnp.where(guided, y, quant.fake_quant(x, fmt))
    return y.astype(x.dtype)

  def _expert_records(self, rec: quant.Record):
    """moe_mid records are per (token, rollout slot): each trainer slot takes the record of the
    rollout's slot with its expert; where the rollout did not choose that expert, a record
    would carry another expert's scales and bits, so the slot is left unguided."""
    if self.path.rollout_routes is None:
      raise ValueError("moe_mid records are laid out by the rollout's experts: pass the "
                       "rollout's routes (recompute(rollout_routes=...) or routes=...)")
    ours_BxTxk = self.chosen
    guided_BxTxk, src_BxTxk = L.match_experts(
        ours_BxTxk, self.path.rollout_routes[self.i].astype(ours_BxTxk.dtype))

    def take(a):  # [B, T, k, ...]: gather along the slot axis
      src = src_BxTxk.reshape(*src_BxTxk.shape, *(1,) * (a.ndim - 3))
      return jnp.take_along_axis(a, src, axis=2)

    return jax.tree.map(take, rec), guided_BxTxk

  def _collect(self, x, site, fmt, rec, guided):
    code_fmt = self.path.code_recipe.site_format(site, self.rep, self.path.cfg.n_layers)
    if code_fmt is BF16:
      return
    nearest = lambda: quant.element_codes(quant.quantize(x, code_fmt))
    if rec is not None and code_fmt == fmt:
      codes = quant.guided_codes(x, rec, fmt)
      if guided is not None:
        codes = jnp.where(guided, codes, nearest())
    else:
      codes = nearest()
    self.codes[site] = jax.lax.stop_gradient(codes)

  def attention(self, q, k, v):
    k = self.act(k, "k")
    v = self.act(v, "v")
    return self.path.attend(q, k, v, self.path.valid)

  def route(self, probs):
    p = self.path
    if p.routes is not None:  # routing replay: the rollout's experts, the trainer's gates
      idx = p.routes[self.i].astype(jnp.int32)
      if p.replay is not None:
        idx = jnp.where(p.replay, idx, L.top_k_experts(probs, p.cfg.top_k))
    else:
      idx = L.top_k_experts(probs, p.cfg.top_k)
    self.chosen = idx
    return idx

  def emit(self, probs, idx):
    aux = L.load_balancing_loss(probs, idx, self.path.valid)
    return {"aux": aux, "routes": idx.astype(jnp.uint8), "codes": self.codes}
