"""The shared wire types: torch-free, in step with rollout.proto, defined once, and mapped to
status codes that survive the round trip."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import types
import typing
from pathlib import Path

import grpc
import pytest

from protos import rollout_pb2 as pb
from rollout_engine import protocol
from rollout_engine.protocol import (
    ERROR_TYPES,
    CompletionOutput,
    EngineInfo,
    InternalError,
    InvalidRequestError,
    MemoryState,
    SamplingMask,
    SamplingParams,
    ScoreOutput,
    SleepLevel,
    StructuredOutputsParams,
    TagMemoryState,
    TopLogprobs,
    WeightVersionSpan,
    error_from_status,
)
from rollout_engine.protocol.wire_codec import from_message, to_message

REPO_ROOT = Path(__file__).resolve().parents[2]
WIRE_TYPES = [
    (SamplingParams, pb.SamplingParams),
    (CompletionOutput, pb.CompletionOutput),
    (TagMemoryState, pb.TagMemoryState),
    (MemoryState, pb.GetMemoryStateResponse),
    (EngineInfo, pb.GetInfoResponse),
    (StructuredOutputsParams, pb.StructuredOutputsParams),
    (TopLogprobs, pb.TopLogprobs),
    (ScoreOutput, pb.ScoreOutput),
    (WeightVersionSpan, pb.WeightVersionSpan),
    (SamplingMask, pb.SamplingMask),
]
TORCH_FREE_MODULES = [
    "rollout_engine",
    "rollout_engine.protocol",
    "rollout_engine.protocol.wire_codec",
    "rollout_engine.config",
    "rollout_engine.core.block_pool",
    "rollout_engine.core.kv_cache_manager",
    "rollout_engine.core.ngram_proposer",
    "rollout_engine.core.request",
    "rollout_engine.core.scheduler",
    "rollout_engine.core.scheduler_output",
    "rollout_engine.core.spec_decode",
    "rollout_engine.core.structured_output",
]
_FD = pb.SamplingParams.DESCRIPTOR.fields[0]  # any field: for the TYPE_* constants
_PROTO_SCALARS = {
    int: {_FD.TYPE_INT32, _FD.TYPE_INT64, _FD.TYPE_UINT32, _FD.TYPE_UINT64},
    float: {_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT},
    bool: {_FD.TYPE_BOOL},
    str: {_FD.TYPE_STRING},
    bytes: {_FD.TYPE_BYTES},
}


def test_shared_and_core_modules_import_without_torch_or_grpc():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # any `import torch` now raises ImportError\n"
        f"for name in {TORCH_FREE_MODULES!r}:\n"
        "    __import__(name)\n"
        "assert 'grpc' not in sys.modules, 'grpc imported'\n"
        "import rollout_engine\n"
        "assert rollout_engine.SamplingParams(n=2).n == 2\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)


def _python_kind(hint) -> tuple[str, type | None]:
    """("list"|"dict"|"optional"|"scalar"|"message", element type) of a dataclass field."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return "list", args[0]
    if origin is dict:
        return "dict", args[1]
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        if typing.get_origin(inner) is list:  # None travels as an empty repeated field
            return "list", typing.get_args(inner)[0]
        if dataclasses.is_dataclass(inner):  # None travels as an unset message
            return "message", inner
        return "optional", str if typing.get_origin(inner) is typing.Literal else inner
    if typing.get_origin(hint) is typing.Literal:
        return "scalar", str
    return ("message", hint) if dataclasses.is_dataclass(hint) else ("scalar", hint)


def _proto_kind(field) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "dict"
    if field.is_repeated:
        return "list"
    if field.message_type is not None:
        return "message"
    return "optional" if field.has_presence else "scalar"


@pytest.mark.parametrize("cls, message", WIRE_TYPES, ids=lambda x: x.__name__)
def test_proto_messages_carry_exactly_the_shared_fields(cls, message):
    fields = message.DESCRIPTOR.fields_by_name
    hints = typing.get_type_hints(cls)
    local = {f.name for f in dataclasses.fields(cls) if not f.metadata.get("wire", True)}
    assert local <= {"message"}  # views built on one side: a parsed chat message
    assert set(fields) == {f.name for f in dataclasses.fields(cls)} - local
    for name, field in fields.items():
        kind, element = _python_kind(hints[name])
        proto_kind = _proto_kind(field)
        if cls is SamplingParams and kind == "scalar":
            kind = "optional"  # unset means "the engine's default"
        assert proto_kind == kind, f"{cls.__name__}.{name}: {kind} here, {proto_kind} in the proto"
        proto_field = field.message_type.fields_by_name["value"] if kind == "dict" else field
        if dataclasses.is_dataclass(element):
            assert proto_field.message_type.name in (element.__name__, message.DESCRIPTOR.name)
        else:
            assert proto_field.type in _PROTO_SCALARS[element], f"{cls.__name__}.{name}"


