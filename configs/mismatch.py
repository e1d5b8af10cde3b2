"""The mismatch probe: rollout vs training-path log-probs per precision, guidance and replay.

  python -m trace_jax.mismatch --config=configs/mismatch.py           # small model, ~2-3 min on 2 CPUs
  python -m trace_jax.mismatch --config=configs/mismatch.py:quick     # tiny model, under a minute
  python -m trace_jax.mismatch --config=configs/mismatch.py:hf_path=/path/to/Qwen3-MoE-dir
  python -m trace_jax.mismatch --config=configs/mismatch.py:checkpoint=runs/reasoning

One rollout batch per rollout precision (bf16, fp8, mxfp4, nvfp4) with records for every layer,
then the trainer's recomputation for each guidance (none, last:N, all) and routing replay (off,
on). Expected: flip rate exactly 0 at recorded sites with records=all and replay on; KL of
FP4+TRACE(all) near the bf16-vs-bf16 floor and far below unguided FP4; last:N in between.
Override any key with --config.key=value, e.g. --config.max_new_tokens=64.
"""

import ml_collections

from trace_jax import distributed
from trace_jax.configs import apply_variant

VARIANTS = {
    "quick": dict(model="tiny", batch=4, prompt_len_min=4, prompt_len_max=12, max_new_tokens=40,
                  guidance="none,last:1,all", n_buckets=4),
}


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.model = "small"  # a preset of trace_jax.models.PRESETS, or see hf_path
  c.init_seed = 0
  c.init_scale = 1.0  # std multiplier of the random init
  c.hf_path = ""  # a Hugging Face Qwen3-MoE directory instead of a random init
  c.checkpoint = ""  # or an RL run's workdir: its newest policy, prompts from its eval set
  c.batch = 8
  c.prompt_len_min = 16
  c.prompt_len_max = 48
  c.max_new_tokens = 320
  c.temperature = 1.0
  c.top_p = 1.0  # samples from the nucleus; log-probs stay those of the full distribution
  c.precisions = "bf16,fp8,mxfp4,nvfp4"
  c.guidance = "none,last:2,all"
  c.routing_replay = "off,on"
  c.n_buckets = 8  # response-position buckets of mismatch/kl_k3_by_position
  c.attn_chunk = 64  # flash-decoding split of the rollout's attention
  # the rollout engine's kernels: xla | pallas (GPU; interpret mode elsewhere, slow) | tokamax
  # (bf16: that package's kernels, where installed), and the decode attention's backend under
  # pallas: auto | triton | mosaic (trace_jax.rl.rollout)
  c.kernels = "xla"
  c.attention_kernel = "auto"
  # MXFP4 x MXFP4 matmuls on the W4A4 (FP8 tensor core) kernels, with kernels=pallas
  c.w4a4 = False
  # the rollout's decode step as one scan over stacked layers (engine.scan_decode): compiles in
  # the same time at every depth, where the unrolled step grows with it
  c.scan_decode = False
  # the trainer's attention (rl.attention): full | fused (jax.nn.dot_product_attention, cuDNN's
  # fused kernel on a GPU)
  c.attention = "full"
  c.seed = 0
  c.output = ""  # also write the JSON lines here
  # the first data x expert devices (trace_jax.sharding; data 0: every device that expert
  # leaves): the rollout splits the batch over data and experts over expert, the training path
  # the batch over both; under jax.distributed it takes every device of every process
  c.mesh = ml_collections.ConfigDict(dict(data=1, expert=1))
  c.dist = distributed.config()  # several processes: trace_jax.distributed
  return apply_variant(c, arg, VARIANTS)
