"""Test-wide setup: 8 fake CPU devices for the sharding tests (set before JAX starts)."""

import os
import sys

import pytest

if "jax" not in sys.modules:
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


def pytest_collection_modifyitems(session, config, items):
  if not items and not config.getoption("markexpr"):
    raise pytest.UsageError("no tests were collected: check testpaths and test file names")
