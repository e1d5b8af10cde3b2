"""The rollout engine's kernel backend: `make_ops(kernels, attention_kernel)` -> the ops object
the rollout path computes with (`trace_jax.models.ops`): XLA's ("xla"), or `KernelOps`
("pallas"), whose projections, expert matmuls, one-token attention and FP4 quantization run
the Pallas kernels of `pallas_kernels` where they take the formats and sizes, and XLA's
elsewhere. The choices and the thresholds measured on the H200 live here, with the kernels.

Both compute the same numbers up to the order of float32 sums: the kernels decode each FP4 value
to the bf16 that XLA's dequantization gives (NVFP4's global folded into each block scale in
float32 before the rounding to bf16). Attention past one of its kernel's blocks also rounds
differently: the kernel's online softmax takes each block's probabilities to bf16 against a
running max, XLA's flash-decoding against its chunk's. The kernels take MXFP4 and NVFP4 weights
and caches, and bf16 ones (the project's bf16 kernels, so that a BF16 rollout is measured on
kernels of the same design); MXFP4 and NVFP4 activations and K/V are quantized, with their
records, by the fused quantize-and-record kernel (bit for bit the quant core's codes and
records); other formats (fp8), and sizes the kernels' tiles do not fit, stay on XLA.

Which kernel runs, as measured on the H200 (BENCHMARKS.md): FP4 weights packed for the kernels
(`weight_layout`, applied by the weight sync `pack_weights(..., ops=KernelOps())`) run the
Mosaic GPU kernels, which take them pre-tiled; weights packed plainly run the Triton ones, as do
bf16 weights (below BF16_XLA_FROM tokens; XLA's dot from there on; bf16 experts always),
the attention over bf16 and NVFP4 caches, the quantization of activations and K/V and, off
Hopper, everything (the weight sync then leaves FP4 weights untiled, and the attention is
Triton's). The attention over MXFP4 caches runs the Mosaic kernel on Hopper (in splits of at
most MOSAIC_SPLIT_SLOTS slots, so that a partly filled cache is read about as far as it is
filled): in rollouts over a half-full cache it took 0.89x / 0.84x the Triton kernel's time at
batch 64 / 256, while on bf16 caches it is the slower one, and on NVFP4 ones it was in the
rollout of 2026-12-01 (0.81x / 0.90x the Triton rows' throughput). Since V^T comes from
registers (head_dim a multiple of 128) the Mosaic NVFP4 kernel takes 0.87-0.91x the Triton
kernel's time on full caches (8K-32K, BENCHMARKS.md "V^T from registers too"), and the NVFP4
rollout on it decodes 1.08x / 1.04x / 1.11x the tokens per second of the rollout on the Triton
one at batch 16 / 64 / 256 (2026-12-04, "NVFP4 attention in the rollout"): "auto" runs it for
NVFP4 caches of those head dims and Triton for the others. That is `attention_kernel` "auto";
"triton" or "mosaic" ask for one backend. `triton_backend` "jax_triton" runs the bf16 Triton
matmuls (dense and grouped), the Triton FP4 matmuls (off Hopper), the Triton attention (every
cache format) and the quantize-and-record kernel as the same programs written in Triton's own
language, through jax-triton (`pallas_kernels.triton_call`), Pallas' Triton lowering being
deprecated from jax 0.11; "pallas" (the default) on that lowering.
On a backend other than GPU the Triton kernels run in Pallas' interpret mode (tiled weights
taken back first): slow, for tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.decode_attention import mosaic as mosaic_attention
from pallas_kernels.decode_attention.api import supports as supports_attention
from pallas_kernels.decode_attention.cache import cache_format, default_splits
from pallas_kernels.fp4_matmul import (bf16_matmul, fp4_matmul, grouped_bf16_matmul,
                                       grouped_fp4_matmul)
from pallas_kernels.fp4_matmul import mosaic, w4a4
from pallas_kernels.fp4_matmul import w4a4_layout
from pallas_kernels.fp4_matmul.layout import FORMATS as FP4_WEIGHT_FORMATS
from pallas_kernels.fp4_matmul.layout import ORDERS as FP4_ORDERS
from pallas_kernels.fp4_matmul.layout import TiledFP4, tile, untile
from pallas_kernels.quantize_record import quantize_and_record
from pallas_kernels.quantize_record.reference import FORMATS as _RECORD_FORMATS
from trace_jax.models.ops import XLA, XlaOps
from trace_jax.quant import QArray, Record
from trace_jax.quant.formats import Format

KERNELS = ("xla", "pallas", "tokamax")
FP4_ORDER = "halves"  # the engine's nibble order (measured faster on the H200, BENCHMARKS.md)
# the projections of one input the kernels' weight sync packs as one weight (`KernelOps.fuse`)
FUSED = (("wq", "wk", "wv"), ("w_gate", "w_up"))
ATTENTION_KERNELS = ("auto", "triton", "mosaic")  # the decode attention's, under "pallas"
# how the Triton kernels that exist in Triton's own language (the bf16 and FP4 matmuls, dense and
# grouped, the attention over any cache, quantize-and-record) are called: Pallas' Triton lowering, or those programs through
# jax-triton (`pallas_kernels.triton_call`; Pallas' Triton lowering is deprecated from jax 0.11)
TRITON_BACKENDS = ("pallas", "jax_triton")
MOSAIC_ATTENTION_FORMATS = ("mxfp4",)  # the caches "auto" gives the Mosaic kernel (measured),
# besides NVFP4 ones whose V it takes from registers (`mosaic_attention.v_in_registers`)
_FP4_WEIGHTS = FP4_WEIGHT_FORMATS  # what the FP4 matmul kernels, Triton and Mosaic, take
_FP4_CACHES = ("mxfp4", "nvfp4")


def make_ops(kernels: str = "xla", attention_kernel: str = "auto", act_dtype=jnp.bfloat16,
             w4a4: bool = False, fp4_order: str = FP4_ORDER, fuse: bool = True,
             fold_scales: bool = False, attention_blocks: int = 1,
             triton_backend: str = "pallas"):
  """The rollout path's ops for `kernels` ("xla" | "pallas" | "tokamax": `TokamaxOps`, a bf16
  baseline on that package's kernels) and, under "pallas", the decode attention's backend
  ("auto" | "triton" | "mosaic"); act_dtype: the model's activations (the kernels take bf16).
  `w4a4`: MXFP4 projections and experts whose input the recipe quantizes to MXFP4 run the W4A4
  kernels (`KernelOps`). `fp4_order`: the nibble order the weight sync tiles FP4 weights in for
  the Mosaic matmuls (`layout.ORDERS`: "halves", the default, takes x as it is; "pairs" its even
  and odd K columns transposed). `fuse`: the weight sync packs the projections of one input
  as one weight (`KernelOps.fuse`), or with False each apart. `fold_scales`: the Mosaic
  kernels decode MXFP4 weights and caches with each block's scale folded into one multiply a
  pair of values (the same outputs, for caches whose block scales lie within 2^-60 to 2^66:
  `mosaic_attention.FOLD_REF`; 1-2% faster attention, no change in the 48-layer rollout on an
  H100: BENCHMARKS.md). `attention_blocks`: 64-slot blocks a pipeline step of the Mosaic
  attention over FP4 caches (`mosaic_attention.BLOCKS`; 2 is correct and takes 1.04-1.14x the time
  of 1 in 11 of 12 shapes on an H100: BENCHMARKS.md). `triton_backend`: how the Triton
  kernels are called (`TRITON_BACKENDS`)."""
  if kernels not in KERNELS:
    raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
  if fp4_order not in FP4_ORDERS:
    raise ValueError(f"fp4_order must be one of {FP4_ORDERS}, got {fp4_order!r}")
  if attention_kernel not in ATTENTION_KERNELS:
    raise ValueError(f"attention_kernel must be one of {ATTENTION_KERNELS}, got "
                     f"{attention_kernel!r}")
  if triton_backend not in TRITON_BACKENDS:
    raise ValueError(f"triton_backend must be one of {TRITON_BACKENDS}, got {triton_backend!r}")
  if attention_blocks not in mosaic_attention.BLOCKS:
    raise ValueError(f"attention_blocks must be one of {mosaic_attention.BLOCKS}, got "
                     f"{attention_blocks!r}")
  pallas_only = [name for name, asked in (
      ("w4a4", w4a4), ("fold_scales", fold_scales), ("attention_blocks > 1", attention_blocks > 1),
      (f"triton_backend={triton_backend!r}", triton_backend != "pallas")) if asked]
  if kernels != "pallas" and pallas_only:
    raise ValueError(f"{pallas_only[0]} runs the Pallas kernels: it needs kernels='pallas'")
  if kernels == "xla":
    return XLA
  if kernels == "tokamax":
    return TokamaxOps()
  if jnp.dtype(act_dtype) != jnp.bfloat16:
    raise ValueError(f"the pallas kernels take bf16 activations; the model's dtype is "
                     f"{jnp.dtype(act_dtype).name}")
  if w4a4 and jax.default_backend() == "gpu" and not mosaic.available():
    raise ValueError("w4a4 needs Hopper's FP8 wgmma (the Mosaic GPU kernels); this GPU has none")
  return KernelOps(attention_kernel, w4a4=w4a4, fp4_order=fp4_order,
                   fuse=FUSED if fuse else (), fold_scales=fold_scales,
                   attention_blocks=attention_blocks, triton_backend=triton_backend)


def _interpret() -> bool:
  return jax.default_backend() != "gpu"


def _divisor(n: int, choices: tuple[int, ...]) -> int | None:
  return next((c for c in choices if n % c == 0), None)


def _fp4_tiles(w: QArray | TiledFP4) -> dict | None:
  """Triton tiles for a [K, N] (or K-major [N, K], or tiled) FP4 weight, or None where none
  fits."""
  k, n = w.shape[-2:][::-1] if getattr(w, "axis", -2) == -1 else w.shape[-2:]
  tiles = dict(block_n=_divisor(n, (64, 32, 16)), rows=_divisor(k // 2, (32, 16)))
  return None if None in tiles.values() or k % 2 else tiles


def _bf16_tiles(w: jax.Array) -> dict | None:
  k, n = w.shape[-2:]
  tiles = dict(block_n=_divisor(n, (128, 64, 32, 16)), block_k=_divisor(k, (64, 32, 16)))
  return None if None in tiles.values() else tiles


def _tiles(w) -> dict | None:
  """The tiles the Triton kernels take w with, or None where they take no such weight (other
  formats, or sizes no tile divides): then XLA computes it."""
  if isinstance(w, TiledFP4):
    return _fp4_tiles(w)
  if isinstance(w, QArray):
    return _fp4_tiles(w) if w.fmt.name in _FP4_WEIGHTS else None
  return _bf16_tiles(w)


def _weight_layout(w, order: str = FP4_ORDER):
  """A rollout weight in the layout its kernel reads: MXFP4 / NVFP4 projections the Mosaic GPU
  kernels take (N and K multiples of 64) tiled for them (`TiledFP4`, the same bytes permuted);
  anything else as it is. On a GPU without those kernels (not Hopper) nothing is tiled: the
  Triton kernels there would take every tiled weight back each step. (Other backends tile, so
  that the interpret-mode tests run the layout.) `order`: the tiles' nibble order."""
  if jax.default_backend() == "gpu" and not mosaic.available():
    return w
  if (isinstance(w, QArray) and w.fmt.name in _FP4_WEIGHTS and w.axis == -2
      and w.shape[-1] % 64 == 0 and w.shape[-2] % 64 == 0):
    return tile(w, order)
  return w


