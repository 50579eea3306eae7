"""Weights pushed to several engines (a pool, a prefill and a decode engine) are read once."""

from __future__ import annotations

import torch

from trainer_bridge.transports import WeightManifest, for_several_readers


def test_a_generator_with_a_manifest_is_read_once_into_a_list():
    pairs = [("a", torch.ones(2)), ("b", torch.zeros(3))]
    manifest = WeightManifest.of(pairs)
    reads = []

    def generate():
        for name, tensor in pairs:
            reads.append(name)
            yield name, tensor

    held = for_several_readers(generate(), manifest)
    assert isinstance(held, list) and reads == ["a", "b"]
    assert [name for name, _ in held] == ["a", "b"] == [name for name, _ in held]  # re-readable
    assert reads == ["a", "b"], "read once"
    assert for_several_readers(pairs, manifest) is pairs  # a list is already re-readable


def test_without_a_manifest_a_module_or_mapping_becomes_pairs():
    module = torch.nn.Linear(2, 3)
    assert [name for name, _ in for_several_readers(module, None)] == ["weight", "bias"]
    mapping = {"w": torch.ones(1)}
    assert for_several_readers(mapping, None)[0][0] == "w"
