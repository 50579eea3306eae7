"""Typed exceptions raised at the engine's API edge; `server.py` maps them to gRPC codes."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """The request itself is wrong (prompt, sampling parameters); fix the input and resend."""


class ModelLoadError(EngineError, ValueError):
    """The model directory is missing, unreadable, or holds an unsupported architecture."""


class EngineSleepingError(EngineError, RuntimeError):
    """Weights or KV cache are not awake; call `wake_up(...)` (and load weights) first."""


class OutOfBlocksError(EngineError, RuntimeError):
    """The KV pool is too small for a request even when it runs alone."""


class WeightUpdateError(EngineError, ValueError):
    """A weight update was refused (unknown name, wrong shape or dtype) or cut off."""
