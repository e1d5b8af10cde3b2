"""RL on the reasoning family (reasoning-gym chain_sum): warm start, then GRPO with FP4 rollouts.

  python -m trace_jax.main --config=configs/reasoning.py --workdir=runs/reasoning
  python -m trace_jax.main --config=configs/reasoning.py:fp4_qat --workdir=runs/qat
  python -m trace_jax.main --config=configs/reasoning.py:trace_all,rl.routing_replay=true ...

The default (the README's main job) trains a 2-layer, 4-expert policy from scratch on sums of
two 1-2 digit numbers: a 100-step supervised warm start (bf16), then 500 GRPO steps in `trace`
mode (MXFP4 weights, activations and KV cache in the rollout; QAT guided by the last layer's
records). About 3 minutes on 2 CPU cores; greedy eval accuracy of the FP4 policy rises from
~0.37 after the warm start to ~0.55, the mean training reward from ~0.25 to ~0.5. Variants: one
per mode (bf16, fp4_rollout, fp4_qat, trace, trace_all), `smoke` (a few steps of everything, for
tests), and any key=value, e.g. `rl.correction=tis`.
"""

import ml_collections

from trace_jax.configs import apply_variant
from trace_jax.rl.trainer import MODES

VARIANTS = {m: {"rl.mode": m} for m in MODES}
VARIANTS["smoke"] = {"sft.steps": 3, "rl.steps": 4, "sft.batch_size": 8,
                     "rl.prompts_per_step": 8, "rl.group_size": 2, "eval.size": 8, "eval.batch_size": 8,
                     "eval.every": 3, "checkpoint.every": 2, "log.flip_rate_every": 2,
                     "task.train_size": 64, "task.eval_size": 16}


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.data_dir = ""  # where TFDS datasets are prepared ("" = the TFDS default)

  c.task = ml_collections.ConfigDict()
  c.task.family = "reasoning"
  c.task.dataset = "chain_sum"
  c.task.min_terms = 2
  c.task.max_terms = 2
  c.task.min_digits = 1
  c.task.max_digits = 2
  c.task.train_size = 5000
  c.task.eval_size = 200
  c.task.prompt_style = "compact"  # compact: "7+5="; question: the generator's full text
  c.max_prompt_len = 8  # tokens; prompts are left-padded to it

  c.model = ml_collections.ConfigDict()
  c.model.d_model = 128
  c.model.n_layers = 2
  c.model.n_heads = 4
  c.model.n_kv_heads = 2
  c.model.head_dim = 32
  c.model.n_experts = 4
  c.model.top_k = 2
  c.model.d_ff = 128
  c.model.init_scale = 1.0

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 100
  c.sft.batch_size = 64
  c.sft.lr = 3e-3

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 500
  c.rl.mode = "trace"  # bf16 | fp4_rollout | fp4_qat | trace | trace_all
  c.rl.fp4 = "mxfp4"  # mxfp4 | nvfp4 (the rollout's format in the FP4 modes)
  c.rl.trace_layers = "last:1"  # the layers `trace` records: none | all | last:N | [i, ...]
  c.rl.prompts_per_step = 32
  c.rl.group_size = 8
  c.rl.max_new_tokens = 4
  c.rl.temperature = 1.0
  c.rl.top_p = 1.0
  c.rl.lr = 3e-4
  c.rl.clip_eps = 0.2
  c.rl.correction = "none"  # none | tis | mis
  c.rl.correction_cap = 2.0
  c.rl.kl_coef = 0.0
  c.rl.aux_coef = 1e-3
  c.rl.minibatches = 2
  c.rl.routing_replay = False

  c.optim = ml_collections.ConfigDict()
  c.optim.max_grad_norm = 1.0
  c.optim.weight_decay = 0.0
  c.optim.b2 = 0.99

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 50
  c.eval.size = 200
  c.eval.batch_size = 100

  c.log = ml_collections.ConfigDict()
  c.log.flip_rate_every = 10  # steps between rollouts that keep every code (0: never)
  c.log.tensorboard = True

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50
  c.checkpoint.keep = 2

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 0  # 0: every device
  c.mesh.expert = 1
  return apply_variant(c, arg, VARIANTS)
