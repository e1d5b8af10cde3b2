"""Train/rollout mismatch metrics of DESIGN section 7 (names are fixed: JSONL keys)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import sharding as S
from trace_jax.models import layers as L
from trace_jax.models.config import ModelConfig
from trace_jax.models.recipe import QuantRecipe
from trace_jax.rl import grpo


# the smallest non-zero per-token KL float32 log-probabilities resolve: r = logp_train -
# logp_rollout moves in ulps of logp, and one ulp at logp = -1 (2^-23) gives k3 = 2^-47
# (`grpo.k3`); means below it say that the two paths' log-probs agree to rounding
KL_RESOLUTION = 2.0**-47


def masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(jnp.where(mask > 0, x, 0.0)) / jnp.maximum(jnp.sum(mask), 1.0)


def masked_max(x, mask):
  return jnp.max(jnp.where(mask, x, -jnp.inf), initial=0.0)


def logp_mismatch(logp_rollout_BxL, logp_train_BxL, mask_BxL, *, prompt_width: int | None = None,
                  n_buckets: int = 8) -> dict[str, float | list]:
  """KL (k3, `grpo.k3`: sound down to `KL_RESOLUTION`), log-prob and probability differences
  over the masked (response) tokens. Both log-probs are of the full temperature-scaled
  distribution (`rollout.SamplingConfig`): under top_p < 1 these measure how far the two paths'
  policies are apart, not how far the trainer is from the nucleus that was sampled."""
  arrays = S.fetch(_logp_mismatch_jit(logp_rollout_BxL, logp_train_BxL, mask_BxL))
  return logp_mismatch_summary(arrays, mask_BxL, prompt_width=prompt_width, n_buckets=n_buckets)


LOGP_KEYS = ("mismatch/kl_k3", "mismatch/logp_abs_diff_mean", "mismatch/logp_abs_diff_max",
             "mismatch/prob_abs_diff_mean", "mismatch/prob_abs_diff_max")


def logp_mismatch_arrays(logp_rollout_BxL, logp_train_BxL, mask_BxL) -> dict[str, jax.Array]:
  """`logp_mismatch`'s numbers as arrays, and the per-token k3 (jittable: no host transfer)."""
  r = logp_train_BxL - logp_rollout_BxL
  k3 = grpo.k3(r)
  dp = jnp.abs(jnp.exp(logp_train_BxL) - jnp.exp(logp_rollout_BxL))
  values = (masked_mean(k3, mask_BxL), masked_mean(jnp.abs(r), mask_BxL),
            masked_max(jnp.abs(r), mask_BxL), masked_mean(dp, mask_BxL), masked_max(dp, mask_BxL))
  return {**dict(zip(LOGP_KEYS, values)), "k3_BxL": k3}


_logp_mismatch_jit = jax.jit(logp_mismatch_arrays)


def logp_mismatch_summary(arrays: dict, mask_BxL, *, prompt_width: int | None = None,
                          n_buckets: int = 8) -> dict[str, float | list]:
  """`logp_mismatch` from the host copy of `logp_mismatch_arrays` (`S.fetch`: whole on every
  process)."""
  out = {k: float(arrays[k]) for k in LOGP_KEYS}  # a dict through jit comes back sorted
  if prompt_width is not None:
    out["mismatch/kl_k3_by_position"] = kl_by_position(arrays["k3_BxL"], S.fetch(mask_BxL),
                                                       prompt_width, n_buckets)
  return out


def kl_by_position(k3_BxL, mask_BxL, prompt_width: int, n_buckets: int) -> list[float | None]:
  """Mean k3 in `n_buckets` equal buckets of response position (None where a bucket is empty)."""
  return by_position(k3_BxL, np.ones_like(k3_BxL), mask_BxL, prompt_width, n_buckets)


def by_position(num_BxL, den_BxL, mask_BxL, prompt_width: int, n_buckets: int):
  """sum(num) / sum(den) over masked tokens in equal buckets of response position."""
  num, den, mask = np.asarray(num_BxL), np.asarray(den_BxL), np.asarray(mask_BxL)
  n_resp = num.shape[1] - prompt_width
  edges = np.linspace(0, n_resp, n_buckets + 1).round().astype(int) + prompt_width
  out = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = mask[:, lo:hi]
    d = den[:, lo:hi][m].sum()
    out.append(float(num[:, lo:hi][m].sum() / d) if m.any() and d > 0 else None)
  return out


