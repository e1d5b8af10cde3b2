"""Runs an entry point as N processes joined by jax.distributed on this host (a coordinator on
localhost at a free port, each process with its own fake CPU devices), as a cluster would.

The processes are always ended: when one fails the others are killed at once (they would wait
for it in their next collective), and all are killed at the deadline, so a failing test cannot
hang CI. SIGKILL, since a run takes SIGTERM as a request to stop after its step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import portpicker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env(devices: int) -> dict:
  """The environment of a process with `devices` fake CPU devices (and no GPU)."""
  out = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  out.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu")
  return out


class Processes:
  """`python args... --config.dist.*` started once per process (`extra[i]`: more arguments for
  process i); `wait` collects them. With `dist=False` (one process) no jax.distributed at all.

  `heartbeat_s` is how long the service waits for a silent process before it stops them all:
  a minute by default, since on a loaded two-core machine three processes that compile at
  once can starve a heartbeat thread for ten seconds; a test of failure sets it shorter."""

  def __init__(self, args: list[str], n: int = 2, devices: int = 4, dist: bool = True,
               heartbeat_s: int = 60, extra: list[list[str]] | None = None):
    port = portpicker.pick_unused_port()
    self.outs, self.procs = [], []
    for i in range(n):
      flags = [f"--config.dist.coordinator=localhost:{port}", f"--config.dist.num_processes={n}",
               f"--config.dist.process_id={i}", "--config.dist.init_timeout_s=120",
               f"--config.dist.heartbeat_timeout_s={heartbeat_s}"] if dist else []
      out = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block the process
      self.outs.append(out)
      self.procs.append(subprocess.Popen(
          [sys.executable, *args, *flags, *(extra[i] if extra else [])], cwd=ROOT,
          env=env(devices),
          stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True))

  def signal(self, i: int, signum: int) -> None:
    self.procs[i].send_signal(signum)

  def kill(self) -> None:
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()

  def wait(self, timeout_s: float, ok=(0,)) -> list[tuple[int, str]]:
    """(exit status, output) of each process; the others are killed as soon as one exits with
    a status not in `ok`."""
    deadline = time.time() + timeout_s
    try:
      while any(p.poll() is None for p in self.procs):
        if any(p.poll() not in (None, *ok) for p in self.procs) or time.time() > deadline:
          break
        time.sleep(0.1)
      timed_out = any(p.poll() is None for p in self.procs) and time.time() > deadline
    finally:
      self.kill()
    results = []
    for p, out in zip(self.procs, self.outs):
      out.seek(0)
      results.append((p.returncode, out.read()))
      out.close()
    if timed_out:
      raise TimeoutError(f"still running after {timeout_s:.0f}s, killed: " + " | ".join(
          f"process {i}: ...{text[-1500:]}" for i, (_, text) in enumerate(results)))
    return results


def why(text: str, tail: int = 1500) -> str:
  """A failed process's output for an assertion message: the error lines of JAX's C++ logs
  (`E...`/`F...`, where a process that aborts says why, above its stack trace) and the tail."""
  errors = [line for line in text.splitlines() if re.match(r"[EF]\d{4} ", line)]
  return "\n".join(errors[-8:] + ["...", text[-tail:]])


def run(args: list[str], n: int = 2, devices: int = 4, timeout_s: float = 600,
        **kw) -> list[str]:
  """Runs them to the end; -> each process's output. Fails naming the first that failed."""
  procs = Processes(args, n, devices, **kw)
  results = procs.wait(timeout_s)
  for i, (code, text) in enumerate(results):
    assert code == 0, f"process {i} of {n} exited {code}:\n{why(text, 4000)}"
  return [text for _, text in results]
