"""Fused activation quantize-and-record: FP4 codes, block scales and the TRACE record in one pass."""

from pallas_kernels.quantize_record.api import IMPLEMENTATIONS, quantize_and_record

__all__ = ["IMPLEMENTATIONS", "quantize_and_record"]
