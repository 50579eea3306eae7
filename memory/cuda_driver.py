"""Lazy access to the CUDA driver API (cuda-bindings) with every CUresult checked."""

import functools
from types import ModuleType
from typing import Any

from memory.errors import BackendUnavailableError, CudaDriverError

_INSTALL_HINT = (
    "the CUDA memory backend needs cuda-bindings: `pip install 'cuda-bindings>=12.6'` "
    "(or install this project with its [gpu] extra)"
)


@functools.cache
def load_driver() -> ModuleType:
    """The driver module: `cuda.bindings.driver`, or `cuda.cuda` from older releases."""
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError as error:
            raise BackendUnavailableError(_INSTALL_HINT) from error
    return driver


def error_name(driver: ModuleType, result: Any) -> str:
    """The CUresult's name, e.g. 'CUDA_ERROR_OUT_OF_MEMORY'."""
    status, name = driver.cuGetErrorName(result)
    if status != driver.CUresult.CUDA_SUCCESS or not name:
        return f"CUresult({int(result)})"
    return name.decode() if isinstance(name, bytes) else str(name)


def call(name: str, *args: Any, detail: str = "") -> Any:
    """Call driver function `name`; raise CudaDriverError unless it returns CUDA_SUCCESS.

    Returns None for calls with no outputs, the output for one, a tuple for several.
    """
    driver = load_driver()
    result, *outputs = getattr(driver, name)(*args)
    if result != driver.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(name, error_name(driver, result), detail)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else tuple(outputs)
