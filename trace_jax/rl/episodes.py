"""Rollouts of task batches: single-turn generation, or multi-turn episodes whose observations
are appended to the same KV cache between the policy's turns."""

from __future__ import annotations

import jax
import numpy as np

from trace_jax.data.pipeline import left_pad
from trace_jax.sharding import Layout
from trace_jax.rl.rollout import RolloutBatch, RolloutEngine


def episode_length(task) -> int:
  """Tokens after the prompt in a full episode of a fixed-turn-length task."""
  return task.max_turns * task.answer_len + (task.max_turns - 1) * task.observation_len


def task_rewards(task, records, completions) -> np.ndarray:
  """A task's `rewards` (batched, e.g. one sandbox for many programs) or its `reward`."""
  if hasattr(task, "rewards"):
    return np.asarray(task.rewards(records, completions), np.float32)
  return np.asarray([task.reward(r, c) for r, c in zip(records, completions)], np.float32)


def rollout(engine: RolloutEngine, weights, task, records, tokenizer, prompt_width: int, key,
            layout: Layout = Layout(None, {})) -> tuple[RolloutBatch, np.ndarray]:
  """Runs `records` through the engine -> (batch, reward per sequence). Under several
  processes each tokenizes and scores only its own rows of the batch (`layout.rows`), and every
  process gets every reward."""
  n = len(records)
  mine = records[layout.rows(n)]
  tokens, lengths = left_pad([tokenizer.encode(task.prompt(r)) for r in mine], prompt_width,
                             tokenizer.pad_id)
  tokens, lengths = layout.put((tokens, lengths), n)
  if task.max_turns == 1:
    batch = engine.generate(weights, tokens, lengths, key)
    texts = [tokenizer.decode(row) for row in layout.local(batch.tokens)[:, prompt_width:]]
    return batch, layout.gather(task_rewards(task, mine, texts), n)

  state = engine.start(weights, tokens, lengths, key, prompt_width + episode_length(task))
  rewards = np.zeros(len(mine), np.float32)
  # a turn is one program (the observation appended, the answer sampled) and one wait for its
  # answer; the host tracks where the state is (`t`, read with the answer)
  t, obs = prompt_width, None
  for turn in range(task.max_turns):
    state, answers = engine.turn(weights, state, obs, task.answer_len, t)
    answers, t = layout.local(answers), int(state["t"])
    steps = [task.step(r, turn, tokenizer.decode(a)) for r, a in zip(mine, answers)]
    rewards += [s.reward for s in steps]
    if turn + 1 < task.max_turns:
      obs = [tokenizer.encode(s.observation) for s in steps]
      if any(len(o) != task.observation_len for o in obs):
        raise ValueError(f"{task.name}: observations must be {task.observation_len} tokens")
      obs = layout.put(np.asarray(obs, np.int32), n)
  return engine.finish(state, prompt_width), layout.gather(rewards / task.max_turns, n)


def greedy_accuracy(engine, weights, task, records, tokenizer, prompt_width, batch_size,
                    layout: Layout = Layout(None, {})) -> dict[str, float]:
  """Reward of greedy rollouts over `records` (in fixed-size batches: one compiled shape).
  eval/accuracy: the fraction solved (single-turn) or of turns answered right (multi-turn)."""
  scores = []
  for i in range(0, len(records), batch_size):
    chunk = records[i:i + batch_size]
    padded = chunk + chunk[:1] * (batch_size - len(chunk))
    _, rewards = rollout(engine, weights, task, padded, tokenizer, prompt_width,
                         jax.random.PRNGKey(0), layout)
    scores += list(rewards[:len(chunk)])
  scores = np.asarray(scores)
  solved = scores if task.max_turns > 1 else scores >= 1.0
  return {"eval/accuracy": float(np.mean(solved)), "eval/reward": float(np.mean(scores))}
