"""Building blocks of the decoder: norms, RoPE, the two attentions, MoE routing and dispatch.

Shapes in names: B batch, T query positions, S key positions (cache slots), D d_model, H query
heads, K kv heads, G = H / K, Dh head_dim, E experts, k experts per token, F expert d_ff.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

# a large finite negative instead of -inf keeps fully masked rows (left padding) NaN-free
_MASKED = -1e30


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """Qwen3 RMSNorm: normalize in float32, cast back, then scale (the Hugging Face order)."""
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return w.astype(x.dtype) * xf.astype(x.dtype)


def rope(x_BxTxNxDh: jax.Array, pos_BxT: jax.Array, theta: float) -> jax.Array:
  """Rotate-half RoPE at integer positions."""
  dh = x_BxTxNxDh.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  freqs = pos_BxT.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x_BxTxNxDh.dtype), jnp.sin(emb).astype(x_BxTxNxDh.dtype)
  x1, x2 = jnp.split(x_BxTxNxDh, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxDh * cos + rotated * sin


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w in the activation dtype with float32 accumulation."""
  y = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return y.astype(x.dtype)


def grouped(x_MxD: jax.Array, w_ExDxF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """Rows of x sorted by expert times their expert's matrix, float32 accumulation."""
  y = jax.lax.ragged_dot(x_MxD, w_ExDxF.astype(x_MxD.dtype), group_sizes_E,
                         preferred_element_type=jnp.float32)
  return y.astype(x_MxD.dtype)


# Gathers whose gradients gather too. Autodiff transposes a gather into a scatter-add, which
# XLA's deterministic GPU ops (trace_jax.determinism) compute as a sort and a scan of its own: a
# warm-start step of the long-horizon `gpu` policy took 3.3x the GPU time with them. Where
# each row of the operand is taken a known number of times, at known places, the gradient is a
# gather of those places and a sum in a fixed order instead.


@jax.custom_vjp
def take_rows(x_RxD: jax.Array, idx_N: jax.Array, places_RxK: jax.Array) -> jax.Array:
  """x[idx], for an idx that takes each row r of x exactly K times, to the rows places[r] of
  the result. Its gradient: row r's K cotangents gathered and summed in slot order (the
  scatter-add's value bit for bit for K <= 2, which adds to a zero first)."""
  return x_RxD[idx_N]


def _take_rows_fwd(x_RxD, idx_N, places_RxK):
  return x_RxD[idx_N], places_RxK


def _take_rows_bwd(places_RxK, g_NxD):
  g = g_NxD[places_RxK[:, 0]]
  for j in range(1, places_RxK.shape[1]):
    g = g + g_NxD[places_RxK[:, j]]
  return g, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def take_last(x: jax.Array, idx: jax.Array) -> jax.Array:
  """jnp.take_along_axis(x, idx, axis=-1) for indices 0 <= idx < x.shape[-1] (a token's
  experts, one target): its gradient is the sum of the cotangents whose index matches each
  place, a select and a sum, where autodiff's is a scatter-add (the same values)."""
  return jnp.take_along_axis(x, idx, axis=-1)


def _take_last_fwd(x, idx):
  return jnp.take_along_axis(x, idx, axis=-1), (idx, x.shape[-1])


def _take_last_bwd(res, g):
  idx, n = res
  at = idx[..., :, None] == jnp.arange(n)  # [..., k, n]
  return jnp.sum(jnp.where(at, g[..., :, None], jnp.zeros((), g.dtype)), axis=-2), None


take_last.defvjp(_take_last_fwd, _take_last_bwd)


class ExpertRows(NamedTuple):
  """The rows a grouped matmul takes and gives around its sort by expert: sorted row i is row
  `src[i]` of its input (`group_sizes[e]` rows for expert e, in expert order), and output row
  j is sorted row `back[j]`. A kernel composes the two gathers with those of its own tiling.
  `slots` (a dispatch's): the same rows per output row, (its expert, its input row), in the
  order of a stable sort by expert; a kernel can place the rows from these with no sort.
  `order` (a dispatch's): back's inverse, sorted row i is output row order[i]; with `back`,
  the places of each row that the trainer's gradients gather from (`take_rows`)."""

  src: jax.Array
  back: jax.Array
  group_sizes: jax.Array
  slots: tuple[jax.Array, jax.Array] | None = None
  order: jax.Array | None = None


def grouped_rows(x_RxD: jax.Array, w_ExDxF: jax.Array, rows: ExpertRows) -> jax.Array:
  """`grouped` around the sort: grouped(x[rows.src])[rows.back]."""
  return grouped(x_RxD[rows.src], w_ExDxF, rows.group_sizes)[rows.back]


def _grouped_scores(q_BxTxHxDh, k_BxSxKxDh):
  b, t, h, dh = q_BxTxHxDh.shape
  kv = k_BxSxKxDh.shape[2]
  q = q_BxTxHxDh.reshape(b, t, kv, h // kv, dh)
  s = jnp.einsum("btkgd,bskd->bkgts", q, k_BxSxKxDh, preferred_element_type=jnp.float32)
  return s * (dh**-0.5)


def full_attention(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, valid_BxT) -> jax.Array:
  """The trainer's attention: the whole causal, padding-masked score matrix, one softmax.

  The G query heads of a kv head are laid out as one run of G x T rows ([B, K, G*T, Dh]), so
  that each matmul of the backward pass, K's and V's gradients included (sums over G and T),
  contracts one dimension of the score matrix as it lies, and the [T, T] matrices are not
  transposed in memory: the same products and sums as heads and positions kept apart, at 1.5x
  the speed forward and backward on CPU and 1.45x on an H100. Compiled alone on CPU, the
  outputs and gradients are those of heads apart bit for bit (tests/models/test_model.py); on
  the H100 its matmuls sum in another order (q's gradient 3e-5 apart, relative), and inside a
  whole trainer step XLA may order a gradient's sums otherwise (seen on CPU: the same
  log-probabilities, parameter gradients that differ in bf16 rounding)."""
  b, t, h, dh = q_BxTxHxDh.shape
  kv = k_BxTxKxDh.shape[2]
  g = h // kv
  q = q_BxTxHxDh.reshape(b, t, kv, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, dh)
  s = jnp.einsum("bkqd,bskd->bkqs", q, k_BxTxKxDh, preferred_element_type=jnp.float32)
  s = (s * (dh**-0.5)).reshape(b, kv, g, t, t)
  causal = jnp.tril(jnp.ones((t, t), bool))
  mask = causal[None, None, None] & valid_BxT[:, None, None, None, :]
  p = jax.nn.softmax(jnp.where(mask, s, _MASKED), axis=-1).astype(q_BxTxHxDh.dtype)
  o = jnp.einsum("bkqs,bskd->bkqd", p.reshape(b, kv, g * t, t), v_BxTxKxDh,
                 preferred_element_type=jnp.float32)
  o = o.reshape(b, kv, g, t, dh).transpose(0, 3, 1, 2, 4)
  return o.reshape(b, t, h, dh).astype(q_BxTxHxDh.dtype)


def fused_attention(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, valid_BxT) -> jax.Array:
  """`full_attention`'s causal, padding-masked attention by `jax.nn.dot_product_attention`:
  cuDNN's fused kernel on a GPU (no head's [T, T] scores in memory; 4x `full_attention`'s speed
  forward and backward at a 1 540-token episode on an H100, BENCHMARKS.md), XLA's composition of
  it elsewhere. The mask goes in as a bf16 bias (0 or -1e9) of [B, 1, T, T], one for all heads,
  so any padding works; the probabilities and the backward's sums are cuDNN's, not the full
  attention's (q's gradient 3e-3 apart, relative, on that GPU), which is why the trainer takes
  it only when asked (`rl.attention=fused`; the warm start's, `sft.attention=fused`). cuDNN
  takes a biased attention's gradient at even lengths only: an odd one is padded by a slot that
  no query sees, and the extra query's row is dropped."""
  t = q_BxTxHxDh.shape[1]
  # jax's own default (implementation=None) is XLA's composition on every backend
  implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
  pad = t % 2 if implementation == "cudnn" else 0
  if pad:
    q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0)))
                                          for a in (q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh))
    valid_BxT = jnp.pad(valid_BxT, ((0, 0), (0, pad)))
  n = t + pad
  mask = jnp.tril(jnp.ones((n, n), bool))[None, None] & valid_BxT[:, None, None, :]
  bias = jnp.where(mask, 0.0, -1e9).astype(q_BxTxHxDh.dtype)
  out = jax.nn.dot_product_attention(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh, bias=bias,
                                     implementation=implementation)
  return out[:, :t]


