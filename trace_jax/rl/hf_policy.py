"""RL from a Hugging Face Qwen3-MoE checkpoint (`model.hf_path`): the policy's config, weights,
tokenizer and stop tokens come from the checkpoint's directory.

The model's shape is the checkpoint's, so `model.*` keys set away from their defaults must
agree with it. Task prompts stay plain text by default (a task's prompt is what its reward
and warm start were written for); `model.chat_template=true` wraps each one as the single user
turn of the checkpoint's chat template, followed by the assistant's turn.
"""

from __future__ import annotations

import functools

import jax
import ml_collections

from trace_jax import sharding as S
from trace_jax.data.tokenizer import HFTokenizer
from trace_jax.models import ModelConfig, init_params
from trace_jax.models.hf import load_hf, read_hf_config
from trace_jax.rl.defaults import base_config

# model.* keys about where the policy comes from, not its shape
SOURCE_KEYS = ("hf_path", "chat_template")


def model_config(c: ml_collections.ConfigDict, tokenizer) -> ModelConfig:
  """The policy's ModelConfig: the checkpoint's with model.hf_path, else the config's own
  shape over the tokenizer's vocabulary."""
  if c.model.hf_path:
    return read_hf_config(c.model.hf_path)
  shape = {k: v for k, v in c.model.items() if k not in SOURCE_KEYS}
  return ModelConfig(vocab_size=tokenizer.vocab_size, **shape)


def check(c: ml_collections.ConfigDict) -> ModelConfig | None:
  """Before any work: the checkpoint's config, its tokenizer and the model.* keys that would
  contradict it. -> the checkpoint's ModelConfig, or None without model.hf_path."""
  if not c.model.hf_path:
    if c.model.chat_template:
      raise ValueError("model.chat_template=True needs model.hf_path (a checkpoint's template)")
    return None
  path = c.model.hf_path
  cfg = read_hf_config(path)
  defaults = base_config().model
  for key in sorted(set(c.model.keys()) - set(SOURCE_KEYS)):
    if c.model[key] != defaults[key] and c.model[key] != getattr(cfg, key):
      raise ValueError(f"model.{key}={c.model[key]!r} contradicts model.hf_path={path!r} "
                       f"({key}={getattr(cfg, key)!r}): the model's shape is the checkpoint's; "
                       f"leave model.{key} at its default")
  tok = HFTokenizer.from_directory(path)
  if tok.vocab_size > cfg.vocab_size:
    raise ValueError(f"{path}: tokenizer.json has {tok.vocab_size} tokens, the model's "
                     f"embedding {cfg.vocab_size} rows")
  if tok.eos_id is None:
    raise ValueError(f"{path}: tokenizer_config.json names no eos_token (answers end at it, "
                     "and the warm start teaches it)")
  if c.model.chat_template and tok.chat_template is None:
    raise ValueError(f"model.chat_template=True, but {path} has no chat template "
                     "(tokenizer_config.json's chat_template or chat_template.jinja)")
  return cfg


def load_params(path: str, cfg: ModelConfig, mesh, groups=None) -> dict:
  """The checkpoint's weights as float32 master params (layers in stacks of `groups`), each
  device reading its slice straight into the training sharding."""
  abstract = jax.eval_shape(functools.partial(init_params, cfg, groups=groups),
                            jax.random.PRNGKey(0))
  _, params = load_hf(path, cfg.dtype, groups=groups,
                      shardings=S.param_shardings(abstract, mesh, S.TRAIN_RULES))
  return params


class ChatPrompts:
  """A task whose prompts are wrapped in the tokenizer's chat template; all else is the
  task's."""

  def __init__(self, task, tokenizer: HFTokenizer):
    self._task, self._tok = task, tokenizer

  def prompt(self, record) -> str:
    return self._tok.chat(self._task.prompt(record))

  def __getattr__(self, name):
    return getattr(self._task, name)
