"""The mismatch probe end to end on the tiny model."""

import functools
import json

import jax
import pytest

from configs import mismatch as mismatch_config
from trace_jax import mismatch
from trace_jax.models import QuantRecipe
from trace_jax.rl import metrics as M


def quick_config():
  c = mismatch_config.get_config("quick,max_new_tokens=24")
  c.precisions = "bf16,mxfp4"
  c.guidance = "none,last:1,all"
  return c


@pytest.fixture(scope="module")
def probe():
  """The probe's rows, how often it traced the training path, and its rollout batches."""
  traces, batches = [], {}

  def counting_recompute(*args, **kwargs):  # runs once per trace under jit
    traces.append(1)
    return recompute(*args, **kwargs)

  class Engine(mismatch.RolloutEngine):
    def generate(self, *args, **kwargs):
      batches[self.recipe] = batch = super().generate(*args, **kwargs)
      return batch

  recompute = mismatch.recompute
  lines = []
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(mismatch, "recompute", counting_recompute)
    mp.setattr(mismatch, "RolloutEngine", Engine)
    out = mismatch.run(quick_config(), log=lines.append)
  assert sum(1 for line in lines if line.startswith("{")) == len(out)
  return {"rows": out, "traces": len(traces), "batches": batches, "lines": lines}


@pytest.fixture(scope="module")
def rows(probe):
  return probe["rows"]


def test_rows_have_the_design_keys(rows):
  assert len(rows) == 2 + 6  # bf16: no records to guide with; mxfp4: 3 guidances x 2 replays
  for row in rows:
    json.dumps(row)
    for key in ("rollout_quant", "records", "routing_replay", "mismatch/kl_k3",
                "mismatch/logp_abs_diff_mean", "mismatch/prob_abs_diff_max",
                "mismatch/route_flip_rate", "mismatch/kl_k3_by_position",
                "record/bytes_per_token"):
      assert key in row, key
  mx = [r for r in rows if r["rollout_quant"] == "mxfp4"]
  assert all("mismatch/flip_rate/attn_in/layer_1" in r and "mismatch/flip_rate" in r for r in mx)


def test_the_picture(rows):
  get = lambda q, rec, replay: next(r for r in rows if (r["rollout_quant"], r["records"],
                                                        r["routing_replay"]) == (q, rec, replay))
  trace_all, unguided = get("mxfp4", "all", True), get("mxfp4", "none", True)
  assert mismatch.recorded_flip_rate(trace_all, n_layers=2) == 0.0
  assert trace_all["mismatch/flip_rate"] == 0.0 and unguided["mismatch/flip_rate"] > 0
  assert trace_all["mismatch/kl_k3"] < 0.2 * unguided["mismatch/kl_k3"]
  assert (trace_all["record/bytes_per_token"] > get("mxfp4", "last:1", True)["record/bytes_per_token"]
          > unguided["record/bytes_per_token"] == 0)
  assert get("mxfp4", "all", False)["mismatch/route_flip_rate"] >= 0.0
  assert trace_all["mismatch/route_flip_rate"] == 0.0


def test_each_precision_traces_the_training_path_once(probe):
  """Every (guidance, replay) setting runs one compiled program (guidance and replay are
  arrays), not one compilation per setting: on a GPU that was most of the probe's time."""
  assert probe["traces"] == 2  # bf16 and mxfp4, for 1 + 6 settings
  assert [line.split(":")[0] for line in probe["lines"] if line.startswith("#")] == [
      "# bf16", "# mxfp4"]
  assert all("settings: " in line for line in probe["lines"] if line.startswith("#"))


def test_rows_are_those_of_one_recomputation_per_setting(probe):
  """The guide mask and the replay flag change nothing: a row equals the row of a training
  path given only that guidance's records and, replay off, no routes (one program each)."""
  c = quick_config()
  cfg, params = mismatch.load_policy(c)
  recipe = QuantRecipe.uniform("mxfp4")
  batch = probe["batches"][recipe]
  train = jax.jit(functools.partial(mismatch.recompute, cfg, recipe=recipe,
                                    temperature=c.temperature, collect_codes=True))
  predicts = batch.response_mask[:, 1:]
  for guidance, replay in (("last:1", False), ("all", True)):
    records = {i: batch.records[i] for i in mismatch.parse_layers(guidance, cfg.n_layers)}
    out = train(params, batch.tokens, batch.valid, records=records,
                routes=batch.routes if replay else None, rollout_routes=batch.routes)
    want = M.logp_mismatch(batch.logp, out.logp, batch.response_mask,
                           prompt_width=batch.prompt_width, n_buckets=c.n_buckets)
    want.update(M.flip_rates(cfg, recipe, batch.codes, out.codes, predicts,
                             routes_rollout=batch.routes, routes_train=out.routes,
                             prompt_width=batch.prompt_width, n_buckets=c.n_buckets))
    want["mismatch/route_flip_rate"] = M.route_flip_rate(batch.routes, out.routes, predicts)
    got = next(r for r in probe["rows"] if (r["rollout_quant"], r["records"],
                                            r["routing_replay"]) == ("mxfp4", guidance, replay))
    assert {k: got[k] for k in want} == want, (guidance, replay)
    assert [k for k in got if k in want] == list(want)  # the JSON lines' order too
  # last:1 leaves layer 0 to round to nearest, where the two paths' codes differ
  assert next(r for r in probe["rows"] if r["records"] == "last:1")[
      "mismatch/flip_rate/attn_out/layer_0"] > 0


