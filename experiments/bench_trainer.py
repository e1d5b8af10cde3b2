"""What TRACE costs the trainer: the GRPO step of each mode, and the record bytes it is sent.

    python experiments/bench_trainer.py                     # configs/reasoning.py:gpu's policy, GPU
    python experiments/bench_trainer.py --quick             # tiny policy and batch, CPU seconds
    python experiments/bench_trainer.py --config_arg=gpu --modes=fp4_qat,trace --new_tokens=1024

For each mode (bf16, fp4_qat, trace, trace_all by default) the policy of `configs/<family>.py`
(`--config_arg`, its variant string) is randomly initialised, one rollout batch of
`--sequences` random prompts with `--new_tokens` sampled tokens each (no stop token) is made by
the mode's rollout engine, and the trainer's GRPO step (`Trainer.rl_step`: recompute, then one
optimizer step per minibatch, as the RL loop runs it) is run `--steps` times on it after one
call that compiles. Per mode: the first call, the median and spread of the timed steps, the
ratio to fp4_qat's median (unguided QAT: what the records and guided rounding add), and the
record bytes per fed token (`record/bytes_per_token`, the RL loop's metric). Timings count on a
GPU only; compare ratios within one run. `--out` also writes the rows as JSON.

`--step=sft` times the supervised warm-start step instead (bf16 and the same for every mode:
one row, teacher-forced on the same batch, its loss on the sampled tokens, its attention
`sft.attention`'s), and
`--deterministic` asks XLA for the deterministic GPU ops that the RL loop runs with by default
(`deterministic=true`); without it XLA picks its faster non-deterministic ones:

    python experiments/bench_trainer.py --family=long_horizon --config_arg=gpu,rl.remat=layer \
        --step=sft --sequences=64 --prompt=8 --new_tokens=1532 --deterministic
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trace_jax import determinism  # noqa: E402
from trace_jax.models import ModelConfig, init_params, pack_weights  # noqa: E402
from trace_jax.rl import metrics as M  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig  # noqa: E402
from trace_jax.rl.trainer import (MODES, RLOptions, Trainer, make_optimizer,  # noqa: E402
                                  mode_setup)

SHAPE_KEYS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts", "top_k",
              "d_ff", "init_scale")
QUICK = dict(config_arg="smoke", sequences=8, prompt=8, new_tokens=16, steps=2)


def family_config(args):
  return importlib.import_module(f"configs.{args.family}").get_config(args.config_arg or None)


def one_mode(c, mode: str, args) -> dict:
  cfg = ModelConfig(vocab_size=args.vocab, **{k: c.model[k] for k in SHAPE_KEYS})
  setup = mode_setup(mode, c.rl.fp4, c.rl.trace_layers)
  params = init_params(cfg, jax.random.PRNGKey(0), setup.layer_groups(cfg.n_layers))
  engine = RolloutEngine(cfg, setup.rollout, SamplingConfig(max_new_tokens=args.new_tokens),
                         records=setup.records, kernels=c.engine.kernels)
  weights = jax.jit(lambda p: pack_weights(cfg, p, recipe=setup.rollout, ops=engine.ops))(params)
  rng = np.random.default_rng(0)
  prompts = jnp.asarray(rng.integers(1, cfg.vocab_size, (args.sequences, args.prompt)), jnp.int32)
  lengths = jnp.full((args.sequences,), args.prompt, jnp.int32)
  rollout = engine.generate(weights, prompts, lengths, jax.random.PRNGKey(1))
  positions = rollout.tokens.shape[0] * (rollout.tokens.shape[1] - 1)
  batch = {"tokens": rollout.tokens, "valid": rollout.valid,
           "response_mask": rollout.response_mask, "logp": rollout.logp,
           "advantages": jnp.asarray(rng.standard_normal(args.sequences), jnp.float32),
           "records": rollout.records, "routes": rollout.routes}
  options = RLOptions(clip_eps=c.rl.clip_eps, aux_coef=c.rl.aux_coef,
                      minibatches=c.rl.minibatches, routing_replay=c.rl.routing_replay,
                      temperature=c.rl.temperature, remat=c.rl.remat,
                      attention=c.rl.attention, sft_attention=c.sft.attention)
  trainer = Trainer(cfg, setup, make_optimizer(c.sft.lr, c.rl.lr, 0), options)
  state = trainer.init_state(params)
  sft = {"tokens": batch["tokens"], "valid": batch["valid"], "loss_mask": batch["response_mask"]}

  def step(state):
    if args.step == "sft":
      state, metrics = trainer.sft_step(state, sft)
    else:
      state, metrics, _ = trainer.rl_step(state, batch)
    jax.block_until_ready(metrics)
    return state

  start = time.perf_counter()
  state = step(state)
  first = time.perf_counter() - start
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    state = step(state)
    times.append(time.perf_counter() - start)
  return {"mode": "warm start" if args.step == "sft" else mode,
          "records": "none" if args.step == "sft" else setup.records, "first_call_s": first,
          "step_ms": 1e3 * statistics.median(times),
          "step_ms_min": 1e3 * min(times), "step_ms_max": 1e3 * max(times),
          "record_bytes_per_token": M.record_bytes_per_token(batch["records"], positions),
          "tokens_per_step": positions}


def table(rows: list[dict], step: str = "grpo") -> str:
  ref = next((r["step_ms"] for r in rows if r["mode"] == "fp4_qat"), None)
  what = "warm-start" if step == "sft" else "GRPO"
  lines = [f"| mode | records | {what} step ms (median; min-max) | vs fp4_qat | record "
           "bytes/token | first call s |", "|---|---|---|---|---|---|"]
  for r in rows:
    ratio = f"{r['step_ms'] / ref:.3f}x" if ref else "-"
    lines.append(f"| {r['mode']} | {r['records']} | {r['step_ms']:.1f} ({r['step_ms_min']:.1f}-"
                 f"{r['step_ms_max']:.1f}) | {ratio} | {r['record_bytes_per_token']:.1f} | "
                 f"{r['first_call_s']:.1f} |")
  return "\n".join(lines)


def parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--family", default="reasoning", help="configs/<family>.py: the policy's shape")
  p.add_argument("--config_arg", default="gpu", help="the family config's variant string")
  p.add_argument("--modes", default="bf16,fp4_qat,trace,trace_all")
  p.add_argument("--sequences", type=int, default=512, help="the batch: prompts x group size")
  p.add_argument("--prompt", type=int, default=32, help="prompt tokens per sequence")
  p.add_argument("--new_tokens", type=int, default=512, help="sampled tokens per sequence")
  p.add_argument("--vocab", type=int, default=128)
  p.add_argument("--steps", type=int, default=5, help="timed steps after the compiling one")
  p.add_argument("--step", default="grpo", choices=("grpo", "sft"),
                 help="the step timed: GRPO (each mode's) or the supervised warm start (one row)")
  p.add_argument("--deterministic", action="store_true",
                 help="XLA's deterministic GPU ops, as the RL loop's deterministic=true")
  p.add_argument("--out", default="", help="also write the rows here as JSON")
  p.add_argument("--quick", action="store_true", help="tiny sizes: " + str(QUICK))
  args = p.parse_args(argv)
  if args.quick:
    for key, value in QUICK.items():
      setattr(args, key, value)
  args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  bad = [m for m in args.modes if m not in MODES]
  if bad or not args.modes:
    p.error(f"--modes: {bad or 'none given'}; choose from {list(MODES)}")
  if args.step == "sft":  # the warm start is the same for every mode
    args.modes = ["bf16"]
  if not os.path.isfile(os.path.join(ROOT, "configs", f"{args.family}.py")):
    p.error(f"--family={args.family!r}: no configs/{args.family}.py")
  for name in ("sequences", "prompt", "new_tokens", "vocab", "steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  return args


def main(argv=None):
  args = parse(argv)
  determinism.enable(args.deterministic)  # (before JAX starts on the device)
  c = family_config(args)
  if args.sequences % c.rl.minibatches:
    raise SystemExit(f"--sequences={args.sequences} does not split into rl.minibatches="
                     f"{c.rl.minibatches}")
  rows = []
  for mode in args.modes:
    rows.append(one_mode(c, mode, args))
    print(json.dumps(rows[-1]), flush=True)
  result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "family": args.family, "config_arg": args.config_arg, "sequences": args.sequences,
            "prompt": args.prompt, "new_tokens": args.new_tokens, "step": args.step,
            "deterministic": args.deterministic or determinism.is_on(), "rows": rows}
  print(f"{result['device']}, jax {result['jax']}, configs/{args.family}.py:{args.config_arg}, "
        f"{args.sequences} sequences of {args.prompt} + {args.new_tokens} tokens"
        + (", deterministic ops" if result["deterministic"] else ""))
  print(table(rows, args.step))
  if args.out:
    with open(args.out, "w") as fh:
      json.dump(result, fh, indent=1)
  return result


if __name__ == "__main__":
  main()
