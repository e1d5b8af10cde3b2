"""`python -m trace_jax.quant`: the quantization report."""

from trace_jax.quant.report import main

if __name__ == "__main__":
  main()
