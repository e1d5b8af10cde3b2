"""The input pipeline: shuffled, repeated batches of task records by step, and their tokens.

Batches are addressed by step (`batches[step]`), so the data position of a run is its step
number: a resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np


def record_batches(source, batch_size: int, seed: int) -> grain.MapDataset:
  """Batches (lists) of records from a random-access source, reshuffled every epoch."""
  if len(source) == 0:
    raise ValueError("the dataset split is empty")
  return (grain.MapDataset.source(source).shuffle(seed=seed).repeat()
          .batch(batch_size, batch_fn=list))


def left_pad(seqs: Sequence[Sequence[int]], width: int, pad_id: int, *,
             what: str = "prompt") -> tuple[np.ndarray, np.ndarray]:
  """Left-pads token lists to a fixed width -> (tokens [B, width] int32, lengths [B])."""
  too_long = [len(s) for s in seqs if len(s) > width]
  if too_long:
    raise ValueError(f"a {what} of {max(too_long)} tokens does not fit the configured width "
                     f"{width}; raise it in the config")
  if any(len(s) == 0 for s in seqs):
    raise ValueError(f"empty {what}")
  out = np.full((len(seqs), width), pad_id, np.int32)
  for i, s in enumerate(seqs):
    out[i, width - len(s):] = s
  return out, np.array([len(s) for s in seqs], np.int32)


def supervised_batch(tokenizer, prompts: Sequence[str],
                     continuations: Sequence[Sequence[tuple[str, bool]]], prompt_width: int,
                     continuation_width: int) -> dict[str, np.ndarray]:
  """Prompt (left-padded) then continuation segments, the rollout's layout. Each segment is
  (text, trained?): the loss mask covers the policy's segments (answers, <eos>), not the
  environment's (observations)."""
  p, lens = left_pad([tokenizer.encode(t) for t in prompts], prompt_width, tokenizer.pad_id)
  b, total = len(prompts), prompt_width + continuation_width
  tokens = np.full((b, total), tokenizer.pad_id, np.int32)
  tokens[:, :prompt_width] = p
  loss_mask = np.zeros((b, total), bool)
  for i, segments in enumerate(continuations):
    at = prompt_width
    for text, trained in segments:
      ids = tokenizer.encode(text) if text != "<eos>" else [tokenizer.eos_id]
      if at + len(ids) > total:
        raise ValueError(f"a continuation needs at least {at + len(ids) - prompt_width} "
                         f"positions, the rollout has {continuation_width} (rl.max_new_tokens)")
      tokens[i, at:at + len(ids)] = ids
      loss_mask[i, at:at + len(ids)] = trained
      at += len(ids)
  valid = np.arange(total)[None, :] >= (prompt_width - lens)[:, None]
  return {"tokens": tokens, "valid": valid, "loss_mask": loss_mask}


def demonstration(task, record) -> list[tuple[str, bool]]:
  """What the warm start imitates: a multi-turn task's demonstration, or target + <eos>."""
  if hasattr(task, "demonstration"):
    return task.demonstration(record)
  return [(task.target(record), True), ("<eos>", True)]
