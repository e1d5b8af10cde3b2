"""The mismatch probe: how far the trainer's log-probs are from the rollout's, and what TRACE buys.

    python -m trace_jax.mismatch --config=configs/mismatch.py[:variant] [--config.key=value]

For each rollout precision, one rollout batch (records for every layer, every site's codes kept
for diagnostics), then the training path's recomputation for each guidance (which layers' records
it uses) and routing replay setting. Prints one JSON object per line, then a table.

On a mesh (`mesh.data`, `mesh.expert`: trace_jax.sharding) the rollout splits the batch over
`data` and the experts over `expert`; under several processes (`dist`: trace_jax.distributed)
each puts its own rows of the batch, every process computes every row's metrics, and process
0 prints and writes them.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from pallas_kernels.dispatch import ATTENTION_KERNELS, KERNELS
from trace_jax import cli, distributed
from trace_jax import sharding as S
from trace_jax.models import QuantRecipe, init_params, load_hf, pack_weights, parse_layers, preset
from trace_jax.models import layers as L
from trace_jax.models.config import PRESETS, ModelConfig
from trace_jax.models.recipe import precisions
from trace_jax.rl import metrics as M
from trace_jax.rl.loop import load_run
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig, pad_prompts
from trace_jax.rl.validate import check_mesh_spans_processes

_CONFIG = cli.ConfigFile("config", "configs/mismatch.py", "probe config file")


def _choices(spec: str, allowed, what: str) -> list[str]:
  items = [s.strip() for s in spec.split(",") if s.strip()]
  bad = [s for s in items if allowed is not None and s not in allowed]
  if bad or not items:
    raise ValueError(f"{what}={spec!r}: choose from {list(allowed)}")
  return items


def load_policy(c: ml_collections.ConfigDict) -> tuple[ModelConfig, dict]:
  if c.checkpoint:
    run, state, _ = load_run(c.checkpoint)
    return run.cfg, state["params"]
  if c.hf_path:
    return load_hf(c.hf_path, dtype="bfloat16")
  cfg = preset(c.model, init_scale=c.init_scale)
  return cfg, init_params(cfg, jax.random.PRNGKey(c.init_seed))


def task_prompts(run, n: int) -> list[list[int]]:
  """The first n eval prompts of an RL run's task (`load_run`), tokenized as the run
  tokenizes them."""
  records = run.eval_records[:n]
  if len(records) < n:
    raise ValueError(f"the run's eval set has {len(records)} prompts, the probe asks for {n}")
  return [run.tok.encode(run.task.prompt(r)) for r in records]


def random_prompts(cfg: ModelConfig, c, rng: np.random.Generator) -> list[list[int]]:
  lens = rng.integers(c.prompt_len_min, c.prompt_len_max + 1, c.batch)
  return [rng.integers(1, cfg.vocab_size, n).tolist() for n in lens]


def load_probe(c: ml_collections.ConfigDict) -> tuple[ModelConfig, dict, list[list[int]]]:
  """The policy and the prompts to probe it on: a run's newest policy and its eval prompts
  (the run read once), or the policy of `load_policy` and random prompts."""
  if c.checkpoint:
    run, state, _ = load_run(c.checkpoint)
    return run.cfg, state["params"], task_prompts(run, c.batch)
  cfg, params = load_policy(c)
  return cfg, params, random_prompts(cfg, c, np.random.default_rng(c.seed))


def mesh(c: ml_collections.ConfigDict):
  """The probe's (data, expert) mesh: one device by default, every device under several
  processes (`check`)."""
  return S.make_mesh(c.mesh.data or None, c.mesh.expert)


def rollout(cfg, params, precision: str, prompts, c, times: dict | None = None):
  """One rollout batch at `precision` with every layer's records and every site's codes, on the
  engine's kernels (`c.kernels`), on `c.mesh`: each process puts its own rows of the batch.
  -> (recipe, batch); `times` gets the seconds of compiling and running it."""
  times = {} if times is None else times
  recipe = QuantRecipe.uniform(precision)
  sampling = SamplingConfig(max_new_tokens=c.max_new_tokens, temperature=c.temperature,
                            top_p=c.top_p)
  engine = RolloutEngine(cfg, recipe, sampling, records="all", collect_codes=True,
                         attn_chunk=c.attn_chunk, kernels=c.kernels,
                         attention_kernel=c.attention_kernel, w4a4=c.w4a4,
                         scan_decode=c.scan_decode)
  start = time.perf_counter()
  weights = jax.jit(functools.partial(pack_weights, cfg, recipe=recipe, ops=engine.ops,
                                      stacked=c.scan_decode))(params)
  m = mesh(c)
  weights = S.place(weights, S.param_shardings(weights, m, S.ROLLOUT_RULES))
  layout = S.Layout(m, S.ROLLOUT_RULES)
  rows = layout.rows(len(prompts))
  tokens, lengths = pad_prompts(prompts)  # the whole batch's width
  tokens, lengths = layout.put((tokens[rows], lengths[rows]), len(prompts))
  key = jax.random.PRNGKey(c.seed)
  jax.block_until_ready(engine.generate(weights, tokens, lengths, key).tokens)  # compile
  times["rollout_compile_s"] = time.perf_counter() - start
  start = time.perf_counter()
  batch = engine.generate(weights, tokens, lengths, key)
  jax.block_until_ready(batch.tokens)
  times["rollout_s"] = time.perf_counter() - start
  return recipe, batch


def _setting(cfg, recipe, temperature, attention, params, batch, guide_L, replay):
  """One (guidance, replay) recomputation and its metrics' arrays: traced once per precision,
  the guidance and replay being arrays (`TrainPath`), so no setting recompiles. `attention`:
  the trainer's (`rl.attention`)."""
  out = recompute(cfg, params, batch.tokens, batch.valid, recipe, records=batch.records,
                  routes=batch.routes, rollout_routes=batch.routes, guide_layers=guide_L,
                  replay=replay, temperature=temperature, collect_codes=True,
                  attention=attention)
  predicts_response = batch.response_mask[:, 1:]  # positions whose outputs score a response
  return {
      "logp": M.logp_mismatch_arrays(batch.logp, out.logp, batch.response_mask),
      "flips": M.flip_counts(cfg, recipe, batch.codes, out.codes, predicts_response,
                             batch.routes, out.routes) if batch.codes else None,
      "route_flips": M.route_flips(batch.routes, out.routes, predicts_response),
  }


