"""Decode attention kernel against its reference: interpret mode on CPU, compiled on a GPU
(-m gpu)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_attention import decode_attention, reference
from trace_jax.models import layers as L
from trace_jax.quant import MXFP4, NVFP4, dequantize, quantize

FORMATS = [None, MXFP4, NVFP4]  # None: a bf16 cache
fmt_id = lambda f: "bf16" if f is None else f.name


def inputs(seed, b, s, kv, g, dh, fmt, lengths=None):
  """q, K, V (packed when fmt is given) and a left-padded mask: sequence i holds slots
  [pad_i, lengths_i)."""
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, kv * g, dh), jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, kv, dh)) * jnp.exp(jax.random.normal(ks[3], (1, s, kv, 1)))
  v = jax.random.normal(ks[2], (b, s, kv, dh))
  lengths = np.full(b, s) if lengths is None else np.asarray(lengths)
  pad = np.arange(b) % 3
  slots = np.arange(s)
  mask = jnp.asarray((slots >= pad[:, None]) & (slots < lengths[:, None]))
  if fmt is None:
    return q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), mask
  return q, quantize(k, fmt), quantize(v, fmt), mask


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_reference_is_softmax_attention(fmt):
  q, k, v, mask = inputs(0, 3, 64, 2, 4, 32, fmt, lengths=[64, 40, 7])
  kd, vd = (np.asarray(dequantize(c) if fmt else c, np.float64) for c in (k, v))
  qd = np.asarray(q, np.float64).reshape(3, 2, 4, 32)
  s = np.einsum("bkgd,bskd->bkgs", qd, kd) / np.sqrt(32)
  s = np.where(np.asarray(mask)[:, None, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bkgs,bskd->bkgd", p / p.sum(-1, keepdims=True), vd).reshape(3, 8, 32)
  assert rel(reference.decode_attention(q, k, v, mask), want) < 1e-2  # bf16 roundings


@pytest.mark.parametrize("fmt", [None, MXFP4], ids=fmt_id)
def test_reference_matches_the_engines_flash_decoding(fmt):
  """The rollout engine's XLA attention (chunked online softmax) at one query position."""
  q, k, v, mask = inputs(1, 2, 128, 2, 2, 32, fmt, lengths=[128, 50])
  kd, vd = (reference.as_bf16(c) for c in (k, v))
  q_slot = jnp.full((2, 1), 127)
  engine = L.flash_decode_attention(q[:, None], kd, vd, q_slot, mask, chunk=32)[:, 0]
  assert rel(reference.decode_attention(q, k, v, mask), engine) < 5e-3


@pytest.mark.parametrize("fmt,b,s,kv,g,dh,block_s,splits", [
    (fmt, 2, 128, 2, 4, 64, 32, 2) for fmt in FORMATS] + [  # G < 16: padded query rows
    (MXFP4, 1, 256, 1, 16, 64, 64, 4),   # G = 16, one kv head
    (NVFP4, 3, 64, 2, 2, 128, 32, None),  # head_dim 128, the default split count
    (MXFP4, 1, 64, 1, 20, 32, 32, None),  # G = 20: padded to 32 rows (a power of two)
], ids=lambda v: fmt_id(v) if v is None or hasattr(v, "name") else None)
def test_kernel_in_interpret_mode(fmt, b, s, kv, g, dh, block_s, splits):
  q, k, v, mask = inputs(b * s + g, b, s, kv, g, dh, fmt, lengths=[s - 5 * i for i in range(b)])
  got = decode_attention(q, k, v, mask, implementation="pallas", block_s=block_s, splits=splits,
                         interpret=True, poison=True)
  want = decode_attention(q, k, v, mask)
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert not np.isnan(np.asarray(got, np.float32)).any()
  # bf16 output and probability rounding (p scaled by the running max), the order of the sums
  assert rel(got, want) < 4e-3


# The kernels in Triton's own language (backend "jax_triton"): Triton's interpreter on CPU (its
# outputs start as NaN there, so an element it fails to write shows), compiled through jax-triton
# on a GPU (-m gpu).

@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("b,s,kv,g,dh,block_s,splits", [
    (2, 128, 2, 4, 64, 32, 2),      # G < 16: padded query rows
    (3, 64, 2, 2, 128, 32, None),   # head_dim 128, the default split count
    (1, 64, 1, 20, 32, 32, None)])  # G = 20: padded to 32 rows
