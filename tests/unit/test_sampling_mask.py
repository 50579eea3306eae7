"""Sampling masks: the compact type and its wire form, the sampler's masks against the reference
distribution of every returned token (drafts, masks, greedy rows included), and the trainer's
logprobs renormalised over them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protos import rollout_pb2 as pb
from rollout_engine.core.scheduler_output import NO_ALLOWED_TOKEN_ID
from rollout_engine.protocol import (
    CompletionOutput,
    InvalidRequestError,
    RequestOutput,
    SamplingMask,
    SamplingParams,
)
from rollout_engine.protocol.wire_codec import from_message, to_message
from rollout_engine.server.convert import generate_response
from rollout_engine.worker.sampling.sampler import Sampler
from tests.unit.test_sampler import random_logits
from tests.unit.test_sampler_surface import (
    EOS,
    FEATURES,
    feature_batch,
    make_row,
    reference_logprobs,
)
from trainer_bridge.client_messages import apply_generate_response
from trainer_bridge.masked_logprobs import masked_logprobs, support_mask

IDS = [[3, 7, 9], [1], [], [0, 511]]


# ------------------------------------------------------------------------------ the type
def test_a_mask_holds_each_tokens_ids_compactly_and_gives_them_back():
    mask = SamplingMask.of([IDS[0], np.array(IDS[1]), IDS[2], IDS[3]])
    assert mask.counts == [3, 1, 0, 2] and len(mask) == 4
    assert mask.flat_token_ids == np.array([3, 7, 9, 1, 0, 511], dtype="<i4").tobytes()
    assert mask.to_lists() == IDS
    assert mask.to_numpy().dtype == np.int32 and mask.to_numpy().tolist() == [3, 7, 9, 1, 0, 511]
    parts = SamplingMask.concat([SamplingMask.of(IDS[:1]), None, SamplingMask.of(IDS[1:])])
    assert parts == mask
    assert SamplingMask.of([]) == SamplingMask([], b"") == SamplingMask.concat([])


def test_a_mask_travels_in_completions_and_stream_deltas():
    mask = SamplingMask.of(IDS)
    assert from_message(to_message(mask, pb.SamplingMask()), SamplingMask) == mask
    completion = CompletionOutput(0, [3, 1, 5, 0], [-0.5] * 4, "length", sampling_mask=mask)
    wire = to_message(completion, pb.CompletionOutput())
    assert from_message(wire, CompletionOutput) == completion
    assert from_message(pb.CompletionOutput(), CompletionOutput).sampling_mask is None
    # A stream: each delta carries its tokens' masks; the client joins them.
    steps = [CompletionOutput(0, [3], [-0.5], sampling_mask=SamplingMask.of(IDS[:1])),
             CompletionOutput(0, [1, 5], [-0.5] * 2, sampling_mask=SamplingMask.of(IDS[1:3]))]
    snapshot = RequestOutput("", [], [])
    for i, step in enumerate(steps):
        message = generate_response("g", RequestOutput("g", [1, 2], [step]), i == 0)
        assert SamplingMask(list(message.deltas[0].sampling_mask.counts),
                            message.deltas[0].sampling_mask.flat_token_ids) == step.sampling_mask
        apply_generate_response(snapshot, message)
    assert snapshot.outputs[0].sampling_mask == SamplingMask.of(IDS[:3])
    plain = generate_response("g", RequestOutput("g", [1], [CompletionOutput(0, [3], [-1])]), True)
    assert not plain.deltas[0].HasField("sampling_mask")


# ---------------------------------------------------------------------------- requests
@pytest.mark.parametrize("kwargs", [{"top_k": 4}, {"top_p": 0.9}, {"min_p": 0.1},
                                    {"temperature": 0.0}, {"allowed_token_ids": [3, 4]}])
def test_a_truncating_request_may_ask_for_masks(kwargs):
    assert SamplingParams(return_sampling_mask=True, **kwargs).return_sampling_mask


@pytest.mark.parametrize("kwargs", [{}, {"top_k": -1, "top_p": 1.0}, {"bad_words": ["no"]},
                                    {"min_tokens": 3}])
def test_a_request_that_truncates_nothing_is_refused_with_what_to_change(kwargs):
    with pytest.raises(InvalidRequestError, match="return_sampling_mask needs a truncation.*"
                                                  "set top_k, top_p < 1 or min_p > 0"):
        SamplingParams(return_sampling_mask=True, **kwargs)


# ----------------------------------------------------------------------------- sampler
def reference_support(logits: torch.Tensor, row, j: int) -> list[int] | None:
    distribution = reference_logprobs(logits, row, j)
    return None if distribution is None else distribution.isfinite().nonzero()[:, 0].tolist()


@pytest.mark.parametrize("feature", ["allowed_token_ids", "bad_words", "min_tokens", "all"])
def test_each_returned_token_gets_the_support_of_its_own_distribution(feature):
    """Greedy and sampled rows, with and without drafts, among rows that do not ask: the
    reference distribution of every returned token's position is finite exactly on its mask."""
    asking = FEATURES[feature] | {"return_sampling_mask": True}
    logits, rows, uses = feature_batch(asking, seed=0)
    results = Sampler(eos_token_ids=(EOS,))(logits, rows)
    offset, num_checked = 0, {"greedy": 0, "sampled": 0, "draft": 0}
    for result, row, used in zip(results, rows, uses):
        if not used:
            assert result.sampling_masks is None
        else:
            assert len(result.sampling_masks) == len(result.token_ids)
            for j, (token, mask) in enumerate(zip(result.token_ids, result.sampling_masks)):
                if token == NO_ALLOWED_TOKEN_ID:
                    continue
                assert mask.dtype == np.int32 and token in mask
                if row.params.is_greedy:
                    assert mask.tolist() == [token]
                else:
                    assert mask.tolist() == reference_support(logits[offset + j], row, j)
                kind = "draft" if j else "greedy" if row.params.is_greedy else "sampled"
                num_checked[kind] += 1
        offset += len(row.draft_token_ids) + 1
    assert min(num_checked.values()) > 0, num_checked


