"""Test-wide setup: 8 fake CPU devices for the sharding tests (set before JAX starts)."""

import os
import sys

if "jax" not in sys.modules:
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

