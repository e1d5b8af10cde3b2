"""The coding family: HumanEval in the sandbox, and the function-synthesis task."""

import pytest

from trace_jax.tasks.coding import (FunctionSynthesisTask, humaneval_pass, humaneval_problems,
                                    humaneval_program)


def _canonical_solutions_pass(problems):
  ok = humaneval_pass(problems, [p["canonical_solution"] for p in problems])
  failing = [p["task_id"] for p, o in zip(problems, ok) if not o]
  assert not failing, failing


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail():
  problems = humaneval_problems()
  assert len(problems) == 164
  _canonical_solutions_pass(problems[::4])  # every fourth; all 164 in the slow test below
  for body, sample in (("    return None\n", problems[:20]), ("    pass\n", problems[:20]),
                       ("    while True:\n        pass\n", problems[:3])):  # each times out
    assert not any(humaneval_pass(sample, [body] * len(sample), timeout_s=1.0))


@pytest.mark.slow
def test_every_humaneval_canonical_solution_passes():
  _canonical_solutions_pass(humaneval_problems())


def test_humaneval_program_layout():
  p = humaneval_problems()[0]
  text = humaneval_program(p, p["canonical_solution"])
  assert text.startswith(p["prompt"]) and text.rstrip().endswith(f"check({p['entry_point']})")


@pytest.fixture(scope="module")
def synthesis(tmp_path_factory):
  task = FunctionSynthesisTask(families="linear", train_size=50, eval_size=10)
  return task, task.prepare(str(tmp_path_factory.mktemp("tfds")))


def test_synthesis_rewards_run_the_program(synthesis):
  task, sources = synthesis
  records = [sources["train"][i] for i in range(6)]
  right = [task.target(r) for r in records]
  assert task.rewards(records, right) == [1.0] * 6
  a, b = right[0].split("*x+")
  assert task.prompt(records[0]) == f"f(0)={b},f(1)={int(a) + int(b)},f(2)={2 * int(a) + int(b)}:"
  wrong = ["x", "0", "(", "x*x*x*x", "1/0", "__import__('os').system('true')"]
  assert task.rewards(records, wrong) == [0.0] * 6
  assert set("".join(task.prompt(r) + task.target(r) for r in records)) <= set(task.alphabet())


def test_unknown_family():
  with pytest.raises(ValueError, match="unknown function families \\['cubic'\\]"):
    FunctionSynthesisTask(families="linear,cubic")
