"""The run loop with a KL penalty: its reference is the policy where RL starts."""

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from tests.test_main import data_dir, smoke  # noqa: F401 (data_dir: a fixture)
from trace_jax.rl.loop import train
from trace_jax.rl.writer import read_metrics

# smoke sizes: 3 warm-start steps, then 4 RL steps (steps 3-6)
TOTAL = 7


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
