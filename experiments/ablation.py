"""The ablation of DESIGN section 8 on the small CPU setting, for all three task families.

    python experiments/ablation.py [--out=experiments/results] [--seeds=0] \
        [--families=reasoning,coding,long_horizon] [--modes=bf16,fp4_rollout,fp4_qat,trace,trace_all]
    python experiments/ablation.py --figures_only   # redraw figures and table from summary.json

For every family, mode and seed: one RL run (configs/<family>.py with a 3-layer policy, so that
`trace` can keep the deepest layer's records while `trace_all` keeps all three). Rerunning the
command resumes unfinished runs and skips finished ones. Then, per family:

- post-hoc FP4: the BF16-trained policy quantized to MXFP4 after training and evaluated by the
  FP4 rollout engine, against the FP4 policies the FP4 modes trained;
- record bytes against the KL they buy: the trained trace_all policy probed on its task's eval
  prompts with records of none / last:1 / last:2 / all layers, routing replay off and on.

Writes <out>/summary.json and the figures (experiments/figures/*.png); RESULTS.md quotes them.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time

import jax
import ml_collections

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments import figures  # noqa: E402
from trace_jax import cli, mismatch  # noqa: E402
from trace_jax.models import QuantRecipe, pack_weights  # noqa: E402
from trace_jax.rl.checkpoint import Checkpointer  # noqa: E402
from trace_jax.rl.episodes import greedy_accuracy  # noqa: E402
from trace_jax.rl.loop import load_run, summarize, train  # noqa: E402
from trace_jax.rl.rollout import RolloutEngine  # noqa: E402
from trace_jax.rl.trainer import MODES  # noqa: E402
from trace_jax.rl.validate import check_sandbox, check_workdir, validate  # noqa: E402
from trace_jax.tasks.sandbox import BoundaryUnavailable  # noqa: E402

FAMILIES = ("reasoning", "coding", "long_horizon")
# the CPU budget of one run per family (minutes on 2 cores): fewer RL steps than the defaults;
# the 3-layer long-horizon policy needs twice the default SFT to learn the format (at 150 steps
# its SFT loss was still falling steeply and greedy accuracy was 0.18-0.22)
ABLATION = {"model.n_layers": 3, "rl.trace_layers": "last:1", "log.flip_rate_every": 5}
STEPS = {"reasoning": {"rl.steps": 300}, "coding": {"rl.steps": 300},
         "long_horizon": {"sft.steps": 300, "rl.steps": 200}}


def run_config(family: str, mode: str, seed: int, smoke: bool = False
               ) -> ml_collections.ConfigDict:
  module = importlib.import_module(f"configs.{family}")
  overrides = {**ABLATION, "rl.mode": mode, "seed": seed}
  if not smoke:
    overrides.update(STEPS[family])
  variant = ",".join((["smoke"] if smoke else []) + [f"{k}={v}" for k, v in overrides.items()])
  return module.get_config(variant)


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


def markdown_table(summary: dict, families) -> str:
  """The RESULTS.md table: one row per family and mode (first seed), plus post-hoc FP4."""
  f = lambda v, spec: "-" if v is None else spec.format(v)
  lines = ["| family | mode | reward first -> last | eval acc. (rollout precision) | "
           "mismatch KL | flip rate | route flips | record B/token |",
           "|---|---|---|---|---|---|---|---|"]
  for family in families:
    acc = summary[family]["final_eval_accuracy"]
    for key, s in summary[family]["runs"].items():
      mode = key.split("/")[0]
      lines.append(
          f"| {family} | {mode} | {f(s['reward_first'], '{:.3f}')} -> "
          f"{f(s['reward_last'], '{:.3f}')} | {f(s['eval_accuracy_before_rl'], '{:.3f}')} -> "
          f"{f(s['eval_accuracy_after'], '{:.3f}')} | {f(s['mismatch_kl_k3'], '{:.1e}')} | "
          f"{f(s['flip_rate'], '{:.4f}')} | {f(s.get('route_flip_rate'), '{:.4f}')} | "
          f"{f(s['record_bytes_per_token'], '{:.0f}')} |")
    if "bf16_posthoc_fp4" in acc:
      lines.append(f"| {family} | bf16 policy, MXFP4 post hoc | | -> "
                   f"{f(acc['bf16_posthoc_fp4'], '{:.3f}')} | | | | |")
  return "\n".join(lines)


def main(argv=None):
  parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="experiments/results")
  parser.add_argument("--figures", default="experiments/figures")
  parser.add_argument("--families", default=",".join(FAMILIES))
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--seeds", default="0")
  parser.add_argument("--smoke", action="store_true", help="a few steps per run (a check)")
  parser.add_argument("--figures_only", action="store_true",
                      help="only redraw the figures and the table from <out>/summary.json")
  parser.add_argument("--data_dir", default="", help="where TFDS datasets are prepared")
  args = parser.parse_args(argv)
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
    for family in [] if args.figures_only else families:
      for mode in modes:
        for seed in seeds:
          c = run_config(family, mode, seed, args.smoke)
          validate(c)
          check_sandbox(c)

  if args.figures_only:
    return _report(figures.load_summary(args.out), families, args)
  start = time.time()
  summary = {}
  for family in families:
    summary[family] = {"runs": {}, "final_eval_accuracy": {}}
    for mode in modes:
      for seed in seeds:
        c = run_config(family, mode, seed, args.smoke)
        c.data_dir = args.data_dir
        workdir = os.path.join(args.out, family, mode, f"seed{seed}")
        if not finished(workdir, c):
          print(f"== {family} / {mode} / seed {seed} -> {workdir}", flush=True)
          train(c, workdir, progress=False)
        summary[family]["runs"][f"{mode}/seed{seed}"] = summarize(workdir, c)
      first = os.path.join(args.out, family, mode, f"seed{seeds[0]}")
      summary[family]["final_eval_accuracy"][mode] = summary[family]["runs"][
          f"{mode}/seed{seeds[0]}"]["eval_accuracy_after"]
      if mode == "bf16":
        summary[family]["final_eval_accuracy"]["bf16_bf16"] = summary[family][
            "final_eval_accuracy"]["bf16"]
        summary[family]["final_eval_accuracy"]["bf16_posthoc_fp4"] = fp4_eval(first)
    if "trace_all" in modes:
      summary[family]["probe"] = probe(os.path.join(args.out, family, "trace_all",
                                                    f"seed{seeds[0]}"))
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
      json.dump(summary, fh, indent=1)
  summary["runtime_s"] = time.time() - start
  summary["jax"] = jax.__version__
  with open(os.path.join(args.out, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
  _report(summary, families, args)
  print(f"done in {summary['runtime_s'] / 60:.1f} min")


def _report(summary: dict, families, args) -> None:
  """Figures (PNG) and the markdown table (printed and written to <out>/table.md)."""
  for path in figures.make_all(args.out, args.figures, families):
    print("wrote", path)
  table = markdown_table(summary, families)
  with open(os.path.join(args.out, "table.md"), "w") as fh:
    fh.write(table + "\n")
  print(table)


if __name__ == "__main__":
  main()
