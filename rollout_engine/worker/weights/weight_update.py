"""Weight updates: a manifest validated whole before a byte is written, then a write session.

Names are the model's parameter names as `model.named_parameters()` gives them (the Hugging
Face checkpoint names). Dtypes must equal the parameter's dtype exactly: a cast would hide a
trainer that sends bf16 to an fp32 engine (or the reverse), so it is refused instead. With
tied embeddings `lm_head.weight` is the same tensor as the input embedding (e.g.
`model.embed_tokens.weight`): it is accepted and written there, or ignored (still checked) when
the manifest names both.

Under tensor parallelism every rank receives the full checkpoint-shaped tensor and keeps its
shard (`ShardSpec`); manifests are checked against the full shapes.
"""

from __future__ import annotations

import hashlib
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from memory import MemoryEventLog
from rollout_engine.protocol import WeightUpdateError
from rollout_engine.worker.engine_memory import EngineMemory
from rollout_engine.worker.models.tp_sharding import ShardSpec
from rollout_engine.worker.weights.checkpoint import tied_aliases

ManifestEntry = tuple[str, tuple[int, ...], torch.dtype]
"""(name, shape, dtype) of one tensor an update will send."""
NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]

_MAX_NAMES_SHOWN = 8


@dataclass(frozen=True)
class _Target:
    """Where one manifest entry goes; `param` is None for an ignored tied alias."""

    shape: tuple[int, ...]
    """The full (checkpoint) shape."""
    dtype: torch.dtype
    param: torch.Tensor | None
    shard: ShardSpec
    """This rank's slice of the full tensor."""


class WeightMirror(Protocol):
    """Forwards an update to the other tensor-parallel ranks (rank 0 only)."""

    def begin(self, manifest: list[ManifestEntry]) -> None: ...
    def write(self, name: str, tensor: torch.Tensor) -> None: ...
    def finish(self) -> None: ...
    def abort(self, reason: str) -> None: ...


