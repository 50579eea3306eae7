"""vLLM's sampling surface on a tiny real model, against the Hugging Face oracle: stop strings,
min_tokens, penalties and logit bias, top-k logprobs, prompt logprobs and scoring."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from rollout_engine import LLM, InvalidRequestError, SamplingParams
from tests.integration.hf_oracle import hf_greedy, load_hf_model

ATOL = 1e-5  # fp32 logprobs
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
# 4-token blocks and an 8-token budget: prompts are chunked and share cached blocks.
ENGINE_OPTIONS = {"block_size": 4, "max_num_batched_tokens": 8, "num_blocks": 64}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs) -> str:
    return str(tiny_model_dirs["llama"])


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, **ENGINE_OPTIONS)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, **kwargs})


@torch.inference_mode()
def hf_logprobs_of(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: log_softmax of HF's logits at every position but the last."""
    logits = load_hf_model(model_dir)(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


@torch.inference_mode()
def hf_processed_greedy(
    model_dir: str, prompt: list[int], num_tokens: int,
    process: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> list[int]:
    """Greedy decoding from HF's logits after `process(logits [V], output so far)`."""
    model, output = load_hf_model(model_dir), []
    for _ in range(num_tokens):
        logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        output.append(int(process(logits, output).argmax()))
    return output


# ------------------------------------------------------------------------ stop strings
def test_a_stop_string_across_tokens_ends_the_completion_and_cuts_its_text(llm, model_dir):
    expected = hf_greedy(model_dir, PROMPT, 16)
    tokenizer = llm.tokenizer
    # Text made by tokens 3..5 of the greedy continuation: the string ends inside token 5.
    piece = tokenizer.decode(expected[3:6])
    stop = piece[1:-1] if len(piece) > 3 else piece
    assert len(stop) >= 2
    before = llm.generate([PROMPT], greedy())[0].outputs[0]
    text_before = tokenizer.decode(expected[:6])
    cut = text_before.index(stop)
    for include in (False, True):
        params = greedy(stop=["never appears in this text", stop],
                        include_stop_str_in_output=include)
        out = llm.generate([PROMPT], params)[0].outputs[0]
        assert out.token_ids == expected[:6]  # ends with the token that completed the match
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == text_before[: cut + (len(stop) if include else 0)]
        assert len(out.logprobs) == 6
    assert before.stop_reason is None and before.finish_reason == "length"


def test_stop_strings_wait_for_min_tokens(llm, model_dir):
    expected = hf_greedy(model_dir, PROMPT, 16)
    stop = llm.tokenizer.decode(expected[1:3]).strip() or llm.tokenizer.decode(expected[1:3])
    early = llm.generate([PROMPT], greedy(stop=[stop]))[0].outputs[0]
    late = llm.generate([PROMPT], greedy(stop=[stop], min_tokens=8))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) <= 3
    assert len(late.token_ids) > 8 or late.finish_reason == "length"


# ------------------------------------------------------------------------ min_tokens, bias
def test_min_tokens_holds_back_eos(llm):
    eos = llm.engine.limits.eos_token_ids[0]
    eager = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={eos: 100.0})
    assert llm.generate([PROMPT], eager)[0].outputs[0].token_ids == [eos]
    held = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={eos: 100.0}, min_tokens=5)
    out = llm.generate([PROMPT], held)[0].outputs[0]
    assert out.token_ids[:5] != [eos] * 5 and eos not in out.token_ids[:5]
    assert out.token_ids[5:] == [eos] and out.finish_reason == "stop"
    stopper = out.token_ids[0]  # a stop id is held back as EOS is
    out = llm.generate([PROMPT], greedy(stop_token_ids=[stopper], min_tokens=3))[0].outputs[0]
    assert stopper not in out.token_ids[:3]


def test_logit_bias_allowed_and_bad_tokens_change_greedy_as_the_reference(llm, model_dir):
    expected = hf_greedy(model_dir, PROMPT, 8)
    bias = {expected[0]: -100.0, 42: 3.0}

    def biased(logits, output):
        logits = logits.clone()
        for token, value in bias.items():
            logits[token] += value
        return logits

    out = llm.generate([PROMPT], greedy(max_tokens=8, logit_bias=bias))[0].outputs[0]
    assert out.token_ids == hf_processed_greedy(model_dir, PROMPT, 8, biased)
    allowed = [3, 17, 42, 99, 300]
    out = llm.generate([PROMPT], greedy(max_tokens=8, allowed_token_ids=allowed))[0].outputs[0]
    assert out.token_ids == hf_processed_greedy(
        model_dir, PROMPT, 8, lambda l, o: l.masked_fill(
            ~torch.isin(torch.arange(len(l)), torch.tensor(allowed)), float("-inf")))
    word = llm.tokenizer.decode([expected[0]]).strip()
    banned = llm.engine.processor.bad_words_token_ids(SamplingParams(bad_words=[word]))
    out = llm.generate([PROMPT], greedy(max_tokens=8, bad_words=[word]))[0].outputs[0]
    single = {seq[0] for seq in banned if len(seq) == 1}
    assert single and not single & set(out.token_ids)


