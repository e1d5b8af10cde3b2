"""The multi-turn rollout of a long-horizon RL step, timed: one program a turn or two.

    python experiments/bench_episodes.py                                  # the CPU config
    XLA_FLAGS=--xla_gpu_deterministic_ops=true python experiments/bench_episodes.py \
        --config_arg=family=long_horizon,mode=trace,seed=0,scale=gpu --out=DIR

The policy of `configs/ablation.py:<--config_arg>` (randomly initialised, packed for its
rollout engine as the RL loop does) plays the episodes of its first RL step's prompts (each
`rl.group_size` times) with the RL engine. `turn`: the RL loop's rollout
(`trace_jax.rl.episodes.rollout`: a turn is one program, `RolloutEngine.turn`, and one wait for
its answer); `extend_run`: the loop it replaced (`run` for the answer, then `extend` by the
observation: two programs and three host reads a turn). Each is run `--reps` times after one
call that compiles; the median, and the milliseconds a turn. Both give the same batch (the
test suite checks it); timings count on a GPU, compare ratios within one run. The `host` row
times the environment's share of `turn` alone: the last batch's answers decoded, stepped and
their observations encoded turn by turn, as the loop does, without the device (what a loop
that kept the turns on the device would save at most, besides the waits). `--profile` (GPU):
one more `turn` rollout under the profiler, its kernels' summed device time and launches a
turn and the share of the rollout's wall time the device was busy, and its largest kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs.ablation import get_config  # noqa: E402
from pallas_kernels.timing import kernel_times  # noqa: E402
from trace_jax.data.pipeline import left_pad  # noqa: E402
from trace_jax.data.tokenizer import CharTokenizer  # noqa: E402
from trace_jax.rl import episodes  # noqa: E402
from trace_jax.rl.loop import Run  # noqa: E402
from trace_jax.rl.validate import make_task, validate  # noqa: E402


def extend_run(engine, weights, task, records, tok, prompt_width, key):
  """The multi-turn rollout before `RolloutEngine.turn`: `run`, then `extend`, a turn."""
  tokens, lengths = left_pad([tok.encode(task.prompt(r)) for r in records], prompt_width,
                             tok.pad_id)
  state = engine.start(weights, tokens, lengths, key,
                       prompt_width + episodes.episode_length(task))
  for turn in range(task.max_turns):
    first = int(state["t"])
    state = engine.run(weights, state, first + task.answer_len - 1)
    answers = np.asarray(state["tokens"])[:, first:first + task.answer_len]
    if turn + 1 < task.max_turns:
      obs = [tok.encode(task.step(r, turn, tok.decode(a)).observation)
             for r, a in zip(records, answers)]
      state = engine.extend(weights, state, np.asarray(obs, np.int32))
  return engine.finish(state, prompt_width)


def turn(engine, weights, task, records, tok, prompt_width, key):
  return episodes.rollout(engine, weights, task, records, tok, prompt_width, key)[0]


LOOPS = {"turn": turn, "extend_run": extend_run}


def profile_turns(rollout, turns: int, wall_s: float, top: int = 12) -> dict | None:
  """Where a rollout's device time goes (`rollout()`, compiled before): the kernels' summed
  microseconds and launches a turn, the device-busy share of `wall_s` (the rollout's median
  wall time), and the `top` kernels by time; None without a GPU trace."""
  launches: dict[str, int] = {}
  times = kernel_times(rollout, launches=launches)
  if times is None:
    return None
  busy = sum(times.values())
  largest = sorted(times, key=times.get, reverse=True)[:top]
  return {"loop": "turn (profiled)", "kernel_us_a_turn": busy / turns,
          "launches_a_turn": sum(launches.values()) / turns,
          "device_busy_frac": busy / 1e6 / wall_s,
          "largest": {n: {"us_a_turn": times[n] / turns, "launches_a_turn": launches[n] / turns}
                      for n in largest}}


def host_share(task, records, tok, tokens, prompt_width) -> float:
  """Seconds of `episodes.rollout`'s host work for a finished batch `tokens` [n, prompt_width
  + episode]: each turn's answers decoded, the task stepped and the observations encoded."""
  answers = np.asarray(tokens)[:, prompt_width:]
  span = task.answer_len + task.observation_len
  start = time.perf_counter()
  for turn in range(task.max_turns):
    at = turn * span
    steps = [task.step(r, turn, tok.decode(a)) for r, a in
             zip(records, answers[:, at:at + task.answer_len])]
    if turn + 1 < task.max_turns:
      np.asarray([tok.encode(s.observation) for s in steps], np.int32)
  return time.perf_counter() - start


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config_arg", default="family=long_horizon,mode=trace,seed=0",
                      help="configs/ablation.py's argument (a long-horizon family's)")
  parser.add_argument("--loops", default=",".join(LOOPS))
  parser.add_argument("--reps", type=int, default=2)
  parser.add_argument("--workdir", default="/tmp/bench_episodes")
  parser.add_argument("--out", default="")
  parser.add_argument("--profile", action="store_true",
                      help="one more `turn` rollout under the profiler (GPU)")
  args = parser.parse_args(argv)
  loops = [v for v in args.loops.split(",") if v]
  unknown = sorted(set(loops) - set(LOOPS))
  if unknown:
    parser.error(f"unknown --loops {unknown}; choose from {tuple(LOOPS)}")
  c = get_config(args.config_arg)
  validate(c)
  task = make_task(c.task)
  if task.max_turns == 1:
    parser.error(f"--config_arg={args.config_arg!r}: a single-turn family; take long_horizon")
  run = Run(c, args.workdir, CharTokenizer(task.alphabet()))
  weights = run.rollout_weights(run.initial_state()["params"])
  records = [r for r in run.rl_batches[0] for _ in range(c.rl.group_size)]
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
         "config_arg": args.config_arg, "episodes": len(records), "turns": task.max_turns,
         "rows": []}
  for name in loops:
    times = []
    for i in range(args.reps + 1):  # the first compiles
      start = time.perf_counter()
      batch = LOOPS[name](run.engine, weights, task, records, run.tok, c.max_prompt_len,
                          jax.random.PRNGKey(i))
      jax.block_until_ready(batch.tokens)
      times.append(time.perf_counter() - start)
    row = {"loop": name, "first_call_s": times[0], "s": float(np.median(times[1:])),
           "ms_a_turn": 1000 * float(np.median(times[1:])) / task.max_turns}
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
  if "turn" in loops:
    s = float(np.median([host_share(task, records, run.tok, batch.tokens, c.max_prompt_len)
                         for _ in range(args.reps)]))
    row = {"loop": "host", "s": s, "ms_a_turn": 1000 * s / task.max_turns}
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
  if args.profile and "turn" in loops:
    wall = next(r["s"] for r in out["rows"] if r["loop"] == "turn")
    row = profile_turns(lambda: turn(run.engine, weights, task, records, run.tok,
                                     c.max_prompt_len, jax.random.PRNGKey(0)).tokens,
                        task.max_turns, wall)
    if row is None:
      row = {"loop": "turn (profiled)", "error": "no GPU trace on this device"}
    out["rows"].append(row)
    print(json.dumps(row), flush=True)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_episodes.json"), "w") as fh:
      json.dump(out, fh, indent=1)


if __name__ == "__main__":
  main()
