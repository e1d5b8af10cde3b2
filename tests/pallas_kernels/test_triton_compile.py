"""Every kernel written in Triton's own language compiles for a Hopper GPU, on any host (Triton's
compiler down to a cubin, `triton_compile.py` in a process of its own), for the calls the
wrappers make: the dense and grouped bf16 and FP4 matmuls (MXFP4 and NVFP4, the FP4 decode
from the bits and by PTX), the attention over bf16, MXFP4 and NVFP4
caches (its FP4 decode from the bits and by PTX), and the quantize-and-record kernel with and
without its norm and values. The interpreter the other CPU tests run these kernels in does not
apply the compiler's rules (a module global a kernel reads must be a `tl.constexpr`, for one:
the first GPU run of these kernels stopped there)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import triton_call
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.fp4_matmul import (bf16_matmul, fp4_matmul, grouped_bf16_matmul,
                                       grouped_fp4_matmul)
from pallas_kernels.quantize_record import quantize_and_record
from tests.pallas_kernels.test_decode_attention import inputs
from trace_jax.quant import MXFP4, NVFP4, NVFP4_TENSOR, quantize

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TYPES = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16", "int32": "i32",
          "uint32": "u32", "int8": "i8", "uint8": "u8", "int64": "i64"}


def _signature(kernel, values) -> dict:
  """The kernel's pointer and scalar parameters, as Triton's signature strings."""
  sig = {}
  for name, v in zip(kernel.arg_names, values):
    if isinstance(v, bool):
      sig[name] = "i1"
    elif isinstance(v, int):
      sig[name] = "i32"
    elif isinstance(v, float):
      sig[name] = "fp32"
    else:
      sig[name] = "*" + _TYPES[np.dtype(v.dtype).name]
  return sig


@pytest.fixture
def calls(monkeypatch):
  """The wrappers' calls of `triton_call.call`, recorded (not run): what the compiler gets."""
  recorded = []

  def spy(kernel, *args, out_shape, grid, num_warps=4, num_stages=2, name="", **meta):
    recorded.append({"module": kernel.fn.__module__, "kernel": kernel.fn.__name__,
                     "signature": _signature(kernel, [*args, *out_shape]),
                     "constexprs": {**meta, "INTERPRET": False}, "num_warps": num_warps,
                     "num_stages": num_stages})
    return [jnp.zeros(s.shape, s.dtype) for s in out_shape]

  monkeypatch.setattr(triton_call, "call", spy)
  # the wrappers' choices for a GPU (the FP4 decode by PTX by default); the kernels' modules
  # stay the ones imported under the interpreter, of which the spy reads the source only
  monkeypatch.setattr(triton_call, "interpreted", lambda: False)
  return recorded


def _compile(calls) -> str:
  env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
  out = subprocess.run([sys.executable, "-m", "tests.pallas_kernels.triton_compile"],
                       input=json.dumps(calls), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  return out.stdout


def test_every_kernel_in_triton_language_compiles_for_hopper(calls):
  x = jnp.ones((16, 256), jnp.bfloat16)
  bf16_matmul(x, jnp.ones((256, 128), jnp.bfloat16), implementation="pallas",
              backend="jax_triton", splits=2)
  grouped_bf16_matmul(x, jnp.ones((4, 256, 128), jnp.bfloat16), jnp.asarray([5, 0, 8, 3]),
                      implementation="pallas", backend="jax_triton")
  for fmt, decodes in ((MXFP4, ("asm", "bits")), (NVFP4_TENSOR, ("bits", "asm"))):
    w = quantize(jnp.ones((256, 128)), fmt, axis=0)
    we = jax.vmap(lambda m: quantize(m, fmt, axis=0))(jnp.ones((4, 256, 128)))
    # each format's dense and grouped kernel, each decode once
    fp4_matmul(x, w, implementation="pallas", backend="jax_triton", decode=decodes[0], splits=2)
    grouped_fp4_matmul(x, we, jnp.asarray([5, 0, 8, 3]), implementation="pallas",
                       backend="jax_triton", decode=decodes[1])
  for fmt in (None, MXFP4, NVFP4):  # None: a bf16 cache
    q, k, v, mask = inputs(0, 2, 128, 2, 4, 64, fmt)
    decodes = ("asm", "bits") if fmt else (None,)
    for decode in decodes:
      decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton",
                       block_s=64, decode=decode)
  for fmt, (with_values, with_norm) in (("mxfp4", ((jnp.bfloat16, 2048), (jnp.float32, 96))),
                                        ("nvfp4", ((jnp.float32, 96), (jnp.bfloat16, 2048)))):
    x = jnp.ones((5, with_values[1]), with_values[0])
    quantize_and_record(x, fmt, implementation="pallas", backend="jax_triton", values=True)
    x = jnp.ones((5, with_norm[1]), with_norm[0])
    quantize_and_record(x, fmt, implementation="pallas", backend="jax_triton",
                        rms_norm=(jnp.ones(x.shape[-1:], x.dtype), 1e-6), normed=True)
  names = [c["kernel"] for c in calls]
  assert set(names) == {"bf16_matmul", "fp4_matmul", "bf16_attention", "fp4_attention",
                        "quantize_record"}
  assert sum(n == "fp4_attention" for n in names) == 4
  assert sum(n == "fp4_matmul" for n in names) == 4
  out = _compile(calls)
  assert out.count("ok ") == len(calls), out


def test_the_compile_check_sees_what_the_interpreter_does_not(calls, tmp_path, monkeypatch):
  """A kernel reading a module global that is not a tl.constexpr runs in the interpreter but
  does not compile: the check above would catch it."""
  (tmp_path / "bad_kernel.py").write_text(
      "import triton\nimport triton.language as tl\nSCALE = 2.0\n\n\n@triton.jit\n"
      "def scale(x_ptr, o_ptr, N: tl.constexpr, INTERPRET: tl.constexpr):\n"
      "  i = tl.arange(0, N)\n  tl.store(o_ptr + i, tl.load(x_ptr + i) * SCALE)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
  bad = triton_call.load("bad_kernel")
  x = jnp.arange(16, dtype=jnp.float32)
  triton_call.call(bad.scale, x, out_shape=[jax.ShapeDtypeStruct((16,), jnp.float32)],
                   grid=(1,), N=16)
  with pytest.raises(AssertionError, match="FAILED scale .*Cannot access global variable SCALE"):
    _compile(calls)
