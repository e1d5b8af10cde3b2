"""Test-wide setup: 8 fake CPU devices for the sharding tests and one persistent compilation
cache for the session (both set before JAX starts), and the sandbox's boundary for the tests
that run untrusted programs."""

import os
import shutil
import sys
import tempfile

import pytest

if "jax" not in sys.modules:
  _flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

_CACHE = None
if "jax" not in sys.modules and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # Many tests compile the same programs (each mode's warm start, a run and its resumed copy
  # in another process): JAX's persistent cache, fresh for the session and inherited by the
  # processes tests start, compiles each once (tests/test_main.py: 12.0 -> 8.3 min on 2 cores)
  _CACHE = tempfile.mkdtemp(prefix="trace_jax_tests_jit_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


def pytest_configure(config):
  """Kernels in Triton's own language run in its interpreter in every test but the GPU ones
  (`pallas_kernels.triton_call`); Triton reads this when it is first imported, which a test
  module may do (transformers' models import it where it is installed)."""
  if "gpu" not in (config.getoption("markexpr") or "").replace("not gpu", ""):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config):
  """`-n auto` (pyproject.toml's addopts) gives a worker to each core, but runs GPU tests in
  this one process: every worker would claim the GPU's memory for itself."""
  if "gpu" in (config.getoption("markexpr") or "").replace("not gpu", ""):
    return 0
  return None  # xdist's count: the cores


def pytest_sessionfinish(session, exitstatus):
  if _CACHE:
    shutil.rmtree(_CACHE, ignore_errors=True)



def _boundary_or_why():
  from trace_jax.tasks import sandbox

  try:
    return sandbox.boundary(), None
  except sandbox.BoundaryUnavailable as e:
    return None, str(e)


def _boundary_expected() -> bool:
  """On Linux as root the project installs bubblewrap itself: no boundary there is a bug."""
  return sys.platform.startswith("linux") and os.geteuid() == 0


@pytest.fixture(scope="session")
def kernel_boundary():
  """The sandbox's kernel boundary, for tests about it: where none can be had they fail on a
  Linux root machine (CI) and skip elsewhere, where the opt-in path is tested instead."""
  found, why = _boundary_or_why()
  if found is None:
    if _boundary_expected():
      pytest.fail(f"no sandbox boundary on a Linux root machine: {why}")
    pytest.skip(f"no sandbox boundary here: {why}")
  return found


@pytest.fixture(scope="session")
def allow_unsandboxed() -> bool:
  """For tests that run programs but are not about the boundary: opt in to running without one
  only where none can be had and none is expected."""
  return _boundary_or_why()[0] is None and not _boundary_expected()
