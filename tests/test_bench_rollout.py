"""The rollout benchmark's variant names (its run on CPU is in test_experiments.py, slow)."""

import re
import sys

import pytest

from experiments import bench_rollout


def test_bench_rollout_variant_names():
  parse = bench_rollout.parse_variant
  h = "halves"  # the engine's default nibble order
  p = "pallas"  # and its default Triton backend (the last field)
  assert parse("mxfp4:pallas") == ("mxfp4", "pallas", "auto", False, False, h, True, False, 1, p)
  assert parse("nvfp4:triton:mosaic") == (
      "nvfp4", "triton", "mosaic", False, False, h, True, False, 1, p)
  assert parse("bf16:xla+scan") == ("bf16", "xla", "auto", True, False, h, True, False, 1, p)
  assert parse("mxfp4:pallas:mosaic+scan") == (
      "mxfp4", "pallas", "mosaic", True, False, h, True, False, 1, p)
  assert parse("mxfp4:pallas+w4a4") == (
      "mxfp4", "pallas", "auto", False, True, h, True, False, 1, p)
  assert parse("mxfp4:pallas+w4a4+scan") == parse("mxfp4:pallas+scan+w4a4") == (
      "mxfp4", "pallas", "auto", True, True, h, True, False, 1, p)
  assert parse("nvfp4:pallas+pairs") == (
      "nvfp4", "pallas", "auto", False, False, "pairs", True, False, 1, p)
  assert parse("mxfp4:pallas+pairs+scan") == (
      "mxfp4", "pallas", "auto", True, False, "pairs", True, False, 1, p)
  assert parse("mxfp4:pallas+halves") == parse("mxfp4:pallas")
  assert parse("mxfp4:pallas+apart") == (
      "mxfp4", "pallas", "auto", False, False, h, False, False, 1, p)
  assert parse("bf16:pallas+apart+scan")[3:] == (True, False, h, False, False, 1, p)
  assert parse("mxfp4:pallas+fold").fold and not parse("mxfp4:pallas").fold
  assert parse("mxfp4:pallas:mosaic+fold+scan")[2:] == ("mosaic", True, False, h, True, True, 1, p)
  assert parse("bf16:pallas+jt").triton_backend == "jax_triton"
  assert parse("mxfp4:pallas:triton+jt+scan")[2:4] == ("triton", True)
  assert parse("nvfp4:pallas+b2").blocks == 2 and parse("mxfp4:pallas:mosaic+fold+b2")[-3:-1] == (
      True, 2)
  for bad in ("mxfp4:xla:mosaic", "mxfp4:pallas:flash", "fp8:pallas", "mxfp4:pallas:mosaic:x",
              "mxfp4", "mxfp4:pallas+scanned", "+scan", "mxfp4:xla+w4a4", "mxfp4:triton+w4a4",
              "mxfp4:xla+pairs", "mxfp4:triton+pairs", "bf16:pallas+pairs",
              "bf16:pallas+halves", "mxfp4:pallas+w4a4+pairs", "mxfp4:pallas+pairs+halves",
              "mxfp4:xla+apart", "bf16:tokamax+apart", "nvfp4:pallas+fold", "bf16:pallas+fold",
              "mxfp4:triton+fold", "mxfp4:pallas+w4a4+fold", "bf16:pallas+b2",
              "mxfp4:xla+b2", "mxfp4:triton+b2", "bf16:xla+jt", "bf16:triton+jt"):
    with pytest.raises(ValueError, match=re.escape(f"unknown variant '{bad}'")):
      parse(bad)


@pytest.mark.parametrize("precision,kernels", [("mxfp4", "pallas"), pytest.param("nvfp4", "xla", marks=pytest.mark.slow),
                                               ("bf16", "xla")])
