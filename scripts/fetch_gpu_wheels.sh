#!/usr/bin/env bash
# Fill .gpu-wheels/ (git-ignored) with the wheels the GPU machine may lack or hold in other
# versions, for its Python 3.12 on x86_64: gpu_check.sh installs them there without a network,
# ahead of the machine's own packages. What is carried: the closure of the runtime and test
# packages the GPU checks import (transformers, the gRPC stack, the HTTP stack, pytest,
# llguidance, ...), at the versions of this checkout's .venv, minus what the GPU machine
# brings built for its CUDA (torch, triton, numpy, cupy).
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mapfile -t PINS < <("$PY" - <<'PYEOF'
import importlib.metadata as metadata
import re

ROOTS = ("transformers tokenizers safetensors tqdm jinja2 grpcio grpcio-health-checking "
         "grpcio-reflection grpcio-status protobuf llguidance fastapi uvicorn prometheus-client "
         "psutil pytest pytest-timeout").split()
MACHINE_OWN = {"torch", "triton", "numpy", "cupy-cuda13x"}
SKIPPED_MARKERS = ('python_version < "3.1', 'sys_platform == "win32"',
                   'platform_system == "Windows"', "extra ==")
pins, todo = {}, list(ROOTS)
while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in pins or name in MACHINE_OWN:
        continue
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue  # an optional dependency this venv does not have either
    pins[name] = dist.version
    for requirement in dist.requires or []:
        if any(marker in requirement for marker in SKIPPED_MARKERS):
            continue
        todo.append(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0))
for name, version in sorted(pins.items()):
    print(f"{name}=={version}")
PYEOF
)
echo "carrying ${#PINS[@]} packages: ${PINS[*]}"
mkdir -p .gpu-wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux_2_12_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --implementation cp \
  -d .gpu-wheels "${PINS[@]}"
du -sh .gpu-wheels
