"""The decoder's flax modules: their params are the weights as stored, what the layers sow is
each path's outputs, scanned runs stacked and unrolled layers one by one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trace_jax.models import TrainPath, init_params, tiny
from trace_jax.models.qwen3_moe import Qwen3MoE, forward, module_params


def setup(groups):
  cfg = tiny(n_layers=3)
  params = init_params(cfg, jax.random.PRNGKey(0), groups=groups)
  tokens = jnp.arange(8, dtype=jnp.int32).reshape(2, 4)
  pos = jnp.broadcast_to(jnp.arange(4), (2, 4))
  return cfg, params, tokens, pos, TrainPath(cfg, jnp.ones((2, 4), bool))


@pytest.mark.parametrize("scan", [True, False])
def test_the_layers_sow_the_paths_outputs(scan):
  cfg, params, tokens, pos, path = setup((2, 1))
  runs = path.runs(params["layers"])
  assert runs == ((0, 2), (2, 3))  # split where the stacks are
  variables = {"params": module_params(cfg, params, path, runs, scan)}
  if scan:  # a stored stack that covers a run is its params as it is, not a copy
    assert variables["params"]["run_0"] is params["layers"][0]
  (logits, carries), sown = Qwen3MoE(cfg, path, runs, scan=scan).apply(
      variables, tokens, pos, mutable=["intermediates"])
  sown = sown["intermediates"]
  names = ["run_0", "run_2"] if scan else ["layer_0", "layer_1", "layer_2"]
  assert sorted(sown) == names and all(c is None for c in carries)
  lead = [(2,), (1,)] if scan else [(), (), ()]
  for name, n in zip(names, lead):
    assert sown[name]["routes"].shape == n + (2, 4, cfg.top_k)
    assert sown[name]["aux"].shape == n
  got_logits, out = forward(cfg, params, tokens, pos, path, scan=scan)
  np.testing.assert_array_equal(got_logits, logits)
  assert out["routes"].shape == (3, 2, 4, cfg.top_k)


def test_weights_in_another_layout_are_refused_in_one_line():
  cfg, params, tokens, pos, path = setup(None)
  with pytest.raises(ValueError, match=r"weights \['params'\]: expected the master params"):
    forward(cfg, {"params": params}, tokens, pos, path)
