"""Benchmark of the FP4 matmul against bf16 paths, on decode shapes, in one run.

    python -m pallas_kernels.fp4_matmul.bench [--out=DIR] [--quick]

For each shape and batch M: XLA's bf16 dot, the project's bf16 kernel, the FP4 kernel (MXFP4 and
NVFP4, a few tile configurations), XLA's dequantize-then-dot, and PyTorch's bf16 `x @ W` when
torch sees a GPU. Each variant is checked against its reference on fresh random inputs first.
Times are medians over repeated runs that rotate among weight copies larger than the L2 cache;
bandwidth counts the bytes that must move: weights (codes + scales), activations, outputs.
Writes bench.json and prints a table; the device-to-device copy bandwidth is measured too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.fp4_matmul import api, reference
from trace_jax.quant import MXFP4, NVFP4_TENSOR, quantize

# decode shapes of the qwen3_30b_a3b preset and the dot of the kernels issue
SHAPES = {"q_proj 2048x4096": (2048, 4096), "dot 4096x14336": (4096, 14336)}
BATCHES = (1, 16, 64, 256)
SWEEP = [dict(block_n=bn, rows=r, num_warps=w, num_stages=st, splits=sp)
         for bn, r, w, st, sp in [(64, 16, 4, 4, None), (64, 32, 4, 4, 8), (128, 32, 4, 4, 8),
                                  (128, 64, 4, 3, 4), (256, 32, 8, 4, 4), (64, 64, 2, 4, 8),
                                  (32, 64, 2, 4, 16), (128, 16, 4, 5, 16)]]
CONFIGS = [dict(block_n=64, rows=16, num_warps=4, num_stages=4),
           dict(block_n=128, rows=32, num_warps=4, num_stages=3),
           dict(block_n=64, rows=64, num_warps=4, num_stages=3),
           dict(block_n=256, rows=32, num_warps=8, num_stages=3)]


def _time(matmul, x, weights, reps: int = 7) -> float:
  """Median seconds per matmul: one jitted call runs it once on each weight copy (separate
  buffers, together larger than the L2 cache; one dispatch), summing the outputs so that
  nothing is skipped."""

  @jax.jit
  def loop(x, ws):
    return sum(jnp.sum(matmul(x, w).astype(jnp.float32)) for w in ws)

  jax.block_until_ready(loop(x, weights))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(loop(x, weights))
    samples.append((time.perf_counter() - start) / len(weights))
  return statistics.median(samples)


def copy_bandwidth(gib: float = 2.0, reps: int = 7) -> float:
  """Bytes read plus written per second by a large device-to-device copy (PyTorch's copy_
  where torch sees the GPU, else an XLA elementwise pass)."""
  try:
    import torch
    if torch.cuda.is_available():
      src = torch.randn(int(gib * 2**30) // 4, device="cuda")
      dst = torch.empty_like(src)
      dst.copy_(src)
      torch.cuda.synchronize()
      samples = []
      for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
      return 2 * src.numel() * 4 / statistics.median(samples)
  except ImportError:
    pass
  x = jax.random.normal(jax.random.PRNGKey(1), (int(gib * 2**30) // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  jax.block_until_ready(f(x))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(f(x))
    samples.append(time.perf_counter() - start)
  return 2 * x.nbytes / statistics.median(samples)


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
  for w in ws:
    x @ w
  torch.cuda.synchronize()
  samples = []
  for _ in range(5):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for w in ws:
      x @ w
    end.record()
    torch.cuda.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / len(ws))
  return statistics.median(samples)


def run(quick: bool = False, shapes: list[str] | None = None, batches: list[int] | None = None,
        configs: list[dict] | None = None) -> dict:
  key = jax.random.PRNGKey(0)
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(0.5 if quick else 2.0), "rows": []}
  shapes = {k: v for k, v in SHAPES.items() if not shapes or k.split()[0] in shapes}
  if quick:
    shapes = dict(list(shapes.items())[:1])
  configs = configs or (CONFIGS[:1] if quick else CONFIGS)
  for name, (k, n) in shapes.items():
    copies = max(2, int(np.ceil(200e6 / (k * n * 2))))  # > L2 even in bf16
    kw, kx = jax.random.split(jax.random.fold_in(key, k * n))
    w32 = [jax.random.normal(jax.random.fold_in(kw, i), (k, n)) * 0.05 for i in range(copies)]
    w16 = [w.astype(jnp.bfloat16) for w in w32]
    packed = {f.name: [quantize(w, f, axis=0) for w in w32] for f in (MXFP4, NVFP4_TENSOR)}
    del w32
    for m in batches or (BATCHES[:2] if quick else BATCHES):
      x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
      io_bytes = (m * k + m * n) * 2

      def attempt(fn, what):  # a variant that fails to lower or run is reported, not fatal
        try:
          fn()
        except Exception as e:  # noqa: BLE001
          result.setdefault("errors", []).append(f"{name} M={m} {what}: {type(e).__name__}: "
                                                 f"{str(e)[:300]}")

      def record(variant, seconds, weight_bytes, rel, extra=None):
        bytes_moved = weight_bytes + io_bytes
        result["rows"].append({"shape": name, "M": m, "variant": variant, "us": seconds * 1e6,
                               "GB/s": bytes_moved / seconds / 1e9,
                               "copy_frac": bytes_moved / seconds / result["copy_bytes_per_s"],
                               "rel_err": rel, **(extra or {})})

      ref16 = reference.bf16_matmul(x, w16[0])
      record("xla bf16", _time(reference.bf16_matmul, x, w16), k * n * 2, 0.0)
      g = lambda a, b: api.bf16_matmul(a, b, implementation="pallas")
      attempt(lambda: record("pallas bf16", _time(g, x, w16), k * n * 2,
                             _rel(jax.jit(g)(x, w16[0]), ref16)), "pallas bf16")
      t = torch_time(m, k, n, copies)
      if t is not None:
        record("torch bf16", t, k * n * 2, float("nan"))
      for fmt, ws in packed.items():
        wbytes = ws[0].nbytes
        ref = reference.fp4_matmul(x, ws[0])
        record(f"xla {fmt} dequant+dot", _time(reference.fp4_matmul, x, ws), wbytes, 0.0)
        for cfg in configs:
          if n % cfg["block_n"]:
            continue
          p = lambda a, b, cfg=cfg: api.fp4_matmul(a, b, implementation="pallas", **cfg)
          attempt(lambda p=p, cfg=cfg: record(
              f"pallas {fmt}", _time(p, x, ws), wbytes, _rel(jax.jit(p)(x, ws[0]), ref),
              dict(cfg)), f"pallas {fmt} {cfg}")
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
    out["rows"].append({"M": m, "variant": "harness (zeros)", "us": _time(null, x, ws) * 1e6})
    out["rows"].append({"M": m, "variant": "xla bf16",
                        "us": _time(reference.bf16_matmul, x, ws) * 1e6})
    for cfg in BF16_SWEEP:
      fn = lambda a, b, cfg=cfg: api.bf16_matmul(a, b, implementation="pallas", **cfg)
      try:
        out["rows"].append({"M": m, "variant": "pallas bf16", **cfg,
                            "us": _time(fn, x, ws) * 1e6})
      except Exception as e:  # noqa: BLE001
        out["rows"].append({"M": m, "variant": f"pallas bf16 {cfg} failed: {str(e)[:200]}"})
  for r in out["rows"]:
    if "us" in r:
      r["GB/s"] = (k * n * 2 + (r["M"] * (k + n)) * 2) / r["us"] / 1e3
  return out


def table(result: dict) -> str:
  errors = result.get("errors", [])
  lines = [f"device {result['device']}, jax {result['jax']}, copy "
           f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s",
           f"{'shape':18s} {'M':>4s} {'variant':34s} {'us':>9s} {'GB/s':>8s} {'%copy':>6s} "
           f"{'rel err':>8s}"]
  for r in result["rows"]:
    cfg = (f" n{r['block_n']}r{r['rows']}w{r['num_warps']}s{r['num_stages']}"
           f"{'k' + str(r['splits']) if r.get('splits') else ''}" if "block_n" in r else "")
    lines.append(f"{r['shape']:18s} {r['M']:4d} {r['variant'] + cfg:34s} {r['us']:9.1f} "
                 f"{r['GB/s']:8.0f} {100 * r['copy_frac']:6.1f} {r['rel_err']:8.1e}")
  return "\n".join(lines + [f"ERROR {e}" for e in errors[:10]])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--shapes", default="", help="comma-separated shape names (q_proj, dot)")
  parser.add_argument("--batches", default="", help="comma-separated M values")
  parser.add_argument("--sweep", action="store_true", help="a wider sweep of tile configs")
  parser.add_argument("--bf16_sweep", action="store_true",
                      help="only the harness overhead and a bf16 tile sweep on the big dot")
  args = parser.parse_args()
  if args.bf16_sweep:
    out = overhead_and_bf16_sweep()
    with open(os.path.join(args.out, "bf16_sweep.json"), "w") as fh:
      json.dump(out, fh, indent=1)
    for r in out["rows"]:
      print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()})
    return
  result = run(args.quick, [s for s in args.shapes.split(",") if s],
               [int(b) for b in args.batches.split(",") if b], SWEEP if args.sweep else None)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "fp4_matmul_bench.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table(result))


if __name__ == "__main__":
  main()
