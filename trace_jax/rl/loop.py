"""The RL run: a supervised warm start, then GRPO with the mode's rollout and trainer.

`train(config, workdir)` is the whole run; it resumes from the newest checkpoint in `workdir`.
The policy starts from a random init, or from a Hugging Face checkpoint (`model.hf_path`:
trace_jax.rl.hf_policy); or RL starts where another run's warm start ended (`sft.init_from`),
so that runs of several modes start RL from one policy.
Every step writes a row of DESIGN section 7 metrics; a step's data and sampling key are functions
of the step number, so a resumed run continues exactly as an uninterrupted one. A SIGTERM or
Ctrl-C stops the run between steps, with a checkpoint of the steps done.

Under several processes (trace_jax.distributed) every process runs this same loop on its share
of the devices: each loads and scores its own rows of every batch (`sharding.Layout`), all take
part in every program, checkpoint save and restore, and process 0 alone writes metrics.jsonl,
TensorBoard, the plots and the run's files. They agree on the step to resume from and, after
every step, on whether a signal stops the run (a signal to any one of them stops all).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from tqdm import tqdm

from trace_jax import determinism
from trace_jax import distributed as D
from trace_jax import sharding as S
from trace_jax.configs import MOVED, SPLIT_FROM
from trace_jax.data.pipeline import demonstration, record_batches, supervised_batch
from trace_jax.data.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer_json
from trace_jax.models import ModelConfig, init_params, pack_weights
from trace_jax.rl import checkpoint, grpo, hf_policy
from trace_jax.rl import metrics as M
from trace_jax.rl.checkpoint import Checkpointer
from trace_jax.rl.defaults import base_config
from trace_jax.rl.episodes import episode_length, greedy_accuracy, rollout
from trace_jax.rl.plots import plot_run
from trace_jax.rl.preemption import Interrupted, StopBetweenSteps
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig
from trace_jax.rl.summary import format_summary, postfix, summarize
from trace_jax.rl.trainer import RLOptions, Trainer, make_optimizer, mode_setup
from trace_jax.rl.validate import make_task, validate
from trace_jax.rl.writer import MetricsWriter, read_metrics


class Run:
  """Everything a step needs, built once from the config."""

  def __init__(self, c: ml_collections.ConfigDict, workdir: str, tokenizer,
               model: ModelConfig | None = None):
    """`model`: the policy's config as a checkpoint saved it (default: from the config)."""
    self.c, self.workdir, self.tok = c, workdir, tokenizer
    self.task = make_task(c.task)
    # once, then read: processes sharing a data_dir must not prepare it at the same time
    self.sources = D.primary_first(lambda: self.task.prepare(c.data_dir or None), "data")
    if c.model.chat_template:
      self.task = hf_policy.ChatPrompts(self.task, tokenizer)
    self.cfg = model or hf_policy.model_config(c, tokenizer)
    self.setup = mode_setup(c.rl.mode, c.rl.fp4, c.rl.trace_layers, c.rl.rollout_recipe,
                            c.rl.train_recipe)
    options = RLOptions(clip_eps=c.rl.clip_eps, correction=c.rl.correction,
                        correction_cap=c.rl.correction_cap, kl_coef=c.rl.kl_coef,
                        aux_coef=c.rl.aux_coef, minibatches=c.rl.minibatches,
                        routing_replay=c.rl.routing_replay, temperature=c.rl.temperature,
                        remat=c.rl.remat, attention=c.rl.attention,
                        sft_attention=c.sft.attention)
    optimizer = make_optimizer(c.sft.lr, c.rl.lr, c.sft.steps, sft_warmup=c.sft.warmup_steps,
                               max_grad_norm=c.optim.max_grad_norm,
                               weight_decay=c.optim.weight_decay, b2=c.optim.b2)
    self.trainer = Trainer(self.cfg, self.setup, optimizer, options)
    # single-turn answers end at <eos>; multi-turn episodes run a fixed number of tokens
    multi = self.task.max_turns > 1
    self.new_tokens = episode_length(self.task) if multi else c.rl.max_new_tokens
    stops = () if multi else tuple(tokenizer.stop_ids)
    sampling = SamplingConfig(max_new_tokens=self.new_tokens, temperature=c.rl.temperature,
                              top_p=c.rl.top_p, stop_tokens=stops, pad_id=tokenizer.pad_id)
    engine = functools.partial(RolloutEngine, self.cfg, self.setup.rollout,
                               kernels=self.c.engine.kernels,
                               attention_kernel=self.c.engine.attention_kernel,
                               scan_decode=self.c.engine.scan_decode, w4a4=self.c.engine.w4a4,
                               fold_scales=self.c.engine.fold_scales,
                               triton_backend=self.c.engine.triton_backend)
    self.engine = engine(sampling, records=self.setup.records)
    self.diag_engine = engine(sampling, records=self.setup.records, collect_codes=True)
    self.eval_engine = engine(dataclasses.replace(sampling, temperature=0.0))
    self.sync = jax.jit(functools.partial(pack_weights, self.cfg, recipe=self.setup.rollout,
                                          ops=self.engine.ops, stacked=c.engine.scan_decode))
    self.codes = jax.jit(functools.partial(
        recompute, self.cfg, recipe=self.setup.train, temperature=c.rl.temperature,
        collect_codes=True, code_recipe=self.setup.rollout, attention=c.rl.attention))
    self.mesh = S.make_mesh(c.mesh.data or None, c.mesh.expert)
    self.rollout_layout = S.Layout(self.mesh, S.ROLLOUT_RULES)
    self.train_layout = S.Layout(self.mesh, S.TRAIN_RULES)
    self.sft_batches = record_batches(self.sources["train"], c.sft.batch_size, c.seed)
    self._prepared = None  # (step, its placed batch): the warm start's next batch, built early
    self.rl_batches = record_batches(self.sources["train"], c.rl.prompts_per_step, c.seed + 1)
    n_eval = min(c.eval.size, len(self.sources["eval"]))
    self.eval_records = [self.sources["eval"][i] for i in range(n_eval)]

  # -- placement ---------------------------------------------------------------------------

  def place_state(self, state):
    return S.place(state, S.param_shardings(state, self.mesh, S.TRAIN_RULES))

  def place_batch(self, batch, rules):
    routes = batch.pop("routes", None)
    placed = S.place(batch, S.batch_shardings(batch, self.mesh, rules))
    if routes is not None:
      placed["routes"] = S.place(routes, S.batch_shardings(routes, self.mesh, rules, 1))
    return placed

  def rollout_weights(self, params):
    weights = self.sync(params)
    return S.place(weights, S.param_shardings(weights, self.mesh, S.ROLLOUT_RULES))

  def initial_state(self, reference: bool = False, *, random: bool = False) -> dict:
    """The state before step 0 (the checkpoint's weights with model.hf_path, unless `random`);
    with `reference`, shaped as from the first RL step on."""
    init_key, key = jax.random.split(jax.random.PRNGKey(self.c.seed))
    groups = self.setup.layer_groups(self.cfg.n_layers)
    if self.c.model.hf_path and not random:
      params = hf_policy.load_params(self.c.model.hf_path, self.cfg, self.mesh, groups)
    else:
      params = init_params(self.cfg, init_key, groups)
    state = {**self.trainer.init_state(params), "key": key}
    return self.trainer.with_reference(state) if reference else state

  def abstract_state(self, reference: bool = False) -> dict:
    """The shapes, dtypes and training shardings of `initial_state`, computing nothing: what
    a checkpoint restores into."""
    shapes = jax.eval_shape(functools.partial(self.initial_state, reference, random=True))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, S.param_shardings(shapes, self.mesh, S.TRAIN_RULES))

  def has_reference(self, step: int) -> bool:
    """Whether the state after `step` steps holds the KL penalty's reference: the policy where
    RL starts, so from the first RL step on (not carried through the warm start)."""
    return self.c.rl.kl_coef > 0 and step > self.c.sft.steps

  # -- steps -------------------------------------------------------------------------------

  def sft_batch(self, step):
    """Warm-start step `step`'s batch of demonstrations, placed: the one `sft_step` prepared
    while the previous step ran, or built now."""
    if self._prepared is not None and self._prepared[0] == step:
      return self._prepared[1]
    records = self.sft_batches[step]
    mine = records[self.train_layout.rows(len(records))]  # this process's rows
    batch = supervised_batch(self.tok, [self.task.prompt(r) for r in mine],
                             [demonstration(self.task, r) for r in mine],
                             self.c.max_prompt_len, self.new_tokens)
    return self.train_layout.put(batch, len(records))

  def sft_step(self, state, step):
    state, metrics = self.trainer.sft_step(state, self.sft_batch(step))
    # the next step's batch is built on the host while this one runs on the device (the
    # metrics below wait for it): 256-turn episodes take a second of Python a batch. One that
    # cannot be built is left to its own step, which builds it again and raises there
    self._prepared = None
    if step + 1 < self.c.sft.steps:
      try:
        self._prepared = (step + 1, self.sft_batch(step + 1))
      except Interrupted:  # a second signal: at once
        raise
      except Exception:  # noqa: BLE001 (raised again by step + 1, after this step's row)
        pass
    return state, {k: float(v) for k, v in metrics.items()}

  def rl_step(self, state, step):
    c, g = self.c, self.c.rl.group_size
    if c.rl.kl_coef > 0 and "ref_params" not in state:
      # RL starts here, from this policy; placed as a restored state is, so that a resumed run
      # runs the programs an uninterrupted one compiled
      state = self.place_state(self.trainer.with_reference(state))
    records = [r for r in self.rl_batches[step - c.sft.steps] for _ in range(g)]
    diag = c.log.flip_rate_every and (step - c.sft.steps) % c.log.flip_rate_every == 0
    engine = self.diag_engine if diag else self.engine
    start = time.perf_counter()
    batch, rewards = rollout(engine, self.rollout_weights(state["params"]), self.task, records,
                             self.tok, c.max_prompt_len, jax.random.fold_in(state["key"], step),
                             self.rollout_layout)
    jax.block_until_ready(batch.tokens)
    rollout_s = time.perf_counter() - start
    predicts = batch.response_mask[:, 1:]
    flips = {}
    if diag and batch.codes:  # the trainer's codes for the policy that made the rollout
      records_used = {i: batch.records[i] for i in self.trainer.record_layers
                      if i in batch.records}
      routes = batch.routes if c.rl.routing_replay else None
      out = self.codes(state["params"], batch.tokens, batch.valid, records=records_used,
                       routes=routes, rollout_routes=batch.routes)
      flips = M.flip_rates(self.cfg, self.setup.rollout, batch.codes, out.codes, predicts,
                           routes_rollout=batch.routes, routes_train=out.routes)
    adv = grpo.group_advantages(jnp.asarray(rewards), g)
    train_batch = self.place_batch(
        {"tokens": batch.tokens, "valid": batch.valid, "response_mask": batch.response_mask,
         "logp": batch.logp, "advantages": adv, "records": batch.records,
         "routes": batch.routes}, S.TRAIN_RULES)
    start = time.perf_counter()
    state, metrics, old = self.trainer.rl_step(state, train_batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    train_s = time.perf_counter() - start
    n_resp = int(jnp.sum(batch.response_mask))
    metrics.update({
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "rollout/tokens_per_s": n_resp / rollout_s, "rollout/response_tokens": n_resp,
        "time/rollout_s": rollout_s, "time/train_s": train_s,
        "record/bytes_per_token": M.record_bytes_per_token(
            batch.records, batch.tokens.shape[0] * (batch.tokens.shape[1] - 1)),
        "mismatch/route_flip_rate": M.route_flip_rate(batch.routes, old["routes"], predicts),
    })
    metrics.update({f"rollout/{name}": int(n) for name, n in batch.stats.items()})
    metrics.update(M.logp_mismatch(batch.logp, old["logp"], batch.response_mask,
                                   prompt_width=batch.prompt_width, n_buckets=4))
    metrics.update(flips)
    return state, metrics

  def evaluate(self, params) -> dict:
    """Greedy accuracy of the policy as the rollout engine runs it (FP4 in the FP4 modes)."""
    return greedy_accuracy(self.eval_engine, self.rollout_weights(params), self.task,
                           self.eval_records, self.tok, self.c.max_prompt_len,
                           self.c.eval.batch_size, self.rollout_layout)


def _config_json(c) -> dict:
  return json.loads(c.to_json())


def peak_memory() -> dict[str, float]:
  """{"memory/peak_gib": the most memory this process has held on its first device so far}
  where the backend counts it (a GPU's allocator; {} on CPU): what a run needs of a device, to
  size the runs that share one (experiments/ablation.py --jobs)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" not in stats:
    return {}
  return {"memory/peak_gib": stats["peak_bytes_in_use"] / 2**30}


def saved_config(saved: dict) -> ml_collections.ConfigDict:
  """A run's saved config, with the keys added to the schema since it was written at their
  defaults (the behaviour that run had), and keys that moved where they are now, so that older
  runs load and resume."""
  saved = json.loads(json.dumps(saved))  # a copy to move keys in
  for old, new in MOVED.items():
    (old_section, old_key), (new_section, new_key) = old.split("."), new.split(".")
    if old_key in saved.get(old_section, {}):
      saved.setdefault(new_section, {})[new_key] = saved[old_section].pop(old_key)
  for new, old in SPLIT_FROM.items():
    (new_section, new_key), (old_section, old_key) = new.split("."), old.split(".")
    if new_key not in saved.get(new_section, {}) and old_key in saved.get(old_section, {}):
      saved.setdefault(new_section, {})[new_key] = saved[old_section][old_key]
  c = base_config()
  c.update(saved)
  return c


def _reason(e: BaseException) -> str:
  """The first line of the innermost error under `e` (orbax wraps TensorStore's)."""
  for _ in range(16):  # a chain, not a cycle
    if (e.__cause__ or e.__context__) is None:
      break
    e = e.__cause__ or e.__context__
  lines = str(e).strip().splitlines() or [""]
  return f"{type(e).__name__}: {lines[0][:300]}"


def _open(c, workdir: str, ckpt: Checkpointer, log=print, set_aside: bool = False):
  """The run of `c` in `workdir`, its state and step: from the newest checkpoint that can be
  read, or fresh. Each one that cannot (a truncated file) is reported by name in one line, and
  with `set_aside` renamed out of the way of the run's next saves; one that reads but holds
  another layout stops the run (checkpoint.LayoutMismatch), as does any other error."""
  run, state, start, unreadable = None, None, 0, []
  for step in ckpt.steps():
    try:
      meta = ckpt.meta(step)
    except Exception as e:
      if not checkpoint.unreadable(e):
        raise
      unreadable.append((step, e))
      continue
    if run is None:
      _check_same_config(_config_json(saved_config(meta["config"])), _config_json(c), workdir)
      model = ModelConfig(**meta["model"]) if "model" in meta else None
      run = Run(c, workdir, load_tokenizer_json(meta["tokenizer"]), model)
    try:  # another layout (LayoutMismatch), an OSError, running out of memory: raised
      state, _ = ckpt.restore(step, run.abstract_state(reference=run.has_reference(step)))
    except Exception as e:
      if not checkpoint.unreadable(e):
        raise
      unreadable.append((step, e))
      continue
    start = step
    break
  if state is None and unreadable:
    raise checkpoint.CannotResume(
        f"no checkpoint in {ckpt.directory} can be read: " + "; ".join(
            f"step {step}: {_reason(e)}" for step, e in unreadable) + "; move them aside (mv "
        f"{ckpt.path(unreadable[0][0])} {ckpt.path(unreadable[0][0])}.unreadable, each of them) "
        "to start the run over, or use a new --workdir")
  for step, e in unreadable:
    log(f"checkpoint {ckpt.path(step)} cannot be read ({_reason(e)}); "
        + (f"set aside as {ckpt.set_aside(step)}" if set_aside else "skipped"))
  if state is None and c.sft.init_from:
    run, state = _warm_started(c, workdir)
    start = c.sft.steps
  elif state is None:
    tokenizer = (HFTokenizer.from_directory(c.model.hf_path) if c.model.hf_path
                 else CharTokenizer(make_task(c.task).alphabet()))
    run = Run(c, workdir, tokenizer)
    state = run.initial_state()
  return run, run.place_state(state), start


# the keys a warm start does not read (they act from RL on, or say where and how the run runs):
# a run may take its warm start from a run that differs from it there (sft.init_from), and
# nowhere else. rl.aux_coef, rl.max_new_tokens and rl.remat are read by the warm start (its
# loss's attention is sft.attention; rl.attention acts from RL on)
_AFTER_WARM_START = ("rl.", "eval.", "log.", "checkpoint.", "engine.", "mesh.", "dist.",
                     "data_dir", "deterministic", "sft.init_from")
_READ_BY_WARM_START = ("rl.aux_coef", "rl.max_new_tokens", "rl.remat")


def _warm_started(c, workdir: str):
  """(Run, state) of `c` after the warm start that run `c.sft.init_from` made: its checkpoint
  of step `c.sft.steps`, in this run's layout (its layers regrouped where the modes group them
  otherwise). Raises ValueError, naming the keys, where that run's config has another warm
  start."""
  source = Checkpointer(c.sft.init_from)
  try:
    meta = source.meta(c.sft.steps)
    theirs, mine = _flat(_config_json(saved_config(meta["config"]))), _flat(_config_json(c))
    diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k)
                  and (k in _READ_BY_WARM_START or not k.startswith(_AFTER_WARM_START)))
    if diff:
      raise ValueError(f"sft.init_from={c.sft.init_from!r}: that run's warm start is another "
                       f"than this config's (keys {diff}: " + ", ".join(
                           f"{k}={theirs.get(k)!r} there" for k in diff[:3]) + ")")
    model = ModelConfig(**meta["model"]) if "model" in meta else None
    run = Run(c, workdir, load_tokenizer_json(meta["tokenizer"]), model)
    state, _ = source.restore(c.sft.steps, run.abstract_state())
  finally:
    source.close()
  return run, state


