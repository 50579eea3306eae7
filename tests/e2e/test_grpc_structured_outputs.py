"""Structured outputs over gRPC: the constraint travels in SamplingParams, completions satisfy
it, and a bad constraint gets INVALID_ARGUMENT with the grammar library's message while other
calls go on."""

from __future__ import annotations

import json
import re

import pytest

from tests.integration.test_structured_outputs import REGEX, SCHEMA, satisfies_schema
from trainer_bridge import InvalidArgumentError, SamplingParams, StructuredOutputsParams


def test_constrained_generation_over_grpc(client):
    outputs = client.generate(
        ["The answer is", "Tell me"],
        SamplingParams(n=4, temperature=1.0, max_tokens=64, seed=2,
                       structured_outputs=StructuredOutputsParams(regex=REGEX)),
    )
    completions = [c for o in outputs for c in o.outputs]
    assert len(completions) == 8
    for completion in completions:
        if completion.finish_reason == "stop":
            assert re.fullmatch(REGEX, completion.text), completion.text
    assert sum(c.finish_reason == "stop" for c in completions) >= 4
    (output,) = client.generate(
        ["x"], SamplingParams(temperature=0.0, max_tokens=64,
                              structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    )
    if output.outputs[0].finish_reason == "stop":
        assert satisfies_schema(json.loads(output.outputs[0].text))
    # Unconstrained requests after them are free text again.
    (free,) = client.generate(["x"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert len(free.outputs[0].token_ids) == 6


@pytest.mark.parametrize(
    ("constraint", "words"),
    [(StructuredOutputsParams(regex="(a"), "unclosed group"),
     (StructuredOutputsParams(json={"type": "objectx"}), "objectx")],
)
def test_a_bad_constraint_is_invalid_argument(client, constraint, words):
    with pytest.raises(InvalidArgumentError, match=words):
        client.generate(["hello"], SamplingParams(structured_outputs=constraint))
    (ok,) = client.generate(["hello"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(ok.outputs[0].token_ids) == 3
