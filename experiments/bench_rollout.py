"""Rollout decode throughput, FP4 against BF16 in the same engine, on a few-layer qwen3_30b_a3b.

    python experiments/bench_rollout.py [--out=DIR] [--layers=2] [--batches=16,64,256,max] \
        [--memory_gb=F] [--context=4080] [--steps=16] [--slots=N] [--profile] [--hlo] \
        [--variants=bf16:xla,bf16:pallas,mxfp4:pallas,mxfp4:pallas+scan,...]

A GPU benchmark. For each variant (precision of weights, activations and KV: bf16 | mxfp4 |
nvfp4; the engine's kernels: xla | pallas | triton | tokamax, where "pallas" is the engine's
kernel switch as a user sets it, the weight sync packing FP4 weights for the Mosaic GPU kernels,
"triton" the same switch with FP4 weights packed plainly, which runs the Triton FP4 kernels
instead, and `bf16:tokamax` the bf16 engine on tokamax's kernels where that package is
installed (`pallas_kernels.dispatch.TokamaxOps`);
under either, an optional third field picks the decode attention's backend:
`mxfp4:pallas:mosaic` the Mosaic attention kernel, `:triton` the Triton one, `:auto`, the
engine's default, the one measured faster for the cache's format; a suffix `+scan` runs the
decode step as a scan over stacked layers, `engine.scan_decode`; `+w4a4` on a pallas variant
the MXFP4 matmuls on the W4A4 kernels, `engine.w4a4`; `+pairs` on an FP4 pallas variant the
weights tiled in the "pairs" nibble order, whose Mosaic matmuls take x's even and odd K columns
transposed, where the engine's default "halves" order takes x as it is (`+halves` names the
default explicitly): `make_ops(fp4_order=...)`; `+apart` on a pallas variant the weights packed
each on its own, where the weight sync packs q, k and v as one, and gate and up as one
(`make_ops(fuse=False)`); `+fold` on an MXFP4 pallas variant the Mosaic kernels' decode with
the scales folded, `engine.fold_scales`; `+b2` on an FP4 pallas variant the Mosaic attention's
two 64-slot blocks a pipeline step, `RolloutEngine(attention_blocks=2)`; `+jt` on a pallas
variant the Triton kernels written in Triton's own language too (the bf16 matmuls, the Triton
attention, quantize-and-record) called through jax-triton, `engine.triton_backend=jax_triton`) and
batch size, the rollout engine decodes `steps` tokens per sequence after `context` tokens of
context, in one jitted decode loop (records off, sampling at temperature 1). The cache holds
random codes for the context (the attention reads every slot up to the current token whatever
its content), so no prefill of B x 4K tokens is needed; `--slots` makes the cache longer than
what it holds, as a rollout's is; the policy's rollout weights are random, built packed layer by
layer without float32 master params (`random_weights`: what is timed does not depend on the
weights' values, and the full 48 layers fit). `--sync` also times the weight sync
(`pack_weights` from float32 master params) on a few layers, per layer.

Reported per row: decode tokens/s (B x steps / wall seconds of the loop, one dispatch), the
bytes one decode step must move (weights of the attention and of the experts the batch can hit
(E (1 - (1 - k/E)^B) of them under uniform routing), the LM head, the KV cache, activations
neglected) and that byte count's time at the copy bandwidth measured in the same run, as a
fraction of the measured step (the roofline fraction). The largest batch each precision fits is
computed from byte counts for the full 48-layer model in the device's memory; `--batches=max`
runs each variant at its own largest batch (a multiple of 8) in one memory budget, counted from
its compiled decode loop (weights, state, XLA's temporaries): FP4 against bf16 "each at the
largest batch it fits" in the same memory (`--memory_gb`, by default the device's). Writes
bench_rollout.json (again after every row, `complete` false until the run ends: a run cut
short keeps what it measured) and prints a table; BENCHMARKS.md quotes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels.timing import copy_bandwidth, kernel_times, wall_seconds  # noqa: E402
from trace_jax.models import QuantRecipe, init_params, pack_weights  # noqa: E402
from trace_jax.models.config import preset as model_preset  # noqa: E402
from trace_jax.models.recipe import WEIGHT_AXES  # noqa: E402
from pallas_kernels.dispatch import ATTENTION_KERNELS, FP4_ORDER, make_ops  # noqa: E402
from trace_jax.models.rollout_path import lay_out, new_kv_cache  # noqa: E402
from trace_jax.quant import QArray  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig  # noqa: E402

VARIANTS = ("bf16:xla", "bf16:pallas", "bf16:tokamax", "mxfp4:xla", "mxfp4:pallas",
            "nvfp4:pallas", "mxfp4:triton", "nvfp4:triton")


ORDER_SUFFIXES = ("+pairs", "+halves")
SUFFIXES = ("+scan", "+w4a4", "+apart", "+fold", "+b2", "+jt", *ORDER_SUFFIXES)


class Variant(NamedTuple):
  """What a variant name asks for (`parse_variant`)."""
  precision: str
  kernels: str
  attention: str  # the decode attention's backend
  scan: bool  # the decode step scans its layers
  w4a4: bool  # MXFP4 matmuls on the W4A4 kernels
  order: str  # the FP4 weights' nibble order for the Mosaic matmuls
  fuse: bool  # the weight sync packs the projections of one input as one weight
  fold: bool = False  # the Mosaic kernels decode MXFP4 with the scales folded
  blocks: int = 1  # the Mosaic attention's 64-slot blocks a pipeline step
  triton_backend: str = "pallas"  # how the Triton kernels in Triton's language are called


def parse_variant(v: str) -> Variant:
  """A variant, "precision:kernels[:attention][+scan][+w4a4][+apart][+fold][+b2][+jt][+pairs|
  +halves]" -> `Variant`."""
  name, flags = v, set()
  while name.endswith(SUFFIXES):
    suffix = next(x for x in SUFFIXES if name.endswith(x))
    name, flags = name[:-len(suffix)], flags | {suffix}
  parts = name.split(":")
  base, attention = ":".join(parts[:2]), (parts[2] if len(parts) == 3 else "auto")
  if base not in VARIANTS or len(parts) > 3 or attention not in ATTENTION_KERNELS or (
      len(parts) == 3 and parts[1] in ("xla", "tokamax")) or (
          flags & {"+w4a4", "+apart", "+jt", *ORDER_SUFFIXES} and parts[1] != "pallas") or (
          flags & set(ORDER_SUFFIXES) and (parts[0] == "bf16" or "+w4a4" in flags)) or (
          set(ORDER_SUFFIXES) <= flags) or (
          "+fold" in flags and (base != "mxfp4:pallas" or "+w4a4" in flags)) or (
          "+b2" in flags and (parts[0] == "bf16" or parts[1] != "pallas")):
    raise ValueError(f"unknown variant {v!r}; choose from {VARIANTS}, a kernels variant "
                     f"optionally with :{' or :'.join(ATTENTION_KERNELS)} (the attention's "
                     "backend), any of them with +scan (the decode step scanned over layers), "
                     "a pallas one with +w4a4 (the W4A4 matmuls), +jt (the Triton kernels "
                     "in Triton's own language), +apart (each projection "
                     "packed apart), mxfp4:pallas without +w4a4 with +fold (the scales folded), "
                     "an FP4 pallas one with +b2 (two blocks a step of the Mosaic attention), "
                     "or, FP4 without +w4a4, "
                     "one of +pairs or +halves (the FP4 weights' nibble order; default "
                     f"{FP4_ORDER})")
  order = next((o[1:] for o in ORDER_SUFFIXES if o in flags), FP4_ORDER)
  return Variant(parts[0], parts[1], attention, "+scan" in flags, "+w4a4" in flags, order,
                 "+apart" not in flags, "+fold" in flags, 2 if "+b2" in flags else 1,
                 "jax_triton" if "+jt" in flags else "pallas")


