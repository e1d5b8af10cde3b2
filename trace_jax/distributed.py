"""Several processes through jax.distributed: how a command learns it is one of them, and what
they agree on.

A run over several hosts (or several processes on one) is the same command started once per
process, with the config's `dist` section saying where the coordinator is:

    python -m trace_jax.main --config=configs/reasoning.py --workdir=runs/x \\
        --config.dist.coordinator=host0:1234 --config.dist.num_processes=2 \\
        --config.dist.process_id=0          # and process_id=1 on the other process

- `dist.coordinator`: "" (one process: the default), "host:port" (process 0's address and a
  free port, the same for every process), or "auto": `jax.distributed.initialize()` without
  arguments, which reads them from the cluster (Slurm, Open MPI, Kubernetes, Cloud TPU; or
  JAX_COORDINATOR_ADDRESS where the cluster gives the process count and id).
- `dist.num_processes`, `dist.process_id`: with "host:port"; "auto" takes the cluster's.
- `dist.init_timeout_s`: how long processes wait for each other to start;
  `dist.heartbeat_timeout_s`: how soon the others stop after one has died.

Why config keys: MaxText, on TPUs and under Slurm, calls `jax.distributed.initialize()` and
lets JAX detect the cluster (what "auto" does here); on GPUs without a scheduler it reads
environment variables of its own (JAX_COORDINATOR_IP, JAX_COORDINATOR_PORT, NNODES, NODE_RANK)
and passes them on. tunix's GRPO entry point does not call it: it runs one controller for all
hosts on Pathways (a `--pathways_bns` flag, or JAX_PLATFORMS=proxy). Every other setting of a
trace_jax run is a config key, checked before any work and named in its errors, so these are
too (a launcher sets `--config.dist.process_id=$RANK` as it would an environment variable).
They say how a run is launched, not what it computes: a checkpoint written by N processes
resumes in M (`rl.loop` leaves `dist` out of its resume check).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
import traceback

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils


def config() -> ml_collections.ConfigDict:
  """The `dist` section of every entry point's config: one process unless it says otherwise."""
  return ml_collections.ConfigDict(dict(coordinator="", num_processes=1, process_id=0,
                                        init_timeout_s=300, heartbeat_timeout_s=100))


