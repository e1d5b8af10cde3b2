"""Running untrusted Python programs: a subprocess with time, memory, file and process limits.

Layers, each enough for the common case and together for the hostile one:

- a throwaway working directory, deleted afterwards; the child starts there with an empty
  environment, in isolated mode (`python -I`), in its own session (its whole process group is
  killed at the deadline);
- resource limits: address space (memory hogs get MemoryError), CPU seconds, file size, open
  files, and no core dumps; wall-clock timeout on top;
- when the trainer runs as root: a fresh network namespace where the kernel allows it (no
  interfaces: no network), and the child drops to the `nobody` user (with a Python interpreter
  `nobody` can run), so it cannot signal the parent or write where `nobody` may not;
- inside the child, a Python audit hook (`sys.addaudithook`, which the program cannot remove)
  refuses sockets, new processes (fork, exec, spawn, subprocess, os.system), signals to other
  processes, ctypes, and file writes, renames or deletions outside the working directory.

Programs run by `run_batch` share one child process (each with its own namespace and a
per-program alarm): fast enough for RL rewards, but a program could tamper with the next one's
globals or the results; evaluation sets (HumanEval) use one process per program.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

_NOBODY = 65534


@dataclasses.dataclass(frozen=True)
class Limits:
  timeout_s: float = 10.0  # wall clock for the whole child
  memory_mb: int = 1024  # address space
  file_mb: int = 16  # largest file the child may write (stdout/stderr are files too)
  output_bytes: int = 20_000  # how much of stdout/stderr comes back


@dataclasses.dataclass(frozen=True)
class Result:
  returncode: int | None
  stdout: str
  stderr: str
  timed_out: bool

  @property
  def ok(self) -> bool:
    return self.returncode == 0 and not self.timed_out


# The child's first code: sets its resource limits, leaves the network and drops to `nobody`
# (as root), installs the audit hook, then runs the payload. Doing this in the child itself
# rather than in a preexec_fn keeps Python code out of the window between fork and exec, which
# is unsafe in a multithreaded parent such as a JAX process. Written as files so the program text
# never passes through a shell or the command line.
_GUARD = r'''
import json, os, resource, sys
with open("limits.json") as _fh:
  _LIM = json.load(_fh)
_MB = 1 << 20
resource.setrlimit(resource.RLIMIT_AS, (_LIM["memory_mb"] * _MB,) * 2)
resource.setrlimit(resource.RLIMIT_CPU, (_LIM["cpu_s"],) * 2)
resource.setrlimit(resource.RLIMIT_FSIZE, (_LIM["file_mb"] * _MB,) * 2)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if _LIM["drop"]:
  import ctypes
  ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET; best effort
  os.setgroups([])
  os.setgid(65534)
  os.setuid(65534)
  resource.setrlimit(resource.RLIMIT_NPROC, (32, 32))
_ROOT = os.path.realpath(os.getcwd())
_DENY = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
         "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
         "ctypes.call_function", "os.chroot", "os.setuid", "os.setgid", "signal.pthread_kill",
         "resource.setrlimit", "resource.prlimit", "sys.remote_exec"}
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1,
                "os.rename": 2, "os.link": 2, "os.symlink": 2, "os.truncate": 1,
                "os.utime": 1, "shutil.rmtree": 1, "shutil.move": 2, "shutil.copyfile": 2}

def _inside(path):
  if isinstance(path, int):
    return True
  path = os.fsdecode(path)
  full = os.path.realpath(os.path.join(_ROOT, path))
  return full == _ROOT or full.startswith(_ROOT + os.sep)

def _hook(event, args):
  if event in _DENY:
    raise PermissionError(f"sandbox: {event} is not allowed")
  if event == "open":
    path, mode, flags = args
    writing = (mode and any(c in mode for c in "wax+")) or (
        flags is not None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    if writing and not _inside(path):
      raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
  elif event in _PATH_EVENTS:
    for path in args[:_PATH_EVENTS[event]]:
      if path is not None and not _inside(path):
        raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")

sys.addaudithook(_hook)
del _hook
sys.path.insert(0, _ROOT)
with open("payload.py") as _fh:
  _code = compile(_fh.read(), "payload.py", "exec")
exec(_code, {"__name__": "__main__"})
'''

# The batch payload: one program after another, each with its own globals and alarm.
_BATCH = r'''
import io, json, signal, sys
class _Timeout(BaseException):
  pass
def _alarm(signum, frame):
  raise _Timeout()
signal.signal(signal.SIGALRM, _alarm)
with open("jobs.json") as fh:
  jobs = json.load(fh)
results = []
out = sys.stdout
sys.stdout = io.StringIO()  # programs' prints go nowhere; only the results line is output
for job in jobs:
  signal.setitimer(signal.ITIMER_REAL, job["timeout"])
  try:
    exec(compile(job["code"], "program.py", "exec"), {"__name__": "__program__"})
    results.append("passed")
  except _Timeout:
    results.append("timed out")
  except BaseException as e:
    results.append(f"failed: {type(e).__name__}: {str(e)[:200]}")
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    sys.stdout = io.StringIO()
out.write("\nRESULTS " + json.dumps(results) + "\n")
'''


def _world_executable(path: str) -> bool:
  """Whether any user may run `path`: o+x on the file and on every directory above it."""
  path = os.path.realpath(path)
  parts = path.split(os.sep)
  dirs = [os.sep.join(parts[:i]) or os.sep for i in range(1, len(parts))]
  return all(os.stat(d).st_mode & 0o001 for d in dirs) and bool(os.stat(path).st_mode & 0o001)


@functools.lru_cache(maxsize=None)
def _interpreter() -> tuple[str, bool]:
  """-> (python to run, whether the child can drop to `nobody`). The programs need only the
  standard library, so a system Python of the same version does when ours is not reachable."""
  if os.geteuid() != 0:
    return sys.executable, False
  version = f"python{sys.version_info.major}.{sys.version_info.minor}"
  for candidate in (sys.executable, f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
    if os.path.exists(candidate) and _world_executable(candidate):
      return candidate, True
  return sys.executable, False


def run_python(code: str, limits: Limits = Limits(), files: dict[str, str] | None = None
               ) -> Result:
  """Runs `code` as a program in a fresh sandbox; returns its exit status and output."""
  workdir = tempfile.mkdtemp(prefix="trace_jax_sandbox_")
  python, as_root = _interpreter()
  try:
    limits_json = json.dumps({"memory_mb": limits.memory_mb, "file_mb": limits.file_mb,
                              "cpu_s": int(limits.timeout_s) + 1, "drop": as_root})
    payloads = {"guard.py": _GUARD, "payload.py": code, "limits.json": limits_json,
                **(files or {})}
    for name, text in payloads.items():
      with open(os.path.join(workdir, name), "w") as fh:
        fh.write(text)
    out_path, err_path = os.path.join(workdir, "stdout"), os.path.join(workdir, "stderr")
    if as_root:  # the child runs as nobody: it owns its working directory, nothing else
      for root, _, names in os.walk(workdir):
        os.chown(root, _NOBODY, _NOBODY)
        for name in names:
          os.chown(os.path.join(root, name), _NOBODY, _NOBODY)
      os.chmod(workdir, 0o700)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
      if as_root:
        os.chown(out_path, _NOBODY, _NOBODY)
        os.chown(err_path, _NOBODY, _NOBODY)
      proc = subprocess.Popen(
          [python, "-I", "-S", "guard.py"], cwd=workdir, stdin=subprocess.DEVNULL,
          stdout=out, stderr=err, env={"PATH": "/usr/bin:/bin", "HOME": workdir},
          start_new_session=True, close_fds=True)  # no preexec_fn: the guard limits itself
      timed_out = False
      try:
        proc.wait(timeout=limits.timeout_s)
      except subprocess.TimeoutExpired:
        timed_out = True
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)  # the child and anything it managed to start
        except (ProcessLookupError, PermissionError):
          pass
        proc.wait()

    def read(path):
      with open(path, "rb") as fh:
        return fh.read(limits.output_bytes).decode(errors="replace")

    return Result(proc.returncode, read(out_path), read(err_path), timed_out)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def run_batch(programs: list[str], per_program_timeout_s: float = 2.0,
              limits: Limits | None = None) -> list[str]:
  """Runs each program (code + its own asserts) in one sandboxed child, one after another.

  Returns "passed", "timed out" or "failed: ..." per program; if the child itself dies, every
  program without a result gets "failed: sandbox ...".
  """
  if not programs:
    return []
  limits = limits or Limits(timeout_s=per_program_timeout_s * len(programs) + 5)
  jobs = json.dumps([{"code": p, "timeout": per_program_timeout_s} for p in programs])
  result = run_python(_BATCH, limits, files={"jobs.json": jobs})
  for line in result.stdout.splitlines()[::-1]:
    if line.startswith("RESULTS "):
      try:
        results = json.loads(line[len("RESULTS "):])
      except json.JSONDecodeError:
        break
      if isinstance(results, list) and len(results) == len(programs):
        return [str(r) for r in results]
      break
  why = "timed out" if result.timed_out else f"exited with {result.returncode}"
  return [f"failed: sandbox {why}"] * len(programs)