def flip_rates(cfg: ModelConfig, recipe: QuantRecipe, codes_rollout: dict, codes_train: dict,
               mask_BxT: jax.Array, *, routes_rollout: jax.Array | None = None,
               routes_train: jax.Array | None = None, prompt_width: int | None = None,
               n_buckets: int = 8) -> dict[str, float | list]:
  """Fraction of quantized elements whose code differs, overall and per site and layer.

  codes are {layer: {site: uint8 [B, T, ...]}}; -0 and +0 count as one code; only positions
  in mask_BxT count (those that predict response tokens). moe_mid codes are per (token, expert
  slot), and the two paths' top-k can differ: they are compared expert by expert (needs both
  paths' routes, [n_layers, B, T, k]), and an expert only one path chose has no code to
  compare (`route_flip_rate` counts those). With `prompt_width`, also the overall rate in
  buckets of the response position each position predicts.
  """
  _check_routes(codes_rollout, routes_rollout, routes_train)
  counts = S.fetch(_flip_counts_jit(cfg, recipe, codes_rollout, codes_train, mask_BxT,
                                           routes_rollout, routes_train))
  return flip_rates_summary(counts, codes_rollout, mask_BxT, prompt_width=prompt_width,
                            n_buckets=n_buckets)


def _sites(codes: dict) -> list[tuple[int, str]]:
  return [(layer, site) for layer in sorted(codes) for site in sorted(codes[layer])]


def _check_routes(codes_rollout, routes_rollout, routes_train):
  if any(site == "moe_mid" for _, site in _sites(codes_rollout)) and (
      routes_rollout is None or routes_train is None):
    raise ValueError("flip_rates: moe_mid codes are per expert slot; pass both paths' "
                     "routes (routes_rollout=, routes_train=)")


# compared codes a chunk of positions holds at most (one position at least): what bounds
# `flip_counts`' scratch memory, whatever the batch, length and depth
FLIP_CHUNK = 2**26


