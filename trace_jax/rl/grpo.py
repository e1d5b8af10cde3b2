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


def kl_k3(logp_BxL, logp_ref_BxL, mask_BxL) -> jax.Array:
  """k3 estimate of KL(pi || pi_ref) on the sampled tokens: e^d - d - 1 with d = ref - pi."""
  d = jnp.where(mask_BxL, logp_ref_BxL - logp_BxL, 0.0)
  return jnp.sum(jnp.exp(d) - d - 1.0) / jnp.maximum(jnp.sum(mask_BxL), 1)
