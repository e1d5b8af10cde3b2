"""Running untrusted programs: one fresh kernel sandbox per program, and verdicts the parent owns.

What holds a hostile program is the kernel, set up by bubblewrap (`kernel.py`): new user, pid,
mount, network, ipc and uts namespaces; a root of its own, read-only but for one private tmpfs
at /tmp (its working directory) and /dev/shm; /usr and the interpreter bound read-only, nothing
else of the host's files; a /proc of its own pid namespace (the trainer's processes are not
there to read or to signal); no capabilities, no new privileges, no nested user namespaces; a
seccomp filter (where libseccomp is present) refusing ptrace and other processes' memory,
mounts, keyrings, bpf, io_uring, SysV IPC (shared memory, message queues, semaphores), memfd
and non-Unix sockets; an environment of PATH, LANG, HOME and PWD only. A root trainer's sandbox
runs as `nobody` outside its namespaces too, or not at all: never as host root.

Bounded, per sandbox: the wall clock (`timeout_s`: bwrap is killed, and its pid namespace,
setsid'd grandchildren included, with it); each process's address space (`memory_mb`), CPU
time, largest file (`file_mb`), open files (64); processes and threads together (`processes`,
counted for the sandbox's own user); the tmpfs in bytes (`disk_mb`) and, where util-linux's
`unshare` mounts it, in files (`files`; else bwrap's tmpfs, in bytes only, said at start-up);
what comes back (`output_bytes` of stdout and of stderr). So one sandbox holds at most
(processes + 2) x memory_mb of process memory, disk_mb of files and ~1 KB of kernel memory per
file (defaults: about 2.1 GB), and at most `run_batch`'s workers (twice the cores) run at once;
there is no cgroup to cap a sandbox tighter than that. Not bounded: kernel memory in caches the
kernel reclaims itself, what the kernel lets through (an exploit escapes any namespace), and
where a layer is missing, what it held (without seccomp, SysV IPC's kernel memory; without
`unshare`, the number of files).

Verdicts (`run_tests`): a solution and its tests never share a process (a harness in the
program's interpreter can always be read or hijacked by it: frames, gc, trace functions, threads
that outlive it). Inside the sandbox the harness forks before any untrusted code runs; the
solution's process runs the program and answers calls to its entry point over a pipe; the
judge's process, which no untrusted code runs in and which the solution cannot read
(non-dumpable, ptrace refused), runs the trusted tests with `candidate` calling across that
pipe (built-in values only come back, so an object whose `__eq__` always says yes cannot cross;
exceptions that steer control flow, such as StopIteration, come back as RuntimeError). Only
the judge holds the verdict pipe, and only after the fork does it read the tests and a random
per-run marker; it writes `<marker> passed` when the tests ran to completion. The parent reads
the verdict, stdout and stderr through the pipes it holds, each with a size cap, and calls a
program passed only on that marker line: not on an exit status, not on anything the program
prints, so `os._exit(0)`, `SystemExit(0)`, a forged result line, output floods and catching
every exception all come out failed.

Where no boundary can be had (not Linux, no user namespaces, no bwrap and no way to install
it), the coding tasks refuse to run programs unless the user opts in (`require`). Opted in,
they run with the same harness and the per-process rlimits, in a fresh directory and session,
as the trainer's user, and nothing else holds: no process cap, no disk cap, the user's files,
network and processes (the trainer's included) in reach, and verdicts can be forged (a
program running as root, or reaching the trainer, writes the marker itself). Only for
programs one trusts.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import time

from trace_jax.tasks.sandbox.harness import encode
from trace_jax.tasks.sandbox.kernel import (HARNESS, SYSTEM_PATH, UNSANDBOXED, Boundary,
                                              BoundaryUnavailable, boundary, require)

__all__ = ["Boundary", "BoundaryUnavailable", "Limits", "Result", "Submission", "UNSANDBOXED",
           "Verdict", "boundary", "require", "run_batch", "run_python", "run_tests"]

with open(HARNESS, "rb") as _fh:
  _HARNESS_SOURCE = _fh.read()


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 10.0  # wall clock for the whole sandbox
  memory_mb: int = 512  # address space of each process
  file_mb: int = 16  # the largest file it may write
  disk_mb: int = 64  # its tmpfs, all files together
  files: int = 4096  # files, directories and links its tmpfs holds (each costs the kernel ~1 KB)
  processes: int = 2  # processes and threads it may start beyond its own (each gets memory_mb)
  output_bytes: int = 20_000  # how much of stdout and of stderr comes back
  audit_hook: bool = True  # the in-process layer (a convenience: obvious attempts fail early)


@dataclasses.dataclass(frozen=True)
class Result:
  """A program's exit status and output: what it did, never whether it passed anything."""
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool


