#!/usr/bin/env bash
# Fill .gpu-wheels/ (git-ignored) with the pure-Python and binary wheels the GPU machine lacks,
# for its Python 3.12 on x86_64: gpu_check.sh installs them there without a network.
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .gpu-wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_31_x86_64 --implementation cp \
  -d .gpu-wheels \
  "grpcio==$(version grpcio)" "grpcio-health-checking==$(version grpcio-health-checking)" \
  "grpcio-reflection==$(version grpcio-reflection)" "grpcio-status==$(version grpcio-status)" \
  "protobuf==$(version protobuf)" "googleapis-common-protos==$(version googleapis-common-protos)" \
  "pytest-timeout==$(version pytest-timeout)" "llguidance==$(version llguidance)"
ls -la .gpu-wheels