def random_cache(shapes: list, key) -> list:
  """The engine's cache layout (`shapes`: its arrays or their `jax.ShapeDtypeStruct`s) filled
  with random content, one leaf at a time, so no other cache is ever alive beside it: bf16
  normals, random FP4 codes with unit scales (E8M0 127; E4M3 0x38) and unit globals."""
  nodes, tree = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, QArray))

  def fill(i, s):
    k = jax.random.fold_in(key, i)
    if not isinstance(s, QArray):
      return jax.random.normal(k, s.shape, s.dtype)
    g = s.global_scale
    return QArray(jax.random.bits(k, s.codes.shape, jnp.uint8),
                  jnp.full(s.scales.shape, _UNIT_SCALE.get(s.fmt.name, 0x38), s.scales.dtype),
                  None if g is None else jnp.ones(g.shape, g.dtype), s.fmt, s.axis)

  return jax.tree.unflatten(tree, [fill(i, s) for i, s in enumerate(nodes)])


_UNIT_SCALE = {"mxfp4": 127}  # a block scale of 1 in E8M0; in E4M3 (NVFP4s) 0x38


def _unit_scales(c):
  if not isinstance(c, QArray):
    return c
  one = _UNIT_SCALE.get(c.fmt.name, 0x38)
  g = None if c.global_scale is None else jnp.ones_like(c.global_scale)
  return QArray(c.codes, jnp.full_like(c.scales, one), g, c.fmt, c.axis)


