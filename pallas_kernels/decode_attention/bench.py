"""Benchmark of decode attention over FP4 and bf16 KV caches, in one run.

    python -m pallas_kernels.decode_attention.bench [--out=DIR] [--batches=16,64]
        [--contexts=2048,8192,32768] [--backends=triton,mosaic,jax_triton]
        [--formats=bf16,mxfp4,nvfp4]
        [--configs='mosaic c2,triton s64w4st2'] [--splits=4,8,16]

qwen3_30b_a3b attention (32 query heads on 4 kv heads, head_dim 128), one query per sequence,
every slot valid. Per (batch, context): XLA's bf16 attention (the reference), the project's
bf16 kernel, PyTorch's `scaled_dot_product_attention` (enable_gqa, its [B, Kv, S, Dh] layout,
no mask) when torch sees a GPU, XLA on the dequantized MXFP4 cache, and the Pallas kernel on
MXFP4 and NVFP4 caches over a few tile configurations of its backends (Triton; Mosaic, the
wgmma kernel, when the device is a Hopper GPU; the Triton program also in Triton's own
language, through jax-triton), each also at the sequence splits `--splits`
asks for (by default `cache.default_splits`'). Each variant is checked against its
reference first (rel err). Times are the kernels' device time (`pallas_kernels.timing.time_calls`)
over cache copies larger than the L2 cache; bytes count the caches (codes, scales, globals),
the queries and the outputs. Writes decode_attention_bench.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.decode_attention import api, reference
from pallas_kernels.fp4_matmul import mosaic as mosaic_matmul
from pallas_kernels.timing import KERNELS, copy_bandwidth, cuda_event_seconds, time_calls
from trace_jax.quant import MXFP4, NVFP4, quantize

HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
BATCHES = (16, 64)
CONTEXTS = (2048, 8192, 32768)
FORMATS = ("bf16", "mxfp4", "nvfp4")  # the caches: bf16 (the project's kernels and PyTorch's)
# Triton's tiles, for the Pallas kernel and for the same program in Triton's own language
# ("jax_triton")
CONFIGS = [dict(backend=backend, block_s=bs, num_warps=w, num_stages=st)
           for backend in ("triton", "jax_triton")
           for bs, w, st in [(64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 3)]] + [
           dict(backend="mosaic", max_concurrent_steps=n) for n in (2, 4, 6)] + [
           dict(backend="mosaic", max_concurrent_steps=2, fold=True),  # MXFP4 caches only
           dict(backend="mosaic", max_concurrent_steps=2, blocks=2),  # FP4 caches only
           # fewer registers live, less overlap (`mosaic._body`'s lean; FP4 caches only)
           dict(backend="mosaic", max_concurrent_steps=2, lean=True),
           dict(backend="mosaic", max_concurrent_steps=2, blocks=2, lean=True)]


def label(cfg: dict) -> str:
  """A tile configuration in a few characters: triton s64w4st2, mosaic c4, mosaic c2 fold (the
  MXFP4 scales folded, `mosaic.FOLD_REF`), mosaic c2 b2 (two 64-slot blocks a step), mosaic c2
  lean (fewer registers live, `mosaic._body`); " x8":
  8 splits of the sequence (`--splits`) instead of `cache.default_splits`'; jax_triton s64w4st2:
  the Triton kernel's program in Triton's own language."""
  splits = f" x{cfg['splits']}" if cfg.get("splits") else ""
  if cfg.get("backend") == "mosaic":
    return (f"mosaic c{cfg['max_concurrent_steps']}" + (" fold" if cfg.get("fold") else "")
            + (f" b{cfg['blocks']}" if cfg.get("blocks", 1) > 1 else "")
            + (" lean" if cfg.get("lean") else "") + splits)
  return (f"{cfg['backend']} s{cfg['block_s']}w{cfg['num_warps']}st{cfg['num_stages']}"
          + splits)


def _rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def torch_sdpa_seconds(b: int, s: int, copies: int) -> float | None:
  """PyTorch's SDPA on bf16 [B, Kv, S, Dh] caches, CUDA-event timed over a loop of copies."""
  try:
    import torch
    import torch.nn.functional as F
  except ImportError:
    return None
  if not torch.cuda.is_available():
    return None
  q = torch.randn(b, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
  caches = [(torch.randn(b, KV_HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
             torch.randn(b, KV_HEADS, s, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
            for _ in range(copies)]
  sdpa = lambda kv: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)
  return cuda_event_seconds(torch, sdpa, caches)


def _shape(result, b, s, key, configs, formats):
  """Every variant at batch b and context s, its rows appended to `result`."""
  bf16_bytes = 2 * b * s * KV_HEADS * HEAD_DIM * 2
  copies = min(64, max(2, int(np.ceil(300e6 / (bf16_bytes / 3.5)))))  # FP4 > L2 x 6
  kq, kc = jax.random.split(jax.random.fold_in(key, b * s))
  q = jax.random.normal(kq, (b, HEADS, HEAD_DIM), jnp.bfloat16)
  mask = jnp.ones((b, s), bool)
  io_bytes = 2 * b * HEADS * HEAD_DIM * 2

  def cache(i):
    k1, k2 = jax.random.split(jax.random.fold_in(kc, i))
    shape = (b, s, KV_HEADS, HEAD_DIM)
    return (jax.random.normal(k1, shape, jnp.bfloat16),
            jax.random.normal(k2, shape, jnp.bfloat16))

  bf16 = [cache(i) for i in range(copies)]
  packed = {f.name: [(quantize(k, f), quantize(v, f)) for k, v in bf16]
            for f in (MXFP4, NVFP4) if f.name in formats}

  def record(variant, times, kv_bytes, rel, extra=None):
    wall, device = times
    seconds = device or wall
    moved = kv_bytes + io_bytes
    result["rows"].append({"batch": b, "context": s, "variant": variant,
                           "us": seconds * 1e6, "wall_us": wall * 1e6,
                           "GB/s": moved / seconds / 1e9,
                           "copy_frac": moved / seconds / result["copy_bytes_per_s"],
                           "rel_err": rel, "kernels_us": dict(KERNELS) if device else {},
                           **(extra or {})})
    print(json.dumps(result["rows"][-1]), flush=True)  # partial results survive a timeout

  def attempt(fn, what):  # a variant that fails to lower or run is reported, not fatal
    try:
      fn()
    except Exception as e:  # noqa: BLE001
      result["errors"].append(f"B={b} S={s} {what}: {type(e).__name__}: {str(e)[:300]}")
      print("ERROR", result["errors"][-1], flush=True)

  xla = lambda x, kv: reference.decode_attention(x[0], kv[0], kv[1], x[1])
  ref16 = jax.jit(xla)((q, mask), bf16[0])
  record("xla bf16", time_calls(xla, (q, mask), bf16), bf16_bytes, 0.0)
  for cfg in [c for c in configs if not c.get("fold") and c.get("blocks", 1) == 1
              and not c.get("lean")] if "bf16" in formats else ():
    p = lambda x, kv, cfg=cfg: api.decode_attention(x[0], kv[0], kv[1], x[1],
                                                    implementation="pallas", **cfg)
    attempt(lambda p=p, cfg=cfg: record(
        "pallas bf16", time_calls(p, (q, mask), bf16), bf16_bytes,
        _rel(jax.jit(p)((q, mask), bf16[0]), ref16), {"config": label(cfg), **cfg}),
        f"pallas bf16 {label(cfg)}")
  t = torch_sdpa_seconds(b, s, len(bf16)) if "bf16" in formats else None
  if t is not None:
    record("torch sdpa bf16", (t, None), bf16_bytes, float("nan"))
  for fmt, caches in packed.items():
    kv_bytes = caches[0][0].nbytes + caches[0][1].nbytes
    ref = jax.jit(xla)((q, mask), caches[0])
    if fmt == "mxfp4":
      record(f"xla {fmt} dequant", time_calls(xla, (q, mask), caches), kv_bytes, 0.0)
    for cfg in [c for c in configs if fmt == "mxfp4" or not c.get("fold")]:
      p = lambda x, kv, cfg=cfg: api.decode_attention(x[0], kv[0], kv[1], x[1],
                                                      implementation="pallas", **cfg)
      attempt(lambda p=p, cfg=cfg, caches=caches, kv_bytes=kv_bytes, ref=ref, fmt=fmt: record(
          f"pallas {fmt}", time_calls(p, (q, mask), caches), kv_bytes,
          _rel(jax.jit(p)((q, mask), caches[0]), ref), {"config": label(cfg), **cfg}),
          f"pallas {fmt} {label(cfg)}")


def run(batches=BATCHES, contexts=CONTEXTS, configs=None, formats=FORMATS) -> dict:
  result = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
            "copy_bytes_per_s": copy_bandwidth(), "rows": [], "errors": []}
  configs = CONFIGS if configs is None else configs
  if not mosaic_matmul.available() and any(c["backend"] == "mosaic" for c in configs):
    configs = [c for c in configs if c["backend"] != "mosaic"]
    result["errors"].append("the mosaic backend was not run: it needs a Hopper GPU")
  key = jax.random.PRNGKey(0)
  for b in batches:
    for s in contexts:
      try:  # a shape that fails (the memory of an 80 GB GPU at B = 64 x 128K) is one error
        _shape(result, b, s, key, configs, formats)
      except Exception as e:  # noqa: BLE001
        result["errors"].append(f"B={b} S={s}: {type(e).__name__}: {str(e)[:300]}")
        print("ERROR", result["errors"][-1], flush=True)
  return result


def table(result: dict) -> str:
  lines = [f"device {result['device']}, jax {result['jax']}, copy "
           f"{result['copy_bytes_per_s'] / 1e12:.2f} TB/s",
           f"{'B':>3s} {'S':>6s} {'variant':36s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} "
           f"{'rel err':>8s}"]
  for r in result["rows"]:
    cfg = f" {r['config']}" if "config" in r else ""
    lines.append(f"{r['batch']:3d} {r['context']:6d} {r['variant'] + cfg:36s} {r['us']:9.1f} "
                 f"{r['GB/s']:7.0f} {100 * r['copy_frac']:6.1f} {r['rel_err']:8.1e}")
  return "\n".join(lines + [f"ERROR {e}" for e in result["errors"][:10]])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
  parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
  parser.add_argument("--backends", default=",".join(api.BACKENDS),
                      help="the kernel backends to time (comma-separated)")
  parser.add_argument("--configs", default="",
                      help="only these tile configurations (comma-separated labels, e.g. "
                           "'mosaic c2,triton s64w4st2'; default: every one of the backends)")
  parser.add_argument("--splits", default="",
                      help="also time each chosen configuration at these splits of the "
                           "sequence (comma-separated; a count the blocks do not divide is an "
                           "error row)")
  parser.add_argument("--formats", default=",".join(FORMATS),
                      help="the caches to time (comma-separated; XLA's bf16 attention always)")
  args = parser.parse_args()
  ints = lambda s: [int(v) for v in s.split(",") if v]
  formats = [v for v in args.formats.split(",") if v]
  if set(formats) - set(FORMATS) or not formats:
    parser.error(f"--formats must name some of {FORMATS}, got {args.formats!r}")
  backends = [v for v in args.backends.split(",") if v]
  unknown = set(backends) - set(api.BACKENDS)
  if unknown:
    parser.error(f"unknown backends {sorted(unknown)}; choose from {api.BACKENDS}")
  configs = [c for c in CONFIGS if c["backend"] in backends]
  if args.configs:
    wanted = [v.strip() for v in args.configs.split(",") if v.strip()]
    unknown = set(wanted) - {label(c) for c in configs}
    if unknown:
      parser.error(f"unknown --configs {sorted(unknown)}; choose from "
                   f"{[label(c) for c in configs]}")
    configs = [c for c in configs if label(c) in wanted]
  if not configs:
    parser.error(f"--backends names none of {api.BACKENDS}")
  try:
    splits = [int(v) for v in args.splits.split(",") if v]
  except ValueError:
    splits = [0]
  if any(n < 1 for n in splits):
    parser.error(f"--splits={args.splits!r}: comma-separated positive integers")
  configs += [{**c, "splits": n} for n in splits for c in configs]
  result = run(ints(args.batches), ints(args.contexts), configs, formats)
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "decode_attention_bench.json"), "w") as fh:
    json.dump(result, fh, indent=1)
  print(table(result))


if __name__ == "__main__":
  main()
