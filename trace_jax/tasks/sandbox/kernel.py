"""The kernel boundary around untrusted programs: bubblewrap, seccomp, and a check that it holds.

`boundary()` finds `bwrap` in /usr/bin or /bin (installing Debian's `bubblewrap` with apt-get,
under a deadline, when the trainer runs as root and it is missing), compiles the seccomp filter,
picks the interpreter and the user the sandbox runs as (never host root), and runs a probe
program and two verdicts at once through all of it, dropping a layer (seccomp, the inode cap)
only when the failure names it; the outcome is kept for the process. `require()` is what the
coding tasks call at start-up: the boundary, or one line saying why there is none and how to
run without one on purpose.
"""

from __future__ import annotations

import dataclasses
import errno
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

NOBODY = 65534
HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
HARNESS_INSIDE = "/sandbox/harness.py"  # where the sandbox sees it (a read-only copy)
OPT_IN = "task.coding.allow_unsandboxed=true (evaluate_humaneval: --allow_unsandboxed)"
SYSTEM_PATH = "/usr/bin:/bin"  # where the tools come from: never the trainer's PATH
APT_TIMEOUT_S = {"update": 120, "install": 300}  # installing bubblewrap, where it is missing
_VERSION = sys.version_info[:2]

# Syscalls a Python program has no use for that widen what it can reach: other processes'
# memory and descriptors, namespaces and mounts, kernel surfaces with a history of escapes
# (bpf, io_uring, userfaultfd, perf, keyrings), and kernel memory outside every rlimit (SysV
# shared memory, message queues and semaphores, the `ipc` multiplexer where an architecture
# has one, memfd). They fail with EPERM; sockets other than AF_UNIX fail too.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "open_tree", "move_mount",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "personality", "modify_ldt",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "syslog", "acct", "quotactl", "open_by_handle_at",
    "name_to_handle_at", "lookup_dcookie", "uselib", "vhangup", "iopl", "ioperm",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "fanotify_init",
    "shmget", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop",
    "semctl", "ipc", "memfd_create")


# bwrap's --tmpfs takes a size only, and empty files cost no blocks, just kernel memory (about
# 1 KB each, 55,000 a second on one core). So where util-linux's unshare is present, sh runs this
# as root of a user and mount namespace of its own, in which it mounts the sandbox's writable
# tmpfs over /tmp, capped in bytes and in inodes (hard links count), for bwrap to bind as /tmp
# and /dev/shm; the namespace and the tmpfs go when bwrap does.
TMPFS = ('mount -n -t tmpfs -o "size=$1,nr_inodes=$2,mode=0755,nosuid,nodev" sandbox /tmp && '
         'mkdir -m 0755 /tmp/tmp /tmp/shm && shift 2 && exec "$@"')


class BoundaryUnavailable(RuntimeError):
  """No kernel boundary can be had here; the message is one line saying why."""