def test_random_weights_are_the_weight_syncs_layout(precision, kernels):
  """The benchmark's random rollout weights, made without master params, have the structure,
  shapes and dtypes the weight sync gives, unit block scales and globals, and the engine
  decodes with them."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.dispatch import make_ops
  from trace_jax.models import QuantRecipe, init_params, pack_weights, tiny
  from trace_jax.quant import QArray
  from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts
  cfg, recipe, ops = tiny(), QuantRecipe.uniform(precision), make_ops(kernels)
  want = jax.eval_shape(lambda: pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)),
                                             recipe, ops=ops))
  got = bench_rollout.random_weights(cfg, recipe, ops, jax.random.PRNGKey(1))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  for layer in got.layers:
    for w in layer.values():
      if isinstance(w, QArray):
        assert np.all(np.asarray(w.scales) == (127 if precision == "mxfp4" else 0x38))
        assert w.global_scale is None or np.all(np.asarray(w.global_scale) == 1)
  if kernels == "xla":  # (the kernels' interpret mode is too slow for a decode here)
    engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=2))
    out = engine.generate(got, *pad_prompts([[3, 4, 5]]), jax.random.PRNGKey(0))
    assert bool(jnp.all(jnp.isfinite(out.logp)))


@pytest.mark.parametrize("precision", ["mxfp4", "bf16"])
def test_the_bytes_a_step_reads_do_not_depend_on_how_the_weights_are_packed(precision):
  """`step_bytes` counts a layer's weights alike whether the weight sync packs q, k and v,
  and gate and up, as one weight each (`Fused`, the kernels' default) or apart: up to the
  tiled MXFP4 weights' globals (their fold references), 4 bytes a matrix, which the fused
  weights hold fewer of."""
  import jax

  from pallas_kernels.dispatch import make_ops
  from trace_jax.models import QuantRecipe, tiny
  cfg, recipe = tiny(), QuantRecipe.uniform(precision)
  fused, apart = (bench_rollout.random_weights(cfg, recipe, make_ops("pallas", fuse=fuse),
                                               jax.random.PRNGKey(0)) for fuse in (True, False))
  assert "w_gate+w_up" in fused.layers[0] and "w_gate" in apart.layers[0]
  # (a batch that hits every expert: (1 - k / E)^B is 0 in float64)
  counted = [bench_rollout.step_bytes(cfg, w, [], batch=4096) for w in (fused, apart)]
  globals_ = 4 * (cfg.n_layers * (2 + cfg.n_experts) if precision == "mxfp4" else 0)
  assert counted[1]["total"] - counted[0]["total"] == globals_
  assert counted[0]["experts"] > 0 and counted[1]["attention_weights"] == bench_rollout._nbytes(
      [apart.layers[i][n] for i in range(cfg.n_layers) for n in ("wq", "wk", "wv", "wo")])


def test_describe_fusions_names_what_a_profiled_kernel_computes():
  hlo = """
%fused_computation.7 (param_0: u8[4,64]) -> u8[4,64] {
  %param_0 = u8[4,64]{1,0} parameter(0)
  ROOT %select.3 = u8[4,64]{1,0} select(%p, %param_0, %param_0)
}

ENTRY %main (a: u8[4,64]) -> u8[4,64] {
  ROOT %loop_select_fusion.12 = u8[4,64]{1,0} fusion(%a), kind=kLoop, calls=%fused_computation.7, metadata={op_name="jit(_decode)/while/body/select_n" stack_frame_id=3}
}
"""
  got = bench_rollout.describe_fusions(hlo, ["loop_select_fusion_12", "absent_kernel"])
  assert got == {"loop_select_fusion_12": {"shape": "u8[4,64]{1,0}", "root": "select",
                                           "op_name": "jit(_decode)/while/body/select_n"}}
  # a fusion of several outputs: its shape is a tuple, spaces and all
  tuple_hlo = hlo.replace("-> u8[4,64] {", "-> (u8[4,64], u8[4]) {").replace(
      "ROOT %loop_select_fusion.12 = u8[4,64]{1,0} fusion",
      "ROOT %loop_slice_fusion.189 = (u8[4,64]{1,0}, u8[4]{0}) fusion")
  got = bench_rollout.describe_fusions(tuple_hlo, ["loop_slice_fusion_189"])
  assert got["loop_slice_fusion_189"]["shape"] == "(u8[4,64]{1,0}, u8[4]{0})"
  assert got["loop_slice_fusion_189"]["root"] == "select"


@pytest.mark.parametrize("precision", ["bf16", "mxfp4"])
def test_decode_state_holds_one_cache_at_a_time(precision, monkeypatch):
  """The decode state is built with one KV cache alive at any moment (weights aside): at 48
  layers a bf16 cache is a third of the H200, and two of them beside the weights do not fit.
  Every random leaf is checked against the bytes then alive on the device."""
  import jax
  import jax.numpy as jnp

  from trace_jax.models import QuantRecipe, tiny
  from trace_jax.rl.rollout import RolloutEngine, SamplingConfig
  cfg, recipe = tiny(), QuantRecipe.uniform(precision)
  weights = bench_rollout.random_weights(cfg, recipe, bench_rollout.make_ops("xla"),
                                         jax.random.PRNGKey(0))
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=2))
  live = lambda: sum(a.nbytes for a in jax.live_arrays())
  base, peaks = live(), []
  for name in ("normal", "bits"):
    real = getattr(jax.random, name)

    def spy(*a, real=real, **kw):
      out = real(*a, **kw)
      peaks.append(live())  # (out among them)
      return out
    monkeypatch.setattr(jax.random, name, spy)
  state = bench_rollout.decode_state(engine, weights, 8, 200, 16, jax.random.PRNGKey(1))
  held = sum(a.nbytes for a in jax.tree.leaves(state))  # the cache, and the rest of the state
  leaf = max(a.nbytes for a in jax.tree.leaves(state["cache"]))
  assert peaks and max(peaks) - base <= held + leaf, (max(peaks) - base, held, leaf)
  assert all(float(jnp.std(a.astype(jnp.float32))) > 0 for a in jax.tree.leaves(state["cache"])
             if a.dtype == jnp.bfloat16)


def test_run_counts_the_largest_batch_from_the_devices_memory(monkeypatch):
  """Where the device says how much memory arrays may take, the run reports each precision's
  largest batch of the preset's full model (the step rows keep their own decode memory)."""
  monkeypatch.setattr(bench_rollout, "device_bytes", lambda: 2**30)
  result = bench_rollout.run(1, [2], 48, 16, ["bf16:xla"], preset="tiny")
  assert not result["errors"] and result["memory_bytes"] == 2**30
  assert result["max_batch"]["bf16"] == bench_rollout.max_batch("bf16", 64, 2**30, "tiny") > 0
  assert "decode_memory" in result["rows"][0]


def test_decode_memory_counts_the_outputs_the_loop_does_not_write_in_place(monkeypatch):
  """The decode loop's outputs that XLA does not alias to its donated state are new buffers
  beside it (at 32K on an H100, B = 64 fit by the count and ran out of memory in its first
  call, allocating one layer's cache codes): `decode_memory` counts them and `check_fits` asks
  for them. The CPU loop writes its whole state in place."""
  import types

  import numpy as np
  stats = types.SimpleNamespace(temp_size_in_bytes=5, output_size_in_bytes=1000,
                                alias_size_in_bytes=600, peak_memory_in_bytes=0)
  compiled = types.SimpleNamespace(memory_analysis=lambda: stats)
  memory = bench_rollout.decode_memory(compiled, [np.zeros(10, np.int8)],
                                       [np.zeros(100, np.int8)])
  assert memory == {"weights_bytes": 10, "state_bytes": 100, "temp_bytes": 5,
                    "unaliased_bytes": 400}
  result = bench_rollout.run(1, [2], 48, 16, ["mxfp4:xla"], preset="tiny")
  cpu = result["rows"][0]["decode_memory"]
  assert 0 <= cpu["unaliased_bytes"] < cpu["state_bytes"] / 50, cpu
  assert cpu["xla_peak_bytes"] >= cpu["state_bytes"], cpu
  monkeypatch.setattr(bench_rollout, "memory_stats",
                      lambda: {"bytes_limit": 1000, "bytes_in_use": 550})
  with pytest.raises(MemoryError, match="state, temporaries and outputs not written in place "
                                        "take 0.0 GB"):
    bench_rollout.check_fits(memory, 8)  # 505 fit in the 450 free; 905 do not


def test_a_batch_that_does_not_fit_is_refused_before_its_state_is_made(monkeypatch):
  """The decode loop is compiled from shapes and its state and temporaries counted against the
  device's free memory first: a batch beyond it is one error naming the bytes, and no state is
  allocated (a GPU out-of-memory would retry instead of failing)."""
  import jax
  monkeypatch.setattr(bench_rollout, "memory_stats",
                      lambda: {"bytes_limit": 2**20, "bytes_in_use": 2**19})
  made = []
  real = bench_rollout.decode_state
  monkeypatch.setattr(bench_rollout, "decode_state",
                      lambda *a, **kw: made.append(isinstance(a[-2], jax.core.Tracer))
                      or real(*a, **kw))
  result = bench_rollout.run(1, [64], 48, 16, ["bf16:xla"], preset="tiny")
  assert not result["rows"] and len(result["errors"]) == 1, result
  assert "B=64 does not fit" in result["errors"][0] and "GB are free" in result["errors"][0]
  assert made == [True]  # traced for its shapes, never built


def test_an_error_names_where_it_stopped_and_what_the_allocator_held(monkeypatch):
  """A batch that fits by the count but fails later (out of memory building its state, or in
  the loop) is one error that says at which stage, with the allocator's counts at that moment:
  what the count left out is then there to read."""
  import jax
  stats = {"bytes_limit": 2**40, "bytes_in_use": 3 * 10**9, "peak_bytes_in_use": 5 * 10**9,
           "largest_alloc_size": 10**9}
  monkeypatch.setattr(bench_rollout, "memory_stats", lambda: stats)
  real = bench_rollout.decode_state

  def state(*a, **kw):
    if not isinstance(a[-2], jax.core.Tracer):  # built, not traced: fails as an OOM would
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    return real(*a, **kw)

  monkeypatch.setattr(bench_rollout, "decode_state", state)
  result = bench_rollout.run(1, [8], 16, 4, ["bf16:xla"], preset="tiny")
  assert not result["rows"] and len(result["errors"]) == 1, result
  error = result["errors"][0]
  assert error.startswith("bf16:xla B=8: RuntimeError: RESOURCE_EXHAUSTED"), error
  assert "while building the state" in error, error
  assert ("allocator: 3.0 GB in use, peak 5.0 GB, largest allocation 1.0 GB, "
          "limit 1099.5 GB") in error, error


@pytest.mark.slow  # the scanned decode (bench_rollout's +scan, engine.scan_decode): off by default
def test_stacked_random_weights_are_the_scanned_decodes_layout():
  """Stacked random weights: the layout `pack_weights(..., stacked=True)` gives a uniform
  recipe, the unstacked weights' values layer for layer; a `+scan` row decodes with them."""
  import jax
  import numpy as np

  from trace_jax.models import QuantRecipe, init_params, pack_weights, tiny
  cfg, recipe, ops = tiny(), QuantRecipe.uniform("mxfp4"), bench_rollout.make_ops("xla")
  want = jax.eval_shape(lambda: pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)),
                                             recipe, ops=ops, stacked=True))
  got = bench_rollout.random_weights(cfg, recipe, ops, jax.random.PRNGKey(1), stacked=True)
  flat = bench_rollout.random_weights(cfg, recipe, ops, jax.random.PRNGKey(1))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
  for i, layer in enumerate(flat.layers):
    for a, b in zip(jax.tree.leaves(layer), jax.tree.leaves(got.layers[0])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b[i]))
  with pytest.raises(ValueError, match="one weight format"):
    bench_rollout.random_weights(cfg, QuantRecipe.parse("mxfp4; layers=last:1,weights=nvfp4"),
                                 ops, jax.random.PRNGKey(1), stacked=True)
  result = bench_rollout.run(2, [2], 48, 16, ["bf16:xla+scan"], preset="tiny", slots=96)
  assert not result["errors"] and result["rows"][0]["variant"] == "bf16:xla+scan"


