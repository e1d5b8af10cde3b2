"""The reasoning family: verifiable arithmetic from reasoning-gym generators.

Train and eval prompts are fixed sets generated once, stored as a TFDS dataset (array_record
files, no TensorFlow needed) and read back through `tfds.data_source`; scoring is the dataset's
own `score_answer`. Any TFDS dataset with `question`, `answer` and `entry` (the reasoning-gym
record as JSON) features works the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import string
from typing import Any

import numpy as np
import reasoning_gym
import tensorflow_datasets as tfds

from trace_jax.tasks import datasets
from trace_jax.tasks.base import Record

# generators a small policy trained from scratch can learn, with the knobs that set difficulty
SUPPORTED = ("chain_sum", "basic_arithmetic")


@dataclasses.dataclass(eq=False)
class GymBuilderConfig(datasets.SplitsConfig):
  dataset: str = "chain_sum"
  options: str = "{}"  # JSON of the generator's config (min_terms, max_digits, ...)


class ReasoningGymPrompts(datasets.FixedSplitsBuilder):
  """Fixed train/eval sets drawn from a reasoning-gym generator."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "question": tfds.features.Text(), "answer": tfds.features.Text(),
        "entry": tfds.features.Text(), "index": np.int64}))

  def _generate_examples(self, size: int, seed: int):
    c = self.builder_config
    ds = reasoning_gym.create_dataset(c.dataset, seed=seed, size=size, **json.loads(c.options))
    for i, entry in enumerate(ds):
      yield i, {"question": entry["question"], "answer": entry["answer"],
                "entry": json.dumps(entry), "index": i}


@dataclasses.dataclass(frozen=True)
class ReasoningTask:
  """A reasoning-gym generator as a task.

  prompt_style "compact" gives the bare expression (`17+43-13=`), short enough for a policy
  trained from scratch on a CPU; "question" gives the generator's full question text.
  """

  dataset: str = "chain_sum"
  options: tuple[tuple[str, Any], ...] = ()
  train_size: int = 5000
  eval_size: int = 256
  seed: int = 0
  prompt_style: str = "compact"
  max_turns: int = 1

  def __post_init__(self):
    if self.dataset not in SUPPORTED:
      raise ValueError(f"unknown reasoning dataset {self.dataset!r}; choose one of {SUPPORTED}")
    if self.prompt_style not in ("compact", "question"):
      raise ValueError(f"prompt_style must be 'compact' or 'question', got "
                       f"{self.prompt_style!r}")
    # fail on bad generator options now, not halfway through building the dataset
    reasoning_gym.create_dataset(self.dataset, seed=0, size=1, **dict(self.options))

  @property
  def name(self) -> str:
    return f"reasoning/{self.dataset}"

  def prepare(self, data_dir: str | None) -> dict[str, Any]:
    opts = json.dumps(dict(self.options), sort_keys=True)
    # the config name is a digest of everything that shapes the data: same task, same files
    tag = hashlib.sha1(f"{opts}|{self.train_size}|{self.eval_size}|{self.seed}".encode())
    config = GymBuilderConfig(name=f"{self.dataset}_{tag.hexdigest()[:10]}", dataset=self.dataset,
                              options=opts, train_size=self.train_size,
                              eval_size=self.eval_size, seed=self.seed)
    return datasets.prepare(ReasoningGymPrompts, config, data_dir)

  def prompt(self, record: Record) -> str:
    entry = json.loads(datasets.text(record["entry"]))
    if self.prompt_style == "question":
      return entry["question"] + "\n"
    return entry["metadata"]["expression"].replace(" ", "") + "="

  def target(self, record: Record) -> str:
    return datasets.text(record["answer"])

  def reward(self, record: Record, completion: str) -> float:
    entry = json.loads(datasets.text(record["entry"]))
    return float(_score_answer(self.dataset, self.options)(answer=completion.strip(), entry=entry))

  def alphabet(self) -> str:
    return string.digits + "+-*/=()." + (string.ascii_letters + " :,?\n" if
                                          self.prompt_style == "question" else "")


@functools.lru_cache(maxsize=None)
def _score_answer(dataset: str, options: tuple):
  """The generator's score_answer (it only reads the entry it is given)."""
  return reasoning_gym.create_dataset(dataset, seed=0, size=1, **dict(options)).score_answer
