"""CUDA backend: lazy import and clear errors everywhere; measured scenarios on a GPU."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from memory import BackendUnavailableError, CudaDriverError, MemoryManager, cuda_driver
from tests.memory_growth import leak_bytes, max_leak_bytes

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("memory_scenarios.py")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_python(args: list[str]) -> subprocess.CompletedProcess[str]:
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": python_path},
    )


def run_scenario(name: str, device: str) -> dict[str, Any]:
    completed = run_python([str(SCENARIOS), name, device])
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


# -- CPU-runnable ----------------------------------------------------------------------------

WITHOUT_CUDA_BINDINGS = textwrap.dedent("""
    import sys

    class BlockCudaPackages:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("cuda", "cupy"):
                raise ImportError(f"{name} is blocked")
            return None

    sys.meta_path.insert(0, BlockCudaPackages())
    import memory.cuda_backend
    from memory import BackendUnavailableError, MemoryManager
    from memory.cuda_driver import load_driver
    assert "cuda" not in sys.modules
    try:
        load_driver()
    except BackendUnavailableError as error:
        print(error)
    with MemoryManager("cpu") as manager:
        manager.create_pool("weights", 4096)
    print("cpu ok")
""")


def test_cuda_backend_imports_without_cuda_bindings() -> None:
    completed = run_python(["-c", WITHOUT_CUDA_BINDINGS])
    assert completed.returncode == 0, completed.stderr
    hint, cpu_ok = completed.stdout.strip().splitlines()
    assert "needs cuda-bindings" in hint and "pip install" in hint
    assert cpu_ok == "cpu ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_selecting_cuda_without_cuda_says_so() -> None:
    with pytest.raises(BackendUnavailableError, match=r"torch.cuda.is_available\(\) is False"):
        MemoryManager("cuda")
    with pytest.raises(BackendUnavailableError, match="device='cpu'"):
        MemoryManager(torch.device("cuda", 0))


def test_unsupported_device_type_says_which_are_supported() -> None:
    with pytest.raises(BackendUnavailableError, match="use 'cpu' or 'cuda'"):
        MemoryManager("meta")


def test_driver_errors_carry_the_call_and_error_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUresult check, against a stand-in for the driver module (no GPU here)."""
    success, out_of_memory = 0, 2
    names = {out_of_memory: b"CUDA_ERROR_OUT_OF_MEMORY"}
    stand_in = SimpleNamespace(
        CUresult=SimpleNamespace(CUDA_SUCCESS=success),
        cuGetErrorName=lambda result: (success, names[result]),
        cuMemCreate=lambda *args: (out_of_memory, None),
        cuMemAddressReserve=lambda *args: (success, 1 << 40),
        cuMemMap=lambda *args: (success,),
        cuMemGetInfo=lambda: (success, 1, 2),
    )
    monkeypatch.setattr(cuda_driver, "load_driver", lambda: stand_in)
    with pytest.raises(CudaDriverError) as info:
        cuda_driver.call("cuMemCreate", 1 << 21, None, 0, detail="allocating 2097152 bytes")
    assert info.value.error_name == "CUDA_ERROR_OUT_OF_MEMORY" and info.value.call == "cuMemCreate"
    assert str(info.value) == (
        "cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY: allocating 2097152 bytes"
    )
    assert cuda_driver.call("cuMemAddressReserve", 1 << 21, 0, 0, 0) == 1 << 40
    assert cuda_driver.call("cuMemMap", 0, 0, 0, 0, 0) is None
    assert cuda_driver.call("cuMemGetInfo") == (1, 2)


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_gpu_discard_releases_device_memory_at_a_stable_address() -> None:
    result = run_scenario("discard", "cuda")
    num_bytes = result["num_bytes"]
    assert result["used_touched"] - result["used_released"] >= 0.95 * num_bytes, result
    assert result["used_woken"] - result["used_released"] >= 0.95 * num_bytes, result
    assert result["same_ptr"] and result["retouched_ok"], result


@pytest.mark.gpu
@needs_gpu
def test_gpu_offload_restores_exact_bytes() -> None:
    result = run_scenario("offload", "cuda")
    num_bytes = result["num_bytes"]
    assert result["is_exact"] and result["same_ptr"], result
    assert result["used_touched"] - result["used_offloaded"] >= 0.95 * num_bytes, result
    assert result["used_discarded"] - result["used_base"] < 0.05 * num_bytes, result


@pytest.mark.gpu
@needs_gpu
def test_gpu_500_cycles_do_not_grow_host_or_device_memory() -> None:
    result = run_scenario("cycles", "cuda")
    assert result["num_ok"] == result["num_cycles"] == 500 and result["same_ptr"], result
    # Judged on both halves of the run, as on CPU (tests/memory_growth.py); device memory is
    # mapped 2 MiB at a time, so a leaked mapping grows a half by far more than 1% of the pool.
    assert leak_bytes(result["private_rss_bytes"]) < max_leak_bytes(500), result
    assert leak_bytes(result["used_bytes"]) < 0.01 * result["num_bytes"], result


@pytest.mark.gpu
@needs_gpu
def test_gpu_kernels_and_graphs_survive_sleep_and_wake() -> None:
    result = run_scenario("cuda_kernels", "cuda")
    assert result["after_offload"] == 2.0 * result["num_elements"], result
    assert result["after_discard"] == 6.0 * result["num_elements"], result
