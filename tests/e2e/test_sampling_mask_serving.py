"""Sampling masks over gRPC: GenerateBatch and a Generate stream return the in-process engine's
masks (a stream's deltas carry their tokens' slices), and a request that truncates nothing is
refused with INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest

from protos import rollout_pb2 as pb
from tests.e2e.server_process import AUTH
from trainer_bridge import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42]]
PARAMS = SamplingParams(n=2, temperature=0.9, top_k=6, top_p=0.9, seed=11, max_tokens=10,
                        ignore_eos=True, return_sampling_mask=True)


def test_served_masks_equal_the_engines_in_batch_and_stream(client, llm):
    expected = llm.generate(PROMPTS, PARAMS)
    batch = client.generate(PROMPTS, PARAMS)
    snapshots = list(client.generate_stream(PROMPTS[0], PARAMS))
    for want, got in zip(expected, batch):
        for x, y in zip(want.outputs, got.outputs, strict=True):
            assert y.token_ids == x.token_ids and y.sampling_mask == x.sampling_mask
            assert len(y.sampling_mask) == len(y.token_ids) == 10
    # Every snapshot's masks cover exactly its tokens, joined from the deltas so far.
    lengths = set()
    for snapshot in snapshots:
        for output in snapshot.outputs:
            assert len(output.sampling_mask) == len(output.token_ids)
            lengths.add(len(output.token_ids))
    assert len(lengths) > 1, "the stream sent no partial completion"
    assert snapshots[-1].outputs == expected[0].outputs


def test_a_request_that_truncates_nothing_is_refused(raw_stub):
    request = pb.GenerateBatchRequest(
        prompts=[pb.Prompt(token_ids=pb.TokenIds(token_ids=PROMPTS[0]))],
        sampling_params=pb.SamplingParams(return_sampling_mask=True),
    )
    with pytest.raises(grpc.RpcError) as info:
        list(raw_stub.GenerateBatch(request, metadata=AUTH, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "return_sampling_mask needs a truncation" in info.value.details()
