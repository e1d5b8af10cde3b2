"""The FP4 rollout engine: prefill, then a jitted decode loop over a packed KV cache.

Prompts are left-padded so that every sequence writes the same cache slot at each step; slot j
holds token j of the padded sequence (prompt, then response). The engine returns the tokens,
the response mask, its own log-probabilities of the sampled tokens and the records of DESIGN
section 5 for every position the trainer recomputes (all but the last token).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models.config import ModelConfig
from pallas_kernels.dispatch import make_ops
from trace_jax.models.rollout_path import RolloutPath, RolloutWeights, write_slots
from trace_jax.models.qwen3_moe import forward
from trace_jax.models.recipe import QuantRecipe, parse_layers


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """temperature 0 is greedy; log-probabilities are always of softmax(logits / temperature)
  (temperature 1 when greedy), before top-p truncation.

  That is the distribution the trainer recomputes (`recompute(..., temperature=)`), so the PPO
  ratio and the mismatch metrics compare the two paths' same distribution, also under top_p < 1.
  Tokens are then drawn from the renormalised nucleus, which neither log-probability describes:
  an importance weight against the sampling distribution would need the nucleus on both paths
  (the rollout's kept set replayed in the trainer), so the RL config refuses top_p < 1 together
  with a rollout correction (`validate`)."""

  max_new_tokens: int = 64
  temperature: float = 1.0
  top_p: float = 1.0
  stop_tokens: tuple[int, ...] = ()
  pad_id: int = 0

  def __post_init__(self):
    if self.max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tokens", "valid", "response_mask", "logp", "records", "routes",
                                "codes", "stats"],
                   meta_fields=["prompt_width"])
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  """What a rollout hands the trainer. L = prompt_width + max_new_tokens.

  tokens [B, L] int32, valid [B, L] (False on left padding), response_mask [B, L] (sampled tokens
  up to and including a stop token), logp [B, L] (the rollout's log-prob of tokens[:, j] at
  response positions, 0 elsewhere), records {layer: {site: Record}} with arrays [B, L-1, ...],
  routes [n_layers, B, L-1, k] uint8 expert ids, codes {layer: {site: uint8 codes}} (diagnostics),
  stats {name: int32} the engine's ops' counts over every layer and step (with W4A4:
  "w4a4_fold_misses", the activation blocks that took the kernel's exact branch).
  """

  tokens: jax.Array
  valid: jax.Array
  response_mask: jax.Array
  logp: jax.Array
  records: dict
  routes: jax.Array | None
  codes: dict | None
  prompt_width: int
  stats: dict = dataclasses.field(default_factory=dict)


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists -> (tokens [B, P] int32, lengths [B])."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("every prompt needs at least one token")
  width = max(len(p) for p in prompts)
  out = np.full((len(prompts), width), pad_id, np.int32)
  for i, p in enumerate(prompts):
    out[i, width - len(p):] = p
  return out, np.array([len(p) for p in prompts], np.int32)


def sample(key, logits_BxV, temperature: float, top_p: float):
  """-> (token ids [B], their log-probabilities [B])."""
  if temperature == 0:
    logp_all = jax.nn.log_softmax(logits_BxV, axis=-1)
    tok = jnp.argmax(logits_BxV, axis=-1)
  else:
    logp_all = jax.nn.log_softmax(logits_BxV / temperature, axis=-1)
    masked = logp_all
    if top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
      desc = jnp.sort(logp_all, axis=-1)[:, ::-1]
      before = jnp.cumsum(jnp.exp(desc), axis=-1) - jnp.exp(desc)
      threshold = jnp.min(jnp.where(before < top_p, desc, jnp.inf), axis=-1, keepdims=True)
      masked = jnp.where(logp_all >= threshold, logp_all, -jnp.inf)
    tok = jax.random.categorical(key, masked, axis=-1)
  return tok.astype(jnp.int32), jnp.take_along_axis(logp_all, tok[:, None], axis=-1)[:, 0]


def _zeros_like_slots(tree, slots: int, axis: int):
  def alloc(a):
    shape = list(a.shape)
    shape[axis] = slots
    return jnp.zeros(shape, a.dtype)
  return jax.tree.map(alloc, tree)


class RolloutEngine:
  """Batched generation with a recipe, records for `records` layers and routing decisions.

  `records`: "none" | "all" | "last:N" | [layer indices]. `collect_codes` also returns every
  quantized site's element codes (large; for the mismatch probe). `attn_chunk`: the sequence
  split of flash-decoding. `kernels`: "xla", "tokamax" (a bf16 baseline: the experts and the
  bf16 decode attention on the tokamax package's kernels, `pallas_kernels.dispatch.TokamaxOps`)
  or "pallas" for the Pallas matmul, decode attention and quantize-and-record kernels (GPU, or
  interpret mode elsewhere; `pallas_kernels.dispatch` says which run where and how their
  numbers relate to XLA's), made into the ops object its path computes with (`self.ops`); the
  Mosaic FP4 matmuls take weights packed for them (`pack_weights(..., ops=engine.ops)`),
  plainly packed ones run the Triton kernels. `attention_kernel`: the decode attention's
  backend under "pallas": "auto" (the Mosaic kernel for MXFP4 caches on Hopper, the Triton
  one otherwise, as measured), "triton" or "mosaic" (on Hopper; Triton elsewhere).
  `scan_decode`: the decode step (and `extend`) as one
  `lax.scan` per run of layers over a cache stacked per run (compiled once whatever the depth;
  its weights best stacked too: `pack_weights(..., stacked=True)`), or layer by layer over a
  per-layer cache (False, the default). The prefill always scans. Both compute the same values.
  `w4a4` (with "pallas"): MXFP4 x MXFP4 matmuls on FP8 tensor cores where the recipe quantizes
  a projection's weight and input to MXFP4 (`pallas_kernels.dispatch.KernelOps`); the same
  values up to the order of float32 sums; the batch's `stats` count its exact-path blocks.
  `fold_scales` (with "pallas"): the Mosaic kernels decode MXFP4 with one multiply a pair of
  values (`pallas_kernels.dispatch.KernelOps`); the same outputs. `attention_blocks` (with
  "pallas"): the Mosaic attention's 64-slot blocks a pipeline step over FP4 caches.
  `triton_backend` (with "pallas"): how the Triton kernels written in Triton's own language too
  (the bf16 matmuls, the Triton attention, quantize-and-record) are called, "pallas" or
  "jax_triton"
  (`pallas_kernels.dispatch`).
  """

  def __init__(self, cfg: ModelConfig, recipe: QuantRecipe, sampling: SamplingConfig,
               records: str | Sequence[int] = "none", collect_codes: bool = False,
               attn_chunk: int = 64, kernels: str = "xla", attention_kernel: str = "auto",
               scan_decode: bool = False, w4a4: bool = False, fold_scales: bool = False,
               attention_blocks: int = 1, triton_backend: str = "pallas"):
    self.ops = make_ops(kernels, attention_kernel, cfg.act_dtype, w4a4=w4a4,
                        fold_scales=fold_scales, attention_blocks=attention_blocks,
                        triton_backend=triton_backend)
    self.cfg, self.recipe, self.sampling = cfg, recipe, sampling
    self.record_layers = parse_layers(records, cfg.n_layers, what="records")
    self.collect_codes = collect_codes
    self.attn_chunk = attn_chunk
    self.scan_decode = scan_decode
    self._prefill_jit = jax.jit(self._prefill, static_argnums=(4,))
    self._decode_jit = jax.jit(self._decode, donate_argnums=(1,))
    self._extend_jit = jax.jit(self._extend, donate_argnums=(1,))
    self._turn_jit = jax.jit(self._turn, donate_argnums=(1,), static_argnums=(3,))

  def generate(self, weights: RolloutWeights, prompts_BxP, lengths_B, key) -> RolloutBatch:
    """Single-turn: up to `max_new_tokens` sampled tokens per prompt, or until a stop token."""
    prompts_BxP, lengths_B = self._check(prompts_BxP, lengths_B)
    total = prompts_BxP.shape[1] + self.sampling.max_new_tokens
    state = self.start(weights, prompts_BxP, lengths_B, key, total)
    return self.finish(self.run(weights, state, total - 1), prompts_BxP.shape[1])

  # -- multi-turn building blocks: start, run (sample), extend (observations), finish ---------

  def start(self, weights, prompts_BxP, lengths_B, key, total: int) -> dict:
    """Prefills the prompts into a cache with room for `total` tokens; samples token P."""
    prompts_BxP, lengths_B = self._check(prompts_BxP, lengths_B)
    if total <= prompts_BxP.shape[1]:
      raise ValueError(f"total length {total} leaves no room after prompts of width "
                       f"{prompts_BxP.shape[1]}")
    return self._prefill_jit(weights, prompts_BxP, lengths_B, key, total)

  def run(self, weights, state: dict, until: int) -> dict:
    """Samples tokens until index `until` holds one (or every sequence has stopped)."""
    if not int(state["t"]) <= until < state["tokens"].shape[1]:
      raise ValueError(f"run(until={until}) outside [{int(state['t'])}, "
                       f"{state['tokens'].shape[1] - 1}]")
    return self._decode_jit(weights, {**state, "limit": jnp.asarray(until, jnp.int32)})

  def compiled_decode(self, weights, state: dict):
    """`run`'s decode loop compiled ahead of time for these shapes: call it with (weights,
    state with "limit"); its `memory_analysis()` says what it allocates beyond its arguments,
    its `as_text()` what XLA fused, by name."""
    state = {**state, "limit": jnp.asarray(0, jnp.int32)}
    return self._decode_jit.lower(weights, state).compile()

  def extend(self, weights, state: dict, tokens_BxT) -> dict:
    """Appends environment tokens (an observation: in the cache and the records, never in the
    response mask) after the last sampled token, then samples the next policy token."""
    tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
    end = int(state["t"]) + tokens_BxT.shape[1] + 1
    if tokens_BxT.ndim != 2 or tokens_BxT.shape[0] != state["tokens"].shape[0] or (
        end >= state["tokens"].shape[1]):
      raise ValueError(f"extend: tokens {tokens_BxT.shape} do not fit a batch of "
                       f"{state['tokens'].shape[0]} with {state['tokens'].shape[1] - end} "
                       "positions left")
    return self._extend_jit(weights, state, tokens_BxT)

  def turn(self, weights, state: dict, tokens_BxT, answer_len: int,
           t: int) -> tuple[dict, jax.Array]:
    """One turn of a multi-turn episode as one program: `extend` by the observation
    `tokens_BxT` (None on the first turn, whose first token `start` sampled), then `run` until the
    answer holds `answer_len` tokens -> (state, the answer's tokens [B, answer_len]). `t`: the
    state's `t` as the host last saw it (the prompt width after `start`, `int(state["t"])` after
    a turn), for the bounds check: the host need not wait for the device between the two."""
    n = 0 if tokens_BxT is None else tokens_BxT.shape[1]
    total = state["tokens"].shape[1]
    if tokens_BxT is not None:
      tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
      if tokens_BxT.ndim != 2 or tokens_BxT.shape[0] != state["tokens"].shape[0]:
        raise ValueError(f"turn: observation tokens {tokens_BxT.shape} for a batch of "
                         f"{state['tokens'].shape[0]}")
    # the answer's last token: after the pending token at t and the observation, if any
    last = t + answer_len - 1 + (n + 1 if tokens_BxT is not None else 0)
    if answer_len < 1 or last >= total:
      raise ValueError(f"turn: an observation of {n} tokens and an answer of {answer_len} do not "
                       f"fit after position {t} of {total}")
    return self._turn_jit(weights, state, tokens_BxT, answer_len)

  def finish(self, state: dict, prompt_width: int) -> RolloutBatch:
    total = state["tokens"].shape[1]
    j = jnp.arange(total)[None, :]
    return RolloutBatch(
        tokens=state["tokens"], valid=j >= state["pad"][:, None], response_mask=state["sampled"],
        logp=jnp.where(state["sampled"], state["logp"], 0.0), records=state["records"],
        routes=state["routes"], codes=state["codes"] if self.collect_codes else None,
        prompt_width=prompt_width, stats=state["stats"])

  # -- shapes: P padded prompt width, L tokens in all, L - 1 positions fed to the model --------

  def _check(self, prompts_BxP, lengths_B):
    prompts_BxP, lengths_B = jnp.asarray(prompts_BxP, jnp.int32), jnp.asarray(lengths_B)
    if prompts_BxP.ndim != 2 or lengths_B.shape != prompts_BxP.shape[:1]:
      raise ValueError(f"prompts must be [B, P] with lengths [B], got {prompts_BxP.shape} and "
                       f"{lengths_B.shape}")
    return prompts_BxP, lengths_B

  def _path(self, cache, start, q_slot_BxT, valid_BxS):
    return RolloutPath(self.cfg, self.recipe, cache, start, q_slot_BxT, valid_BxS,
                       self.record_layers, self.attn_chunk, self.collect_codes, self.ops,
                       stacked_cache=self.scan_decode)

  def _sample(self, key, logits_BxV):
    return sample(key, logits_BxV, self.sampling.temperature, self.sampling.top_p)

  def _prefill(self, weights, prompts_BxP, lengths_B, key, total):
    b, p = prompts_BxP.shape
    fed = total - 1
    slots = -(-fed // self.attn_chunk) * self.attn_chunk
    pad_B = p - lengths_B
    valid_BxS = jnp.arange(slots)[None, :] >= pad_B[:, None]
    pos = jnp.maximum(jnp.arange(p)[None, :] - pad_B[:, None], 0)
    path = self._path(None, 0, jnp.broadcast_to(jnp.arange(p), (b, p)), valid_BxS)
    logits, out = forward(self.cfg, weights, prompts_BxP, pos, path)
    key, sub = jax.random.split(key)
    tok, lp = self._sample(sub, logits[:, -1])
    pad = self.sampling.pad_id
    tokens = jnp.full((b, total), pad, jnp.int32).at[:, :p].set(prompts_BxP).at[:, p].set(tok)
    routes = out["routes"]
    return {
        "t": jnp.asarray(p, jnp.int32), "limit": jnp.asarray(total - 1, jnp.int32), "key": key,
        "pad": pad_B, "valid": valid_BxS, "tokens": tokens,
        "logp": jnp.zeros((b, total), jnp.float32).at[:, p].set(lp),
        "sampled": jnp.zeros((b, total), bool).at[:, p].set(True),
        "done": jnp.isin(tok, jnp.asarray(self.sampling.stop_tokens, jnp.int32)),
        "cache": out["cache"],
        "records": write_slots(_zeros_like_slots(out["records"], fed, 1), out["records"], 0),
        "codes": write_slots(_zeros_like_slots(out["codes"], fed, 1), out["codes"], 0),
        "routes": write_slots(_zeros_like_slots(routes, fed, 2), routes, 0, axis=2),
        "stats": jax.tree.map(lambda n: jnp.asarray(n, jnp.int32), out["stats"]),
    }

  def _advance(self, weights, s, fed_BxT):
    """Feeds fed_BxT at slots t .. t+T-1 (fed[:, 0] is the pending sampled token at t, the rest
    are new context), writes their cache entries and records, samples the token at t + T."""
    t, (b, n) = s["t"], fed_BxT.shape
    q_slot = jnp.broadcast_to(t + jnp.arange(n), (b, n))
    pos = jnp.maximum(q_slot - s["pad"][:, None], 0)
    path = self._path(s["cache"], t, q_slot, s["valid"])
    logits, out = forward(self.cfg, weights, fed_BxT, pos, path, scan=self.scan_decode)
    key, sub = jax.random.split(s["key"])
    nxt, lp = self._sample(sub, logits[:, -1])
    nxt = jnp.where(s["done"], self.sampling.pad_id, nxt)
    lp = jnp.where(s["done"], 0.0, lp)
    new_t = t + n
    tokens = write_slots(s["tokens"], fed_BxT[:, 1:], t + 1) if n > 1 else s["tokens"]
    stops = jnp.asarray(self.sampling.stop_tokens, jnp.int32)
    return {
        **s, "t": new_t, "key": key, "cache": out["cache"],
        "tokens": write_slots(tokens, nxt[:, None], new_t),
        "logp": write_slots(s["logp"], lp[:, None], new_t),
        "sampled": write_slots(s["sampled"], ~s["done"][:, None], new_t),
        "done": s["done"] | jnp.isin(nxt, stops),
        "records": write_slots(s["records"], out["records"], t),
        "codes": write_slots(s["codes"], out["codes"], t),
        "routes": write_slots(s["routes"], out["routes"], t, axis=2),
        "stats": jax.tree.map(lambda a, n: a + n, s["stats"], out["stats"]),
    }

  def _decode(self, weights, state):
    def cond(s):
      return (s["t"] < s["limit"]) & ~jnp.all(s["done"])

    def body(s):
      return self._advance(weights, s, jax.lax.dynamic_slice_in_dim(s["tokens"], s["t"], 1, 1))

    return jax.lax.while_loop(cond, body, state)

  def _extend(self, weights, state, tokens_BxT):
    pending = jax.lax.dynamic_slice_in_dim(state["tokens"], state["t"], 1, 1)
    return self._advance(weights, state, jnp.concatenate([pending, tokens_BxT], axis=1))

  def _turn(self, weights, state, tokens_BxT, answer_len):
    if tokens_BxT is not None:
      state = self._extend(weights, state, tokens_BxT)
    first = state["t"]  # the answer's first token, sampled already
    state = self._decode(weights, {**state, "limit": first + answer_len - 1})
    return state, jax.lax.dynamic_slice_in_dim(state["tokens"], first, answer_len, 1)
