"""Shared fixtures: tiny Hugging Face models built once per session through the real builder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_engine.tiny_model import build_tiny_model

ARCHS = ("llama", "qwen2", "qwen3")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(params=[True, False], ids=["bf16-cpu", "fp32-only-cpu"])
def bf16_arithmetic(request, monkeypatch) -> bool:
    """The CPU's answer to "do you have AVX-512 BF16?" (`cpu_features.cpu_computes_bf16`),
    both ways."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: request.param)
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(root / arch, arch, "tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def metaspace_model_dir(tmp_path_factory, llama_dir) -> Path:
    """The tiny llama with a SentencePiece-style tokenizer (tests/metaspace_model.py)."""
    from tests.metaspace_model import build_metaspace_model

    return build_metaspace_model(tmp_path_factory.mktemp("metaspace"), llama_dir)
