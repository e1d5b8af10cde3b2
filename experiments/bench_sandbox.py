"""Programs per second of the coding family's reward: the sandbox's throughput in an RL step.

    python experiments/bench_sandbox.py [--programs=256] [--repeats=3]

Builds `programs` function-synthesis records (the RL batch of configs/coding.py is 32 prompts x
8 samples = 256), half with the right completion and half with a distinct wrong one (no two
programs alike), scores them with `FunctionSynthesisTask.rewards` and prints the best of
`repeats` runs as programs per second, with a check that every reward came out right.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trace_jax.tasks.coding import FunctionSynthesisTask  # noqa: E402


def batch(n: int) -> tuple[list[dict], list[str], list[float]]:
  records, completions, expected = [], [], []
  for i in range(n):
    a, b = 1 + i % 9, i % 10
    tests = [[x, a * x + b] for x in (0, 1, 2, 3, 5, 7, 10, -1, -4)]
    records.append({"examples": json.dumps(tests[:3]), "reference": f"{a}*x+{b}",
                    "tests": json.dumps(tests)})
    right = i % 2 == 0
    completions.append(f"{a}*x+{b}" if right else f"{a}*x+{b + 1 + i}")
    expected.append(float(right))
  return records, completions, expected


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--programs", type=int, default=256)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  task = FunctionSynthesisTask()
  records, completions, expected = batch(args.programs)
  best = float("inf")
  for _ in range(args.repeats):
    start = time.perf_counter()
    rewards = task.rewards(records, completions)
    best = min(best, time.perf_counter() - start)
    if rewards != expected:
      raise SystemExit(f"wrong rewards: {sum(r != e for r, e in zip(rewards, expected))} of "
                       f"{len(expected)} differ")
  print(f"{args.programs} programs in {best:.2f} s: {args.programs / best:.0f} programs/s")


if __name__ == "__main__":
  main()
