"""The run loop under stops and with a KL penalty: a SIGTERM or Ctrl-C at any point, or an
unreadable newest checkpoint, and the rerun's metrics equal an uninterrupted run's; the KL
penalty's reference is the policy where RL starts."""

import os
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from tests.test_main import comparable, data_dir, smoke  # noqa: F401 (data_dir: a fixture)
from trace_jax.rl.checkpoint import Checkpointer
from trace_jax.data.tokenizer import CharTokenizer
from trace_jax.models import stacks
from trace_jax.rl.loop import Interrupted, Run, _config_json, _warm_started, train
from trace_jax.rl.validate import make_task
from trace_jax.rl.writer import MetricsWriter, read_metrics

# smoke sizes: 3 warm-start steps, then 4 RL steps (steps 3-6); evaluations after steps 2, 5
# and 6; checkpoints at 2, 4, 6 and 7 (the newest two kept)
SFT, TOTAL = 3, 7


@pytest.fixture(scope="module", autouse=True)
def compile_once(tmp_path_factory):
  """Every run here compiles the same programs: JAX's persistent cache compiles them once."""
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                           "jax_persistent_cache_min_compile_time_secs")}
  jax.config.update("jax_compilation_cache_dir", str(tmp_path_factory.mktemp("jax_cache")))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  compilation_cache.reset_cache()
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  compilation_cache.reset_cache()


def config(data_dir):
  # bf16: the policy's recompute and the reference's are the same program; one minibatch: the
  # first RL step's loss is taken at the reference itself
  return smoke(data_dir, "bf16", "rl.kl_coef=0.1", "rl.minibatches=1", "log.flip_rate_every=0")


def quiet(*_):
  pass


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("uninterrupted"))
  train(config(data_dir), workdir, progress=False, log=quiet)
  return workdir, read_metrics(workdir)


def test_the_kl_penalty_starts_at_the_policy_where_rl_starts(uninterrupted):
  rows = uninterrupted[1]
  assert [r["step"] for r in rows] == list(range(TOTAL))
  kl = [r["train/kl_ref"] for r in rows if r["phase"] == "rl"]
  assert abs(kl[0]) < 1e-7, kl  # the first RL step's policy is the reference
  assert 1e-5 < kl[1] < kl[2] < kl[3], kl  # and moves away from it


def kill_self(signum=signal.SIGTERM):
  os.kill(os.getpid(), signum)


def during_evaluation(monkeypatch, signum):
  evaluate = Run.evaluate
  def killed(self, params):
    monkeypatch.undo()
    kill_self(signum)
    return evaluate(self, params)
  monkeypatch.setattr(Run, "evaluate", killed)
  return SFT  # the first evaluation follows the last warm-start step: RL has not started


def during_a_save(monkeypatch, signum):
  save = Checkpointer.save
  def killed(self, step, state, meta):
    if step == 4:
      monkeypatch.undo()
      kill_self(signum)
    return save(self, step, state, meta)
  monkeypatch.setattr(Checkpointer, "save", killed)
  return 4


def between_steps(monkeypatch, signum):
  write = MetricsWriter.write
  def killed(self, step, metrics):
    row = write(self, step, metrics)
    if step == 4:  # step 4 is done and logged; step 5 has not started
      monkeypatch.undo()
      kill_self(signum)
    return row
  monkeypatch.setattr(MetricsWriter, "write", killed)
  return 5


@pytest.mark.parametrize("stop,signum", [
    (during_evaluation, signal.SIGTERM), (during_a_save, signal.SIGTERM),
    (between_steps, signal.SIGTERM), (between_steps, signal.SIGINT)],
    ids=["evaluation", "save", "between_steps", "between_steps_ctrl_c"])
def test_a_stop_anywhere_resumes_as_if_never_stopped(stop, signum, uninterrupted, data_dir,
                                                     tmp_path, monkeypatch):
  c, workdir, messages = config(data_dir), str(tmp_path), []
  saved = stop(monkeypatch, signum)
  with pytest.raises(Interrupted):
    train(c, workdir, progress=False, log=messages.append)
  assert f"the newest checkpoint is step {saved}" in messages[-1]
  assert [r["step"] for r in read_metrics(workdir)] == list(range(saved))
  train(c, workdir, progress=False, log=messages.append)
  assert f"resumed from step {saved}" in "\n".join(messages)
  assert comparable(read_metrics(workdir)) == comparable(uninterrupted[1])


