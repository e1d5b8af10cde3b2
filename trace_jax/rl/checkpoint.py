"""Orbax checkpoints of everything a run needs to continue: params, optimizer state, RNG key,
the KL penalty's reference (the state pytree) and step, data position, tokenizer and config
(JSON metadata).

Orbax writes a checkpoint into a temporary directory and renames it when complete, so a run
killed during a save leaves the checkpoints before it as they were. Under several processes
(jax.distributed) every process calls save and restore, each writing and reading its own
shards, into one directory they all see (a shared file system across hosts); a checkpoint
restores into any number of processes and devices the state's shardings split over.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp

from trace_jax import distributed

# TensorStore's status codes for a checkpoint's bytes cut short, missing or not decoding
_DECODE_ERRORS = ("DATA_LOSS", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION")


class CannotResume(ValueError):
  """A workdir's checkpoints cannot continue this run; the message says why and what to do."""


class LayoutMismatch(CannotResume):
  """A checkpoint that reads, of another state layout than the code restoring it builds."""


def unreadable(e: BaseException) -> bool:
  """Whether `e`, or an error under it (orbax wraps TensorStore's), says that a checkpoint's
  files are cut short, missing or do not decode; not a layout that differs, a machine's
  passing failure or running out of memory."""
  for _ in range(16):  # a chain, not a cycle
    if isinstance(e, (json.JSONDecodeError, UnicodeDecodeError, FileNotFoundError)):
      return True
    if type(e) is ValueError and str(e).startswith(_DECODE_ERRORS):
      return True
    e = e.__cause__ or e.__context__
    if e is None:
      return False
  return False


def _leaves(tree) -> dict[str, tuple]:
  """path -> (shape, dtype) of every array, the path's parts as plain names (a checkpoint's
  metadata has dicts and lists where the state has named tuples)."""
  name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
  return {"/".join(map(name, path)): (tuple(leaf.shape), str(leaf.dtype))
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _few(names: list[str], n: int = 3) -> str:
  return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


class Checkpointer:
  """Synchronous saves under `<workdir>/checkpoints/<step>`, keeping the newest `keep`."""

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()},
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
    distributed.barrier(f"set aside checkpoint {step}")  # every process has read it
    if distributed.is_primary():
      os.rename(self.path(step), new)
    distributed.barrier(f"checkpoint {step} set aside")
    self.manager.reload()
    return new

  def save(self, step: int, state, meta: dict) -> None:
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def check_layout(self, step: int, like) -> None:
    """Raises LayoutMismatch, naming the checkpoint and what differs, where the arrays it holds
    are not those of `like` (by path, shape and dtype)."""
    tree = self.manager.item_metadata(step).state
    tree = getattr(tree, "tree", tree)  # orbax's TreeMetadata, or the tree itself
    if tree is None:  # saved without tree metadata: the restore checks what it can
      return
    saved, want = _leaves(tree), _leaves(like)
    if saved == want:
      return
    missing, extra = sorted(set(want) - set(saved)), sorted(set(saved) - set(want))
    changed = [f"{k} {saved[k]} here {want[k]}" for k in sorted(set(want) & set(saved))
               if saved[k] != want[k]]
    what = ([f"{len(missing)} arrays missing ({_few(missing)})"] if missing else []) + (
        [f"{len(extra)} arrays not expected ({_few(extra)})"] if extra else []) + (
        [f"{len(changed)} of another shape or dtype ({_few(changed)})"] if changed else [])
    raise LayoutMismatch(f"checkpoint {self.path(step)} holds a state of another layout than "
                         f"this code builds: {'; '.join(what)}; resume it with the version that "
                         "wrote it, or use a new --workdir")

  def restore(self, step: int, like) -> tuple[dict, dict]:
    """State shaped (and placed) like `like`, and the metadata; LayoutMismatch where the
    checkpoint holds other arrays."""
    self.check_layout(step, like)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    self.manager.close()