@dataclasses.dataclass(frozen=True)
class Boundary:
  bwrap: str | None  # None: no kernel boundary (the user opted in to running without one)
  python: str  # the interpreter that runs inside
  binds: tuple[str, ...]  # host directories it needs, bound read-only (beyond /usr)
  setpriv: str | None  # for a root trainer: setpriv, to start bwrap as nobody; None: as us
  seccomp: bytes | None  # the compiled filter; None where no libseccomp binding is present
  unshare: str | None = None  # util-linux's, for a tmpfs capped in inodes; None: bwrap's tmpfs

  def command(self, harness_fd: int, seccomp_fd: int | None, disk_mb: int, files: int
              ) -> list[str]:
    """bwrap's arguments up to the interpreter's."""
    args = [self.setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "--"] if self.setpriv else []
    if self.unshare:
      args += [self.unshare, "--user", "--map-root-user", "--mount", "--", "/bin/sh", "-c",
               TMPFS, "sh", str(disk_mb << 20), str(files)]
    args += [self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--uid", str(NOBODY),
            "--gid", str(NOBODY), "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
      path = "/" + name
      if os.path.islink(path):
        args += ["--symlink", os.readlink(path), path]
      elif os.path.isdir(path):
        args += ["--ro-bind", path, path]
    for path in self.binds:
      args += ["--ro-bind", path, path]
    if self.unshare:
      shm, tmp = ["--bind", "/tmp/shm", "/dev/shm"], ["--bind", "/tmp/tmp", "/tmp"]
    else:
      shm = ["--size", str(8 << 20), "--tmpfs", "/dev/shm"]
      tmp = ["--size", str(disk_mb << 20), "--tmpfs", "/tmp"]
    args += ["--proc", "/proc", "--dev", "/dev", *shm, "--remount-ro", "/dev", *tmp,
             "--chdir", "/tmp", "--ro-bind-data", str(harness_fd), HARNESS_INSIDE,
             "--remount-ro", "/", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
             "--setenv", "LANG", "C.UTF-8", "--setenv", "HOME", "/tmp"]
    if seccomp_fd is not None:
      args += ["--seccomp", str(seccomp_fd)]
    return args + ["--", self.python, "-I", "-S", HARNESS_INSIDE]


def _tool(name: str) -> str | None:
  return shutil.which(name, path=SYSTEM_PATH)


UNSANDBOXED = Boundary(bwrap=None, python=sys.executable, binds=(), setpriv=None, seccomp=None)


def _apt_get(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
  """apt-get with a deadline: past it, its process group (dpkg included) is stopped."""
  env = dict(os.environ, DEBIAN_FRONTEND="noninteractive", PATH="/usr/sbin:/usr/bin:/sbin:/bin")
  with subprocess.Popen([_tool("apt-get"), *args], stdin=subprocess.DEVNULL, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        start_new_session=True) as proc:
    try:
      out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):  # dpkg may tidy up
        os.killpg(proc.pid, sig)
        try:
          proc.communicate(timeout=wait_s)
          break
        except subprocess.TimeoutExpired:
          continue
      raise BoundaryUnavailable(f"apt-get {args[0]} did not finish in {timeout_s:g} s (another "
                                "apt holding its lock, or no mirror?); install bubblewrap "
                                "yourself") from None
  return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _install_bwrap() -> str:
  """bwrap's path, installing Debian's bubblewrap first where we are root and have apt-get;
  only /usr/bin or /bin's, never one earlier on the trainer's PATH."""
  found = _tool("bwrap")
  if found:
    return found
  if os.geteuid() != 0 or not _tool("apt-get"):
    raise BoundaryUnavailable("bubblewrap (bwrap) is not in /usr/bin or /bin, and installing it "
                              "needs root and apt-get")
  print("sandbox: installing bubblewrap (apt-get install bubblewrap) for the boundary around "
        "untrusted programs", file=sys.stderr)
  install = ["install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120",
             "bubblewrap"]
  if _apt_get(install, APT_TIMEOUT_S["install"]).returncode:
    # a fresh machine's package lists may be stale
    _apt_get(["update", "-q"], APT_TIMEOUT_S["update"])
    done = _apt_get(install, APT_TIMEOUT_S["install"])
    if done.returncode:
      last = (done.stderr.strip().splitlines() or ["no output"])[-1]
      raise BoundaryUnavailable(f"apt-get install bubblewrap failed: {last}")
  found = _tool("bwrap")
  if not found:
    raise BoundaryUnavailable("apt-get installed bubblewrap but there is no bwrap in /usr/bin "
                              "or /bin")
  return found


def _seccomp_filter() -> bytes | None:
  """The BPF program bwrap loads, compiled by libseccomp (through pyseccomp); None without it."""
  try:
    import pyseccomp as sc
  except (ImportError, RuntimeError):  # RuntimeError: the package is there, libseccomp is not
    return None
  import termios

  f = sc.SyscallFilter(sc.ALLOW)
  for name in DENIED_SYSCALLS:
    if sc.resolve_syscall(sc.Arch.NATIVE, name) >= 0:  # not every syscall exists everywhere
      f.add_rule(sc.ERRNO(errno.EPERM), name)
  f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
  f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, termios.TIOCSTI))
  with tempfile.TemporaryFile() as fh:
    f.export_bpf(fh)
    fh.seek(0)
    return fh.read()