def test_jax_triton_kernel_in_the_interpreter(fmt, b, s, kv, g, dh, block_s, splits):
  """The Pallas kernel's program: its interpret-mode outputs bit for bit (the same decoded
  values, products and roundings; the float32 sums in the same order here)."""
  q, k, v, mask = inputs(b * s + g, b, s, kv, g, dh, fmt, lengths=[s - 5 * i for i in range(b)])
  got = decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton",
                         block_s=block_s, splits=splits)
  want = decode_attention(q, k, v, mask)
  pallas = decode_attention(q, k, v, mask, implementation="pallas", block_s=block_s,
                            splits=splits, interpret=True)
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 4e-3
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(pallas, np.float32))


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_jax_triton_kernel_reads_no_block_past_the_sequence_end_and_skips_empty_rows(fmt):
  q, k, v, mask = inputs(15, 3, 128, 2, 4, 64, fmt, lengths=[128, 40, 0])
  want = decode_attention(q, k, v, mask)
  kp, vp = (poisoned_past(poisoned_past(c, 1, 64, fmt), 2, 0, fmt) for c in (k, v))
  got = decode_attention(q, kp, vp, mask, implementation="pallas", backend="jax_triton",
                         block_s=32, splits=2)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert np.all(np.asarray(got[2], np.float32) == 0)  # no valid slot: attends to nothing
  assert rel(got, want) < 4e-3


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's, of NaN
def test_jax_triton_kernel_gives_nan_for_a_non_finite_block_and_names_what_it_does_not_take():
  q, k, v, mask = inputs(3, 1, 64, 1, 2, 32, None)
  v = v.at[0, 5, 0, 3].set(jnp.inf)
  for fmt in (MXFP4, NVFP4):  # the block's NaN scale byte (NVFP4) or E8M0 255 (MXFP4)
    out = decode_attention(q, quantize(k, fmt), quantize(v, fmt), mask,
                           implementation="pallas", backend="jax_triton", block_s=32)
    assert np.isnan(np.asarray(out, np.float32)).any()
  q, k, v, mask = inputs(7, 1, 64, 1, 2, 32, MXFP4)
  with pytest.raises(ValueError, match="not interpretable"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton",
                     decode="asm")
  with pytest.raises(ValueError, match="no interpret"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton",
                     interpret=True)
  with pytest.raises(ValueError, match="divisible by block_s"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton", block_s=48)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("b,s,block_s,decode,g,dh,splits", [
    (1, 512, 64, "asm", 8, 128, None), (16, 2048, 64, "asm", 8, 128, None),
    (5, 4096, 128, "asm", 8, 128, 4), (4, 1024, 64, "bits", 8, 128, None),
    (3, 1024, 64, "asm", 20, 64, None)])
def test_jax_triton_kernel_on_gpu(fmt, b, s, block_s, decode, g, dh, splits):
  """Compiled through jax-triton: the reference's outputs within the kernels' tolerance, and the
  Pallas kernel's (the same program, its sums in the compilers' orders)."""
  q, k, v, mask = inputs(b * s, b, s, 4, g, dh, fmt, lengths=[s - 37 * i for i in range(b)])
  got = decode_attention(q, k, v, mask, implementation="pallas", backend="jax_triton",
                         block_s=block_s, splits=splits, decode=decode)
  want = decode_attention(q, k, v, mask)
  pallas = decode_attention(q, k, v, mask, implementation="pallas", block_s=block_s,
                            splits=splits, decode=decode)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 4e-3 and rel(got, pallas) < 4e-3


def test_a_sequence_with_no_valid_slot_attends_to_nothing():
  q, k, v, mask = inputs(2, 2, 64, 1, 2, 32, MXFP4)
  mask = mask.at[1].set(False)  # also a whole split of sequence 0 masked
  mask = mask.at[0, :32].set(False)
  for impl in ("xla", "pallas"):
    out = decode_attention(q, k, v, mask, implementation=impl, block_s=32, splits=2,
                           interpret=True)
    assert np.all(np.asarray(out[1], np.float32) == 0)
    assert np.all(np.isfinite(np.asarray(out[0], np.float32)))
    assert np.any(np.asarray(out[0], np.float32) != 0)


