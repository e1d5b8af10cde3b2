#!/usr/bin/env bash
# Regenerates constraints/py3XX.txt from pyproject.toml's dependencies, every extra, and the pins
# in constraints/py3XX.in (jax, and torch's CPU build), with uv's resolver (`pip install uv`).
# torch's CPU builds come from TORCH_CPU_WHEELS: a folder or page of wheels, by default PyTorch's
# CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${TORCH_CPU_WHEELS:-https://download.pytorch.org/whl/cpu/torch/}
for pins in constraints/py3*.in; do
  version=$(basename "$pins" .in)  # py311 -> 3.11
  version=${version:2:1}.${version:3}
  uv --no-python-downloads pip compile pyproject.toml --all-extras --python-version "$version" \
    --find-links "$wheels" -c "$pins" --custom-compile-command constraints/compile.sh --quiet \
    -o "${pins%.in}.txt"
  echo "wrote ${pins%.in}.txt (Python $version)"
done
