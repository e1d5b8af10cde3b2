"""The reasoning family: TFDS-prepared prompts, reasoning-gym scoring."""

import pytest

from trace_jax.tasks import ReasoningTask

SUMS = (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 1))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
  task = ReasoningTask(options=SUMS, train_size=40, eval_size=8)
  return task, task.prepare(str(tmp_path_factory.mktemp("tfds")))


def test_splits_prompts_and_rewards(prepared):
  task, sources = prepared
  assert len(sources["train"]) == 40 and len(sources["eval"]) == 8
  record = sources["train"][0]
  prompt, target = task.prompt(record), task.target(record)
  a, b = prompt.rstrip("=").split("+")
  assert int(a) + int(b) == int(target)
  assert task.reward(record, target) == 1.0
  assert task.reward(record, f" {target} ") == 1.0
  assert task.reward(record, str(int(target) + 1)) == 0.0
  assert task.reward(record, "") == 0.0
  assert set(prompt + target) <= set(task.alphabet())


def test_eval_differs_from_train_and_rebuilds_are_identical(prepared, tmp_path):
  task, sources = prepared
  train = {task.prompt(sources["train"][i]) + str(i) for i in range(40)}
  again = ReasoningTask(options=SUMS, train_size=40, eval_size=8).prepare(str(tmp_path))
  assert {task.prompt(again["train"][i]) + str(i) for i in range(40)} == train


def test_question_style_and_bad_options():
  task = ReasoningTask(dataset="basic_arithmetic", prompt_style="question")
  assert "\n" in task.alphabet()
  with pytest.raises(ValueError, match="unknown reasoning dataset 'countdown'"):
    ReasoningTask(dataset="countdown")
  with pytest.raises(ValueError, match="prompt_style"):
    ReasoningTask(prompt_style="chat")
  with pytest.raises(Exception):
    ReasoningTask(options=(("min_terms", 9), ("max_terms", 2)))