def weight_targets(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's parameters by name, and alias -> parameter name for tied weights."""
    params = {name: param.data for name, param in model.named_parameters()}
    return params, tied_aliases(model)


def shard_specs_of(model: torch.nn.Module) -> dict[str, ShardSpec]:
    """Each parameter's slice of its checkpoint tensor (whole for a plain module)."""
    if hasattr(model, "shard_specs"):
        return model.shard_specs()
    return {name: ShardSpec(tuple(p.shape)) for name, p in model.named_parameters()}


def plan_update(
    manifest: Iterable[ManifestEntry],
    params: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    require_all: str | None,
    specs: Mapping[str, ShardSpec] | None = None,
) -> dict[str, _Target]:
    """Check every entry against the full shapes; with `require_all` (the reason) every
    parameter must be covered."""
    entries = [_check_entry(entry) for entry in manifest]
    if not entries:
        raise WeightUpdateError("the weight update manifest is empty; send at least one tensor")
    names = [name for name, _, _ in entries]
    duplicates = sorted(n for n, count in Counter(names).items() if count > 1)
    if duplicates:
        raise WeightUpdateError(f"the manifest names {_shown(duplicates)} more than once")
    if specs is None:
        specs = {name: ShardSpec(tuple(p.shape)) for name, p in params.items()}
    plan = {
        name: _target(name, shape, dtype, params, aliases, names, specs)
        for name, shape, dtype in entries
    }
    if require_all is not None:
        covered = {aliases.get(name, name) for name in names}
        missing = sorted(set(params) - covered)
        if missing:
            raise WeightUpdateError(
                f"{require_all}, so an update must cover every parameter; the manifest lacks "
                f"{len(missing)} of {len(params)}: {_shown(missing)}"
            )
    return plan


def _check_entry(entry: object) -> ManifestEntry:
    try:
        name, shape, dtype = entry  # type: ignore[misc]
        shape = tuple(operator.index(s) for s in shape)
    except (TypeError, ValueError):
        raise WeightUpdateError(
            f"a manifest entry must be (name, shape, dtype), got {entry!r}"
        ) from None
    if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(
            f"a manifest entry must be (str name, shape, torch.dtype), got {entry!r}"
        )
    return name, shape, dtype


def _target(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    params: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    names: list[str],
    specs: Mapping[str, ShardSpec],
) -> _Target:
    param_name = aliases.get(name, name)
    param = params.get(param_name)
    if param is None:
        raise WeightUpdateError(
            f"unknown parameter name {name!r}; names must be the model's parameter names "
            f"(model.named_parameters()), e.g. {_shown(sorted(params)[:3])}"
        )
    full_shape = specs[param_name].full_shape
    if shape != full_shape:
        raise WeightUpdateError(
            f"parameter {name!r}: the update has shape {list(shape)}, "
            f"the model has {list(full_shape)}"
        )
    if dtype != param.dtype:
        raise WeightUpdateError(
            f"parameter {name!r}: the update has dtype {dtype}, the model has {param.dtype}; "
            f"cast it to {param.dtype} before sending"
        )
    is_ignored_alias = name != param_name and param_name in names
    return _Target(shape, dtype, None if is_ignored_alias else param, specs[param_name])


def _shown(names: list[str]) -> str:
    more = f" and {len(names) - _MAX_NAMES_SHOWN} more" if len(names) > _MAX_NAMES_SHOWN else ""
    return ", ".join(repr(n) for n in names[:_MAX_NAMES_SHOWN]) + more


class WeightUpdateSession:
    """Writes the tensors of a validated manifest; `finish()` once every one was written.

    Until `finish()` succeeds the engine's weights are marked inconsistent and generation is
    refused. `abort()` (or a failed `finish()`) leaves them so until a complete update lands.
    """

    def __init__(
        self,
        plan: dict[str, _Target],
        on_finish: Callable[[WeightUpdateSession], int],
        on_close: Callable[[WeightUpdateSession, str], None],
        mirror: WeightMirror | None = None,
    ) -> None:
        self._plan = plan
        self._on_finish = on_finish
        self._on_close = on_close
        self._mirror = mirror
        self._written: set[str] = set()
        self._closed_reason: str | None = None
        self.num_bytes = sum(t.param.nbytes for t in plan.values() if t.param is not None)

    @property
    def is_open(self) -> bool:
        return self._closed_reason is None

    @property
    def num_pending(self) -> int:
        """Manifest tensors not written yet."""
        return len(self._plan) - len(self._written)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy one manifest tensor into its parameter (any device; same shape and dtype)."""
        self._check_open()
        target = self._plan.get(name)
        if target is None:
            raise WeightUpdateError(f"{name!r} is not in this update's manifest")
        if name in self._written:
            raise WeightUpdateError(f"{name!r} was already written in this update")
        if not isinstance(tensor, torch.Tensor):
            raise WeightUpdateError(f"{name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tuple(tensor.shape) != target.shape or tensor.dtype != target.dtype:
            raise WeightUpdateError(
                f"{name!r}: got a {list(tensor.shape)} {tensor.dtype} tensor, the manifest "
                f"announced {list(target.shape)} {target.dtype}"
            )
        if target.param is not None:
            with torch.no_grad():
                target.shard.copy_into(target.param, tensor)
        if self._mirror is not None:
            self._mirror.write(name, tensor)
        self._written.add(name)

    def finish(self) -> int:
        """End the update; the new weight version. Refused (and aborted) if a tensor is missing."""
        self._check_open()
        missing = sorted(set(self._plan) - self._written)
        if missing:
            self.abort("it was finished with tensors missing")
            raise WeightUpdateError(
                f"the update is incomplete: {len(missing)} of {len(self._plan)} manifest tensors "
                f"were never written ({_shown(missing)}); the weights stay inconsistent and "
                f"generation is refused until a complete update lands"
            )
        if self._mirror is not None:
            try:
                self._mirror.finish()
            except BaseException:
                self.abort("another tensor-parallel rank failed to finish it")
                raise
        self._closed_reason = "it finished"
        return self._on_finish(self)

    def abort(self, reason: str = "it was aborted") -> None:
        """Stop writing; the weights stay inconsistent until a complete update lands."""
        if self._closed_reason is not None:
            return
        self._closed_reason = reason
        try:
            if self._mirror is not None:
                self._mirror.abort(reason)
        finally:
            self._on_close(self, reason)

    def _check_open(self) -> None:
        if self._closed_reason is not None:
            raise WeightUpdateError(
                f"this weight update session is closed ({self._closed_reason}); "
                f"begin a new one with begin_weight_update(...)"
            )


def materialize(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs from a mapping or an iterable of pairs; WeightUpdateError otherwise."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    for item in items:
        if not (
            isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise WeightUpdateError(
                f"update_weights takes {{name: tensor}} or (name, tensor) pairs; got {item!r:.80}"
            )
    return items


class WeightUpdater:
    """Opens, supersedes and finishes the update sessions of one model; owns the weight version.

    At most one session is open. While it is, and after one is cut off, the weights are marked
    inconsistent in `memory` and generation is refused; a finished session bumps the version
    and calls `on_update` (the engine resets its prefix cache there).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        memory: EngineMemory,
        event_log: MemoryEventLog,
        on_update: Callable[[], None],
    ) -> None:
        self._params, self._aliases = weight_targets(model)
        self._specs = shard_specs_of(model)
        self.mirror: WeightMirror | None = None
        """Set on rank 0 of a tensor-parallel group: every step of an update is forwarded."""
        self._memory = memory
        self._event_log = event_log
        self._on_update = on_update
        self._session: WeightUpdateSession | None = None
        self.weight_version = 0
        self._fingerprint: tuple[int, str] | None = None  # (weight_version, digest)

    def begin(self, manifest: Sequence[ManifestEntry]) -> WeightUpdateSession:
        """Validate every (name, shape, dtype), then open a session (an open one is aborted)."""
        self._memory.check_weights_mapped()
        require_all = None
        if not self._memory.weights_valid:
            require_all = (
                "the current weights are not valid (discarded by sleep(level=2), or an earlier "
                "update was cut off)"
            )
        plan = plan_update(manifest, self._params, self._aliases, require_all, self._specs)
        self.close_session("a newer begin_weight_update superseded it")
        if self.mirror is not None:
            self.mirror.begin([(name, t.shape, t.dtype) for name, t in plan.items()])
        self._memory.begin_weight_update()
        self._session = WeightUpdateSession(plan, self._finish, self._on_closed, self.mirror)
        self._event_log.record(
            "weight_update", phase="begin", tag="weights", num_bytes=self._session.num_bytes
        )
        return self._session

    def fingerprint(self) -> str:
        """A digest of the weights' values (64 evenly spaced elements of every parameter),
        cached per weight version. Engines whose fingerprints differ hold other weights:
        another checkpoint, or the same one at another step of training."""
        if self._fingerprint is None or self._fingerprint[0] != self.weight_version:
            digest = hashlib.sha256()
            for name in sorted(self._params):
                flat = self._params[name].reshape(-1)
                sample = flat[:: max(1, flat.numel() // 64)][:64]
                digest.update(name.encode())
                digest.update(sample.float().cpu().numpy().tobytes())
            self._fingerprint = (self.weight_version, digest.hexdigest()[:32])
        return self._fingerprint[1]

    def update(self, named_tensors: NamedTensors) -> int:
        """Write a whole update in one session; the new weight version."""
        items = materialize(named_tensors)
        session = self.begin([(n, tuple(t.shape), t.dtype) for n, t in items])
        try:
            for name, tensor in items:
                session.write(name, tensor)
        except BaseException:
            session.abort("a write failed")
            raise
        return session.finish()

    def close_session(self, reason: str) -> None:
        """Abort the open session, if any; the weights stay inconsistent until an update lands."""
        if self._session is not None:
            self._session.abort(reason)

    def _finish(self, session: WeightUpdateSession) -> int:
        assert session is self._session, "a closed session finished"
        self._session = None
        self._memory.finish_weight_update()
        self.weight_version += 1
        self._on_update()
        self._event_log.record(
            "weight_update", phase="end", tag="weights", num_bytes=session.num_bytes,
            weight_version=self.weight_version,
        )
        return self.weight_version

    def _on_closed(self, session: WeightUpdateSession, reason: str) -> None:
        if session is self._session:
            self._session = None
        self._event_log.record("weight_update", phase="abort", tag="weights", reason=reason)
