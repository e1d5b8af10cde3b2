"""Safetensors files as memory-mapped numpy views: nothing is read until a slice is asked for.

The `safetensors` package's numpy reader has no bfloat16 and its other frameworks copy each
tensor whole onto a device; a loader that places each device's slice of a 30B-parameter
checkpoint needs the raw bytes instead. The format is an 8-byte little-endian header length, a
JSON header ({name: {dtype, shape, data_offsets}}, data_offsets relative to the end of the
header) and the tensors' little-endian bytes.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"), "U16": np.dtype("<u2"), "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"), "I64": np.dtype("<i8"), "U64": np.dtype("<u8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


def read_header(path: str) -> tuple[dict, int]:
  """-> ({name: {dtype, shape, data_offsets}}, the byte offset where the data starts)."""
  size = os.path.getsize(path)
  with open(path, "rb") as fh:
    raw = fh.read(8)
    if len(raw) < 8:
      raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > size - 8:
      raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes)")
    try:
      header = json.loads(fh.read(n))
    except ValueError as e:
      raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
  header.pop("__metadata__", None)
  return header, 8 + n


def open_mmap(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a .safetensors file as a read-only view of one memory map of it."""
  header, start = read_header(path)
  size = os.path.getsize(path)
  data = (np.memmap(path, dtype=np.uint8, mode="r", offset=start) if size > start
          else np.zeros((0,), np.uint8))
  out = {}
  for name, info in header.items():
    if info["dtype"] not in DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which this reader "
                       f"does not know (it reads {sorted(DTYPES)})")
    dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
    lo, hi = info["data_offsets"]
    if hi - lo != dtype.itemsize * int(np.prod(shape)) or hi > data.size:
      raise ValueError(f"{path}: tensor {name!r} ({info['dtype']} {list(shape)}) has data "
                       f"offsets {lo}..{hi}, which do not fit its size or the file")
    out[name] = data[lo:hi].view(dtype).reshape(shape)
  return out
