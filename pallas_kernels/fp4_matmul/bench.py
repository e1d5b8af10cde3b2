"""Benchmark of the FP4 matmul against bf16 paths, on decode shapes, in one run.

    python -m pallas_kernels.fp4_matmul.bench [--out=DIR] [--quick] [--grouped] [--engine]

For each shape and batch M: XLA's bf16 dot, the project's bf16 kernel, the FP4 kernel (MXFP4 and
NVFP4, a few tile configurations), XLA's dequantize-then-dot, and PyTorch's bf16 `x @ W` when
torch sees a GPU. With --grouped, the same for the MoE expert matmul (`run_grouped`). With
--engine, each kernel only as the rollout engine calls it (its default tiles: the Triton FP4
kernel on a plainly packed weight, the Mosaic one on a tiled weight, the Triton bf16 kernel; the
Mosaic bf16 kernel, which the engine does not run, with its default tiles for comparison), for
a table of every decode size in one run.
Each variant is checked against its reference on fresh random inputs first.
Times are medians over repeated runs that rotate among weight copies larger than the L2 cache;
bandwidth counts the bytes that must move: weights (codes + scales), activations, outputs.
Writes fp4_matmul_bench.json (--grouped: fp4_matmul_grouped.json) and prints a table; the
device-to-device copy bandwidth is measured too.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dispatch import FP4_ORDER
from pallas_kernels.fp4_matmul import api, layout, mosaic, mosaic_grouped_baseline, reference
from pallas_kernels.timing import KERNELS, copy_bandwidth, cuda_event_seconds, time_calls
from trace_jax.quant import MXFP4, NVFP4_TENSOR, quantize

# decode shapes of the qwen3_30b_a3b preset and the dot of the kernels issue
SHAPES = {"q_proj 2048x4096": (2048, 4096), "dot 4096x14336": (4096, 14336)}
BATCHES = (1, 16, 64, 256)
SWEEP = [dict(block_n=bn, rows=r, num_warps=w, num_stages=st, splits=sp)
         for bn, r, w, st, sp in [(64, 16, 4, 4, None), (64, 32, 4, 4, 8), (128, 32, 4, 4, 8),
                                  (128, 64, 4, 3, 4), (256, 32, 8, 4, 4), (64, 64, 2, 4, 8),
                                  (32, 64, 2, 4, 16), (128, 16, 4, 5, 16)]]
CONFIGS = [dict(block_n=64, rows=16, num_warps=4, num_stages=4, variant="dot"),
           dict(block_n=64, rows=32, num_warps=4, num_stages=4, variant="dot"),
           dict(block_n=128, rows=32, num_warps=4, num_stages=3, variant="dot"),
           dict(block_n=128, rows=16, num_warps=4, num_stages=4, splits=8, variant="gemv")]
DECODE_SWEEP = [dict(cfg, decode=d, variant="dot") for cfg in SWEEP for d in ("bits", "asm")]
KMAJOR = [dict(block_n=bn, rows=r, num_warps=w, num_stages=st, splits=sp, layout="kmajor")
          for bn, r, w, st, sp in [(64, 32, 4, 4, None), (128, 32, 4, 4, None),
                                   (64, 64, 4, 3, None), (128, 64, 8, 3, None),
                                   (256, 32, 8, 3, None), (128, 16, 4, 4, 8)]]
KMAJOR_SWEEP = KMAJOR + [dict(block_n=64, rows=32, num_warps=4, num_stages=4, variant="dot")]
GEMV_SWEEP = ([dict(block_n=bn, rows=r, num_warps=w, num_stages=st, splits=sp, decode="asm",
                    variant="gemv")
               for bn, r, w, st, sp in [(64, 16, 2, 4, 8), (128, 16, 4, 4, 8), (128, 32, 4, 4, 4),
                                        (256, 16, 4, 4, 4), (256, 32, 8, 3, 4),
                                        (64, 64, 4, 3, 8), (128, 64, 8, 3, 4), (512, 16, 8, 4, 2),
                                        (256, 64, 8, 3, 2), (32, 32, 1, 4, 16)]]
              + [dict(block_n=128, rows=32, num_warps=4, num_stages=4, splits=4, decode="bits",
                      variant="gemv")]
              + [dict(c, decode="asm", variant="dot") for c in SWEEP[:3]])
# the Mosaic GPU (wgmma, decoded weight in registers) kernels against the Triton ones
# (decode "asm": the PTX decode in the A operand's registers; "jnp": integer operations; None:
# the kernel's default for the M, `mosaic.pipeline`, 128 x 4 up to M = 64)
MOSAIC = [dict(backend="mosaic", block_k2=bk, splits=sp, max_concurrent_steps=st, decode=d)
          for bk, sp, st, d in [(None, None, None, "asm"), (256, None, 4, "asm"),
                                (64, None, 8, "asm"), (256, None, 2, "asm"),
                                (128, None, 4, "jnp")]]
MOSAIC += [dict(backend="mosaic", out_rows=False)]  # y^T written, then transposed
MOSAIC_SWEEP = MOSAIC + [dict(block_n=64, rows=32, num_warps=4, num_stages=4, variant="dot")]
MOSAIC_BF16 = [dict(block_k=bk, splits=sp, max_concurrent_steps=st)
               for bk, sp, st in [(128, None, 4), (64, None, 6), (128, 2, 3), (256, None, 3)]]
# the kernels as the rollout engine calls them (`pallas_kernels.dispatch`): the Triton FP4
# kernel's tiles for a plainly packed weight, the Mosaic kernel's defaults for a tiled one
ENGINE = [dict(block_n=64, rows=32, num_warps=4, num_stages=4, variant="dot"),
          dict(backend="mosaic")]


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def torch_time(m: int, k: int, n: int, copies: int) -> float | None:
  try:
    import torch
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
  ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
  return cuda_event_seconds(torch, lambda w: x @ w, ws)


def _attempt(result: dict, what: str, fn) -> None:
  """Runs fn; a variant that fails to lower or run is reported in result["errors"], not fatal."""
  try:
    fn()
  except Exception as e:  # noqa: BLE001
    result.setdefault("errors", []).append(f"{what}: {type(e).__name__}: {str(e)[:300]}")


def _record(result: dict, shape: str, m: int, variant: str, times, bytes_moved: float,
            rel: float, extra: dict | None = None) -> None:
  wall, device = times
  seconds = device or wall  # the kernels' own time where the trace has it
  extra = {("kernel" if key == "variant" else key): v for key, v in (extra or {}).items()}
  result["rows"].append({"shape": shape, "M": m, "variant": variant, "us": seconds * 1e6,
                         "wall_us": wall * 1e6, "GB/s": bytes_moved / seconds / 1e9,
                         "copy_frac": bytes_moved / seconds / result["copy_bytes_per_s"],
                         "rel_err": rel, "kernels_us": dict(KERNELS) if device else {}, **extra})
  print(json.dumps(result["rows"][-1]), flush=True)  # partial results survive a timeout


def run(quick: bool = False, shapes: list[str] | None = None, batches: list[int] | None = None,
        configs: list[dict] | None = None, formats: list[str] | None = None,
        mosaic_bf16: list[dict] = MOSAIC_BF16) -> dict:
  key = jax.random.PRNGKey(0)
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(0.5 if quick else 2.0), "rows": []}
  shapes = {k: v for k, v in SHAPES.items() if not shapes or k.split()[0] in shapes}
  if quick:
    shapes = dict(list(shapes.items())[:1])
  configs = configs or (CONFIGS[:1] if quick else CONFIGS)
  for name, (k, n) in shapes.items():
    copies = max(4, int(np.ceil(200e6 / (k * n * 2))))  # > L2 even in bf16
    kw, kx = jax.random.split(jax.random.fold_in(key, k * n))
    w32 = [jax.random.normal(jax.random.fold_in(kw, i), (k, n)) * 0.05 for i in range(copies)]
    w16 = [w.astype(jnp.bfloat16) for w in w32]
    packed = {f.name: [quantize(w, f, axis=0) for w in w32] for f in (MXFP4, NVFP4_TENSOR)
              if not formats or f.name in formats}
    del w32
    for m in batches or (BATCHES[:2] if quick else BATCHES):
      x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
      io_bytes = (m * k + m * n) * 2

      def attempt(fn, what):
        _attempt(result, f"{name} M={m} {what}", fn)

      def record(variant, times, weight_bytes, rel, extra=None):
        _record(result, name, m, variant, times, weight_bytes + io_bytes, rel, extra)

      ref16 = reference.bf16_matmul(x, w16[0])
      record("xla bf16", time_calls(reference.bf16_matmul, x, w16), k * n * 2, 0.0)
      g = lambda a, b: api.bf16_matmul(a, b, implementation="pallas")
      attempt(lambda: record("pallas bf16", time_calls(g, x, w16), k * n * 2,
                             _rel(jax.jit(g)(x, w16[0]), ref16)), "pallas bf16")
      if any(c.get("backend") == "mosaic" for c in configs):
        w16t = [w.T for w in w16]  # K-major, outside the timing
        for cfg in mosaic_bf16:
          g = lambda a, b, cfg=cfg: mosaic.bf16_matmul(a, b, **cfg)
          attempt(lambda g=g, cfg=cfg: record("mosaic bf16", time_calls(g, x, w16t), k * n * 2,
                                              _rel(jax.jit(g)(x, w16t[0]), ref16), cfg),
                  f"mosaic bf16 {cfg}")
        del w16t
      t = torch_time(m, k, n, copies)
      if t is not None:
        record("torch bf16", (t, None), k * n * 2, float("nan"))  # CUDA events
      for fmt, ws in packed.items():
        wbytes = ws[0].nbytes
        ref = reference.fp4_matmul(x, ws[0])
        record(f"xla {fmt} dequant+dot", time_calls(reference.fp4_matmul, x, ws), wbytes, 0.0)
        wts = tiled = None
        for cfg in configs:
          if n % cfg.get("block_n", 64) or (cfg.get("variant") == "gemv" and m > 8):
            continue
          kw = {key: v for key, v in cfg.items() if key not in ("layout", "backend")}
          if cfg.get("layout") == "kmajor":
            wts = wts or [reference.transpose(w) for w in ws]  # outside the timing
            args, label = wts, dict(kw, variant="kmajor")
          else:
            args, label = ws, kw
          p = lambda a, b, kw=kw: api.fp4_matmul(a, b, implementation="pallas", **kw)
          if cfg.get("backend") == "mosaic":  # the weight in its tiled layout
            tiled = tiled or [layout.tile(w) for w in ws]  # outside the timing
            args, label = tiled, dict(kw, variant="mosaic")
            p = lambda a, b, kw=kw: mosaic.fp4_matmul(a, b, **kw)
          attempt(lambda p=p, args=args, label=label: record(
              f"pallas {fmt}", time_calls(p, x, args), wbytes, _rel(jax.jit(p)(x, args[0]), ref),
              label), f"pallas {fmt} {cfg}")
  return result


# qwen3_30b_a3b's MoE experts at decode: 128 experts, top-8 routing, d_model 2048, d_ff 768
EXPERTS, TOP_K = 128, 8
GROUPED_SHAPES = {"gate/up 2048x768": (2048, 768), "down 768x2048": (768, 2048)}
# JAX's Mosaic GPU grouped kernel (`mosaic_grouped_baseline`) at decode: block_m at its minimum
# (each group holds a few rows), N tiles of 64-256 columns (768 and 2048 are multiples of
# each), deep K pipelines within shared memory; the last reads the weight K-major ([E, N, K])
MOSAIC_GROUPED_BF16 = [dict(block_m=64, block_n=bn, block_k=bk, max_concurrent_steps=st)
                       for bn, bk, st in [(128, 64, 4), (128, 128, 4), (64, 128, 6), (256, 64, 4)]]
MOSAIC_GROUPED_BF16 += [dict(MOSAIC_GROUPED_BF16[0], transpose_rhs=True)]
# the project's Mosaic grouped FP4 kernel (`mosaic.grouped_fp4_matmul`: 8-token tiles for
# "halves" weights, 16 for "pairs", its defaults)
MOSAIC_GROUPED_FP4 = [dict(block_k2=bk, max_concurrent_steps=st)
                      for bk, st in [(128, 4), (64, 8), (192, 2)]] + [
    dict(block_k2=bk, max_concurrent_steps=st, row_tiles=rt)  # "halves" weights only
    for rt, bk, st in [(2, 128, 4), (2, 128, 2), (2, 64, 4), (4, 128, 2), (4, 64, 3)]]
# y^T written by the kernel (one split), its columns gathered back and transposed (the
# configs above write y's rows, the default)
MOSAIC_GROUPED_FP4 += [dict(block_k2=128, max_concurrent_steps=4, splits=1, out_rows=False)]
# 16-token tiles for "halves" weights (8 by default): each expert's rows padded to a multiple
# of 16
MOSAIC_GROUPED_FP4 += [dict(splits=1, tile_m=16), dict(block_k2=64, splits=1, tile_m=16),
                       dict(tile_m=16)]
# the project's Mosaic grouped bf16 kernel (`mosaic.grouped_bf16_matmul`, 16-token tiles, x and
# the weight both read transposed from shared memory)
MOSAIC_GROUPED_BF16_PROJECT = [dict(block_k=bk, max_concurrent_steps=st)
                               for bk, st in [(128, 4), (64, 8), (256, 2)]]


def weight_copies(k: int, n: int) -> int:
  """The weight copies a grouped row cycles through: the experts one token hits (TOP_K) in all
  of them past the L2 cache, at least 4."""
  return max(4, int(np.ceil(200e6 / (TOP_K * k * n * 2))))


def routing(key, m: int, experts: int, top_k: int) -> jax.Array:
  """group_sizes [E] int32 for M tokens, each routed to top_k distinct experts drawn uniformly
  (T = top_k x M rows, sorted by expert)."""
  choice = jnp.argsort(jax.random.uniform(key, (m, experts)), axis=1)[:, :top_k]
  return jnp.bincount(choice.ravel(), length=experts).astype(jnp.int32)


def torch_grouped(x, w, group_sizes, copies: int, ref) -> tuple[float, float] | str:
  """(seconds per call by CUDA events, rel. error against `ref`) of torch._grouped_mm(a [T, K],
  b [E, K, N], offs = each group's int32 end row) over `copies` random weights, checked on x and
  w themselves; or why it was skipped (no torch, no GPU, no _grouped_mm)."""
  try:
    import torch
  except ImportError:
    return "torch bf16 grouped_mm skipped: torch is not installed"
  if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
    return (f"torch bf16 grouped_mm skipped: torch {torch.__version__} has "
            f"{'no torch._grouped_mm' if torch.cuda.is_available() else 'no GPU'}")
  to_torch = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to("cuda", torch.bfloat16)
  xt = to_torch(x)
  offs = torch.from_numpy(np.cumsum(np.asarray(group_sizes))).to("cuda", torch.int32)
  got = torch._grouped_mm(xt, to_torch(w), offs=offs).float().cpu().numpy()
  rel = _rel(got, ref) if ref is not None else float("nan")
  ws = [torch.randn(*w.shape, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
  return cuda_event_seconds(torch, lambda b: torch._grouped_mm(xt, b, offs=offs), ws), rel


def run_grouped(quick: bool = False, shapes: list[str] | None = None,
                batches: list[int] | None = None, formats: list[str] | None = None,
                engine: bool = False, skip: tuple[str, ...] = ()) -> dict:
  """The MoE expert matmul of qwen3_30b_a3b at decode, per projection and batch M (T = TOP_K x M
  routed rows): XLA's ragged_dot and the project's kernel in bf16, JAX's Mosaic GPU grouped
  kernel in bf16 (each of MOSAIC_GROUPED_BF16), the project's Mosaic bf16 kernel (each of
  MOSAIC_GROUPED_BF16_PROJECT), torch's _grouped_mm, and MXFP4 / NVFP4 by XLA (dequantize +
  ragged_dot), by the Triton kernel with its default tiles and by the project's Mosaic kernel
  on weights in either nibble order (`layout.ORDERS`; each of MOSAIC_GROUPED_FP4). `engine`:
  only what the rollout engine runs, with its defaults (no JAX or project Mosaic bf16 kernel,
  the engine's nibble order). `skip`: variants to leave out, by the start of their name,
  torch's among them (the xla references always run). Bytes moved count
  the weights of the experts hit (distinct among the routed rows), activations and outputs;
  each xla row is the reference of the rows after it."""
  key = jax.random.PRNGKey(0)
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(0.5 if quick else 2.0), "rows": []}
  shapes = {k: v for k, v in GROUPED_SHAPES.items() if not shapes or k.split()[0] in shapes}
  fmts = [f for f in (MXFP4, NVFP4_TENSOR) if not formats or f.name in formats]
  for name, (k, n) in shapes.items():
    copies = weight_copies(k, n)
    kw, kx = jax.random.split(jax.random.fold_in(key, k * n))
    w16, packed = [], {f.name: [] for f in fmts}
    for i in range(copies):
      w32 = jax.random.normal(jax.random.fold_in(kw, i), (EXPERTS, k, n)) * 0.05
      w16.append(w32.astype(jnp.bfloat16))
      for f in fmts:
        packed[f.name].append(quantize(w32, f, axis=-2))
    del w32
    w16t = ([jnp.swapaxes(w, 1, 2) for w in w16]  # [E, N, K], outside the timing
            if not engine and any(c.get("transpose_rhs") for c in MOSAIC_GROUPED_BF16)
            else None)
    for m in batches or (BATCHES[:2] if quick else BATCHES):
      t = TOP_K * m
      xs = (jax.random.normal(jax.random.fold_in(kx, m), (t, k), jnp.bfloat16),
            routing(jax.random.fold_in(key, m), m, EXPERTS, TOP_K))  # the same for every shape
      hit = int(jnp.sum(xs[1] > 0))
      extra = {"T": t, "experts_hit": hit}
      refs = {}

      def row(variant, fn, ws, expert_bytes, ref, cfg=None):
        if not variant.startswith("xla") and variant.startswith(tuple(skip)):
          return
        out = jax.jit(fn)(xs, ws[0])
        if variant.startswith("xla"):  # the reference of its format (rel_err 0)
          refs[ref] = out
        _record(result, name, m, variant, time_calls(fn, xs, ws),
                hit * expert_bytes + t * (k + n) * 2,
                _rel(out, refs[ref]) if ref in refs else float("nan"), dict(extra, **cfg or {}))

      xla16 = lambda a, w: reference.grouped_bf16_matmul(a[0], w, a[1])
      pallas16 = lambda a, w: api.grouped_bf16_matmul(a[0], w, a[1], implementation="pallas")
      for variant, fn in (("xla bf16 ragged_dot", xla16), ("pallas bf16", pallas16)):
        _attempt(result, f"{name} M={m} {variant}",
                 lambda: row(variant, fn, w16, k * n * 2, "bf16"))
      for cfg in [] if engine else MOSAIC_GROUPED_BF16:
        mgpu16 = lambda a, w, cfg=cfg: mosaic_grouped_baseline.grouped_bf16_matmul(
            a[0], w, a[1], **cfg)
        _attempt(result, f"{name} M={m} mosaic bf16 ragged_dot_mgpu {cfg}",
                 lambda: row("mosaic bf16 (jax ragged_dot_mgpu)", mgpu16,
                             w16t if cfg.get("transpose_rhs") else w16, k * n * 2, "bf16", cfg))
      for cfg in [] if engine else MOSAIC_GROUPED_BF16_PROJECT:
        own16 = lambda a, w, cfg=cfg: mosaic.grouped_bf16_matmul(a[0], w, a[1], **cfg)
        _attempt(result, f"{name} M={m} mosaic bf16 {cfg}",
                 lambda: row("mosaic bf16", own16, w16, k * n * 2, "bf16", cfg))
      torch_row = "torch bf16 grouped_mm"
      timed = (None if torch_row.startswith(tuple(skip)) else
               torch_grouped(xs[0], w16[0], xs[1], copies, refs.get("bf16")))
      if isinstance(timed, str):
        if timed not in result.setdefault("notes", []):
          result["notes"].append(timed)
      elif timed is not None:
        _record(result, name, m, torch_row, (timed[0], None),
                hit * k * n * 2 + t * (k + n) * 2, timed[1], extra)
      for fmt, ws in packed.items():
        xla = lambda a, w: reference.grouped_fp4_matmul(a[0], w, a[1])
        pallas = lambda a, w: api.grouped_fp4_matmul(a[0], w, a[1], implementation="pallas")
        for variant, fn in ((f"xla {fmt} dequant+ragged_dot", xla), (f"pallas {fmt}", pallas)):
          _attempt(result, f"{name} M={m} {variant}",
                   lambda: row(variant, fn, ws, ws[0].nbytes / EXPERTS, fmt))
        for order in (FP4_ORDER,) if engine else layout.ORDERS:
          tiled = [layout.tile(w, order) for w in ws]  # outside the timing
          label = f"mosaic {fmt}" + ("" if order == "pairs" else f" {order}")
          for cfg in [{}] if engine else [c for c in MOSAIC_GROUPED_FP4 if order == "halves"
                                          or "row_tiles" not in c and "tile_m" not in c]:
            mgpu4 = lambda a, w, cfg=cfg: mosaic.grouped_fp4_matmul(a[0], w, a[1], **cfg)
            _attempt(result, f"{name} M={m} {label} {cfg}",
                     lambda: row(label, mgpu4, tiled, ws[0].nbytes / EXPERTS, fmt, cfg))
  return result


BF16_SWEEP = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st, splits=sp)
              for bn, bk, w, st, sp in [(64, 64, 4, 3, 1), (64, 128, 4, 4, 1), (64, 256, 4, 3, 1),
                                        (32, 256, 4, 4, 2), (128, 128, 8, 4, 1),
                                        (64, 256, 8, 4, 4), (32, 512, 4, 3, 4),
                                        (128, 256, 8, 3, 2), (16, 512, 4, 4, 8)]]


def overhead_and_bf16_sweep(batches=(1, 16)) -> dict:
  """What the timing harness costs (a matmul that returns zeros), and how close the bf16
  kernel's memory pipeline gets to the copy bandwidth over tile shapes."""
  k, n = SHAPES["dot 4096x14336"]
  copies = 4
  ws = [(jax.random.normal(jax.random.PRNGKey(i), (k, n)) * 0.05).astype(jnp.bfloat16)
        for i in range(copies)]
  out = {"rows": []}
  for m in batches:
    x = jax.random.normal(jax.random.PRNGKey(99), (m, k), jnp.bfloat16)
    null = lambda a, b: jnp.zeros((a.shape[0], b.shape[1]), jnp.bfloat16) + a[:, :1]
    us = lambda t: {"wall_us": t[0] * 1e6, "us": (t[1] or t[0]) * 1e6}
    out["rows"].append({"M": m, "variant": "harness (zeros)", **us(time_calls(null, x, ws))})
    out["rows"].append({"M": m, "variant": "xla bf16",
                        **us(time_calls(reference.bf16_matmul, x, ws))})
    for cfg in BF16_SWEEP:
      fn = lambda a, b, cfg=cfg: api.bf16_matmul(a, b, implementation="pallas", **cfg)
      try:
        out["rows"].append({"M": m, "variant": "pallas bf16", **cfg, **us(time_calls(fn, x, ws))})
      except Exception as e:  # noqa: BLE001
        out["rows"].append({"M": m, "variant": f"pallas bf16 {cfg} failed: {str(e)[:200]}"})
  for r in out["rows"]:
    if "us" in r:
      r["GB/s"] = (k * n * 2 + (r["M"] * (k + n)) * 2) / r["us"] / 1e3
  return out


def load_probe(k: int = 4096, n: int = 14336, copies: int = 8) -> list[dict]:
  """How fast a Pallas/Triton kernel of the FP4 kernel's grid and K loop only *loads* a weight:
  each step loads a [rows, block_n] tile and xors it into an integer accumulator (one operation
  per element), for the packed codes as bytes (uint8 [K/2, N]), the same bytes as 32-bit words
  (uint32 [K/2, N/4]), and a bf16 weight's bits (uint16 [K, N]). A probe of the memory
  pipeline: if the byte tile alone is slow, the decode is not what limits the FP4 kernel."""
  from pallas_kernels.fp4_matmul.kernel import _compiler_params
  from jax.experimental import pallas as pl

  def probe(w, rows, block_n, splits, warps, stages):
    kr, nc = w.shape
    per_split = kr // splits

    def kernel(w_ref, o_ref):
      n0 = pl.multiple_of(pl.program_id(0) * block_n, block_n)
      base = pl.program_id(1) * per_split

      def step(i, acc):
        r0 = pl.multiple_of(base + i * rows, rows)
        return acc ^ w_ref[pl.ds(r0, rows), pl.ds(n0, block_n)].astype(jnp.int32)

      acc = jax.lax.fori_loop(0, per_split // rows, step, jnp.zeros((rows, block_n), jnp.int32))
      o_ref[...] = jnp.sum(acc, axis=0, keepdims=True)

    return pl.pallas_call(
        kernel, grid=(nc // block_n, splits), in_specs=[pl.no_block_spec],
        out_specs=pl.BlockSpec((None, 1, block_n), lambda i, s: (s, 0, i)),
        out_shape=jax.ShapeDtypeStruct((splits, 1, nc), jnp.int32),
        compiler_params=_compiler_params(warps, stages))(w)

  rows_out = []
  key = jax.random.PRNGKey(3)
  u8 = [jax.random.randint(jax.random.fold_in(key, i), (k // 2, n), 0, 256).astype(jnp.uint8)
        for i in range(copies)]
  weights = {"uint8 codes": u8,
             "uint32 words": [jax.lax.bitcast_convert_type(c.reshape(k // 2, n // 4, 4),
                                                           jnp.uint32) for c in u8],
             "uint16 (bf16 weight)": [jax.random.randint(jax.random.fold_in(key, 99 + i),
                                                         (k, n), 0, 65535).astype(jnp.uint16)
                                      for i in range(copies // 2)]}
  x = jnp.zeros((1,), jnp.float32)
  for name, ws in weights.items():
    cols = ws[0].shape[1]
    for rows, bn, splits, warps, stages in [(16, 128, 8, 4, 4), (32, 128, 8, 4, 4),
                                            (64, 128, 4, 4, 3), (16, 256, 8, 4, 4),
                                            (32, 64, 8, 4, 4)]:
      bn_eff = bn if name != "uint32 words" else bn // 4  # the same bytes per tile as uint8
      if cols % bn_eff:
        continue
      f = lambda a, w, r=rows, b=bn_eff, s=splits, nw=warps, st=stages: probe(w, r, b, s, nw,
                                                                               st)
      try:
        wall, dev = time_calls(f, x, ws)
      except Exception as e:  # noqa: BLE001
        rows_out.append({"probe": name, "error": str(e)[:200]})
        continue
      t = dev or wall
      rows_out.append({"probe": name, "rows": rows, "block_n": bn_eff, "splits": splits,
                       "num_warps": warps, "num_stages": stages, "us": t * 1e6,
                       "GB/s": ws[0].nbytes / t / 1e9})
      print(json.dumps(rows_out[-1]), flush=True)
  return rows_out


def table(result: dict) -> str:
  errors = result.get("errors", [])
  lines = [f"device {result['device']}, jax {result['jax']}, copy "
           f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s",
           f"{'shape':18s} {'M':>4s} {'variant':40s} {'us':>9s} {'wall us':>8s} {'GB/s':>8s} "
           f"{'%copy':>6s} {'rel err':>8s}"]
  for r in result["rows"]:
    cfg = (f" n{r['block_n']}r{r['rows']}w{r['num_warps']}s{r['num_stages']}"
           f"{'k' + str(r['splits']) if r.get('splits') else ''} {r.get('decode', '')} "
           f"{r.get('kernel', '')}"
           if "block_n" in r and "rows" in r else
           " " + " ".join(f"{key}={r[key]}" for key in ("block_m", "block_n", "block_k2",
                                                      "block_k", "splits",
                                                      "max_concurrent_steps", "row_tiles",
                                                      "tile_m", "out_rows", "transpose_rhs",
                                                      "decode", "kernel")
                          if r.get(key) is not None))
    routed = f" T={r['T']} hit={r['experts_hit']}" if "experts_hit" in r else ""
    lines.append(f"{r['shape']:18s} {r['M']:4d} {r['variant'] + cfg:40s} {r['us']:9.1f} "
                 f"{r['wall_us']:8.1f} {r['GB/s']:8.0f} {100 * r['copy_frac']:6.1f} "
                 f"{r['rel_err']:8.1e}{routed}")
  return "\n".join(lines + [f"NOTE {n}" for n in result.get("notes", [])]
                   + [f"ERROR {e}" for e in errors[:10]])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--shapes", default="",
                      help="comma-separated shape names (q_proj, dot; --grouped: gate/up, down)")
  parser.add_argument("--batches", default="", help="comma-separated M values")
  parser.add_argument("--formats", default="", help="comma-separated: mxfp4, nvfp4_tensor")
  parser.add_argument("--sweep", action="store_true", help="a wider sweep of tile configs")
  parser.add_argument("--decode_sweep", action="store_true",
                      help="the wide sweep, each config with both FP4 decodes (bits, asm)")
  parser.add_argument("--kmajor_sweep", action="store_true",
                      help="tile configs of the K-major kernel (weight in registers)")
  parser.add_argument("--mosaic_sweep", action="store_true",
                      help="the Mosaic GPU (wgmma) kernels, FP4 and bf16, and the Triton dot")
  parser.add_argument("--gemv_sweep", action="store_true",
                      help="tile configs of the few-row (gemv) kernel, and a few of the dot one")
  parser.add_argument("--grouped", action="store_true",
                      help="the MoE expert matmul (qwen3_30b_a3b: 128 experts, top-8) instead")
  parser.add_argument("--engine", action="store_true",
                      help="each kernel only as the rollout engine calls it (default tiles)")
  parser.add_argument("--skip", default="",
                      help="--grouped: comma-separated variants to leave out, by the start of "
                           "their name (e.g. 'mosaic bf16 (jax')")
  parser.add_argument("--load_probe", action="store_true",
                      help="only the load-throughput probe (uint8 / uint32 / uint16 tiles)")
  parser.add_argument("--bf16_sweep", action="store_true",
                      help="only the harness overhead and a bf16 tile sweep on the big dot")
  args = parser.parse_args()
  if args.load_probe:
    with open(os.path.join(args.out, "load_probe.json"), "w") as fh:
      json.dump(load_probe(), fh, indent=1)
    return
  if args.bf16_sweep:
    out = overhead_and_bf16_sweep()
    with open(os.path.join(args.out, "bf16_sweep.json"), "w") as fh:
      json.dump(out, fh, indent=1)
    for r in out["rows"]:
      print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    return
  shapes = [s for s in args.shapes.split(",") if s]
  batches = [int(b) for b in args.batches.split(",") if b]
  formats = [f for f in args.formats.split(",") if f]
  if args.grouped:
    result = run_grouped(args.quick, shapes, batches, formats, args.engine,
                         tuple(v for v in args.skip.split(",") if v))
    path = "fp4_matmul_grouped.json"
  elif args.engine:
    result = run(args.quick, shapes, batches, ENGINE, formats, MOSAIC_BF16[:1])
    path = "fp4_matmul_bench.json"
  else:
    result = run(args.quick, shapes, batches,
                 MOSAIC_SWEEP if args.mosaic_sweep
                 else KMAJOR_SWEEP if args.kmajor_sweep else GEMV_SWEEP if args.gemv_sweep
                 else DECODE_SWEEP if args.decode_sweep
                 else SWEEP if args.sweep else None, formats)
    path = "fp4_matmul_bench.json"
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, path), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table(result))


if __name__ == "__main__":
  main()
