"""The rollout engine as the generation backend of TRL's GRPOTrainer (and RLOOTrainer).

TRL's trainers call their backend's `sync_weights()` when the optimizer step changed and
`generate(prompts, images, num_generations, profiler)`, and apply the importance-sampling
correction of the sampled logprobs only when `trainer.use_vllm` is true. `EngineGeneration`
answers those calls through an `EngineClient`, so the correction and the whole vLLM code path
run with no vLLM installed:

    from trainer_bridge.trl import EngineGRPOTrainer
    trainer = EngineGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, engine="127.0.0.1:50051")
    trainer.train()

With several trainer processes (`accelerate launch`), each process drives its own engine
(one engine per device), passed as a per-process address; processes never share an engine.
Train in the engine's precision (`bf16=False` for an fp32 engine; TRL defaults to bf16) so
that the importance-sampling ratio measures policy staleness, not rounding.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from trl import GRPOTrainer
from trl.generation.vllm_generation import VLLMGeneration

from rollout_engine.protocol import EngineError, SamplingParams, SleepLevel
from trainer_bridge.client import EngineClient
from trainer_bridge.colocate import Colocation

if TYPE_CHECKING:
    from accelerate import Accelerator

    from trainer_bridge.timeline import MemoryTimeline

logger = logging.getLogger(__name__)
# Keys of TRL's `generation_kwargs` the engine understands (as SamplingParams fields).
_GENERATION_KWARGS = {"seed", "stop_token_ids", "ignore_eos", "top_k", "top_p", "min_p",
                      "temperature", "repetition_penalty", "max_tokens"}


class EngineGeneration(VLLMGeneration):
    """TRL's vLLM backend with the engine behind it. Weight gathering (DeepSpeed ZeRO-3,
    FSDP 1/2, PEFT merge) is TRL's own `_iter_named_params`; every process walks it, because
    gathering is collective, and pushes to its own engine."""

    def __init__(
        self,
        client: EngineClient,
        model: torch.nn.Module,
        accelerator: Accelerator,
        processing_class: Any,
        *,
        sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
        timeline: MemoryTimeline | None = None,
        generate_timeout_s: float | None = None,
        transport: str = "auto",
        **generation: Any,
    ) -> None:
        self.client = client
        self.colocation = Colocation(client, sleep_level=sleep_level, timeline=timeline,
                                     transport=transport)
        self.generate_timeout_s = generate_timeout_s
        self.last_weight_versions: set[int] = set()
        """Weight versions that produced the last rollout's completions."""
        super().__init__(model=model, accelerator=accelerator, processing_class=processing_class,
                         mode="server", **generation)
        unknown = sorted(set(self.generation_kwargs) - _GENERATION_KWARGS)
        if unknown:
            raise ValueError(f"generation_kwargs {unknown} are not supported by the rollout "
                             f"engine; supported: {sorted(_GENERATION_KWARGS)}")

    def _init_vllm(self) -> None:
        """Nothing to start: the engine is already serving."""

    def attach(self, client: EngineClient) -> None:
        """Generate with `client`'s engine from now on (e.g. a restarted one); the trainer's
        weights are pushed to it before its first generation."""
        self.client = client
        self.colocation.attach(client)

    @property
    def timeline(self) -> MemoryTimeline | None:
        return self.colocation.timeline

    # ---------------------------------------------------------------------- TRL's interface
    def sync_weights(self) -> None:
        """Wake the weights, push the trainer's (gathered when sharded), reset the prefix cache."""
        with _engine_context(self.client, "pushing weights"):
            self.colocation.sync_weights(self._gathered_params())

    def generate(
        self,
        prompts: list[list[int]],
        images: list | None,
        num_generations: int,
        profiler: contextlib.AbstractContextManager | None = None,
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]], list[list[list[int]]]]:
        """(prompt_ids, completion_ids, logprobs, logprob_token_ids), one row per completion;
        `logprobs[i][t][0]` is the sampled token's logprob under the processed distribution."""
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("the rollout engine serves text-only models; got images")
        if self.colocation.needs_weights:
            self.sync_weights()
        groups = _group_repeats(prompts)
        params = [self._sampling_params(n) for _, n in groups]
        with (_engine_context(self.client, "generating"), self.colocation.rollout() as client,
              profiler or contextlib.nullcontext()):
            outputs = client.generate([p for p, _ in groups], params,
                                      timeout=self.generate_timeout_s)
        self.colocation.begin_training()
        self.last_weight_versions = {c.weight_version for o in outputs for c in o.outputs}
        prompt_ids, completion_ids, logprobs, token_ids = [], [], [], []
        for output in outputs:
            for completion in output.outputs:
                prompt_ids.append(list(output.prompt_token_ids))
                completion_ids.append(list(completion.token_ids))
                logprobs.append([[lp] for lp in completion.logprobs])
                token_ids.append([[t] for t in completion.token_ids])
        assert len(completion_ids) == len(prompts), (len(completion_ids), len(prompts))
        return prompt_ids, completion_ids, logprobs, token_ids

    # --------------------------------------------------------------------------- internals
    def _sampling_params(self, n: int) -> SamplingParams:
        fields = dict(
            n=n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k and self.top_k > 0 else -1,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_completion_length,
        )
        fields.update(self.generation_kwargs)
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def _gathered_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, full tensor) pairs. A gathered shard is cloned: it is freed again when the
        gather scope ends, before the update is sent."""
        is_sharded = self._dist.is_zero3 or self._dist.is_fsdp
        return [(name, tensor.detach().clone() if is_sharded else tensor.detach())
                for name, tensor in self._iter_named_params()]


def _group_repeats(prompts: Sequence[list[int]]) -> list[tuple[list[int], int]]:
    """Runs of identical consecutive prompts as (prompt, count): TRL repeats each prompt
    num_generations times in a row, and n > 1 lets the engine share the prompt's KV."""
    groups: list[tuple[list[int], int]] = []
    for prompt in prompts:
        prompt = list(prompt)
        if groups and groups[-1][0] == prompt:
            groups[-1] = (prompt, groups[-1][1] + 1)
        else:
            groups.append((prompt, 1))
    return groups


