"""The sandbox's kernel boundary against hostile programs: this process (the trainer) and the
host come out unharmed. Most programs run with the audit hook off (KERNEL), so what holds them
is the kernel's boundary, not the in-process layer."""

import os
import secrets
import signal
import socket
import time

import pytest

from trace_jax.tasks.sandbox import Limits, run_python

FAST = Limits(timeout_s=5.0, memory_mb=256)
KERNEL = Limits(timeout_s=5.0, memory_mb=256, audit_hook=False)


@pytest.fixture(autouse=True)
def _boundary(kernel_boundary):
  return kernel_boundary


def processes_with(token: str) -> list[int]:
  """Host processes whose command line holds `token` (the tests run where they see them all)."""
  found = []
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/cmdline", "rb") as fh:
        if token.encode() in fh.read():
          found.append(int(pid))
    except OSError:
      pass
  return found


def test_a_normal_program_runs_and_its_output_comes_back():
  r = run_python("import math\nprint(math.factorial(5))", FAST)
  assert r.returncode == 0 and r.stdout.strip() == "120" and not r.timed_out


def test_the_probe_found_the_boundary_whole(kernel_boundary):
  assert kernel_boundary.bwrap
  if os.geteuid() == 0:  # a root trainer's programs are nobody outside their namespaces too
    assert kernel_boundary.setpriv
  r = run_python("import os\nprint(os.getpid(), os.getuid(), sorted(os.environ))", KERNEL)
  assert r.stdout.split(None, 2) == ["2", "65534", "['HOME', 'LANG', 'PATH', 'PWD']\n"]


def test_infinite_loop_is_killed_at_the_deadline():
  start = time.time()
  r = run_python("while True:\n  pass", Limits(timeout_s=1.0))
  assert r.timed_out and r.returncode is None and time.time() - start < 4


def test_setsid_grandchildren_die_at_the_deadline_and_at_exit():
  """A shell in its own session (`_posixsubprocess.fork_exec`, which Popen calls and no audit
  hook sees) outlived the old sandbox's killpg; a pid namespace takes all its processes along."""
  for ends in ("while True:\n  pass", "pass"):  # killed at the deadline / the program exits
    token = f"sleep 300{secrets.randbelow(10**6)}"
    code = (f"import subprocess\nsubprocess.Popen(['/bin/sh', '-c', '{token}'], "
            f"start_new_session=True)\nprint('spawned', flush=True)\n{ends}\n")
    r = run_python(code, Limits(timeout_s=1.5, audit_hook=False))
    assert "spawned" in r.stdout, r.stderr
    time.sleep(0.2)
    assert processes_with(token) == []


def test_fork_bombs_stop_at_the_process_limit():
  start = time.time()
  r = run_python("import os, time\nn = 0\ntry:\n  while True:\n    if not os.fork():\n"
                 "      time.sleep(60)\n    n += 1\nexcept OSError as e:\n"
                 "  print(n, e.errno, flush=True)\nwhile True:\n  try:\n    os.fork()\n"
                 "  except OSError:\n    pass\n", Limits(timeout_s=2.0, audit_hook=False))
  started, errno_ = map(int, r.stdout.split())
  assert r.timed_out and errno_ == 11 and started <= Limits().processes  # EAGAIN
  assert time.time() - start < 6
  r = run_python("import os\nwhile True:\n  os.fork()", FAST)  # the hook refuses it at once
  assert r.returncode != 0 and "os.fork is not allowed" in r.stderr
  r = run_python("import threading, time\n"
                 "ts = [threading.Thread(target=time.sleep, args=(5,), daemon=True)\n"
                 "      for _ in range(50)]\n"
                 "[t.start() for t in ts]", KERNEL)
  assert r.returncode != 0 and "can't start new thread" in r.stderr


def test_memory_hog_gets_memory_error():
  r = run_python("x = bytearray(4 * 1024**3)", KERNEL)
  assert r.returncode != 0 and "MemoryError" in r.stderr


