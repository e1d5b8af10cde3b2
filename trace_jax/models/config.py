"""Model configuration of the Qwen3-MoE family, and its presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and numerics of a Qwen3-MoE decoder (DESIGN section 3). Hashable: jit-static."""

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  n_experts: int
  top_k: int
  d_ff: int  # per expert
  norm_eps: float = 1e-6
  rope_theta: float = 1e6
  norm_topk_prob: bool = True
  router_aux_loss_coef: float = 1e-3
  tie_embeddings: bool = False
  dtype: str = "bfloat16"  # activations; params are float32
  init_scale: float = 1.0  # multiplies the default init std (larger: more decisive routing)

  def __post_init__(self):
    problems = []
    if self.n_heads % self.n_kv_heads:
      problems.append(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                      f"({self.n_kv_heads})")
    if not 0 < self.top_k <= self.n_experts:
      problems.append(f"top_k ({self.top_k}) must be in [1, n_experts={self.n_experts}]")
    if self.head_dim % 2:
      problems.append(f"head_dim ({self.head_dim}) must be even for rotate-half RoPE")
    if self.n_experts > 256:
      problems.append(f"n_experts ({self.n_experts}) must fit the uint8 routing record")
    if self.dtype not in ("bfloat16", "float32"):
      problems.append(f"dtype must be 'bfloat16' or 'float32', got {self.dtype!r}")
    if problems:
      raise ValueError("bad ModelConfig: " + "; ".join(problems))

  @property
  def act_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def q_dim(self) -> int:
    return self.n_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.n_kv_heads * self.head_dim

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)


def tiny(**kw) -> ModelConfig:
  """Unit tests: compiles in seconds."""
  defaults = dict(vocab_size=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                  n_experts=4, top_k=2, d_ff=64)
  return ModelConfig(**{**defaults, **kw})


def small(**kw) -> ModelConfig:
  """CPU experiments in minutes."""
  defaults = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=32,
                  n_experts=8, top_k=2, d_ff=128)
  return ModelConfig(**{**defaults, **kw})


def qwen3_30b_a3b(n_layers: int = 48, **kw) -> ModelConfig:
  """Qwen3-30B-A3B shapes with a configurable depth, for GPU benchmarks."""
  defaults = dict(vocab_size=151936, d_model=2048, n_heads=32, n_kv_heads=4, head_dim=128,
                  n_experts=128, top_k=8, d_ff=768, norm_topk_prob=True)
  return ModelConfig(n_layers=n_layers, **{**defaults, **kw})


PRESETS = {"tiny": tiny, "small": small, "qwen3_30b_a3b": qwen3_30b_a3b}


def preset(name: str, **kw) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name](**kw)