# from this many tokens a bf16 projection goes to XLA's dot: on the H200 the Triton bf16 kernel
# (16-row tiles) took 78.7 / 251 us at 64 / 256 tokens on 4096 x 14336, XLA 37.2 / 51.1
BF16_XLA_FROM = 64


def _folds(w, fold: bool) -> dict:
  """The FP4 matmuls' `fold` argument for w, a weight in the Mosaic layout (`api` passes it on
  for MXFP4 ones only), else none."""
  return {"fold": True} if fold and isinstance(w, TiledFP4) else {}


def _triton_call(triton_backend: str) -> dict:
  """How a Triton kernel that exists in Triton's own language is called: Pallas' lowering
  (interpret mode off a GPU) or, with "jax_triton", that language (its interpreter off a GPU)."""
  if triton_backend == "jax_triton":
    return {"backend": "jax_triton"}
  return {"interpret": _interpret()}


def _linear(x: jax.Array, w, fold: bool = False,
            triton_backend: str = "pallas") -> jax.Array | None:
  """x [..., K] @ w [K, N] by a kernel, or None where no kernel takes w (or, for bf16 weights
  from BF16_XLA_FROM tokens on, where XLA's dot is the faster one). `fold`: MXFP4's scales
  folded in the Mosaic kernel (the same outputs); `triton_backend`: the bf16 kernel's
  (`TRITON_BACKENDS`)."""
  tiles = _tiles(w)
  if tiles is None or isinstance(w, jax.Array) and x.size // x.shape[-1] >= BF16_XLA_FROM:
    return None
  if isinstance(w, jax.Array):
    return bf16_matmul(x, w, implementation="pallas", **tiles, **_triton_call(triton_backend))
  return fp4_matmul(x, w, implementation="pallas", **tiles, **_folds(w, fold),
                    **_triton_call(triton_backend))


