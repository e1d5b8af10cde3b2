"""Decode attention over a KV cache (packed FP4 with block scales, or bf16): GQA, split-K over
the sequence; Triton (`kernel.py`, Pallas' lowering; over bf16 caches also `triton_kernel.py`, in
Triton's own language) and Mosaic GPU (`mosaic.py`) backends."""

from pallas_kernels.decode_attention.api import BACKENDS, IMPLEMENTATIONS, decode_attention

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "decode_attention"]
