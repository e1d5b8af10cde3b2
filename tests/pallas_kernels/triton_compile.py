"""Compiles kernels written in Triton's own language for a CUDA GPU, on any host: Triton's
front end, its GPU passes, LLVM and ptxas all run without a GPU. Run as a program (its own
process: the test process imports Triton under its interpreter, whose kernels cannot be
compiled), reading a JSON list of calls on stdin, each {"module", "kernel", "signature",
"constexprs", "num_warps", "num_stages"}; prints one line a call, "ok <kernel>" or the error."""

import importlib
import json
import os
import sys


def main():
  os.environ.pop("TRITON_INTERPRET", None)
  os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # what jax-triton compiles with
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import ASTSource
  target = GPUTarget("cuda", 90, 32)  # Hopper, as the engine's GPU
  failed = 0
  for c in json.load(sys.stdin):
    fn = getattr(importlib.import_module(c["module"]), c["kernel"])
    signature = dict(c["signature"])
    signature.update({k: "constexpr" for k in c["constexprs"]})
    constexprs = {(fn.arg_names.index(k),): v for k, v in c["constexprs"].items()}
    try:
      compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=target,
                                options=dict(num_warps=c["num_warps"],
                                             num_stages=c["num_stages"]))
      assert "cubin" in compiled.asm
      print("ok", c["kernel"], flush=True)
    except Exception as e:  # noqa: BLE001 -- reported, the next call compiled all the same
      failed += 1
      print("FAILED", c["kernel"], type(e).__name__, str(e).replace("\n", " | ")[:2000],
            flush=True)
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