def _experts(x_RxD: jax.Array, w, rows, fold: bool = False,
             triton_backend: str = "pallas") -> jax.Array | None:
  """x's rows through their experts' w [E, K, N] (`rows`: the model's `ExpertRows`, whose
  gathers the kernel's wrapper composes with its own) by a kernel, or None. `fold` and
  `triton_backend` as in `_linear`."""
  tiles = _tiles(w)
  if tiles is None:
    return None
  args = (x_RxD, w, rows.group_sizes, rows.src, rows.back, rows.slots)
  if isinstance(w, jax.Array):
    return grouped_bf16_matmul(*args, implementation="pallas", **tiles,
                               **_triton_call(triton_backend))
  return grouped_fp4_matmul(*args, implementation="pallas", **tiles, **_folds(w, fold),
                            **_triton_call(triton_backend))


def _quantize(x: jax.Array, fmt: Format, values: bool = False, rms_norm=None,
              triton_backend: str = "pallas"):
  """x quantized along its last axis (an activation or a K/V site) and its record, by the fused
  quantize-and-record kernel, or None where the kernel takes no such format or size; the same
  codes, scales and record bits as `quant.quantize` and `quant.make_record`, and with `values`
  the values `quant.dequantize` gives them, in x's dtype, written by the same kernel. With
  `rms_norm` (w, eps) the kernel quantizes x's RMSNorm, which it computes and returns too (the
  model's norm before the attention and the experts: no pass of its own). `triton_backend` as
  in `_linear`."""
  if fmt.name not in _RECORD_FORMATS or x.shape[-1] % fmt.block_size:
    return None
  return quantize_and_record(x, fmt.name, implementation="pallas", values=values,
                             rms_norm=rms_norm, normed=rms_norm is not None,
                             **_triton_call(triton_backend))