def random_weights(cfg, recipe, ops, key, stacked: bool = False):
  """Rollout weights of `cfg` as `pack_weights` lays them out for `ops`, random: FP4 codes
  random with unit scales, bf16 normals x 0.02, norms 1; made layer by layer without master
  params (a 48-layer qwen3_30b_a3b in float32 would not fit next to its rollout weights).
  `stacked`: as `pack_weights(..., stacked=True)` lays out a uniform recipe's, one stack of all
  layers (what `engine.scan_decode` reads), the same values as unstacked."""
  one = dataclasses.replace(cfg, n_layers=1)
  params = jax.eval_shape(lambda k: init_params(one, k), jax.random.PRNGKey(0))
  shapes = jax.eval_shape(lambda p: pack_weights(one, p, recipe), params)

  def fill(k, a):
    if a.dtype == jnp.uint8:
      return jax.random.bits(k, a.shape, jnp.uint8)
    return (jax.random.normal(k, a.shape) * 0.02).astype(a.dtype)

  def layer(k):
    leaves, tree = jax.tree.flatten(shapes.layers[0])
    made = jax.tree.unflatten(tree, [fill(jax.random.fold_in(k, i), a)
                                     for i, a in enumerate(leaves)])
    made = {n: _unit_scales(v) if isinstance(v, QArray) else v for n, v in made.items()}
    for n in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
      made[n] = jnp.ones_like(made[n])
    return lay_out(made, ops)

  keys = [jax.random.fold_in(key, i) for i in range(cfg.n_layers)]
  if stacked:
    formats = {recipe.weight_format(i, cfg.n_layers) for i in range(cfg.n_layers)}
    if len(formats) > 1:
      raise ValueError(f"stacked random weights take a recipe of one weight format, got "
                       f"{sorted(getattr(f, 'name', str(f)) for f in formats)}")
    layers = [jax.block_until_ready(jax.jit(jax.vmap(layer))(jnp.stack(keys)))]
  else:
    one_layer = jax.jit(layer)
    layers = [jax.block_until_ready(one_layer(k)) for k in keys]
  dt = cfg.act_dtype
  embed = fill(jax.random.fold_in(key, cfg.n_layers), shapes.embed)
  head = (None if shapes.lm_head is None
          else fill(jax.random.fold_in(key, cfg.n_layers + 1), shapes.lm_head))
  return type(shapes)(embed=embed.astype(dt), layers=layers,
                      final_norm=jnp.ones(shapes.final_norm.shape, shapes.final_norm.dtype),
                      lm_head=head)


def sync_seconds(cfg, recipe, ops, layers: int = 2, reps: int = 3) -> float:
  """Seconds per layer of the weight sync (`pack_weights` from float32 master params, laid out
  for `ops`), timed on `layers` layers (the median of `reps` calls after one compile)."""
  few = dataclasses.replace(cfg, n_layers=layers)
  params = init_params(few, jax.random.PRNGKey(0))
  sync = jax.jit(lambda p: pack_weights(few, p, recipe, ops=ops))
  return wall_seconds(sync, params, reps=reps) / layers


def decode_state(engine: RolloutEngine, weights, batch: int, context: int, steps: int, key,
                 slots: int | None = None):
  """The engine's decode state after `context` tokens of context, built without a prefill: its
  structure from tracing the prefill (no compile), the cache random (room for `slots` tokens,
  by default the context and the steps), every slot valid; fresh arrays throughout (the decode
  loop takes its state as donated buffers). The engine attends to the slots up to the current
  token: past it a longer cache holds what a rollout has not yet written."""
  total = max(context + steps, slots or 0) + 1
  prompts = jnp.zeros((batch, 8), jnp.int32)
  lengths = jnp.full((batch,), 8, jnp.int32)
  shapes = jax.eval_shape(lambda *a: engine.start(*a, total), weights, prompts, lengths, key)
  cache = shapes.pop("cache")  # made last, and once: a 48-layer bf16 cache is 26 GB
  state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  slots = state["valid"].shape[1]
  state.update(t=jnp.asarray(context, jnp.int32), limit=jnp.asarray(total - 1, jnp.int32),
               key=jax.random.fold_in(key, 1), valid=jnp.ones((batch, slots), bool),
               cache=random_cache(cache, key))
  return state


