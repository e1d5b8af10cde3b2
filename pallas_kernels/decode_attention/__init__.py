"""Decode attention over a KV cache (packed FP4 with block scales, or bf16): GQA, split-K over
the sequence."""

from pallas_kernels.decode_attention.api import IMPLEMENTATIONS, decode_attention

__all__ = ["IMPLEMENTATIONS", "decode_attention"]
