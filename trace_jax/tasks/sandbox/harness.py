"""The sandbox's first code: limits itself, then runs a program, or a solution and its tests.

Run as a script inside the sandbox (`python -I -S harness.py MODE JOB_FD [VERDICT_FD JUDGE_FD]`);
the trainer imports only its codec. Standard library only, and only modules that load fast (no
json, re or ast), since one interpreter starts per program; any Python from 3.8 runs it, so
the parent passes the job on JOB_FD in the codec below, not in a version's marshal. Modes:

- `program`: runs the job's code as `__main__`; its exit status and output are the result.
- `tests`: forks before any untrusted code runs. The child ("solution") runs the solution and
  then answers calls to its entry point over a pipe; the parent ("judge") runs the trusted
  tests with `candidate` bound to a proxy for those calls, and writes `<marker> passed` or
  `<marker> failed: ...` on VERDICT_FD. The judge reads the tests and the marker from
  JUDGE_FD only after the fork; the solution closes JUDGE_FD and VERDICT_FD first, and the
  judge is non-dumpable, so the solution cannot read its memory, its descriptors or the
  marker. Values cross the pipe in the small codec below, which only builds built-in values:
  the tests compare real numbers, strings and containers, never an object of the solution's.
"""

from __future__ import annotations

import builtins
import os
import struct
import sys

_LEN = struct.Struct(">I")
_F64 = struct.Struct(">d")


