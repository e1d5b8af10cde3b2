"""The RL run's config schema with the reasoning family's defaults; `configs/*.py` start here.

Every key a run reads is defined here, so `--config.x=y` with an unknown `x` fails at parse
time; trace_jax.rl.validate checks the values before any work.
"""

import ml_collections

from trace_jax import distributed
from trace_jax.configs import apply_variant, set_key
from trace_jax.rl.trainer import MODES


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data_dir = ""  # where TFDS datasets are prepared ("" = the TFDS default)
  # GPU runs that repeat themselves bit for bit (XLA's deterministic ops, trace_jax.determinism:
  # no atomic adds in scatters, the same autotuned kernels); false: XLA's defaults, with which
  # two runs of one config need not compute the same. CPUs compute the same either way
  c.deterministic = True

  c.task = ml_collections.ConfigDict()
  c.task.family = "reasoning"  # reasoning | coding | long_horizon
  c.task.train_size = 5000
  c.task.eval_size = 200
  c.task.reasoning = ml_collections.ConfigDict(dict(
      dataset="chain_sum", min_terms=2, max_terms=2, min_digits=1, max_digits=2,
      prompt_style="compact"))  # compact: "7+5="; question: the generator's full text
  # allow_unsandboxed: run the policy's programs even where no kernel sandbox can be had
  # (trace_jax.tasks.sandbox); without it such a run stops at start-up, saying why
  c.task.coding = ml_collections.ConfigDict(dict(families="linear,affine_neg,quadratic",
                                                 timeout_s=1.0, allow_unsandboxed=False))
  c.task.long_horizon = ml_collections.ConfigDict(dict(turns=32, modulus=10))
  c.max_prompt_len = 8  # tokens; prompts are left-padded to it

  # the policy's shape, randomly initialised; or hf_path: a Hugging Face Qwen3-MoE directory
  # whose weights, config, tokenizer.json and stop tokens the run starts from (the shape keys
  # then stay at their defaults), and chat_template: wrap each task prompt in its chat template
  # as one user turn (trace_jax.rl.hf_policy)
  c.model = ml_collections.ConfigDict(dict(
      d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=4, top_k=2,
      d_ff=128, init_scale=1.0, hf_path="", chat_template=False))

  # the supervised warm start (bf16 in every mode); init_from: the workdir of a run of the same
  # warm start (the same config but for what acts only after it: rl.*, eval.*, ...) whose
  # checkpoint of step `steps` this run starts RL from, instead of its own warm start: its
  # policy, optimizer state and metric rows, evaluated again at this run's rollout precision.
  # Runs that compare modes then start RL from one policy (experiments/ablation.py); train the
  # warm start once with rl.steps=0. warmup_steps: the rate rises linearly to lr over the first
  # steps (0: lr from the first step). attention: the warm start's loss attention (full | fused,
  # as rl.attention, which is RL's alone): the warm start is bf16 in every mode and shared by
  # the modes it is compared across, so its attention enters no mode's mismatch
  c.sft = ml_collections.ConfigDict(dict(steps=100, batch_size=64, lr=3e-3, warmup_steps=0,
                                         init_from="", attention="full"))

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 500
  c.rl.mode = "trace"  # bf16 | fp4_rollout | fp4_qat | trace | trace_all
  c.rl.fp4 = "mxfp4"  # the quantized modes' format: any registered one (mxfp4, nvfp4, fp8, ...)
  # recipes replacing the mode's (QuantRecipe.parse: "weights=nvfp4,acts=mxfp4,kv=mxfp4",
  # "mxfp4; layers=last:2,moe_mid=fp8"); "" keeps the mode's
  c.rl.rollout_recipe = ""
  c.rl.train_recipe = ""
  c.rl.trace_layers = "last:1"  # the layers `trace` records: none | all | last:N | [i, ...]
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.max_new_tokens = 4  # single-turn tasks; multi-turn episodes have their own length
  c.rl.temperature = 1.0
  c.rl.top_p = 1.0
  c.rl.lr = 3e-4
  c.rl.clip_eps = 0.2
  c.rl.correction = "none"  # none | tis | mis
  c.rl.correction_cap = 2.0
  c.rl.kl_coef = 0.0  # KL penalty towards the policy where RL starts (after the warm start)
  c.rl.aux_coef = 1e-3
  c.rl.minibatches = 2
  c.rl.routing_replay = False
  # the trainer's memory for compute: none | layer (each layer's activations recomputed in the
  # backward pass, jax.checkpoint, instead of kept); the same values either way
  c.rl.remat = "none"
  # the trainer's attention: full (the score matrix as XLA computes it) | fused
  # (jax.nn.dot_product_attention: cuDNN's fused kernel on a GPU, 4x the speed at a 1 540-token
  # episode on an H100, its probabilities and sums cuDNN's: q's gradient 3e-3 apart, relative;
  # XLA's composition elsewhere). Off by default: what it does to the mismatch is not yet measured
  c.rl.attention = "full"

  # the rollout engine's kernels (pallas_kernels.dispatch.make_ops)
  c.engine = ml_collections.ConfigDict()
  # its matmuls, decode attention and quantization: xla | pallas (the Pallas kernels; GPU,
  # interpret mode elsewhere; MXFP4, NVFP4 and bf16 compute what XLA does up to the order of
  # float32 sums) | tokamax (bf16 experts and attention on the tokamax package's kernels, where
  # it is installed: a baseline for the benchmarks)
  c.engine.kernels = "xla"
  # their decode attention's backend: auto (the Mosaic kernel for MXFP4 caches on Hopper, the
  # Triton one otherwise, as measured) | triton | mosaic
  c.engine.attention_kernel = "auto"
  # how the Triton kernels written in Triton's own language too (the bf16 matmuls, the Triton
  # attention, quantize-and-record) are called: pallas (Pallas' Triton lowering, deprecated from jax 0.11) |
  # jax_triton (those programs through jax-triton; Triton's interpreter off a GPU)
  c.engine.triton_backend = "pallas"
  # the decode step as one lax.scan per run of layers alike (compiled once whatever the depth;
  # the rollout weights then stacked as the master params are) or layer by layer (false, as
  # measured so far); the prefill always scans. The same tokens and records either way
  c.engine.scan_decode = False
  # with kernels=pallas: MXFP4 x MXFP4 projections and experts on FP8 tensor cores (the W4A4
  # kernels, Hopper; their arithmetic by XLA elsewhere), taking the activations' codes; the
  # same values up to float32 sum order; rollout/w4a4_fold_misses counts the activation blocks
  # that took the kernel's exact branch. Off by default: not faster at B >= 16 (BENCHMARKS.md)
  c.engine.w4a4 = False
  # with kernels=pallas: the Mosaic kernels decode MXFP4 weights and KV caches with each block's
  # scale folded into one multiply a pair of values; the same outputs (the caches' block scales
  # within 2^-60 to 2^66, pallas_kernels/decode_attention/mosaic.py). Off: 1-2% on the
  # attention, nothing measurable in the 48-layer rollout (BENCHMARKS.md)
  c.engine.fold_scales = False

  c.optim = ml_collections.ConfigDict(dict(max_grad_norm=1.0, weight_decay=0.0, b2=0.99))
  c.eval = ml_collections.ConfigDict(dict(every=50, size=200, batch_size=100))
  c.log = ml_collections.ConfigDict(dict(
      flip_rate_every=10,  # steps between rollouts that keep every code (0: never)
      tensorboard=True))
  c.checkpoint = ml_collections.ConfigDict(dict(every=50, keep=2))
  # the first data x expert devices; data 0: every device that expert leaves
  c.mesh = ml_collections.ConfigDict(dict(data=0, expert=1))
  # several processes (hosts, or GPUs of one) through jax.distributed: trace_jax.distributed
  c.dist = distributed.config()
  return c