def test_codec_round_trips_every_wire_type():
    params = SamplingParams(n=3, temperature=0.5, seed=7, stop_token_ids=[1, 2], max_tokens=9)
    assert from_message(to_message(params, pb.SamplingParams()), SamplingParams) == params
    assert from_message(pb.SamplingParams(), SamplingParams) == SamplingParams()
    for constraint in (StructuredOutputsParams(choice=["a", "b c"]),
                       StructuredOutputsParams(json={"type": "object"}),
                       StructuredOutputsParams(json_object=True)):
        constrained = SamplingParams(max_tokens=9, structured_outputs=constraint)
        message = to_message(constrained, pb.SamplingParams())
        assert from_message(message, SamplingParams) == constrained
    sampling_surface = SamplingParams(
        stop=["</answer>", "\n\nUser:"], include_stop_str_in_output=True, min_tokens=2,
        presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={3: 1.5, 70000: -100.0},
        allowed_token_ids=[1, 3, 5], bad_words=["no"], logprobs=5,
        logprobs_mode="raw_logprobs", prompt_logprobs=0, truncate_prompt_tokens=100,
        skip_special_tokens=False, spaces_between_special_tokens=False,
    )
    message = to_message(sampling_surface, pb.SamplingParams())
    assert from_message(message, SamplingParams) == sampling_surface
    running = CompletionOutput(index=1, token_ids=[4, 5], logprobs=[-0.5, -1.0])
    finished = dataclasses.replace(
        running, finish_reason="stop", text="hi", weight_version=3, stop_str="</a>",
        top_logprobs=[TopLogprobs([4, 4, 9], [-0.5, -0.5, -2.0], [1, 1, 2]),
                      TopLogprobs([5, 2], [-1.0, -0.1], [3, 1])],
        weight_versions=[WeightVersionSpan(2, 0, 1), WeightVersionSpan(3, 1, 2)],
    )
    for completion in (running, finished):
        message = to_message(completion, pb.CompletionOutput())
        assert from_message(message, CompletionOutput) == completion
    state = MemoryState(
        tags={"weights": TagMemoryState("offloaded", False, 1024)}, pool_bytes={"weights": 1024},
        is_sleeping=True, weights_valid=True, process_rss_bytes=5, device_memory={"x_bytes": 1},
    )
    assert from_message(to_message(state, pb.GetMemoryStateResponse()), MemoryState) == state
    info = EngineInfo(
        model="m", architecture="LlamaForCausalLM", vocab_size=10, max_model_len=8, dtype="float32",
        device="cpu", weight_version=2, config_json='{"a": 1}', num_blocks=4, num_free_blocks=3,
        block_size=16, eos_token_ids=[2], is_sleeping=False, weights_valid=True,
        engine_stats={"num_preemptions": 1.0}, num_inflight_requests=6,
    )
    decoded = from_message(to_message(info, pb.GetInfoResponse()), EngineInfo)
    assert decoded == info and decoded.config == {"a": 1}
    for score in (ScoreOutput([-0.5, -1.25], weight_version=2),
                  ScoreOutput([-0.5], [TopLogprobs([4, 1], [-0.5, -0.25], [2, 1])], 3)):
        assert from_message(to_message(score, pb.ScoreOutput()), ScoreOutput) == score


