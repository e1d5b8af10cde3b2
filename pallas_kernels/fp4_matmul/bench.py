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


def run(quick: bool = False) -> dict:
  key = jax.random.PRNGKey(0)
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(0.5 if quick else 2.0), "rows": []}
  shapes = dict(list(SHAPES.items())[:1]) if quick else SHAPES
  for name, (k, n) in shapes.items():
    copies = max(2, int(np.ceil(200e6 / (k * n * 2))))  # > L2 even in bf16
    kw, kx = jax.random.split(jax.random.fold_in(key, k * n))
    w32 = [jax.random.normal(jax.random.fold_in(kw, i), (k, n)) * 0.05 for i in range(copies)]
    w16 = [w.astype(jnp.bfloat16) for w in w32]
    packed = {f.name: [quantize(w, f, axis=0) for w in w32] for f in (MXFP4, NVFP4_TENSOR)}
    del w32
    for m in (BATCHES[:2] if quick else BATCHES):
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
        for cfg in CONFIGS[:1] if quick else CONFIGS:
          if n % cfg["block_n"]:
            continue
          p = lambda a, b, cfg=cfg: api.fp4_matmul(a, b, implementation="pallas", **cfg)
          attempt(lambda p=p, cfg=cfg: record(
              f"pallas {fmt}", _time(p, x, ws), wbytes, _rel(jax.jit(p)(x, ws[0]), ref),
              dict(cfg)), f"pallas {fmt} {cfg}")
  return result


def table(result: dict) -> str:
  errors = result.get("errors", [])
  lines = [f"device {result['device']}, jax {result['jax']}, copy "
           f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s",
           f"{'shape':18s} {'M':>4s} {'variant':34s} {'us':>9s} {'GB/s':>8s} {'%copy':>6s} "
           f"{'rel err':>8s}"]
  for r in result["rows"]:
    cfg = (f" n{r['block_n']}r{r['rows']}w{r['num_warps']}s{r['num_stages']}"
           if "block_n" in r else "")
    lines.append(f"{r['shape']:18s} {r['M']:4d} {r['variant'] + cfg:34s} {r['us']:9.1f} "
                 f"{r['GB/s']:8.0f} {100 * r['copy_frac']:6.1f} {r['rel_err']:8.1e}")
  return "\n".join(lines + [f"ERROR {e}" for e in errors[:10]])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  result = run(args.quick)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "fp4_matmul_bench.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table(result))


if __name__ == "__main__":
  main()