def test_non_finite_cache_blocks_come_back_as_nan():
  q, k, v, mask = inputs(3, 1, 64, 1, 2, 32, None)
  v = v.at[0, 5, 0, 3].set(jnp.inf)
  out = decode_attention(q, quantize(k, MXFP4), quantize(v, MXFP4), mask,
                         implementation="pallas", block_s=32, interpret=True)
  assert np.isnan(np.asarray(out, np.float32)).any()


@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v, m: (q[:, :, :16], k, v, m), "head_dim"),
    (lambda q, k, v, m: (q[:, :3], k, v, m), "multiple of the cache"),
    (lambda q, k, v, m: (q, k, v, m[:, :32]), "mask must be"),
    (lambda q, k, v, m: (q, k, dequantize(v), m), "both be packed"),
    (lambda q, k, v, m: (q, k, quantize(dequantize(v), NVFP4), m), "share a format"),
    (lambda q, k, v, m: (q, quantize(dequantize(k), MXFP4, axis=1), v, m), "along head_dim"),
])
def test_bad_inputs_name_what_is_wrong(bad, match):
  args = bad(*inputs(4, 2, 64, 2, 2, 32, MXFP4))
  with pytest.raises(ValueError, match=match):
    decode_attention(*args, implementation="pallas", block_s=32, interpret=True)


def test_kernel_tiling_errors():
  q, k, v, mask = inputs(5, 1, 96, 1, 2, 32, MXFP4)
  with pytest.raises(ValueError, match="divisible by block_s"):
    decode_attention(q, k, v, mask, implementation="pallas", block_s=64, interpret=True)
  with pytest.raises(ValueError, match="must divide"):
    decode_attention(q, k, v, mask, implementation="pallas", block_s=32, splits=2,
                     interpret=True)
  with pytest.raises(ValueError, match="implementation"):
    decode_attention(q, k, v, mask, implementation="triton")
  q, k, v, mask = inputs(6, 1, 64, 1, 2, 96, MXFP4)  # Triton's tiles are powers of two
  with pytest.raises(ValueError, match="head_dim \\(96\\) a power of two"):
    decode_attention(q, k, v, mask, implementation="pallas", block_s=32, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
@pytest.mark.parametrize("b,s,block_s,decode,g,dh", [
    (1, 512, 64, "asm", 8, 128), (16, 2048, 64, "asm", 8, 128), (5, 4096, 128, "asm", 8, 128),
    (4, 1024, 64, "bits", 8, 128), (3, 1024, 64, "asm", 20, 64)])  # 20: rows padded to 32
def test_compiled_kernel_on_gpu(fmt, b, s, block_s, decode, g, dh):
  # qwen3_30b_a3b attention: 32 query heads on 4 kv heads, head_dim 128; fresh inputs each shape
  q, k, v, mask = inputs(b * s, b, s, 4, g, dh, fmt,
                         lengths=[s - 37 * i for i in range(b)])
  got = decode_attention(q, k, v, mask, implementation="pallas", block_s=block_s,
                         decode=decode, poison=True)
  want = decode_attention(q, k, v, mask)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 4e-3


# The Mosaic (wgmma) kernel: no interpret mode, so on CPU it is lowered for CUDA and its
# wrapper runs around an emulation; compiled on a Hopper GPU (-m gpu).

@pytest.mark.parametrize("fmt,fold", [(None, False), (MXFP4, False), (MXFP4, True),
                                      (NVFP4, False)], ids=lambda v: fmt_id(v) if v is None
                         or hasattr(v, "name") else ("fold" if v else "unfolded"))
def test_mosaic_kernel_lowers_for_cuda(fmt, fold):
  """The whole Mosaic lowering (layout inference, wgmma's operand checks) for a CUDA target."""
  args = jax.eval_shape(lambda: inputs(0, 2, 256, 4, 8, 128, fmt))
  f = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, implementation="pallas",
                                                  backend="mosaic", splits=2, fold=fold))
  assert jax.export.export(f, platforms=["cuda"])(*args).out_avals[0].shape == (2, 32, 128)


