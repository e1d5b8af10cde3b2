"""The multi-turn environment and multi-turn rollouts through one KV cache."""

import jax
import numpy as np
import pytest

from experiments.bench_episodes import extend_run
from trace_jax.data.tokenizer import CharTokenizer
from trace_jax.models import QuantRecipe, init_params, pack_weights, tiny
from trace_jax.rl import metrics as M
from trace_jax.rl.episodes import episode_length, rollout
from trace_jax.rl.recompute import recompute
from trace_jax.rl.rollout import RolloutEngine, SamplingConfig
from trace_jax.tasks import RunningSumTask


@pytest.fixture(scope="module")
def episodes(tmp_path_factory):
  task = RunningSumTask(turns=8, train_size=20, eval_size=4)
  return task, task.prepare(str(tmp_path_factory.mktemp("tfds")))


def test_environment(episodes):
  task, sources = episodes
  record = sources["train"][0]
  totals = task.totals(record)
  assert len(totals) == 8 and all(0 <= t < 10 for t in totals)
  assert task.prompt(record).startswith(f"s={int(record['start'])} ")
  right = task.step(record, 0, task.answer(totals[0]))
  wrong = task.step(record, 0, "x;")
  assert right.observation[0] == "y" and wrong.observation[0] == "n" and not right.done
  assert right.observation[1:] == wrong.observation[1:] and len(right.observation) == 4
  assert right.reward == 1.0 and wrong.reward == 0.0
  assert task.step(record, 7, task.answer(totals[7])).done
  demo = task.demonstration(record)
  assert sum(trained for _, trained in demo) == 8 and len(demo) == 15
  assert task.reward(record, task.target(record)) == 1.0
  assert len(task.target(record)) == episode_length(task) == 8 * 2 + 7 * 4


@pytest.mark.parametrize("precision,tol", [("bf16", 2e-4), ("mxfp4", None)])
def test_episodes_share_one_kv_cache_and_mask_observations(episodes, precision, tol):
  task, sources = episodes
  tok = CharTokenizer(task.alphabet())
  cfg = tiny(vocab_size=tok.vocab_size, dtype="float32")
  params = init_params(cfg, jax.random.PRNGKey(0))
  recipe = QuantRecipe.uniform(precision)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=1), records="all",
                         collect_codes=True, attn_chunk=16)
  records = [sources["train"][i] for i in range(4)]
  batch, rewards = rollout(engine, pack_weights(cfg, params, recipe), task, records, tok, 8,
                           jax.random.PRNGKey(1))
  p = batch.prompt_width
  assert batch.tokens.shape == (4, p + episode_length(task)) and rewards.shape == (4,)
  mask = np.asarray(batch.response_mask)[:, p:]
  turn = np.r_[np.ones(2, bool), np.zeros(4, bool)]
  np.testing.assert_array_equal(mask[0], np.tile(turn, 8)[:episode_length(task)])
  # the observations in the context are the environment's replies to the sampled answers
  text = tok.decode(np.asarray(batch.tokens[0, p:]))
  for t in range(7):
    answer = text[6 * t:6 * t + 2]
    assert text[6 * t + 2:6 * t + 6] == task.step(records[0], t, answer).observation
  # the trainer, one pass over the whole episode, scores the same tokens the same way
  out = recompute(cfg, params, batch.tokens, batch.valid, recipe, records=batch.records,
                  routes=batch.routes, collect_codes=True)
  if tol is not None:
    diff = np.abs(np.asarray(out.logp) - np.asarray(batch.logp))[np.asarray(batch.response_mask)]
    assert diff.max() < tol
  else:  # FP4 with records everywhere: nothing flips, observations included (padding aside)
    everywhere = np.asarray(batch.valid[:, :-1])
    assert M.flip_rates(cfg, recipe, batch.codes, out.codes, everywhere,
                        routes_rollout=batch.routes, routes_train=out.routes)[
        "mismatch/flip_rate"] == 0.0