def test_the_host_filesystem_is_out_of_reach(tmp_path):
  target = tmp_path / "owned.txt"
  (tmp_path / "keep.txt").write_text("mine")
  for code in [f"open({str(target)!r}, 'w').write('x')",
               f"import os\nos.remove({str(tmp_path / 'keep.txt')!r})",
               "open('/usr/owned', 'w')",
               "import os\nos.chdir('/usr')\nopen('owned', 'w')",  # relative, after a chdir
               "import os\nfd = os.open('/usr', os.O_RDONLY)\n"  # a dir_fd the hook never saw
               "os.open('owned', os.O_WRONLY | os.O_CREAT, dir_fd=fd)",
               "import os\nos.symlink('/usr/owned', 'link')\nopen('link', 'w')",
               "import os\nos.mknod('/tmp/null', 0o666 | 0o020000, os.makedev(1, 3))"]:
    r = run_python(code, KERNEL)
    assert r.returncode != 0 and "Error" in r.stderr, code
  assert not target.exists() and (tmp_path / "keep.txt").read_text() == "mine"
  assert not os.path.exists("/usr/owned")


def test_its_tmp_is_private_and_thrown_away():
  name = f"sandbox_{secrets.token_hex(6)}"
  r = run_python(f"import os\nos.chdir('/tmp')\nopen({name!r}, 'w').write('x')\n"
                 f"os.mkfifo('/tmp/fifo')\nimport _posixshmem\n"
                 f"os.close(_posixshmem.shm_open('/{name}', os.O_CREAT | os.O_RDWR, 0o600))\n"
                 "print(sorted(os.listdir('/tmp')), os.getcwd())", KERNEL)
  assert r.returncode == 0 and r.stdout.split() == [f"['fifo',", f"'{name}']", "/tmp"], r.stderr
  assert not os.path.exists(f"/tmp/{name}") and not os.path.exists(f"/dev/shm/{name}")


def test_disk_fills_stop_at_the_tmpfs_size():
  """512 MB written in 3 s got through the old sandbox; the tmpfs holds `disk_mb`."""
  r = run_python("n = 0\ntry:\n  for i in range(64):\n    with open(f'f{i}', 'wb') as fh:\n"
                 "      for _ in range(8):\n        fh.write(bytes(1 << 20))\n        n += 1\n"
                 "except OSError as e:\n  print(n, e.errno)\n",
                 Limits(timeout_s=10.0, disk_mb=32, audit_hook=False))
  written, errno_ = map(int, r.stdout.split())
  assert errno_ == 28 and written <= 32  # ENOSPC


def test_sysv_queues_and_semaphores_are_refused(kernel_boundary):
  """Their memory is outside every rlimit (32,000 queues of 16 KB each per ipc namespace)."""
  if not kernel_boundary.seccomp:
    pytest.skip("no seccomp filter here (pyseccomp or libseccomp is missing)")
  r = run_python("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                 "for name, args in (('msgget', (0, 0o1600)), ('semget', (0, 4, 0o1600)),\n"
                 "                   ('shmget', (0, 4096, 0o1600))):\n"  # IPC_PRIVATE, IPC_CREAT
                 "  print(name, getattr(libc, name)(*args), ctypes.get_errno())\n", KERNEL)
  assert r.stdout.splitlines() == ["msgget -1 1", "semget -1 1", "shmget -1 1"], r  # EPERM


def test_file_counts_stop_at_the_tmpfs_inode_cap(kernel_boundary):
  """Empty files fill no blocks, only the kernel's memory (about 1 KB each): 265,000 in 3 s got
  through a size-capped tmpfs. /tmp and /dev/shm share `files`."""
  if not kernel_boundary.unshare:
    pytest.skip("no inode-capped tmpfs here (util-linux's unshare is missing or refused)")
  r = run_python("import os\nn = 0\ntry:\n  while n < 20_000:\n    open(f'f{n}', 'w').close()\n"
                 "    n += 1\nexcept OSError as e:\n  print(n, e.errno)\n"
                 "try:\n  open('/dev/shm/one_more', 'w')\nexcept OSError as e:\n  print(e.errno)\n",
                 KERNEL)
  assert r.stdout.split()[1:] == ["28", "28"], r  # ENOSPC
  assert int(r.stdout.split()[0]) < Limits().files


def test_no_network():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
                 KERNEL)
  server.setblocking(False)  # a connection that got through would be waiting in the backlog
  with pytest.raises(BlockingIOError):
    server.accept()
  server.close()
  # refused by seccomp (no AF_INET), or nobody listening on the sandbox's own loopback
  assert r.returncode != 0 and ("OSError" in r.stderr or "ConnectionRefusedError" in r.stderr)