@contextlib.contextmanager
def _engine_context(client: EngineClient, action: str) -> Iterator[None]:
    """Say which engine failed and what to do, on top of the client's typed error."""
    try:
        yield
    except EngineError as error:
        error.add_note(f"the rollout engine at {client.address} failed while {action}; if it "
                       "died, restart it and call attach_engine(trainer, new_client) (weights "
                       "are pushed again before the next generation)")
        raise


def attach_engine(
    trainer: Any,
    engine: EngineClient | str,
    *,
    sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
    timeline: MemoryTimeline | None = None,
    generate_timeout_s: float | None = None,
    transport: str = "auto",
    auth_token: str | None = None,
) -> EngineGeneration:
    """Make `trainer` (a GRPOTrainer or RLOOTrainer built with `use_vllm=False`) generate
    through the engine, as it would through vLLM; call again to switch to another engine."""
    client = EngineClient(engine, auth_token=auth_token) if isinstance(engine, str) else engine
    backend = getattr(trainer, "vllm_generation", None)
    if isinstance(backend, EngineGeneration):
        backend.attach(client)
        return backend
    if getattr(trainer, "use_vllm", False):
        raise ValueError("the trainer already uses vLLM; build it with use_vllm=False")
    args = trainer.args
    trainer.vllm_generation = backend = EngineGeneration(
        client, trainer.model, trainer.accelerator, trainer.processing_class,
        sleep_level=sleep_level, timeline=timeline, generate_timeout_s=generate_timeout_s,
        transport=transport,
        repetition_penalty=getattr(trainer, "repetition_penalty", args.repetition_penalty),
        temperature=getattr(trainer, "temperature", args.temperature),
        top_p=getattr(trainer, "top_p", args.top_p),
        top_k=getattr(trainer, "top_k", args.top_k),
        min_p=getattr(trainer, "min_p", args.min_p),
        max_completion_length=getattr(trainer, "max_completion_length",
                                      args.max_completion_length),
        generation_kwargs=args.generation_kwargs,
    )
    _warn_on_precision_gap(args, client)
    trainer.use_vllm = True  # turns on TRL's vLLM path, importance-sampling correction included
    trainer.vllm_mode = "server"  # the engine runs in its own process, like a vLLM server
    trainer._last_loaded_step = -1
    return backend


def _warn_on_precision_gap(args: Any, client: EngineClient) -> None:
    """bf16/fp16 autocast in the trainer against fp32 in the engine: the recomputed logprobs
    differ by ~1e-2 and the importance-sampling ratio measures that, not staleness."""
    is_mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    if is_mixed and client.info().dtype == "float32":
        logger.warning("the trainer computes in %s autocast but the engine in float32: the "
                       "importance-sampling correction will mostly measure the precision gap; "
                       "set bf16=False / fp16=False or serve the engine with --dtype bfloat16",
                       "bf16" if args.bf16 else "fp16")


class EngineGRPOTrainer(GRPOTrainer):
    """`GRPOTrainer` that generates with the rollout engine at `engine` (a client or an
    address), in TRL's colocate choreography: generate, sleep(`sleep_level`), train, wake the
    weights, push them, reset the prefix cache, wake the KV cache, generate again."""

    def __init__(
        self,
        *args: Any,
        engine: EngineClient | str,
        sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
        timeline: MemoryTimeline | None = None,
        generate_timeout_s: float | None = None,
        transport: str = "auto",
        auth_token: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.engine_generation = attach_engine(
            self, engine, sleep_level=sleep_level, timeline=timeline,
            generate_timeout_s=generate_timeout_s, transport=transport, auth_token=auth_token,
        )

    def attach_engine(self, engine: EngineClient | str, auth_token: str | None = None) -> None:
        """Switch to another engine (e.g. a restarted one); it gets the weights first."""
        attach_engine(self, engine, auth_token=auth_token)

    def sync_engine_weights(self) -> int:
        """Push the current weights now (e.g. after training, to serve the final policy);
        the engine's new weight version."""
        self.engine_generation.sync_weights()
        self.engine_generation.colocation.wake_kv_cache()
        return self.engine_generation.colocation.weight_version
