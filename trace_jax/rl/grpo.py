"""GRPO as pure functions (DESIGN section 8): advantages, rollout correction, the clipped loss.

Shapes: P prompts x G samples = B sequences of L tokens; masks select response tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CORRECTIONS = ("none", "tis", "mis")


def group_advantages(rewards_B: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
  """(r - mean of its group) / (std of its group + eps); groups are consecutive samples."""
  r = rewards_B.reshape(-1, group_size)
  adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1)


def rollout_correction(logp_old_BxL, logp_rollout_BxL, mode: str, cap: float) -> jax.Array:
  """Per-token importance weight of the trainer's policy against the rollout's.

  tis: truncated ratio min(pi_train / pi_rollout, cap); mis: 1 where the ratio is in
  [1/cap, cap], else 0 (the token is masked out); none: 1.
  """
  if mode not in CORRECTIONS:
    raise ValueError(f"rollout correction must be one of {CORRECTIONS}, got {mode!r}")
  ratio = jnp.exp(jnp.clip(logp_old_BxL - logp_rollout_BxL, -30.0, 30.0))
  if mode == "tis":
    w = jnp.minimum(ratio, cap)
  elif mode == "mis":
    w = ((ratio <= cap) & (ratio >= 1.0 / cap)).astype(jnp.float32)
  else:
    w = jnp.ones_like(ratio)
  return jax.lax.stop_gradient(w)


def policy_loss(logp_BxL, logp_old_BxL, adv_B, mask_BxL, weights_BxL, clip_eps: float):
  """Token-level PPO-clip objective (a mean over all response tokens of the batch).

  -> (loss, fraction of tokens where the clipped term was the active one)
  """
  # masked tokens (padding, prompt) never enter exp: no inf there, so no 0 * inf in gradients
  log_ratio = jnp.where(mask_BxL, logp_BxL - logp_old_BxL, 0.0)
  ratio = jnp.exp(log_ratio)
  adv = adv_B[:, None]
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
  per_token = jnp.where(mask_BxL, -jnp.minimum(unclipped, clipped) * weights_BxL, 0.0)
  n = jnp.maximum(jnp.sum(mask_BxL), 1)
  clip_frac = jnp.sum(mask_BxL & (clipped < unclipped)) / n
  return jnp.sum(per_token) / n, clip_frac


# below this |r|, expm1(r) - r has lost float32 digits to cancellation (it is off by up to an
# ulp of r against r^2 / 2: 1e-6 relative here, 1e-3 at 1e-4); the Taylor series, to r^7, is
# exact to float32 rounding there
_K3_SERIES_BELOW = 0.1


def k3(r: jax.Array) -> jax.Array:
  """e^r - r - 1, the k3 KL estimator's summand, in float32: >= 0 and within 1e-5 relative of
  its exact value for every finite r whose square is a normal float32 (|r| > ~1e-18; measured:
  2e-7 for |r| in [1e-9, 0.1), 6e-6 in [0.1, 1)), where e^r - r - 1 is rounding noise of
  +-6e-8 below |r| ~ 3e-4 and goes negative. expm1(r) - r, and for |r| < 0.1 the series
  r^2/2 (1 + r/3 (1 + r/4 (1 + r/5 (1 + r/6 (1 + r/7))))).

  What limits a KL computed from float32 log-probabilities is then r itself: it is resolved to
  an ulp of the log-probability (1.2e-7 at logp = -1), so the smallest non-zero per-token KL is
  ulp^2 / 2 (7e-15 at logp = -1; `metrics.KL_RESOLUTION`)."""
  small = jnp.abs(r) < _K3_SERIES_BELOW
  s = jnp.where(small, r, 0.0)  # the unused branch sees a harmless value, also in gradients
  h = 1.0 + s / 7.0
  for n in (6.0, 5.0, 4.0, 3.0):
    h = 1.0 + s / n * h
  return jnp.where(small, 0.5 * s * s * h, jnp.expm1(r) - r)


def kl_k3(logp_BxL, logp_ref_BxL, mask_BxL) -> jax.Array:
  """k3 estimate of KL(pi || pi_ref) on the sampled tokens: e^d - d - 1 with d = ref - pi."""
  d = jnp.where(mask_BxL, logp_ref_BxL - logp_BxL, 0.0)
  return jnp.sum(k3(d)) / jnp.maximum(jnp.sum(mask_BxL), 1)