# the trainer's attention by name (`rl.attention`): the score matrix as XLA computes it, or
# jax.nn.dot_product_attention's fused kernel
ATTENTIONS = {"full": full_attention, "fused": fused_attention}


def flash_decode_attention(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_slot_BxT, valid_BxS,
                           chunk: int) -> jax.Array:
  """The inference engine's attention over a cache, split along the sequence (flash-decoding).

  Each chunk of `chunk` slots gets its own running max, sum and output; the partials are then
  combined with an online-softmax rescale. Query i sees slots <= q_slot[i] that are valid.
  """
  b, t, h, dh = q_BxTxHxDh.shape
  s_len, kv = k_BxSxKxDh.shape[1], k_BxSxKxDh.shape[2]
  if s_len % chunk:
    raise ValueError(f"cache length {s_len} is not a multiple of the attention chunk {chunk}")
  n = s_len // chunk
  s = _grouped_scores(q_BxTxHxDh, k_BxSxKxDh)  # [B, K, G, T, S]
  slots = jnp.arange(s_len)
  mask = (slots[None, None, :] <= q_slot_BxT[:, :, None]) & valid_BxS[:, None, :]  # [B, T, S]
  s = jnp.where(mask[:, None, None], s, _MASKED).reshape(*s.shape[:-1], n, chunk)
  m_c = jnp.max(s, axis=-1)  # [B, K, G, T, n]
  p_c = jnp.exp(s - m_c[..., None])
  p_c = jnp.where(mask.reshape(b, 1, 1, t, n, chunk), p_c, 0.0)
  l_c = jnp.sum(p_c, axis=-1)
  v_c = v_BxSxKxDh.reshape(b, n, chunk, kv, dh)
  o_c = jnp.einsum("bkgtnc,bnckd->bkgtnd", p_c.astype(q_BxTxHxDh.dtype), v_c,
                   preferred_element_type=jnp.float32)
  m = jnp.max(m_c, axis=-1, keepdims=True)
  w_c = jnp.exp(m_c - m)
  l = jnp.sum(w_c * l_c, axis=-1)
  o = jnp.sum(w_c[..., None] * o_c, axis=-2) / jnp.maximum(l, 1e-30)[..., None]
  return jnp.einsum("bkgtd->btkgd", o).reshape(b, t, h, dh).astype(q_BxTxHxDh.dtype)