def _warm_start_rows(run, state, source: str, steps: int) -> list[tuple[int, dict]]:
  """The metric rows of the warm start that run `source` made, as this run's: the same, but its
  evaluations are left out, and the last row's made again by this run's engine (its rollout
  precision, e.g. MXFP4 where `source` evaluated in bf16)."""
  rows = [r for r in read_metrics(source) if r["step"] < steps]
  if [r["step"] for r in rows] != list(range(steps)):
    raise ValueError(f"sft.init_from={source!r}: its metrics.jsonl lacks rows of steps 0-"
                     f"{steps - 1}, its warm start")
  out = [(r["step"], {k: v for k, v in r.items() if k != "step" and not k.startswith("eval/")})
         for r in rows]
  out[-1][1].update(run.evaluate(state["params"]))
  return out


def load_run(workdir: str, data_dir: str | None = None):
  """A finished (or stopped) run and its newest readable state, e.g. to evaluate or probe its
  policy. -> (Run, state, step)"""
  ckpt = Checkpointer(workdir)
  try:
    saved = None
    for step in ckpt.steps():
      try:
        saved = ckpt.meta(step)["config"]
        break
      except Exception:  # noqa: BLE001 (_open names it)
        continue
    if saved is None:
      raise ValueError(f"no checkpoint in {workdir} can be read")
    c = saved_config(saved)
    if data_dir is not None:
      c.data_dir = data_dir
    return _open(c, workdir, ckpt)
  finally:
    ckpt.close()


