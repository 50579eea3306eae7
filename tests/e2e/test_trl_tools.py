"""TRL's GRPOTrainer with `tools=` and with `environment_factory=` generating through a real
engine: TRL's own tool loop (parse the call, run the tool, glue the tool's tokens after the
completion, generate again) runs over the engine, and what the trainer trains on is what the
engine sampled, token for token: every sampled run of a completion (tool mask 1) is one engine
completion with its logprobs (TRL's old logprobs) bit for bit, and every next turn's engine
prompt is the previous prompt, the completion and the tool mask-0 tokens exactly.

The tiny model gets TRL's Qwen3 chat template (so TRL knows how to parse its calls), and a
choice constraint makes its random weights answer with a call or with text."""

from __future__ import annotations

import collections

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig
from trl.chat_template_utils import qwen3_chat_template

from trainer_bridge import EngineClient
from trainer_bridge.server_process import EngineServer
from trainer_bridge.trl import EngineGRPOTrainer

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"topic": "cats"}}\n</tool_call>'
ANSWER = "Cats are nice."


def lookup(topic: str) -> str:
    """Look a topic up.

    Args:
        topic: the topic
    """
    return f"{topic} sleep a lot"


class Notes:
    """An environment: its methods are the tools; it owns the reward."""

    def reset(self, **kwargs) -> None:
        self.looked_up = 0

    def lookup(self, topic: str) -> str:
        """Look a topic up.

        Args:
            topic: the topic
        """
        self.looked_up += 1
        return f"{topic} sleep a lot"

    def get_reward(self) -> float:
        return float(self.looked_up)


def length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


@pytest.fixture(scope="module")
def qwen_model_dir(tmp_path_factory, llama_dir):
    model_dir = tmp_path_factory.mktemp("qwen_template") / "llama"
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = qwen3_chat_template
    AutoModelForCausalLM.from_pretrained(llama_dir).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def engine(tmp_path_factory, qwen_model_dir):
    log = tmp_path_factory.mktemp("trl_tools") / "server.log"
    with EngineServer(qwen_model_dir, log_path=log,
                      engine_options={"kv_cache_bytes": "32MiB", "max_model_len": 1024}) as server:
        yield server


class Recorded:
    """The engine's outputs of every generate call (the client's real answers, kept)."""

    def __init__(self, client: EngineClient) -> None:
        self.calls: list[tuple[list, list]] = []
        generate = client.generate

        def recording(prompts, *args, **kwargs):
            outputs = generate(prompts, *args, **kwargs)
            self.calls.append((list(prompts), outputs))
            return outputs

        client.generate = recording


def runs(mask: list[int], value: int) -> list[tuple[int, int]]:
    """[start, end) of each run of `value` in `mask`."""
    spans, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            spans.append((start, i))
            start = None
    return spans


@pytest.mark.parametrize("source", ["tools", "environment_factory"])
def test_trl_tool_loop_trains_on_what_the_engine_sampled(engine, qwen_model_dir, tmp_path,
                                                         source):
    client = EngineClient(engine.address, timeout=60)
    recorded = Recorded(client)
    torch.manual_seed(0)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=8, num_generations=8,
        max_completion_length=256, max_tool_calling_iterations=2, learning_rate=1e-3,
        max_steps=1, beta=0.0, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
        generation_kwargs={"structured_outputs": {"choice": [CALL, ANSWER]}})
    sources = {"tools": [lookup]} if source == "tools" else {"environment_factory": Notes}
    trainer = EngineGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32),
        reward_funcs=length_reward if source == "tools" else None, args=args,
        train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "cats?"}]] * 8}),
        processing_class=AutoTokenizer.from_pretrained(qwen_model_dir), engine=client,
        generate_timeout_s=60, **sources)
    batches = []
    generate_and_score = trainer._generate_and_score_completions
    trainer._generate_and_score_completions = lambda inputs: batches.append(
        generate_and_score(inputs)) or batches[-1]
    trainer.train()

    (batch,) = batches
    assert len(recorded.calls) >= 2, "no completion called the tool"
    # (an engine prompt, a completion's tokens) -> the logprobs of each such completion (samples
    # of one prompt may sample the same tokens; each trained segment takes one of them)
    sampled = collections.defaultdict(list)
    next_prompts = set()
    for prompts, outputs in recorded.calls:
        for prompt, output in zip(prompts, outputs):
            assert output.prompt_token_ids == list(prompt)
            next_prompts.add(tuple(prompt))
            for completion in output.outputs:
                assert completion.kv_transfer_params is None
                sampled[tuple(prompt), tuple(completion.token_ids)].append(
                    torch.tensor(completion.logprobs))
    num_tool_turns = 0
    for row in range(len(batch["completion_ids"])):
        length = int(batch["completion_mask"][row].sum())
        ids = batch["completion_ids"][row, :length].tolist()
        mask = batch["tool_mask"][row, :length].tolist()
        old_logprobs = batch["sampling_per_token_logps"][row, :length]
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        for start, end in runs(mask, 1):
            segment = (tuple(prompt + ids[:start]), tuple(ids[start:end]))
            candidates = sampled[segment]
            match = next((i for i, logprobs in enumerate(candidates)
                          if torch.equal(old_logprobs[start:end], logprobs)), None)
            assert match is not None, "a trained completion the engine did not sample"
            del candidates[match]
        for _, end in runs(mask, 0):  # the tool's tokens, then the engine's next prompt
            num_tool_turns += 1
            assert tuple(prompt + ids[:end]) in next_prompts
    assert num_tool_turns >= 1
    history = trainer.state.log_history[0]
    assert history["tools/call_frequency"] > 0 and history["tools/failure_frequency"] == 0
    client.close()
