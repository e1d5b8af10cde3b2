"""Config checks that run before any work: every bad value is named with its choices."""

from __future__ import annotations

import os

import jax
import ml_collections

from pallas_kernels.dispatch import ATTENTION_KERNELS, KERNELS, TRITON_BACKENDS
from trace_jax import distributed
from trace_jax.models.recipe import QuantRecipe, parse_layers, precisions
from trace_jax.rl import hf_policy
from trace_jax.rl.grpo import CORRECTIONS
from trace_jax.rl.trainer import ATTENTIONS, MODES, REMAT, mode_setup
from trace_jax.tasks import FunctionSynthesisTask, ReasoningTask, RunningSumTask, sandbox

FAMILIES = ("reasoning", "coding", "long_horizon")


def make_task(t: ml_collections.ConfigDict):
  """The task of a config's `task` section."""
  _choice("task.family", t.family, FAMILIES)
  if t.family == "reasoning":
    r = t.reasoning
    options = (("min_terms", r.min_terms), ("max_terms", r.max_terms),
               ("min_digits", r.min_digits), ("max_digits", r.max_digits))
    return ReasoningTask(dataset=r.dataset, options=options, train_size=t.train_size,
                         eval_size=t.eval_size, prompt_style=r.prompt_style)
  if t.family == "coding":
    return FunctionSynthesisTask(families=t.coding.families, train_size=t.train_size,
                                 eval_size=t.eval_size, timeout_s=t.coding.timeout_s,
                                 allow_unsandboxed=t.coding.allow_unsandboxed)
  return RunningSumTask(turns=t.long_horizon.turns, modulus=t.long_horizon.modulus,
                        train_size=t.train_size, eval_size=t.eval_size)


def _choice(name: str, value, choices) -> None:
  if value not in choices:
    raise ValueError(f"{name}={value!r}: choose one of {tuple(choices)}")


def _positive(c, *names: str) -> None:
  for name in names:
    value = c
    for part in name.split("."):
      value = value[part]
    if not value > 0:
      raise ValueError(f"{name} must be > 0, got {value!r}")


