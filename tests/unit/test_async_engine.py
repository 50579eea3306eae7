"""The server's one door to the engine (rollout_engine.server.async_engine): a call's prompts
are admitted, added all or none, followed to the end and aborted on every early way out, with
the admission given back; and no other server module reaches the engine around it."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout_engine.config import ServerConfig
from rollout_engine.protocol import (
    AdmissionError,
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
)
from rollout_engine.server.async_engine import AsyncEngine

SERVER_DIR = Path(__file__).resolve().parents[2] / "rollout_engine" / "server"
DOOR = {"async_engine.py", "engine_loop.py"}


class OneStepEngine:
    """Stands in for LLMEngine: every prompt finishes at the next step; a prompt of `[0]` is
    refused; `hold()` keeps steps from running."""

    config = SimpleNamespace(model_config=SimpleNamespace(model="/models/tiny"))
    hf_config = SimpleNamespace(architectures=["TinyForCausalLM"])
    limits = SimpleNamespace(vocab_size=32, max_model_len=64, eos_token_ids=(1,), num_blocks=8)
    worker = SimpleNamespace(dtype=torch.float32)
    device = torch.device("cpu")
    kv_transfer = None

    def __init__(self) -> None:
        self.unfinished: list[str] = []
        self.aborted: list[str] = []
        self.is_holding = False
        self.is_shut_down = False
        self.output_processor = SimpleNamespace(num_finished_tokens=0)

    def add_request(self, request_id, prompt, sampling_params, output_kind, **options) -> None:
        if prompt == [0]:
            raise InvalidRequestError("prompt [0] is refused")
        self.unfinished.append(request_id)

    def abort_request(self, request_ids) -> None:
        self.aborted += request_ids
        self.unfinished = [rid for rid in self.unfinished if rid not in request_ids]

    def can_make_progress(self) -> bool:
        return bool(self.unfinished) and not self.is_holding

    def step(self) -> list[SimpleNamespace]:
        done, self.unfinished = self.unfinished, []
        return [SimpleNamespace(request_id=rid, finished=True) for rid in done]

    def shutdown(self) -> None:
        self.is_shut_down = True


def serving(scenario, max_inflight_requests: int = 4) -> None:
    """Run `scenario(async_engine, engine)` with the engine thread started, then shut down."""
    engine = OneStepEngine()
    config = ServerConfig(max_inflight_requests=max_inflight_requests, max_n=4)

    async def main() -> None:
        async_engine = AsyncEngine(engine, config, model_name="tiny")
        async_engine.start()
        try:
            await asyncio.wait_for(scenario(async_engine, engine), 10)
        finally:
            async_engine.shutdown()

    asyncio.run(main())
    assert engine.is_shut_down


def test_a_call_is_followed_to_the_end_and_gives_its_admission_back():
    async def scenario(async_engine: AsyncEngine, engine: OneStepEngine) -> None:
        params = [SamplingParams(n=2), SamplingParams(n=2)]
        generation = async_engine.generate([[5], [6]], params, RequestOutputKind.FINAL_ONLY,
                                           "batch")
        outputs = await generation.final_outputs()
        assert [o.request_id for o in outputs] == ["batch-0:0", "batch-0:1"]
        assert _inflight_now(async_engine) == 0
        later = async_engine.generate([[7]], [SamplingParams()], RequestOutputKind.DELTA, "cmpl")
        assert later.request_id == "cmpl-1"  # one counter for every kind of call

    serving(scenario)


def test_a_refused_prompt_adds_none_and_releases_the_admission():
    async def scenario(async_engine: AsyncEngine, engine: OneStepEngine) -> None:
        engine.is_holding = True
        generation = async_engine.generate([[5], [0]], [SamplingParams()] * 2,
                                           RequestOutputKind.FINAL_ONLY, "gen")
        with pytest.raises(InvalidRequestError, match="refused"):
            await generation.start()
        assert engine.unfinished == [] and "gen-0:0" in engine.aborted
        assert _inflight_now(async_engine) == 0

    serving(scenario)


def test_past_the_limit_nothing_is_added():
    async def scenario(async_engine: AsyncEngine, engine: OneStepEngine) -> None:
        engine.is_holding = True
        running = await async_engine.generate([[5]], [SamplingParams(n=3)],
                                              RequestOutputKind.DELTA, "gen").start()
        with pytest.raises(AdmissionError):
            await async_engine.generate([[6]], [SamplingParams(n=2)],
                                        RequestOutputKind.DELTA, "gen").start()
        assert engine.unfinished == ["gen-0:0"] and _inflight_now(async_engine) == 3
        running.close()

    serving(scenario)


def test_a_call_that_ends_early_aborts_what_is_pending():
    async def scenario(async_engine: AsyncEngine, engine: OneStepEngine) -> None:
        engine.is_holding = True
        async with async_engine.generate([[5], [6]], [SamplingParams()] * 2,
                                         RequestOutputKind.DELTA, "chatcmpl") as generation:
            assert _inflight_now(async_engine) == 2
        generation.close()  # idempotent: every way out of an HTTP stream calls it
        await _flush(async_engine)
        assert sorted(engine.aborted) == ["chatcmpl-0:0", "chatcmpl-0:1"]
        assert engine.unfinished == [] and _inflight_now(async_engine) == 0

    serving(scenario)


def test_no_front_end_reaches_around_the_door():
    """Front-ends hold an `AsyncEngine` (tests/integration/test_layering: only it and its loop
    name `LLMEngine`): none runs an engine method through the engine loop, or reads the
    engine's parts."""
    reaching = re.compile(r"engine_loop|\.call\(|(?<![\w.])engine\.("
                          r"worker|config|hf_config|limits|kv_transfer|output_processor)\b")
    offenders = [f"{path.relative_to(SERVER_DIR)}:{n}"
                 for path in SERVER_DIR.rglob("*.py") if path.name not in DOOR
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if reaching.search(line)]
    assert offenders == []


def _inflight_now(async_engine: AsyncEngine) -> int:
    return async_engine._admission.num_inflight_requests


async def _flush(async_engine: AsyncEngine) -> None:
    """Wait for the commands queued so far (an abort is fire and forget)."""
    await async_engine._loop.call(lambda: None)
