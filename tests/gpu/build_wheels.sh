#!/usr/bin/env bash
# Wheels for a GPU machine that has torch (CUDA), transformers and numpy but not DeepSpeed (the device machine of
# tests/gpu/README.md): DeepSpeed as a pure-Python wheel (DS_BUILD_OPS=0: no compiled ops; the check uses none) and
# the packages it and launcher/config.py import that such a machine may lack, for its Python (default 3.12) on
# Linux x86-64. Run here, with network; carry tests/gpu/wheels/ (about 7 MB, git-ignored) to the GPU machine, where
# check_training.py unpacks them into a temporary directory by itself when `import deepspeed` would fail.
#   bash tests/gpu/build_wheels.sh [PYTHON_VERSION]
# Versions: those of envs/cpu.lock.txt.
set -euo pipefail
cd "$(dirname "$0")"
PY_VERSION="${1:-3.12}"
ABI="cp${PY_VERSION/./}"
PIP="${PIP:-../../.venv/bin/pip}"
rm -rf wheels && mkdir wheels
export PIP_DISABLE_PIP_VERSION_CHECK=1
# --no-build-isolation: DeepSpeed's setup.py imports torch; the project's venv has it.
DS_BUILD_OPS=0 "$PIP" wheel --quiet --no-deps --no-build-isolation deepspeed==0.19.8 -w wheels
"$PIP" download --quiet --no-deps --only-binary :all: --python-version "$PY_VERSION" --implementation cp \
  --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d wheels \
  hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 py-cpuinfo==9.0.0 einops==0.8.2 psutil==7.2.2 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 \
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 attrs==26.1.0
ls wheels
du -sh wheels
