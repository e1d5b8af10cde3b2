"""RL on the long-horizon family: a 32-turn running-sum environment, ~195 tokens per episode.

  python -m trace_jax.main --config=configs/long_horizon.py --workdir=runs/long_horizon

Every turn the environment's observation (`y+7>`: the verdict on the last answer, the next
operation) is appended to the context and the KV cache; the policy answers with the running
total mod 10 (`2;`). Observations are masked out of the loss and the mismatch metrics; the
reward is the fraction of turns answered right. Variants and keys as in configs/reasoning.py.
"""

from trace_jax.rl.defaults import VARIANTS, config

__all__ = ["VARIANTS", "get_config"]


def get_config(arg=None):
  return config({"task.family": "long_horizon", "task.train_size": 2000, "task.eval_size": 100,
                 "sft.steps": 150, "sft.batch_size": 32, "rl.steps": 250,
                 "rl.prompts_per_step": 8, "rl.group_size": 4, "eval.size": 100,
                 "eval.batch_size": 50}, arg)
