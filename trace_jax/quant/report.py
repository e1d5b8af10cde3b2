"""Quantization report: error, storage and record cost of every format on realistic tensors.

    python -m trace_jax.quant [--tokens=512] [--d_model=2048] [--seed=0] [--json]

Prints, for each format, the error on LLM-like activations (heavy tails, per-token scale and a
few outlier channels) and on a weight matrix, the storage and record bits per element, and how
many codes a 1e-3 relative drift flips with plain rounding and with guided rounding.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

from trace_jax.quant import api
from trace_jax.quant.formats import (BF16, FP8, MXFP4, MXFP4_CEIL, NVFP4, NVFP4_TENSOR,
                                     BlockFormat, Format)

REPORT_FORMATS = (BF16, FP8, MXFP4, MXFP4_CEIL, NVFP4)


def llm_activations(key: jax.Array, tokens: int, d_model: int) -> jax.Array:
  """[tokens, d_model] like a transformer's normed hidden state: Student-t(5) elements, a
  log-normal scale per token and ~0.5% outlier channels 20x larger."""
  k_elem, k_tok, k_chan = jax.random.split(key, 3)
  x = jax.random.t(k_elem, 5.0, (tokens, d_model))
  x = x * jnp.exp(0.5 * jax.random.normal(k_tok, (tokens, 1)))
  outliers = jax.random.uniform(k_chan, (d_model,)) < 0.005
  return jnp.where(outliers, 20.0, 1.0) * x


def linear_weight(key: jax.Array, d_in: int, d_out: int) -> jax.Array:
  return jax.random.normal(key, (d_in, d_out)) / math.sqrt(d_in)


def error_stats(x: jax.Array, y: jax.Array) -> dict[str, float]:
  err = y - x
  rel_rmse = jnp.sqrt(jnp.mean(err**2) / jnp.mean(x**2))
  return {
      "rel_rmse": float(rel_rmse),
      "sqnr_db": float(-20 * jnp.log10(jnp.maximum(rel_rmse, 1e-30))),
      "max_abs_err_over_amax": float(jnp.max(jnp.abs(err)) / jnp.max(jnp.abs(x))),
  }


def flip_rate(codes_a: jax.Array, codes_b: jax.Array, sign_bit: int) -> float:
  """Fraction of element codes that differ; -0 and +0 count as the same code."""
  norm = lambda c: jnp.where(c == sign_bit, 0, c)
  return float(jnp.mean(norm(codes_a) != norm(codes_b)))


def drift_flips(fmt: Format, x: jax.Array, key: jax.Array, rel: float = 1e-3) -> dict:
  """Fraction of element codes a relative drift flips: plain rounding vs guided rounding."""
  if not isinstance(fmt, BlockFormat):
    return {"flip_rate_plain": None, "flip_rate_guided": None}
  drifted = x * (1 + rel * jax.random.uniform(key, x.shape, minval=-1, maxval=1))
  qa = api.quantize(x, fmt)
  rollout = api.element_codes(qa)
  plain = api.element_codes(api.quantize(drifted, fmt))
  guided = api.guided_codes(drifted, api.make_record(qa), fmt)
  sign = fmt.codec.sign_bit
  return {"flip_rate_plain": flip_rate(plain, rollout, sign),
          "flip_rate_guided": flip_rate(guided, rollout, sign)}


def report(tokens: int = 512, d_model: int = 2048, d_ff: int = 768, seed: int = 0) -> list[dict]:
  k_act, k_w, k_drift = jax.random.split(jax.random.PRNGKey(seed), 3)
  acts = llm_activations(k_act, tokens, d_model)
  weight = linear_weight(k_w, d_model, d_ff)
  rows = []
  for fmt in REPORT_FORMATS:
    qa = api.quantize(acts, fmt)
    w_fmt = NVFP4_TENSOR if fmt is NVFP4 else fmt  # NVFP4 weights: one global per tensor
    w_err = error_stats(weight, api.fake_quant(weight, w_fmt, axis=0))
    rows.append({
        "format": fmt.name,
        "block": fmt.axis_block(d_model),
        **error_stats(acts, api.dequantize(qa)),
        "weight_rel_rmse": w_err["rel_rmse"],
        "clip_frac": float(1.0 - jnp.mean(fmt.clip_mask(
            acts.reshape(tokens, -1, fmt.axis_block(d_model)), qa.scales, qa.global_scale))),
        "storage_bits": fmt.storage_bits(d_model),
        "storage_bits_measured": api.storage_bits_per_element(qa),
        "record_bits": fmt.record_bits(d_model),
        "record_bits_measured": api.record_bits_per_element(api.make_record(qa), acts.shape),
        **drift_flips(fmt, acts, k_drift),
    })
  return rows


COLUMNS = [
    ("format", "{}", "format"), ("block", "{}", "block"),
    ("rel_rmse", "{:.4f}", "act rel.RMSE"), ("sqnr_db", "{:.1f}", "SQNR dB"),
    ("max_abs_err_over_amax", "{:.4f}", "max|err|/amax"), ("clip_frac", "{:.4f}", "clipped"),
    ("weight_rel_rmse", "{:.4f}", "weight rel.RMSE"),
    ("storage_bits", "{:.2f}", "storage b/elem"), ("record_bits", "{:.2f}", "record b/elem"),
    ("flip_rate_plain", "{:.4f}", "flips@1e-3 plain"),
    ("flip_rate_guided", "{:.4f}", "flips@1e-3 guided"),
]


def format_table(rows: list[dict]) -> str:
  head = [c[2] for c in COLUMNS]
  cell = lambda v, f: "n/a" if v is None else f.format(v)
  body = [[cell(r[k], f) for k, f, _ in COLUMNS] for r in rows]
  widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
  return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m trace_jax.quant", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tokens", type=int, default=512)
  parser.add_argument("--d_model", type=int, default=2048)
  parser.add_argument("--d_ff", type=int, default=768)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", action="store_true", help="one JSON object per format, no table")
  args = parser.parse_args(argv)
  if args.d_model % 32 or args.d_ff % 32:
    parser.error(f"--d_model ({args.d_model}) and --d_ff ({args.d_ff}) must be multiples of 32, "
                 "the MXFP4 block size")
  rows = report(args.tokens, args.d_model, args.d_ff, args.seed)
  if args.json:
    for r in rows:
      print(json.dumps(r))
    return
  print(f"trace_jax quantization report: activations [{args.tokens}, {args.d_model}] "
        f"(Student-t(5), log-normal token scale, 0.5% outlier channels x20), weight "
        f"[{args.d_model}, {args.d_ff}], jax {jax.__version__} on {jax.default_backend()}")
  print(format_table(rows))
  nv = next(r for r in rows if r["format"] == NVFP4.name)
  print(f"bits per element include the block scales; NVFP4's 32-bit row global adds "
        f"{32 / args.d_model:.3f} (measured {nv['storage_bits_measured']:.3f} storage, "
        f"{nv['record_bits_measured']:.3f} record).")
  print("flips: fraction of element codes that change when the input drifts by a relative "
        "1e-3, with plain rounding and with guided rounding from the undrifted tensor's record "
        "(bf16 has neither codes nor records).")