def _encode(value, out: list) -> None:
  t = type(value)
  if value is None or t is bool:
    out.append({None: b"N", True: b"T", False: b"F"}[value])
  elif isinstance(value, int):
    raw = int(value).to_bytes((int(value).bit_length() + 8) // 8, "big", signed=True)
    out += [b"i", _LEN.pack(len(raw)), raw]
  elif isinstance(value, float):
    out += [b"f", _F64.pack(value)]
  elif isinstance(value, complex):
    out += [b"c", _F64.pack(value.real), _F64.pack(value.imag)]
  elif isinstance(value, (str, bytes, bytearray)):
    raw = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
    out += [b"s" if isinstance(value, str) else b"b", _LEN.pack(len(raw)), raw]
  elif isinstance(value, dict):
    out += [b"d", _LEN.pack(len(value))]
    for k, v in value.items():
      _encode(k, out)
      _encode(v, out)
  else:
    tag = next((tag for cls, tag in ((list, b"l"), (tuple, b"t"), (set, b"S"),
                                      (frozenset, b"Z")) if isinstance(value, cls)), None)
    if tag is None:
      raise TypeError(f"a {t.__name__} cannot leave the sandbox (built-in values only)")
    out += [tag, _LEN.pack(len(value))]
    for v in value:
      _encode(v, out)


def encode(value) -> bytes:
  out = []
  _encode(value, out)
  return b"".join(out)


def decode(data: bytes):
  """The inverse of `encode`, for bytes from anyone: built-in values or ValueError."""
  def take(pos, n):
    if pos + n > len(data):
      raise ValueError("truncated value")
    return data[pos:pos + n], pos + n

  def length(pos):
    raw, pos = take(pos, 4)
    return _LEN.unpack(raw)[0], pos

  def one(pos):
    tag, pos = take(pos, 1)
    if tag in (b"N", b"T", b"F"):
      return {b"N": None, b"T": True, b"F": False}[tag], pos
    if tag == b"f":
      raw, pos = take(pos, 8)
      return _F64.unpack(raw)[0], pos
    if tag == b"c":
      raw, pos = take(pos, 16)
      return complex(*struct.unpack(">dd", raw)), pos
    n, pos = length(pos)
    if tag in (b"i", b"s", b"b"):
      raw, pos = take(pos, n)
      if tag == b"i":
        return int.from_bytes(raw, "big", signed=True), pos
      return (raw.decode("utf-8", "surrogatepass") if tag == b"s" else raw), pos
    items = []
    for _ in range(2 * n if tag == b"d" else n):
      item, pos = one(pos)
      items.append(item)
    kinds = {b"l": list, b"t": tuple, b"S": set, b"Z": frozenset}
    if tag == b"d":
      return dict(zip(items[::2], items[1::2])), pos
    if tag not in kinds:
      raise ValueError(f"unknown tag {tag!r}")
    return kinds[tag](items), pos

  value, end = one(0)
  if end != len(data):
    raise ValueError("trailing bytes")
  return value


class Channel:
  """Length-prefixed messages over a pair of pipes, each at most `cap` bytes."""

  def __init__(self, read_fd: int, write_fd: int, cap: int):
    self.read_fd, self.write_fd, self.cap = read_fd, write_fd, cap

  def send(self, value) -> None:
    data = encode(value)
    data = _LEN.pack(len(data)) + data
    while data:
      data = data[os.write(self.write_fd, data):]

  def _exactly(self, n: int) -> bytes:
    chunks = []
    while n:
      chunk = os.read(self.read_fd, min(n, 1 << 20))
      if not chunk:
        raise EOFError("the solution's process ended")
      chunks.append(chunk)
      n -= len(chunk)
    return b"".join(chunks)

  def recv(self):
    n = _LEN.unpack(self._exactly(4))[0]
    if n > self.cap:
      raise ValueError(f"a {n}-byte message from the solution is over the cap")
    return decode(self._exactly(n))


def _limit(limits: dict) -> None:
  import resource

  try:  # should memory run out, the kernel's OOM killer takes a sandbox before the trainer
    with open("/proc/self/oom_score_adj", "w") as fh:
      fh.write("1000")
  except OSError:
    pass

  mb = 1 << 20
  for name, value in (("RLIMIT_AS", limits["memory_mb"] * mb), ("RLIMIT_CPU", limits["cpu_s"]),
                      ("RLIMIT_FSIZE", limits["file_mb"] * mb), ("RLIMIT_NOFILE", 64),
                      ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", limits.get("processes"))):
    if value is not None:
      resource.setrlimit(getattr(resource, name), (value, value))


# A convenience inside the boundary, not part of it (the boundary is the kernel's; CPython says
# audit hooks are no sandbox): obvious attempts fail at once, with a message saying why.
_DENIED = frozenset({
    "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
    "os.forkpty", "os.kill", "os.killpg", "pty.spawn", "os.chroot", "os.setuid", "os.setgid",
    "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "sys.remote_exec"})


def _audit_hook(event, args):
  if event in _DENIED or event.startswith(("socket.", "ctypes.")):
    raise PermissionError(f"sandbox: {event} is not allowed")


def _tests(job: dict, verdict_fd: int, judge_fd: int) -> None:
  import ctypes

  prctl = getattr(ctypes.CDLL(None), "prctl", None)  # Linux; elsewhere there is no boundary
  if prctl and prctl(4, 0, 0, 0, 0):  # PR_SET_DUMPABLE 0, inherited by the fork below
    raise OSError("prctl(PR_SET_DUMPABLE) failed")
  to_solution_r, to_solution_w = os.pipe()
  to_judge_r, to_judge_w = os.pipe()
  pid = os.fork()
  if pid == 0:  # the solution: nothing of the judge's but its own ends of the pipes
    for fd in (judge_fd, verdict_fd, to_solution_w, to_judge_r):
      os.close(fd)
    _serve(job, Channel(to_solution_r, to_judge_w, job["message_bytes"]))
    os._exit(0)
  os.close(to_solution_r)
  os.close(to_judge_w)
  with os.fdopen(judge_fd, "rb") as fh:
    judge = decode(fh.read())
  status = _judge(job, judge, Channel(to_judge_r, to_solution_w, job["message_bytes"]))
  os.write(verdict_fd, f"{judge['marker']} {status}".encode())
  os.close(verdict_fd)
  os.kill(pid, 9)


def _serve(job: dict, channel: Channel) -> None:
  if job["audit_hook"]:
    sys.addaudithook(_audit_hook)
  namespace = {"__name__": "__solution__"}
  try:
    exec(compile(job["code"], "solution.py", "exec"), namespace)
    function = namespace[job["entry_point"]]
  except BaseException as e:  # noqa: B036 - SystemExit too: the solution did not load
    channel.send(("error", type(e).__name__, str(e)[:300]))
    return
  channel.send(("ready",))
  while True:
    try:
      _, args, kwargs = channel.recv()
    except EOFError:
      return
    try:
      reply = ("ok", function(*args, **kwargs))
      encode(reply[1])  # a value that cannot cross becomes the call's error
    except BaseException as e:  # noqa: B036
      reply = ("raise", type(e).__name__, str(e)[:300])
    sys.stdout.flush()
    channel.send(reply)


# Exceptions that steer the tests' own control flow rather than fail them: a StopIteration from
# `candidate` would end a `for` over `map(candidate, ...)` as though every case had run.
_STEERING = (StopIteration, StopAsyncIteration)


class _Candidate:
  """The solution's entry point as the tests see it: arguments go over, built-in values or
  the solution's exception (as the built-in Exception of its name where there is one, but for
  those that steer control flow) come back."""

  def __init__(self, channel: Channel, name: str):
    self.channel, self.__name__ = channel, name

  def __call__(self, *args, **kwargs):
    self.channel.send(("call", args, kwargs))
    reply = self.channel.recv()
    if reply[0] == "ok":
      return reply[1]
    error = getattr(builtins, str(reply[1]), None)
    if not (isinstance(error, type) and issubclass(error, Exception)
            and not issubclass(error, _STEERING)):
      error = RuntimeError
    raise error(f"{reply[1]}: {reply[2]}")


def _judge(job: dict, judge: dict, channel: Channel) -> str:
  try:
    first = channel.recv()
    if first[0] != "ready":
      return f"failed: the solution did not load: {str(first[1])[:100]}: {str(first[2])[:300]}"
    candidate = _Candidate(channel, job["entry_point"])
    namespace = {"__name__": "__tests__"}
    exec(compile(judge["prelude"], "prelude.py", "exec"), namespace)
    namespace["candidate"] = namespace[job["entry_point"]] = candidate
    exec(compile(judge["tests"], "tests.py", "exec"), namespace)
  except BaseException as e:  # noqa: B036 - whatever stopped the tests, they did not pass
    return f"failed: {type(e).__name__}: {str(e)[:300]}"
  return "passed"


def main(argv: list[str]) -> None:
  mode, job_fd = argv[1], int(argv[2])
  with os.fdopen(job_fd, "rb") as fh:
    job = decode(fh.read())
  _limit(job["limits"])
  if mode == "tests":
    _tests(job, int(argv[3]), int(argv[4]))
    return
  if job["audit_hook"]:
    sys.addaudithook(_audit_hook)
  exec(compile(job["code"], "program.py", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
  main(sys.argv)
