"""Helpers for ml-collections config files: `configs/x.py:variant,key=value` arguments."""

from __future__ import annotations

import dataclasses
import difflib

import ml_collections


def apply_variant(config: ml_collections.ConfigDict, arg: str | None,
                  variants: dict[str, dict] | None = None) -> ml_collections.ConfigDict:
  """Applies a config-file argument: named variants and key=value pairs, comma separated.

  Values are converted to the type of the default they replace; unknown names fail, listing the
  choices, before any work starts.
  """
  variants = variants or {}
  for part in filter(None, (arg or "").split(",")):
    if "=" not in part:
      if part not in variants:
        raise ValueError(f"unknown config variant {part!r}{_near(part, variants)}; variants: "
                         f"{', '.join(sorted(variants)) or 'none'}, or key=value with keys "
                         f"{', '.join(sorted(config.keys()))}")
      for key, value in variants[part].items():
        set_key(config, key, value)
      continue
    key, value = part.split("=", 1)
    set_key(config, key.strip(), value.strip())
  return config


# keys that moved, section.key -> section.key where it is now (saved runs are read with them
# moved there: trace_jax.rl.loop.saved_config)
MOVED = {"rl.kernels": "engine.kernels", "rl.attention_kernel": "engine.attention_kernel"}
# keys split off another, section.key -> the key whose value they took before they existed
# (saved runs without them are read with that value: trace_jax.rl.loop.saved_config); before
# sft.attention, the warm start's loss took rl.attention
SPLIT_FROM = {"sft.attention": "rl.attention"}


def set_key(config: ml_collections.ConfigDict, key: str, value) -> None:
  """config[key] = value for a dotted key, converting strings to the existing value's type.

  A string for a section that has named presets (`model=small`) sets the section's keys to the
  preset's values. Errors name the whole key and the keys there are at its level.
  """
  node, leaf = _walk(config, key)
  old = node[leaf]
  if isinstance(old, ml_collections.ConfigDict):
    if not isinstance(value, str) or key not in SECTION_PRESETS:
      raise ValueError(f"config key {key!r} is a section (keys {', '.join(sorted(old.keys()))}); "
                       f"set one of its keys, e.g. {key}.{sorted(old.keys())[0]}=...")
    for k, v in _preset(key, value).items():
      if k in old:
        old[k] = v
    return
  node[leaf] = _convert(key, old, value)


def get_key(config: ml_collections.ConfigDict, key: str):
  node, leaf = _walk(config, key)
  return node[leaf]


def _walk(config: ml_collections.ConfigDict, key: str):
  """(the ConfigDict holding key, key's last part); unknown keys fail, naming their level's."""
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts):
    here = ".".join(parts[:i])
    if not isinstance(node, ml_collections.ConfigDict):
      kind = _KINDS.get(type(node), type(node).__name__)
      raise ValueError(f"unknown config key {key!r}: {here} is {kind}, not a section")
    if part not in node:
      moved = MOVED.get(".".join(parts[:i + 1]))
      if moved:
        raise ValueError(f"unknown config key {key!r}: moved to {moved}")
      where = f"keys of {here}" if here else "top-level keys"
      raise ValueError(f"unknown config key {key!r}{_near(part, node, parts[:i])}; {where}: "
                       f"{', '.join(sorted(node.keys()))}")
    if i < len(parts) - 1:
      node = node[part]
  return node, parts[-1]


_KINDS = {bool: "a bool (true or false)", int: "an int", float: "a float", str: "a string"}


def _convert(key: str, old, value):
  if not isinstance(value, str) or isinstance(old, str) or old is None:
    return value
  if isinstance(old, bool):
    if value.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"config key {key!r} is a bool (true or false), got {value!r}")
    return value.lower() in ("true", "1")
  try:
    return type(old)(value)
  except ValueError:
    kind = _KINDS.get(type(old), type(old).__name__)
    raise ValueError(f"config key {key!r} is {kind}, got {value!r}") from None


def _near(name: str, choices, path=()) -> str:
  close = difflib.get_close_matches(name, [str(c) for c in choices], n=1)
  return f" (did you mean {'.'.join([*path, close[0]])}?)" if close else ""


def _model_presets() -> dict[str, dict]:
  # imported here: the model code pulls in JAX, which a config file's own import should not need
  from trace_jax.models.config import PRESETS as MODELS

  # vocab_size is the tokenizer's, not the config's
  return {name: {k: v for k, v in dataclasses.asdict(make()).items() if k != "vocab_size"}
          for name, make in MODELS.items()}


# sections that a name on the command line can set whole: `--config.model=small`
SECTION_PRESETS = {"model": _model_presets}


def _preset(section: str, name: str) -> dict:
  presets = SECTION_PRESETS[section]()
  if name not in presets:
    raise ValueError(f"config key {section!r}: unknown preset {name!r}{_near(name, presets)}; "
                     f"presets: {', '.join(sorted(presets))}, or set its keys "
                     f"({section}.<key>=...)")
  return presets[name]
