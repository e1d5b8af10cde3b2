"""One run of the ablation (RESULTS.md, experiments/ablation.py): a family's config, resized.

  python -m trace_jax.main --config=configs/ablation.py:family=reasoning,mode=trace \
      --workdir=experiments/results/reasoning/trace/seed0
  python -m trace_jax.main --config=configs/ablation.py:family=long_horizon,mode=fp4_qat,seed=1 \
      --workdir=experiments/results/long_horizon/fp4_qat/seed1

configs/<family>.py with a 3-layer policy (so that `trace` records the deepest layer and
`trace_all` all three), code flips measured every 5 RL steps, and the ablation's schedule:
300 GRPO steps for reasoning and coding, 200 for long-horizon after a 300-step warm start. On 2
CPU cores the five modes took 12 minutes (reasoning) and 31 (coding); RESULTS.md has the rest. `experiments/ablation.py`
runs exactly these configs in these workdirs, so a run made by this command is picked up there,
not rerun. Variant parts: `family=` (reasoning | coding | long_horizon, default reasoning),
`mode=` (bf16 | fp4_rollout | fp4_qat | trace | trace_all, default trace), `seed=`, `scale=`
(cpu, the default: the above; gpu: below), `smoke` (a few steps, for tests) and any key=value
of trace_jax/rl/defaults.py, applied after the ablation's own values.

`scale=gpu` is the ablation at the size of one H200 (`experiments/ablation.py --scale=gpu`): the
`gpu` policy (12 layers, d_model 512, 16 experts, `trace` recording the last 4 layers) on harder
tasks: chain sums of 3 terms of up to 2 digits (two additions where the CPU ablation has one),
and long-horizon episodes of 256 turns (512 sampled tokens, ~1 500 in all), with short
schedules (GPU_SCHEDULE) so that a run takes minutes there.
"""

import importlib.util
import os

from trace_jax.configs import apply_variant, set_key
from trace_jax.rl.defaults import VARIANTS
from trace_jax.rl.validate import FAMILIES

__all__ = ["VARIANTS", "get_config", "ABLATION", "SCHEDULE", "SCALES", "GPU_SCHEDULE"]

ABLATION = {"model.n_layers": 3, "rl.trace_layers": "last:1", "log.flip_rate_every": 5}
# the CPU budget of one run per family (minutes on 2 cores): fewer RL steps than the defaults;
# the 3-layer long-horizon policy needs twice the default warm start to learn the format (at
# 150 steps its SFT loss was still falling steeply and greedy accuracy was 0.18-0.22)
SCHEDULE = {"reasoning": {"rl.steps": 300}, "coding": {"rl.steps": 300},
            "long_horizon": {"sft.steps": 300, "rl.steps": 200}}
SCALES = ("cpu", "gpu")
# scale=gpu: the `gpu` variant of trace_jax/rl/defaults.py, harder tasks, and schedules meant for
# under 10 minutes a run on one H200. Reasoning, timed there in bf16 (2026-12-04): 3-4 terms of
# up to 3 digits after 300 supervised steps left greedy accuracy at 0.07 and RL at a reward of
# 0.05 (nothing to learn from); 3 terms of up to 2 digits, 500 supervised and 200 RL steps,
# went 0.445 -> 0.540 in 3.5 minutes. Long-horizon's warm start, timed on an H100 (2026-12-07,
# RESULTS.md): 1.1 s a step of 32 episodes, its loss at ln(10)/2 (uniform digits) from step 22
# to 140, then falling. On cuDNN's fused attention (`sft.attention`, 2026-12-08, H100) 0.62 s a
# step, and that run's plateau lasted to about step 330 (greedy accuracy 0.113 at step 349):
# how long it lasts varies from run to run, so 700 steps (~7 minutes, what 400 took on the full
# attention) keep ~370 past the later of the two. Its RL step on the same GPU (2026-12-07,
# XLA's engine): 6.6 s of rollout and 4.2 s of training after the compiling steps; its rollout
# on the engine's Pallas kernels took 3.4 s against XLA's 5.3 (BENCHMARKS.md), so long-horizon
# rolls out on them (reasoning's prefill-heavy rollout stays on XLA, the faster there). Its RL
# at the default rl.lr of 3e-4 (bf16, seed 0, H100, 2026-12-07): the reward rose from 0.34 to
# 0.81 in 30 steps and fell to 0.2 at step 32 for good (eval 0.620 -> 0.204), a collapse of
# bf16 itself, which would leave the modes' collapses nothing to be told apart from; so 1e-4
# (RESULTS.md's ledger). Coding is not yet timed.
GPU_ABLATION = {"log.flip_rate_every": 5}
GPU_SCHEDULE = {
    "reasoning": {"task.reasoning.min_terms": 3, "task.reasoning.max_terms": 3,
                  "task.reasoning.max_digits": 2, "max_prompt_len": 16, "rl.max_new_tokens": 6,
                  "sft.steps": 500, "rl.steps": 200},
    "coding": {"sft.steps": 300, "rl.steps": 100},
    # episodes of ~1 500 tokens: each layer's activations recomputed in the backward pass
    # (rl.remat, the trainer's, warm start included); without it one warm-start step at a
    # batch of 8 asked for a 29.9 GB buffer on CPU. The warm start's loss on cuDNN's fused
    # attention (sft.attention): its step at 32 episodes took 631 ms against the full
    # attention's 873 on an H100 (BENCHMARKS.md), ~1.6 of the ~7 minutes every GPU machine
    # spends making a seed's warm start again; RL's trainer keeps the full attention, whose
    # sums every mode's measured mismatch shares
    "long_horizon": {"task.long_horizon.turns": 256, "sft.steps": 700, "sft.batch_size": 32,
                     "sft.attention": "fused",
                     "rl.steps": 60, "rl.prompts_per_step": 16, "eval.size": 50,
                     "eval.batch_size": 50, "rl.remat": "layer", "engine.kernels": "pallas",
                     "rl.lr": 1e-4}}


def _family_config(family: str):
  # by path, not `import configs.x`: config_flags loads this file by path from any directory
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{family}.py")
  spec = importlib.util.spec_from_file_location(f"_ablation_{family}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config(arg=None):
  family, scale, rest = "reasoning", "cpu", []
  for part in filter(None, (arg or "").split(",")):
    key, _, value = part.partition("=")
    if key.strip() == "family":
      family = value.strip()
    elif key.strip() == "scale":
      scale = value.strip()
    elif key.strip() == "mode":
      rest.append(f"rl.mode={value.strip()}")
    else:
      rest.append(part)
  if family not in FAMILIES:
    raise ValueError(f"unknown ablation family {family!r}; choose one of {FAMILIES}")
  if scale not in SCALES:
    raise ValueError(f"unknown ablation scale {scale!r}; choose one of {SCALES}")
  c = _family_config(family)
  if scale == "gpu":
    values = {**VARIANTS["gpu"], **GPU_ABLATION, **GPU_SCHEDULE[family]}
  else:
    values = {**ABLATION, **SCHEDULE[family]}
  for key, value in values.items():
    set_key(c, key, value)
  return apply_variant(c, ",".join(rest), VARIANTS)