def test_the_trainer_is_out_of_sight_and_out_of_reach(monkeypatch):
  """Its /proc entries (environment included) and signals: pid, pidfd and process group."""
  secret = secrets.token_hex(8)
  monkeypatch.setenv("TRAINER_SECRET", secret)
  me = os.getpid()
  code = (f"import os, signal\nseen = []\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
          f"  seen.append(open(f'/proc/{{pid}}/environ', 'rb').read())\nprint(seen, os.environ)\n"
          f"for attempt in (lambda: os.kill({me}, signal.SIGKILL),\n"
          f"                lambda: signal.pidfd_send_signal(os.pidfd_open({me}), 9),\n"
          f"                lambda: open('/proc/{me}/environ').read(),\n"
          f"                lambda: os.kill(os.getppid(), signal.SIGKILL)):\n"  # its pid 1
          f"  try:\n    attempt()\n    print('sent')\n  except OSError as e:\n"
          f"    print(type(e).__name__)\n")
  r = run_python(code, KERNEL)
  assert secret not in r.stdout + r.stderr
  assert r.stdout.split()[-4:] == ["ProcessLookupError", "ProcessLookupError",
                                   "FileNotFoundError", "sent"], r.stdout + r.stderr
  for code in ["import os\nos.kill(-1, 9)", "import os\nos.killpg(0, 9)"]:
    run_python(code, KERNEL)  # every process it may signal: its sandbox's
  assert os.getpid() == me  # still here: kill(-1) reached nothing outside the sandbox


def test_the_audit_hook_can_be_disabled_and_the_kernel_still_holds(tmp_path):
  """The hook is a convenience: a program switches it off through `__main__`'s globals or
  the hook's code object, and then meets the kernel."""
  for off in ["import sys\nsys.modules['__main__']._DENIED = frozenset()\n"
              "sys.modules['__main__'].__dict__['_audit_hook'].__code__ = "
              "(lambda e, a: None).__code__\n",
              "import gc\nfor f in gc.get_objects():\n"
              "  if getattr(f, '__name__', '') == '_audit_hook':\n"
              "    f.__code__ = (lambda e, a: None).__code__\n"]:
    # the child leaves at once: with it still running, its shell and the parent's would race
    # for the two processes the limits allow, and the loser's fork fails
    r = run_python(off + "import os\npid = os.fork()\nif pid == 0: os._exit(0)\n"
                   "os.waitpid(pid, 0)\nprint('forked')\n"
                   f"os.system('echo x > {tmp_path}/owned; echo shell ran')\n", FAST)
    assert "forked" in r.stdout and "shell ran" in r.stdout, r.stderr
  assert not (tmp_path / "owned").exists()


def test_output_is_read_through_the_parents_pipes_with_a_cap():
  r = run_python("while True:\n  print('x' * 10000)", Limits(timeout_s=2.0))
  assert r.timed_out and len(r.stdout) == Limits().output_bytes
  # the old sandbox reopened stdout by path: a FIFO there hung it, a symlink read root's files
  for code in ["import os\nos.remove('/tmp/stdout') if os.path.exists('/tmp/stdout') else 0\n"
               "os.mkfifo('/tmp/stdout')\nprint('done')",
               "import os\nos.symlink('/etc/shadow', '/tmp/stdout')\nprint('done')",
               "import os\nos.close(1)\nos.close(2)"]:
    start = time.time()
    r = run_python(code, KERNEL)
    assert r.stdout.strip() in ("done", "") and "root:" not in r.stdout, code
    assert time.time() - start < 4


