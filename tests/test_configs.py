"""Every config file loads, with every named variant; bad variants fail by name."""

import importlib.util
import pathlib

import pytest

CONFIGS = sorted(p for p in pathlib.Path(__file__).parent.parent.glob("configs/*.py")
                 if not p.name.startswith("_"))


def load(path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_there_are_configs():
  assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_with_every_variant(path):
  module = load(path)
  assert module.__doc__ and "python -m" in module.__doc__  # the command is documented
  base = module.get_config()
  for name in getattr(module, "VARIANTS", {}):
    variant = module.get_config(name)
    assert set(variant.keys()) == set(base.keys())
  with pytest.raises(ValueError, match="unknown config variant 'nope'"):
    module.get_config("nope")
  with pytest.raises(ValueError, match="unknown config key 'nope'"):
    module.get_config("nope=1")
  if "rl" in base:  # keys that moved say where to
    with pytest.raises(ValueError, match="'rl.kernels': moved to engine.kernels"):
      module.get_config("rl.kernels=pallas")


def test_ablation_config_is_the_family_config_resized():
  ablation, coding = load(CONFIGS[0].parent / "ablation.py"), load(CONFIGS[0].parent / "coding.py")
  c = ablation.get_config("family=coding,mode=fp4_qat,seed=2")
  base = coding.get_config()
  assert (c.task.family, c.rl.mode, c.seed) == ("coding", "fp4_qat", 2)
  assert (c.model.n_layers, c.rl.trace_layers, c.log.flip_rate_every) == (3, "last:1", 5)
  assert (c.sft.steps, c.rl.steps) == (base.sft.steps, 300)
  assert c.max_prompt_len == base.max_prompt_len  # the family's own values stay
  lh = ablation.get_config("family=long_horizon,mode=trace")
  assert (lh.task.family, lh.sft.steps, lh.rl.steps, lh.seed) == ("long_horizon", 300, 200, 0)
  assert ablation.get_config().task.family == "reasoning"
  # later parts win over the ablation's values: smoke sizes, then any key
  smoke = ablation.get_config("family=long_horizon,smoke,rl.steps=6")
  assert (smoke.sft.steps, smoke.rl.steps, smoke.log.flip_rate_every) == (3, 6, 2)
  with pytest.raises(ValueError, match="unknown ablation family 'chess'.*long_horizon"):
    ablation.get_config("family=chess")


@pytest.mark.parametrize("family", ["reasoning", "coding", "long_horizon"])
def test_the_gpu_variant_is_the_h200_size_and_validates(family):
  from trace_jax.rl.validate import validate
  c = load(CONFIGS[0].parent / f"{family}.py").get_config("gpu,trace_all")
  assert (c.model.n_layers, c.model.d_model, c.model.n_experts) == (12, 512, 16)
  assert (c.rl.mode, c.engine.kernels) == ("trace_all", "xla")
  validate(c, n_devices=1)