def _world_readable(path: str) -> bool:
  """Whether any user reaches `path`: o+x on every directory above it, o+rx on it."""
  path = os.path.realpath(path)
  parents = [os.path.dirname(path)]
  while parents[-1] != os.path.dirname(parents[-1]):
    parents.append(os.path.dirname(parents[-1]))
  return (all(os.stat(d).st_mode & 0o001 for d in parents)
          and os.stat(path).st_mode & 0o005 == 0o005)


def _system_pythons() -> list[str]:
  """The system's interpreters (/usr/bin/python3.N, 3.8 and later, which the harness runs on),
  ours first, then the newest."""
  found = []
  for path in glob.glob("/usr/bin/python3.*"):
    minor = os.path.basename(path)[len("python3."):]
    real = os.path.realpath(path)
    if minor.isdigit() and int(minor) >= 8 and real.startswith("/usr/"):
      found.append(((int(minor) == _VERSION[1]), int(minor), real))
  return list(dict.fromkeys(real for *_, real in sorted(found, reverse=True)))


def _interpreters() -> list[tuple[str, tuple[str, ...]]]:
  """(python, binds) to try: ours (its base, not a virtualenv's: the programs need only the
  standard library, and -S keeps site-packages out), then the system's."""
  version = f"python{_VERSION[0]}.{_VERSION[1]}"
  ours = os.path.join(sys.base_prefix, "bin", version)
  ours = os.path.realpath(ours if os.path.exists(ours) else sys.executable)
  prefix = os.path.realpath(sys.base_prefix)
  found = [(ours, () if prefix.startswith("/usr/") or prefix == "/usr" else (prefix,))]
  return found + [(python, ()) for python in _system_pythons() if python != ours]


def _candidates(bwrap: str, seccomp: bytes | None, unshare: str | None = None):
  """Boundaries to probe, best first. A root trainer's sandbox runs as nobody outside its
  namespaces too (util-linux's setpriv switches before bwrap starts, so the trainer still
  spawns with vfork), with an interpreter nobody can run, or not at all: started by root, the
  sandbox's user would be host root, beyond RLIMIT_NPROC."""
  found = _interpreters()
  if os.geteuid() != 0:
    for python, binds in found:
      yield Boundary(bwrap, python, binds, None, seccomp, unshare)
    return
  setpriv = _tool("setpriv")
  if not setpriv:
    raise BoundaryUnavailable("a root trainer's programs run as nobody through setpriv "
                              "(util-linux), which is not in /usr/bin or /bin")
  runnable = [(p, b) for p, b in found if all(_world_readable(x) for x in (p, *b))]
  if not runnable:
    raise BoundaryUnavailable(f"no Python that nobody may run for the sandbox (not {found[0][0]}, "
                              "nor a /usr/bin/python3.N): install python3")
  for python, binds in runnable:
    yield Boundary(bwrap, python, binds, setpriv, seccomp, unshare)


PROBE = r"""
import os
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
assert pids == [1, 2], f"processes outside the sandbox are visible: {pids}"
devices = [line.split(":")[0].strip() for line in open("/proc/net/dev") if ":" in line]
assert devices == ["lo"], f"network devices {devices}"
for path in ("/probe", "/usr/probe", "/dev/probe"):
  try:
    open(path, "w")
  except OSError:
    continue
  raise AssertionError(f"{path} is writable")
open("/tmp/probe", "w").write("ok")
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
print(os.getuid(), status["NoNewPrivs"].strip(), status["Seccomp"].strip(), status["CapEff"])
"""

_lock = threading.Lock()
_outcome: list = []  # [Boundary] or [BoundaryUnavailable], once probed


def boundary() -> Boundary:
  """The boundary this machine gives, probed once per process; raises BoundaryUnavailable."""
  with _lock:
    if not _outcome:
      try:
        _outcome.append(_probe())
      except BoundaryUnavailable as e:
        _outcome.append(e)
    if isinstance(_outcome[0], BoundaryUnavailable):
      raise _outcome[0]
    return _outcome[0]


