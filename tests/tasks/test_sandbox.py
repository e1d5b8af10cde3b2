"""The sandbox against hostile programs: the trainer (this process) must come out unharmed."""

import os
import socket
import threading
import time

import pytest

from trace_jax.tasks.sandbox import Limits, run_batch, run_python

FAST = Limits(timeout_s=3.0, memory_mb=256)


def test_a_normal_program_runs_and_its_output_comes_back():
  r = run_python("import math\nprint(math.factorial(5))", FAST)
  assert r.ok and r.stdout.strip() == "120"


def test_infinite_loop_is_killed_at_the_deadline():
  start = time.time()
  r = run_python("while True:\n  pass", Limits(timeout_s=1.0))
  assert r.timed_out and not r.ok and time.time() - start < 5


def test_fork_bomb_and_subprocesses_are_refused():
  r = run_python("import os\nwhile True:\n  os.fork()", FAST)
  assert not r.ok and "os.fork is not allowed" in r.stderr
  r = run_python("import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])", FAST)
  assert not r.ok and "not allowed" in r.stderr
  r = run_python("import os\nos.system('echo hi')", FAST)
  assert not r.ok and "os.system is not allowed" in r.stderr


def test_memory_hog_gets_memory_error():
  r = run_python("x = bytearray(4 * 1024**3)", FAST)
  assert not r.ok and "MemoryError" in r.stderr


def test_writes_outside_the_working_directory_are_refused(tmp_path):
  target = tmp_path / "owned.txt"
  for code in [f"open({str(target)!r}, 'w').write('x')",
               f"import os\nos.rename('a', {str(target)!r})",
               "import shutil\nshutil.rmtree('/tmp')",
               "import os\nos.remove('/etc/hostname')"]:
    r = run_python(code, FAST)
    assert not r.ok and "outside the working directory" in r.stderr, code
  assert not target.exists() and os.path.exists("/etc/hostname")
  r = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", FAST)
  assert r.ok and r.stdout.strip() == "ok"


def test_the_working_directory_is_thrown_away():
  r = run_python("import os\nprint(os.getcwd())", FAST)
  assert r.ok and not os.path.exists(r.stdout.strip())


def test_no_network():
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen(1)
  port = server.getsockname()[1]
  accepted = []
  thread = threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True)
  thread.start()
  r = run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
                 FAST)
  thread.join(timeout=1)
  server.close()
  assert not r.ok and not accepted and "not allowed" in r.stderr


def test_attempts_to_kill_the_parent_fail():
  for code in ["import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
               "import os, signal\nos.killpg(0, signal.SIGKILL)",
               "import ctypes\nctypes.CDLL(None).kill(0, 9)"]:
    r = run_python(code, FAST)
    assert not r.ok and "not allowed" in r.stderr, code
  assert os.getpid() > 0  # still here


def test_output_flood_is_cut():
  r = run_python("while True:\n  print('x' * 10000)", Limits(timeout_s=5.0, file_mb=1))
  assert not r.ok and len(r.stdout) <= Limits().output_bytes


def test_batch_mode_isolates_failures():
  results = run_batch(["assert 1 + 1 == 2", "while True:\n  pass", "assert 1 == 2",
                       "x = bytearray(8 * 1024**3)", "import os\nos.fork()",
                       "print('x' * 10**6)\nassert True", "raise SystemExit(0)"], 0.5)
  assert results[0] == "passed" and results[1] == "timed out"
  assert results[2].startswith("failed: AssertionError")
  assert results[3].startswith("failed: MemoryError")
  assert "os.fork is not allowed" in results[4]
  assert results[5] == "passed"
  assert results[6].startswith("failed: SystemExit")
  assert run_batch([]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop and network namespace need root")
def test_as_root_the_child_runs_as_nobody():
  r = run_python("import os\nprint(os.getuid())", FAST)
  assert r.ok and r.stdout.strip() == "65534"
