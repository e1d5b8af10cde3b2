"""Orbax checkpoints of everything a run needs to continue: params, optimizer state, RNG key,
the KL penalty's reference (the state pytree) and step, data position, tokenizer and config
(JSON metadata).

Orbax writes a checkpoint into a temporary directory and renames it when complete, so a run
killed during a save leaves the checkpoints before it as they were.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """Synchronous saves under `<workdir>/checkpoints/<step>`, keeping the newest `keep`."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    """Every saved step, newest first."""
    return sorted(self.manager.all_steps(), reverse=True)

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def set_aside(self, step: int) -> str:
    """Renames an unreadable checkpoint `<step>.unreadable` (kept for a look, out of the way of
    the run's next save of that step) -> its new path."""
    new, n = self.path(step) + ".unreadable", 1
    while os.path.exists(new):
      new, n = f"{self.path(step)}.unreadable.{n}", n + 1
    os.rename(self.path(step), new)
    self.manager.reload()
    return new

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore(self, step: int, like) -> tuple[dict, dict]:
    """State shaped (and placed) like `like`, and the metadata."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self.manager.close()
