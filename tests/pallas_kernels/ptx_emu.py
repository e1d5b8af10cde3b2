"""A small interpreter of the few PTX instructions the kernels' inline asm uses, so that CPU tests
check the asm strings themselves bit for bit (mov, shl, shr, and, or, prmt, fma.rn.bf16x2,
mul.rn.f32, cvt.rn.bf16x2.f32, lop3.b32)."""

from __future__ import annotations

import numpy as np


def bf16_bits_to_f32(h: int) -> np.float32:
  return np.array([h << 16], np.uint32).view(np.float32)[0]


def f32_bits(f: np.float32) -> int:
  return int(np.array([f], np.float32).view(np.uint32)[0])


def bits_f32(b: int) -> np.float32:
  return np.array([b], np.uint32).view(np.float32)[0]


def f32_to_bf16_bits(f: np.float32) -> int:
  """Round to nearest even (subnormals kept, overflow to Inf); NaN gives the canonical NaN."""
  if np.isnan(f):
    return 0x7FFF
  b = f32_bits(f)
  return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def run(asm: str, n_out: int, inputs: list[int]) -> list[int]:
  """Runs `asm` with $0..$(n_out-1) as outputs and the 32-bit `inputs` as the next operands."""
  values = {f"${n_out + i}": v & 0xFFFFFFFF for i, v in enumerate(inputs)}
  regs: dict[str, int] = {}

  def get(x):
    if x.startswith("$"):
      return values[x]
    return regs[x] if x in regs else int(x, 0)

  def put(x, v):
    (values if x.startswith("$") else regs)[x] = v & 0xFFFFFFFF

  for stmt in asm.replace("{", "").replace("}", "").split(";"):
    stmt = stmt.strip()
    if not stmt or stmt.startswith(".reg"):
      continue
    op, rest = stmt.split(None, 1)
    a = [x.strip() for x in rest.split(",")]
    if op == "mov.b32":
      put(a[0], get(a[1]))
    elif op == "shl.b32":
      put(a[0], get(a[1]) << get(a[2]))
    elif op == "shr.b32":
      put(a[0], get(a[1]) >> get(a[2]))
    elif op == "and.b32":
      put(a[0], get(a[1]) & get(a[2]))
    elif op == "or.b32":
      put(a[0], get(a[1]) | get(a[2]))
    elif op == "lop3.b32":  # bit i of the result: bit (a_i b_i c_i as a 3-bit number) of lut
      x, y, z, lut, r = get(a[1]), get(a[2]), get(a[3]), get(a[4]), 0
      for i in range(32):
        r |= ((lut >> ((x >> i & 1) << 2 | (y >> i & 1) << 1 | (z >> i & 1))) & 1) << i
      put(a[0], r)
    elif op == "prmt.b32":  # default mode: each selector nibble picks a byte of {b, a}
      src, sel, r = get(a[1]) | (get(a[2]) << 32), get(a[3]), 0
      for i in range(4):
        r |= ((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)
      put(a[0], r)
    elif op == "fma.rn.bf16x2":  # exact product and sum, one rounding to bf16
      x, y, z, r = get(a[1]), get(a[2]), get(a[3]), 0
      for h in range(2):
        f = lambda v: np.float64(bf16_bits_to_f32((v >> (16 * h)) & 0xFFFF))
        r |= f32_to_bf16_bits(np.float32(f(x) * f(y) + f(z))) << (16 * h)
      put(a[0], r)
    elif op == "mul.rn.f32":  # IEEE float32 product, round to nearest even, no flush
      with np.errstate(all="ignore"):
        put(a[0], f32_bits(np.float32(bits_f32(get(a[1])) * bits_f32(get(a[2])))))
    elif op == "cvt.rn.bf16x2.f32":  # the first source to the upper half
      put(a[0], f32_to_bf16_bits(bits_f32(get(a[1]))) << 16
          | f32_to_bf16_bits(bits_f32(get(a[2]))))
    else:
      raise ValueError(f"the emulator does not know {op!r}")
  return [values[f"${i}"] for i in range(n_out)]