def probe_precision(cfg, params, precision: str, prompts, c, times: dict | None = None
                    ) -> list[dict]:
  """One rollout at `precision`, then every (guidance, replay) recomputation of it, on the
  probe's mesh (`c.mesh`, where the params are placed first: a training run's may be spread
  over another); `times` gets the seconds of each phase."""
  times = {} if times is None else times
  params = S.place(params, S.param_shardings(params, mesh(c), S.TRAIN_RULES))
  recipe, batch = rollout(cfg, params, precision, prompts, c, times)
  n_new = int(jnp.sum(batch.response_mask))
  setting = jax.jit(functools.partial(_setting, cfg, recipe, c.temperature, c.attention))
  fed = batch.tokens.shape[0] * (batch.tokens.shape[1] - 1)
  guidances = _choices(c.guidance, None, "guidance") if recipe.recorded_sites(0, 1) else ["none"]
  rows, times["settings_s"] = [], []
  for guidance in guidances:
    layers = parse_layers(guidance, cfg.n_layers, what="guidance")
    guide_L = jnp.asarray([i in layers for i in range(cfg.n_layers)])
    for replay in _choices(c.routing_replay, ("off", "on"), "routing_replay"):
      start = time.perf_counter()
      got = S.fetch(setting(params, batch, guide_L, jnp.asarray(replay == "on")))
      row = {"rollout_quant": precision, "records": guidance, "routing_replay": replay == "on",
             "attention": c.attention}
      row.update(M.logp_mismatch_summary(got["logp"], batch.response_mask,
                                         prompt_width=batch.prompt_width, n_buckets=c.n_buckets))
      if batch.codes:
        row.update(M.flip_rates_summary(got["flips"], batch.codes, batch.response_mask[:, 1:],
                                        prompt_width=batch.prompt_width, n_buckets=c.n_buckets))
      row["mismatch/route_flip_rate"] = float(got["route_flips"])
      row["record/bytes_per_token"] = M.record_bytes_per_token(
          {i: batch.records[i] for i in layers}, fed)
      row["rollout/tokens_per_s"] = n_new / times["rollout_s"]
      row["rollout/response_tokens"] = n_new
      row.update({f"rollout/{name}": int(n) for name, n in batch.stats.items()})
      rows.append(row)
      times["settings_s"].append(time.perf_counter() - start)
  return rows