def _check_mesh(c, n_devices: int) -> None:
  """Batches must split over the mesh: the trainer splits sequences over all devices, the
  rollout over the data axis."""
  expert = c.mesh.expert
  data = c.mesh.data or n_devices // max(expert, 1)
  if expert < 1 or data < 1 or data * expert > n_devices:
    raise ValueError(f"mesh.data={c.mesh.data} x mesh.expert={expert} needs more than the "
                     f"{n_devices} devices there are")
  check_mesh_spans_processes(data, expert, n_devices)
  rl_batch = c.rl.prompts_per_step * c.rl.group_size
  for name, size in [("sft.batch_size", c.sft.batch_size), ("eval.batch_size", c.eval.batch_size),
                     ("rl.prompts_per_step x rl.group_size / rl.minibatches",
                      rl_batch // c.rl.minibatches)]:
    if size % (data * expert):
      raise ValueError(f"{name} = {size} does not split over {data * expert} devices")


def check_mesh_spans_processes(data: int, expert: int, n_devices: int) -> None:
  """Under several processes every one must hold part of the mesh (each runs every program on
  its own devices), so the mesh takes every device."""
  if jax.process_count() > 1 and data * expert != n_devices:
    raise ValueError(f"mesh.data={data} x mesh.expert={expert} = {data * expert} devices, but "
                     f"under jax.distributed the mesh takes every one of the {n_devices} "
                     f"devices of the {jax.process_count()} processes (mesh.data=0: all that "
                     "mesh.expert leaves)")


def validate(c: ml_collections.ConfigDict, n_devices: int | None = None) -> None:
  """Raises ValueError naming the first bad key (unknown keys fail earlier, in set_key)."""
  distributed.check(c.dist)
  _choice("rl.mode", c.rl.mode, MODES)
  _choice("rl.fp4", c.rl.fp4, [p for p in precisions() if p != "bf16"])
  _choice("rl.correction", c.rl.correction, CORRECTIONS)
  _choice("engine.kernels", c.engine.kernels, KERNELS)
  _choice("engine.attention_kernel", c.engine.attention_kernel, ATTENTION_KERNELS)
  if c.engine.w4a4 and c.engine.kernels != "pallas":
    raise ValueError(f"engine.w4a4 runs the Pallas W4A4 kernels: it needs engine.kernels=pallas "
                     f"(got {c.engine.kernels!r})")
  if c.engine.fold_scales and c.engine.kernels != "pallas":
    raise ValueError(f"engine.fold_scales folds the Pallas kernels' MXFP4 decode: it needs "
                     f"engine.kernels=pallas (got {c.engine.kernels!r})")
  _choice("engine.triton_backend", c.engine.triton_backend, TRITON_BACKENDS)
  if c.engine.triton_backend != "pallas" and c.engine.kernels != "pallas":
    raise ValueError(f"engine.triton_backend={c.engine.triton_backend!r} calls the Pallas "
                     f"kernels' Triton programs: it needs engine.kernels=pallas (got "
                     f"{c.engine.kernels!r})")
  _choice("rl.remat", c.rl.remat, REMAT)
  _choice("rl.attention", c.rl.attention, ATTENTIONS)
  _choice("sft.attention", c.sft.attention, ATTENTIONS)
  hf = hf_policy.check(c)  # the checkpoint's shape with model.hf_path
  n_layers = (hf or c.model).n_layers
  parse_layers(c.rl.trace_layers, n_layers, what="rl.trace_layers")
  for key in ("rollout_recipe", "train_recipe"):
    if c.rl[key]:
      try:
        QuantRecipe.parse(c.rl[key]).check(n_layers)
      except ValueError as e:
        raise ValueError(f"rl.{key}: {e}") from None
  try:
    mode_setup(c.rl.mode, c.rl.fp4, c.rl.trace_layers, c.rl.rollout_recipe,
               c.rl.train_recipe).check(n_layers)
  except ValueError as e:
    raise ValueError(f"rl.mode={c.rl.mode!r} (rl.fp4={c.rl.fp4!r}, rl.rollout_recipe="
                     f"{c.rl.rollout_recipe!r}, rl.train_recipe={c.rl.train_recipe!r}): {e}; a "
                     "record guides only the format it was made in: give both recipes the same "
                     "format there (or bf16 in the trainer), or record other layers "
                     "(rl.trace_layers)") from None
  _positive(c, "sft.batch_size", "rl.prompts_per_step", "rl.max_new_tokens", "rl.lr",
            "eval.every", "eval.size", "eval.batch_size", "checkpoint.every",
            "checkpoint.keep", "max_prompt_len", "rl.minibatches", "rl.correction_cap")
  if c.sft.steps < 0 or c.rl.steps < 0 or c.sft.steps + c.rl.steps == 0:
    raise ValueError(f"sft.steps ({c.sft.steps}) and rl.steps ({c.rl.steps}) must be >= 0 and "
                     "not both 0")
  if not 0 <= c.sft.warmup_steps <= c.sft.steps:
    raise ValueError(f"sft.warmup_steps ({c.sft.warmup_steps}) must be within 0 and sft.steps "
                     f"({c.sft.steps}): the steps over which the warm start's rate rises")
  if c.sft.init_from:
    checkpoints = os.path.join(c.sft.init_from, "checkpoints")
    if c.sft.steps == 0:
      raise ValueError(f"sft.init_from={c.sft.init_from!r} with sft.steps=0: there is no warm "
                       "start to take; set sft.steps to where that run's warm start ends")
    if not os.path.isdir(os.path.join(checkpoints, str(c.sft.steps))):
      raise ValueError(f"sft.init_from={c.sft.init_from!r}: {checkpoints} holds no checkpoint "
                       f"of step {c.sft.steps} (sft.steps, where the warm start ends); train "
                       "the warm start there first (this config with rl.steps=0 and no "
                       "sft.init_from)")
  if c.rl.group_size < 2:
    raise ValueError(f"rl.group_size must be >= 2 (GRPO compares samples of a prompt), got "
                     f"{c.rl.group_size}")
  batch = c.rl.prompts_per_step * c.rl.group_size
  if batch % c.rl.minibatches:
    raise ValueError(f"rl.prompts_per_step x rl.group_size = {batch} does not split into "
                     f"rl.minibatches={c.rl.minibatches}")
  if c.rl.temperature < 0 or not 0 < c.rl.top_p <= 1:
    raise ValueError(f"rl.temperature must be >= 0 and rl.top_p in (0, 1]; got "
                     f"{c.rl.temperature}, {c.rl.top_p}")
  if c.rl.top_p < 1 and c.rl.correction != "none":
    # the rollout's log-probs are of the full tempered distribution (what the trainer
    # recomputes), but top_p samples from its renormalised nucleus: the correction's ratio
    # would be against a distribution nothing sampled from (rollout.SamplingConfig)
    raise ValueError(f"rl.top_p={c.rl.top_p} with rl.correction={c.rl.correction!r}: the "
                     "correction's ratio needs the sampling distribution, which top_p < 1 "
                     "truncates; use rl.top_p=1 or rl.correction='none'")
  if c.log.flip_rate_every < 0:
    raise ValueError(f"log.flip_rate_every must be >= 0, got {c.log.flip_rate_every}")
  _check_mesh(c, jax.device_count() if n_devices is None else n_devices)
  make_task(c.task)  # unknown dataset or generator options fail here


def check_workdir(workdir: str, what: str = "workdir") -> None:
  """A workdir must be a directory, or a path where one can be made."""
  path = os.path.abspath(workdir)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  if not os.path.isdir(path):
    where = "is" if path == os.path.abspath(workdir) else f"is inside {path}, which is"
    raise ValueError(f"{what} {workdir} {where} a file, not a directory")
  if not os.access(path, os.W_OK | os.X_OK):
    raise ValueError(f"{what} {workdir}: {path} is not writable")


def check_sandbox(c: ml_collections.ConfigDict) -> None:
  """The coding family runs programs only behind a sandbox boundary, or where the user allowed
  it without one (raises sandbox.BoundaryUnavailable, one line saying why)."""
  if c.task.family == "coding":
    sandbox.require(c.task.coding.allow_unsandboxed)
