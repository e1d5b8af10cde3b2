"""FP4 quantization as pure functions: formats, QArray, records and guided rounding."""

from trace_jax.quant.api import (
    QArray,
    Record,
    dequantize,
    element_codes,
    fake_quant,
    guided_codes,
    guided_quant,
    make_record,
    quantize,
    record_bits_per_element,
    storage_bits_per_element,
)
from trace_jax.quant.formats import (
    BF16,
    FORMATS,
    FP8,
    MXFP4,
    MXFP4_CEIL,
    NVFP4,
    NVFP4_TENSOR,
    BlockFormat,
    Format,
    get_format,
    register,
)

__all__ = [
    "BF16", "FORMATS", "FP8", "MXFP4", "MXFP4_CEIL", "NVFP4", "NVFP4_TENSOR", "BlockFormat",
    "Format", "QArray", "Record", "dequantize", "element_codes", "fake_quant", "get_format",
    "guided_codes", "guided_quant",
    "make_record", "quantize", "record_bits_per_element", "register", "storage_bits_per_element",
]
