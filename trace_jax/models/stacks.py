"""Layers stored in stacks, and the runs of layers a forward pass scans over.

A model's `layers` is a list of items, each one layer (a dict of its arrays) or a stack of
consecutive layers (the same dict, every array with a leading layer axis). A `lax.scan` reads
one stack in place; stacking or slicing arrays inside a jitted program copies them (for a
large model, a second copy of its weights). So master params are stored as stacks, one per
group of layers the trainer's program treats alike (`init_params(groups=...)`), and a run that
a stack covers exactly is scanned over it as it is. The rollout's weights are one item per
layer (what the unrolled decode step reads) or stacks (`pack_weights(stacked=True)`, for the
scanned decode step); its scans read one layer at a time, in place where one stack holds the
run (`take_traced`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence

import jax
import jax.numpy as jnp

Layers = list  # of layer dicts or stacked layer dicts


def is_stack(item) -> bool:
  """Whether a layers item is a stack (its norm has a leading layer axis) or one layer."""
  return len(item["attn_norm"].shape) == 2


def sizes(layers: Layers) -> tuple[int, ...]:
  """Layers per item."""
  return tuple(item["attn_norm"].shape[0] if is_stack(item) else 1 for item in layers)


def starts(layers: Layers) -> tuple[int, ...]:
  """The first layer of each item, and the layer count after the last."""
  return tuple(itertools.accumulate(sizes(layers), initial=0))


def check_sizes(groups: Sequence[int], n_layers: int, what: str = "groups") -> tuple[int, ...]:
  groups = tuple(int(g) for g in groups)
  if sum(groups) != n_layers or min(groups, default=0) < 1:
    raise ValueError(f"{what}={groups}: expected positive layer counts adding up to "
                     f"{n_layers} layers")
  return groups


def stack(layer_list: Sequence[dict], groups: Sequence[int] | None = None) -> Layers:
  """Per-layer dicts -> stacks of `groups` consecutive layers (default: one stack)."""
  groups = check_sizes(groups or (len(layer_list),), len(layer_list))
  out, lo = [], 0
  for n in groups:
    out.append(jax.tree.map(lambda *a: jnp.stack(a), *layer_list[lo:lo + n]))
    lo += n
  return out


def unstack(layers: Layers) -> list[dict]:
  """Every layer as its own dict (stacks sliced: copies inside a jitted program)."""
  return [take(layers, i) for i in range(starts(layers)[-1])]


def regroup(layers: Layers, groups: Sequence[int]) -> Layers:
  """The same layers in stacks of `groups` layers (unchanged where they already are)."""
  if sizes(layers) == tuple(groups) and all(is_stack(item) for item in layers):
    return layers
  return stack(unstack(layers), groups)


def _locate(layers: Layers, i: int) -> tuple[int, int]:
  """(item, index within it) of layer i."""
  bounds = starts(layers)
  if not 0 <= i < bounds[-1]:
    raise IndexError(f"layer {i} of {bounds[-1]}")
  g = next(g for g in range(len(layers)) if bounds[g + 1] > i)
  return g, i - bounds[g]


def take(layers: Layers, i: int) -> dict:
  """Layer i (a static index) as a dict of arrays."""
  g, j = _locate(layers, i)
  item = layers[g]
  return jax.tree.map(lambda a: a[j], item) if is_stack(item) else item


def select(items: Sequence, k):
  """items[k] for a traced k: a switch that copies only the chosen item."""
  if isinstance(k, int):
    return items[k]
  if len(items) == 1 or not jax.tree.leaves(items[0]):  # nothing to choose between
    return items[0]
  return jax.lax.switch(k, [lambda it=it: it for it in items])


def take_traced(layers: Layers, lo: int, hi: int, i) -> dict:
  """Layer i (traced, in [lo, hi)) without copying a stack: indexed in place where one stack
  holds [lo, hi), else selected from the layers' own items (one layer copied)."""
  if isinstance(i, int):
    return take(layers, i)
  g, j = _locate(layers, lo)
  if is_stack(layers[g]) and starts(layers)[g + 1] >= hi:
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i - lo + j, keepdims=False),
                        layers[g])
  return select([take(layers, n) for n in range(lo, hi)], i - lo)


def run_stack(layers: Layers, lo: int, hi: int) -> dict:
  """The stacked arrays of layers [lo, hi): a stored stack as it is where one covers exactly
  that; otherwise concatenated (a copy: store the layers grouped as the program runs them)."""
  g, j = _locate(layers, lo)
  if j == 0 and is_stack(layers[g]) and starts(layers)[g + 1] == hi:
    return layers[g]
  return jax.tree.map(lambda *a: jnp.stack(a), *[take(layers, n) for n in range(lo, hi)])


def runs(n_layers: int, signature: Callable[[int], Hashable],
         cuts: Sequence[int] = ()) -> tuple[tuple[int, int], ...]:
  """Maximal [lo, hi) ranges of consecutive layers with equal `signature`, also split at each
  layer in `cuts`."""
  out, lo = [], 0
  for i in range(1, n_layers + 1):
    if i == n_layers or i in cuts or signature(i) != signature(lo):
      out.append((lo, i))
      lo = i
  return tuple(out)