def test_invalid_values_from_the_wire_are_refused_by_the_shared_type():
    with pytest.raises(InvalidRequestError, match="top_p"):
        from_message(pb.SamplingParams(top_p=0.0), SamplingParams)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "must not exceed max_tokens"),
        ({"stop": ["ok", ""]}, "non-empty strings"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must map token ids"),
        ({"allowed_token_ids": []}, "non-empty list"),
        ({"bad_words": [" "]}, "bad_words must be non-empty"),
        ({"logprobs": 21}, r"logprobs must be None or in \[0, 20\]"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs must be None or in \[0, 20\]"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode must be one of"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None or >= 1"),
    ],
)
def test_bad_sampling_surface_values_are_refused_with_the_reason(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": float("nan")}, "temperature must be .*finite number"),
        ({"temperature": float("inf")}, "temperature must be .*finite number"),
        ({"temperature": 1e39}, "temperature .* float32"),  # inf as the kernels see it
        ({"temperature": "0.5"}, "temperature must be .*finite number"),
        ({"top_p": float("nan")}, "top_p must be .*finite number"),
        ({"min_p": float("inf")}, "min_p must be .*finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be .*finite number"),
        ({"repetition_penalty": 1e-50}, r"repetition_penalty must be in \[1e-06, "),  # 0 in fp32
        ({"presence_penalty": float("nan")}, "presence_penalty must be .*finite number"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty must be .*finite number"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias .* finite"),
        ({"logit_bias": {3: float("inf")}}, "logit_bias .* finite"),
    ],
)
def test_non_finite_sampling_values_are_refused(kwargs, match):
    """Before the fix a NaN logit bias became +100 (forcing its token) and the others reached
    the kernels, where they made NaN logprobs."""
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


def test_a_top_p_that_rounds_to_zero_in_float32_is_accepted_like_vllm():
    # vLLM 0.32 accepts it and keeps the most likely token only (the sampler's rule).
    assert SamplingParams(top_p=1e-50).top_p == 1e-50


def test_sampling_surface_normalises_like_vllm():
    params = SamplingParams(stop="</s>", bad_words="bad", logit_bias={7: 250})
    assert params.stop == ["</s>"] and params.bad_words == ["bad"]
    assert params.logit_bias == {7: 100.0}  # clamped to OpenAI's range
    top = TopLogprobs([4, 4, 9], [-0.5, -0.5, -2.0], [1, 1, 2])
    assert list(top.as_dict()) == [4, 9] and top.as_dict()[9].rank == 2
    output = CompletionOutput(index=0, token_ids=[1], logprobs=[0.0], stop_token_id=1)
    assert output.stop_reason == 1


@pytest.mark.parametrize("name", sorted(ERROR_TYPES))
def test_every_error_travels_as_its_status_and_comes_back_as_itself(name):
    cls = ERROR_TYPES[name]
    assert cls.status_code in grpc.StatusCode.__members__, cls.status_code
    error = error_from_status(cls.status_code, "what went wrong", name)
    assert type(error) is cls and error.code == cls.status_code and error.error_type == name
    assert "what went wrong" in str(error)


def test_unknown_or_mismatched_error_types_fall_back_to_the_code():
    assert type(error_from_status("INTERNAL", "x", "SomethingNew")) is InternalError
    # A type that does not travel as this code is not trusted.
    assert type(error_from_status("INTERNAL", "x", "InvalidRequestError")) is InternalError
    assert type(error_from_status("NOT_FOUND", "x", "")) is protocol.EngineError


def test_sleep_level_accepts_only_the_two_levels():
    assert SleepLevel.parse(1) is SleepLevel.OFFLOAD_WEIGHTS
    assert SleepLevel.parse(SleepLevel.DISCARD_ALL) is SleepLevel.DISCARD_ALL
    for bad in (0, 3, True, "2", None):
        with pytest.raises(InvalidRequestError, match="sleep level"):
            SleepLevel.parse(bad)


def _top_level_definitions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def test_no_shared_type_or_constant_is_defined_twice():
    protocol_dir = REPO_ROOT / "rollout_engine/protocol"
    shared = {n for path in protocol_dir.glob("*.py") if path.name != "__init__.py"
              for n in _top_level_definitions(path) if not n.startswith("_")}
    literals = {protocol.SERVICE_NAME, protocol.ERROR_TYPE_KEY}
    offenders = []
    for package in ("rollout_engine", "trainer_bridge", "memory", "kernels", "benchmarks",
                    "examples"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path.parent == protocol_dir:
                continue
            for name in _top_level_definitions(path) & shared:
                offenders.append(f"{path.relative_to(REPO_ROOT)} defines {name}")
            for literal in literals:
                if f'"{literal}"' in path.read_text():
                    offenders.append(f"{path.relative_to(REPO_ROOT)} spells out {literal!r}")
    assert not offenders, offenders
