"""Helpers for ml-collections config files: `configs/x.py:variant,key=value` arguments."""

from __future__ import annotations

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
        raise ValueError(f"unknown config variant {part!r}; variants: {sorted(variants)}, or "
                         f"key=value with keys {sorted(config.keys())}")
      for key, value in variants[part].items():
        set_key(config, key, value)
      continue
    key, value = part.split("=", 1)
    set_key(config, key.strip(), value.strip())
  return config


def set_key(config, key: str, value) -> None:
  """config[key] = value for a dotted key, converting strings to the existing value's type."""
  *parents, leaf = key.split(".")
  for p in parents:  # dotted keys reach into nested ConfigDicts
    if p not in config or not isinstance(config[p], ml_collections.ConfigDict):
      raise ValueError(f"unknown config key {key!r}; top-level keys: {sorted(config.keys())}")
    config = config[p]
  key = leaf
  if key not in config:
    raise ValueError(f"unknown config key {key!r}; keys: {sorted(config.keys())}")
  old = config[key]
  if isinstance(value, str) and not isinstance(old, str):
    if isinstance(old, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config key {key!r} is a bool, got {value!r}")
      value = value.lower() in ("true", "1")
    else:
      value = type(old)(value)
  config[key] = value
