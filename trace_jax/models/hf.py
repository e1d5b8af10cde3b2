"""Loading Hugging Face Qwen3-MoE checkpoints: config.json + safetensors -> (config, params).

Tensors stream from memory-mapped files straight into their target sharding and dtype: each
device's slice is read, transposed into this codebase's layout and converted on its own, so no
host copy of the whole model is ever made (a float32 one of Qwen3-30B-A3B would be ~122 GB).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax.models import safetensors_mmap, stacks
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


def read_hf_config(path: str, dtype: str = "bfloat16") -> ModelConfig:
  """The ModelConfig of a Hugging Face model directory (its config.json), reading no tensor."""
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
  with open(cfg_path) as fh:
    return config_from_hf(json.load(fh), dtype=str(jnp.dtype(dtype)))


def _open_tensors(path: str) -> dict[str, np.ndarray]:
  files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as fh:
      files = sorted(set(json.load(fh)["weight_map"].values()))
  if not files:
    raise ValueError(f"no .safetensors files in {path}")
  tensors = {}
  for name in files:
    tensors.update(safetensors_mmap.open_mmap(os.path.join(path, name)))
  return tensors


@dataclasses.dataclass(frozen=True, eq=False)
class _Source:
  """One param in this codebase's layout, over memory-mapped checkpoint tensors: `parts[0]`
  with its axes permuted by `perm`, or with `stacked` the parts (one per expert) permuted and
  stacked along a new leading axis. Nothing is read until `read`."""

  parts: tuple[np.ndarray, ...]
  perm: tuple[int, ...]
  stacked: bool = False

  @property
  def shape(self) -> tuple[int, ...]:
    one = tuple(self.parts[0].shape[p] for p in self.perm)
    return (len(self.parts),) + one if self.stacked else one

  def _one(self, a: np.ndarray, index: tuple) -> np.ndarray:
    src = [slice(None)] * a.ndim
    for k, p in enumerate(self.perm):
      src[p] = index[k]
    return np.asarray(a[tuple(src)]).transpose(self.perm)

  def read(self, index: tuple) -> np.ndarray:
    """The slice `index` (a tuple of slices, as jax.make_array_from_callback asks) of the
    param; only its bytes are read from the files."""
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    if not self.stacked:
      return self._one(self.parts[0], index)
    experts = range(*index[0].indices(len(self.parts)))
    return np.stack([self._one(self.parts[j], index[1:]) for j in experts])


@dataclasses.dataclass(frozen=True, eq=False)
class _Layers:
  """One param of a stack of layers (`models.stacks`): each layer's _Source along a new leading
  axis, read layer by layer."""

  layers: tuple[_Source, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.layers),) + self.layers[0].shape

  def read(self, index: tuple) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
    return np.stack([self.layers[j].read(index[1:])
                     for j in range(*index[0].indices(len(self.layers)))])


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

  def plain(self, name: str, shape: tuple[int, ...]) -> _Source:
    return _Source((self.pop(name, shape),), tuple(range(len(shape))))

  def transposed(self, name: str, shape: tuple[int, int]) -> _Source:
    """A torch Linear weight [out, in] as this codebase's [in, out]."""
    return _Source((self.pop(name, shape),), (1, 0))


def _experts(t: _Tensors, prefix: str, cfg: ModelConfig) -> dict[str, _Source]:
  """Expert stacks w_gate, w_up [E, D, F] and w_down [E, F, D] from fused tensors (gate_up_proj
  [E, 2F, D], down_proj [E, D, F]) or per-expert ones ([F, D], [F, D], [D, F] each)."""
  e, d, f = cfg.n_experts, cfg.d_model, cfg.d_ff
  if t.has(f"{prefix}.gate_up_proj"):
    gate_up = t.pop(f"{prefix}.gate_up_proj", (e, 2 * f, d))
    down = t.pop(f"{prefix}.down_proj", (e, d, f))
    return {"w_gate": _Source((gate_up[:, :f],), (0, 2, 1)),
            "w_up": _Source((gate_up[:, f:],), (0, 2, 1)),
            "w_down": _Source((down,), (0, 2, 1))}
  per = lambda n, shape: _Source(tuple(t.pop(f"{prefix}.{j}.{n}.weight", shape)
                                       for j in range(e)), (1, 0), stacked=True)
  return {"w_gate": per("gate_proj", (f, d)), "w_up": per("up_proj", (f, d)),
          "w_down": per("down_proj", (d, f))}