@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=fmt_id)
def test_mosaic_kernel_with_two_blocks_a_step_lowers_for_cuda(fmt):
  """Two 64-slot blocks a pipeline step (FP4 caches): lowered for CUDA; a bf16 cache takes one
  block a step whatever is asked, and sizes that do not split into steps of 128 slots are
  refused with what they need."""
  args = jax.eval_shape(lambda: inputs(0, 2, 512, 4, 8, 128, fmt))
  f = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, implementation="pallas",
                                                  backend="mosaic", splits=2, blocks=2))
  assert jax.export.export(f, platforms=["cuda"])(*args).out_avals[0].shape == (2, 32, 128)
  args16 = jax.eval_shape(lambda: inputs(0, 2, 512, 4, 8, 128, None))
  assert jax.export.export(f, platforms=["cuda"])(*args16).out_avals[0].shape == (2, 32, 128)
  q, k, v, mask = inputs(0, 2, 192, 4, 8, 128, fmt)
  with pytest.raises(ValueError, match="slots \\(192\\) must be a multiple of 128"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", blocks=2)
  with pytest.raises(ValueError, match="blocks must be one of \\(1, 2\\), got 3"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", blocks=3)

@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=fmt_id)
@pytest.mark.parametrize("blocks", [1, 2])
def test_the_lean_mosaic_kernel_lowers_for_cuda(fmt, blocks):
  """`lean` (each K chunk's and the first block's V^T registers freed by a wgmma wait before
  the next are decoded): lowered for CUDA, for one and two blocks a step."""
  args = jax.eval_shape(lambda: inputs(0, 2, 512, 4, 8, 128, fmt))
  f = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, implementation="pallas",
                                                  backend="mosaic", splits=2, blocks=blocks,
                                                  lean=True))
  assert jax.export.export(f, platforms=["cuda"])(*args).out_avals[0].shape == (2, 32, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [MXFP4, NVFP4], ids=fmt_id)
@pytest.mark.parametrize("blocks", [1, 2])
def test_the_lean_mosaic_kernel_computes_what_the_other_does_on_gpu(fmt, blocks):
  """`lean` waits for matrix instructions earlier; the instructions and their order are the
  same, so are the outputs, bit for bit."""
  from pallas_kernels.fp4_matmul import mosaic as mosaic_matmul
  if not mosaic_matmul.available():
    pytest.fail("the Mosaic kernel's GPU test needs a Hopper GPU")
  q, k, v, mask = inputs(11, 5, 4096, 4, 8, 128, fmt, lengths=[4096 - 37 * i for i in range(5)])
  run = lambda lean: np.asarray(decode_attention(q, k, v, mask, implementation="pallas",
                                                 backend="mosaic", blocks=blocks, lean=lean),
                                np.float32)
  np.testing.assert_array_equal(run(True), run(False))


def test_mosaic_kernel_takes_fp4_caches_whose_v_it_reads_from_registers_only():
  """An FP4 cache of head_dim 64 (or any not a multiple of 128) would take V through shared
  memory, in O^T tiles of head_dim / 2 rows, fewer than wgmma's 64: refused by `unsupported`
  (the engine then runs the Triton kernel), not left to fail in Mosaic's lowering."""
  from pallas_kernels.decode_attention import mosaic
  for fmt in ("mxfp4", "nvfp4"):
    assert f"head_dim (64) a multiple of 128 for a {fmt} cache" in mosaic.unsupported(
        8, 64, 4, fmt, 256)
    assert mosaic.supports(4, 128, 8, fmt, 256) and mosaic.supports(4, 256, 8, fmt, 256)
  assert mosaic.supports(8, 64, 4, "bf16", 256)  # bf16 reads V from shared memory as it is
  args = jax.eval_shape(lambda: inputs(0, 2, 256, 8, 4, 64, None))
  f = jax.jit(lambda q, k, v, m: decode_attention(q, k, v, m, implementation="pallas",
                                                  backend="mosaic", splits=2))
  assert jax.export.export(f, platforms=["cuda"])(*args).out_avals[0].shape == (2, 32, 64)


