"""The Qwen3-MoE policy: config presets, the decoder written once, the two execution paths."""

from trace_jax.models.config import PRESETS, ModelConfig, preset, qwen3_30b_a3b, small, tiny
from trace_jax.models.hf import load_hf
from trace_jax.models.paths import TrainPath
from trace_jax.models.rollout_path import RolloutPath, RolloutWeights, pack_weights
from trace_jax.models.qwen3_moe import forward, init_params, logits
from trace_jax.models.recipe import SITES, QuantRecipe, parse_layers

__all__ = [
    "PRESETS", "SITES", "ModelConfig", "QuantRecipe", "RolloutPath", "RolloutWeights",
    "TrainPath", "forward", "init_params", "load_hf", "logits", "pack_weights", "parse_layers",
    "preset", "qwen3_30b_a3b", "small", "tiny",
]