# What a failed probe's own words blame, line by line: bwrap loading the filter, or the tools
# of the inode-capped tmpfs. Only these drop a layer; any other failure is retried as it was.
_LAYERS = {"seccomp": lambda line: line.startswith("bwrap:") and "seccomp" in line.lower(),
           "unshare": lambda line: line.startswith(("unshare:", "mount:", "mkdir:", "sh:"))}
_DROPPED = {"seccomp": "bwrap could not load the seccomp filter ({}); namespaces and rlimits "
                       "without it",
            "unshare": "no inode-capped tmpfs ({}); the sandbox's /tmp is capped in bytes only"}


def _check(where: Boundary) -> str | None:
  """Runs the probe program, then two verdicts at once through run_batch's path (the judge's
  fork, prctl and pipes); -> None, or what failed: its output, last line last."""
  from trace_jax.tasks.sandbox import Limits, Submission, batch_with, run_with

  limits = Limits(timeout_s=20.0, audit_hook=False)
  result = run_with(where, PROBE, limits)
  want = [str(NOBODY), "1", "2" if where.seccomp else "0", "0" * 16]
  if result.returncode != 0 or result.stdout.split() != want:
    return f"{result.stdout}\n{result.stderr}".strip() or f"exit {result.returncode}"
  honest = [Submission(f"def f(x):\n  return x + {i}\n", f"assert candidate(1) == {1 + i}\n",
                       "f") for i in (1, 2)]
  for verdict in batch_with(where, honest, limits, workers=len(honest)):
    if not verdict.passed:
      return f"{verdict.stderr}\n{verdict.status}".strip()
  return None


def _probe() -> Boundary:
  if not sys.platform.startswith("linux"):
    raise BoundaryUnavailable(f"the boundary needs Linux namespaces; this is {sys.platform}")
  bwrap, seccomp = _install_bwrap(), _seccomp_filter()
  unshare = _tool("unshare") if _tool("mount") else None
  if seccomp is None:
    print("sandbox: no seccomp filter (pyseccomp or libseccomp is missing); namespaces and "
          "rlimits only", file=sys.stderr)
  if unshare is None:
    print("sandbox: no unshare or mount (util-linux) in /usr/bin or /bin; the sandbox's /tmp "
          "is capped in bytes only, not in files", file=sys.stderr)
  failure = None
  for where in _candidates(bwrap, seccomp, unshare):
    dropped, tries = [], 0
    while tries < 2:  # a failure no layer is named in may be passing: once more, as it was
      failure = _check(where)
      if failure is None:
        for layer, line in dropped:
          print(f"sandbox: {_DROPPED[layer].format(line)}", file=sys.stderr)
        return where
      lines = failure.splitlines()
      layer = next((name for name, names in _LAYERS.items()
                    if getattr(where, name) and any(map(names, lines))), None)
      if layer:
        dropped.append((layer, next(filter(_LAYERS[layer], lines))))
        where = dataclasses.replace(where, **{layer: None})
      else:
        tries += 1
  last = failure.splitlines()[-1] if failure else "no candidate"
  raise BoundaryUnavailable(f"bwrap cannot set up the sandbox here ({last!r}); unprivileged "
                            "user namespaces may be disabled")


_warned: list = []


def require(allow_unsandboxed: bool = False) -> Boundary:
  """The boundary, or UNSANDBOXED where there is none and the user allowed it."""
  try:
    return boundary()
  except BoundaryUnavailable as e:
    if not allow_unsandboxed:
      raise BoundaryUnavailable(f"untrusted programs refused: no sandbox boundary: {e}; install "
                                f"bubblewrap, or run them without one with {OPT_IN}") from None
    if not _warned:
      _warned.append(True)
      print(f"sandbox: no boundary ({e}); running untrusted programs with process limits only, "
            "as allowed", file=sys.stderr)
    return UNSANDBOXED
