"""FP4 (MXFP4 / NVFP4) weight matmul and its bf16 twin."""

from pallas_kernels.fp4_matmul.api import IMPLEMENTATIONS, bf16_matmul, fp4_matmul

__all__ = ["IMPLEMENTATIONS", "bf16_matmul", "fp4_matmul"]
