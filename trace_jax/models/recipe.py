"""The quantization recipe: which format at which site of which layer (DESIGN section 3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trace_jax.quant import BF16, FORMATS, Format, get_format

# activation sites (per token, blocks along the feature axis) and the KV-cache sites
ACT_SITES = ("attn_in", "attn_out", "moe_in", "moe_mid")
KV_SITES = ("k", "v")
SITES = ACT_SITES + KV_SITES
# projection weights and the axis they contract over (the axis their FP4 blocks run along)
WEIGHT_AXES = {"wq": 0, "wk": 0, "wv": 0, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 1}
GROUPS = ("weights", "acts", "kv")  # what a recipe's formats are given for, besides single sites


def precisions() -> tuple[str, ...]:
  """The format names a recipe takes: every registered format (`trace_jax.quant.register`),
  read when asked, so a format registered later is a choice too."""
  return tuple(FORMATS)


def parse_layers(spec: str | Sequence[int] | None, n_layers: int, *, what: str = "layers") -> (
    tuple[int, ...]):
  """"none" | "all" | "last:N" | [indices] -> sorted layer indices, validated."""
  if spec is None or spec == "none":
    return ()
  if spec == "all":
    return tuple(range(n_layers))
  if isinstance(spec, str):
    if spec.startswith("last:") and spec[5:].isdigit():
      n = int(spec[5:])
      if not 0 <= n <= n_layers:
        raise ValueError(f"{what}={spec!r}: N must be in [0, {n_layers}] for {n_layers} layers")
      return tuple(range(n_layers - n, n_layers))
    raise ValueError(f"{what}={spec!r}: expected 'none', 'all', 'last:N' or a list of indices")
  layers = tuple(sorted({int(i) for i in spec}))
  bad = [i for i in layers if not 0 <= i < n_layers]
  if bad:
    raise ValueError(f"{what}={list(spec)}: indices {bad} out of range for {n_layers} layers")
  return layers


def _layers(value: str, spec: str) -> str | tuple[int, ...]:
  """A recipe string's layers: a `parse_layers` word, or indices and ranges joined by "+"."""
  if value in ("none", "all") or value.startswith("last:"):
    return value
  out = []
  for part in value.split("+"):
    lo, sep, hi = part.partition("-")
    if not (lo.isdigit() and (not sep or hi.isdigit())):
      raise ValueError(f"recipe {spec!r}: layers={value!r}: expected none, all, last:N or "
                       "indices and ranges joined by '+' (0-3+7)")
    out += range(int(lo), int(hi if sep else lo) + 1)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
  """Formats for weights, activations and KV at the quantized layers; others stay bf16.

  Formats are names of registered formats (`trace_jax.quant.FORMATS`). Weights are stored in
  their format's `for_weights()` (NVFP4: one global per matrix, per expert for the expert
  stacks); activations get one per token. `overrides`: (what, layers, format) rules applied in
  order after the base, where `what` is "weights", "acts", "kv" or a site name, `layers` a
  `parse_layers` spec; the last rule that covers a site of a layer wins. `parse` reads all of
  it from one string, so a recipe is a config value.
  """

  weights: str = "bf16"
  acts: str = "bf16"
  kv: str = "bf16"
  layers: str | tuple[int, ...] = "all"
  overrides: tuple[tuple[str, str | tuple[int, ...], str], ...] = ()

  def __post_init__(self):
    for field in ("weights", "acts", "kv"):
      get_format(getattr(self, field))  # unknown names fail here, naming the choices
    if not isinstance(self.layers, str):
      object.__setattr__(self, "layers", tuple(self.layers))
    rules = []
    for what, layers, fmt in self.overrides:
      if what not in GROUPS + SITES:
        raise ValueError(f"recipe override of {what!r}: choose one of {GROUPS + SITES}")
      get_format(fmt)
      rules.append((what, layers if isinstance(layers, str) else tuple(layers), fmt))
    object.__setattr__(self, "overrides", tuple(rules))

  @classmethod
  def uniform(cls, precision: str, layers: str | Sequence[int] = "all") -> QuantRecipe:
    """One precision for weights, activations and KV: the rollout precisions of the ablation."""
    return cls(weights=precision, acts=precision, kv=precision, layers=layers)

  @classmethod
  def parse(cls, spec: str) -> QuantRecipe:
    """A recipe from its string: rules separated by ";", each a comma-separated list of
    `key=value` (keys: weights, acts, kv, a site name, layers) or a bare format name (weights,
    acts and kv at once). The first rule is the base (its layers: the quantized ones, default
    all); each later one overrides its keys for its layers (default all). Within a rule the
    order of keys does not matter: a site's key beats its group's (acts, kv), which beats a
    bare format; across rules the later one wins. Format names are case-insensitive (stored
    lowercase). Layers: none, all, last:N, or indices and inclusive ranges joined by "+" ("0",
    "0-3+7"). E.g. "mxfp4", "weights=nvfp4,acts=mxfp4,kv=mxfp4",
    "mxfp4; layers=last:2,moe_mid=fp8" ("mxfp4; moe_mid=fp8,acts=nvfp4": moe_mid fp8, the other
    activation sites nvfp4)."""
    rules = [r.strip() for r in spec.split(";")]
    if not spec.strip() or not all(rules):
      raise ValueError(f"recipe {spec!r}: expected rules separated by ';'")
    parsed = []
    for rule in rules:
      kv = {}
      for item in (i.strip() for i in rule.split(",")):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:  # a bare format: weights, acts and kv
          key, value = "*", key
        if key not in ("*", "layers") + GROUPS + SITES:
          raise ValueError(f"recipe {spec!r}: unknown key {key!r}; keys are "
                           f"{('layers',) + GROUPS + SITES} or a format name")
        if key != "layers" and value.lower() not in FORMATS:
          raise ValueError(f"recipe {spec!r}: unknown format {value!r}; choose one of "
                           f"{precisions()}")
        kv[key] = _layers(value, spec) if key == "layers" else value.lower()
      parsed.append(kv)
    base = parsed[0]
    fmt = lambda kv, g: kv.get(g, kv.get("*", "bf16"))
    overrides = []
    for kv in parsed[1:]:  # applied in order: the narrower key last, so that it wins
      layers = kv.get("layers", "all")
      overrides += [(g, layers, fmt(kv, g)) for g in GROUPS if g in kv or "*" in kv]
      overrides += [(k, layers, v) for k, v in kv.items() if k in SITES]
    sites = [(k, v) for k, v in base.items() if k in SITES]
    overrides = [(k, base.get("layers", "all"), v) for k, v in sites] + overrides
    return cls(weights=fmt(base, "weights"), acts=fmt(base, "acts"), kv=fmt(base, "kv"),
               layers=base.get("layers", "all"), overrides=tuple(overrides))

  def check(self, n_layers: int) -> None:
    """Every layer spec of the recipe, validated against the model's depth."""
    self.quantized_layers(n_layers)
    for what, layers, _ in self.overrides:
      parse_layers(layers, n_layers, what=f"recipe override of {what}")

  def quantized_layers(self, n_layers: int) -> tuple[int, ...]:
    return parse_layers(self.layers, n_layers, what="recipe.layers")

  def _group_format(self, group: str, site: str | None, layer: int, n_layers: int) -> Format:
    name = getattr(self, group) if layer in self.quantized_layers(n_layers) else "bf16"
    for what, layers, fmt in self.overrides:
      if what in (group, site) and layer in parse_layers(layers, n_layers, what="recipe"):
        name = fmt
    return get_format(name)

  def weight_format(self, layer: int, n_layers: int) -> Format:
    return self._group_format("weights", None, layer, n_layers).for_weights()

  def site_format(self, site: str, layer: int, n_layers: int) -> Format:
    if site not in SITES:
      raise ValueError(f"unknown quantization site {site!r}; sites are {SITES}")
    return self._group_format("kv" if site in KV_SITES else "acts", site, layer, n_layers)

  def recorded_sites(self, layer: int, n_layers: int) -> tuple[str, ...]:
    """Sites of `layer` whose format has a record."""
    return tuple(s for s in SITES if self.site_format(s, layer, n_layers).has_record)