def test_a_turn_in_one_program_gives_the_batch_of_extend_then_run(episodes):
  task, sources = episodes
  tok = CharTokenizer(task.alphabet())
  cfg = tiny(vocab_size=tok.vocab_size)
  recipe = QuantRecipe.uniform("mxfp4")
  weights = pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)), recipe)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=1), records="last:1",
                         attn_chunk=16)
  records = [sources["train"][i] for i in range(4)]
  batch, _ = rollout(engine, weights, task, records, tok, 8, jax.random.PRNGKey(3))
  other = extend_run(engine, weights, task, records, tok, 8, jax.random.PRNGKey(3))
  for name in ("tokens", "valid", "response_mask", "logp", "records", "routes", "stats"):
    jax.tree.map(np.testing.assert_array_equal, getattr(batch, name), getattr(other, name))
  # each turn's answer is the tokens sampled after its observation
  state = engine.start(weights, np.ones((4, 8), np.int32), np.full(4, 8), jax.random.PRNGKey(1),
                       8 + episode_length(task))
  state, first = engine.turn(weights, state, None, 2, 8)
  t = int(state["t"])
  state, second = engine.turn(weights, state, np.full((4, 4), 3, np.int32), 2, t)
  assert t == 9 and int(state["t"]) == t + 4 + 2
  tokens = np.asarray(state["tokens"])
  np.testing.assert_array_equal(first, tokens[:, 8:10])
  np.testing.assert_array_equal(tokens[:, 10:14], 3)
  np.testing.assert_array_equal(second, tokens[:, 14:16])


def test_a_turn_that_does_not_fit_names_the_sizes(episodes):
  task, _ = episodes
  cfg = tiny(vocab_size=40)
  recipe = QuantRecipe.uniform("bf16")
  weights = pack_weights(cfg, init_params(cfg, jax.random.PRNGKey(0)), recipe)
  engine = RolloutEngine(cfg, recipe, SamplingConfig(max_new_tokens=1), attn_chunk=16)
  state = engine.start(weights, np.ones((2, 4), np.int32), np.full(2, 4), jax.random.PRNGKey(0),
                       12)
  with pytest.raises(ValueError, match="observation of 6 tokens and an answer of 3 do not fit "
                                       "after position 4 of 12"):
    engine.turn(weights, state, np.ones((2, 6), np.int32), 3, 4)
  with pytest.raises(ValueError, match=r"observation tokens \(3, 2\) for a batch of 2"):
    engine.turn(weights, state, np.ones((3, 2), np.int32), 2, 4)
  # the pending token at 4, the observation at 5-10, the answer would take 11 and 12 (of 0-11)
  with pytest.raises(ValueError, match="observation of 6 tokens and an answer of 2 do not fit"):
    engine.turn(weights, state, np.ones((2, 6), np.int32), 2, 4)
  with pytest.raises(ValueError, match="observation of 0 tokens and an answer of 9 do not fit"):
    engine.turn(weights, state, None, 9, 4)  # the answer from 4: up to 11 fits, 12 does not
  state, answer = engine.turn(weights, state, np.ones((2, 5), np.int32), 2, 4)
  assert answer.shape == (2, 2) and int(state["t"]) == 11


def test_the_episode_bench_profile_divides_the_trace_by_the_turns(monkeypatch):
  """`bench_episodes --profile`: the trace's kernel time and launches a turn, the device-busy
  share of the rollout's wall time, the largest kernels first; nothing without a GPU trace."""
  from experiments import bench_episodes

  def trace(fn, launches=None):
    fn()
    launches.update({"fusion": 40, "gemm": 8})
    return {"fusion": 300.0, "gemm": 500.0}

  monkeypatch.setattr(bench_episodes, "kernel_times", trace)
  calls = []
  row = bench_episodes.profile_turns(lambda: calls.append(1), turns=4, wall_s=0.002)
  assert calls == [1]
  assert row["kernel_us_a_turn"] == 200.0 and row["launches_a_turn"] == 12.0
  assert row["device_busy_frac"] == pytest.approx(0.4)
  assert list(row["largest"]) == ["gemm", "fusion"]
  assert row["largest"]["gemm"] == {"us_a_turn": 125.0, "launches_a_turn": 2.0}
  monkeypatch.setattr(bench_episodes, "kernel_times", lambda fn, launches=None: None)
  assert bench_episodes.profile_turns(lambda: None, turns=4, wall_s=1.0) is None
