"""The training path: one teacher-forced pass over prompt + response (DESIGN section 4)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trace_jax.models import layers as L
from trace_jax.models.config import ModelConfig
from trace_jax.models.paths import Records, TrainPath
from trace_jax.models.qwen3_moe import forward
from trace_jax.models.recipe import QuantRecipe


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["logp", "aux_loss", "codes", "routes"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TrainOutputs:
  """logp [B, L]: log-prob of tokens[:, j] given tokens[:, :j] (0 at j = 0); aux_loss: the mean
  load-balancing loss over layers; codes {layer: {site: codes}} when collected; routes
  [n_layers, B, L-1, k]: the experts the trainer used."""

  logp: jax.Array
  aux_loss: jax.Array
  codes: dict
  routes: jax.Array


def recompute(cfg: ModelConfig, params: dict, tokens_BxL: jax.Array, valid_BxL: jax.Array,
              recipe: QuantRecipe = QuantRecipe(), *, records: Records | None = None,
              routes: jax.Array | None = None, temperature: float = 1.0,
              collect_codes: bool = False, code_recipe: QuantRecipe | None = None,
              rollout_routes: jax.Array | None = None, guide_layers: jax.Array | None = None,
              replay: jax.Array | None = None, scan: bool = True,
              remat: bool = False, attention: str = "full") -> TrainOutputs:
  """Fake-quantized forward over tokens[:, :-1], scored on tokens[:, 1:].

  records: the rollout's records (arrays [B, L-1, ...]); sites without one round to nearest.
  routes: [n_layers, B, L-1, k] expert ids to replay instead of the trainer's own top-k.
  rollout_routes: the rollout's expert ids (default: `routes`), needed with moe_mid records,
  which are laid out by them: a record guides only the slots whose expert the rollout chose.
  collect_codes: also return each site's element codes in the formats of `code_recipe`
  (default: `recipe`), for flip rates against the rollout's.
  guide_layers: bool [n_layers], which layers' records guide (the others round to nearest, as
  without a record); replay: bool, whether `routes` replace the trainer's top-k. Both are
  arrays, so one compiled program serves every guidance and replay setting.
  scan / remat: `forward`'s (each run of layers one lax.scan; each layer recomputed in the
  backward pass); neither changes a value. attention: `TrainPath`'s ("full" | "fused").
  """
  inputs, targets = tokens_BxL[:, :-1], tokens_BxL[:, 1:]
  valid = valid_BxL[:, :-1]
  pos = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
  path = TrainPath(cfg, valid, recipe, records, routes, collect_codes, code_recipe,
                   rollout_routes, guide_layers, replay, attention)
  logits, out = forward(cfg, params, inputs, pos, path, scan=scan, remat=remat)
  if temperature > 0:
    logits = logits / temperature
  logp = L.take_last(jax.nn.log_softmax(logits, axis=-1), targets[..., None])
  logp = jnp.pad(logp[..., 0], ((0, 0), (1, 0)))
  return TrainOutputs(logp=logp, aux_loss=jnp.mean(out["aux"]), codes=out["codes"],
                      routes=out["routes"])
