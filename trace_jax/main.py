"""The main entry point: RL of an MoE policy with FP4 rollouts and TRACE.

    python -m trace_jax.main --config=configs/reasoning.py[:variant] --workdir=<dir> \\
        [--config.key=value ...]

Rerunning the same command with the same workdir resumes from the newest checkpoint.
"""

from absl import app, flags, logging
from ml_collections import config_flags

from trace_jax.rl.loop import train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/reasoning.py", "run config file")
_WORKDIR = flags.DEFINE_string("workdir", "runs/reasoning", "checkpoints, metrics and plots")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  train(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)


if __name__ == "__main__":
  app.run(main)