def flip_counts(cfg: ModelConfig, recipe: QuantRecipe, codes_rollout: dict, codes_train: dict,
                mask_BxT: jax.Array, routes_rollout: jax.Array | None = None,
                routes_train: jax.Array | None = None) -> dict[str, jax.Array]:
  """`flip_rates`' counts as arrays (jittable: no host transfer): per site, in `_sites` order,
  flipped and compared elements of each batch row (int32 [S, B]: exact, where float32 sums of
  a site's 1e8 codes would not be; the host adds the rows), and both summed over sites per
  position (int32 [B, T]). The positions are compared a chunk at a time, a chunk at most
  `FLIP_CHUNK` codes of every row, site and layer, so what the comparisons take besides the
  codes does not grow with the batch, the length or the depth (compared all at once, one long
  rollout's took 4 bytes a code of every layer); chunks of positions, not of rows, keep each
  device of a batch-split mesh on its own rows."""
  _check_routes(codes_rollout, routes_rollout, routes_train)
  sites = _sites(codes_rollout)
  b, t = mask_BxT.shape
  zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
  if not sites:
    return {"flips_SxB": zeros(0, b), "elems_SxB": zeros(0, b), "flips_BxT": zeros(b, t),
            "elems_BxT": zeros(b, t)}
  per_position = sum(int(np.prod(codes_rollout[layer][site].shape[::2]))
                     for layer, site in sites)  # [B, T, ...]: every row's codes but T's
  size = max(1, min(t, FLIP_CHUNK // per_position))
  mask_BxT = jnp.asarray(mask_BxT, bool)

  def counts(start, fresh_n):
    """Positions start .. start + n - 1 where fresh_n -> per site [B], and over the sites
    [B, n]."""
    n = fresh_n.shape[0]
    take = lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, start, n, axis)
    m = take(mask_BxT) & fresh_n
    flips_S, elems_S, flips_Bxn, elems_Bxn = [], [], 0, 0
    for layer, site in sites:
      c_r, c_t = take(codes_rollout[layer][site]), take(codes_train[layer][site])
      sign = recipe.site_format(site, layer, cfg.n_layers).codec.sign_bit
      canon = lambda c: jnp.where(c == sign, 0, c)
      w = jnp.broadcast_to(m.reshape(*m.shape, *(1,) * (c_r.ndim - 2)), c_r.shape)
      if site == "moe_mid":
        # the trainer's slot with the rollout slot's expert, where it has one
        shared_Bxnxk, src_Bxnxk = L.match_experts(take(routes_rollout[layer]),
                                                  take(routes_train[layer]))
        c_t = jnp.take_along_axis(c_t, src_Bxnxk[..., None], axis=2)
        w = w & shared_Bxnxk[..., None]
      each = lambda x: jnp.sum(x.reshape(b, n, -1), axis=-1, dtype=jnp.int32)
      flips, elems = each((canon(c_r) != canon(c_t)) & w), each(w)
      flips_S.append(jnp.sum(flips, axis=1))
      elems_S.append(jnp.sum(elems, axis=1))
      flips_Bxn, elems_Bxn = flips_Bxn + flips, elems_Bxn + elems
    return jnp.stack(flips_S), jnp.stack(elems_S), flips_Bxn, elems_Bxn

  def add(i, acc):  # chunk i; the last one ends at T, its positions counted before not again
    start = jnp.minimum(i * size, t - size)
    f_S, e_S, f_n, e_n = counts(start, start + jnp.arange(size) >= i * size)
    put = lambda a, x: jax.lax.dynamic_update_slice_in_dim(
        a, jax.lax.dynamic_slice_in_dim(a, start, size, 1) + x, start, axis=1)
    return acc[0] + f_S, acc[1] + e_S, put(acc[2], f_n), put(acc[3], e_n)

  acc = (zeros(len(sites), b), zeros(len(sites), b), zeros(b, t), zeros(b, t))
  chunks = -(-t // size)
  acc = add(0, acc) if chunks == 1 else jax.lax.fori_loop(0, chunks, add, acc)
  return dict(zip(("flips_SxB", "elems_SxB", "flips_BxT", "elems_BxT"), acc))


_flip_counts_jit = jax.jit(flip_counts, static_argnums=(0, 1))


def flip_rates_summary(counts: dict, codes_rollout: dict, mask_BxT, *,
                       prompt_width: int | None = None,
                       n_buckets: int = 8) -> dict[str, float | list]:
  """`flip_rates` from the host copy of `flip_counts` (codes_rollout: only its structure)."""
  out, n_flip, n_all = {}, 0.0, 0.0
  for (layer, site), f, e in zip(_sites(codes_rollout), counts["flips_SxB"], counts["elems_SxB"]):
    flips, total = (float(np.sum(x, dtype=np.int64)) for x in (f, e))
    out[f"mismatch/flip_rate/{site}/layer_{layer}"] = flips / max(total, 1.0)
    n_flip, n_all = n_flip + flips, n_all + total
  out["mismatch/flip_rate"] = n_flip / max(n_all, 1.0)
  if prompt_width is not None:  # position t predicts token t + 1: shift onto token positions
    shift = lambda a: np.pad(np.asarray(a), ((0, 0), (1, 0)))
    out["mismatch/flip_rate_by_position"] = by_position(
        shift(counts["flips_BxT"]), shift(counts["elems_BxT"]), shift(S.fetch(mask_BxT)),
        prompt_width, n_buckets)
  return out


def route_flip_rate(routes_rollout, routes_train, mask_BxT) -> float:
  """Fraction of (token, layer) whose top-k expert set differs (routes are sorted id sets)."""
  return float(route_flips(routes_rollout, routes_train, mask_BxT))


def route_flips(routes_rollout, routes_train, mask_BxT) -> jax.Array:
  """`route_flip_rate` as an array (jittable)."""
  differ = jnp.any(routes_rollout != routes_train, axis=-1)  # [L, B, T]
  return masked_mean(differ, jnp.broadcast_to(mask_BxT, differ.shape))


def record_bytes_per_token(records: dict, positions: int) -> float:
  """Record bytes per fed position (all layers and sites), from the arrays themselves."""
  leaves = jax.tree.leaves(records)
  return sum(a.size * a.dtype.itemsize for a in leaves) / max(positions, 1)
