"""The long-horizon family: a multi-turn environment with observations in the context.

`RunningSumTask`: the environment starts a counter (`s=5`) and, every turn, announces an
operation (`+7>`); the policy answers with the new total modulo `modulus` (`2;`). From the
second turn on, each observation starts with the verdict on the previous answer (`y` or `n`)
and the counter always continues from the true total, so an episode is a closed loop: the policy
has to notice and recover from its own mistakes. Turns have fixed lengths (observation 4
tokens, answer 2 for modulus 10), so a batch of episodes advances in lockstep through one KV
cache. With the default 32 turns a trajectory is 188 tokens after the prompt; the reward is the
fraction of turns answered correctly.
Observation tokens are context only: they are masked out of the loss and the mismatch metrics.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random

import numpy as np
import tensorflow_datasets as tfds

from trace_jax.tasks import datasets
from trace_jax.tasks.base import Record, Turn

OBS_LEN = 4  # "y+7>"


# an episode's operations and running totals, parsed once: each turn's `step` reads them, so a
# 256-turn demonstration or rollout would otherwise parse and sum its episode 256 times
@functools.lru_cache(maxsize=8192)
def _episode(ops_json: str, start: int, modulus: int, turns: int):
  ops = json.loads(ops_json)
  if len(ops) < turns:
    raise ValueError(f"episode has {len(ops)} operations, the task needs {turns}")
  ops, total, totals = tuple(ops[:turns]), start % modulus, []
  for o in ops:
    total = (total + o) % modulus
    totals.append(total)
  return ops, tuple(totals)


@dataclasses.dataclass(eq=False)
class EpisodeBuilderConfig(datasets.SplitsConfig):
  turns: int = 32


class RunningSumEpisodes(datasets.FixedSplitsBuilder):
  """Episode specs: a start value and one signed digit per turn."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        "start": np.int64, "ops": tfds.features.Text(), "index": np.int64}))

  def _generate_examples(self, size: int, seed: int):
    rng = random.Random(seed)
    for i in range(size):
      ops = [rng.choice([-1, 1]) * rng.randint(1, 9) for _ in range(self.builder_config.turns)]
      yield i, {"start": rng.randint(0, 9), "ops": json.dumps(ops), "index": i}


def _op(o: int) -> str:
  return f"{'+' if o >= 0 else '-'}{abs(o)}"


@dataclasses.dataclass(frozen=True)
class RunningSumTask:
  turns: int = 32
  modulus: int = 10
  train_size: int = 2000
  eval_size: int = 100
  seed: int = 0

  def __post_init__(self):
    if self.turns < 1 or self.modulus < 2:
      raise ValueError(f"need turns >= 1 and modulus >= 2, got {self.turns}, {self.modulus}")

  @property
  def max_turns(self) -> int:
    return self.turns

  @property
  def name(self) -> str:
    return f"long_horizon/running_sum_{self.turns}x{self.modulus}"

  @property
  def answer_len(self) -> int:
    return len(str(self.modulus - 1)) + 1  # digits and ";"

  observation_len = OBS_LEN

  def prepare(self, data_dir: str | None):
    config = EpisodeBuilderConfig(
        name=f"t{self.turns}_{self.train_size}_{self.eval_size}_{self.seed}", turns=self.turns,
        train_size=self.train_size, eval_size=self.eval_size, seed=self.seed)
    return datasets.prepare(RunningSumEpisodes, config, data_dir)

  def _episode(self, record: Record) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _episode(datasets.text(record["ops"]), int(record["start"]), self.modulus,
                    self.turns)

  def _ops(self, record: Record) -> tuple[int, ...]:
    return self._episode(record)[0]

  def totals(self, record: Record) -> tuple[int, ...]:
    return self._episode(record)[1]

  def prompt(self, record: Record) -> str:
    start = int(record["start"]) % self.modulus
    return f"s={start:0{self.answer_len - 1}d} {_op(self._ops(record)[0])}>"

  def answer(self, total: int) -> str:
    return f"{total:0{self.answer_len - 1}d};"

  def step(self, record: Record, turn: int, answer: str) -> Turn:
    """The environment's reply to the policy's answer in `turn` (0-based)."""
    correct = answer == self.answer(self.totals(record)[turn])
    if turn + 1 == self.turns:
      return Turn(observation=None, done=True, reward=float(correct))
    verdict = "y" if correct else "n"
    return Turn(observation=f"{verdict}{_op(self._ops(record)[turn + 1])}>", done=False,
                reward=float(correct))

  def demonstration(self, record: Record) -> list[tuple[str, bool]]:
    """A perfect episode after the prompt: (text, written by the policy?) segments."""
    segments = []
    for turn, total in enumerate(self.totals(record)):
      segments.append((self.answer(total), True))
      obs = self.step(record, turn, self.answer(total)).observation
      if obs is not None:
        segments.append((obs, False))
    return segments

  def target(self, record: Record) -> str:
    return "".join(text for text, _ in self.demonstration(record))

  def reward(self, record: Record, completion: str) -> float:
    """Fraction of turns answered correctly in a full transcript after the prompt."""
    per_turn = self.answer_len + OBS_LEN
    answers = [completion[i * per_turn:i * per_turn + self.answer_len]
               for i in range(self.turns)]
    return float(np.mean([a == self.answer(t) for a, t in zip(answers, self.totals(record))]))

  def alphabet(self) -> str:
    return "0123456789s=+-><;yn "
