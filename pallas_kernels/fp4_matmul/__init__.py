"""FP4 (MXFP4 / NVFP4) weight matmul, its grouped (MoE expert) form, and their bf16 twins."""

from pallas_kernels.fp4_matmul.api import (IMPLEMENTATIONS, bf16_matmul, fp4_matmul,
                                           grouped_bf16_matmul, grouped_fp4_matmul)

__all__ = ["IMPLEMENTATIONS", "bf16_matmul", "fp4_matmul", "grouped_bf16_matmul",
           "grouped_fp4_matmul"]
