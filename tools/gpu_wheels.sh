#!/usr/bin/env bash
# Wheels of the project's dependencies that a GPU machine's own Python lacks, for a machine with no network
# whose image already holds torch, torchvision, tensorboard, timm, numpy, pillow, pyyaml and tqdm (a CUDA
# PyTorch image): the pydantic-settings stack, at the versions constraints.txt pins. Run it where PyPI is
# reachable; tools/gpu_run.sh installs what it finds in the folder into a scratch directory before it starts.
#   bash tools/gpu_wheels.sh [DIR (default .whl)] [PYTHON_VERSION (default 3.12)]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
pyver=${2:-3.12}
# the GPU image lacks these; the rest of the runtime dependencies it has (the train/bench paths import no others)
names="pydantic pydantic-core pydantic-settings annotated-types typing-inspection python-dotenv typing-extensions"
specs=()
for name in $names; do
  pin=$(grep -i -E "^${name}==" constraints.txt || true)
  if [ -z "$pin" ]; then
    echo "gpu_wheels.sh: constraints.txt pins no version of $name; run scripts/lock.sh first" >&2
    exit 2
  fi
  specs+=("$pin")
done
mkdir -p "$dir"
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dir" "${specs[@]}"
ls -la "$dir"
