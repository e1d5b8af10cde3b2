"""One device mesh with named axes, and the logical-axis rules of the two programs.

The mesh has a `data` axis and an `expert` axis. Arrays are described by logical axes (`batch`,
`experts`, ...) and each program maps them to mesh axes with its own rules:

- rollout: sequences (and their KV cache and records) split over `data`; expert weights split
  over `expert`, so a decode step reads each expert's bytes on one device only;
- training: sequences split over every device (`data` x `expert`); expert weights over `expert`.

Everything else is replicated. Logical axes become mesh axes through flax's logical axis rules
(`flax.linen.logical_to_mesh_axes`: a rule maps one logical axis to a mesh axis or several, an
axis no rule names replicates, no mesh axis is used twice in one array). The same jitted
programs run on one device or many, in one process or several (jax.distributed:
trace_jax.distributed): only the placement of their inputs changes (`place`, `Layout`). Under
several processes each holds its devices' shards of every array; `Layout` says which rows of a
batch a process loads and computes rewards for, and `fetch` brings an array whole to every
host.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "expert")
Rules = dict[str, str | tuple[str, ...] | None]

ROLLOUT_RULES: Rules = {"batch": "data", "experts": "expert"}
TRAIN_RULES: Rules = {"batch": ("data", "expert"), "experts": "expert"}

_EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
# the leading axis of a stack of layers (`models.stacks`): no rule names it, each device holds
# every layer of its shard
LEADING_AXES = ("layers",)


def flax_rules(rules: Rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
  """`rules` as flax's logical axis rules: (logical axis, mesh axes) pairs, in priority order."""
  return tuple(rules.items())


def make_mesh(data: int | None = None, expert: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, expert) mesh over the first data x expert of `devices` (default: all of
  jax.devices()); data defaults to every device that expert leaves."""
  devices = list(jax.devices() if devices is None else devices)
  if data is None:
    data = len(devices) // expert
  if data < 1 or expert < 1 or data * expert > len(devices):
    raise ValueError(f"mesh data={data} x expert={expert} needs {data * expert} devices, "
                     f"have {len(devices)}")
  return Mesh(np.asarray(devices[:data * expert]).reshape(data, expert), AXES)


def spec(logical: Sequence[str | None], rules: Rules) -> P:
  """Logical axis names -> PartitionSpec under `rules` (unknown names replicate)."""
  return nn.logical_to_mesh_axes(tuple(logical), flax_rules(rules))


def _axis_size(mesh: Mesh, axes) -> int:
  axes = (axes,) if isinstance(axes, str) else (axes or ())
  return int(np.prod([mesh.shape[a] for a in axes]))


def _path_names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _stacked_items(tree) -> set[tuple[str, ...]]:
  """Paths of the layers items that are stacks (`models.stacks`: their norm has a leading
  layer axis), wherever in the tree they are (params, optimizer moments, rollout weights)."""
  out = set()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    names = _path_names(path)
    if names[-1:] == ["attn_norm"] and len(names) >= 3 and names[-3] == "layers" and (
        len(leaf.shape) == 2):
      out.add(tuple(names[:-1]))
  return out


def param_logical_axes(path, leaf, stacked: bool = False) -> tuple[str | None, ...]:
  """Logical axes of a param or rollout-weight leaf: expert stacks lead with `experts`, and so
  does every array of a packed expert stack (codes, scales, globals; in any layout); `stacked`:
  the leaf has a leading `layers` axis before those (a stack of layers)."""
  names = _path_names(path)
  lead = LEADING_AXES if stacked else ()
  rest = leaf.ndim - len(lead)
  # (a rollout weight packed from several, `rollout_path.Fused`, is named by theirs joined by +)
  if any(part in _EXPERT_WEIGHTS for n in names for part in n.split("+")) and rest >= 1:
    return lead + ("experts",) + (None,) * (rest - 1)
  return lead + (None,) * rest


def param_logical_specs(tree):
  """Each leaf's logical axes (`param_logical_axes`) as a PartitionSpec of logical names."""
  stacked = _stacked_items(tree)

  def one(path, leaf):
    names = _path_names(path)
    return P(*param_logical_axes(path, leaf, any(tuple(names[:len(p)]) == p for p in stacked)))
  return jax.tree_util.tree_map_with_path(one, tree)


