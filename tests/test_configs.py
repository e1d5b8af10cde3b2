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