def router_probs(x_BxTxD: jax.Array, w_DxE: jax.Array) -> jax.Array:
  """Router in float32 (high precision at every quantization setting)."""
  logits = jnp.dot(x_BxTxD.astype(jnp.float32), w_DxE.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  return jax.nn.softmax(logits, axis=-1)


def top_k_experts(probs_BxTxE: jax.Array, k: int) -> jax.Array:
  """Top-k expert ids per token, in ascending id order (a set: the slot layout of records)."""
  _, idx = jax.lax.top_k(probs_BxTxE, k)
  # a token's ids are distinct: each goes to the place of its rank, the count of smaller ids
  # (a fusion of compares and sums, where a sort would be a GPU kernel of its own)
  rank = jnp.sum(idx[..., None, :] < idx[..., :, None], axis=-1)
  at_rank = rank[..., :, None] == jnp.arange(k)
  return jnp.sum(jnp.where(at_rank, idx[..., :, None], 0), axis=-2).astype(idx.dtype)


def match_experts(idx_BxTxk: jax.Array, ref_BxTxk: jax.Array) -> tuple[jax.Array, jax.Array]:
  """For each slot of idx: whether its expert is among ref's k for that token, and the slot of
  ref that holds it (0 where none). Two top-k's of a token can differ in their sets, and a
  shared expert can sit in another slot (slots are in ascending id order)."""
  same_BxTxkxk = idx_BxTxk[..., :, None] == ref_BxTxk[..., None, :]
  return jnp.any(same_BxTxkxk, axis=-1), jnp.argmax(same_BxTxkxk, axis=-1)


def gate_weights(probs_BxTxE, idx_BxTxk, renormalize: bool):
  gates = take_last(probs_BxTxE, idx_BxTxk)
  if renormalize:
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
  return gates


def load_balancing_loss(probs_BxTxE, idx_BxTxk, mask_BxT) -> jax.Array:
  """Switch-style auxiliary loss as Qwen3-MoE computes it: E * sum_{k,e} f_{k,e} * P_e."""
  e = probs_BxTxE.shape[-1]
  w = mask_BxT.astype(jnp.float32)
  denom = jnp.maximum(jnp.sum(w), 1.0)
  f = jnp.einsum("btke,bt->ke", jax.nn.one_hot(idx_BxTxk, e), w) / denom
  p = jnp.einsum("bte,bt->e", probs_BxTxE, w) / denom
  return e * jnp.sum(f * p[None, :])


class Dispatch:
  """The experts' rows for grouped matmuls (`ExpertRows`): the (token, expert slot) pairs sorted
  by expert, and the way back to slot order (token, k)."""

  def __init__(self, idx_MxK: jax.Array, n_experts: int):
    flat = idx_MxK.reshape(-1)
    self.k, self.experts = idx_MxK.shape[-1], flat
    self.order = jnp.argsort(flat, stable=True)
    # the permutation's inverse by a scatter (a sort would be another GPU kernel)
    self.inverse = jnp.zeros_like(self.order).at[self.order].set(
        jnp.arange(flat.size, dtype=self.order.dtype), unique_indices=True)
    self.group_sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)

  # one object each (a path that gathers the sorted rows once for gate and up knows them by it)
  @functools.cached_property
  def of_tokens(self) -> ExpertRows:
    """From one row per token [M, D] to one per slot [M x k, F]."""
    return ExpertRows(self.order // self.k, self.inverse, self.group_sizes,
                      (self.experts, jnp.arange(self.experts.size) // self.k), self.order)

  @functools.cached_property
  def of_slots(self) -> ExpertRows:
    """From one row per slot [M x k, F] to one per slot [M x k, D]."""
    return ExpertRows(self.order, self.inverse, self.group_sizes,
                      (self.experts, jnp.arange(self.experts.size)), self.order)
