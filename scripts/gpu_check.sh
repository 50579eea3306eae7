#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU: every `gpu`-marked test, group by group, each
# group in its own pytest process (one sticky CUDA error cannot wreck the rest), then the GPU
# benchmarks; one PASS/FAIL line per group and a summary file. Budget: 7 minutes.
#
#   bash scripts/gpu_check.sh
#
# It uses the machine's own Python and torch ($PYTHON, default python3): no virtualenv, no
# torch install, no network. The packages that machine lacks or holds in other versions (the
# gRPC stack with its health/reflection/status parts, transformers at our pin, the HTTP stack,
# pytest, llguidance: about 45 MB) travel in .gpu-wheels/ (git-ignored;
# `bash scripts/fetch_gpu_wheels.sh` fills it where there is a network) and are installed into
# a private temporary folder put first on PYTHONPATH. Point GPU_CHECK_LOG_DIR at what comes
# back from the machine: it holds only logs.
#
# A group FAILS when a file of it cannot be collected, when it collects no test, when a test
# fails, or, on a GPU, when a test is skipped (a GPU test that skips on a GPU did not run).
# Settings: GPU_CHECK_TOTAL_S (default 420), GPU_CHECK_LOG_DIR (default a temp dir),
# GPU_CHECK_ALLOW_NO_GPU=1 runs without a GPU (tests skip; nothing is measured), and
# GPU_CHECK_COLLECT_ONLY=1 only checks that every group collects its tests and the benchmarks
# parse their options: the plumbing check that runs on CPU machines.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
TOTAL_S=${GPU_CHECK_TOTAL_S:-420}
START_S=$(date +%s)
LOG_DIR=${GPU_CHECK_LOG_DIR:-$(mktemp -d -t gpu_check.XXXXXX)}
mkdir -p "$LOG_DIR"
PY=${PYTHON:-python3}
COLLECT_ONLY=${GPU_CHECK_COLLECT_ONLY:-0}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET  # real kernels here, never the interpreter

# name | test files (space-separated)
TEST_GROUPS=(
  "vmm memory backend|tests/unit/test_memory_cuda_backend.py"
  "triton kernels|tests/unit/test_kernels_triton.py tests/gpu/test_kernels_cuda.py"
  "engine parity bf16 fp32|tests/gpu/test_engine_cuda.py tests/unit/test_sampler.py tests/unit/test_sampler_surface.py"
  "sampling masks|tests/unit/test_sampling_mask.py"
  "cuda-ipc transport|tests/e2e/test_grpc_cuda_ipc.py"
  "sleep-wake device memory|tests/gpu/test_sleep_wake_cuda.py"
  "cuda-graph parity|tests/gpu/test_cuda_graphs.py"
  "async scheduling|tests/gpu/test_async_scheduling_cuda.py"
  "structured outputs|tests/gpu/test_structured_outputs_cuda.py"
  "kv transfer|tests/gpu/test_kv_transfer_cuda.py"
  "lora|tests/gpu/test_lora_cuda.py"
  "moe experts|tests/gpu/test_moe_cuda.py"
  "routed experts|tests/gpu/test_routed_experts_cuda.py tests/gpu/test_routing_replay_cuda.py"
  "batch invariance|tests/gpu/test_batch_invariant_cuda.py"
)

SUMMARY=()
FAILED=0
elapsed() { echo $(( $(date +%s) - START_S )); }

budget() {  # the smaller of a step's own budget and what is left of the total
  local want=$1 left=$(( TOTAL_S - $(elapsed) - 10 ))
  (( left < want )) && want=$left
  (( want < 5 )) && want=5
  echo "$want"
}

record() {  # record NAME STATUS DETAIL
  local line
  line=$(printf '%-4s %-28s %4ss  %s' "$2" "$1" "$3" "$4")
  SUMMARY+=("$line")
  [[ $2 == PASS ]] || FAILED=1
}

