"""Which dtype `dtype="auto"` runs a checkpoint in: the checkpoint's on a GPU; on the CPU its
bfloat16 only where the CPU computes in bfloat16 (vLLM's CPU default), float32 otherwise."""

import pytest
import torch
from transformers import LlamaConfig

from rollout_engine.worker.weights import loader
from rollout_engine.worker.weights.loader import cpu_computes_bf16, resolve_dtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def checkpoint(dtype: str | None) -> LlamaConfig:
    config = LlamaConfig()
    config.dtype = dtype
    return config


def test_a_bf16_checkpoint_runs_in_bf16_on_a_cpu_only_where_the_cpu_computes_in_it(
        bf16_arithmetic, caplog):
    assert cpu_computes_bf16() is bf16_arithmetic
    with caplog.at_level("INFO", logger=loader.__name__):
        chosen = resolve_dtype("auto", checkpoint("bfloat16"), CPU)
    assert chosen == (torch.bfloat16 if bf16_arithmetic else torch.float32)
    assert ("no bfloat16 arithmetic" in caplog.text) is not bf16_arithmetic


@pytest.mark.parametrize("dtype", ["float32", "float16", None])
def test_other_checkpoints_run_in_float32_on_the_cpu(bf16_arithmetic, dtype):
    assert resolve_dtype("auto", checkpoint(dtype), CPU) == torch.float32


def test_an_explicit_dtype_and_a_gpu_take_what_they_are_given(bf16_arithmetic):
    assert resolve_dtype("float32", checkpoint("bfloat16"), CPU) == torch.float32
    assert resolve_dtype("bfloat16", checkpoint("float32"), CPU) == torch.bfloat16
    assert resolve_dtype("auto", checkpoint("float16"), CUDA) == torch.float16
    assert resolve_dtype("auto", checkpoint(None), CUDA) == torch.bfloat16


def test_the_probe_answers_for_this_machine():
    """The real probe (no patch): a bool, true exactly when the CPU lists avx512_bf16."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    assert cpu_computes_bf16() is ("avx512_bf16" in flags)
