"""The flax modules compute what the model's functions computed before them, bit for bit: the
cases of tests/models/pre_flax_cases.py against the digests stored from the old code."""

import json

import jax
import pytest

from tests.models import pre_flax_cases as cases

with open(cases.DATA) as fh:
  STORED = json.load(fh)


def test_the_digests_cover_every_case():
  assert sorted(STORED["cases"]) == sorted(cases.CASES)


@pytest.mark.slow  # minutes of compiling on 2 cores (gradients through while loops' records)
@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_a_case_computes_its_stored_digest(name):
  if cases.environment() != STORED["environment"]:  # other XLA builds round differently
    pytest.skip(f"digests stored on {STORED['environment']}, this is {cases.environment()}")
  got, want = cases.digest(cases.CASES[name]()), STORED["cases"][name]
  assert sorted(got) == sorted(want), "the outputs' tree changed"
  differ = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
  assert not differ, differ
