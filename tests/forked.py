"""Runs entry points as `python -m module args` / `python script args` would, each in a process of
its own forked from one that imported the libraries once (a fresh interpreter spends seconds on
imports per command, most of a test that checks what happens before any work).

  python -m tests.forked '[["-m", "trace_jax.main", "--config.rl.nope=1"], ...]'

prints one JSON object per command: its exit status, stdout and stderr.
"""

import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import traceback

# what the entry points import, not the entry points themselves: their flags must be defined
# once, by the command that runs them
PRELOAD = ("trace_jax", "jax", "absl.app", "ml_collections", "trace_jax.rl.loop",
           "trace_jax.rl.validate", "trace_jax.tasks", "trace_jax.models", "configs.reasoning",
           "experiments.figures")
TIMEOUT_S = 120


def _child(args, out, err) -> int:
  signal.alarm(TIMEOUT_S)  # a command that starts working instead of failing ends here
  os.dup2(out.fileno(), 1)
  os.dup2(err.fileno(), 2)
  try:
    if args[0] == "-m":  # run_module sets argv[0] to the module's file, as python -m does
      sys.argv = ["-m", *args[2:]]
      runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
      sys.argv = list(args)
      runpy.run_path(args[0], run_name="__main__")
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (e.code is not None)
  except BaseException:  # noqa: BLE001 (the traceback is what the command would print)
    traceback.print_exc()
    code = 1
  sys.stdout.flush()
  sys.stderr.flush()
  return code


def run(commands: list[list[str]]) -> list[dict]:
  for name in PRELOAD:
    importlib.import_module(name)
  started = []
  for args in commands:
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    pid = os.fork()
    if pid == 0:
      os._exit(_child(args, out, err))
    started.append((pid, out, err))
  results = []
  for pid, out, err in started:
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    results.append({"returncode": os.waitstatus_to_exitcode(status), "stdout": out.read(),
                    "stderr": err.read()})
  return results


if __name__ == "__main__":
  for result in run(json.loads(sys.argv[1])):
    print(json.dumps(result))
