"""GRPO's pure functions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.rl import grpo


def test_group_advantages_normalize_within_groups():
  r = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
  adv = np.asarray(grpo.group_advantages(r, 4))
  np.testing.assert_allclose(adv[:4], [np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3), -1 / np.sqrt(3)],
                             rtol=1e-4)
  np.testing.assert_array_equal(adv[4:], 0.0)  # a group that agrees teaches nothing


def test_policy_loss_is_the_clipped_surrogate():
  logp_old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
  logp = jnp.log(jnp.array([[0.5, 0.9, 0.1]]))
  mask = jnp.array([[True, True, False]])
  loss, clip_frac = grpo.policy_loss(logp, logp_old, jnp.array([1.0]), mask, jnp.ones((1, 3)), 0.2)
  # ratio 1 -> -1; ratio 1.8 is clipped to 1.2 -> -1.2; the masked token does not count
  assert float(loss) == pytest.approx(-(1.0 + 1.2) / 2)
  assert float(clip_frac) == pytest.approx(0.5)
  # gradient of a clipped token is zero; masked -inf log-probs stay out of the gradient
  logp = logp.at[0, 2].set(-jnp.inf)
  g = jax.grad(lambda lp: grpo.policy_loss(lp, logp_old, jnp.array([1.0]), mask,
                                           jnp.ones((1, 3)), 0.2)[0])(logp)
  np.testing.assert_allclose(np.asarray(g), [[-0.5, 0.0, 0.0]], atol=1e-6)


def test_rollout_corrections():
  old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
  rollout = jnp.log(jnp.array([[0.5, 0.1, 0.9]]))  # ratios 1, 5, 0.56
  np.testing.assert_allclose(np.asarray(grpo.rollout_correction(old, rollout, "tis", 2.0)),
                             [[1.0, 2.0, 0.5 / 0.9]], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(grpo.rollout_correction(old, rollout, "mis", 2.0)),
                                [[1.0, 0.0, 1.0]])
  np.testing.assert_array_equal(np.asarray(grpo.rollout_correction(old, rollout, "none", 2.0)),
                                1.0)
  with pytest.raises(ValueError, match="tis.*got 'is'"):
    grpo.rollout_correction(old, rollout, "is", 2.0)


def test_kl_k3():
  lp = jnp.log(jnp.array([[0.5, 0.2]]))
  ref = jnp.log(jnp.array([[0.25, 0.2]]))
  d = np.log(0.5)
  assert float(grpo.kl_k3(lp, ref, jnp.array([[True, True]]))) == pytest.approx(
      (np.exp(d) - d - 1) / 2, rel=1e-5)
