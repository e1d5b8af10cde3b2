"""Command lines: a config file with `--config.key=value` overrides, and bad input as one line.

Every entry point's bad input (an unknown flag or config key, a value of the wrong type, a config
file that is not there, a bad variant, a bad value or path) stops it before any work with one
line on stderr naming what is wrong and the choices, and exit status 2.

ml_collections' config_flags reads the command line when the flag is defined, at import, and a
bad override surfaces as a traceback from inside it without the key's path; a name for a section
(`--config.model=small`) cannot be given to it at all. Here the config file is a plain string
flag, the overrides are taken off the command line before absl sees it, and both are applied,
in order, with trace_jax.configs.set_key once the flags are parsed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import sys

import ml_collections
from absl import app, flags

from trace_jax.configs import get_key, set_key


def fail(message: str):
  """Stops the program: one line on stderr, exit status 2 (a usage error)."""
  print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  sys.exit(2)


@contextlib.contextmanager
def bad_input(*errors: type[BaseException]):
  """Errors raised inside are the user's input: one line each (ValueError by default)."""
  try:
    yield
  except errors or (ValueError,) as e:
    fail(str(e))


class ArgumentParser(argparse.ArgumentParser):
  """argparse with its errors on one line (argparse prints the usage before them)."""

  def error(self, message):
    fail(f"{message} (see {self.prog} --help)")


class ConfigFile:
  """A `--<name>=path.py[:variant,key=value]` flag whose `get_config(arg)` gives the config."""

  def __init__(self, name: str, default: str, help_string: str):
    self.name = name
    self._path = flags.DEFINE_string(
        name, default, f"{help_string}: path.py[:variant,key=value,...]; then any key as "
        f"--{name}.key=value (--{name}.model=<preset> for a model section)")
    self._value = None
    self._overrides: list[tuple[str, str | bool]] = []  # bool: `--name.key`, `--noname.key`

  @property
  def value(self) -> ml_collections.ConfigDict:
    if self._value is None:
      raise RuntimeError(f"--{self.name} is read once the flags are parsed (trace_jax.cli.run)")
    return self._value

  def take_overrides(self, args: list[str]) -> list[str]:
    """Removes `--name.key=value`, `--name.key value` and, for bools, `--name.key` and
    `--noname.key` from args, keeping their order; returns the rest."""
    pattern = re.compile(rf"^--?(?:(no){re.escape(self.name)}\.([^=]+)|{re.escape(self.name)}"
                         rf"\.([^=]+)(?:=(.*))?)$")
    rest, i = [], 0
    while i < len(args):
      m = pattern.match(args[i]) if "--" not in rest else None
      i += 1
      if not m:
        rest.append(args[i - 1])
        continue
      negated, negated_key, key, value = m.groups()
      if negated:
        self._overrides.append((negated_key, False))
        continue
      if value is None and i < len(args) and not args[i].startswith("-"):
        value, i = args[i], i + 1  # `--config.key value`, as absl takes `--flag value`
      self._overrides.append((key, True if value is None else value))
    return rest

  def load(self) -> None:
    c = load_config(self._path.value)
    for key, value in self._overrides:
      old = get_key(c, key)
      if isinstance(value, bool) and not isinstance(old, (bool, ml_collections.ConfigDict)):
        raise ValueError(f"--{self.name}.{key} needs a value: --{self.name}.{key}=..." if value
                         else f"--no{self.name}.{key}: {key} is not a bool")
      set_key(c, key, value)
    c.lock()  # as config_flags does: a misspelt key in code fails too
    self._value = c


def load_config(spec: str) -> ml_collections.ConfigDict:
  """`path.py[:arg]` -> the module's get_config(arg), as config_flags loads it."""
  path, colon, arg = spec.partition(":")
  if not os.path.isfile(path):
    folder = os.path.dirname(path) or "."
    there = sorted(f for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")
                   ) if os.path.isdir(folder) else []
    hint = f"; {folder} has {', '.join(there)}" if there else ""
    raise ValueError(f"config file {path!r} not found{hint}")
  module_spec = importlib.util.spec_from_file_location(
      f"config_{os.path.splitext(os.path.basename(path))[0]}", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"config file {path!r} has no get_config(arg)")
  return module.get_config(arg) if colon else module.get_config()


def run(main, *configs: ConfigFile) -> None:
  """absl's app.run, with `configs` loaded and every parsing error on one line."""

  def parse(argv: list[str]) -> list[str]:
    rest = argv[1:]
    for c in configs:
      rest = c.take_overrides(rest)
    try:
      args = flags.FLAGS([argv[0], *rest])
    except flags.Error as e:
      fail(str(e))
    with bad_input():
      for c in configs:
        c.load()
    return args

  app.run(main, flags_parser=parse)