def phase_line(precision: str, n: int, total_s: float, times: dict) -> str:
  """`# mxfp4: 6 settings in 40s (...)`: where the time went."""
  s = times["settings_s"]
  rest = f", then {sum(s[1:]) / (len(s) - 1):.2f}s each" if len(s) > 1 else ""
  return (f"# {precision}: {n} settings in {total_s:.0f}s (rollout: "
          f"{times['rollout_compile_s']:.1f}s with compiling, {times['rollout_s']:.2f}s timed; "
          f"settings: {s[0]:.1f}s the first{rest})")


def check(c: ml_collections.ConfigDict) -> None:
  """Every bad value fails here, by name, before any work (after `distributed.initialize`:
  the mesh is checked against the devices of every process)."""
  distributed.check(c.dist)
  _choices(c.precisions, precisions(), "precisions")
  for key, allowed in (("kernels", KERNELS), ("attention_kernel", ATTENTION_KERNELS),
                       ("attention", tuple(L.ATTENTIONS))):
    if c[key] not in allowed:
      raise ValueError(f"{key}={c[key]!r}: choose from {list(allowed)}")
  if c.w4a4 and c.kernels != "pallas":
    raise ValueError(f"w4a4 runs the Pallas W4A4 kernels: it needs kernels=pallas (got "
                     f"{c.kernels!r})")
  for g in _choices(c.guidance, None, "guidance"):
    parse_layers(g, 10**6, what="guidance")
  _choices(c.routing_replay, ("off", "on"), "routing_replay")
  if c.checkpoint and not os.path.isdir(os.path.join(c.checkpoint, "checkpoints")):
    raise ValueError(f"checkpoint={c.checkpoint!r}: not an RL run's workdir (no checkpoints/)")
  if c.hf_path and not os.path.isfile(os.path.join(c.hf_path, "config.json")):
    raise ValueError(f"hf_path={c.hf_path!r} has no config.json; expected a Hugging Face "
                     "Qwen3-MoE directory")
  if not (c.checkpoint or c.hf_path) and c.model not in PRESETS:
    raise ValueError(f"model={c.model!r}: choose one of {', '.join(sorted(PRESETS))}, or set "
                     "hf_path or checkpoint")
  for name in ("batch", "max_new_tokens", "n_buckets", "attn_chunk"):
    if not c[name] > 0:
      raise ValueError(f"{name} must be > 0, got {c[name]!r}")
  if not 1 <= c.prompt_len_min <= c.prompt_len_max:
    raise ValueError(f"need 1 <= prompt_len_min ({c.prompt_len_min}) <= prompt_len_max "
                     f"({c.prompt_len_max})")
  if c.temperature < 0 or not 0 < c.top_p <= 1:
    raise ValueError(f"temperature must be >= 0 and top_p in (0, 1]; got {c.temperature}, "
                     f"{c.top_p}")
  n, expert = jax.device_count(), c.mesh.expert
  data = c.mesh.data or n // max(expert, 1)
  if expert < 1 or data < 1 or data * expert > n:
    raise ValueError(f"mesh.data={c.mesh.data} x mesh.expert={expert} needs more than the {n} "
                     "devices there are")
  check_mesh_spans_processes(data, expert, n)
  if c.batch % data:
    raise ValueError(f"batch={c.batch} does not split over mesh.data={data}")


