"""Loading Hugging Face Qwen3-MoE checkpoints: config.json + safetensors -> (config, params)."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from trace_jax.models.config import ModelConfig

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _config_value(raw: dict, *names: str, default: Any = KeyError):
  """The first of `names` present in raw (old and new Hugging Face spellings)."""
  for name in names:
    if name in raw and raw[name] is not None:
      return raw[name]
  if default is KeyError:
    raise ValueError(f"config.json has none of the keys {names}")
  return default


def config_from_hf(raw: dict, dtype: str = "bfloat16") -> ModelConfig:
  """A ModelConfig from a Qwen3-MoE config.json dict; unsupported variants fail by name."""
  if raw.get("model_type", "qwen3_moe") != "qwen3_moe":
    raise ValueError(f"expected a qwen3_moe checkpoint, config.json says model_type="
                     f"{raw.get('model_type')!r}")
  unsupported = {
      "mlp_only_layers": bool(raw.get("mlp_only_layers")),
      "decoder_sparse_step": raw.get("decoder_sparse_step", 1) != 1,
      "attention_bias": bool(raw.get("attention_bias", False)),
      "use_sliding_window": bool(raw.get("use_sliding_window", False)),
  }
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise ValueError(f"unsupported Qwen3-MoE variant: {', '.join(f'{k}={raw[k]!r}' for k in bad)}"
                     " (every layer must be a MoE layer without attention bias or sliding window)")
  rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
  if rope.get("rope_type", rope.get("type", "default")) != "default":
    raise ValueError(f"unsupported RoPE scaling {rope!r}; only the default rotation is implemented")
  d_model = _config_value(raw, "hidden_size")
  n_heads = _config_value(raw, "num_attention_heads")
  return ModelConfig(
      vocab_size=_config_value(raw, "vocab_size"),
      d_model=d_model,
      n_layers=_config_value(raw, "num_hidden_layers"),
      n_heads=n_heads,
      n_kv_heads=_config_value(raw, "num_key_value_heads", default=n_heads),
      head_dim=_config_value(raw, "head_dim", default=d_model // n_heads),
      n_experts=_config_value(raw, "num_experts", "num_local_experts"),
      top_k=_config_value(raw, "num_experts_per_tok"),
      d_ff=_config_value(raw, "moe_intermediate_size"),
      norm_eps=_config_value(raw, "rms_norm_eps", default=1e-6),
      rope_theta=float(_config_value(rope, "rope_theta", default=None)
                       or _config_value(raw, "rope_theta", default=10000.0)),
      norm_topk_prob=bool(_config_value(raw, "norm_topk_prob", default=False)),
      router_aux_loss_coef=_config_value(raw, "router_aux_loss_coef", default=1e-3),
      tie_embeddings=bool(_config_value(raw, "tie_word_embeddings", default=False)),
      dtype=dtype,
  )


def _read_tensors(path: str) -> dict[str, np.ndarray]:
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as fh:
      files = sorted(set(json.load(fh)["weight_map"].values()))
  if not files:
    raise ValueError(f"no .safetensors files in {path}")
  tensors = {}
  for name in files:
    with safe_open(os.path.join(path, name), framework="flax") as fh:
      for key in fh.keys():
        tensors[key] = np.asarray(fh.get_tensor(key).astype(jnp.float32))
  return tensors


class _Tensors:
  """Pops named tensors with shape checks, so leftovers can be reported."""

  def __init__(self, tensors: dict[str, np.ndarray]):
    self.t = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}

  def has(self, name: str) -> bool:
    return name in self.t

  def pop(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in self.t:
      raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
    a = self.t.pop(name)
    if a.shape != tuple(shape):
      raise ValueError(f"tensor {name!r} has shape {a.shape}, config implies {tuple(shape)}")
    return a


def _experts(t: _Tensors, prefix: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
  """Expert stacks [E, D, F] / [E, F, D] from per-expert or fused tensors."""
  e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
  if t.has(f"{prefix}.gate_up_proj"):  # fused: gate_up [E, 2F, D], down [E, D, F]
    gate_up = t.pop(f"{prefix}.gate_up_proj", (e, 2 * f, d))
    down = t.pop(f"{prefix}.down_proj", (e, d, f))
    return {"w_gate": gate_up[:, :f].transpose(0, 2, 1), "w_up": gate_up[:, f:].transpose(0, 2, 1),
            "w_down": down.transpose(0, 2, 1)}
  per = lambda j, n, shape: t.pop(f"{prefix}.{j}.{n}.weight", shape).T
  return {
      "w_gate": np.stack([per(j, "gate_proj", (f, d)) for j in range(e)]),
      "w_up": np.stack([per(j, "up_proj", (f, d)) for j in range(e)]),
      "w_down": np.stack([per(j, "down_proj", (d, f)) for j in range(e)]),
  }


def load_hf(path: str, dtype: str = "bfloat16") -> tuple[ModelConfig, dict]:
  """Reads a Hugging Face Qwen3-MoE directory -> (config, float32 master params).

  `dtype` is the activation dtype of the returned config ("float32" for exact parity checks).
  Accepts the old and new config key names (num_experts / num_local_experts, rope_theta /
  rope_parameters) and per-expert or fused expert tensors, in one or several safetensors files.
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
  with open(cfg_path) as fh:
    cfg = config_from_hf(json.load(fh), dtype=str(jnp.dtype(dtype)))
  t = _Tensors(_read_tensors(path))
  d, v, hd = cfg.d_model, cfg.vocab_size, cfg.head_dim
  layers = []
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}"
    layers.append({
        "attn_norm": t.pop(f"{pre}.input_layernorm.weight", (d,)),
        "mlp_norm": t.pop(f"{pre}.post_attention_layernorm.weight", (d,)),
        "q_norm": t.pop(f"{pre}.self_attn.q_norm.weight", (hd,)),
        "k_norm": t.pop(f"{pre}.self_attn.k_norm.weight", (hd,)),
        "wq": t.pop(f"{pre}.self_attn.q_proj.weight", (cfg.q_dim, d)).T,
        "wk": t.pop(f"{pre}.self_attn.k_proj.weight", (cfg.kv_dim, d)).T,
        "wv": t.pop(f"{pre}.self_attn.v_proj.weight", (cfg.kv_dim, d)).T,
        "wo": t.pop(f"{pre}.self_attn.o_proj.weight", (d, cfg.q_dim)).T,
        "router": t.pop(f"{pre}.mlp.gate.weight", (cfg.n_experts, d)).T,
        **_experts(t, f"{pre}.mlp.experts", cfg),
    })
  params = {"embed": t.pop("model.embed_tokens.weight", (v, d)), "layers": layers,
            "final_norm": t.pop("model.norm.weight", (d,))}
  if not cfg.tie_embeddings:
    params["lm_head"] = t.pop("lm_head.weight", (v, d)).T
  if t.t:
    raise ValueError(f"checkpoint has tensors this loader does not know: {sorted(t.t)[:8]}")
  return cfg, jax.tree.map(lambda a: jnp.asarray(np.ascontiguousarray(a), jnp.float32), params)