# the Mosaic attention skips only whole splits past a sequence's end: splits of at most this
# many slots, so that a half-filled cache is read about half (more splits, more partial
# results to combine: [splits, B, Kv, Dh, 16] float32 out and back)
MOSAIC_SPLIT_SLOTS = 1024


def _mosaic_splits(programs: int, blocks: int, block_s: int) -> int:
  """The splits of the Mosaic attention: the occupancy's (`default_splits`), raised to the
  fewest dividing the blocks (its pipeline steps, of block_s slots each) with at most
  MOSAIC_SPLIT_SLOTS slots each."""
  least = max(default_splits(programs, blocks), -(-blocks * block_s // MOSAIC_SPLIT_SLOTS))
  return next(n for n in range(least, blocks + 1) if blocks % n == 0)


def _mosaic_attention_runs() -> bool:
  return mosaic.available()  # the Mosaic kernels' GPU: Hopper


def _attention(q_BxHxDh: jax.Array, k, v, mask_BxS: jax.Array, backend: str = "auto",
               fold: bool = False, blocks: int = 1,
               triton_backend: str = "pallas") -> jax.Array | None:
  """One query per sequence against the whole cache by the kernel, or None where no kernel
  takes the cache (its format, or sizes the kernel's power-of-two tiles do not fit).
  `backend` "mosaic" runs the Mosaic GPU kernel where it compiles (Hopper) and takes the
  sizes, in splits of at most MOSAIC_SPLIT_SLOTS slots (`fold`: MXFP4's scales folded, the
  same outputs; `blocks`: 64-slot blocks a pipeline step for FP4 caches whose slots they
  divide, one otherwise); elsewhere the Triton one runs, called as `triton_backend` says
  (`TRITON_BACKENDS`). "auto" is "mosaic" for the formats of
  MOSAIC_ATTENTION_FORMATS and for NVFP4 caches whose V the Mosaic kernel takes from
  registers, else "triton"."""
  if isinstance(k, QArray) and k.fmt.name not in _FP4_CACHES:
    return None
  fmt = cache_format(k)
  b, slots, kv, head_dim = k.shape
  if backend == "auto":
    faster = fmt in MOSAIC_ATTENTION_FORMATS or (
        fmt == "nvfp4" and mosaic_attention.v_in_registers(fmt, head_dim))
    backend = "mosaic" if faster else "triton"
  if backend == "mosaic" and _mosaic_attention_runs() and mosaic_attention.supports(
      kv, head_dim, q_BxHxDh.shape[1] // kv, fmt, slots):
    span = mosaic_attention.BLOCK_S * blocks
    if fmt == "bf16" or slots % span:
      blocks, span = 1, mosaic_attention.BLOCK_S
    steps = slots // span
    return decode_attention(q_BxHxDh, k, v, mask_BxS, implementation="pallas", backend="mosaic",
                            splits=_mosaic_splits(b * kv, steps, span), fold=fold, blocks=blocks)
  block_s = _divisor(slots, (64, 32, 16))
  if block_s is None or not supports_attention(slots, head_dim, block_s):
    return None
  return decode_attention(q_BxHxDh, k, v, mask_BxS, implementation="pallas", block_s=block_s,
                          **_triton_call(triton_backend))


def _w4a4_weight_layout(w, order: str = FP4_ORDER):
  """With W4A4: MXFP4 projections and experts ([K, N] or [E, K, N] quantized along K, N and K
  multiples of 64) in the W4A4 kernels' layout (`w4a4_layout.TiledW4`); others as
  `_weight_layout` lays them out."""
  if (isinstance(w, QArray) and w.fmt.name == "mxfp4" and w.axis == -2
      and w.shape[-1] % w4a4_layout.ROWS == 0 and w.shape[-2] % w4a4_layout.CHUNK_K == 0):
    return w4a4_layout.tile(w)
  return _weight_layout(w, order)


def _rows(xq: QArray) -> QArray:
  """An activation QArray [..., K] quantized along K as [M, K]."""
  k2, nb = xq.codes.shape[-1], xq.scales.shape[-1]
  return QArray(xq.codes.reshape(-1, k2), xq.scales.reshape(-1, nb), None, xq.fmt, -1)


def _takes_w4a4(xq) -> bool:
  return isinstance(xq, QArray) and xq.fmt.name == "mxfp4" and xq.axis in (-1, xq.codes.ndim - 1)


def _w4a4_linear(x, w: w4a4_layout.TiledW4, xq) -> jax.Array | None:
  """x [..., K] (whose MXFP4 QArray is xq) @ w on the W4A4 kernel (compiled Hopper; its
  arithmetic by XLA elsewhere, `w4a4.emulated_matmul`); None without xq."""
  if not _takes_w4a4(xq):
    return None
  matmul = w4a4.emulated_matmul if _interpret() else w4a4.w4a4_matmul
  return matmul(_rows(xq), w).reshape(*x.shape[:-1], w.shape[-1])


def _w4a4_experts(x_RxD, w: w4a4_layout.TiledW4, rows, xq) -> jax.Array | None:
  if not _takes_w4a4(xq):
    return None
  matmul = w4a4.emulated_grouped_matmul if _interpret() else w4a4.grouped_w4a4_matmul
  return matmul(_rows(xq), w, rows.group_sizes, rows_in=rows.src, rows_out=rows.back,
                slots=rows.slots)


class KernelOps(XlaOps):
  """The Pallas kernels where they take the formats and sizes (`_linear`, `_experts`,
  `_attention`, `_quantize` say which), XLA elsewhere; weights laid out for them by the weight
  sync (`_weight_layout`).

  `w4a4`: MXFP4 weights are laid out for the W4A4 (FP8 tensor core) kernels instead, which take
  the activation as the rollout's MXFP4 QArray (codes and scales, never a bf16 copy): the
  projections and experts of layers whose recipe quantizes both operands to MXFP4. A matmul
  handed no such activation (its site left in bf16) is XLA's, on the weight dequantized.
  `activation_stats` counts the blocks of each activation the kernel's E4M3 fold cannot hold
  (`w4a4.fold_misses`: such a call takes the kernel's exact branch), the engine's
  "w4a4_fold_misses".

  `fold_scales`: the Mosaic matmuls and attention decode MXFP4 with each block's scale folded
  with the decode's 2^126 (one bf16x2 multiply a pair of values, not two) against a reference
  (the weight's `layout.fold_reference`, the attention's `FOLD_REF`) that they multiply back
  once; the same outputs (BENCHMARKS.md, "Where the MXFP4 attention waits").
  `attention_blocks`: the Mosaic attention's 64-slot blocks a pipeline step over FP4 caches.

  `fp4_order`: the nibble order of the FP4 weights it tiles for the Mosaic matmuls
  (`layout.ORDERS`); the kernels read each weight's own, so weights tiled either way run.

  `fuse`: the groups of projections of one input the weight sync packs side by side as one
  weight (`rollout_path.Fused`) where their packing allows (not NVFP4's per-matrix globals):
  by default (`FUSED`) wq, wk and wv, whose matmul at decode is one kernel launch and one sum
  of its split partials where there were three, and the experts' w_gate and w_up, one grouped
  launch (one read of the dispatched rows) where there were two. `()` packs each apart.

  `triton_backend`: how the Triton kernels that exist in Triton's own language are called
  (`TRITON_BACKENDS`)."""

  name = "pallas"

  def __init__(self, attention_kernel: str = "auto", w4a4: bool = False,
               fp4_order: str = FP4_ORDER, fuse: tuple[tuple[str, ...], ...] = FUSED,
               fold_scales: bool = False, attention_blocks: int = 1,
               triton_backend: str = "pallas"):
    self.attention_kernel = attention_kernel
    self.triton_backend = triton_backend
    self.w4a4 = w4a4
    self.fold_scales = fold_scales
    self.attention_blocks = attention_blocks
    self.fp4_order = fp4_order
    self.fuse = tuple(tuple(group) for group in fuse)

  def weight_layout(self, w):
    if self.w4a4:
      return _w4a4_weight_layout(w, self.fp4_order)
    return _weight_layout(w, self.fp4_order)

  def dense(self, w) -> jax.Array:
    if isinstance(w, w4a4_layout.TiledW4):
      return super().dense(w4a4_layout.untile(w))
    return super().dense(untile(w) if isinstance(w, TiledFP4) else w)

  def linear(self, x, w, xq=None):
    if isinstance(w, w4a4_layout.TiledW4):
      return _w4a4_linear(x, w, xq)
    return _linear(x, w, self.fold_scales, self.triton_backend)

  def experts(self, x_RxD, w, rows, xq=None):
    if isinstance(w, w4a4_layout.TiledW4):
      return _w4a4_experts(x_RxD, w, rows, xq)
    return _experts(x_RxD, w, rows, self.fold_scales, self.triton_backend)

  def activation_stats(self, xq) -> dict:
    if not (self.w4a4 and _takes_w4a4(xq)):
      return {}
    return {"w4a4_fold_misses": w4a4.fold_misses(_rows(xq))}

  def attention(self, q_BxHxDh, k, v, mask_BxS):
    return _attention(q_BxHxDh, k, v, mask_BxS, backend=self.attention_kernel,
                      fold=self.fold_scales, blocks=self.attention_blocks,
                      triton_backend=self.triton_backend)

  def quantize(self, x, fmt, values: bool = False, rms_norm=None):
    return _quantize(x, fmt, values, rms_norm, self.triton_backend)


class TokamaxOps(XlaOps):
  """A bf16 rollout on tokamax's kernels (`pip install tokamax`, not a dependency of this
  project: the benchmarks' other bf16 engine): the experts by `tokamax.ragged_dot`, the decode
  attention over bf16 caches by `tokamax.dot_product_attention`, in `implementation` (None:
  tokamax's own order, its Mosaic GPU kernels first, then Triton, then XLA; the first that
  takes the call). On jax 0.11.2 neither of tokamax 0.0.12's GPU kernels runs (H100,
  2026-12-05: the Mosaic GPU ragged_dot stops on a TypeError in jax's Mosaic GPU core, the
  Triton one on `pl.dot`, which jax 0.11 removed), so this engine needs a tokamax and jax that
  agree. The dense projections are XLA's dot, FP4 weights and caches XLA's path."""

  name = "tokamax"

  def __init__(self, implementation: tuple[str, ...] | None = None):
    self.implementation = implementation
    try:
      import tokamax
    except ImportError as e:
      raise ValueError("kernels='tokamax' needs the tokamax package (pip install tokamax), "
                       f"which is not installed: {e}") from None
    from absl import flags
    if not flags.FLAGS.is_parsed():  # its config reads absl flags, which would parse sys.argv
      flags.FLAGS.mark_as_parsed()  # (this program's own arguments) at the first call
    self.tokamax = tokamax

  def experts(self, x_RxD, w, rows, xq=None):
    if not isinstance(w, jax.Array):
      return None
    y = self.tokamax.ragged_dot(x_RxD[rows.src].astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                                rows.group_sizes.astype(jnp.int32),
                                preferred_element_type=jnp.float32,
                                implementation=self.implementation)
    return y.astype(jnp.bfloat16)[rows.back]

  def attention(self, q_BxHxDh, k, v, mask_BxS):
    if isinstance(k, QArray) or isinstance(v, QArray):
      return None
    o = self.tokamax.dot_product_attention(  # [B, T = 1, H, Dh] against [B, S, Kv, Dh]
        q_BxHxDh[:, None].astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
        mask=mask_BxS[:, None, None, :], implementation=self.implementation)
    return o[:, 0].astype(jnp.bfloat16)
