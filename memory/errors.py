"""Typed exceptions of the memory package; the engine translates them at its own API edge."""


class MemoryStateError(RuntimeError):
    """An unknown tag, or a transition the tag's current state does not allow."""


class UnknownTagError(MemoryStateError, KeyError):
    """No pool has this tag; also a KeyError so that mapping-style callers can catch it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PoolCapacityError(RuntimeError):
    """An allocation does not fit in what is left of a pool's fixed capacity."""


class BackendUnavailableError(RuntimeError):
    """The memory backend for the asked device cannot be used on this machine."""


class CudaDriverError(RuntimeError):
    """A CUDA driver call returned an error; `error_name` holds its CUresult name."""

    def __init__(self, call: str, error_name: str, detail: str = "") -> None:
        self.call = call
        self.error_name = error_name
        message = f"{call} failed with {error_name}"
        super().__init__(f"{message}: {detail}" if detail else message)