def test_presence_and_frequency_penalties_follow_openais_rule(llm, model_dir):
    presence, frequency = 1.5, 0.7

    def penalised(logits, output):
        counts = torch.bincount(torch.tensor(output, dtype=torch.long),
                                minlength=len(logits)).float() if output else 0.0
        return logits - frequency * counts - presence * (torch.as_tensor(counts) > 0).float()

    params = greedy(max_tokens=12, presence_penalty=presence, frequency_penalty=frequency)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert out.token_ids == hf_processed_greedy(model_dir, PROMPT, 12, penalised)
    assert out.token_ids != hf_greedy(model_dir, PROMPT, 12)


# ------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_top_logprobs_equal_the_distribution_sampled_from(llm, model_dir, mode):
    temperature = 0.7
    params = SamplingParams(temperature=temperature, seed=11, max_tokens=8, ignore_eos=True,
                            logprobs=5, logprobs_mode=mode)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    reference = hf_logprobs_of(model_dir, PROMPT + out.token_ids)[len(PROMPT) - 1:]
    if mode == "processed_logprobs":
        reference = (reference / temperature).log_softmax(-1)  # temperature 0.7, no filters
    assert len(out.top_logprobs) == len(out.token_ids)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
        expected = reference[position]
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(expected[token].item(), abs=ATOL)
        assert entry.logprobs[0] == pytest.approx(out.logprobs[position], abs=1e-6)
        assert entry.ranks[0] == int((expected > expected[token]).sum()) + 1
        top = expected.topk(5)
        assert entry.token_ids[1:] == top.indices.tolist() and entry.ranks[1:] == [1, 2, 3, 4, 5]
        torch.testing.assert_close(torch.tensor(entry.logprobs[1:]), top.values,
                                   rtol=0, atol=ATOL)


def test_prompt_logprobs_cover_every_position_through_chunks_and_cache_hits(llm, model_dir):
    prompt = list(range(20, 47))  # 27 tokens: 4 chunks of the 8-token budget
    reference = hf_logprobs_of(model_dir, prompt)
    params = greedy(max_tokens=2, prompt_logprobs=3)
    for attempt in range(2):  # the second finds the prompt's blocks cached: not used for it
        output = llm.generate([prompt], params)[0]
        logprobs = output.prompt_logprobs
        assert logprobs[0] is None and len(logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            entry, expected = logprobs[position], reference[position - 1]
            assert entry.token_ids[0] == prompt[position]
            assert entry.logprobs[0] == pytest.approx(expected[prompt[position]].item(), abs=ATOL)
            assert entry.token_ids[1:] == expected.topk(3).indices.tolist()
    assert llm.engine.scheduler.num_prefix_hit_tokens > 0  # the prompt was cached, not reused


def test_score_equals_hfs_recompute_and_shares_the_prompt(model_dir):
    llm = LLM(model_dir, **ENGINE_OPTIONS)
    completions = [[101, 102, 103, 104], [105, 106], [101, 102, 300]]
    sequences = [PROMPT + c for c in completions]
    scores = llm.score(sequences, [len(PROMPT)] * 3, logprobs=2)
    for sequence, completion, score in zip(sequences, completions, scores):
        reference = hf_logprobs_of(model_dir, sequence)[len(PROMPT) - 1:]
        expected = reference.gather(1, torch.tensor(completion)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(score.logprobs), expected, rtol=0, atol=ATOL)
        assert [e.token_ids[1:] for e in score.top_logprobs] == reference.topk(2).indices.tolist()
    assert llm.engine.scheduler.num_prefix_hit_tokens >= 2 * 8  # the prompt's 2 full blocks
    with pytest.raises(InvalidRequestError, match="prompt_len"):
        llm.score([PROMPT], [len(PROMPT)])
    assert llm.score([PROMPT + [7]], [len(PROMPT)])[0].top_logprobs is None


# ------------------------------------------------------------------------ the rest
def test_seeded_tokens_keep_their_determinism_with_every_field(llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=0.2, logit_bias={3: 2.0},
                            bad_words=["x"], logprobs=3, min_tokens=2)
    alone = llm.generate([PROMPT], params)[0].outputs[0]
    others = SamplingParams(temperature=1.0, max_tokens=6, n=3)
    batched = llm.generate([[40, 41, 42], PROMPT, [50] * 11], [others, params, others])
    assert batched[1].outputs[0].token_ids == alone.token_ids
    assert batched[1].outputs[0].logprobs == pytest.approx(alone.logprobs, abs=1e-6)


def test_truncate_prompt_tokens_keeps_the_last_ones(llm, model_dir):
    out = llm.generate([list(range(30, 60))], greedy(max_tokens=6, truncate_prompt_tokens=7))[0]
    assert out.prompt_token_ids == list(range(53, 60))
    assert out.outputs[0].token_ids == hf_greedy(model_dir, list(range(53, 60)), 6)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias names token ids"),
        (SamplingParams(allowed_token_ids=[10**6]), "allowed_token_ids names token ids"),
    ],
)
def test_token_ids_past_the_vocabulary_are_refused_and_the_engine_serves(llm, model_dir, params,
                                                                           match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([PROMPT], params)
    assert llm.generate([PROMPT], greedy(max_tokens=4))[0].outputs[0].token_ids == hf_greedy(
        model_dir, PROMPT, 4)
