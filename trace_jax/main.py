"""The main entry point: RL of an MoE policy with FP4 rollouts and TRACE.

    python -m trace_jax.main --config=configs/reasoning.py[:variant] --workdir=<dir> \\
        [--config.key=value ...]

Rerunning the same command with the same workdir resumes from the newest checkpoint. SIGTERM
or Ctrl-C stops the run after the step in flight, with a checkpoint (a second one stops at
once); the exit status is then 128 + the signal's number. Bad input (an unknown key, a bad
value, a workdir that is a file, a workdir whose checkpoints cannot continue this run) stops
it first, with one line naming it and what to do; exit status 2.

Several processes (hosts, or GPUs of one host) run the same command each, with
`--config.dist.coordinator=host:port --config.dist.num_processes=N --config.dist.process_id=i`
(or `--config.dist.coordinator=auto` under Slurm, Open MPI, Kubernetes: trace_jax.distributed).
"""

import sys

from absl import flags, logging

from trace_jax import cli, determinism, distributed
from trace_jax.rl.checkpoint import CannotResume
from trace_jax.rl.loop import Interrupted, train
from trace_jax.rl.validate import check_sandbox, check_workdir, validate
from trace_jax.tasks.sandbox import BoundaryUnavailable

_CONFIG = cli.ConfigFile("config", "configs/reasoning.py", "run config file")
_WORKDIR = flags.DEFINE_string("workdir", "runs/reasoning", "checkpoints, metrics and plots")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")


def main(argv):
  if len(argv) > 1:
    cli.fail(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  c = _CONFIG.value
  with cli.bad_input():
    determinism.enable(c.deterministic)  # both before anything asks JAX for its devices
    distributed.initialize(c.dist)
  with distributed.exit_at_once_on_failure():
    with cli.bad_input(ValueError, BoundaryUnavailable):
      validate(c)
      check_workdir(_WORKDIR.value)
      check_sandbox(c)
    try:
      with cli.bad_input(CannotResume):  # the workdir's checkpoints, read before any work
        train(c, _WORKDIR.value, progress=_PROGRESS.value)
    except Interrupted as e:  # train has said where the run stands
      sys.exit(128 + e.signum)


if __name__ == "__main__":
  cli.run(main, _CONFIG)
