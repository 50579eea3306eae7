#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: set up what is missing, run every
# `gpu`-marked test and the GPU benchmarks, and print a summary, all within 8 minutes.
#
#   bash scripts/gpu_check.sh
#
# Python: $PYTHON (default python3) is used as it is when it already has a CUDA build of
# torch and every package the checks need (no network used). Otherwise a virtualenv
# ($GPU_CHECK_VENV, default .venv-gpu) is made on top of it (--system-site-packages, so
# a preinstalled CUDA torch is reused) and only the missing packages are installed; an
# install that fails (no network, say) is reported and the checks run anyway.
# Other settings: GPU_CHECK_TOTAL_S (default 480), GPU_CHECK_LOG_DIR (default a temp dir),
# TORCH_SPEC (default torch==2.13.0; PyPI's Linux wheels of torch are CUDA builds),
# GPU_CHECK_ALLOW_NO_GPU=1 (run the steps without a GPU, installing nothing: a dry run).
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
TOTAL_S=${GPU_CHECK_TOTAL_S:-480}
START_S=$(date +%s)
LOG_DIR=${GPU_CHECK_LOG_DIR:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PIP=(-m pip install --disable-pip-version-check --retries 0 --timeout 15 -q)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET  # real kernels here, never the interpreter

SUMMARY=()
NOTES=()
FAILED=0

elapsed() { echo $(( $(date +%s) - START_S )); }

# The smaller of a step's own budget and what is left of the total (less a reserve).
budget() {
  local want=$1 left=$(( TOTAL_S - $(elapsed) - ${2:-10} ))
  (( left < want )) && want=$left
  (( want < 5 )) && want=5
  echo "$want"
}

# Last line of a log that reads like a pytest result ("3 passed, 1 skipped in 2.0s").
result_line() {
  grep -E "[0-9]+ (passed|failed|error|errors|skipped|deselected)" "$1" | tail -n 1 | tr -d '='
}

# True when pytest failed only because some files could not be collected (an import error
# in a file of CPU tests must not hide the GPU results), not because a test failed.
only_collection_errors() {
  ! grep -qE "^(FAILED |ERROR [^ ]*::)" "$1" && ! result_line "$1" | grep -q failed \
    && grep -qE "^ERROR [^ ]+( - |$)" "$1"
}

# run_step NAME BUDGET_S COMMAND...: runs under `timeout`, logs, records a summary row.
run_step() {
  local name=$1 limit rc status t0 log
  limit=$(budget "$2")
  shift 2
  log="$LOG_DIR/${name//[^A-Za-z0-9]/_}.log"
  t0=$(date +%s)
  echo
  echo "=== $name (limit ${limit}s) ==="
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  if [[ $rc == 1 && $name == pytest* ]] && only_collection_errors "$log"; then
    rc=0
    NOTES+=("some test files could not be imported (missing packages?); their tests did not run: see $log")
  fi
  case $rc in
    0) status=ok ;;
    124|137) status="TIMEOUT (${limit}s)"; FAILED=1 ;;
    *) status="FAILED (exit $rc)"; FAILED=1 ;;
  esac
  SUMMARY+=("$(printf '%-26s %-18s %4ss  %s' "$name" "$status" "$(( $(date +%s) - t0 ))" \
    "$(result_line "$log")")")
}

