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
import jax.numpy as jnp
import orbax.checkpoint as ocp

from trace_jax import distributed
from trace_jax import sharding as S

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


def _named(tree) -> dict[str, object]:
  name = lambda k: str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
  return {"/".join(map(name, path)): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _split_layers(name: str):
  """"params/layers/3/wq" -> ("params", 3, "wq"); None outside a model's layers."""
  parts = name.split("/")
  for k in range(len(parts) - 2):
    if parts[k] == "layers" and parts[k + 1].isdigit():
      return "/".join(parts[:k]), int(parts[k + 1]), "/".join(parts[k + 2:])
  return None


def _per_layer(leaves: dict[str, tuple]) -> dict[str, tuple] | None:
  """The leaves with every layers item (one layer, or a stack: `models.stacks`) split into its
  layers: per-layer name -> (shape, dtype, the leaf's name, index in its stack or None); None
  where an item has no norm to tell its size by."""
  sizes: dict[tuple[str, int], int | None] = {}
  for name, (shape, _) in leaves.items():
    where = _split_layers(name)
    if where and where[2] == "attn_norm":
      sizes[where[:2]] = shape[0] if len(shape) == 2 else None
  first: dict[tuple[str, int], int] = {}
  for prefix in {p for p, _ in sizes}:
    at = 0
    for item in sorted(i for p, i in sizes if p == prefix):
      first[prefix, item] = at
      at += sizes[prefix, item] or 1
  out = {}
  for name, (shape, dtype) in leaves.items():
    where = _split_layers(name)
    if where is None:
      out[name] = (shape, dtype, name, None)
      continue
    if where[:2] not in sizes:
      return None
    (prefix, item, rest), n = where, sizes[where[:2]]
    base = first[prefix, item]
    for j in range(n or 1):
      out[f"{prefix}/layers/{base + j}/{rest}"] = (shape[1:] if n else shape, dtype, name,
                                                    j if n else None)
  return out


def _same_layers(saved: dict, want: dict) -> bool:
  """Whether two layouts hold the same arrays, the model's layers grouped in other stacks."""
  a, b = _per_layer(saved), _per_layer(want)
  return a is not None and b is not None and (
      {k: v[:2] for k, v in a.items()} == {k: v[:2] for k, v in b.items()})


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

  def _saved_tree(self, step: int):
    tree = self.manager.item_metadata(step).state
    return getattr(tree, "tree", tree)  # orbax's TreeMetadata, or the tree itself

  def check_layout(self, step: int, like) -> bool:
    """Raises LayoutMismatch, naming the checkpoint and what differs, where the arrays it holds
    are not those of `like` (by path, shape and dtype), unless only the grouping of the model's
    layers differs (one array per layer, as written before layers were stacked, or stacks of
    other sizes). -> whether the layers need regrouping."""
    tree = self._saved_tree(step)
    if tree is None:  # saved without tree metadata: the restore checks what it can
      return False
    saved, want = _leaves(tree), _leaves(like)
    if saved == want:
      return False
    if _same_layers(saved, want):
      return True
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
    checkpoint holds other arrays. Layers saved in another grouping are regrouped (read whole
    onto one of each process's devices, then placed as `like` is)."""
    if self.check_layout(step, like):
      return self._restore_regrouped(step, like)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def _restore_regrouped(self, step: int, like) -> tuple[dict, dict]:
    # a device of this process: under several processes jax.devices()[0] is process 0's
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                            self._saved_tree(step))
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    saved, sources = _named(out.state), _per_layer(_leaves(out.state))
    parts: dict[str, list] = {}  # each of this code's leaves: its layers, from the checkpoint's
    for key, (_, _, name, j) in _per_layer(_leaves(like)).items():
      _, _, src, k = sources[key]
      parts.setdefault(name, []).append((j, saved[src] if k is None else saved[src][k]))
    leaves, treedef = jax.tree.flatten(like)
    built = []
    for name in _named(like):
      (j, value), *_ = parts[name]
      if j is not None:
        value = jnp.stack([v for _, v in sorted(parts[name], key=lambda p: p[0])])
      built.append(value)
    # S.place: each process puts its own devices' slices of the whole array it holds
    return S.place(jax.tree.unflatten(treedef, built),
                   jax.tree.unflatten(treedef, [leaf.sharding for leaf in leaves])), out.meta

  def close(self) -> None:
    self.manager.close()
