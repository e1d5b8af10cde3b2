"""MoE dispatch rows for the grouped kernels' tests."""

import jax

from trace_jax.models import layers as L


def routed_rows(seed: int, tokens: int, top_k: int, experts: int, per_token: bool):
  """A MoE dispatch's rows (`layers.Dispatch`): random routes of `tokens` tokens to `top_k`
  distinct experts each; the grouped matmul takes one row per token or per (token, slot)."""
  keys = jax.random.split(jax.random.PRNGKey(seed), tokens)
  idx = jax.vmap(lambda k: jax.random.permutation(k, experts)[:top_k])(keys)
  d = L.Dispatch(idx, experts)
  return d.of_tokens if per_token else d.of_slots
