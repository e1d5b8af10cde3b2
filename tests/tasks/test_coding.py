"""The coding family: HumanEval in the sandbox, and the function-synthesis task."""

import pytest

from trace_jax.tasks.coding import (FunctionSynthesisTask, humaneval_pass, humaneval_problems,
                                    humaneval_program)


def _canonical_solutions_pass(problems, allow_unsandboxed):
  ok = humaneval_pass(problems, [p["canonical_solution"] for p in problems],
                      allow_unsandboxed=allow_unsandboxed)
  failing = [p["task_id"] for p, o in zip(problems, ok) if not o]
  assert not failing, failing


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(allow_unsandboxed):
  problems = humaneval_problems()
  assert len(problems) == 164
  _canonical_solutions_pass(problems[::4], allow_unsandboxed)  # all 164: the slow test below
  # a pass is check() returning in the judge: never an exit status the program chooses
  for body, sample in (("    return None\n", problems[:20]), ("    pass\n", problems[:20]),
                       ("    raise SystemExit(0)\n", problems[:5]),
                       ("    import os\n    os._exit(0)\n", problems[:5]),
                       ("    while True:\n        pass\n", problems[:3])):  # each times out
    assert not any(humaneval_pass(sample, [body] * len(sample), timeout_s=1.0,
                                  allow_unsandboxed=allow_unsandboxed)), body


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes(allow_unsandboxed):
  _canonical_solutions_pass(humaneval_problems(), allow_unsandboxed)


def test_humaneval_program_layout():
  p = humaneval_problems()[0]
  job = humaneval_program(p, p["canonical_solution"])
  assert job.solution == p["prompt"] + p["canonical_solution"] + "\n"
  assert job.prelude == p["prompt"] and job.entry_point == p["entry_point"]
  assert job.tests.rstrip().endswith(f"check({p['entry_point']})")


@pytest.fixture(scope="module")
def synthesis(tmp_path_factory, allow_unsandboxed):
  task = FunctionSynthesisTask(families="linear", train_size=50, eval_size=10,
                               allow_unsandboxed=allow_unsandboxed)
  return task, task.prepare(str(tmp_path_factory.mktemp("tfds")))


def test_synthesis_rewards_run_the_program(synthesis):
  task, sources = synthesis
  records = [sources["train"][i] for i in range(6)]
  right = [task.target(r) for r in records]
  assert task.rewards(records, right) == [1.0] * 6
  a, b = right[0].split("*x+")
  assert task.prompt(records[0]) == f"f(0)={b},f(1)={int(a) + int(b)},f(2)={2 * int(a) + int(b)}:"
  wrong = ["x", "0", "(", "x*x*x*x", "1/0", "__import__('os').system('true')",
           "__import__('os')._exit(0)", "x) if 0 else exit(0) or (x"]
  assert task.rewards(records + records[:2], wrong) == [0.0] * 8
  assert set("".join(task.prompt(r) + task.target(r) for r in records)) <= set(task.alphabet())


def test_unknown_family():
  with pytest.raises(ValueError, match="unknown function families \\['cubic'\\]"):
    FunctionSynthesisTask(families="linear,cubic")