def check(d: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the first bad `dist` key."""
  if d.coordinator not in ("", "auto") and not re.fullmatch(r"[^\s:]+:\d+|\[[0-9a-fA-F:]+\]:\d+",
                                                            d.coordinator):
    raise ValueError(f"dist.coordinator={d.coordinator!r}: give host:port (process 0's address "
                     "and a free port), 'auto' (the cluster's, jax.distributed's detection) or "
                     "'' (one process)")
  if d.coordinator == "auto" and (d.num_processes, d.process_id) != (1, 0):
    raise ValueError(f"dist.coordinator='auto' takes the process count and id from the cluster; "
                     f"leave dist.num_processes ({d.num_processes}) and dist.process_id "
                     f"({d.process_id}) unset, or give dist.coordinator=host:port")
  if d.num_processes < 1:
    raise ValueError(f"dist.num_processes must be >= 1, got {d.num_processes}")
  if not 0 <= d.process_id < d.num_processes:
    raise ValueError(f"dist.process_id={d.process_id} must be in [0, dist.num_processes="
                     f"{d.num_processes})")
  if d.num_processes > 1 and not d.coordinator:
    raise ValueError(f"dist.num_processes={d.num_processes} needs dist.coordinator=host:port "
                     "(process 0's address and a free port)")
  for key in ("init_timeout_s", "heartbeat_timeout_s"):
    if not d[key] > 0:
      raise ValueError(f"dist.{key} must be > 0, got {d[key]!r}")


def initialize(d: ml_collections.ConfigDict) -> None:
  """Joins the processes `d` describes (nothing for one process); call it before anything
  asks JAX for a device. Bad values, or a coordinator that cannot be reached in time, raise
  ValueError in one line."""
  check(d)
  if not d.coordinator:
    return
  # JAX's preemption notifier would take SIGTERM from the run's own handler (the run stops
  # between steps, every process at the same one: rl.loop), and before and after the loop
  # it swallows SIGTERM, so a process could not be stopped at all
  jax.config.update("jax_enable_preemption_service", False)
  if not jax.config.jax_cpu_collectives_implementation:  # CPU programs across processes
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  args = {} if d.coordinator == "auto" else dict(
      coordinator_address=d.coordinator, num_processes=d.num_processes, process_id=d.process_id)
  if args and d.process_id > 0:
    _wait_for(d.coordinator, d.init_timeout_s)
  try:
    jax.distributed.initialize(**args, initialization_timeout=int(d.init_timeout_s),
                               heartbeat_timeout_seconds=int(d.heartbeat_timeout_s))
  except (RuntimeError, ValueError, TypeError) as e:  # XlaRuntimeError is a RuntimeError
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    where = (f"dist.coordinator={d.coordinator!r}, process {d.process_id} of "
             f"{d.num_processes}") if args else "dist.coordinator='auto'"
    raise ValueError(f"jax.distributed.initialize ({where}) failed: {first}") from None


def _wait_for(address: str, timeout_s: float) -> None:
  """Waits until process 0's coordinator takes connections: where none ever does, JAX's
  client would abort the process from C++ after the timeout, with a stack trace."""
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      socket.create_connection((host.strip("[]"), int(port)), timeout=1).close()
      return
    except OSError as e:
      if time.monotonic() > deadline:
        raise ValueError(f"dist.coordinator={address!r}: no coordinator there after "
                         f"{timeout_s:g}s (dist.init_timeout_s; {e.strerror or e}); start "
                         "process 0 (dist.process_id=0) with the same address, or fix it") from None
      time.sleep(0.2)


def is_primary() -> bool:
  """Process 0: the one that writes a run's metrics, TensorBoard events, plots and files."""
  return jax.process_index() == 0


def barrier(name: str) -> None:
  """Waits until every process gets here (nothing for one process)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def primary_first(fn, name: str):
  """fn() on process 0, then on the others: for work that writes shared files once (a
  dataset prepared into a data_dir, which the others then read)."""
  if jax.process_count() == 1:
    return fn()
  out = fn() if is_primary() else None
  barrier(f"{name}: process 0 done")
  return out if is_primary() else fn()


def gather(value: int) -> list[int]:
  """Every process's `value`, in process order (a collective: every process calls it)."""
  if jax.process_count() == 1:
    return [int(value)]
  return [int(v) for v in multihost_utils.process_allgather(np.int64(value))]


def first_signal(signum: int | None) -> int | None:
  """The signal of the first process that got one, on every process (None: none did), so that
  all stop after the same step (a collective)."""
  if jax.process_count() == 1:
    return signum
  got = [v for v in gather(signum or 0) if v]
  return got[0] if got else None


def agree(value: int, what: str) -> int:
  """`value`, checked to be the same on every process: a decision (the step to resume from)
  that each process made from the same files must come out the same, or the processes
  would run different programs and wait on each other forever."""
  values = gather(value)
  if len(set(values)) > 1:
    raise RuntimeError(f"the processes disagree on {what}: " + ", ".join(
        f"process {i}: {v}" for i, v in enumerate(values)) + "; do they see the same files?")
  return values[0]


@contextlib.contextmanager
def exit_at_once_on_failure():
  """Under jax.distributed a process that fails leaves at once, its error printed: JAX's exit
  handler would first wait (shutdown_timeout, minutes) for the other processes, which wait for
  this one in their next collective. They stop when the service misses its heartbeats
  (dist.heartbeat_timeout_s). One process: errors propagate as usual."""
  try:
    yield
  except BaseException as e:  # noqa: BLE001 (re-raised with one process)
    if jax.process_count() == 1:
      raise
    code = e.code if isinstance(e, SystemExit) else 1
    code = code if isinstance(code, int) else (code is not None)
    if code:
      if not isinstance(e, SystemExit):
        traceback.print_exc()
      elif not isinstance(e.code, int) and e.code is not None:
        print(e.code, file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(code)
    raise