def truncate_largest_file(directory):
  files = [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as fh:
    fh.truncate(os.path.getsize(largest) // 2)


def test_an_unreadable_newest_checkpoint_is_named_and_the_one_before_resumes(
    uninterrupted, data_dir, tmp_path):
  workdir = str(tmp_path / "run")
  shutil.copytree(uninterrupted[0], workdir)
  newest = os.path.join(workdir, "checkpoints", str(TOTAL))
  truncate_largest_file(newest)
  messages = []
  train(config(data_dir), workdir, progress=False, log=messages.append)
  unreadable = [m for m in messages if "cannot be read" in m]
  assert len(unreadable) == 1 and newest in unreadable[0] and "\n" not in unreadable[0]
  assert f"resumed from step {TOTAL - 1}" in "\n".join(messages)
  assert comparable(read_metrics(workdir)) == comparable(uninterrupted[1])
  assert os.path.isdir(newest + ".unreadable")  # set aside, not deleted

  # with no checkpoint left to read, the run stops rather than starting over
  for step in (TOTAL - 1, TOTAL):
    truncate_largest_file(os.path.join(workdir, "checkpoints", str(step)))
  with pytest.raises(ValueError, match=r"no checkpoint in .* can be read"):
    train(config(data_dir), workdir, progress=False, log=quiet)
  assert all(os.path.isdir(os.path.join(workdir, "checkpoints", str(s))) for s in (TOTAL - 1, TOTAL))


def test_a_checkpoint_of_another_layout_is_refused_by_name_not_set_aside(data_dir, tmp_path):
  """A checkpoint that reads but holds another state layout (here: a norm of another width, as
  a model of another shape would save it) is no corruption: the run stops, naming the
  checkpoint and what differs, and leaves it (and the one before) where they are."""
  c, workdir = config(data_dir), str(tmp_path)
  tokenizer = CharTokenizer(make_task(c.task).alphabet())
  state = Run(c, workdir, tokenizer).initial_state()
  other = {**state, "params": {**state["params"], "final_norm": jnp.ones((3,))}}
  meta = {"tokenizer": tokenizer.to_json(), "config": _config_json(c)}
  ckpt = Checkpointer(workdir)
  ckpt.save(1, state, {**meta, "step": 1})
  ckpt.save(2, other, {**meta, "step": 2})
  ckpt.close()
  with pytest.raises(ValueError) as e:
    train(c, workdir, progress=False, log=quiet)
  message = str(e.value)
  assert os.path.join(workdir, "checkpoints", "2") in message and "layout" in message
  assert "params/final_norm ((3,)" in message
  assert "\n" not in message and "new --workdir" in message
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["1", "2"]
  assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))


