"""Token-in multi-turn chat through a real server (`POST /v1/chat/completions/tokens`,
prime-rl's contract): over six turns of random-weight outputs, every turn's prompt starts with
the previous turn's prompt and completion ids exactly, and the prefix cache serves all of them
but the last partial block; the same conversation re-rendered drifts (the control that shows
the check can fail). A conversation the template cannot extend is refused, saying where."""

from __future__ import annotations

import itertools

import requests

from tests.e2e.http_helpers import AGENT_MODEL_NAME

BLOCK = 16
TURN = {"model": AGENT_MODEL_NAME, "max_tokens": 12, "temperature": 1.0,
        "return_token_ids": True, "allowed_token_ids": list(range(2, 512))}
"""Ids 0 and 1 (EOS, BOS) are special: their text is not in a message's content."""


def run_conversation(url: str, token_in: bool, seed: int) -> list[dict]:
    messages, answers, tokens = [{"role": "user", "content": "Start."}], [], None
    for turn in range(6):
        body = {**TURN, "messages": messages, "seed": seed + turn}
        path = "/v1/chat/completions"
        if token_in and tokens is not None:
            body, path = {**body, "tokens": tokens}, "/v1/chat/completions/tokens"
        answer = requests.post(url + path, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        answer = answer.json()
        choice = answer["choices"][0]
        answers.append(answer)
        tokens = answer["prompt_token_ids"] + choice["token_ids"]
        messages = [*messages, {"role": "assistant", "content": choice["message"]["content"]},
                    {"role": "user", "content": f"Tool result {turn}: ok."}]
    return answers


def extends(previous: dict, current: dict) -> bool:
    history = previous["prompt_token_ids"] + previous["choices"][0]["token_ids"]
    return current["prompt_token_ids"][:len(history)] == history


def test_token_in_turns_extend_each_other_and_hit_the_cache(agent_server):
    answers = run_conversation(agent_server.http_url, token_in=True, seed=11)
    for previous, current in itertools.pairwise(answers):
        assert extends(previous, current)
        num_with_kv = len(previous["prompt_token_ids"]) + len(previous["choices"][0][
            "token_ids"]) - 1  # the last sampled token was never fed back
        cached = current["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == num_with_kv // BLOCK * BLOCK, (cached, num_with_kv)


def test_re_rendering_the_same_conversation_drifts(agent_server):
    answers = run_conversation(agent_server.http_url, token_in=False, seed=11)
    assert not all(extends(p, c) for p, c in itertools.pairwise(answers))


def test_a_conversation_that_does_not_extend_the_tokens_is_refused(agent_server):
    answer = requests.post(agent_server.http_url + "/v1/chat/completions/tokens", timeout=60,
                           json={**TURN, "messages": [{"role": "user", "content": "Hi."}],
                                 "tokens": [5, 6, 7]})
    assert answer.status_code == 400
    assert "does not extend `tokens`" in answer.json()["error"]["message"]
    answer = requests.post(agent_server.http_url + "/v1/chat/completions/tokens", timeout=60,
                           json={**TURN, "messages": [{"role": "user", "content": "Hi."}],
                                 "tokens": [10**9]})
    assert answer.status_code == 400 and "token ids" in answer.json()["error"]["message"]