@dataclasses.dataclass(frozen=True)
class Submission:
  """A solution (untrusted) and its tests (trusted), run in two processes of one sandbox."""
  solution: str  # the program: runs first, in its own process
  tests: str  # run by the judge with `candidate` (and `entry_point`) calling the solution's
  entry_point: str  # the solution's function the tests call
  prelude: str = ""  # trusted code the judge runs before the tests (HumanEval's helpers)


@dataclasses.dataclass(frozen=True)
class Verdict:
  status: str  # "passed", "timed out" or "failed: why"
  stdout: str
  stderr: str

  @property
  def passed(self) -> bool:
    return self.status == "passed"


def _data_fd(data: bytes) -> int:
  """A descriptor the child reads `data` from, whatever its size, without us writing later."""
  if hasattr(os, "memfd_create"):
    fd = os.memfd_create("sandbox", os.MFD_CLOEXEC)
  else:
    fd, path = tempfile.mkstemp(prefix="trace_jax_sandbox_")
    os.unlink(path)
  try:
    while data:
      data = data[os.write(fd, data):]
    os.lseek(fd, 0, os.SEEK_SET)
  except BaseException:
    os.close(fd)
    raise
  return fd


def _start(where: Boundary, mode: str, job: dict, limits: Limits, judge: dict | None
           ) -> tuple[subprocess.Popen, int | None, str | None]:
  """Starts the harness; -> (its process, the verdict pipe's read end, its directory where
  there is no boundary). What fails on the way leaves no descriptor or directory behind."""
  child_fds, verdict_r, workdir = [], None, None
  try:
    child_fds.append(_data_fd(encode(job)))
    tail = [mode, str(child_fds[0])]
    if judge is not None:
      verdict_r, verdict_w = os.pipe()
      child_fds.append(verdict_w)
      child_fds.append(_data_fd(encode(judge)))
      tail += [str(verdict_w), str(child_fds[-1])]
    if where.bwrap:
      child_fds.append(_data_fd(_HARNESS_SOURCE))
      harness_fd, seccomp_fd = child_fds[-1], None
      if where.seccomp:
        child_fds.append(_data_fd(where.seccomp))
        seccomp_fd = child_fds[-1]
      argv = where.command(harness_fd, seccomp_fd, limits.disk_mb, limits.files) + tail
      env, cwd = {"PATH": SYSTEM_PATH}, "/"
    else:
      workdir = tempfile.mkdtemp(prefix="trace_jax_sandbox_")
      argv = [where.python, "-I", "-S", HARNESS] + tail
      env, cwd = {"PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "HOME": workdir}, workdir
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, pass_fds=child_fds, cwd=cwd, env=env,
                            start_new_session=True)
  except BaseException:
    if verdict_r is not None:
      os.close(verdict_r)
    if workdir:
      shutil.rmtree(workdir, ignore_errors=True)
    raise
  finally:
    for fd in child_fds:
      os.close(fd)
  return proc, verdict_r, workdir