def layers_as(tree, regroup):
  """`tree` (a state: params, optimizer moments, reference) with every model's `layers` list
  replaced by `regroup(layers)`."""
  if isinstance(tree, dict):
    return {k: (regroup(v) if k == "layers" else layers_as(v, regroup)) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
    return type(tree)(layers_as(v, regroup) for v in tree)
  if hasattr(tree, "_fields"):  # optax's named tuples
    return type(tree)(*(layers_as(v, regroup) for v in tree))
  return tree


def test_a_checkpoint_of_layers_grouped_otherwise_restores_regrouped(data_dir, tmp_path):
  """Params, optimizer moments and reference saved one array per layer (as written before
  layers were stacked) or in other stacks restore into this run's stacks, the same values."""
  c, workdir = config(data_dir), str(tmp_path)
  run = Run(c, workdir, CharTokenizer(make_task(c.task).alphabet()))
  state = run.initial_state(reference=True)

  ckpt = Checkpointer(workdir)
  ckpt.save(1, layers_as(state, stacks.unstack), {"step": 1})
  ckpt.save(2, layers_as(state, lambda layers: stacks.regroup(layers, (1,) * len(
      stacks.unstack(layers)))), {"step": 2})
  like = run.abstract_state(reference=True)
  for step in (1, 2):
    restored, _ = ckpt.restore(step, like)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b, want in zip(*map(jax.tree.leaves, (restored, state, like))):
      assert a.shape == b.shape and a.sharding == want.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  ckpt.close()


def test_rl_from_another_runs_warm_start_starts_from_its_state_and_rows(data_dir, tmp_path):
  """trace (its 2 layers in stacks of 1 and 1) started from a bf16 run's warm start (one stack
  of 2; rl.steps=0) holds, at the warm start's end, that run's policy and optimizer state
  (regrouped), a checkpoint of its own, and that run's metric rows but for the evaluation,
  made again in trace's MXFP4, as trace's own warm start evaluates; then RL runs on. (Trace's
  own warm start is not this one: with its layers grouped otherwise the gradient norm's sum
  runs in another order, 1 ulp apart at the first step.) A source whose warm start is another
  is refused, naming the keys, before anything is written."""
  source, started = str(tmp_path / "source"), str(tmp_path / "started")
  warm = smoke(data_dir, "bf16", "rl.steps=0", "log.flip_rate_every=0")
  train(warm, source, progress=False, log=quiet)
  c, messages = smoke(data_dir, "trace", "log.flip_rate_every=0", "checkpoint.keep=10"), []
  c.sft.init_from = source
  train(c, started, progress=False, log=messages.append)

  theirs, got = read_metrics(source), read_metrics(started)
  assert [r["step"] for r in got] == list(range(TOTAL))
  drop_eval = lambda r: {k: v for k, v in r.items() if not k.startswith("eval/")}
  assert [drop_eval(r) for r in got[:SFT]] == [drop_eval(r) for r in theirs]
  assert [r for r in got[:SFT - 1] if "eval/accuracy" in r] == []
  run = Run(c, str(tmp_path / "scratch"), CharTokenizer(make_task(c.task).alphabet()))
  like = run.abstract_state()
  mine, yours = Checkpointer(started), Checkpointer(source)
  mxfp4_eval = run.evaluate(yours.restore(SFT, like)[0]["params"])
  assert {k: got[SFT - 1][k] for k in mxfp4_eval} == mxfp4_eval
  assert all(r["phase"] == "rl" and r["reward/mean"] is not None for r in got[SFT:])
  assert any("started RL from the warm start of " + source in m for m in messages), messages
  assert not any(m.startswith("resumed") for m in messages), messages

  assert stacks.sizes(like["params"]["layers"]) == (1, 1)
  for a, b in zip(*(jax.tree.leaves(ck.restore(SFT, like)[0]) for ck in (mine, yours))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mine.close(), yours.close()

  other = smoke(data_dir, "trace", "log.flip_rate_every=0", "sft.lr=1e-3", "seed=1")
  other.sft.init_from = source
  with pytest.raises(ValueError, match=r"sft.init_from=.*keys \['seed', 'sft.lr'\]"):
    train(other, str(tmp_path / "other"), progress=False, log=quiet)
  assert not os.path.exists(tmp_path / "other" / "metrics.jsonl")
  # sft.attention computes the warm start's loss: a run of the fused attention has another;
  # rl.attention acts from RL on, so a run of another trainer attention takes this warm start
  fused = smoke(data_dir, "trace", "log.flip_rate_every=0", "sft.attention=fused")
  fused.sft.init_from = source
  with pytest.raises(ValueError, match=r"sft.init_from=.*keys \['sft.attention'\]"):
    train(fused, str(tmp_path / "fused"), progress=False, log=quiet)
  rl_fused = smoke(data_dir, "trace", "log.flip_rate_every=0", "rl.attention=fused")
  rl_fused.sft.init_from = source
  _, state = _warm_started(rl_fused, str(tmp_path / "rl_fused"))
  mine = Checkpointer(started)
  for a, b in zip(*(jax.tree.leaves(s) for s in (state, mine.restore(SFT, like)[0]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mine.close()


def test_a_warm_start_batch_that_cannot_be_built_fails_its_own_step(data_dir, tmp_path):
  """The next warm-start step's batch is built while a step runs on the device; where building
  it raises, the step that runs still ends with its metrics (its row and checkpoint are
  written), and the step whose batch it is raises the error. A second signal (stop at once)
  while it is built still stops the run at once."""
  c = smoke(data_dir, "bf16", "log.flip_rate_every=0")
  run = Run(c, str(tmp_path), CharTokenizer(make_task(c.task).alphabet()))
  state = run.place_state(run.initial_state())

  class Failing:
    def __init__(self, batches, errors):
      self.batches, self.errors = batches, errors

    def __getitem__(self, step):
      if step in self.errors:
        raise self.errors[step]
      return self.batches[step]

  batches = run.sft_batches
  run.sft_batches = Failing(batches, {1: ValueError("demonstration 7 is malformed")})
  state, metrics = run.sft_step(state, 0)
  assert np.isfinite(metrics["train/loss"])
  with pytest.raises(ValueError, match="demonstration 7 is malformed"):
    run.sft_step(state, 1)
  run.sft_batches = Failing(batches, {2: Interrupted(signal.SIGTERM, at_once=True)})
  with pytest.raises(Interrupted):
    run.sft_step(state, 1)
