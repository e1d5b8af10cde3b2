"""The trainer's attention alone, forward and backward, at a long episode's shape, by variant.

    python experiments/bench_train_attention.py [--batch=32] [--tokens=1540] [--out=DIR]
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python experiments/bench_train_attention.py

The `gpu` policy's heads (8 query heads on 2 kv heads, head_dim 64) on left-padded rows: the
value and the gradients of q, K and V of a weighted sum of the attention's outputs, jitted,
timed over repeated calls after the compiling one (the median). Variants: `heads_apart` (the
trainer's attention before 2026-12-07: scores [B, K, G, T, S]), `full_attention` (the model's,
`trace_jax.models.layers`: a kv head's query heads as one run of rows), and cuDNN's fused
attention by `jax.nn.dot_product_attention` (GPU only), with the causal and padding mask as a
bias (`cudnn_bias`) or with each row's padding rolled to its end so that the causal mask alone
suffices (`cudnn_rolled`). Each variant's relative difference from the first one's loss and q
gradient, and whether a second call repeats its numbers bit for bit, are reported beside its
time. Timings count on a GPU; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trace_jax.models import layers as L  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # the `gpu` variant's (trace_jax/rl/defaults.py)


def heads_apart(q, k, v, valid):
  """The trainer's attention before 2026-12-07 (query heads and positions kept apart)."""
  b, t, h, dh = q.shape
  kv = k.shape[2]
  s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, kv, h // kv, dh), k,
                 preferred_element_type=jnp.float32) * (dh**-0.5)
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None, None] & valid[:, None, None, None, :]
  p = jax.nn.softmax(jnp.where(mask, s, L._MASKED), axis=-1).astype(q.dtype)
  o = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
  return o.reshape(b, t, h, dh).astype(q.dtype)


def cudnn_bias(q, k, v, valid):
  t = q.shape[1]
  mask = jnp.tril(jnp.ones((t, t), bool))[None, None] & valid[:, None, None, :]
  bias = jnp.where(mask, 0.0, -1e9).astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")


def cudnn_rolled(q, k, v, valid):
  shift = jnp.sum(~valid, axis=1)
  roll = lambda x, s: jax.vmap(lambda r, n: jnp.roll(r, -n, axis=0))(x, s)
  o = jax.nn.dot_product_attention(roll(q, shift), roll(k, shift), roll(v, shift),
                                   is_causal=True, implementation="cudnn")
  return roll(o, -shift)


VARIANTS = {"heads_apart": heads_apart, "full_attention": L.full_attention,
            "cudnn_bias": cudnn_bias, "cudnn_rolled": cudnn_rolled}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--batch", type=int, default=32)
  parser.add_argument("--tokens", type=int, default=1540)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  names = [v for v in args.variants.split(",") if v]
  unknown = sorted(set(names) - set(VARIANTS))
  if unknown:
    parser.error(f"unknown --variants {unknown}; choose from {tuple(VARIANTS)}")
  b, t = args.batch, args.tokens
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(ks[0], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, KV_HEADS, HEAD_DIM), jnp.bfloat16)
  valid = jnp.arange(t)[None, :] >= (jnp.arange(b) % 7)[:, None]
  w = jax.random.normal(ks[3], (b, t, HEADS, HEAD_DIM), jnp.bfloat16)
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": b,
         "tokens": t, "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
  first = None
  for name in names:
    f = VARIANTS[name]
    loss = lambda q, k, v, f=f: jnp.sum(
        f(q, k, v, valid).astype(jnp.float32) * w * valid[:, :, None, None])
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    try:
      start = time.perf_counter()
      got = jax.block_until_ready(step(q, k, v))
      row = {"variant": name, "first_call_s": time.perf_counter() - start}
      times = []
      for _ in range(args.reps):
        start = time.perf_counter()
        again = jax.block_until_ready(step(q, k, v))
        times.append(time.perf_counter() - start)
      row["ms"] = 1000 * float(np.median(times))
      row["repeats"] = all(bool(jnp.array_equal(x, y))
                           for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(again)))
      if first is None:
        first = got
      else:
        norm = lambda x: float(jnp.linalg.norm(x.astype(jnp.float32)))
        row["loss_rel"] = float(abs(got[0] - first[0]) / abs(first[0]))
        row["dq_rel"] = norm(got[1][0] - first[1][0]) / norm(first[1][0])
    except Exception as e:  # e.g. cuDNN on a CPU: the reason, and the other variants run
      row = {"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_train_attention.json"), "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
