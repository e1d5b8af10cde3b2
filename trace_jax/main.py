"""The main entry point: RL of an MoE policy with FP4 rollouts and TRACE.

    python -m trace_jax.main --config=configs/reasoning.py[:variant] --workdir=<dir> \\
        [--config.key=value ...]

Rerunning the same command with the same workdir resumes from the newest checkpoint. SIGTERM
or Ctrl-C stops the run after the step in flight, with a checkpoint (a second one stops at
once); the exit status is then 128 + the signal's number.
"""

import sys

from absl import app, flags, logging
from ml_collections import config_flags

from trace_jax.rl.loop import Interrupted, train

_CONFIG = config_flags.DEFINE_config_file("config", "configs/reasoning.py", "run config file")
_WORKDIR = flags.DEFINE_string("workdir", "runs/reasoning", "checkpoints, metrics and plots")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.WARNING)
  try:
    train(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
  except Interrupted as e:  # train has said where the run stands
    sys.exit(128 + e.signum)


if __name__ == "__main__":
  app.run(main)
