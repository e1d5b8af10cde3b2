"""Bad input on every entry point's command line: one line on stderr, exit status 2, no work."""

import json
import subprocess
import sys

import pytest

from tests.test_main import ENV, ROOT

MAIN = ("-m", "trace_jax.main", "--noprogress")
MISMATCH = ("-m", "trace_jax.mismatch")
HUMANEVAL = ("-m", "trace_jax.evaluate_humaneval")
ABLATION = ("experiments/ablation.py",)


def forked(commands):
  """Runs each command as `python args` would (tests/forked.py: the imports once, each command
  in a process of its own); JAX_LOG_COMPILES makes JAX print a line for every program it
  compiles, so one line of stderr also says that nothing was compiled."""
  env = dict(ENV, JAX_LOG_COMPILES="1")
  out = subprocess.run([sys.executable, "-m", "tests.forked", json.dumps(commands)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  results = [json.loads(line) for line in out.stdout.splitlines()]
  assert len(results) == len(commands), out.stdout[-3000:]
  return results


def one_line_errors(cases, extra=()):
  """Checks that each command wrote one line to stderr holding every string wanted, nothing to
  stdout, and exited with 2; returns the results of the extra commands run with them."""
  results = forked([list(args) for args, _ in cases] + [list(args) for args in extra])
  for (args, wants), r in zip(cases, results):
    lines = r["stderr"].splitlines()
    assert r["returncode"] == 2 and len(lines) == 1, (args, r["returncode"], r["stderr"][-3000:])
    for want in wants:
      assert want in lines[0], (args, want, lines[0])
    assert not r["stdout"], (args, r["stdout"])
  return results[len(cases):]


def test_bad_main_input_is_one_line_naming_the_key_and_its_choices(tmp_path):
  workdir = tmp_path / "w"
  a_file = tmp_path / "file"
  a_file.write_text("")
  run = (*MAIN, f"--workdir={workdir}")
  helped, = one_line_errors([
      ((*run, "--config.rl.nope=1"), ["rl.nope", "kl_coef", "routing_replay"]),
      ((*run, "--config.rl.lrr=1"), ["rl.lrr", "did you mean rl.lr?"]),
      ((*run, "--config.rl.kernels=pallas"), ["rl.kernels", "moved to engine.kernels"]),
      ((*run, "--config.rl.attention_kernel=mosaic"),
       ["rl.attention_kernel", "moved to engine.attention_kernel"]),
      ((*run, "--config.nope.x=1"), ["nope.x", "top-level keys", "sft"]),
      ((*run, "--config.rl.lr.x=1"), ["rl.lr.x", "rl.lr is a float"]),
      ((*run, "--config.rl.lr=abc"), ["rl.lr", "float", "'abc'"]),
      ((*run, "--config.rl.routing_replay=maybe"), ["rl.routing_replay", "true or false"]),
      ((*run, "--config.rl.steps", "ten"), ["rl.steps", "int", "'ten'"]),
      ((*run, "--config.rl"), ["rl", "a section"]),
      ((*run, "--config=configs/nope.py"), ["configs/nope.py", "reasoning.py", "mismatch.py"]),
      ((*run, "--config=configs/reasoning.py:bogus"), ["'bogus'", "trace_all", "smoke"]),
      ((*run, "--config=configs/reasoning.py:rl.nope=1"), ["rl.nope", "kl_coef"]),
      ((*run, "--config.rl.mode=fp8"), ["rl.mode='fp8'", "trace_all"]),
      ((*run, "--config.rl.remat=all"), ["rl.remat='all'", "'none', 'layer'"]),
      ((*run, "--config.rl.attention=flash"), ["rl.attention='flash'", "'full', 'fused'"]),
      ((*run, "--config.engine.scan_decode=maybe"), ["engine.scan_decode", "true or false"]),
      ((*run, "--wrkdir=x"), ["wrkdir", "workdir"]),
      ((*MAIN, f"--workdir={a_file}"), [str(a_file), "not a directory"]),
      ((*MAIN, f"--workdir={a_file}/run"), [str(a_file), "not a directory"]),
      # a preset by name sets the section; keys after it change the preset (here, making the
      # trace layers ask for more layers than there are)
      ((*run, "--config.model=smal"), ["model", "'smal'", "did you mean small?", "qwen3_30b_a3b",
                                       "tiny"]),
      ((*run, "--config.model=small", "--config.rl.trace_layers=last:5"),
       ["rl.trace_layers='last:5'", "4 layers"]),
      ((*run, "--config.model=small", "--config.model.n_layers=3",
        "--config.rl.trace_layers=last:4"), ["rl.trace_layers='last:4'", "3 layers"]),
      ((*run, "--config.dist.num_processes=2"), ["dist.num_processes=2", "dist.coordinator"]),
      ((*run, "--config.dist.coordinator=host0"), ["dist.coordinator='host0'", "host:port",
                                                    "'auto'"]),
      ((*run, "--config.dist.coordinator=localhost:1", "--config.dist.num_processes=2",
        "--config.dist.process_id=2"), ["dist.process_id=2", "[0, dist.num_processes=2)"]),
      # nothing listens on port 1: the process waits dist.init_timeout_s for process 0
      ((*run, "--config.dist.coordinator=localhost:1", "--config.dist.num_processes=2",
        "--config.dist.process_id=1", "--config.dist.init_timeout_s=1"),
       ["dist.coordinator='localhost:1'", "no coordinator there after 1s", "process 0"]),
  ], extra=[(*MAIN, "--help")])
  assert not workdir.exists()
  assert "--workdir" in helped["stdout"] and "--config" in helped["stdout"], helped


def test_bad_input_of_the_other_entry_points_is_one_line(tmp_path):
  not_a_model = tmp_path / "m"
  not_a_model.mkdir()
  a_file = tmp_path / "file"
  a_file.write_text("")
  one_line_errors([
      ((*MISMATCH, "--config.nope=1"), ["nope", "precisions"]),
      ((*MISMATCH, "--config.model=smal"), ["model='smal'", "small", "qwen3_30b_a3b"]),
      ((*MISMATCH, "--config.precisions=bf16,fp4"), ["precisions='bf16,fp4'", "mxfp4"]),
      ((*MISMATCH, "--config=configs/mismatch.py:slow"), ["'slow'", "quick"]),
      ((*MISMATCH, f"--config.hf_path={not_a_model}"), [str(not_a_model), "config.json"]),
      ((*MISMATCH, f"--config.checkpoint={tmp_path / 'none'}"), [str(tmp_path / "none")]),
      ((*MISMATCH, "--config.mesh.data=2"), ["mesh.data=2", "1 devices"]),
      ((*MISMATCH, "--config.dist.coordinator=auto", "--config.dist.process_id=1"),
       ["dist.coordinator='auto'", "dist.process_id (1)"]),
      ((*HUMANEVAL,), ["--hf_path"]),
      ((*HUMANEVAL, f"--hf_path={not_a_model}"), [str(not_a_model), "config.json"]),
      ((*HUMANEVAL, f"--hf_path={not_a_model}", "--precision=fp4"), ["precision", "mxfp4"]),
      ((*ABLATION, "--families=maths"), ["maths", "long_horizon"]),
      ((*ABLATION, "--seeds=one"), ["--seeds", "'one'"]),
      ((*ABLATION, "--nope"), ["--nope"]),
      ((*ABLATION, f"--out={a_file}"), [str(a_file), "not a directory"]),
      ((*ABLATION, "--jobs=0"), ["--jobs=0", "at least 1"]),
      (("experiments/profile_kernels.py", "--kernels=gate,up"), ["--kernels", "attn"]),
  ])


def test_a_workdir_that_cannot_resume_is_one_line_saying_what_to_do(tmp_path):
  """Checkpoints that cannot continue the run (another config, none readable) stop it before
  any work, as bad input does (one of another layout: tests/rl/test_loop.py)."""
  import jax.numpy as jnp

  from configs import reasoning
  from trace_jax.data.tokenizer import CharTokenizer
  from trace_jax.rl.checkpoint import Checkpointer
  from trace_jax.rl.loop import _config_json
  from trace_jax.rl.validate import make_task

  data = str(tmp_path / "data")
  c = reasoning.get_config("smoke")
  c.data_dir = data
  tokenizer = CharTokenizer(make_task(c.task).alphabet())
  meta = {"step": 1, "tokenizer": tokenizer.to_json(), "config": _config_json(c)}

  def workdir(name):
    ckpt = Checkpointer(str(tmp_path / name))
    ckpt.save(1, {"key": jnp.zeros(2, jnp.uint32)}, meta)
    ckpt.close()
    return str(tmp_path / name)

  corrupted = workdir("corrupted")
  with open(tmp_path / "corrupted" / "checkpoints" / "1" / "meta" / "metadata", "w") as fh:
    fh.write("{")  # cut short
  step = str(tmp_path / "corrupted" / "checkpoints" / "1")
  run = (*MAIN, "--config=configs/reasoning.py:smoke", f"--config.data_dir={data}")
  one_line_errors([
      ((*run, f"--workdir={workdir('other')}", "--config.rl.lr=0.5"),
       ["different config", "rl.lr", "new --workdir"]),
      ((*run, f"--workdir={corrupted}"), ["no checkpoint", "can be read", step, "aside",
                                          "new --workdir"]),
  ])


@pytest.mark.parametrize("name", ["tiny", "small", "qwen3_30b_a3b"])
def test_a_model_preset_by_name_sets_the_model_section(name):
  from configs import reasoning
  from trace_jax.models.config import PRESETS

  c = reasoning.get_config(f"model={name}")
  want = PRESETS[name]()
  shapes = [k for k in c.model if hasattr(want, k)]  # (hf_path, chat_template: not shapes)
  assert shapes and {k: c.model[k] for k in shapes} == {k: getattr(want, k) for k in shapes}
  c = reasoning.get_config(f"model={name},model.n_layers=1")
  assert c.model.n_layers == 1 and c.model.d_model == want.d_model