DRIVER = r"""
import json, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace_jax.tasks import sandbox
out = {"uid": os.getuid()}
try:
  where = sandbox.require()
except sandbox.BoundaryUnavailable as e:
  out["refused"] = str(e)
  where = sandbox.require(allow_unsandboxed=True)
else:
  out["setpriv"], out["seccomp"] = where.setpriv, bool(where.seccomp)
  code = ("import os, signal\nfor pid in filter(str.isdigit, os.listdir('/proc')):\n"
          "  print(open(f'/proc/{pid}/environ').read())\n"
          "for pid in (%d, %d):\n  for hit in (lambda: os.kill(pid, 9), lambda: "
          "signal.pidfd_send_signal(os.pidfd_open(pid), 9)):\n    try:\n      hit()\n"
          "    except ProcessLookupError:\n      print('unreachable')\n") % (os.getpid(), PARENT)
  r = sandbox.run_python(code, sandbox.Limits(audit_hook=False))
  out["program"] = [r.returncode, r.stdout, r.stderr]
allow = "refused" in out
honest = sandbox.Submission("def f(x):\n  return x + 1\n", "assert candidate(1) == 2\n", "f")
forged = sandbox.Submission("import os\nos._exit(0)\n", "assert candidate(1) == 2\n", "f")
out["verdicts"] = [v.status for v in sandbox.run_batch([honest, forged], allow_unsandboxed=allow)]
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="the suite itself runs as an ordinary user here")
def test_an_ordinary_users_trainer_is_out_of_reach_too(tmp_path):
  """The trainer as `nobody` (with a system Python of our version, which nobody can run):
  bwrap in an unprivileged user namespace, or, where the kernel allows none, the refusal."""
  import importlib.util
  import json
  import shutil
  import subprocess
  import sys
  import tempfile

  python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
  if not os.path.exists(python):
    pytest.skip(f"no {python} that nobody may run")
  here = tempfile.mkdtemp()
  try:
    package = os.path.join(here, "trace_jax", "tasks", "sandbox")
    os.makedirs(package)
    for init in ("trace_jax", "trace_jax/tasks"):  # the sandbox alone, standard library only
      open(os.path.join(here, init, "__init__.py"), "w").close()
    source = os.path.dirname(importlib.util.find_spec("trace_jax.tasks.sandbox").origin)
    for name in ("__init__.py", "kernel.py", "harness.py"):
      shutil.copy(os.path.join(source, name), package)
    seccomp = importlib.util.find_spec("pyseccomp")
    if seccomp:
      shutil.copy(seccomp.origin, here)
    with open(os.path.join(here, "driver.py"), "w") as fh:
      fh.write(DRIVER.replace("PARENT", str(os.getpid())))
    for root, dirs, files in os.walk(here):
      for name in dirs + files + [""]:
        os.chmod(os.path.join(root, name), 0o755)
    secret = secrets.token_hex(8)
    done = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-I",
         os.path.join(here, "driver.py")], cwd=here, capture_output=True, text=True,
        env={"PATH": "/usr/bin:/bin", "TRAINER_SECRET": secret}, timeout=120)
  finally:
    shutil.rmtree(here)
  assert done.returncode == 0, done.stderr
  out = json.loads(done.stdout.splitlines()[-1])
  assert out["uid"] == 65534 and out["verdicts"] == ["passed", "failed: EOFError: the "
                                                     "solution's process ended"]
  if "refused" in out:  # no unprivileged user namespaces: the one-line refusal instead
    assert "untrusted programs refused" in out["refused"] and "\n" not in out["refused"]
    return
  assert out["setpriv"] is None and out["seccomp"] == bool(seccomp)
  rc, stdout, stderr = out["program"]
  assert rc == 0 and secret not in stdout and stdout.count("unreachable") == 4, stderr
