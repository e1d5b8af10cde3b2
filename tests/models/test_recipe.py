"""Recipes as config values: parsed from one string, per site and layer range, over the format
registry (a format registered by a user runs through the probe and RL like a built-in one)."""

import pytest

from trace_jax.models.recipe import QuantRecipe, precisions
from trace_jax.quant import FORMATS, MXFP4, NVFP4_TENSOR, register
from trace_jax.quant.formats import MXFP4Format


def test_parse_gives_the_recipe_the_fields_give():
  assert QuantRecipe.parse("mxfp4") == QuantRecipe.uniform("mxfp4")
  assert QuantRecipe.parse("weights=nvfp4, acts=mxfp4, kv=mxfp4, layers=last:2") == \
      QuantRecipe("nvfp4", "mxfp4", "mxfp4", "last:2")
  assert QuantRecipe.parse("bf16") == QuantRecipe()


def test_overrides_by_site_and_layer_range():
  r = QuantRecipe.parse("mxfp4; layers=last:1,moe_mid=fp8,kv=bf16; layers=0,weights=nvfp4")
  n = 3
  assert [r.site_format("moe_mid", i, n).name for i in range(n)] == ["mxfp4", "mxfp4", "fp8"]
  assert [r.site_format("attn_in", i, n).name for i in range(n)] == ["mxfp4"] * 3
  assert [r.site_format("k", i, n).name for i in range(n)] == ["mxfp4", "mxfp4", "bf16"]
  # NVFP4 weights are stored with one global per matrix (the format's `for_weights`)
  assert r.weight_format(0, n) == NVFP4_TENSOR and r.weight_format(1, n) == MXFP4
  # a site named in the base rule: at the base's layers
  s = QuantRecipe.parse("weights=mxfp4,acts=mxfp4,kv=mxfp4,k=fp8,layers=last:1")
  assert [s.site_format("k", i, 2).name for i in range(2)] == ["bf16", "fp8"]


@pytest.mark.parametrize("rule", ["moe_mid=fp8,acts=nvfp4", "acts=nvfp4,moe_mid=fp8",
                                  "moe_mid=fp8,nvfp4", "nvfp4,moe_mid=fp8",
                                  "acts=nvfp4,fp8,moe_mid=fp8", "moe_mid=fp8,bf16,acts=nvfp4"])
def test_within_a_rule_a_site_beats_its_group_beats_a_bare_format_in_any_order(rule):
  r = QuantRecipe.parse(f"mxfp4; {rule}")
  assert r.site_format("moe_mid", 0, 1).name == "fp8"
  assert r.site_format("attn_in", 0, 1).name == "nvfp4"
  # a later rule beats an earlier one, whatever it names
  later = QuantRecipe.parse(f"mxfp4; {rule}; acts=mxfp4")
  assert later.site_format("moe_mid", 0, 1).name == "mxfp4"


def test_format_names_are_stored_lowercase():
  assert QuantRecipe.parse("MXFP4; layers=0,moe_mid=FP8") == QuantRecipe.parse(
      "mxfp4; layers=0,moe_mid=fp8")


@pytest.mark.parametrize("spec,message", [
    ("mxfp5", "unknown format 'mxfp5'; choose one of"),
    ("weights=mxfp4,bias=fp8", "unknown key 'bias'"),
    ("mxfp4;", "rules separated by ';'"),
    ("", "rules separated by ';'"),
])
def test_bad_specs_name_what_is_wrong(spec, message):
  with pytest.raises(ValueError, match=message):
    QuantRecipe.parse(spec)


def test_layer_ranges_checked_against_the_model():
  r = QuantRecipe.parse("mxfp4; layers=last:5,moe_mid=fp8")
  with pytest.raises(ValueError, match="N must be in"):
    r.check(n_layers=2)


def test_choices_come_from_the_registry():
  name = "mxfp4_recipe_test"
  assert name not in precisions()
  fmt = register(MXFP4Format(name=name, block_size=16))
  try:
    assert name in precisions()
    assert QuantRecipe.parse(name).site_format("attn_in", 0, 1) is fmt
  finally:
    del FORMATS[name]
