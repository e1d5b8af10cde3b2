"""The rollout benchmark's variant names (its run on CPU is in test_experiments.py, slow)."""

import pytest

from experiments import bench_rollout


def test_bench_rollout_variant_names():
  parse = bench_rollout.parse_variant
  assert parse("mxfp4:pallas") == ("mxfp4", "pallas", "auto")
  assert parse("nvfp4:triton:mosaic") == ("nvfp4", "triton", "mosaic")
  for bad in ("mxfp4:xla:mosaic", "mxfp4:pallas:flash", "fp8:pallas", "mxfp4:pallas:mosaic:x",
              "mxfp4"):
    with pytest.raises(ValueError, match=f"unknown variant '{bad}'"):
      parse(bad)
