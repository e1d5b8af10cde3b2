"""The quantization recipe: which format at which site of which layer (DESIGN section 3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trace_jax.quant import BF16, NVFP4, NVFP4_TENSOR, Format, get_format

# activation sites (per token, blocks along the feature axis) and the KV-cache sites
ACT_SITES = ("attn_in", "attn_out", "moe_in", "moe_mid")
KV_SITES = ("k", "v")
SITES = ACT_SITES + KV_SITES
# projection weights and the axis they contract over (the axis their FP4 blocks run along)
WEIGHT_AXES = {"wq": 0, "wk": 0, "wv": 0, "wo": 0, "w_gate": 1, "w_up": 1, "w_down": 1}
PRECISIONS = ("bf16", "fp8", "mxfp4", "nvfp4")


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


@dataclasses.dataclass(frozen=True)
class QuantRecipe:
  """Formats for weights, activations and KV at the quantized layers; others stay bf16.

  Formats are names from `trace_jax.quant.FORMATS`. NVFP4 weights get one global scale per
  weight matrix (per expert for the expert stacks), activations one per token.
  """

  weights: str = "bf16"
  acts: str = "bf16"
  kv: str = "bf16"
  layers: str | tuple[int, ...] = "all"

  def __post_init__(self):
    for field in ("weights", "acts", "kv"):
      get_format(getattr(self, field))  # unknown names fail here, naming the choices
    if not isinstance(self.layers, str):
      object.__setattr__(self, "layers", tuple(self.layers))

  @classmethod
  def uniform(cls, precision: str, layers: str | Sequence[int] = "all") -> QuantRecipe:
    """One precision for weights, activations and KV: the rollout precisions of the ablation."""
    return cls(weights=precision, acts=precision, kv=precision, layers=layers)

  def quantized_layers(self, n_layers: int) -> tuple[int, ...]:
    return parse_layers(self.layers, n_layers, what="recipe.layers")

  def _fmt(self, name: str, layer: int, n_layers: int) -> Format:
    return get_format(name) if layer in self.quantized_layers(n_layers) else BF16

  def weight_format(self, layer: int, n_layers: int) -> Format:
    fmt = self._fmt(self.weights, layer, n_layers)
    return NVFP4_TENSOR if fmt == NVFP4 else fmt

  def site_format(self, site: str, layer: int, n_layers: int) -> Format:
    if site not in SITES:
      raise ValueError(f"unknown quantization site {site!r}; sites are {SITES}")
    return self._fmt(self.kv if site in KV_SITES else self.acts, layer, n_layers)

  def recorded_sites(self, layer: int, n_layers: int) -> tuple[str, ...]:
    """Sites of `layer` whose format has a record."""
    return tuple(s for s in SITES if self.site_format(s, layer, n_layers).has_record)