def test_the_kernels_key_reaches_the_engine_and_the_weight_sync(monkeypatch):
  seen = {}

  class Stop(Exception):
    pass

  def pack_weights(cfg, params, recipe, ops, stacked):
    seen["weights_ops"], seen["stacked"] = ops, stacked
    raise Stop

  class Engine(mismatch.RolloutEngine):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      seen["kernels"], seen["engine_ops"] = kwargs["kernels"], self.ops

  monkeypatch.setattr(mismatch, "RolloutEngine", Engine)
  monkeypatch.setattr(mismatch, "pack_weights", pack_weights)
  c = mismatch_config.get_config("quick,kernels=pallas,precisions=mxfp4")
  with pytest.raises(Stop):
    mismatch.run(c)
  assert seen["kernels"] == "pallas" and seen["weights_ops"] is seen["engine_ops"]
  assert seen["stacked"] is False  # unrolled decode: weights a list of layers
  assert type(seen["engine_ops"]).__name__ == "KernelOps"


def test_a_scanned_decode_gives_the_rows_of_the_unrolled_one(rows):
  """`scan_decode` (the sweep's deep policies compile in the same time at every depth): the
  same rollout, so the same rows, as the unrolled decode step."""
  c = quick_config()
  c.precisions, c.scan_decode = "mxfp4", True
  scanned = mismatch.run(c)
  unrolled = [r for r in rows if r["rollout_quant"] == "mxfp4"]
  assert len(scanned) == len(unrolled) == 6
  for a, b in zip(scanned, unrolled):
    assert {k: v for k, v in a.items() if not k.endswith("_s")} == {
        k: v for k, v in b.items() if not k.endswith("_s")}


def test_a_policy_on_another_mesh_is_probed_on_the_probe_s(rows):
  """probe_precision with params where a training run left them (every device of the run's
  mesh; the ablation probes its trained policies so) moves them to the probe's mesh: the
  same rows as the probe of params on one device."""
  from trace_jax import sharding as S
  c = quick_config()
  c.precisions = "mxfp4"
  cfg, params, prompts = mismatch.load_probe(c)
  assert jax.device_count() > 1  # tests/conftest.py: 8 CPU devices
  spread = S.place(params, S.param_shardings(params, S.make_mesh(None, 1), S.TRAIN_RULES))
  got = mismatch.probe_precision(cfg, spread, "mxfp4", prompts, c)
  want = [r for r in rows if r["rollout_quant"] == "mxfp4"]
  assert [r["mismatch/kl_k3"] for r in got] == [r["mismatch/kl_k3"] for r in want]


def test_the_trainers_fused_attention_is_probed_as_the_trainer_takes_it(rows):
  """`attention=fused` (the trainer's `rl.attention`): the same rollouts recomputed with
  jax.nn.dot_product_attention; records for every layer still leave no code flipped, and the
  unguided rows are the full attention's up to rounding."""
  c = quick_config()
  c.precisions, c.attention = "mxfp4", "fused"
  fused = mismatch.run(c)
  full = [r for r in rows if r["rollout_quant"] == "mxfp4"]
  assert [(r["records"], r["routing_replay"]) for r in fused] == [
      (r["records"], r["routing_replay"]) for r in full]
  for a, b in zip(fused, full):
    assert a["attention"] == "fused" and b["attention"] == "full"
    if a["records"] == "all" and a["routing_replay"]:
      assert a["mismatch/flip_rate"] == 0.0
    assert abs(a["mismatch/kl_k3"] - b["mismatch/kl_k3"]) <= 0.5 * b["mismatch/kl_k3"] + 1e-6


def test_table_renders(rows):
  text = mismatch.table(rows, n_layers=2)
  assert text.count("\n") == len(rows) + 1 and "mxfp4" in text


def test_bad_choices_fail_before_work():
  c = mismatch_config.get_config("quick")
  c.precisions = "bf16,fp4"
  with pytest.raises(ValueError, match="precisions='bf16,fp4'.*mxfp4"):
    mismatch.run(c)
  c = mismatch_config.get_config("quick")
  c.guidance = "last:x"
  with pytest.raises(ValueError, match="guidance='last:x'"):
    mismatch.run(c)
  c = mismatch_config.get_config("quick,kernels=cuda")
  with pytest.raises(ValueError,
                     match=r"kernels='cuda': choose from \['xla', 'pallas', 'tokamax'\]"):
    mismatch.run(c)
  c = mismatch_config.get_config("quick,attention=flash")
  with pytest.raises(ValueError, match=r"attention='flash': choose from \['full', 'fused'\]"):
    mismatch.run(c)


def test_main_loads_the_policy_once(tmp_path, monkeypatch, capsys):
  """The table's layer count comes from the policy the probe ran, not from loading it again
  (a Hugging Face checkpoint or a run's, read whole each time)."""
  (tmp_path / "config.json").write_text("{}")  # the probe's check looks for the file only
  c = mismatch_config.get_config(f"quick,precisions=bf16,hf_path={tmp_path}")
  loads, seen = [], []
  tiny = mismatch.load_policy(mismatch_config.get_config("quick"))

  def load_policy(config):
    loads.append(config.hf_path)
    return tiny

  def probe_precision(cfg, params, precision, prompts, config, times):
    seen.append(cfg)
    times.update(rollout_compile_s=0.0, rollout_s=0.0, settings_s=[0.0])
    return [{"rollout_quant": precision, "records": "none", "routing_replay": False,
             "mismatch/kl_k3_by_position": []}]

  monkeypatch.setattr(mismatch, "load_policy", load_policy)
  monkeypatch.setattr(mismatch, "probe_precision", probe_precision)
  monkeypatch.setattr(mismatch._CONFIG, "_value", c)
  mismatch.main([])
  assert loads == [str(tmp_path)] and seen == [tiny[0]]
  assert "| bf16" in capsys.readouterr().out