def decode_memory(compiled, weights, state) -> dict:
  """What the compiled decode loop holds on the device: its weights and state (the
  arguments, the state's buffers donated), the temporaries XLA allocates beyond them (a
  temporary the size of the weights is a copy of them, which halves the batch that fits), and
  its outputs that XLA does not write into the donated state's buffers (`unaliased_bytes`: new
  buffers beside the state while the loop runs), and XLA's own estimate of the program's peak
  (`xla_peak_bytes`, where it gives one; reported, not counted)."""
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  out = {"weights_bytes": _nbytes(weights), "state_bytes": _nbytes(state),
         "temp_bytes": int(stats.temp_size_in_bytes),
         "unaliased_bytes": max(0, int(stats.output_size_in_bytes)
                                - int(stats.alias_size_in_bytes))}
  if getattr(stats, "peak_memory_in_bytes", 0):
    out["xla_peak_bytes"] = int(stats.peak_memory_in_bytes)
  return out


def _nbytes(tree) -> int:
  return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def step_bytes(cfg, weights, cache, batch: int, filled: float = 1.0) -> dict:
  """Bytes one decode step must read: attention weights, the experts the batch can hit, the
  LM head (the embedding reads B rows: neglected), the filled fraction of the KV cache."""
  attn = expert = 0
  for layer in weights.layers:  # projections packed apart or as one (`Fused`, "wq+wk+wv")
    for name, w in layer.items():
      parts = name.split("+")
      if all(p in WEIGHT_AXES for p in parts):
        if parts[0] in ("w_gate", "w_up", "w_down"):
          expert += _nbytes(w)
        else:
          attn += _nbytes(w)
  hit = 1 - (1 - cfg.top_k / cfg.n_experts) ** batch
  head = _nbytes(weights.lm_head if weights.lm_head is not None else weights.embed)
  out = {"attention_weights": attn, "experts": int(expert * hit), "lm_head": head,
         "kv_cache": int(_nbytes(cache) * filled)}
  out["total"] = sum(out.values())
  return out


