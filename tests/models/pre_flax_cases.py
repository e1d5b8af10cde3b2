"""Deterministic forward passes of both paths, digested, from before the model became flax
modules: tests/models/test_pre_flax.py recomputes them and compares with the digests stored in
tests/models/data/pre_flax.json, so the modules compute exactly what the functions they
replaced did.

    python -m tests.models.pre_flax_cases  # rewrites the JSON (only from the code it pins)
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models import QuantRecipe, init_params, pack_weights, tiny
from trace_jax.models.qwen3_moe import forward
from trace_jax.models.rollout_path import RolloutPath
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "pre_flax.json")
PROMPTS = [[5, 6, 7, 8, 9], [12, 13], [14, 15, 16]]
N_LAYERS = 4
# runs [0, 2) and [2, 4), split by the weight format
RECIPE = "mxfp4; layers=2-3,weights=nvfp4"


def digest(tree) -> dict[str, list]:
  """Per leaf (by its path): [dtype, shape, sha256 of the bytes, the float64 sum rounded]."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(leaf)
    total = float(np.round(a.astype(np.float64).sum(), 6))
    out[jax.tree_util.keystr(path)] = [str(a.dtype), list(a.shape),
                                       hashlib.sha256(a.tobytes()).hexdigest(), total]
  return out


def setup(groups=(2, 2)):
  cfg = tiny(n_layers=N_LAYERS)
  return cfg, init_params(cfg, jax.random.PRNGKey(0), groups=groups), QuantRecipe.parse(RECIPE)


@functools.lru_cache(maxsize=None)  # the trainer's cases share one episode
def episode(scan_decode: bool, stacked: bool, groups=(2, 2)):
  """Prefill, decode, an observation (extend), decode: tokens, log-probs, records (all
  layers), codes, routes."""
  cfg, params, recipe = setup(groups)
  tokens, lengths = pad_prompts(PROMPTS)
  b, p = tokens.shape
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=6), records="all",
                         collect_codes=True, attn_chunk=8, scan_decode=scan_decode)
  w = pack_weights(cfg, params, recipe, stacked=stacked)
  state = engine.start(w, tokens, lengths, jax.random.PRNGKey(5), total=p + 9)
  state = engine.run(w, state, p + 3)
  state = engine.extend(w, state, jnp.full((b, 2), 9, jnp.int32))
  state = engine.run(w, state, p + 8)
  return engine.finish(state, p)


def prefill(scan: bool):
  """The engine's prefill pass as `forward` returns it: logits, records, codes, routes, cache."""
  cfg, params, recipe = setup()
  tokens, lengths = pad_prompts(PROMPTS)
  b, p = tokens.shape
  pad = p - jnp.asarray(lengths)
  valid = jnp.arange(8)[None, :] >= pad[:, None]
  pos = jnp.maximum(jnp.arange(p)[None, :] - pad[:, None], 0)
  path = RolloutPath(cfg, recipe, None, 0, jnp.broadcast_to(jnp.arange(p), (b, p)), valid,
                     (0, 3), 8, collect_codes=True)
  return jax.jit(lambda w: forward(cfg, w, tokens, pos, path, scan=scan))(
      pack_weights(cfg, params, recipe))


def train(scan: bool, remat: bool, guided: bool, groups=(2, 2)):
  """The trainer's pass over an episode: log-probs, aux loss, codes, routes, and the gradient
  of a loss of them. `guided`: with the episode's records, its routes replayed, guidance and
  replay as arrays."""
  cfg, params, recipe = setup(groups)
  batch = episode(True, True)
  kw = {}
  if guided:
    kw = dict(records=batch.records, routes=batch.routes,
              guide_layers=jnp.array([True, False, True, True]), replay=jnp.asarray(True))

  def loss(params):
    out = recompute(cfg, params, batch.tokens, batch.valid, recipe, collect_codes=True,
                    scan=scan, remat=remat, **kw)
    return jnp.sum(out.logp * batch.response_mask) + out.aux_loss, out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return {"out": out, "grads": grads}


def unquantized():
  """No recipe (the `logits` a bf16 trainer computes), one stack per layer."""
  cfg, params, _ = setup((1, 1, 1, 1))
  from trace_jax.models import logits
  tokens, _ = pad_prompts(PROMPTS)
  return jax.jit(lambda p: logits(cfg, p, tokens))(params)


CASES = {
    "episode/scanned": lambda: episode(True, True),
    "episode/unrolled": lambda: episode(False, False),
    "prefill/scan": lambda: prefill(True),
    "prefill/unrolled": lambda: prefill(False),
    "train/scan": lambda: train(True, False, False),
    "train/guided_scan": lambda: train(True, False, True),
    "train/guided_scan_remat": lambda: train(True, True, True),
    "train/guided_unrolled_remat": lambda: train(False, True, True),
    "train/guided_groups_1_3": lambda: train(True, False, True, (1, 3)),
    "logits/unquantized": unquantized,
}


def environment() -> dict:
  return {"jax": jax.__version__, "backend": jax.default_backend()}


def main():
  stored = {"environment": environment(),
            "cases": {name: digest(make()) for name, make in CASES.items()}}
  os.makedirs(os.path.dirname(DATA), exist_ok=True)
  with open(DATA, "w") as fh:
    json.dump(stored, fh, indent=1, sort_keys=True)
  print(f"wrote {len(CASES)} cases to {DATA}")


if __name__ == "__main__":
  main()
