"""load_hf / logits against transformers on tiny random Qwen3-MoE checkpoints (offline)."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the parity test needs torch (requirements-test)")
transformers = pytest.importorskip("transformers")

from trace_jax.models import load_hf, logits  # noqa: E402


def tiny_hf(tmp_path, *, fused: bool, old_keys: bool, norm_topk: bool, tied: bool = False,
            dtype=None, n_layers: int = 3, d_ff: int = 48):
  cfg = transformers.Qwen3MoeConfig(
      vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=n_layers,
      num_attention_heads=4, num_key_value_heads=2, head_dim=32, moe_intermediate_size=d_ff,
      num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk, rms_norm_eps=1e-6,
      initializer_range=0.3,  # large init: router logits far apart, so top-k is decisive
      tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
  torch.manual_seed(0)
  model = transformers.Qwen3MoeForCausalLM(cfg).eval()
  with torch.no_grad():  # norms away from one, so that a swapped norm weight would show
    for name, p in model.named_parameters():
      if "norm" in name:
        p.mul_(torch.empty_like(p).uniform_(0.5, 1.5))
  if dtype is not None:  # e.g. torch.bfloat16: the files hold that dtype
    model = model.to(dtype)
  out = tmp_path / f"hf_{fused}_{old_keys}_{norm_topk}_{tied}_{dtype}_{n_layers}_{d_ff}"
  model.save_pretrained(out)  # per-expert tensors, new config keys
  if fused:  # the in-memory layout: gate_up_proj [E, 2F, D] and down_proj [E, D, F]
    from safetensors.torch import save_file
    for f in out.glob("*.safetensors"):
      f.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
      state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
  if old_keys:
    raw = json.loads((out / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    (out / "config.json").write_text(json.dumps(raw))
  return model, str(out)


@pytest.mark.parametrize("fused,old_keys,norm_topk,tied", [
    (False, False, True, False), (True, True, False, False), (False, True, False, True)])
def test_logits_match_transformers(tmp_path, fused, old_keys, norm_topk, tied):
  model, path = tiny_hf(tmp_path, fused=fused, old_keys=old_keys, norm_topk=norm_topk, tied=tied)
  if fused:
    names = __import__("safetensors").safe_open(os.path.join(path, "model.safetensors"), "np")
    assert any("gate_up_proj" in k for k in names.keys())
  cfg, params = load_hf(path, dtype="float32")
  assert (cfg.n_experts, cfg.top_k, cfg.d_ff, cfg.rope_theta) == (6, 2, 48, 5e4)
  assert cfg.norm_topk_prob == norm_topk and cfg.tie_embeddings == tied
  tokens = np.random.default_rng(0).integers(0, 96, (3, 17))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  got = np.asarray(logits(cfg, params, jnp.asarray(tokens)))
  scale = np.abs(want).max()
  np.testing.assert_allclose(got, want, atol=2e-5 * scale, rtol=0)
  assert scale > 1.0


def test_bad_checkpoints_fail_by_name(tmp_path):
  _, path = tiny_hf(tmp_path, fused=False, old_keys=False, norm_topk=True)
  raw = json.loads(open(os.path.join(path, "config.json")).read())
  raw["mlp_only_layers"] = [1]
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(raw, fh)
  with pytest.raises(ValueError, match="mlp_only_layers"):
    load_hf(path)
  with pytest.raises(ValueError, match="no config.json"):
    load_hf(str(tmp_path))
  raw["mlp_only_layers"] = []
  raw["moe_intermediate_size"] = 40
  with open(os.path.join(path, "config.json"), "w") as fh:
    json.dump(raw, fh)
  with pytest.raises(ValueError, match=r"shape \(48, 64\), config implies \(40, 64\)"):
    load_hf(path)