def train(c: ml_collections.ConfigDict, workdir: str, *, progress: bool = True,
          log=print) -> dict:
  """Runs (or resumes) the whole run; returns the summary it prints (process 0; the others of
  several print nothing and return {})."""
  validate(c)
  determinism.enable(c.deterministic)  # (raises where JAX has started on a GPU without it)
  primary = D.is_primary()
  log = log if primary else (lambda *_: None)
  os.makedirs(workdir, exist_ok=True)
  ckpt = Checkpointer(workdir, c.checkpoint.keep)
  # processes that see other files (a workdir not shared between hosts) would restore
  # different checkpoints, and then wait for each other
  D.agree(ckpt.latest_step() or 0, f"the newest checkpoint in {ckpt.directory}")
  run, state, start = _open(c, workdir, ckpt, log, set_aside=True)
  start = D.agree(start, "the checkpoint step to resume from")
  # a fresh start from another run's warm start: no checkpoint of its own yet
  warm = bool(c.sft.init_from) and start == c.sft.steps and ckpt.latest_step() is None
  if start and not warm:
    log(f"resumed from step {start} in {ckpt.directory}")
  tokenizer = run.tok
  if primary:
    tokenizer.save(workdir)
    with open(os.path.join(workdir, "config.json"), "w") as fh:
      json.dump(_config_json(c), fh, indent=2)
  writer = MetricsWriter(workdir, 0 if warm else start, tensorboard=c.log.tensorboard,
                         write_files=primary)
  total = c.sft.steps + c.rl.steps

  def save(done):
    meta = {"step": done, "data_position": done, "tokenizer": tokenizer.to_json(),
            "model": dataclasses.asdict(run.cfg), "config": _config_json(c)}
    writer.sync()
    ckpt.save(done, state, meta)

  if warm:
    for step, metrics in _warm_start_rows(run, state, c.sft.init_from, start):
      writer.write(step, metrics)
    save(start)  # a resume reads this run's own checkpoint, never the other run's again
    log(f"started RL from the warm start of {c.sft.init_from} (its step {start}; its metric "
        "rows copied, the policy evaluated again by this run's engine)")

  bar = tqdm(range(start, total), initial=start, total=total, disable=not (progress and primary),
             desc=f"{c.rl.mode}", dynamic_ncols=True)
  done, signum = start, None  # steps completed: updated, evaluated, checked, logged
  try:
    with StopBetweenSteps() as stop:
      for step in bar:
        phase = "sft" if step < c.sft.steps else "rl"
        started = time.perf_counter()
        state, metrics = (run.sft_step if phase == "sft" else run.rl_step)(state, step)
        metrics["phase"] = phase
        if (step + 1) % c.eval.every == 0 or step + 1 in (c.sft.steps, total):
          evaluating = time.perf_counter()
          metrics.update(run.evaluate(state["params"]))
          metrics["time/eval_s"] = time.perf_counter() - evaluating
        # the whole step as the run paid for it (its update, rollout and evaluation); the first
        # of each program includes its compilation
        metrics["time/step_s"] = time.perf_counter() - started
        metrics.update(peak_memory())
        if not np.isfinite(metrics["train/loss"]):
          last = ckpt.latest_step()
          raise FloatingPointError(
              f"train/loss is {metrics['train/loss']} at step {step} ({phase}, mode "
              f"{c.rl.mode}); stopping. The last good checkpoint is step {last} in "
              f"{ckpt.directory}; lower the learning rate or optim.max_grad_norm before resuming.")
        writer.write(step, metrics)
        done = step + 1
        bar.set_postfix(postfix(metrics), refresh=False)
        if done % c.checkpoint.every == 0 or done == total:
          save(done)
        signum = D.first_signal(stop.signum)  # a signal to any process stops every one
        if signum is not None:
          break
      if signum is not None and done < total:
        if done != ckpt.latest_step():
          save(done)
        raise Interrupted(signum)
  except Interrupted as e:
    newest = ckpt.latest_step()
    log(f"interrupted by {e}{' twice: stopped at once' if e.at_once else ''}: "
        + (f"the newest checkpoint is step {newest}" if newest else "no checkpoint yet")
        + f" in {ckpt.directory}; rerun the same command to resume")
    raise
  finally:
    bar.close()
    writer.close()
    ckpt.close()
  if not primary:
    return {}
  summary = summarize(workdir, c)
  plot_run(workdir, title=f"{c.rl.mode} ({make_task(c.task).name})")
  log(format_summary(summary))
  log(f"metrics: {os.path.join(workdir, 'metrics.jsonl')}, curves: "
      f"{os.path.join(workdir, 'curves.png')}, tensorboard: {os.path.join(workdir, 'tensorboard')}")
  return summary


def _flat(d: dict, prefix: str = "") -> dict:
  """A nested config dict as {"section.key": value}."""
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def _check_same_config(saved: dict, now: dict, workdir: str) -> None:
  a, b = _flat(saved), _flat(now)
  # data_dir says where the prepared data lives, dist how the run is launched (a run resumes
  # on another number of processes) and deterministic how XLA schedules its GPU ops, not what
  # the run does
  diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                and k not in ("data_dir", "deterministic") and not k.startswith("dist."))
  if diff:
    raise checkpoint.CannotResume(f"{workdir} holds a run with a different config (keys "
                                  f"{diff}); resume with the same config or use a new --workdir")