def _emulated_partials(fmt):
  """`mosaic.decode_attention_partials` in jnp: the caches rebuilt from the kernel's arrays
  (so their byte layout is checked too), head_dim in q's order (o^T's in `v_rows` order where
  V^T comes from registers), per split o^T, m and l."""
  from pallas_kernels.decode_attention import mosaic
  from trace_jax.quant import QArray
  fmt_obj = {"mxfp4": MXFP4, "nvfp4": NVFP4}.get(fmt)

  def cache(arrays, b, s, kv, v=False):
    if fmt_obj is None:
      return arrays[0].reshape(b, s, kv, -1).astype(jnp.float32)
    g = None
    if fmt == "nvfp4":
      g = jax.lax.bitcast_convert_type(arrays[2].reshape(b, s, kv, 1, 4), jnp.float32)
    x = dequantize(QArray(codes=arrays[0].reshape(b, s, kv, -1),
                          scales=arrays[1].reshape(b, s, kv, -1), global_scale=g,
                          fmt=fmt_obj, axis=3))
    x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if v and mosaic.v_in_registers(fmt, x.shape[-1]):  # O^T's rows in `v_rows` order
      return x[..., mosaic.v_rows(x.shape[-1])]
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)

  def partials(q_t, mask, end, k_arrays, v_arrays, *, fmt, splits, max_concurrent_steps,
               fold=False, blocks=1, lean=False):  # (folded, blocks a step, lean: the same
    # partials)
    assert mask.shape[1] % (64 * blocks * splits) == 0
    b, kv, dh, rows = q_t.shape
    s = mask.shape[1]
    k, v = cache(k_arrays, b, s, kv), cache(v_arrays, b, s, kv, v=True)
    sc = jnp.einsum("bhdr,bshd->bhrs", q_t.astype(jnp.float32), k) * dh**-0.5
    sc = jnp.where(mask[:, None, None, :] != 0, sc, -1e30).reshape(b, kv, rows, splits, -1)
    m = jnp.max(sc, axis=-1)
    p = jnp.where(sc > -1e30, jnp.exp(sc - m[..., None]), 0.0)
    o = jnp.einsum("bhrtj,btjhd->tbhdr", p, v.reshape(b, splits, -1, kv, dh))
    m, l = jnp.moveaxis(m, -1, 0), jnp.moveaxis(jnp.sum(p, axis=-1), -1, 0)
    # a split from the sequence's end on reads nothing: the empty state, whatever the cache holds
    reads = (jnp.arange(splits) * (s // splits))[:, None] < end[None, :]  # [splits, B]
    r = reads[:, :, None, None]
    return jnp.where(r[..., None], o, 0.0), jnp.where(r, m, -1e30), jnp.where(r, l, 0.0)

  return partials


@pytest.mark.parametrize("fmt,fold", [(MXFP4, False), (MXFP4, True), (NVFP4, False)],
                         ids=["mxfp4", "mxfp4-fold", "nvfp4"])
def test_v_operands_hold_v_transposed_in_v_rows_order(fmt, fold):
  """The registers `mosaic._v_operands` fills, modelled thread by thread from the PTX's own
  definitions (ldmatrix.trans: of each 8 x 8 matrix of 16-bit words, thread t gets rows
  2 (t % 4) and 2 (t % 4) + 1 of column t // 4; the decode's asm emulated) and from the scale
  rows it reads ([block, slot]), are V^T: tile m's (row, slot) element, where the WGMMA layout
  puts it, is the engine's dequantized V (XLA's, in bf16) at that slot and at head_dim entry
  `v_rows`[64 m + row]; folded (`mosaic.FOLD_REF`), that value over 2^(FOLD_REF - 127)."""
  from pallas_kernels.decode_attention import mosaic
  from pallas_kernels.fp4_matmul.kernel import block_scale, fold_scale_bf16
  from tests.pallas_kernels import ptx_emu
  dh, slots, nv = 128, mosaic.BLOCK_S, fmt is NVFP4
  x = jax.random.normal(jax.random.PRNGKey(0), (slots, dh)) * jnp.exp(
      jax.random.normal(jax.random.PRNGKey(1), (slots, 1)))
  packed = quantize(x, fmt)
  want = np.asarray(dequantize(packed).astype(jnp.bfloat16).astype(jnp.float32))
  codes = np.asarray(packed.codes)
  g = packed.global_scale if nv else None
  # the scale rows the kernel keeps in shared memory: bf16 pairs (MXFP4), float32 (NVFP4)
  rows = np.asarray(fold_scale_bf16(packed.scales, 2.0 ** (mosaic.FOLD_REF - 127)) if fold
                    else block_scale(packed.scales, fmt.name, g)).T  # [blocks, slots]
  if fold:
    want = want * 2.0 ** (127 - mosaic.FOLD_REF)
  asm = mosaic.V_PAIR_ASM["mxfp4_folded" if fold else fmt.name]
  bits = rows.view(np.uint16 if not nv else np.uint32).astype(np.int64)
  tiles = np.full((dh // 64, 64, slots), np.nan)
  for w in range(4):
    for lane in range(32):
      for pi in range(dh // 128):
        col = 16 * (4 * pi + w)  # the warp's 16 code bytes
        block = 8 * pi + 2 * w + lane // 16 if nv else 4 * pi + w
        for k in range(slots // 32):
          for q in range(4):
            r0, j = 32 * k + 8 * q + 2 * (lane % 4), lane // 4
            b = codes[[r0, r0, r0 + 1, r0 + 1], [col + 2 * j, col + 2 * j + 1] * 2]
            word = int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24
            scale = ([int(bits[block, r0]), int(bits[block, r0 + 1])] if nv
                     else [int(bits[block, r0]) | int(bits[block, r0 + 1]) << 16])
            for half, sel in enumerate(("0x2404", "0x3414")):
              regs = ptx_emu.run(asm[sel], 2, [word, *scale])
              for h, reg in enumerate(regs):
                row, slot = 16 * w + lane // 4 + 8 * h, 8 * (4 * k + q) + 2 * (lane % 4)
                for e in range(2):  # the register's low half: the lower column
                  tiles[2 * pi + half, row, slot + e] = ptx_emu.bf16_bits_to_f32(
                      reg >> (16 * e) & 0xFFFF)
  np.testing.assert_array_equal(tiles, want[:, mosaic.v_rows(dh)].T.reshape(dh // 64, 64, slots))
  assert sorted(mosaic.v_rows(dh)) == list(range(dh))


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_mosaic_wrapper_around_an_emulated_kernel(fmt, monkeypatch):
  """q padded to 16 rows, transposed and permuted to [even | odd]; the caches flattened to rows
  of bytes (NVFP4's globals as bytes); the splits combined and the permutation undone."""
  from pallas_kernels.decode_attention import mosaic
  name = fmt_id(fmt)
  monkeypatch.setattr(mosaic, "decode_attention_partials", _emulated_partials(name))
  q, k, v, mask = inputs(11, 3, 256, 4, 6, 128, fmt, lengths=[256, 120, 70])
  mask = mask.at[0, :64].set(False)  # a whole split masked, read (valid slots follow)
  mask = mask.at[2, :128].set(False)  # a sequence with no valid slot
  got = decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", splits=4)
  want = decode_attention(q, k, v, mask)
  assert got.shape == want.shape and got.dtype == jnp.bfloat16
  assert rel(got, want) < 4e-3
  # the splits past sequence 1's end (from slot 128) are not read: non-finite there changes nothing
  kp, vp = (poisoned_past(c, 1, 128, fmt) for c in (k, v))
  got = decode_attention(q, kp, vp, mask, implementation="pallas", backend="mosaic", splits=4)
  assert rel(got, want) < 4e-3
  if fmt is not None:  # two blocks a step: steps of 128 slots, which two splits divide
    got = decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", splits=2,
                           blocks=2)
    assert rel(got, want) < 4e-3


def poisoned_past(cache, row, start, fmt):
  """The cache with row's slots from `start` on non-finite (quantized: from an Inf input)."""
  x = cache if fmt is None else dequantize(cache)
  x = x.at[row, start:].set(jnp.inf)
  return x.astype(jnp.bfloat16) if fmt is None else quantize(x, fmt)


def test_valid_end_is_one_past_the_last_valid_slot():
  from pallas_kernels.decode_attention.kernel import valid_end
  mask = jnp.asarray([[1, 1, 0, 0], [0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0]], bool)
  np.testing.assert_array_equal(valid_end(mask), [2, 4, 0, 2])
  np.testing.assert_array_equal(valid_end(jnp.asarray([[0, 2, 1, 0]], jnp.int8)), [3])


@pytest.mark.parametrize("fmt", FORMATS, ids=fmt_id)
def test_kernel_reads_no_block_past_the_sequence_end(fmt):
  """A rollout's cache is longer than what it holds so far: the Triton kernel skips the blocks
  from each sequence's end on (non-finite values there leave the output as it was)."""
  q, k, v, mask = inputs(15, 2, 128, 2, 4, 64, fmt, lengths=[128, 40])
  want = decode_attention(q, k, v, mask)
  kp, vp = (poisoned_past(c, 1, 64, fmt) for c in (k, v))  # blocks of 32: from the third on
  got = decode_attention(q, kp, vp, mask, implementation="pallas", block_s=32, splits=1,
                         interpret=True, poison=True)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel(got, want) < 4e-3


def test_mosaic_backend_names_what_is_wrong():
  q, k, v, mask = inputs(12, 1, 128, 4, 8, 64, MXFP4)
  with pytest.raises(ValueError, match="backend must be one of"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="cuda")
  with pytest.raises(ValueError, match="no interpret mode"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", interpret=True)
  with pytest.raises(ValueError, match="no poisoned outputs"):
    decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic", poison=True)
  q20, k1, v1, mask1 = inputs(13, 1, 128, 1, 20, 64, None)  # 20 query heads a kv head
  with pytest.raises(ValueError, match="at most 16 query heads"):
    decode_attention(q20, k1, v1, mask1, implementation="pallas", backend="mosaic")
  q2, k2, v2, mask2 = inputs(14, 1, 128, 1, 8, 128, MXFP4)  # one kv head's scales: 4 bytes
  with pytest.raises(ValueError, match="mxfp4 scales of a slot's 1 kv heads.*16 bytes"):
    decode_attention(q2, k2, v2, mask2, implementation="pallas", backend="mosaic")
  q2, k2, v2, mask2 = inputs(14, 1, 128, 8, 4, 64, MXFP4)  # V would go through shared memory
  with pytest.raises(ValueError, match="head_dim \\(64\\) a multiple of 128 for a mxfp4"):
    decode_attention(q2, k2, v2, mask2, implementation="pallas", backend="mosaic")
  q3, k3, v3, mask3 = inputs(15, 1, 128, 2, 8, 128, NVFP4)  # globals: 2 x 4 bytes a slot
  with pytest.raises(ValueError, match="nvfp4 globals of a slot's 2 kv heads"):
    decode_attention(q3, k3, v3, mask3, implementation="pallas", backend="mosaic")
  q4, k4, v4, mask4 = inputs(16, 1, 96, 4, 8, 128, MXFP4)  # 96 slots
  with pytest.raises(ValueError, match="the slots \\(96\\)"):
    decode_attention(q4, k4, v4, mask4, implementation="pallas", backend="mosaic")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,fold,blocks", [
    (None, False, 1), (MXFP4, False, 1), (MXFP4, True, 1), (NVFP4, False, 1), (MXFP4, False, 2),
    (NVFP4, False, 2)], ids=lambda v: fmt_id(v) if v is None or hasattr(v, "name") else (
        ("fold" if v else "unfolded") if isinstance(v, bool) else f"b{v}"))
@pytest.mark.parametrize("b,s,g,dh,splits", [
    (1, 512, 8, 128, None), (16, 2048, 8, 128, None), (5, 4096, 8, 128, 4),
    (3, 1024, 16, 128, None), (2, 1024, 1, 128, 2)])
def test_mosaic_kernel_on_gpu(fmt, fold, blocks, b, s, g, dh, splits):
  """Compiled on a Hopper GPU: 4 kv heads, ragged left-padded masks, fresh inputs a shape; MXFP4
  with its scales folded too, which gives the unfolded kernel's outputs but where terms of P V
  below 2^-61 (which underflow float32 in the folded frame) reach the output; FP4 caches two
  64-slot blocks a step too."""
  from pallas_kernels.fp4_matmul import mosaic as mosaic_matmul
  if not mosaic_matmul.available():
    pytest.fail("the Mosaic kernel's GPU test needs a Hopper GPU")
  q, k, v, mask = inputs(b * s + g, b, s, 4, g, dh, fmt,
                         lengths=[s - 37 * i for i in range(b)])
  got = decode_attention(q, k, v, mask, implementation="pallas", backend="mosaic",
                         splits=splits, fold=fold, blocks=blocks)
  want = decode_attention(q, k, v, mask)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  assert rel(got, want) < 4e-3
  if fold:  # the products and sums of the unfolded kernel, times powers of two: a term below
    # 2^-61 changes a float32 sum only below 2^-61 x 2^24, so outputs above 2^-30 are the same
    unfolded = np.asarray(decode_attention(
        q, k, v, mask, implementation="pallas", backend="mosaic", splits=splits), np.float32)
    got = np.asarray(got, np.float32)
    large = np.abs(unfolded) >= 2.0**-30
    assert large.mean() > 0.9  # (not a vacuous check: 98.8% in the 5 x 4096 case)
    np.testing.assert_array_equal(got[large], unfolded[large])
    assert np.abs(got - unfolded).max() <= 2.0**-40


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,backend", [(MXFP4, "mosaic"), (MXFP4, "triton"), (NVFP4, "triton"),
                                         (None, "triton"), (NVFP4, "mosaic"), (None, "mosaic"),
                                         (MXFP4, "mosaic b2"), (NVFP4, "mosaic b2"),
                                         (None, "jax_triton"), (MXFP4, "jax_triton"),
                                         (NVFP4, "jax_triton")],
                         ids=lambda v: fmt_id(v) if v is None or hasattr(v, "name") else v)
def test_compiled_kernels_on_partly_filled_caches(fmt, backend):
  """Compiled: sequences from empty to full in a 2048-slot cache, non-finite values past each
  sequence's end (blocks, or the Mosaic kernel's splits, there must not be read; with two blocks
  a step, four splits of 512 slots: a split is skipped by where it starts in slots)."""
  from pallas_kernels.fp4_matmul import mosaic as mosaic_matmul
  if backend == "mosaic" and not mosaic_matmul.available():
    pytest.fail("the Mosaic kernel's GPU test needs a Hopper GPU")
  lengths = [2048, 1500, 700, 64, 1, 0, 1024, 1999]
  q, k, v, mask = inputs(16, 8, 2048, 4, 8, 128, fmt, lengths=lengths)
  want = decode_attention(q, k, v, mask)
  for row, n in enumerate(lengths):
    start = -(-n // 512) * 512  # past the last split (of 512 or fewer slots) that holds the end
    if start < 2048:
      k, v = (poisoned_past(c, row, start, fmt) for c in (k, v))
  extra = dict(blocks=2, splits=4) if backend == "mosaic b2" else {}
  got = decode_attention(q, k, v, mask, implementation="pallas", backend=backend.split()[0],
                         **extra)
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert rel(got, want) < 4e-3


def test_bench_reports_a_shape_that_fails_and_goes_on(monkeypatch):
  """A shape whose reference runs out of memory (B = 64 x 128K on an 80 GB GPU) is one error
  line of the run, not the end of it: the shapes after it are still timed."""
  from pallas_kernels.decode_attention import bench

  real = bench.time_calls

  def time_calls(fn, x, weights):
    if x[1].shape[1] == 128:  # the first context: as the allocator would refuse it
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB")
    return real(fn, x, weights)

  monkeypatch.setattr(bench, "time_calls", time_calls)
  monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
  result = bench.run(batches=[1], contexts=[128, 256], configs=[], formats=["bf16"])
  assert [(r["context"], r["variant"]) for r in result["rows"]] == [(256, "xla bf16")]
  [error] = result["errors"]
  assert error.startswith("B=1 S=128") and "RESOURCE_EXHAUSTED" in error


def test_bench_times_each_configuration_at_the_splits_asked_for(tmp_path, monkeypatch, capsys):
  """`--splits=2`: every chosen configuration again at 2 splits of the sequence (label " x2"),
  beside its default splits; a bad count is one line naming the flag."""
  import json
  import sys

  from pallas_kernels.decode_attention import bench

  monkeypatch.setattr(bench, "copy_bandwidth", lambda: 1e12)
  kernel = bench.api.decode_attention  # (a GPU benchmark: here in interpret mode)
  monkeypatch.setattr(bench.api, "decode_attention",
                      lambda *a, **kw: kernel(*a, **kw, interpret=True))
  monkeypatch.setattr(sys, "argv", ["bench", f"--out={tmp_path}", "--batches=1",
                                    "--contexts=128", "--formats=bf16", "--backends=triton",
                                    "--configs=triton s64w4st2", "--splits=2"])
  bench.main()
  rows = json.load(open(tmp_path / "decode_attention_bench.json"))["rows"]
  got = {r["config"]: r.get("splits") for r in rows if r["variant"] == "pallas bf16"}
  assert got == {"triton s64w4st2": None, "triton s64w4st2 x2": 2}
  assert all(r["rel_err"] < 1e-2 for r in rows if r["variant"] == "pallas bf16")
  monkeypatch.setattr(sys, "argv", ["bench", "--splits=two"])
  with pytest.raises(SystemExit):
    bench.main()
  assert "--splits='two'" in capsys.readouterr().err