carry_wheels() {
  shopt -s nullglob
  local wheels=("$ROOT"/.gpu-wheels/*.whl)
  shopt -u nullglob
  if (( ${#wheels[@]} == 0 )); then
    echo "no carried wheels in .gpu-wheels/: using the packages $PY has"
    return
  fi
  # Not under LOG_DIR: the logs are what a caller copies back, the packages are not.
  local site
  site=$(mktemp -d -t gpu_check_site.XXXXXX)
  echo "installing ${#wheels[@]} carried wheels into $site (no index, no deps)"
  "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check \
    --target "$site" "${wheels[@]}" || echo "WARNING: installing the carried wheels failed"
  export PYTHONPATH="$site:$PYTHONPATH"
}

run_group() {  # run_group NAME FILES
  local name=$1 files=$2 log limit t0 rc result
  log="$LOG_DIR/$(echo "$name" | tr -c 'A-Za-z0-9\n' '_').log"
  limit=$(budget 150)
  t0=$(date +%s)
  echo
  echo "=== $name: $files (limit ${limit}s) ==="
  local args=(-m gpu -q -p no:cacheprovider -o addopts= -rfEs)
  (( COLLECT_ONLY )) && args+=(--collect-only)
  # shellcheck disable=SC2086
  timeout --kill-after=10 "$limit" "$PY" -m pytest "${args[@]}" $files 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  result=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|selected|tests? collected)" "$log" \
    | tail -n 1 | tr -d '=')
  local status=PASS
  if (( rc == 124 || rc == 137 )); then status=FAIL; result="timeout after ${limit}s"
  elif (( rc == 5 )); then status=FAIL; result="no gpu test collected"
  elif (( rc != 0 )); then status=FAIL
  elif grep -qE "^ERROR |errors? during collection" "$log"; then status=FAIL
  elif [[ -n $HAS_GPU ]] && (( ! COLLECT_ONLY )) && grep -qE "[0-9]+ skipped" "$log"; then
    status=FAIL; result="$result (a GPU test skipped on a GPU: see $log)"
  fi
  record "$name" "$status" "$(( $(date +%s) - t0 ))" "$result"
}

census() {  # every gpu-marked test file must belong to a group
  local grouped listed missing=()
  grouped=$(printf '%s\n' "${TEST_GROUPS[@]}" | cut -d'|' -f2 | tr ' ' '\n' | sort -u)
  listed=$("$PY" -m pytest tests -m gpu --collect-only -q -p no:cacheprovider -o addopts= \
    --continue-on-collection-errors 2>/dev/null | grep "::" | cut -d: -f1 | sort -u)
  for file in $listed; do
    grep -qx "$file" <<<"$grouped" || missing+=("$file")
  done
  if (( ${#missing[@]} )); then
    record "census of gpu tests" FAIL 0 "in no group: ${missing[*]}"
  else
    record "census of gpu tests" PASS 0 "$(wc -l <<<"$listed") files, all grouped"
  fi
}

run_bench() {  # run_bench NAME LIMIT COMMAND...
  local name=$1 limit t0 rc log
  limit=$(budget "$2")
  shift 2
  log="$LOG_DIR/bench_$(echo "$name" | tr -c 'A-Za-z0-9\n' '_').log"
  t0=$(date +%s)
  echo
  echo "=== bench $name (limit ${limit}s) ==="
  if (( COLLECT_ONLY )); then
    "$PY" "$@" --help >"$log" 2>&1
    rc=$?
  else
    timeout --kill-after=10 "$limit" "$PY" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  fi
  if (( rc == 0 )); then
    record "bench $name" PASS "$(( $(date +%s) - t0 ))" "$(tail -n 1 "$log")"
  else
    record "bench $name" FAIL "$(( $(date +%s) - t0 ))" "exit $rc, see $log"
  fi
}

echo "gpu_check: logs in $LOG_DIR, total budget ${TOTAL_S}s, python $PY"
HAS_GPU=$(nvidia-smi -L 2>/dev/null | grep -m 1 "^GPU")
if [[ -z $HAS_GPU ]]; then
  echo "no NVIDIA GPU visible (nvidia-smi -L lists none): this check needs one."
  [[ ${GPU_CHECK_ALLOW_NO_GPU:-0} == 1 || $COLLECT_ONLY == 1 ]] || exit 2
  echo "running anyway: GPU tests will skip and nothing is measured"
fi
carry_wheels
"$PY" - <<'EOF' 2>&1 | tee "$LOG_DIR/environment.txt"
import importlib
for name in ("torch", "triton", "transformers", "grpc", "google.protobuf", "cupy",
             "cuda.bindings", "grpc_health", "grpc_reflection", "grpc_status"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', 'ok')}", end="; ")
    except Exception as exc:
        print(f"{name} MISSING ({type(exc).__name__})", end="; ")
import torch
print(f"\ntorch CUDA {torch.version.cuda}, GPU: "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
EOF

census
for group in "${TEST_GROUPS[@]}"; do
  run_group "${group%%|*}" "${group#*|}"
done
run_bench kernels 60 -m benchmarks.kernels --quick
run_bench rollout_throughput 150 -m benchmarks.rollout_throughput --device cuda --size 0.5b \
  --skip generate_batch --cuda-graphs --async-scheduling
run_bench async_scheduling 60 -m benchmarks.async_scheduling --device cuda --size 0.5b \
  --batch-sizes 16 64 --repeats 1
run_bench host_overhead 40 -m benchmarks.host_overhead --device cuda --repeats 50
run_bench sleep_wake 60 -m benchmarks.sleep_wake --device cuda --size 0.5b --kv-cache-mib 4096 \
  --repeats 3 --threads 4
run_bench batch_invariant 120 -m benchmarks.batch_invariant --device cuda --size 0.5b \
  --num-prompts 16 --long-tokens 1024 --trainer-rows 8 --repeats 10
# benchmarks.spec_decode is left out: its copy model trains on the CPU first (minutes).

{
  echo "gpu_check summary ($(elapsed)s of ${TOTAL_S}s), logs in $LOG_DIR"
  cat "$LOG_DIR/environment.txt"
  printf '%s\n' "${SUMMARY[@]}"
} | tee "$LOG_DIR/summary.txt"
if (( FAILED )); then echo "RESULT: FAILED"; exit 1; fi
if [[ -z $HAS_GPU ]]; then echo "RESULT: dry run without a GPU (nothing measured)"; exit 0; fi
echo "RESULT: PASS"
