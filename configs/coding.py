"""RL on the coding family: write `f(x)` from two examples; programs run in the sandbox.

  python -m trace_jax.main --config=configs/coding.py --workdir=runs/coding
  python -m trace_jax.main --config=configs/coding.py:trace_all --workdir=runs/coding_all

Prompts like `f(0)=7,f(1)=10,f(2)=13:`; the policy writes the body (`3*x+7`; the families are
a*x+b, a*x-b and x*x+a), which runs as
`def f(x): return (3*x+7)` against hidden tests, each program in a bubblewrap sandbox of its
own (trace_jax.tasks.sandbox; without one the run stops at start-up unless
task.coding.allow_unsandboxed=true); reward 1 when all pass. Same policy size and schedule as
configs/reasoning.py. Variants and keys as there.
"""

from trace_jax.rl.defaults import VARIANTS, config

__all__ = ["VARIANTS", "get_config"]


def get_config(arg=None):
  return config({"task.family": "coding", "task.train_size": 4000, "max_prompt_len": 32,
                 "rl.max_new_tokens": 8}, arg)
