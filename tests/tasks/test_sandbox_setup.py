"""Setting the boundary up: the interpreter and the user programs run as, the start-up probe, and
installing bubblewrap where it is missing."""

import os
import secrets
import sys
import time

import pytest

from trace_jax.tasks import sandbox
from trace_jax.tasks.sandbox import kernel


@pytest.fixture
def as_root(monkeypatch):
  monkeypatch.setattr(kernel.os, "geteuid", lambda: 0)


def test_a_root_trainer_without_setpriv_is_refused_not_run_as_root(as_root, monkeypatch):
  """bwrap started by root leaves the sandbox host uid 0, where RLIMIT_NPROC does not hold."""
  which = kernel.shutil.which
  monkeypatch.setattr(kernel.shutil, "which",
                      lambda name, *a, **k: None if name == "setpriv" else which(name, *a, **k))
  with pytest.raises(sandbox.BoundaryUnavailable) as refused:
    list(kernel._candidates("/usr/bin/bwrap", None))
  assert "setpriv" in str(refused.value) and "\n" not in str(refused.value)


def test_a_root_trainer_with_no_python_nobody_may_run_is_refused(as_root, monkeypatch):
  monkeypatch.setattr(kernel, "_world_readable", lambda path: False)
  with pytest.raises(sandbox.BoundaryUnavailable) as refused:
    list(kernel._candidates("/usr/bin/bwrap", None))
  assert "nobody" in str(refused.value) and "\n" not in str(refused.value)


def test_a_root_trainer_falls_back_to_a_system_python_of_another_version(as_root, monkeypatch):
  """Python 3.12 from a directory only root may enter and no /usr/bin/python3.12: the system's
  other Python runs the stdlib-only harness, as nobody."""
  ours = os.path.realpath(sys.base_prefix)
  monkeypatch.setattr(kernel, "_world_readable", lambda path: not path.startswith(ours))
  monkeypatch.setattr(kernel, "_VERSION", (3, 99))
  system = [p for p in kernel._system_pythons() if not p.startswith(ours)]
  if not system:  # nothing nobody may run here: the refusal is the outcome
    with pytest.raises(sandbox.BoundaryUnavailable):
      list(kernel._candidates("/usr/bin/bwrap", None))
    return
  found = list(kernel._candidates("/usr/bin/bwrap", None))
  assert found and all(b.setpriv for b in found)
  assert [b.python for b in found] == system


def failing_first(monkeypatch, stderr: str):
  """`run_with` whose first call comes back failed with `stderr`, the rest run for real."""
  calls = []
  real = sandbox.run_with

  def run_with(where, code, limits=sandbox.Limits()):
    calls.append(where)
    if len(calls) == 1:
      return sandbox.Result(1, "", stderr, False)
    return real(where, code, limits)
  monkeypatch.setattr(sandbox, "run_with", run_with)
  return calls


def test_a_transient_probe_failure_does_not_drop_a_layer(kernel_boundary, monkeypatch):
  failing_first(monkeypatch, "Traceback (most recent call last):\nOSError: busy, try again")
  where = kernel._probe()
  assert bool(where.seccomp) == bool(kernel_boundary.seccomp)
  assert where.unshare == kernel_boundary.unshare


def test_a_layer_is_dropped_only_when_the_error_names_it(kernel_boundary, monkeypatch, capsys):
  if not kernel_boundary.seccomp:
    pytest.skip("no seccomp filter here to drop")
  failing_first(monkeypatch, "bwrap: prctl(PR_SET_SECCOMP): Invalid argument")
  where = kernel._probe()
  assert where.seccomp is None and where.unshare == kernel_boundary.unshare
  said = [line for line in capsys.readouterr().err.splitlines() if "seccomp" in line]
  assert len(said) == 1 and "PR_SET_SECCOMP" in said[0]


def test_the_probe_runs_verdicts_too(kernel_boundary, monkeypatch):
  """Program mode alone said nothing of the judge's fork, prctl and pipes (a system Python
  without ctypes, say): two verdicts at once, through run_batch's path, must pass as well."""
  broken = sandbox._HARNESS_SOURCE.replace(b"  import ctypes\n", b"  import no_ctypes_here\n")
  assert broken != sandbox._HARNESS_SOURCE
  monkeypatch.setattr(sandbox, "_HARNESS_SOURCE", broken)
  with pytest.raises(sandbox.BoundaryUnavailable) as refused:
    kernel._probe()
  assert "no_ctypes_here" in str(refused.value) and "\n" not in str(refused.value)


def fake_tool(directory, name: str, script: str) -> str:
  path = directory / name
  path.write_text("#!/bin/sh\n" + script)
  path.chmod(0o755)
  return str(path)


def test_bwrap_comes_from_the_system_not_the_trainers_path(tmp_path, monkeypatch):
  fake_tool(tmp_path, "bwrap", "exit 0\n")
  monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '')}")
  found = kernel._install_bwrap()
  assert os.path.dirname(found) in ("/usr/bin", "/bin")


def test_a_hanging_apt_get_stops_at_its_deadline(as_root, tmp_path, monkeypatch):
  """A lock held by another apt, or a mirror that never answers: one line, its processes gone."""
  token = f"{secrets.randbelow(10**6)}.5"
  fake_tool(tmp_path, "apt-get", f"sleep 9{token} &\nwait\n")
  monkeypatch.setattr(kernel, "SYSTEM_PATH", str(tmp_path))
  monkeypatch.setattr(kernel, "APT_TIMEOUT_S", {"update": 0.5, "install": 0.5}, raising=False)
  start = time.monotonic()
  with pytest.raises(sandbox.BoundaryUnavailable) as refused:
    kernel._install_bwrap()
  assert time.monotonic() - start < 5
  assert "apt-get install" in str(refused.value) and "0.5 s" in str(refused.value)
  assert "\n" not in str(refused.value)
  left = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as fh:
        left += [pid] if token.encode() in fh.read() else []
    except OSError:
      pass
  assert left == []