def test_decode_ops_counts_what_surrounds_the_kernels_on_hopper():
  """The census traces the decode step with the Hopper dispatch (the Mosaic matmuls by name,
  the Triton attention and quantize-and-record kernels) on any machine, leaves the dispatch as it was,
  and sees what the "halves" order removes: x's transposes and even/odd slices, not a kernel;
  and what packing q, k and v as one weight, and gate and up as one, removes: a layer's 4 dense
  and 3 grouped kernel calls become 2 and 2."""
  from experiments import decode_ops
  from pallas_kernels import dispatch
  result = decode_ops.run(["mxfp4:pallas+pairs", "mxfp4:pallas", "bf16:pallas",
                           "mxfp4:pallas+apart"], layers=1, batch=16, context=123,
                          preset="small")  # 128 slots
  pairs, halves, bf16, apart = result["rows"]
  assert (halves["kernels"]["fp4_wgmma"], halves["kernels"]["grouped_fp4_wgmma"]) == (2, 2)
  assert (apart["kernels"]["fp4_wgmma"], apart["kernels"]["grouped_fp4_wgmma"]) == (4, 3)
  assert {"fp4_wgmma", "grouped_fp4_wgmma"} <= set(pairs["kernels"])  # (head_dim 32: Triton's
  assert "triton_decode_attention" in pairs["kernels"]  # attention, not the Mosaic one)
  assert pairs["kernels"] == halves["kernels"]
  fewer = {k: pairs["movement"][k] - halves["movement"][k] for k in pairs["movement"]}
  # a layer's 2 dense calls (q, k and v in one, `Fused`; and o) and 2 grouped calls (gate and
  # up in one; down): x^T (4), its even and odd rows (8), the grouped calls' barrier before
  # the gather (2); nothing else
  assert fewer == {**{k: 0 for k in fewer}, "transpose": 4, "slice": 8,
                   "optimization_barrier": 2}
  assert bf16["movement"]["transpose"] == 0 and "fp4_wgmma" not in bf16["kernels"]
  assert dispatch._interpret()  # the patches undone: on CPU the kernels interpret again
  assert "| mxfp4:pallas+pairs |" in decode_ops.table(result)
  with pytest.raises(ValueError, match="pallas or triton variant"):
    decode_ops.run(["mxfp4:xla"], layers=1, batch=4, context=16, preset="small")


