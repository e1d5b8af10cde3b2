"""pyproject.toml's dependencies: trace_jax.quant needs only the base install, and the constraint
files pin versions that satisfy every declared requirement on their Python."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
  PROJECT = tomllib.load(fh)["project"]
EXTRAS = PROJECT["optional-dependencies"]
CONSTRAINTS = {"3.11": "constraints/py311.txt", "3.12": "constraints/py312.txt"}


def names(requirements) -> set[str]:
  return {canonicalize_name(Requirement(r).name) for r in requirements}


def test_the_quantization_library_imports_nothing_the_other_extras_bring():
  """`pip install trace_jax[quant]` gives jax and numpy; the library and its report must run
  on them (where the rest is installed, nothing of it may be imported either)."""
  allowed = names(PROJECT["dependencies"]) | names(EXTRAS["quant"])
  others = set().union(*(names(EXTRAS[e]) for e in EXTRAS)) - allowed
  modules = {m: {canonicalize_name(d) for d in ds}
             for m, ds in importlib.metadata.packages_distributions().items()}
  script = ("import runpy, sys; sys.argv = ['trace_jax.quant', '--help']\n"
            "try: runpy.run_module('trace_jax.quant', run_name='__main__')\n"
            "except SystemExit as e: assert e.code in (0, None), e.code\n"
            "print('\\n' + __import__('json').dumps(sorted(sys.modules)))")
  out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "usage:" in out.stdout
  loaded = {m.split(".")[0] for m in json.loads(out.stdout.splitlines()[-1])}
  brought = {m: modules[m] & others for m in loaded if modules.get(m, set()) & others}
  assert not brought, brought


def pins(path: str) -> dict[str, Version]:
  with open(os.path.join(ROOT, path)) as fh:
    lines = [line.split("#")[0].strip() for line in fh]
  found = [re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)", line) for line in lines if line]
  assert all(found), path
  return {canonicalize_name(m[1]): Version(m[2]) for m in found}


@pytest.mark.parametrize("python", sorted(CONSTRAINTS))
def test_the_constraint_files_pin_what_pyproject_declares(python):
  pinned = pins(CONSTRAINTS[python])
  env = dict(default_environment(), python_version=python, python_full_version=f"{python}.0")
  for extra, requirements in [("", PROJECT["dependencies"]), *EXTRAS.items()]:
    for text in requirements:
      r = Requirement(text)
      if r.marker is not None and not r.marker.evaluate(dict(env, extra=extra)):
        continue
      name = canonicalize_name(r.name)
      assert name in pinned, f"{CONSTRAINTS[python]} pins no {name}: rerun constraints/compile.sh"
      assert r.specifier.contains(pinned[name], prereleases=True), (python, text, pinned[name])
  jax = {"3.11": "0.10.2", "3.12": "0.11.2"}[python]
  assert pinned["jax"] == pinned["jaxlib"] == Version(jax)
  if python == "3.11":  # the CPU machines': torch's CPU build
    assert pinned["torch"] == Version("2.13.0+cpu")
