"""Test-only fault injection: raise inside chosen steps' forward, as a CUDA OOM or Ctrl-C would.

Off by default. Tests set it on a model runner (`ModelRunner.set_fault_injector`) or, for a
server process, through the environment variable `ROLLOUT_ENGINE_FAULT_INJECTION`, e.g.
`{"when": "decode", "error": "oom", "skip": 2, "times": 1}`. Nothing on the wire reaches it.

The fault fires from a forward pre-hook on the middle decoder layer, so the layers before
it have already written their KV for the step: the engine must still never serve that KV.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Literal

import torch

from rollout_engine.worker.persistent_batch import StepRequest

FAULT_INJECTION_ENV = "ROLLOUT_ENGINE_FAULT_INJECTION"

Phase = Literal["any", "prefill", "chunked_prefill", "decode", "spec_decode"]
ErrorKind = Literal["oom", "interrupt", "runtime", "hang"]


class InjectedFault(RuntimeError):
    """The RuntimeError the injector raises for `error="runtime"`."""


@dataclass
class FaultInjector:
    """Raises in the forward of the steps that match `when`, after letting `skip` pass."""

    when: Phase = "any"
    """Which steps: any; with a prompt chunk; with a later chunk of a chunked prompt;
    with a decoding request; with a request verifying drafts."""
    error: ErrorKind = "oom"
    """"oom": a RuntimeError worded as CUDA's out-of-memory; "interrupt": KeyboardInterrupt;
    "runtime": InjectedFault; "hang": no error, the forward stalls for `hang_s`."""
    hang_s: float = 0.0
    skip: int = 0
    """Matching steps to let through before the first fault."""
    times: int = 1
    """How many faults to raise in all."""
    trigger_file: str | None = None
    """If set, steps match only while this file exists (lets a test pick the moment)."""

    def __post_init__(self) -> None:
        self.num_raised = 0
        self._armed = False

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        spec = os.environ.get(FAULT_INJECTION_ENV)
        return cls(**json.loads(spec)) if spec else None

    def install(self, model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Hook the middle decoder layer of `model` (native or transformers backend)."""
        layers = model.decoder_layers
        return layers[len(layers) // 2].register_forward_pre_hook(self._fire)

    def arm(self, requests: list[StepRequest]) -> None:
        """Called before each forward with the step's requests: decide whether it fails."""
        self._armed = False
        if self.num_raised >= self.times or not self._matches(requests):
            return
        if self.skip > 0:
            self.skip -= 1
            return
        self._armed = True

    def _fire(self, module: torch.nn.Module, args: object) -> None:
        if not self._armed:
            return
        self._armed = False
        self.num_raised += 1
        if self.error == "hang":
            time.sleep(self.hang_s)
            return
        if self.error == "interrupt":
            raise KeyboardInterrupt("injected fault")
        if self.error == "oom":
            raise RuntimeError(
                "CUDA out of memory. Tried to allocate 2.00 GiB (injected fault)"
            )
        raise InjectedFault("injected fault")

    def _matches(self, requests: list[StepRequest]) -> bool:
        if self.trigger_file is not None and not os.path.exists(self.trigger_file):
            return False
        return any(_phase_matches(self.when, r) for r in requests)


def _phase_matches(when: Phase, request: StepRequest) -> bool:
    num_prompt_tokens = request.num_prompt_tokens
    in_prompt = request.start_position < num_prompt_tokens
    if when == "prefill":
        return in_prompt
    if when == "chunked_prefill":
        return in_prompt and request.start_position > 0
    if when == "decode":
        return not in_prompt
    if when == "spec_decode":
        return request.num_spec_tokens > 0
    return True
