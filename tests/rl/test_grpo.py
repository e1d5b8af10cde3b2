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


def _k3_64(r):
  r = np.asarray(r, np.float64)
  return np.expm1(r) - r


def _small_r(seed, n=4000):
  """float32 r with |r| log-uniform in [1e-7, 1e-2], either sign."""
  rng = np.random.default_rng(seed)
  mag = 10.0 ** rng.uniform(-7, -2, n)
  return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float32)


def test_kl_k3_is_sound_for_tiny_log_ratios():
  """e^r - r - 1 in float32 is rounding noise for |r| under ~3e-4 (one ulp of e^r is 1.2e-7)
  and goes negative; the estimator must stay >= 0 and close to its float64 value down to
  |r| = 1e-7, both in the KL penalty and in the mismatch metric."""
  from trace_jax.rl import metrics as M
  r = _small_r(0)
  zero, one = jnp.zeros((1,)), jnp.ones((1, 1), bool)
  per_token = np.asarray(jax.vmap(lambda d: grpo.kl_k3(zero[None], d[None, None], one))(r))
  metric = np.array([M.logp_mismatch(np.zeros((1, 1), np.float32), np.array([[x]]),
                                     np.ones((1, 1), bool))["mismatch/kl_k3"] for x in r[:200]])
  want = _k3_64(r)
  assert (per_token >= 0).all() and (metric >= 0).all()
  np.testing.assert_allclose(per_token, want, rtol=1e-5)
  np.testing.assert_allclose(metric, want[:200], rtol=1e-5)


def test_kl_k3_where_the_old_estimate_went_negative():
  from trace_jax.rl import metrics as M
  r = _small_r(1)
  old = np.exp(r) - r - np.float32(1.0)  # float32 throughout, as the metric computed it
  neg = r[old < 0][:400]
  assert len(neg) == 400  # 491 of these 4000 r: a mean over them came out negative
  mask = np.ones((1, len(neg)), bool)
  want = _k3_64(neg).mean()
  assert float(grpo.kl_k3(jnp.zeros((1, len(neg))), jnp.asarray(neg)[None], mask)) == (
      pytest.approx(want, rel=1e-3))
  m = M.logp_mismatch(np.zeros((1, len(neg)), np.float32), neg[None], mask, prompt_width=0,
                      n_buckets=4)
  assert m["mismatch/kl_k3"] == pytest.approx(want, rel=1e-3)
  quarters = _k3_64(neg).reshape(4, -1).mean(axis=1)
  np.testing.assert_allclose(m["mismatch/kl_k3_by_position"], quarters, rtol=1e-3)


def test_kl_k3_gradient_is_the_exact_one():
  """d/dlogp of k3(ref - logp) is 1 - e^(ref - logp), finite and right on both branches."""
  d = jnp.array([[1e-6, -3e-3, 0.5, -4.0, 0.0]])
  g = jax.grad(lambda lp: grpo.kl_k3(lp, d, jnp.ones(d.shape, bool)))(jnp.zeros(d.shape))
  np.testing.assert_allclose(np.asarray(g), -np.expm1(np.asarray(d, np.float64)) / d.size,
                             rtol=1e-4, atol=1e-12)
