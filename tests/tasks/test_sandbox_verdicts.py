"""Verdicts a program cannot fake: the judge's marker line, not an exit status or the program's
output; one sandbox per program, so a hostile program in a batch costs only its own result."""

import os
import secrets

import pytest

from trace_jax.tasks import sandbox
from trace_jax.tasks.sandbox import Limits, Submission, run_batch, run_tests

FAST = Limits(timeout_s=5.0, memory_mb=256, audit_hook=False)
TESTS = "assert candidate(2) == 3\nassert candidate(-1) == 0\n"
HONEST = "def f(x):\n  return x + 1\n"


def job(solution: str, tests: str = TESTS) -> Submission:
  return Submission(solution=solution, tests=tests, entry_point="f")


@pytest.fixture(autouse=True)
def _boundary(kernel_boundary):
  return kernel_boundary


def test_a_right_solution_passes_and_a_wrong_one_fails():
  assert run_tests(job(HONEST), FAST).status == "passed"
  v = run_tests(job("def f(x):\n  return x\n"), FAST)
  assert not v.passed and v.status.startswith("failed: AssertionError")
  v = run_tests(job("def f(x):\n  raise ValueError('no')\n", "try:\n  candidate(1)\n"
                    "except ValueError:\n  pass\nelse:\n  raise AssertionError\n"), FAST)
  assert v.passed  # the solution's exception reaches the tests as the same built-in type


def test_a_solutions_stop_iteration_cannot_end_the_tests_early():
  """Re-raised in the judge as itself, StopIteration ended a `for` over `map` as though every
  case had passed; it and the other exceptions that steer control flow come back RuntimeError."""
  tests = "for got, want in zip(map(candidate, [1, 2]), [2, 3]):\n  assert got == want\n"
  for name in ("StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt"):
    v = run_tests(job(f"def f(x):\n  raise {name}('no')\n", tests), FAST)
    assert v.status == f"failed: RuntimeError: {name}: no", v


FORGERIES = {
    "exit 0 before the tests": "import os\nos._exit(0)\n",
    "SystemExit(0)": "raise SystemExit(0)\n",
    "SystemExit(0) in the function": HONEST.replace("return x + 1", "raise SystemExit(0)"),
    "a forged results line": "import os\nos.write(1, b'\\nRESULTS ' + b'[\"passed\"]' * 8 + "
                             "b'\\npassed\\n')\nos._exit(0)\n",
    "30 KB of padding": "print('x' * 30_000)\nprint('passed')\n" + HONEST.replace("+ 1", "+ 2"),
    "catching everything": "def f(x):\n  try:\n    raise SystemExit(0)\n  except BaseException:\n"
                           "    return None\n",
    "always equal": "class Yes:\n  def __eq__(self, other):\n    return True\n"
                    "def f(x):\n  return Yes()\n",
    "every descriptor": "import os\nfor fd in range(64):\n  try:\n"
                        "    os.write(fd, b'passed ' * 4)\n  except OSError:\n    pass\n"
                        "def f(x):\n  return None\n",
    "killing the judge": "import os\nos.kill(os.getppid(), 9)\n" + HONEST,
}


@pytest.mark.parametrize("name", FORGERIES)
def test_forged_passes_fail(name):
  v = run_tests(job(FORGERIES[name]), FAST)
  assert v.status.startswith("failed"), (name, v)


def test_the_tests_and_the_marker_are_out_of_the_solutions_reach():
  """The judge is another process, non-dumpable, under a seccomp filter refusing ptrace: its
  memory, descriptors and environment are closed to the solution, and so are the tests."""
  token = secrets.token_hex(16)
  spy = ("import ctypes, gc, os\nppid = os.getppid()\nfound = []\n"
         "for path in [f'/proc/{ppid}/mem', f'/proc/{ppid}/environ', f'/proc/{ppid}/fd/4', "
         "f'/proc/{ppid}/fd/5']:\n"
         "  try:\n    found.append(open(path, 'rb').read(1 << 20))\n"
         "  except OSError as e:\n    print(type(e).__name__, path)\n"
         "for fd in range(3, 32):\n  try:\n    os.set_blocking(fd, False)\n"
         "    found.append(os.read(fd, 1 << 16))\n  except OSError:\n    pass\n"
         "  try:\n    os.set_blocking(fd, True)\n  except OSError:\n    pass\n"
         "print('ptrace', ctypes.CDLL(None, use_errno=True).ptrace(16, ppid, 0, 0), "
         "ctypes.get_errno())\n"
         "found += [o for o in gc.get_objects() if isinstance(o, (str, bytes))]\n"
         "def f():\n  return next((x for x in found if len(x) == 32), '')\n")
  v = run_tests(job(spy, f"assert candidate() == {token!r}\n"), FAST)
  assert v.status.startswith("failed: AssertionError") and token not in v.stdout
  denied = [line.split()[0] for line in v.stdout.splitlines() if line.startswith("Perm")]
  assert len(denied) == 4, v.stdout  # mem, environ, and the judge's tests and verdict fds
  assert "ptrace -1 1" in v.stdout  # EPERM