# Prints "cuda=<0|1> missing=<pip names>" for a Python interpreter.
probe() {
  "$1" - <<'EOF' 2>/dev/null || echo "cuda=0 missing=python-broken"
import importlib.util
def has(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
cuda, cuda_major = 0, "12"
try:
    import torch
    cuda = int(torch.cuda.is_available())
    cuda_major = (torch.version.cuda or "12").split(".")[0]
except Exception:
    pass
needed = {"torch": "torch", "triton": "triton", "transformers": "transformers",
          "tokenizers": "tokenizers", "safetensors": "safetensors", "numpy": "numpy",
          "tqdm": "tqdm", "pytest": "pytest", "pytest_timeout": "pytest-timeout",
          "cuda.bindings": "cuda-bindings", "cupy": f"cupy-cuda{cuda_major}x"}
missing = [pkg for module, pkg in needed.items() if not has(module)]
print(f"cuda={cuda} missing={','.join(missing)}")
EOF
}

setup() {
  local state missing
  state=$(probe "$PY")
  echo "$PY: $state"
  if [[ $state == "cuda=1 missing=" ]]; then
    echo "using $PY as it is"
    return 0
  fi
  if [[ -z $HAS_GPU ]]; then
    NOTES+=("no NVIDIA GPU: nothing installed (missing: ${state#*missing=})")
    return 0
  fi
  if [[ ! -x $VENV/bin/python ]]; then
    echo "creating $VENV (--system-site-packages) from $PY"
    "$PY" -m venv --system-site-packages "$VENV" || { echo "cannot create $VENV"; return 1; }
    # When $PY is itself a virtualenv, --system-site-packages reaches only the base
    # interpreter's packages: point the new venv at $PY's own too.
    "$PY" -c "import site; print('\n'.join(site.getsitepackages()))" \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/parent.pth"
  fi
  PY=$VENV/bin/python
  state=$(probe "$PY")
  echo "$PY: $state"
  if [[ $state == cuda=0* ]]; then
    echo "torch here has no CUDA: installing $TORCH_SPEC (a CUDA build from PyPI)"
    timeout "$(budget 240 300)" "$PY" "${PIP[@]}" "$TORCH_SPEC" || echo "WARNING: could not install $TORCH_SPEC; GPU tests will skip"
    state=$(probe "$PY")
  fi
  missing=${state#*missing=}
  if [[ -n $missing ]]; then
    echo "installing the missing packages: ${missing//,/ }"
    for pkg in ${missing//,/ }; do
      [[ $pkg == torch ]] && continue  # tried above
      timeout "$(budget 90 300)" "$PY" "${PIP[@]}" "$pkg" || echo "WARNING: could not install $pkg (no network?); continuing"
    done
  fi
  state=$(probe "$PY")
  echo "$PY: $state"
  [[ ${state#*missing=} == "" ]] || NOTES+=("still missing: ${state#*missing=} (tests needing them skip or fail)")
  if [[ $state != cuda=1* ]]; then
    NOTES+=("torch.cuda.is_available() is False although nvidia-smi sees a GPU: nothing ran on it")
    FAILED=1
  fi
}

environment() {
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv,noheader
  "$PY" - <<'EOF'
import importlib
for name in ("torch", "triton", "transformers", "cupy", "cuda.bindings"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}", end="; ")
    except Exception as exc:
        print(f"{name} unavailable ({type(exc).__name__})", end="; ")
import torch
print(f"torch CUDA {torch.version.cuda}, GPU: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF
}

# Runs benchmarks/NAME.py on the GPU when it has a --device option (--quick if offered).
gpu_benchmarks() {
  local file args
  for file in benchmarks/*.py; do
    [[ $file == benchmarks/kernels.py ]] && continue
    grep -q -- '"--device"' "$file" || continue
    args=(--device cuda)
    grep -q -- '"--quick"' "$file" && args+=(--quick)
    run_step "bench $(basename "$file" .py)" 120 "$PY" "$file" "${args[@]}"
  done
}

echo "gpu_check: logs in $LOG_DIR, total budget ${TOTAL_S}s"
HAS_GPU=$(nvidia-smi -L 2>/dev/null | grep -m 1 "^GPU")
if [[ -z $HAS_GPU ]]; then
  echo "no NVIDIA GPU visible (nvidia-smi -L lists none): this check needs one."
  [[ ${GPU_CHECK_ALLOW_NO_GPU:-0} == 1 ]] || exit 2
  echo "GPU_CHECK_ALLOW_NO_GPU=1: running the steps anyway (GPU tests will skip)"
fi
echo
echo "=== setup ==="
t0=$(date +%s)
setup > >(tee "$LOG_DIR/setup.log") 2>&1  # in this shell: it may switch $PY to the venv
SUMMARY+=("$(printf '%-26s %-18s %4ss  %s' setup done "$(( $(date +%s) - t0 ))" "python: $PY")")
ENVIRONMENT=$(environment 2>&1)
echo "$ENVIRONMENT"

PER_TEST_TIMEOUT=()
"$PY" -c "import pytest_timeout" 2>/dev/null && PER_TEST_TIMEOUT=(--timeout=240)
run_step "pytest -m gpu" 270 "$PY" -m pytest -m gpu tests -q -p no:cacheprovider \
  --continue-on-collection-errors -o addopts=-ra "${PER_TEST_TIMEOUT[@]}"
run_step "bench kernels" 100 "$PY" benchmarks/kernels.py
gpu_benchmarks

echo
echo "================ gpu_check summary ($(elapsed)s of ${TOTAL_S}s) ================"
echo "$ENVIRONMENT"
printf '%s\n' "${SUMMARY[@]}"
for note in "${NOTES[@]}"; do echo "note: $note"; done
grep -h -E "^(FAILED|ERROR) " "$LOG_DIR"/pytest*.log 2>/dev/null | head -n 30
echo "logs: $LOG_DIR"
if (( FAILED )); then echo "RESULT: FAILED"; exit 1; fi
if [[ -z $HAS_GPU ]]; then echo "RESULT: dry run without a GPU (nothing measured)"; exit 0; fi
echo "RESULT: ok"
