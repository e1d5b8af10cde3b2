"""The ablation of DESIGN section 8, on the small CPU setting or one H200's, for all three families.

    python experiments/ablation.py [--out=experiments/results] [--seeds=0] \
        [--families=reasoning,coding,long_horizon] [--modes=bf16,fp4_rollout,fp4_qat,trace,trace_all]
    python experiments/ablation.py --figures_only   # redraw figures and table, no training
    python experiments/ablation.py --scale=gpu --families=reasoning,long_horizon   # one H200
    python experiments/ablation.py --merge=DIR[,DIR]   # add the runs other machines recorded

For every family, mode and seed: one RL run, `configs/ablation.py:family=F,mode=M,seed=S` in
<out>/F/M/seedS (the same as `python -m trace_jax.main` with that config and workdir).
`--warm_start=shared` (the default at --scale=gpu) trains each family and seed's supervised
warm start once, first (`...:family=F,mode=bf16,seed=S,rl.steps=0` in <out>/F/warm_start/seedS),
and every mode's run of that seed starts RL from it (`sft.init_from`): from one policy, where a
GPU's sums need not repeat from run to run; `own`: every run makes its own (the CPU default,
how the CPU results were made: there the modes' warm starts agree to float32 rounding).
Rerunning the command resumes unfinished runs and skips finished ones; results accumulate in
<out>: a run recorded in <out>/summary.json whose directory is gone (a fresh clone holds the
two files alone) is kept, not rerun, and families and seeds this invocation does not name stay
as they were, so more seeds can be added later, on another machine. A seed's shared warm
start made again (its directory gone, as on a fresh GPU machine) must repeat the one that seed's
recorded runs started from (each run's `warm_start_id`, a fingerprint of the warm start's
losses): another, e.g. made on another device kind, stops the invocation before any mode trains,
naming those runs; and where the seed's recorded runs were made on another device kind than
this one, the invocation stops before making it at all (`--any_device` makes it anyway).
Then, per family:

- post-hoc FP4: each seed's BF16-trained policy quantized to MXFP4 after training and evaluated
  by the FP4 rollout engine, against the FP4 policies the FP4 modes trained;
- record bytes against the KL they buy: the trained trace_all policy probed on its task's eval
  prompts with records of none / last:1 / last:2 / all layers, routing replay off and on.

Compiled programs are kept in JAX's persistent cache (<out>/compile_cache, `--compile_cache`),
so the runs after the first of a family and mode load theirs instead of compiling them.
`--jobs=N` trains N runs at once, each in a process of its own (`python -m trace_jax.main`,
its output in <run dir>/train.log): on one GPU the processes share it, each with 1/N of its
memory, and one compiles or steps on the host while another runs on the device; each run's
results are recorded as it finishes (summary.json and curves.json: what a machine that is
given back after a time limit leaves behind), post-hoc FP4 and the probe once the runs are.
A SIGTERM or Ctrl-C stops the running ones after their step in flight, with a checkpoint,
records the runs that had finished and exits; rerunning the command resumes the others.

Writes <out>/summary.json (the table's numbers, each run's config and command, the commit and
package versions), <out>/curves.json (experiments/curves.py: the per-run curves, small enough
to commit) and the figures (experiments/figures/*.png), drawn from those two files alone;
RESULTS.md quotes them.

`--merge=DIR` adds the runs recorded in another results directory (its summary.json and
curves.json, e.g. brought back from a GPU machine that started from an older copy of <out>) to
<out>'s, then redraws: a run <out> does not hold is added, one both hold alike is left, and one
they hold with different numbers stops the merge, naming it (remove one of them to choose).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time

import jax
import ml_collections

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs.ablation import SCALES  # noqa: E402
from experiments import curves, figures, seeds as seed_stats  # noqa: E402
from trace_jax import cli, determinism, mismatch  # noqa: E402
from trace_jax.models import QuantRecipe, pack_weights  # noqa: E402
from trace_jax.rl.checkpoint import Checkpointer  # noqa: E402
from trace_jax.rl.episodes import greedy_accuracy  # noqa: E402
from trace_jax.rl.loop import load_run, summarize, train  # noqa: E402
from trace_jax.rl.preemption import Interrupted, StopBetweenSteps  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine  # noqa: E402
from trace_jax.rl.trainer import MODES  # noqa: E402
from trace_jax.rl.validate import FAMILIES, check_sandbox, check_workdir, validate  # noqa: E402
from trace_jax.rl.writer import read_metrics  # noqa: E402
from trace_jax.tasks.sandbox import BoundaryUnavailable  # noqa: E402

PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "numpy", "ml_dtypes", "optax",
            "orbax-checkpoint", "flax", "ml-collections", "reasoning-gym", "tensorflow-datasets",
            "grain", "matplotlib")


# where each scale's runs take their warm start (--warm_start): shared, one warm start per family
# and seed that every mode's run starts RL from (sft.init_from), so that the modes of a seed
# start RL from one policy even where the device's sums are not repeatable; own, every run its
# own (the CPU results were made so: there the modes' warm starts agree to float32 rounding)
WARM_START = {"cpu": "own", "gpu": "shared"}
WARM = "warm_start"  # the run directory of a family's shared warm starts: <out>/<family>/WARM
FAILED_LOG_LINES = 30  # of a run that fails, the ablation prints its log's last lines


def config_arg(family: str, mode: str, seed: int, smoke: bool = False, scale: str = "cpu",
               init_from: str = "") -> str:
  """configs/ablation.py's argument for a run; `init_from`: its warm start's run directory."""
  return (f"family={family},mode={mode},seed={seed}" + ("" if scale == "cpu" else f",scale={scale}")
          + (",smoke" if smoke else "") + (f",sft.init_from={init_from}" if init_from else ""))


def warm_arg(family: str, seed: int, smoke: bool = False, scale: str = "cpu") -> str:
  """configs/ablation.py's argument for a family's shared warm start: the warm start alone."""
  return config_arg(family, "bf16", seed, smoke, scale) + ",rl.steps=0"


def warm_dir(out: str, family: str, seed: int) -> str:
  return os.path.join(out, family, WARM, f"seed{seed}")


def run_config(family: str, mode: str, seed: int, smoke: bool = False, scale: str = "cpu",
               init_from: str = "") -> ml_collections.ConfigDict:
  """The run's config: configs/ablation.py, the one source of the ablation's settings."""
  return _config(config_arg(family, mode, seed, smoke, scale, init_from))


MADE_BY = ("git_commit", "device")  # provenance's keys each recorded run keeps as its own


def provenance() -> dict:
  """What produced the results: the commit (and whether the tree differed from it outside the
  results), the package versions, the machine and the time."""
  def git(*args):
    try:
      return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
      return None
  changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                ":!experiments/results", ":!experiments/figures")
  versions = {}
  for name in PACKAGES:
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {"git_commit": git("rev-parse", "HEAD"),
          "git_dirty": None if changed is None else bool(changed),
          "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "python": platform.python_version(), "packages": versions,
          "backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
          "cpu_count": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", "")}


def previous_results(out: str) -> tuple[dict, dict]:
  """(summary, curves' runs) that `out` holds from earlier invocations, or empty ones."""
  held = [n for n in (curves.SUMMARY, curves.CURVES) if os.path.exists(os.path.join(out, n))]
  if not held:
    return {}, {}
  if len(held) == 1:
    raise curves.ResultsError(f"{out} holds {held[0]} without the other of {curves.SUMMARY} "
                              f"and {curves.CURVES}")
  data = curves.load(out)
  for family in data.families:  # each run keeps the commit and the device that produced it
    for run in data.summary[family]["runs"].values():
      for key in MADE_BY:
        run.setdefault(key, data.summary["provenance"].get(key))
  return data.summary, data.curves["runs"]


def finished(workdir: str, c) -> bool:
  if not os.path.isdir(os.path.join(workdir, "checkpoints")):
    return False
  ckpt = Checkpointer(workdir)
  try:
    return ckpt.latest_step() == c.sft.steps + c.rl.steps
  finally:
    ckpt.close()


def fp4_eval(workdir: str, fp4: str = "mxfp4") -> float:
  """Greedy accuracy of a run's final policy with an FP4 rollout engine (post-hoc for bf16)."""
  run, state, _ = load_run(workdir)
  recipe = QuantRecipe.uniform(fp4)
  engine = RolloutEngine(run.cfg, recipe, run.eval_engine.sampling)
  weights = pack_weights(run.cfg, state["params"], recipe)
  return greedy_accuracy(engine, weights, run.task, run.eval_records, run.tok,
                         run.c.max_prompt_len, run.c.eval.batch_size)["eval/accuracy"]


def probe(workdir: str) -> list[dict]:
  """Record bytes vs KL on the trained policy's own eval prompts (single-turn generation from
  the prompt: for the long-horizon family the policy also writes the observations)."""
  run, state, _ = load_run(workdir)
  pc = importlib.import_module("configs.mismatch").get_config()
  pc.batch = min(32, len(run.eval_records))
  pc.max_new_tokens = run.new_tokens
  pc.guidance = "none,last:1,last:2,all"
  pc.n_buckets = 4
  prompts = [run.tok.encode(run.task.prompt(r)) for r in run.eval_records[:pc.batch]]
  return mismatch.probe_precision(run.cfg, state["params"], "mxfp4", prompts, pc)


def warm_start_id(rows: list[dict], steps: int) -> str | None:
  """A fingerprint of the warm start a run's metric rows record (its first `steps` rows, the
  supervised ones; a run that takes a shared warm start copies that run's): the loss and
  gradient norm of every step, as written. Two runs whose ids agree started RL from warm starts
  that computed the same numbers at every step; a warm start made again on another device kind
  (whose sums need not repeat) gets another id. None: no supervised step."""
  sft = [[r["step"], r.get("train/loss"), r.get("train/grad_norm")] for r in rows
         if r["step"] < steps]
  return hashlib.sha256(json.dumps(sft).encode()).hexdigest()[:16] if sft else None


def check_warm_start(summary: dict, family: str, seed: int, workdir: str, steps: int,
                     device: str) -> None:
  """Raises SystemExit where the shared warm start in `workdir` is another than the one the
  runs of that family and seed recorded in `summary` started from (their `warm_start_id`): the
  modes of a seed are compared from one policy, so a seed's runs are trained from one warm start
  (made again, e.g. on a fresh machine, it must repeat bit for bit, as deterministic ops do on
  one device kind)."""
  if not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    return
  mine = warm_start_id(read_metrics(workdir), steps)
  if mine is None:
    return
  other = {key: run for key, run in summary.get(family, {}).get("runs", {}).items()
           if key.endswith(f"/seed{seed}") and run.get("warm_start_id") not in (None, mine)}
  if other:
    _, run = sorted(other.items())[0]
    sys.exit(f"the warm start of {family} seed {seed} in {workdir} (made on {device}; id "
             f"{mine}) is another than the one {', '.join(sorted(other))} started RL from "
             f"(id {run['warm_start_id']}, made on {run.get('device')}): the seed's other "
             "modes would start from another policy. Train them on that device kind, or remove "
             f"those runs from {curves.SUMMARY} to train the seed's modes again")


def check_device_kind(summary: dict, families, modes, seeds, args) -> None:
  """Raises ValueError, before anything trains, where a seed's shared warm start would be made
  again (not on disk) for runs still to train, and that seed's recorded runs were made on
  another device kind: deterministic ops repeat a warm start on one kind, so it would most
  likely not be theirs, which `check_warm_start` finds only once it is made (minutes of GPU).
  `--any_device` makes it anyway and lets its fingerprint decide."""
  if args.any_device:
    return
  device = jax.devices()[0].device_kind
  for family in families:
    for seed in seeds:
      if all(_recorded(summary, family, mode, seed, args) for mode in modes):
        continue  # nothing of it to train
      if finished(warm_dir(args.out, family, seed),
                  _config(warm_arg(family, seed, args.smoke, args.scale))):
        continue  # on disk: `check_warm_start` compares it
      other = {key: run.get("device") for key, run in
               summary.get(family, {}).get("runs", {}).items()
               if key.endswith(f"/seed{seed}") and run.get("device") not in (None, device)}
      if other:
        kinds = ", ".join(sorted(set(other.values())))
        raise ValueError(
            f"{family} seed {seed}'s recorded runs ({', '.join(sorted(other))}) were made on "
            f"{kinds}, this device is {device}: its shared warm start made again here would "
            "most likely not be theirs (deterministic ops repeat on one device kind), and the "
            f"seed's other modes would start from another policy. Train them on {kinds}, pass "
            "--any_device to make it here and let its fingerprint decide, or remove those runs "
            f"from {curves.SUMMARY}")


def _main_command(arg: str, workdir: str, data_dir: str = "") -> str:
  return (f"python -m trace_jax.main --config=configs/ablation.py:{arg} --workdir={workdir}"
          + (f" --config.data_dir={data_dir}" if data_dir else ""))


def run_results(family: str, mode: str, seed: int, workdir: str, c, smoke: bool = False,
                scale: str = "cpu", init_from: str = "") -> tuple[dict, dict]:
  """A finished run's summary (with its config and the command that reproduces it, after the
  one that trains its warm start where it took another run's: `init_from`) and its curves,
  both from its metrics.jsonl."""
  arg = config_arg(family, mode, seed, smoke, scale, init_from)
  rows = read_metrics(workdir)
  summary = {**summarize(workdir, c), "config_arg": arg,
             "command": _main_command(arg, workdir, c.data_dir),
             "config": json.loads(c.to_json()), "warm_start_id": warm_start_id(rows, c.sft.steps)}
  if init_from:
    summary["warm_start_command"] = _main_command(warm_arg(family, seed, smoke, scale),
                                                  init_from, c.data_dir)
  return summary, curves.run_curves(rows)


def markdown_table(summary: dict, families) -> str:
  """The RESULTS.md table: one row per family, mode and seed, plus post-hoc FP4, each with the
  config (or command) that reproduces it."""
  f = lambda v, spec: "-" if v is None else spec.format(v)
  lines = ["| family | mode | reward first -> last | eval acc. (rollout precision) | "
           "mismatch KL | flip rate | route flips | record B/token | "
           "`--config=configs/ablation.py:` |",
           "|---|---|---|---|---|---|---|---|---|"]
  for family in families:
    acc = summary[family]["final_eval_accuracy"]
    runs = summary[family]["runs"]
    order = lambda key: (int(key.split("/seed")[1]), MODES.index(key.split("/")[0]))
    for key in sorted(runs, key=order):  # a seed's modes together, whatever order they ran in
      s, mode, seed = runs[key], key.split("/")[0], int(key.split("/seed")[1])
      lines.append(
          f"| {family} | {mode} | {f(s['reward_first'], '{:.3f}')} -> "
          f"{f(s['reward_last'], '{:.3f}')} | {f(s['eval_accuracy_before_rl'], '{:.3f}')} -> "
          f"{f(s['eval_accuracy_after'], '{:.3f}')} | {f(s['mismatch_kl_k3'], '{:.1e}')} | "
          f"{f(s['flip_rate'], '{:.4f}')} | {f(s.get('route_flip_rate'), '{:.4f}')} | "
          f"{f(s['record_bytes_per_token'], '{:.0f}')} | "
          f"`{s.get('config_arg', config_arg(family, mode, seed))}` |")
    for seed, value in seed_stats.posthoc(summary[family]).items():
      arg = runs.get(f"bf16/seed{seed}", {}).get("config_arg", "")
      scale = dict(kv.split("=", 1) for kv in arg.split(",") if "=" in kv).get("scale", "cpu")
      flag = "" if scale == "cpu" else f" --scale={scale}"
      lines.append(f"| {family} | bf16 policy, MXFP4 post hoc | | -> {f(value, '{:.3f}')} | | "
                   f"| | | `experiments/ablation.py{flag} --families={family} --modes=bf16 "
                   f"--seeds={seed}` |")
  return "\n".join(lines)


def use_compile_cache(path: str) -> None:
  """JAX's persistent compilation cache in `path`, for this process (set before it compiles)."""
  jax.config.update("jax_compilation_cache_dir", path)


def train_command(family: str, mode: str, seed: int, workdir: str, smoke: bool = False,
                  scale: str = "cpu", data_dir: str = "", init_from: str = "", *,
                  arg: str | None = None) -> list[str]:
  """The command that trains one run in a process of its own (what `run_results` records);
  `arg`: configs/ablation.py's argument, in place of the run's (e.g. `warm_arg`)."""
  arg = arg or config_arg(family, mode, seed, smoke, scale, init_from)
  return ([sys.executable, "-m", "trace_jax.main",
           f"--config={os.path.join(ROOT, 'configs', 'ablation.py')}:{arg}",
           f"--workdir={workdir}", "--noprogress"]
          + ([f"--config.data_dir={data_dir}"] if data_dir else []))


def _tail(path: str, lines: int = FAILED_LOG_LINES) -> list[str]:
  """The last lines of a run's log (what the ablation prints of a run that failed: the log may
  stay on a machine that is gone by the time anyone reads it)."""
  with open(path, errors="replace") as fh:
    return collections.deque(fh, maxlen=lines)


# runs a command (argv[2:]) tied to the process argv[1] (Linux): it gets a SIGTERM when that
# process dies (PR_SET_PDEATHSIG, kept across the exec), so that no run trains on, unwatched,
# after the ablation was killed; elsewhere the ablation's own signals still reach its runs
_TIED = """
import ctypes, os, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    if os.getppid() != int(sys.argv[1]):
        sys.exit(128 + signal.SIGTERM)
os.execv(sys.argv[2], sys.argv[2:])
"""


def train_in_processes(runs: list[tuple[str, list[str], str]], jobs: int,
                       cache: str | None = None, poll_s: float = 1.0,
                       on_finished=None) -> list[str]:
  """Runs (name, command, workdir) at most `jobs` at a time, each command in a process of its
  own with its output in <workdir>/train.log, in the order given -> the names of those that
  failed. Each process gets 1/jobs of the GPU's memory (unless XLA_PYTHON_CLIENT_MEM_FRACTION
  is set) and `cache` as JAX's persistent compilation cache. `on_finished(name)` is called as
  each run ends well, while the others train on.

  A SIGTERM or SIGINT (Ctrl-C) starts no more runs and passes one SIGTERM to each running one,
  which stops after its step in flight with a checkpoint; once they have, `Interrupted` is
  raised (a second signal passes a second SIGTERM: they stop at once). The runs are in sessions
  of their own, so a terminal's Ctrl-C reaches them only this way, once."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
  env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / jobs:.3f}")
  if cache:
    env["JAX_COMPILATION_CACHE_DIR"] = cache
  queue, running, failed, passed_on = list(runs), {}, [], False

  def reap():
    for proc in [p for p in running if p.poll() is not None]:
      name, log, started = running.pop(proc)
      log.close()
      took = (time.time() - started) / 60
      if passed_on:
        print(f"== {name}: stopped after {took:.1f} min (exit status {proc.returncode})",
              flush=True)
      elif proc.returncode:
        failed.append(name)
        print(f"== {name}: failed (exit status {proc.returncode}) after {took:.1f} min; see "
              f"{log.name}, which ends:", flush=True)
        print("".join(f"   {name} | {line}" for line in _tail(log.name)), end="", flush=True)
      else:
        print(f"== {name}: trained in {took:.1f} min", flush=True)
      if proc.returncode == 0 and on_finished is not None:
        on_finished(name)

  with StopBetweenSteps() as stop:
    try:
      while queue and stop.signum is None or running:
        while queue and len(running) < jobs and stop.signum is None:
          name, command, workdir = queue.pop(0)
          os.makedirs(workdir, exist_ok=True)
          log = open(os.path.join(workdir, "train.log"), "a")
          proc = subprocess.Popen([sys.executable, "-c", _TIED, str(os.getpid()), *command],
                                  stdout=log, stderr=subprocess.STDOUT, env=env,
                                  start_new_session=True)
          running[proc] = (name, log, time.time())
          print(f"== {name} -> {workdir} (process {proc.pid}; {len(queue)} waiting)",
                flush=True)
        if stop.signum is not None and not passed_on:
          passed_on = True
          print(f"== {signal.Signals(stop.signum).name}: stopping the {len(running)} running "
                f"after their step in flight", flush=True)
          for proc in running:
            proc.send_signal(signal.SIGTERM)
        time.sleep(poll_s)
        reap()
    except Interrupted:  # a second signal: the runs stop at once
      for proc in running:
        proc.send_signal(signal.SIGTERM)
      for proc in running:
        proc.wait()
      raise
  if stop.signum is not None:
    raise Interrupted(stop.signum)
  return failed


def main(argv=None):
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--scale", default="cpu", choices=SCALES,
                      help="configs/ablation.py's scale: cpu (3-layer policies) or gpu (the "
                           "12-layer `gpu` policy on harder tasks, for one H200)")
  parser.add_argument("--out", default=None,
                      help="default experiments/results (--scale=gpu: experiments/results/gpu)")
  parser.add_argument("--figures", default=None,
                      help="default experiments/figures (--scale=gpu: experiments/figures/gpu)")
  parser.add_argument("--families", default="",
                      help=f"comma separated, of {FAMILIES}; default all (--figures_only: all "
                           "the results hold)")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--smoke", action="store_true", help="a few steps per run (a check)")
  parser.add_argument("--warm_start", default=None, choices=("shared", "own"),
                      help="shared: one warm start per family and seed (<out>/<family>/"
                           f"{WARM}/seed<S>, trained first), every mode's run starting RL from "
                           "it; own: each run its own. Default: " + ", ".join(
                               f"{v} at --scale={k}" for k, v in WARM_START.items()))
  parser.add_argument("--figures_only", action="store_true",
                      help="only redraw the figures and the table from <out>/summary.json and "
                           "<out>/curves.json")
  parser.add_argument("--merge", default="",
                      help="comma separated results directories whose recorded runs are added "
                           "to <out>'s (e.g. brought back from another machine); then the "
                           "figures and table are redrawn, nothing is trained")
  parser.add_argument("--data_dir", default="", help="where TFDS datasets are prepared")
  parser.add_argument("--compile_cache", default=None,
                      help="JAX's persistent compilation cache, shared by the runs (a seed's "
                           "programs are the other seeds'): default <out>/compile_cache, "
                           "'none' for none")
  parser.add_argument("--any_device", action="store_true",
                      help="make a seed's shared warm start again on a device kind other than "
                           "the one its recorded runs were made on (its fingerprint must still "
                           "match theirs)")
  parser.add_argument("--jobs", type=int, default=1,
                      help="runs trained at once, each in a process of its own (a GPU is "
                           "shared, each process taking 1/jobs of its memory); default 1, in "
                           "this process")
  args = parser.parse_args(argv)
  if args.jobs < 1:
    parser.error(f"--jobs={args.jobs}: at least 1")
  if args.merge and args.figures_only:
    parser.error("--merge redraws the figures itself: leave out --figures_only")
  args.warm_start = args.warm_start or WARM_START[args.scale]
  sub = "" if args.scale == "cpu" else args.scale
  args.out = args.out or os.path.join("experiments", "results", sub)
  args.figures = args.figures or os.path.join("experiments", "figures", sub)
  families = [f for f in args.families.split(",") if f]
  modes = [m for m in args.modes.split(",") if m]
  bad = [f for f in families if f not in FAMILIES] + [m for m in modes if m not in MODES]
  if bad:
    parser.error(f"unknown families or modes {bad}; choose from {FAMILIES} and {MODES}")
  try:
    seeds = [int(s) for s in args.seeds.split(",")]
  except ValueError:
    parser.error(f"--seeds={args.seeds!r}: comma-separated integers")
  with cli.bad_input(ValueError, BoundaryUnavailable):  # every run's config, before the first
    check_workdir(args.out, "--out")
    check_workdir(args.figures, "--figures")
    if not args.figures_only:  # what earlier invocations recorded: kept, results accumulate
      try:
        summary, runs = previous_results(args.out)
      except curves.ResultsError as e:
        raise ValueError(f"--out: {e}; move the results aside to start afresh") from None
    for other in [d for d in args.merge.split(",") if d]:  # before anything is written
      if os.path.abspath(other) == os.path.abspath(args.out):
        raise ValueError(f"--merge={other} is --out itself")
      try:
        added = merge(summary, runs, other)
      except curves.ResultsError as e:
        raise ValueError(f"--merge: {e}") from None
      print(f"from {other}: {', '.join(added) or 'nothing new'}", flush=True)
    configs = [run_config(family, mode, seed, args.smoke, args.scale)
               for family in ([] if args.figures_only or args.merge else families)
               for mode in modes for seed in seeds]
    configs += [_config(arg) for arg in dict.fromkeys(  # each family and seed's warm start once
        warm_arg(c.task.family, c.seed, args.smoke, args.scale) for c in configs
        if args.warm_start == "shared")]
    for c in configs:  # as trace_jax.main does: before anything asks JAX for a device (as
      determinism.enable(c.deterministic)  # validating a config does, counting them)
    for c in configs:  # (sft.init_from, where shared, is checked once its warm start is made)
      validate(c)
      check_sandbox(c)
    if configs and args.warm_start == "shared":
      check_device_kind(summary, families or list(FAMILIES), modes, seeds, args)

  if args.merge:
    curves.write(args.out, summary, runs)
    return _report(figures.load(args.out), args)
  if args.figures_only:
    try:
      data = figures.load(args.out, families)
    except curves.ResultsError as e:
      sys.exit(f"--figures_only: {e}")
    return _report(data, args)
  families = families or list(FAMILIES)
  cache = args.compile_cache or os.path.join(args.out, "compile_cache")
  if cache != "none":
    use_compile_cache(cache)
  if args.jobs > 1:  # this process reads results while others train: no memory taken ahead
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  start = time.time()
  summary["provenance"] = provenance()
  failed, stopped = [], None

  def record(family: str, mode: str, seed: int) -> None:
    """Adds a finished run's results (read from its directory) to <out>'s, and writes them."""
    fam = summary.setdefault(family, {"runs": {}, "final_eval_accuracy": {}})
    init_from, key = _init_from(args, family, seed), f"{mode}/seed{seed}"
    c = run_config(family, mode, seed, args.smoke, args.scale, init_from)
    c.data_dir = args.data_dir
    fam["runs"][key], runs.setdefault(family, {})[key] = run_results(
        family, mode, seed, os.path.join(args.out, family, mode, f"seed{seed}"), c,
        args.smoke, args.scale, init_from)
    fam["runs"][key].update({k: summary["provenance"][k] for k in MADE_BY})
    _headline(fam, mode, {seed})
    summary["runtime_s"] = time.time() - start
    curves.write(args.out, summary, runs)  # after every run: a stop keeps what is done

  recorded_now = set()  # "family/mode/seedS" read from its directory by on_finished

  def on_finished(name: str) -> None:  # a run trained in a process: recorded at once
    family, mode, seed = name.split("/")
    if mode != WARM:
      record(family, mode, int(seed.removeprefix("seed")))
      recorded_now.add(name)

  if args.jobs > 1:
    cache_dir = None if cache == "none" else os.path.abspath(cache)
    to_train = _to_train(summary, families, modes, seeds, args)
    try:  # the shared warm starts first: the runs start from them
      warm = _warm_starts(to_train, args)
      failed = train_in_processes(warm, args.jobs, cache_dir) if warm else []
      for name in sorted({_warm_name(name) for name, _, _ in to_train}
                         if args.warm_start == "shared" else ()):
        if name not in failed:
          _check_shared(summary, name, args)
      failed += [name for name, _, _ in to_train if _warm_name(name) in failed]
      failed += train_in_processes([r for r in to_train if r[0] not in failed], args.jobs,
                                   cache_dir, on_finished=on_finished)
    except Interrupted as e:  # each run checkpointed where it stopped; those that had
      stopped = e.signum      # finished are recorded below, before the exit
  for family in families:
    fam = summary.setdefault(family, {"runs": {}, "final_eval_accuracy": {}})
    runs.setdefault(family, {})
    posthoc, probed = [], None  # after the family's runs are recorded: a compile and more each
    for mode in modes:
      fresh = set()  # seeds whose results this invocation read from their run directory
      for seed in seeds:
        init_from = _init_from(args, family, seed)
        c = run_config(family, mode, seed, args.smoke, args.scale, init_from)
        c.data_dir = args.data_dir
        workdir = os.path.join(args.out, family, mode, f"seed{seed}")
        key = f"{mode}/seed{seed}"
        recorded = _recorded(summary, family, mode, seed, args)
        if f"{family}/{key}" in failed:
          continue
        if not finished(workdir, c):
          if recorded and not os.path.exists(workdir):
            print(f"== {family} / {mode} / seed {seed}: kept from {curves.SUMMARY} (its run "
                  f"directory is not here; remove the entry to rerun it)", flush=True)
            continue
          if stopped is not None:  # trains no more after a stop
            continue
          if init_from:
            _train_warm_start(family, seed, args)
            _check_shared(summary, f"{family}/{WARM}/seed{seed}", args)
          print(f"== {family} / {mode} / seed {seed} -> {workdir}", flush=True)
          train(c, workdir, progress=False)
        if f"{family}/{key}" not in recorded_now:
          record(family, mode, seed)
        if mode == "bf16":
          posthoc.append((key, workdir))
        fresh.add(seed)
      if not any(k.startswith(mode + "/") for k in fam["runs"]):  # its runs all failed
        continue
      first = _headline(fam, mode, fresh)
      if mode == "trace_all" and first in fresh:
        probed = os.path.join(args.out, family, mode, f"seed{first}")
    for key, workdir in posthoc:  # post-hoc FP4: the bf16-trained policy on the MXFP4 engine
      fam["runs"][key]["posthoc_fp4_accuracy"] = fp4_eval(workdir)
      _headline(fam, "bf16", {int(key.split("/seed")[1])})
      curves.write(args.out, summary, runs)
    if probed:
      fam["probe"] = probe(probed)
    if stopped is not None and not fam["runs"]:  # nothing of it finished yet
      del summary[family], runs[family]
    summary["runtime_s"] = time.time() - start
    curves.write(args.out, summary, runs)
  if stopped is not None:
    print(f"stopped by {signal.Signals(stopped).name}; the runs that had finished are in "
          f"{os.path.join(args.out, curves.SUMMARY)}, and rerunning the same command resumes "
          f"every other run", file=sys.stderr, flush=True)
    sys.exit(128 + stopped)
  _report(figures.load(args.out), args)  # of every family the results hold, kept ones too
  print(f"done in {summary['runtime_s'] / 60:.1f} min")
  if failed:
    sys.exit(f"failed: {', '.join(failed)} (each run's train.log says why; rerunning the same "
             f"command resumes them)")


def _config(arg: str) -> ml_collections.ConfigDict:
  return importlib.import_module("configs.ablation").get_config(arg)


def _init_from(args, family: str, seed: int) -> str:
  """The warm start this invocation's runs of a family and seed take (--warm_start=shared: the
  shared one's run directory), or "" (their own)."""
  return warm_dir(args.out, family, seed) if args.warm_start == "shared" else ""


def _warm_name(name: str) -> str:
  """"family/mode/seedS" -> the name of that family and seed's shared warm start."""
  family, _, seed = name.split("/")
  return f"{family}/{WARM}/{seed}"


def _train_warm_start(family: str, seed: int, args) -> None:
  """A family and seed's shared warm start, trained in this process unless it is there."""
  c = _config(warm_arg(family, seed, args.smoke, args.scale))
  c.data_dir = args.data_dir
  workdir = warm_dir(args.out, family, seed)
  if not finished(workdir, c):
    print(f"== {family} / {WARM} / seed {seed} -> {workdir}", flush=True)
    train(c, workdir, progress=False)


def _check_shared(summary: dict, name: str, args) -> None:
  """`check_warm_start` for the shared warm start `name` ("family/warm_start/seedS")."""
  family, _, seed = name.split("/")
  seed = int(seed.removeprefix("seed"))
  c = _config(warm_arg(family, seed, args.smoke, args.scale))
  check_warm_start(summary, family, seed, warm_dir(args.out, family, seed), c.sft.steps,
                   jax.devices()[0].device_kind)


def _warm_starts(to_train, args) -> list[tuple[str, list[str], str]]:
  """The shared warm starts the runs `to_train` (as `_to_train` lists them) take that are not
  trained yet, as `train_in_processes` takes them."""
  out = []
  for name, _, _ in to_train if args.warm_start == "shared" else []:
    family, _, seed = name.split("/")
    seed = int(seed.removeprefix("seed"))
    workdir, arg = warm_dir(args.out, family, seed), warm_arg(family, seed, args.smoke,
                                                              args.scale)
    if _warm_name(name) in [n for n, _, _ in out] or finished(workdir, _config(arg)):
      continue
    out.append((_warm_name(name), train_command(family, "bf16", seed, workdir,
                                                data_dir=args.data_dir, arg=arg), workdir))
  return out


def _recorded(summary: dict, family: str, mode: str, seed: int, args) -> bool:
  """Whether the results hold this run, of this invocation's config."""
  run = summary.get(family, {}).get("runs", {}).get(f"{mode}/seed{seed}", {})
  return run.get("config_arg") == config_arg(family, mode, seed, args.smoke, args.scale,
                                             _init_from(args, family, seed))


def _to_train(summary: dict, families, modes, seeds, args) -> list[tuple[str, list[str], str]]:
  """The runs this invocation trains, as `train_in_processes` takes them: a seed's families
  and modes before the next seed's, so that the first processes compile different programs
  and the later ones find theirs in the cache."""
  runs = []
  for seed in seeds:
    for family in families:
      for mode in modes:
        init_from = _init_from(args, family, seed)
        c = run_config(family, mode, seed, args.smoke, args.scale, init_from)
        workdir = os.path.join(args.out, family, mode, f"seed{seed}")
        kept = _recorded(summary, family, mode, seed, args) and not os.path.exists(workdir)
        if kept or finished(workdir, c):
          continue
        runs.append((f"{family}/{mode}/seed{seed}",
                     train_command(family, mode, seed, workdir, args.smoke, args.scale,
                                   args.data_dir, init_from), workdir))
  return runs


def merge(summary: dict, runs: dict, other: str) -> list[str]:
  """Adds to (summary, curves' runs) the runs recorded in results directory `other` that they
  lack, with their curves, each family's probe where it has none, and the headline numbers
  of the modes that gained a seed -> the runs added ("family/mode/seedS"). A run recorded in
  both with different results raises ValueError naming it."""
  theirs, their_runs = previous_results(other)
  if not theirs:
    raise ValueError(f"--merge: {other} holds no {curves.SUMMARY} and {curves.CURVES}")
  summary.setdefault("provenance", theirs["provenance"])
  added = []
  for family in [k for k, v in theirs.items() if isinstance(v, dict) and "runs" in v]:
    fam = summary.setdefault(family, {"runs": {}, "final_eval_accuracy": {}})
    mine = runs.setdefault(family, {})
    fresh = {}
    for key, run in theirs[family]["runs"].items():
      if key in fam["runs"]:
        if _numbers(fam["runs"][key]) != _numbers(run):
          raise ValueError(f"--merge: {family}/{key} is recorded in {other} with other results "
                           "than here; remove one of them to choose")
        continue
      fam["runs"][key], mine[key] = run, their_runs[family][key]
      mode, seed = key.split("/seed")
      fresh.setdefault(mode, set()).add(int(seed))
      added.append(f"{family}/{key}")
    if "probe" in theirs[family]:
      fam.setdefault("probe", theirs[family]["probe"])
    for mode, seeds in fresh.items():
      _headline(fam, mode, seeds)
  return added


def _numbers(run: dict) -> dict:
  """What a recorded run measured (not where or by which commit it ran)."""
  return {k: v for k, v in run.items()
          if k not in (*MADE_BY, "command", "warm_start_command", "config")}


def _headline(fam: dict, mode: str, fresh: set) -> int:
  """A family's headline numbers for a mode: the lowest seed recorded, recomputed only from its
  directory (`fresh`: the seeds read from theirs) or where the mode has none yet -> that seed."""
  first = min(int(k.split("/seed")[1]) for k in fam["runs"] if k.startswith(mode + "/"))
  if first in fresh or mode not in fam["final_eval_accuracy"]:
    acc = fam["final_eval_accuracy"]
    acc[mode] = fam["runs"][f"{mode}/seed{first}"]["eval_accuracy_after"]
    if mode == "bf16":
      acc["bf16_bf16"] = acc["bf16"]
      posthoc = fam["runs"][f"bf16/seed{first}"].get("posthoc_fp4_accuracy")
      if first in fresh and posthoc is not None:  # (not yet evaluated: no number)
        acc["bf16_posthoc_fp4"] = posthoc
      elif first in fresh:
        acc.pop("bf16_posthoc_fp4", None)
  return first


def _report(data: curves.Results, args) -> None:
  """Figures (PNG) and the markdown table (printed and written to <out>/table.md)."""
  for path in figures.make_all(args.out, args.figures, data.families):
    print("wrote", path)
  table = markdown_table(data.summary, data.families)
  across = seed_stats.markdown(data.summary, data.families)
  if across:  # mean ± the 95% interval's half-width over seeds (experiments/seeds.py)
    table += "\n\nAcross seeds (mean ± 95% interval, Student's t):\n\n" + across
  pairs = seed_stats.paired_markdown(data.summary, data.families)
  if pairs:  # the modes of a seed share its warm start: their differences within it
    table += ("\n\nPaired within seeds (a - b in each seed that has both; mean ± 95% "
              "interval):\n\n" + pairs)
  with open(os.path.join(args.out, "table.md"), "w") as fh:
    fh.write(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