def run(c: ml_collections.ConfigDict, log=print, probe=None) -> list[dict]:
  """The rows of every (precision, guidance, replay) setting; `probe`: what `load_probe(c)`
  returns, where the caller has it already."""
  check(c)
  chosen = _choices(c.precisions, precisions(), "precisions")
  cfg, params, prompts = probe or load_probe(c)
  rows = []
  for precision in chosen:
    start, times = time.perf_counter(), {}
    new = probe_precision(cfg, params, precision, prompts, c, times)
    log(phase_line(precision, len(new), time.perf_counter() - start, times))
    for row in new:
      log(json.dumps(row))
    rows += new
  return rows


TABLE = [
    ("rollout_quant", "rollout", "{}"), ("records", "records", "{}"),
    ("routing_replay", "replay", "{}"), ("mismatch/kl_k3", "KL k3", "{:.2e}"),
    ("mismatch/logp_abs_diff_mean", "|dlogp| mean", "{:.2e}"),
    ("mismatch/prob_abs_diff_max", "|dp| max", "{:.3f}"),
    ("mismatch/flip_rate", "flip rate", "{:.4f}"), ("recorded_flip_rate", "flips@recorded", "{:.4f}"),
    ("mismatch/route_flip_rate", "route flips", "{:.4f}"),
    ("record/bytes_per_token", "record B/token", "{:.0f}"),
    ("kl_first_last", "KL first->last bucket", "{}"),
]


def recorded_flip_rate(row: dict, n_layers: int) -> float | None:
  """Mean flip rate over the sites of the layers that had records (None without records)."""
  layers = parse_layers(row["records"], n_layers)
  rates = [v for k, v in row.items()
           if k.startswith("mismatch/flip_rate/") and int(k.rsplit("_", 1)[1]) in layers]
  return float(np.mean(rates)) if rates else None


def table(rows: list[dict], n_layers: int) -> str:
  def cell(row, key, fmt):
    if key == "recorded_flip_rate":
      v = recorded_flip_rate(row, n_layers)
    elif key == "kl_first_last":
      b = [x for x in row["mismatch/kl_k3_by_position"] if x is not None]
      v = f"{b[0]:.1e} -> {b[-1]:.1e}" if b else None
      fmt = "{}"
    else:
      v = row.get(key)
    return "-" if v is None else fmt.format(v)

  head = [t[1] for t in TABLE]
  body = [[cell(r, k, f) for k, _, f in TABLE] for r in rows]
  widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
  fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # absl would log every backend JAX probes for
  c = _CONFIG.value
  with cli.bad_input():
    distributed.initialize(c.dist)  # before anything asks JAX for its devices
  with distributed.exit_at_once_on_failure():
    with cli.bad_input():
      check(c)
    start = time.perf_counter()
    probe = load_probe(c)
    primary = distributed.is_primary()
    rows = run(c, log=print if primary else lambda *_: None, probe=probe)
    if not primary:
      return
    if c.output:
      with open(c.output, "w") as fh:
        for row in rows:
          fh.write(json.dumps(row) + "\n")
    print(table(rows, probe[0].n_layers))
    print(f"# {len(rows)} settings, {time.perf_counter() - start:.0f}s, jax {jax.__version__} "
          f"on {jax.default_backend()}, {jax.device_count()} devices in {jax.process_count()} "
          "processes")


if __name__ == "__main__":
  cli.run(main, _CONFIG)