def test_the_kernel_engine_computes_with_the_quantize_kernels_values():
  """The FP4 engine's activations come out of the quantize-and-record kernel as values too: no
  XLA pass decodes their codes again (the quant core's E2M1 table look-up and scaling), while
  XLA's engine does exactly that. `--where` lists each site with the bytes it writes."""
  from experiments import decode_ops
  row, = decode_ops.run(["mxfp4:pallas"], layers=1, batch=16, context=123, preset="small",
                        where=True)["rows"]
  assert row["kernels"]["_blocks_kernel"] == 6  # attn_in, k, v, attn_out, moe_in, moe_mid
  sites = {line for _, line, _, _ in row["where"]}
  assert not [s for s in sites if "decode" in s and "codecs" in s], sorted(sites)
  assert all(mb >= 0 for *_, mb in row["where"])


def test_max_runs_each_precision_at_the_largest_batch_its_decode_fits_in_the_same_memory():
  """`--batches=max` (issue 18's "each at the largest batch it fits"): each variant decodes at
  the largest multiple of 8 whose weights, decode state and XLA temporaries fit in one memory
  budget (`--memory_gb`, or the device's), counted from the compiled loop; 8 more would not fit.
  The FP4 cache and weights leave room for more sequences than bf16's."""
  budget = 12 * 2**20
  result = bench_rollout.run(1, ["max"], 240, 16, ["bf16:xla", "mxfp4:xla"], preset="tiny",
                             memory_bytes=budget)
  assert not result["errors"], result["errors"]
  assert result["budget_bytes"] == budget
  rows = {r["variant"]: r for r in result["rows"]}
  for row in rows.values():
    m = row["decode_memory"]
    assert row["largest"] and row["batch"] % 8 == 0 and row["batch"] >= 8
    assert m["weights_bytes"] + m["state_bytes"] + m["temp_bytes"] <= budget, row["variant"]
  import jax

  from trace_jax.models import QuantRecipe
  from trace_jax.models.config import preset
  from trace_jax.rl.rollout import RolloutEngine, SamplingConfig
  cfg, recipe = preset("tiny", n_layers=1), QuantRecipe.uniform("mxfp4")
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=16))
  weights = bench_rollout.random_weights(cfg, recipe, bench_rollout.make_ops("xla"),
                                         jax.random.PRNGKey(0))
  b = rows["mxfp4:xla"]["batch"]
  assert bench_rollout.loop_bytes(engine, weights, b, 240, 16) <= budget
  assert bench_rollout.loop_bytes(engine, weights, b + 8, 240, 16) > budget
  assert rows["mxfp4:xla"]["batch"] > rows["bf16:xla"]["batch"]  # (XLA's CPU temporaries
  # grow with the batch here, the FP4 loop's most: on the GPU its 64 MB do not)
  assert "largest batch in 12 MiB" in bench_rollout.table(result)


