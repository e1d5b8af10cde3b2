"""Importing trace_jax has no surprises: it says when its XLA flag comes too late, and chooses no
matplotlib backend for the program that imports it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, **env) -> subprocess.CompletedProcess:
  environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        env={**environ, "JAX_PLATFORMS": "cpu", **env}, timeout=120)


def test_excess_precision_flag_set_before_jax_starts():
  out = _python("import trace_jax, os, jax; jax.devices(); print(os.environ['XLA_FLAGS'])")
  assert out.returncode == 0, out.stderr
  assert "--xla_allow_excess_precision=false" in out.stdout
  assert "cannot take effect" not in out.stderr


def test_warns_when_jax_has_started_its_backends():
  out = _python("import jax; jax.devices(); import trace_jax")
  assert out.returncode == 0, out.stderr
  assert "xla_allow_excess_precision" in out.stderr and "cannot take effect" in out.stderr
  assert "xla_cpu_enable_platform_dependent_math" in out.stderr
  # with the flag already in XLA_FLAGS there is nothing to warn about
  out = _python("import jax; jax.devices(); import trace_jax",
                XLA_FLAGS="--xla_allow_excess_precision=false "
                          "--xla_cpu_enable_platform_dependent_math=false")
  assert out.returncode == 0 and "cannot take effect" not in out.stderr, out.stderr


def test_plots_choose_no_matplotlib_backend(tmp_path):
  out = _python("import matplotlib, trace_jax.rl.plots as p; print(matplotlib.get_backend())",
                MPLBACKEND="svg")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip().lower() == "svg"
