"""Fixtures of the end-to-end tests: a real server process, clients, reference engines."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rollout_engine.tiny_model import build_tiny_model
from tests.e2e.http_helpers import AGENT_CHAT_TEMPLATE, AGENT_MODEL_NAME
from tests.e2e.server_process import AUTH_TOKEN, ENGINE_OPTIONS, start_server
from trainer_bridge import EngineClient


@pytest.fixture(scope="session")
def other_model_dirs(tmp_path_factory) -> dict[int, Path]:
    """Same architecture as `llama_dir`, different random weights (seeds 1 and 2)."""
    root = tmp_path_factory.mktemp("other_models")
    return {seed: build_tiny_model(root / f"llama-seed{seed}", "llama", "tiny", seed=seed)
            for seed in (1, 2)}


@pytest.fixture(scope="session")
def server(tmp_path_factory, llama_dir):
    """The shared server, with an auth token, and vllm serve's HTTP API on loopback (no API
    key; request chat templates trusted, `/tokenizer_info` served) over the same engine: tests
    using it must leave its weights and memory as they were."""
    process = start_server(
        tmp_path_factory, llama_dir, "--max-inflight-requests", "300", "--auth-token", AUTH_TOKEN,
        "--http-port", "0", "--trust-request-chat-template", "--enable-tokenizer-info-endpoint",
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="session")
def client(server):
    with EngineClient(server.address, auth_token=AUTH_TOKEN, timeout=60) as engine_client:
        engine_client.wait_until_ready(30)
        yield engine_client


@pytest.fixture(scope="session")
def llm(llama_dir):
    """The in-process reference, configured like the served engine."""
    from rollout_engine import LLM

    return LLM(str(llama_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="session")
def raw_stub(server):
    """The generated stub, for messages EngineClient never sends; pass `metadata=AUTH`."""
    import grpc

    from protos import rollout_pb2_grpc

    channel = grpc.insecure_channel(server.address)
    yield rollout_pb2_grpc.RolloutEngineStub(channel)
    channel.close()


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory, llama_dir):
    """A server for agents: the tiny model with a hermes-style chat template of its own,
    `--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`, constraints
    from the first token (a random model that opened a think block would never close it)."""
    model_dir = tmp_path_factory.mktemp("agent_model") / "llama"
    shutil.copytree(llama_dir, model_dir)
    (model_dir / "chat_template.jinja").write_text(AGENT_CHAT_TEMPLATE)
    process = start_server(
        tmp_path_factory, model_dir, "--http-port", "0", "--max-model-len=1024",
        "--kv-cache-bytes=33554432", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "qwen3", "--structured-outputs-config",
        '{"enable_in_reasoning": true}', "--trust-request-chat-template",
        "--served-model-name", AGENT_MODEL_NAME)
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture
def cpu_trainer_kernels(monkeypatch):
    """AsyncGRPOTrainer on the CPU: its MFU lookup (which asks CUDA for the device name) off;
    the returned callable swaps its tree attention (FA3) for SDPA per segment, once the trainer
    is built (building registers TRL's); TRL's is registered again afterwards."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import async_grpo_trainer
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, register_tree_attention

    from tests.e2e.trl_async_helpers import sdpa_tree_attention

    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *args: None)
    yield lambda: AttentionInterface.register(TREE_ATTENTION, sdpa_tree_attention)
    register_tree_attention()