def test_max_needs_a_memory_budget_and_bad_batches_are_named(monkeypatch, capsys):
  monkeypatch.setattr(bench_rollout, "memory_stats", lambda: {})  # a device that says nothing
  with pytest.raises(ValueError, match="--batches=max needs a memory budget: --memory_gb"):
    bench_rollout.run(1, ["max"], 48, 16, ["bf16:xla"], preset="tiny")
  for bad in ("64,most", "0", "-8"):
    monkeypatch.setattr(sys, "argv", ["bench_rollout.py", f"--batches={bad}"])
    with pytest.raises(SystemExit):
      bench_rollout.main()
    assert "--batches: " in capsys.readouterr().err


def test_the_json_holds_each_row_as_it_is_measured(tmp_path, monkeypatch):
  """A benchmark cut short (a call's time limit, an allocator's abort) keeps the rows it had
  measured: bench_rollout.json is written again after every row, `complete` false until the
  run has ended."""
  import json
  engine, made = bench_rollout.RolloutEngine, []

  def the_second_is_stopped(*args, **kwargs):
    made.append(1)
    if len(made) == 2:
      raise KeyboardInterrupt
    return engine(*args, **kwargs)

  monkeypatch.setattr(bench_rollout, "RolloutEngine", the_second_is_stopped)
  monkeypatch.setattr(sys, "argv", ["bench_rollout.py", f"--out={tmp_path}", "--layers=1",
                                    "--batches=4", "--context=48", "--steps=4", "--preset=tiny",
                                    "--variants=bf16:xla,mxfp4:xla"])
  with pytest.raises(KeyboardInterrupt):
    bench_rollout.main()
  result = json.load(open(tmp_path / "bench_rollout.json"))
  assert [r["variant"] for r in result["rows"]] == ["bf16:xla"] and not result["complete"]
  monkeypatch.setattr(bench_rollout, "RolloutEngine", engine)
  bench_rollout.main()
  result = json.load(open(tmp_path / "bench_rollout.json"))
  assert [r["variant"] for r in result["rows"]] == ["bf16:xla", "mxfp4:xla"]
  assert result["complete"]