def test_rows_that_all_ask_and_batches_where_none_asks():
    logits = random_logits(3, 64, seed=3)
    rows = [make_row(seed=s, top_k=5, return_sampling_mask=True) for s in range(3)]
    for result, row_logits in zip(Sampler()(logits, rows), logits):
        assert result.sampling_masks[0].tolist() == sorted(row_logits.topk(5).indices.tolist())
    plain = [make_row(seed=s, top_k=5) for s in range(3)]
    sampler = Sampler()
    assert sampler.plan(plain, 64).sampling_masks is None
    assert all(r.sampling_masks is None for r in sampler(logits, plain))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_masks_match_cpu():
    """On a GPU top-p sorts the whole vocabulary at once: the same supports."""
    rows = [make_row(seed=s, return_sampling_mask=True, **kwargs)
            for s, kwargs in enumerate([{"top_p": 0.9}, {"top_k": 50, "top_p": 0.5},
                                        {"temperature": 0.0}, {"min_p": 0.05}])]
    logits = random_logits(4, 4096, seed=6)
    for cpu, cuda in zip(Sampler()(logits, rows), Sampler()(logits.cuda(), rows)):
        assert cpu.token_ids == cuda.token_ids
        assert [m.tolist() for m in cpu.sampling_masks] == [m.tolist() for m in cuda.sampling_masks]


# ----------------------------------------------------------------------------- trainer
def test_masked_logprobs_are_the_engines_processed_logprobs():
    vocab, temperature = 64, 0.7
    logits = random_logits(6, vocab, seed=4)
    rows = [make_row(seed=s, temperature=temperature, return_sampling_mask=True, **kwargs)
            for s, kwargs in enumerate([{"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.2},
                                        {"top_k": 9, "top_p": 0.6}, {"top_k": 1}])]
    rows.append(make_row(temperature=0.0, return_sampling_mask=True))
    results = Sampler()(logits, rows)
    tokens = [r.token_ids[0] for r in results]
    mask = SamplingMask.of(r.sampling_masks[0] for r in results)
    support = support_mask(mask, vocab)
    assert support.shape == (6, vocab) and support.sum(-1).tolist() == mask.counts
    got = masked_logprobs(logits[:5], tokens[:5], SamplingMask.of(mask.to_lists()[:5]),
                          temperature)
    expected = [r.logprobs[0] for r in results[:5]]
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=0)
    assert masked_logprobs(logits[5:], tokens[5:], support[5:], 0.0).tolist() == [0.0]
    plain = (logits[:5].float() / temperature).log_softmax(-1)[range(5), tokens[:5]]
    assert bool((got > plain).all())  # renormalised over fewer tokens: more mass each


def test_masked_logprobs_refuse_a_mask_that_is_not_the_completions():
    logits = random_logits(2, 16, seed=5)
    with pytest.raises(ValueError, match="outside its sampling mask"):
        masked_logprobs(logits, [3, 4], SamplingMask.of([[3], [5, 6]]))
    with pytest.raises(ValueError, match="covers"):
        masked_logprobs(logits, [3, 4], SamplingMask.of([[3]]))
    with pytest.raises(ValueError, match="vocabulary of 16"):
        support_mask(SamplingMask.of([[3, 16]]), 16)


def test_serve_takes_vllms_engine_wide_switch():
    from rollout_engine import cli
    from rollout_engine.config import EngineConfig

    args = cli.build_parser().parse_args(["serve", "--model", "m", "--return-sampling-mask"])
    options = {k: getattr(args, k) for k in cli._SERVE_ENGINE_OPTIONS
               if getattr(args, k) is not None}
    assert EngineConfig.from_kwargs("m", **options).model_config.return_sampling_mask