def max_batch(precision: str, context: int, memory_bytes: float, preset: str = "qwen3_30b_a3b",
              n_layers: int | None = None) -> int:
  """The largest batch whose KV cache at `context` tokens fits next to the full model's weights
  (packed as the engine packs them; `n_layers`, by default the preset's) in `memory_bytes`, from
  byte counts (shapes only)."""
  n_layers = n_layers or model_preset(preset).n_layers
  cfg = model_preset(preset, n_layers=1)
  recipe = QuantRecipe.uniform(precision)
  params = jax.eval_shape(lambda k: init_params(cfg, k), jax.random.PRNGKey(0))
  w = jax.eval_shape(lambda p: pack_weights(cfg, p, recipe), params)
  per_layer = _nbytes(w.layers[0])
  fixed = _nbytes([w.embed, w.lm_head])
  weights = fixed + n_layers * per_layer
  kv = jax.eval_shape(lambda: new_kv_cache(cfg, recipe, 1, context))
  per_seq = n_layers * _nbytes(kv)
  return int((memory_bytes - weights) // per_seq)


def memory_stats() -> dict:
  """The device allocator's counts ({} where it keeps none: the CPU)."""
  return jax.devices()[0].memory_stats() or {}


def allocator_counts() -> str:
  """What the device's allocator holds now, in words ("" where it keeps no counts): read when a
  batch fails, it shows what the byte count (`decode_memory`) left out."""
  stats = memory_stats()
  gb = lambda k: f"{stats[k] / 1e9:.1f} GB"
  words = [f"{gb('bytes_in_use')} in use"] if "bytes_in_use" in stats else []
  words += [f"{name} {gb(k)}" for k, name in (
      ("peak_bytes_in_use", "peak"), ("largest_alloc_size", "largest allocation"),
      ("bytes_limit", "limit")) if k in stats]
  return "allocator: " + ", ".join(words) if words else ""


def device_bytes() -> int:
  """The memory the device lets arrays take (0 where it does not say: the CPU)."""
  return int(memory_stats().get("bytes_limit", 0))


def check_fits(memory: dict, batch: int) -> None:
  """Raises MemoryError, before anything is allocated, where the decode loop's state and
  temporaries (`decode_memory`) do not fit beside what the device already holds. (After an
  out-of-memory the GPU allocator of jax 0.11 retries every 10 s instead of failing, so a
  batch that does not fit would otherwise hang until its time limit.)"""
  stats = memory_stats()
  if not memory or "bytes_limit" not in stats:
    return
  need = memory["state_bytes"] + memory["temp_bytes"] + memory.get("unaliased_bytes", 0)
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  if need > free:
    raise MemoryError(f"B={batch} does not fit: its decode state, temporaries and outputs not "
                      f"written in place take {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are free")


MAX_MULTIPLE = 8  # `--batches=max` runs the largest multiple of this that fits


def loop_bytes(engine, weights, batch: int, context: int, steps: int, slots: int | None = None,
               compiled: dict | None = None) -> int:
  """The bytes the decode loop at `batch` takes with its weights: the weights, its state,
  XLA's temporaries and the outputs not written in place (`decode_memory` of the loop compiled
  from shapes: nothing allocated); `compiled` keeps (decode, memory) by batch for the run to reuse."""
  shapes = jax.eval_shape(lambda k: decode_state(engine, weights, batch, context, steps, k, slots),
                          jax.random.PRNGKey(batch))
  decode = engine.compiled_decode(weights, shapes)
  memory = decode_memory(decode, weights, shapes)
  if compiled is not None:
    compiled[batch] = decode, memory
  return (memory["weights_bytes"] + memory["state_bytes"] + memory["temp_bytes"]
          + memory["unaliased_bytes"])


def largest_batch(engine, weights, context: int, steps: int, budget: int,
                  slots: int | None = None, compiled: dict | None = None) -> int:
  """The largest multiple of MAX_MULTIPLE whose decode loop (`loop_bytes`) fits in `budget`
  bytes, 0 if none does. A first guess from the state's bytes a sequence (shapes only), then
  the compiled loops' own counts: down in proportion while a loop does not fit (all but the
  weights taken as growing with the batch), up while the next multiple might (its state beside
  this loop's temporaries: XLA's temporaries do not shrink with the batch). A few compiles."""
  state = lambda b: _nbytes(jax.eval_shape(
      lambda k: decode_state(engine, weights, b, context, steps, k, slots), jax.random.PRNGKey(0)))
  w = _nbytes(weights)
  per_seq = state(2) - state(1)
  fixed = w + state(1) - per_seq
  floor = lambda b: b // MAX_MULTIPLE * MAX_MULTIPLE
  b = max(MAX_MULTIPLE, floor((budget - fixed) // per_seq))
  seen = {}

  def used(b):
    if b not in seen:
      seen[b] = loop_bytes(engine, weights, b, context, steps, slots, compiled)
    return seen[b]

  while b >= MAX_MULTIPLE:
    if used(b) > budget:
      b = min(b - MAX_MULTIPLE, floor(b * max(0, budget - w) // (used(b) - w)))
    elif used(b) + MAX_MULTIPLE * per_seq <= budget and used(b + MAX_MULTIPLE) <= budget:
      b += MAX_MULTIPLE
    else:
      return b
  return 0


def step_split(engine, weights, state, until: int, steps: int) -> dict:
  """Where a decode step's GPU time goes: microseconds per step of each kernel name in a
  profiler trace of one decode loop, largest first (the Pallas kernels are named triton_* and
  *_wgmma, XLA's by their fusion: `--hlo` writes what each fusion computes), and their sum."""
  times = kernel_times(lambda s: engine.run(weights, s, until), state)
  if times is None:
    return {}
  per_step = sorted(((us / steps, name) for name, us in times.items()), reverse=True)
  split = {name: round(us, 1) for us, name in per_step}
  split["total"] = round(sum(us for us, _ in per_step), 1)
  return split


_FUSION = re.compile(  # a tuple shape (a fusion of several outputs) has spaces
    r"^\s*(?:ROOT )?%(\S+) = (\([^)]*\)|\S+) fusion\(.*?calls=%([\w.\-]+)(.*)$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def describe_fusions(hlo_text: str, names) -> dict:
  """What each of the profile's XLA kernels computes, from the compiled HLO: its output shape,
  the op at the root of the fused computation and the JAX op it was traced from (profiler
  names are HLO names with "_" for "."; kernels that are no fusion are left out)."""
  roots = {}
  for m in re.finditer(r"^%([\w.\-]+) .*?\{\n(.*?)^\}", hlo_text, re.M | re.S):
    root = re.search(r"ROOT %\S+ = \S+ ([\w\-]+)\(", m.group(2))
    roots[m.group(1)] = root.group(1) if root else "?"
  found = {}
  for m in _FUSION.finditer(hlo_text):
    name = m.group(1).replace(".", "_")
    if name in names:
      op = _OP_NAME.search(m.group(4))
      found[name] = {"shape": m.group(2), "root": roots.get(m.group(3), "?"),
                     "op_name": op.group(1) if op else ""}
  return found


def _top(split: dict, top: int = 12) -> dict:
  """The `top` largest kernels of a `step_split`, the rest summed as "other", and the total."""
  names = [n for n in split if n != "total"]
  out = {n: split[n] for n in names[:top]}
  out["other"] = round(sum(split[n] for n in names[top:]), 1)
  out["total"] = split["total"]
  return out


def run(layers: int, batches: list, context: int, steps: int, variants: list[str],
        preset: str = "qwen3_30b_a3b", profile: bool = False, hlo_dir: str | None = None,
        slots: int | None = None, sync: bool = False, memory_bytes: int | None = None,
        on_row=None) -> dict:
  """batches: ints, and "max" for each variant's largest batch (`largest_batch`) in
  `memory_bytes` (by default the memory the device lets arrays take). `on_row(result)` after
  each row is measured (the result so far, `complete` false until the end)."""
  limit_bytes = device_bytes()
  budget = memory_bytes or limit_bytes
  if "max" in batches and not budget:
    raise ValueError("--batches=max needs a memory budget: --memory_gb (this device does not "
                     "say how much memory arrays may take)")
  cfg = model_preset(preset, n_layers=layers)
  copy = copy_bandwidth()
  device = jax.devices()[0]
  result = {"device": str(device.device_kind), "jax": jax.__version__, "preset": preset,
            "layers": layers,
            "context": context, "steps": steps, "slots": slots, "copy_bytes_per_s": copy,
            "memory_bytes": limit_bytes, "rows": [], "max_batch": {}, "sync_s_per_layer": {},
            "errors": [], "complete": False}
  if "max" in batches:
    result["budget_bytes"] = budget
  packed = {}
  sampling = SamplingConfig(max_new_tokens=steps, temperature=1.0)
  for variant in variants:
    (precision, kernels, attention, scan, w4a4, order, fuse, fold, blocks,
     triton_backend) = parse_variant(variant)
    # "triton": FP4 weights packed plainly; "tokamax" (bf16) lays nothing out
    layout = "pallas" if kernels == "pallas" else "xla"
    kernels = "pallas" if kernels == "triton" else kernels
    recipe = QuantRecipe.uniform(precision)
    ops = make_ops(layout, w4a4=w4a4, fp4_order=order, fuse=fuse)  # (fold: the engine's)
    layout += (("+w4a4" if w4a4 else "") + ("" if order == FP4_ORDER else f"+{order}")
               + ("" if fuse else "+apart"))
    if (precision, layout, scan) not in packed:  # one packing alive at a time
      packed = weights = state = out = None  # nor the last variant's cache
      packed = {}
      packed[precision, layout, scan] = random_weights(cfg, recipe, ops, jax.random.PRNGKey(0),
                                                       stacked=scan)
      if sync and precision != "bf16":
        per_layer = sync_seconds(cfg, recipe, ops)
        result["sync_s_per_layer"][f"{precision}:{layout}"] = per_layer
        print(json.dumps({"sync": f"{precision}:{layout}", "s_per_layer": per_layer,
                          f"s_{layers}_layers": per_layer * layers}), flush=True)
    weights = packed[precision, layout, scan]
    engine = RolloutEngine(cfg, recipe, sampling, kernels=kernels, attention_kernel=attention,
                           scan_decode=scan, w4a4=w4a4, fold_scales=fold,
                           attention_blocks=blocks, triton_backend=triton_backend)
    for b in batches:
      largest, compiled = b == "max", {}
      memory, stage = {}, "compiling the loop"
      try:
        t0 = time.perf_counter()
        if largest:
          found = largest_batch(engine, weights, context, steps, budget, slots, compiled)
          if not found:
            raise MemoryError(f"no batch of {MAX_MULTIPLE} fits in {_size(budget)}")
          b = found
          print(json.dumps({"variant": variant, "largest_batch": b, "budget_bytes": budget}),
                flush=True)
        key = jax.random.PRNGKey(b)
        if b in compiled:
          decode, memory = compiled[b]
        else:
          shapes = jax.eval_shape(  # compiled from shapes: nothing allocated until it fits
              lambda k: decode_state(engine, weights, b, context, steps, k, slots), key)
          decode = engine.compiled_decode(weights, shapes)  # the executable engine.run calls
          memory = decode_memory(decode, weights, shapes)
        compiled = None
        stage = "counting what fits"
        check_fits(memory, b)
        stage = "building the state"
        state = decode_state(engine, weights, b, context, steps, key, slots)
        if hlo_dir:  # before the first call, so a loop that runs out of memory is kept too
          name = f"hlo_{re.sub('[:+]', '_', variant)}_{b}.txt"
          with open(os.path.join(hlo_dir, name), "w") as fh:
            fh.write(decode.as_text())
        limit = lambda: {"limit": jnp.asarray(context + steps, jnp.int32)}  # donated each call
        stage = "running its first call"
        jax.block_until_ready(decode(weights, {**state, **limit()}))
        compile_s = time.perf_counter() - t0
        samples = []
        stage = "running the timed calls"
        for rep in range(3):
          out = None  # (the last call's state, freed before the next is made)
          state = jax.block_until_ready(decode_state(engine, weights, b, context, steps,
                                                     jax.random.fold_in(key, rep), slots))
          t0 = time.perf_counter()
          out = jax.block_until_ready(decode(weights, {**state, **limit()}))
          samples.append(time.perf_counter() - t0)
        assert int(out["t"]) == context + steps, int(out["t"])
      except Exception as e:  # noqa: BLE001  (out of memory at a large batch: reported)
        state = out = None
        compiled = None
        notes = [f"while {stage}", allocator_counts(), memory and f"decode loop: {memory}"]
        result["errors"].append(f"{variant} B={b}: {type(e).__name__}: {str(e)[:300]} "
                                f"({'; '.join(filter(None, notes))})")
        print("ERROR", result["errors"][-1], flush=True)
        if on_row is not None:
          on_row(result)
        continue
      seconds = float(np.median(samples)) / steps
      filled = 1.0  # a cache of context + steps: all of it
      if slots:  # a longer one: what the mean step has filled
        filled = min(1.0, (context + steps / 2) / out["valid"].shape[1])
      nbytes = step_bytes(cfg, weights, out["cache"], b, filled)
      row = {"variant": variant, "batch": b, "tokens_per_s": b / seconds,
             "step_ms": seconds * 1e3, "bytes_per_step": nbytes,
             "roofline_frac": nbytes["total"] / copy / seconds, "first_call_s": compile_s,
             "decode_memory": memory, "largest": largest}
      out = None
      if profile:
        state = decode_state(engine, weights, b, context, steps, key, slots)
        split = step_split(engine, weights, state, context + steps, steps)
        row["kernels_us_per_step"] = split
        if split:  # the GPU idle between kernels, as a share of the measured step
          row["between_kernels_frac"] = max(0.0, 1.0 - split["total"] / (seconds * 1e6))
      if hlo_dir and row.get("kernels_us_per_step"):  # the fusions the profile names
        row["fusions"] = describe_fusions(decode.as_text(),
                                          list(_top(row["kernels_us_per_step"], 40)))
      result["rows"].append(row)
      print(json.dumps(row), flush=True)
      if on_row is not None:
        on_row(result)
  if limit_bytes:  # the full model of the preset, its cache as the run allocates it
    for precision in sorted({v.split(":")[0] for v in variants}):
      result["max_batch"][precision] = max_batch(precision, slots or context + steps,
                                                 limit_bytes, preset)
  result["complete"] = True
  return result


def table(result: dict) -> str:
  lines = [f"device {result['device']}, jax {result['jax']}, {result['preset']} with "
           f"{result['layers']} layers, "
           f"context {result['context']}, {result['steps']} steps, copy "
           f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s",
           f"{'variant':20s} {'B':>4s} {'tokens/s':>10s} {'step ms':>8s} {'MB/step':>8s} "
           f"{'roofline':>8s} {'temp GB':>8s}"]
  for r in result["rows"]:
    lines.append(f"{r['variant']:20s} {r['batch']:4d} {r['tokens_per_s']:10.0f} "
                 f"{r['step_ms']:8.2f} {r['bytes_per_step']['total'] / 1e6:8.0f} "
                 f"{100 * r['roofline_frac']:7.1f}% "
                 f"{r.get('decode_memory', {}).get('temp_bytes', float('nan')) / 1e9:8.2f}")
  for r in result["rows"]:
    if r.get("kernels_us_per_step"):
      gap = f", {100 * r['between_kernels_frac']:.0f}% of the step between kernels" if (
          "between_kernels_frac" in r) else ""
      lines.append(f"{r['variant']} B={r['batch']}{gap}, GPU us a step by kernel: " + ", ".join(
          f"{name} {us}" for name, us in _top(r["kernels_us_per_step"]).items()))
  for v, sec in result.get("sync_s_per_layer", {}).items():
    lines.append(f"weight sync {v}: {sec * 1e3:.1f} ms a layer, {sec * 48:.2f} s for 48 layers")
  largest = [r for r in result["rows"] if r.get("largest")]
  if largest:
    lines.append(f"largest batch in {_size(result['budget_bytes'])}, the decode loop's own "
                 "count (weights, state, temporaries): " + ", ".join(
                     f"{r['variant']} {r['batch']}" for r in largest))
  for p, b in result["max_batch"].items():
    lines.append(f"largest batch in a {result['slots'] or result['context'] + result['steps']}"
                 f"-slot cache, 48 layers, "
                 f"{result['memory_bytes'] / 2**30:.0f} GiB: {p} {b}")
  return "\n".join(lines + [f"ERROR {e}" for e in result["errors"]])


def _size(nbytes: int) -> str:
  return f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.3g} MiB"


def _batches(text: str) -> list:
  """--batches: comma separated positive ints and "max"."""
  out = []
  for item in (t.strip() for t in text.split(",")):
    if item == "max":
      out.append(item)
    elif item.isdigit() and int(item) > 0:
      out.append(int(item))
    elif item:
      raise argparse.ArgumentTypeError(f"{item!r} is neither a positive batch size nor max")
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--preset", default="qwen3_30b_a3b",
                      help="model shapes (trace_jax.models.config.PRESETS); small: a CPU check")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--batches", default="16,64,256", type=_batches,
                      help="batch sizes, and max: each variant at the largest multiple of "
                      f"{MAX_MULTIPLE} whose decode loop fits in --memory_gb (weights, state and "
                      "XLA's temporaries, from the compiled loop)")
  parser.add_argument("--memory_gb", type=float, default=None,
                      help="the memory budget of --batches=max, GiB (default: what the device "
                      "lets arrays take): the same for every variant")
  parser.add_argument("--context", type=int, default=4080,
                      help="context tokens; with --steps 16 the cache is 4096 slots, a power of "
                      "two of 64-slot blocks, which the attention kernel splits evenly")
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--slots", type=int, default=None,
                      help="the cache's slots, if more than context + steps: a rollout's cache "
                      "has room for its longest answer, which it fills as it decodes")
  parser.add_argument("--variants", default="bf16:xla,bf16:pallas,mxfp4:xla,mxfp4:pallas,"
                      "nvfp4:pallas")
  parser.add_argument("--profile", action="store_true",
                      help="also trace one decode loop a row: GPU microseconds per step by kernel")
  parser.add_argument("--hlo", action="store_true",
                      help="also write each row's compiled decode loop (hlo_VARIANT_B.txt)")
  parser.add_argument("--sync", action="store_true",
                      help="also time the weight sync (pack_weights) per layer, each FP4 variant")
  args = parser.parse_args()
  variants = [v for v in args.variants.split(",") if v]
  for v in variants:
    try:
      parse_variant(v)
    except ValueError as e:
      parser.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  memory = int(args.memory_gb * 2**30) if args.memory_gb else None
  if "max" in args.batches and not (memory or device_bytes()):
    parser.error("--batches=max needs --memory_gb here: this device does not say how much "
                 "memory arrays may take")
  path = os.path.join(args.out, "bench_rollout.json")

  def write(result):  # after every row: a run cut short keeps what it measured
    with open(path + ".tmp", "w") as fh:
      json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)

  result = run(args.layers, args.batches, args.context, args.steps, variants, args.preset,
               args.profile, args.out if args.hlo else None, args.slots, args.sync, memory,
               on_row=write)
  write(result)
  print(table(result))


if __name__ == "__main__":
  main()