def _sources(cfg: ModelConfig, t: _Tensors, groups: Sequence[int] | None = None) -> dict:
  """The params pytree (init_params' structure, its layers in stacks of `groups`) with a
  source for every leaf; every name and shape is checked here, from the files' headers, before
  any tensor is read."""
  d, v, hd = cfg.d_model, cfg.vocab_size, cfg.head_dim
  layers = []
  for i in range(cfg.n_layers):
    pre = f"model.layers.{i}"
    layers.append({
        "attn_norm": t.plain(f"{pre}.input_layernorm.weight", (d,)),
        "mlp_norm": t.plain(f"{pre}.post_attention_layernorm.weight", (d,)),
        "q_norm": t.plain(f"{pre}.self_attn.q_norm.weight", (hd,)),
        "k_norm": t.plain(f"{pre}.self_attn.k_norm.weight", (hd,)),
        "wq": t.transposed(f"{pre}.self_attn.q_proj.weight", (cfg.q_dim, d)),
        "wk": t.transposed(f"{pre}.self_attn.k_proj.weight", (cfg.kv_dim, d)),
        "wv": t.transposed(f"{pre}.self_attn.v_proj.weight", (cfg.kv_dim, d)),
        "wo": t.transposed(f"{pre}.self_attn.o_proj.weight", (d, cfg.q_dim)),
        "router": t.transposed(f"{pre}.mlp.gate.weight", (cfg.n_experts, d)),
        **_experts(t, f"{pre}.mlp.experts", cfg),
    })
  stacked, lo = [], 0
  for n in stacks.check_sizes(groups or (cfg.n_layers,), cfg.n_layers):
    stacked.append(jax.tree.map(lambda *a: _Layers(a), *layers[lo:lo + n]))
    lo += n
  params = {"embed": t.plain("model.embed_tokens.weight", (v, d)), "layers": stacked,
            "final_norm": t.plain("model.norm.weight", (d,))}
  if not cfg.tie_embeddings:
    params["lm_head"] = t.transposed("lm_head.weight", (v, d))
  if t.t:
    raise ValueError(f"checkpoint has tensors this loader does not know: {sorted(t.t)[:8]}")
  return params


def _name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _default_device() -> jax.Device:
  device = jax.config.jax_default_device
  return device if isinstance(device, jax.Device) else jax.devices()[0]


Shardings = Any  # a pytree of jax.sharding.Sharding shaped like the params, or name -> Sharding


def load_hf(path: str, dtype: str = "bfloat16", *, param_dtype: str = "float32",
            shardings: Shardings | Callable[[str], jax.sharding.Sharding] | None = None,
            groups: Sequence[int] | None = None) -> tuple[ModelConfig, dict]:
  """Reads a Hugging Face Qwen3-MoE directory -> (config, master params).

  `dtype` is the activation dtype of the returned config ("float32" for exact parity checks);
  `param_dtype` the params' (float32 master params by default). `shardings` places each param:
  a pytree shaped like the params (e.g. `sharding.param_shardings` of
  `jax.eval_shape(init_params, cfg, key)`), or a function of a param's name
  ("layers/0/w_gate"); by default everything goes to the default device. Each device reads only
  its slice of each tensor. `groups`: layers per stack, as `init_params` takes them (default:
  one stack). Accepts the old and new config key names (num_experts /
  num_local_experts, rope_theta / rope_parameters) and per-expert or fused expert tensors, in
  one or several safetensors files (float32, bfloat16, float16).
  """
  cfg = read_hf_config(path, dtype)
  sources = _sources(cfg, _Tensors(_open_tensors(path)), groups)
  target = jnp.dtype(param_dtype)
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(_default_device())
    shardings = jax.tree.map(lambda _: device, sources)
  elif callable(shardings):
    shardings = jax.tree_util.tree_map_with_path(lambda p, _: shardings(_name(p)), sources)
  elif jax.tree.structure(shardings) != jax.tree.structure(sources):
    raise ValueError(f"shardings do not match the params of {path}: "
                     f"{jax.tree.structure(shardings)} vs {jax.tree.structure(sources)}")

  def build(source: _Source, sharding) -> jax.Array:
    read = lambda index: np.ascontiguousarray(source.read(index), dtype=target)
    return jax.make_array_from_callback(source.shape, sharding, read)

  return cfg, jax.tree.map(build, sources, shardings)
