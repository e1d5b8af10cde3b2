"""Importing trace_jax hands XLA the flags that keep its numbers independent of shapes and CPUs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a bf16 dot as the model computes it, compiled with XLA's module options dumped
PROGRAM = """
import sys
import trace_jax
import jax
import jax.numpy as jnp
x = jnp.ones((8, 64), jnp.bfloat16)
jax.jit(lambda x: jnp.dot(x, x.T, preferred_element_type=jnp.float32))(x).block_until_ready()
"""


def compiled_options(tmp_path, xla_flags: str) -> str:
  """The non-default XLA options of the dot's module, as XLA itself reports them."""
  dump = tmp_path / "dump"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = f"{xla_flags} --xla_dump_to={dump}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  (options,) = [p for p in dump.glob("*.debug_options") if "lambda" in p.name]
  return options.read_text()


def test_import_asks_xla_for_consistent_cpu_math_and_no_excess_precision(tmp_path):
  """Without platform-dependent math XLA's CPU backend asks YNNPACK, which runs its bf16 dots,
  for the kernels it keeps numerically consistent with one another: on CPUs with AMX-BF16 its
  cost model otherwise gives some dot shapes AMX kernels, which round otherwise than its AVX-512
  ones, and the rollout on 8 devices, or on the Pallas kernels' tiles, parts from one device by
  rounding (tests/test_sharding.py, tests/rl/test_rollout.py)."""
  options = compiled_options(tmp_path, "")
  assert "xla_cpu_enable_platform_dependent_math: false" in options, options
  assert "xla_allow_excess_precision: false" in options, options


def test_a_flag_the_user_set_is_left_as_set(tmp_path):
  options = compiled_options(tmp_path, "--xla_cpu_enable_platform_dependent_math=true")
  assert "xla_cpu_enable_platform_dependent_math" not in options, options  # XLA's default
  assert "xla_allow_excess_precision: false" in options, options