def param_shardings(tree, mesh: Mesh, rules: Rules):
  logical = param_logical_specs(tree)
  axis = rules.get("experts")

  def check(path, leaf, axes):
    if "experts" in axes and leaf.shape[axes.index("experts")] % _axis_size(mesh, axis):
      raise ValueError(f"{'/'.join(_path_names(path))}: {leaf.shape[axes.index('experts')]} "
                       f"experts do not split over mesh axis {axis!r} of size "
                       f"{_axis_size(mesh, axis)}")
  jax.tree_util.tree_map_with_path(check, tree, logical)
  return nn.logical_to_mesh_sharding(logical, mesh, flax_rules(rules))


def batch_shardings(tree, mesh: Mesh, rules: Rules, batch_axis: int = 0):
  """Shardings that split every leaf along `batch_axis` (leaves of lower rank replicate)."""
  axes = rules.get("batch")
  size = _axis_size(mesh, axes)

  def one(leaf):
    if leaf.ndim <= batch_axis:
      return NamedSharding(mesh, P())
    if leaf.shape[batch_axis] % size:
      raise ValueError(f"batch of {leaf.shape[batch_axis]} does not split over mesh axes {axes} "
                       f"of size {size}")
    logical = [None] * leaf.ndim
    logical[batch_axis] = "batch"
    return NamedSharding(mesh, spec(logical, rules))
  return jax.tree.map(one, tree)


def place(tree, shardings):
  """`tree` on `shardings` (a tree of them, or one for every leaf). Under several processes a
  host value (or an array on one local device) is the whole array, the same on every process,
  and each process puts its own devices' slices of it."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, tree)

  def one(x, s):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable and not s.is_fully_addressable):
      return jax.device_put(x, s)  # resharding a global array (every process takes part)
    x = np.asarray(x)  # device_put would first compare the value across processes
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])
  return jax.tree.map(one, tree, shardings)


def fetch(tree):
  """Host copies (numpy) of a tree's arrays, whole on every process: an array split between
  processes is gathered from them (a collective: every process must call it, in the same
  order)."""
  def one(x):
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
      return multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))
  return jax.tree.map(one, tree)


class Layout:
  """How one program's batches are split between processes, along their leading (batch) axis:
  which rows of a batch this process loads (`rows`), how each process's rows become the one
  global batch (`put`), and how its rows come back to it (`local`). With one process every row
  is its own; without a mesh, arrays stay where they are (one device)."""

  def __init__(self, mesh: Mesh | None, rules: Rules):
    self.mesh, self.rules = mesh, rules

  def _sharding(self, ndim: int) -> NamedSharding:
    return NamedSharding(self.mesh, spec(("batch",) + (None,) * (ndim - 1), self.rules))

  def rows(self, n: int) -> slice:
    """The rows of a batch of `n` on this process's devices: one contiguous block."""
    if self.mesh is None:
      return slice(0, n)
    batch_shardings(np.zeros((n,)), self.mesh, self.rules)  # n must split: one clear line
    blocks = {index[0].indices(n)[:2]
              for index in self._sharding(1).addressable_devices_indices_map((n,)).values()}
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    if sum(b - a for a, b in blocks) != hi - lo:  # meshes from make_mesh never do this
      raise ValueError(f"this process's rows of a batch of {n} are not one block: {blocks}")
    return slice(lo, hi)

  def put(self, local_tree, n: int):
    """Global arrays of `n` rows from each process's `rows(n)` of them (its host values)."""
    if self.mesh is None:
      return local_tree

    def one(x):
      x = np.asarray(x)
      return jax.make_array_from_process_local_data(self._sharding(x.ndim), x,
                                                    (n, *x.shape[1:]))
    return jax.tree.map(one, local_tree)

  def local(self, x) -> np.ndarray:
    """This process's `rows` of a global array split along its leading axis, on the host."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return np.asarray(x)
    shards = {s.index[0].indices(x.shape[0])[:2]: s.data for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])

  def gather(self, local, n: int) -> np.ndarray:
    """The whole batch on every process, from each process's `rows(n)` of it."""
    return fetch(self.put(local, n))
