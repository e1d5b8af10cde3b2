"""The task interface every task family implements (reasoning here; coding and long-horizon
plug in the same way).

A task owns three things: its data (records read from a TFDS dataset through `tfds.data_source`),
how a record becomes a prompt and a reference completion, and how a completion is scored. A
multi-turn task also answers each policy turn with an observation (`step`); single-turn tasks
leave `max_turns = 1`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

Record = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Turn:
  """What a multi-turn environment returns after a policy turn: an observation to insert into
  the context (masked out of the loss and the mismatch metrics), or the end of the episode."""

  observation: str | None
  done: bool
  reward: float = 0.0


class Task(Protocol):
  name: str
  max_turns: int

  def prepare(self, data_dir: str) -> dict[str, Any]:
    """Builds the TFDS dataset if needed; returns its data sources by split."""

  def prompt(self, record: Record) -> str:
    """The text the policy is given."""

  def target(self, record: Record) -> str:
    """A reference completion (the supervised warm start learns these)."""

  def reward(self, record: Record, completion: str) -> float:
    """Score of a completion (text up to the end-of-sequence token), in [0, 1]."""

  def alphabet(self) -> str:
    """Every character prompts and completions may contain (for a character tokenizer)."""
