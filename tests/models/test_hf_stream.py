"""load_hf streams each device's slice of each tensor into its sharding and dtype: the values are
those of the checkpoint, bit for bit, however they are split (8 fake CPU devices)."""

import functools
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tests.models.test_hf import tiny_hf, torch
from trace_jax import sharding as S
from trace_jax.models import init_params, load_hf
from trace_jax.models.safetensors_mmap import open_mmap


def expected(model, cfg) -> dict:
  """The params as the torch model holds them (float32), in this codebase's layout: Linear
  weights [out, in] transposed, experts from transformers' fused in-memory tensors."""
  sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
  f = cfg.d_ff
  layers = []
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}"
    gate_up = sd[f"{pre}.mlp.experts.gate_up_proj"]
    layers.append({
        "attn_norm": sd[f"{pre}.input_layernorm.weight"],
        "mlp_norm": sd[f"{pre}.post_attention_layernorm.weight"],
        "q_norm": sd[f"{pre}.self_attn.q_norm.weight"],
        "k_norm": sd[f"{pre}.self_attn.k_norm.weight"],
        **{w: sd[f"{pre}.self_attn.{n}_proj.weight"].T for w, n in
           (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o"))},
        "router": sd[f"{pre}.mlp.gate.weight"].T,
        "w_gate": gate_up[:, :f].transpose(0, 2, 1), "w_up": gate_up[:, f:].transpose(0, 2, 1),
        "w_down": sd[f"{pre}.mlp.experts.down_proj"].transpose(0, 2, 1),
    })
  layers = [jax.tree.map(lambda *a: np.stack(a), *layers)]  # one stack, as init_params's
  return {"embed": sd["model.embed_tokens.weight"], "layers": layers,
          "final_norm": sd["model.norm.weight"], "lm_head": sd["lm_head.weight"].T}


def assert_same(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(np.asarray(g), w)


def split_everything(abstract, mesh):
  """Expert stacks over `expert` (the training rule) and their d_model over `data`; every
  matrix split along both axes, vectors along theirs (the layers' after their leading layer
  axis): each device reads a strided slice."""
  train = S.param_shardings(abstract, mesh, S.TRAIN_RULES)

  def one(path, leaf, rule):
    if "expert" in rule.spec:
      return NamedSharding(mesh, P(None, "expert", "data", None))
    lead = (None,) if "layers" in jax.tree_util.keystr(path) else ()
    return NamedSharding(mesh, P(*lead, *("data", "expert")[:leaf.ndim - len(lead)]))
  return jax.tree_util.tree_map_with_path(one, abstract, train)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake CPU) devices")
@pytest.mark.parametrize("fused,old_keys,dtype", [(False, False, None), (True, True, "bf16")],
                         ids=["per_expert-new_keys-f32", "fused-old_keys-bf16"])
def test_streamed_params_are_the_checkpoints_in_any_sharding(tmp_path, fused, old_keys, dtype):
  model, path = tiny_hf(tmp_path, fused=fused, old_keys=old_keys, norm_topk=True, n_layers=2,
                        dtype=torch.bfloat16 if dtype else None)
  stored = {str(a.dtype) for a in open_mmap(str(next(pathlib.Path(path).glob("*.safetensors")))).values()}
  assert stored == ({"bfloat16"} if dtype else {"float32"})
  cfg, params = load_hf(path, dtype="float32")
  want = expected(model, cfg)
  assert_same(params, want)  # default: float32 on the default device
  assert all(a.devices() == {jax.devices()[0]} for a in jax.tree.leaves(params))

  mesh = S.make_mesh(data=4, expert=2)
  abstract = jax.eval_shape(functools.partial(init_params, cfg), jax.random.PRNGKey(0))
  shardings = split_everything(abstract, mesh)
  _, placed = load_hf(path, shardings=shardings)
  assert_same(placed, want)
  for a, sh in zip(jax.tree.leaves(placed), jax.tree.leaves(shardings)):
    assert a.sharding == sh
  w_gate = placed["layers"][0]["w_gate"]  # [2, 6, 64, 48]: 3 experts x 16 rows per device
  assert {s.data.shape for s in w_gate.addressable_shards} == {(2, 3, 16, 48)}

  _, half = load_hf(path, param_dtype="bfloat16",
                    shardings=lambda name: NamedSharding(
                        mesh, P(None, "expert") if name.endswith(("w_gate", "w_up", "w_down"))
                        else P()))
  assert_same(half, jax.tree.map(lambda a: a.astype(ml_dtypes.bfloat16), want))
  assert half["layers"][0]["w_down"].sharding.spec == P(None, "expert")


def test_bad_files_and_shardings_fail_by_name(tmp_path):
  _, path = tiny_hf(tmp_path, fused=True, old_keys=False, norm_topk=True, n_layers=1)
  with pytest.raises(ValueError, match="shardings do not match the params"):
    load_hf(path, shardings={"embed": None})
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / "config.json").write_text(open(f"{path}/config.json").read())
  (tmp_path / "broken" / "model.safetensors").write_bytes(b"\xff" * 16)
  with pytest.raises(ValueError, match="header length .* runs past the end of the file"):
    load_hf(str(tmp_path / "broken"))