def _spawn(where: Boundary, mode: str, job: dict, limits: Limits, judge: dict | None = None
           ) -> tuple[int | None, bytes, bytes, bytes, bool]:
  """Runs the harness once; -> (returncode, stdout, stderr, verdict bytes, timed out)."""
  lim = {"memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
         "cpu_s": math.ceil(limits.timeout_s) + 1}
  if where.bwrap:  # RLIMIT_NPROC counts per user, and only the sandbox's user is its own
    lim["processes"] = limits.processes + (3 if mode == "tests" else 2)  # bwrap's init, ours
  job = dict(job, limits=lim, audit_hook=limits.audit_hook, message_bytes=64 << 20)
  proc, verdict_r, workdir = _start(where, mode, job, limits, judge)
  out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
  streams = {out_fd: bytearray(), err_fd: bytearray()}
  caps = dict.fromkeys(streams, limits.output_bytes)
  if verdict_r is not None:
    streams[verdict_r], caps[verdict_r] = bytearray(), 4096
  try:
    timed_out = _read(streams, caps, limits.timeout_s)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)  # bwrap (its namespace dies with it), or the session
    except (ProcessLookupError, PermissionError):
      pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    if verdict_r is not None:
      os.close(verdict_r)
    if workdir:
      shutil.rmtree(workdir, ignore_errors=True)
  return (proc.returncode, bytes(streams[out_fd]), bytes(streams[err_fd]),
          bytes(streams[verdict_r]) if verdict_r is not None else b"", timed_out)


def _read(streams: dict[int, bytearray], caps: dict[int, int], timeout_s: float) -> bool:
  """Reads every pipe to its end or to the deadline, keeping each one's first `cap` bytes
  (the rest is drained and dropped, so a writer never blocks on a full pipe); -> timed out."""
  deadline = time.monotonic() + timeout_s
  with selectors.DefaultSelector() as sel:
    for fd in streams:
      sel.register(fd, selectors.EVENT_READ)
    while sel.get_map():
      left = deadline - time.monotonic()
      if left <= 0:
        return True
      for key, _ in sel.select(left):
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fd)
        room = caps[key.fd] - len(streams[key.fd])
        if room > 0:
          streams[key.fd] += chunk[:room]
  return False


def _text(data: bytes) -> str:
  return data.decode(errors="replace")


def run_with(where: Boundary, code: str, limits: Limits = Limits()) -> Result:
  """Runs `code` as a program under a given boundary (the probe's way in; see run_python)."""
  rc, out, err, _, timed_out = _spawn(where, "program", {"code": code}, limits)
  return Result(None if timed_out else rc, _text(out), _text(err), timed_out)


def run_python(code: str, limits: Limits = Limits(), allow_unsandboxed: bool = False) -> Result:
  """Runs `code` as `__main__` in a fresh sandbox; -> its exit status and output."""
  return run_with(require(allow_unsandboxed), code, limits)


def _verdict(where: Boundary, job: Submission, limits: Limits) -> Verdict:
  marker = secrets.token_hex(16)
  rc, out, err, verdict, timed_out = _spawn(
      where, "tests", {"code": job.solution, "entry_point": job.entry_point}, limits,
      judge={"tests": job.tests, "prelude": job.prelude, "marker": marker})
  head, _, status = _text(verdict).partition(" ")
  if head != marker:
    last = (_text(err).strip().splitlines() or [""])[-1][:300]
    status = "timed out" if timed_out else f"failed: no verdict (exit {rc}) {last}".rstrip()
  return Verdict(status, _text(out), _text(err))


def run_tests(job: Submission, limits: Limits = Limits(), allow_unsandboxed: bool = False
              ) -> Verdict:
  """Runs one solution against its tests in a fresh sandbox."""
  return _verdict(require(allow_unsandboxed), job, limits)


def run_batch(jobs: list[Submission], limits: Limits = Limits(), allow_unsandboxed: bool = False,
              workers: int | None = None) -> list[Verdict]:
  """`run_tests` for each job, each in its own sandbox, `workers` at a time (default: twice the
  cores, as a sandbox spends part of its start waiting on the kernel). Identical jobs run once."""
  return batch_with(require(allow_unsandboxed), jobs, limits, workers)


def batch_with(where: Boundary, jobs: list[Submission], limits: Limits = Limits(),
               workers: int | None = None) -> list[Verdict]:
  """`run_batch` under a given boundary (the probe's way in)."""
  unique = list(dict.fromkeys(jobs))
  workers = workers or 2 * (os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(min(workers, max(len(unique), 1))) as pool:
    verdicts = dict(zip(unique, pool.map(lambda j: _verdict(where, j, limits), unique)))
  return [verdicts[j] for j in jobs]