# variants every RL config file offers: one per mode, and `smoke` (seconds, for tests)
VARIANTS = {m: {"rl.mode": m} for m in MODES}
VARIANTS["smoke"] = {"sft.steps": 3, "rl.steps": 4, "sft.batch_size": 8,
                     "rl.prompts_per_step": 8, "rl.group_size": 2, "eval.size": 8,
                     "eval.batch_size": 8, "eval.every": 3, "checkpoint.every": 2,
                     "log.flip_rate_every": 2, "task.train_size": 64, "task.eval_size": 16}
# one H200: a 12-layer, d_model-512 policy with 16 experts (~160M params; the CPU default has
# 2 layers, d_model 128, 4 experts), `trace` recording the deepest third of its layers, and
# batches a GPU keeps busy. Learning rates and schedules stay the CPU's (untuned at this size);
# engine.kernels stays xla: on the H200 XLA's rollout was the faster one on the CPU default policy
# and at this size on reasoning (BENCHMARKS.md, "The `gpu` policy's rollout").
VARIANTS["gpu"] = {"model.d_model": 512, "model.n_layers": 12, "model.n_heads": 8,
                   "model.n_kv_heads": 2, "model.head_dim": 64, "model.n_experts": 16,
                   "model.top_k": 2, "model.d_ff": 512, "rl.trace_layers": "last:4",
                   "sft.batch_size": 256, "rl.prompts_per_step": 64, "rl.group_size": 8,
                   "rl.minibatches": 4, "eval.batch_size": 100}


def config(overrides: dict, arg: str | None) -> ml_collections.ConfigDict:
  """base_config() with a config file's own values, then the command line's variant string."""
  c = base_config()
  for key, value in overrides.items():
    set_key(c, key, value)
  return apply_variant(c, arg, VARIANTS)