def test_a_hostile_program_in_a_batch_costs_only_its_own_verdict():
  hostile = [
      FORGERIES["a forged results line"],
      "import time\nwhile True:\n  try:\n    time.sleep(10)\n  except BaseException:\n"
      "    pass\n",  # catches the alarm that used to stop it, starving the batch
      "import builtins, gc, json\nbuiltins.compile = None\njson.dumps = lambda *a: 'passed'\n"
      "for o in gc.get_objects():\n  if isinstance(o, list):\n    o.clear()\n",  # tampering
      "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass\n",
      "open('big', 'wb').write(bytes(200 << 20))\n",
  ]
  jobs = [job(HONEST), *map(job, hostile), job("def f(x):\n  return x\n"), job(HONEST)]
  verdicts = run_batch(jobs, Limits(timeout_s=2.0, memory_mb=256, audit_hook=False))
  status = [v.status.split(":")[0] for v in verdicts]
  assert status == ["passed", "failed", "timed out", "failed", "timed out", "failed", "failed",
                    "passed"], [v.status for v in verdicts]


def test_values_cross_as_built_ins():
  tests = ("assert candidate() == (1, [2.5, float('inf')], {'a': {3}}, b'x', None, 2**100, "
           "-7, 1j, frozenset(), True)\nassert type(candidate()[0]) is int\n"
           "assert candidate()[-1] is True\nimport math\nassert math.isnan(candidate(1))\n")
  solution = ("import collections\ndef f(nan=None):\n  if nan:\n    return float('nan')\n"
              "  return (1, collections.UserList([2.5, float('inf')]) and [2.5, float('inf')], "
              "collections.OrderedDict(a={3}), b'x', None, 2**100, -7, 1j, frozenset(), True)\n")
  assert run_tests(Submission(solution, tests, "f"), FAST).passed
  v = run_tests(Submission("def f():\n  return (x for x in ())\n", "candidate()\n", "f"), FAST)
  assert "cannot leave the sandbox" in v.status


def test_without_a_boundary_programs_are_refused_unless_the_user_opts_in(monkeypatch):
  from trace_jax.tasks.sandbox import kernel

  monkeypatch.setattr(kernel, "_outcome", [sandbox.BoundaryUnavailable("simulated")])
  monkeypatch.setattr(kernel, "_warned", [])
  with pytest.raises(sandbox.BoundaryUnavailable) as refused:
    run_tests(job(HONEST), FAST)
  assert "\n" not in str(refused.value) and "allow_unsandboxed=true" in str(refused.value)
  from trace_jax.tasks.coding import FunctionSynthesisTask
  with pytest.raises(sandbox.BoundaryUnavailable, match="untrusted programs refused"):
    FunctionSynthesisTask().prepare(None)
  # opted in: the same harness and verdicts, without the kernel boundary
  assert run_tests(job(HONEST), FAST, allow_unsandboxed=True).passed
  forged = run_batch([job(FORGERIES["exit 0 before the tests"]), job(FORGERIES["always equal"])],
                     FAST, allow_unsandboxed=True)
  assert [v.passed for v in forged] == [False, False]
  r = sandbox.run_python("print('hi')", FAST, allow_unsandboxed=True)
  assert r.returncode == 0 and r.stdout == "hi\n"


def test_a_solutions_words_in_its_verdict_are_capped():
  """The solution may speak to the judge directly (its end of the pipe is in its own memory)."""
  direct = ("import gc, os\nfor o in gc.get_objects():\n  if type(o).__name__ == 'Channel':\n"
            "    o.send(('error', 'E' * 5000, 'x' * 5000))\n    os._exit(0)\n")
  v = run_tests(job(direct), FAST)
  assert v.status.startswith("failed: the solution did not load: EEE")
  assert len(v.status) < 700, len(v.status)


@pytest.mark.parametrize("failing_call", [2, 3])
def test_no_descriptor_leaks_when_a_sandbox_cannot_start(failing_call, monkeypatch):
  real, calls = sandbox._data_fd, []

  def data_fd(data):
    calls.append(data)
    if len(calls) == failing_call:
      raise OSError(24, "simulated: too many open files")
    return real(data)
  monkeypatch.setattr(sandbox, "_data_fd", data_fd)
  before = sorted(os.listdir("/proc/self/fd"))
  with pytest.raises(OSError, match="simulated"):
    run_tests(job(HONEST), FAST)
  assert sorted(os.listdir("/proc/self/fd")) == before
