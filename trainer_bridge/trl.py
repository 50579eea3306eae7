"""The rollout engine as the generation backend of TRL's GRPOTrainer (and RLOOTrainer).

TRL's trainers call their backend's `sync_weights()` once per optimizer step and
`generate(prompts, images, num_generations, profiler)` once per turn, and apply the
importance-sampling correction of the sampled logprobs only when `trainer.use_vllm` is
true. `EngineGeneration` answers those two calls through an `EngineClient` (it has TRL's
backend shape, without subclassing TRL's private vLLM class), so the correction and the
whole vLLM code path run with no vLLM installed:

    from trainer_bridge.trl import EngineGRPOTrainer
    trainer = EngineGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, engine="127.0.0.1:50051")
    trainer.train()

The colocate choreography: the engine wakes and receives the trainer's weights before the
first turn of a generation step, stays awake through every turn (tool calls, multi-turn
`rollout_func`s), and sleeps when the trainer's model next runs a forward (a forward
pre-hook): TRL's scoring forward or the loss, whichever comes first. Weights stream
from the trainer into transport buckets one tensor at a time (`trainer_weights`): LoRA
adapters are merged while they stream, and no copy of the model is made.

Every generation setting of GRPOConfig is honoured or refused when the backend is built
(`check_generation_settings`): `generation_kwargs` takes every field of vLLM's SamplingParams
the engine has (stop strings, min_tokens, penalties, logit_bias, allowed_token_ids, bad_words,
`logprobs=k` for the top-k tokens per position, ...); the sampled token's logprob stays the
processed one that the importance-sampling correction needs. With several trainer processes
(`accelerate launch`), each process drives its own engine (one engine per device). Train in
the engine's precision, or pass `weight_dtype="engine"` to cast as the weights are sent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from trl import GRPOTrainer

from rollout_engine.protocol import (
    EngineError,
    RequestOutput,
    SamplingParams,
    SleepLevel,
    StructuredOutputsParams,
)
from trainer_bridge.client import EngineClient
from trainer_bridge.colocate import Colocation, StreamedWeights
from trainer_bridge.invariant_logps import check_batch_invariance
from trainer_bridge.lora_sync import PolicyAdapter
from trainer_bridge.trainer_weights import is_peft_model, is_sharded, iter_policy_weights
from trainer_bridge.trl_logps import EngineLogps, SamplingMasks, token_logprobs
from trainer_bridge.trl_routing import RoutingReplay

if TYPE_CHECKING:
    from trainer_bridge.timeline import MemoryTimeline

logger = logging.getLogger(__name__)
MULTI_TURN_KV_KEEP_ALIVE_S = 30.0
"""How long a tool-calling turn's KV is kept for the next turn (it also ends when that turn
arrives, and yields to any request that needs the blocks)."""
# Keys of TRL's `generation_kwargs` (vLLM SamplingParams fields) that the backend sets itself or
# that make no sense for a rollout, with the way out; every other SamplingParams field passes.
_REFUSED_GENERATION_KWARGS = {
    "n": "set GRPOConfig.num_generations instead",
    "kv_transfer_params": "prefill-decode disaggregation goes through DisaggregatedClient",
    "truncate_prompt_tokens": "the trainer computes its logprobs after the whole prompt, so "
                              "completions sampled after a truncated one would not match; "
                              "shorten the prompts in the dataset",
}
_GENERATION_KWARGS = frozenset(
    f.name for f in dataclasses.fields(SamplingParams)
) - _REFUSED_GENERATION_KWARGS.keys()
# GRPOConfig fields that configure vLLM itself or another generation path: the engine's own
# server options govern those, so anything but TRL's default is refused, with the way out.
_REFUSED_UNLESS_DEFAULT = {
    "vllm_tensor_parallel_size": (1, "serve the engine with the parallelism you need"),
    "vllm_max_model_length": (None, "start the engine with --max-model-len"),
    "vllm_gpu_memory_utilization": (0.3, "start the engine with --gpu-memory-utilization"),
    "vllm_model_impl": ("vllm", "the engine runs its own model implementation"),
    "use_transformers_continuous_batching": (False, "generation goes through the engine"),
    "use_transformers_paged": (False, "generation goes through the engine"),
    "cache_implementation": (None, "generation goes through the engine, not transformers"),
}


def check_generation_settings(args: Any) -> None:
    """Refuse, with the fix, every GRPOConfig generation setting the engine would ignore,
    and re-run the construction-time checks TRL runs only when built with use_vllm=True."""
    for name, (default, why) in _REFUSED_UNLESS_DEFAULT.items():
        value = getattr(args, name, default)
        if value != default:
            raise ValueError(f"GRPOConfig.{name}={value!r} is not supported with the rollout "
                             f"engine ({why}); leave it at its default {default!r}")
    _check_generation_kwargs(args)
    mode = getattr(args, "vllm_importance_sampling_mode", None)
    if (getattr(args, "loss_type", None) == "vespo"
            and getattr(args, "vllm_importance_sampling_correction", False)
            and mode not in ("token_truncate", "token_mask")):
        raise ValueError("VESPO loss requires `vllm_importance_sampling_mode` to be either "
                         f"'token_truncate' or 'token_mask'. Got: {mode}.")


def _check_generation_kwargs(args: Any) -> None:
    """Refuse the `generation_kwargs` the engine would not honour, naming them, and values it
    would refuse at the first generation."""
    kwargs = dict(getattr(args, "generation_kwargs", None) or {})
    for name, why in _REFUSED_GENERATION_KWARGS.items():
        if name in kwargs:
            raise ValueError(f"generation_kwargs[{name!r}] is not supported with the rollout "
                             f"engine: {why}")
    unknown = sorted(set(kwargs) - _GENERATION_KWARGS)
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} are not supported by the rollout engine; "
                         f"supported: {sorted(_GENERATION_KWARGS)}")
    if (kwargs.get("logprobs_mode", "processed_logprobs") != "processed_logprobs"
            and getattr(args, "vllm_importance_sampling_correction", False)):
        raise ValueError(
            f"generation_kwargs['logprobs_mode']={kwargs['logprobs_mode']!r} with the "
            "importance-sampling correction: the correction needs the logprobs of the "
            "distribution each token was sampled from ('processed_logprobs', the default); "
            "drop logprobs_mode or set vllm_importance_sampling_correction=False"
        )
    # A bad value is refused now, with the reason (max_tokens: min_tokens is checked against it).
    probe = {"max_tokens": getattr(args, "max_completion_length", None) or 2**31 - 1,
             **_engine_kwargs(kwargs)}
    SamplingParams(**{k: v for k, v in probe.items() if v is not None})


def _engine_kwargs(generation_kwargs: dict[str, Any]) -> dict[str, Any]:
    """`generation_kwargs` as SamplingParams takes them: a `structured_outputs` dict (as
    TRL passes it to vLLM) becomes StructuredOutputsParams."""
    kwargs = dict(generation_kwargs)
    if isinstance(kwargs.get("structured_outputs"), dict):
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return kwargs


class EngineGeneration:
    """TRL's generation-backend interface (`sync_weights`, `generate`) backed by an engine.

    `end_rollout()` puts the engine to sleep; it runs by itself when the trainer's model
    next runs a forward after a generation. Weight gathering is collective under
    ZeRO-3/FSDP, so every process calls `sync_weights` together (TRL does, once per step).
    """

    def __init__(
        self,
        client: EngineClient,
        model: torch.nn.Module,
        accelerator: Any,
        args: Any,
        *,
        sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
        timeline: MemoryTimeline | None = None,
        generate_timeout_s: float | None = None,
        transport: str = "auto",
        weight_dtype: torch.dtype | Literal["engine"] | None = None,
        lora_sync: bool | None = None,
    ) -> None:
        check_generation_settings(args)
        self.model, self.accelerator, self.args = model, accelerator, args
        self.colocation = Colocation(client, sleep_level=sleep_level, timeline=timeline,
                                     transport=transport, weight_dtype=weight_dtype)
        self.weights = StreamedWeights(lambda: iter_policy_weights(model, accelerator))
        self.policy_adapter = _policy_adapter(model, accelerator, client, lora_sync,
                                              sleep_level)
        """A PEFT policy on an engine with LoRA enabled: each sync pushes only the adapter,
        and generation runs under it (`lora_sync`: None decides so by itself)."""
        self.generate_timeout_s = generate_timeout_s
        self.last_weight_versions: set[int] = set()
        """Weight versions that produced the last rollout's completions."""
        self.last_outputs: list[RequestOutput] = []
        """The last rollout, as the engine returned it (routing replay reads its experts)."""
        self.return_sampling_mask = False
        """Ask for each token's sampling support (`EngineGRPOTrainer(sampling_masks=True)`)."""
        self.kv_keep_alive_s = 0.0
        """Multi-turn (the trainer has tools or environments): each turn asks the engine to
        keep its KV for the next turn this long (`SamplingParams.kv_keep_alive_s`)."""
        self._check_dtype(weight_dtype)
        self._is_rolling_out = False
        self._forward_hook = model.register_forward_pre_hook(_SleepOnForward(self))

    def attach(self, client: EngineClient) -> None:
        """Generate with `client`'s engine from now on (e.g. a restarted one); the trainer's
        weights are pushed to it before its first generation."""
        self.colocation.attach(client)

    @property
    def client(self) -> EngineClient:
        return self.colocation.client

    @property
    def timeline(self) -> MemoryTimeline | None:
        return self.colocation.timeline

    # ---------------------------------------------------------------------- TRL's interface
    def sync_weights(self) -> None:
        """Wake the weights, stream the trainer's (merged, gathered) into the engine, reset
        the prefix cache."""
        with _engine_context(self.client, "pushing weights"):
            if self.policy_adapter is not None:
                self.colocation.sync_adapter(self.policy_adapter)
            else:
                self.colocation.sync_weights(self.weights)

    def generate(
        self,
        prompts: list[list[int]],
        images: list | None,
        num_generations: int,
        profiler: contextlib.AbstractContextManager | None = None,
    ) -> tuple[list[list[int]], list[list[int]], list[list[list[float]]], list[list[list[int]]]]:
        """(prompt_ids, completion_ids, logprobs, logprob_token_ids), one row per completion;
        `logprobs[i][t][0]` is the sampled token's logprob under the processed distribution,
        followed, with `generation_kwargs["logprobs"]=k`, by the other top-k tokens' (most
        likely first; `logprob_token_ids` names them). The engine stays awake afterwards: the
        next turn needs it, and `end_rollout` (the trainer's next forward) puts it to sleep."""
        if images is not None and any(i is not None for i in images):
            raise NotImplementedError("the rollout engine serves text-only models; got images")
        if self.colocation.needs_weights:
            if is_sharded(self.accelerator):  # gathering alone would wait for the other ranks
                raise RuntimeError("the engine needs the trainer's weights but sync_weights() "
                                   "was not called this step; with sharded weights every rank "
                                   "must call it together")
            self.sync_weights()
        groups = _group_repeats(prompts)
        with _engine_context(self.client, "generating"):
            client = self.colocation.prepare_rollout()
            self._is_rolling_out = True
            max_model_len = None
            if self.args.max_completion_length is None:
                max_model_len = client.info().max_model_len
            params = [self._sampling_params(n, len(p), max_model_len) for p, n in groups]
            with self.colocation.generate_phase(), profiler or contextlib.nullcontext():
                lora_name = "" if self.policy_adapter is None else self.policy_adapter.lora_name
                outputs = client.generate([p for p, _ in groups], params,
                                          timeout=self.generate_timeout_s, lora_name=lora_name)
        self.last_weight_versions = {c.weight_version for o in outputs for c in o.outputs}
        self.last_outputs = outputs
        prompt_ids, completion_ids, logprobs, token_ids = [], [], [], []
        for output in outputs:
            for completion in output.outputs:
                prompt_ids.append(list(output.prompt_token_ids))
                completion_ids.append(list(completion.token_ids))
                rows, id_rows = token_logprobs(completion)
                logprobs.append(rows)
                token_ids.append(id_rows)
        assert len(completion_ids) == len(prompts), (len(completion_ids), len(prompts))
        return prompt_ids, completion_ids, logprobs, token_ids

    def end_rollout(self) -> None:
        """The generation step is over (the trainer needs the memory now): sleep."""
        self._is_rolling_out = False
        with _engine_context(self.client, "going to sleep"):
            self.colocation.sleep()
        self.colocation.begin_training()

    def close(self) -> None:
        """Stop following the trainer's forwards."""
        self._forward_hook.remove()

    def on_trainer_forward(self) -> None:
        if self._is_rolling_out:
            self.end_rollout()

    # --------------------------------------------------------------------------- internals
    def _sampling_params(
        self, n: int, prompt_len: int, max_model_len: int | None
    ) -> SamplingParams:
        args = self.args
        max_tokens = args.max_completion_length
        if max_tokens is None:  # as vLLM: up to the model length
            max_tokens = max(max_model_len - prompt_len, 1)
        fields = {
            "n": n,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k if args.top_k and args.top_k > 0 else -1,
            "min_p": args.min_p or 0.0,
            "repetition_penalty": args.repetition_penalty,
            "max_tokens": max_tokens,
            "kv_keep_alive_s": self.kv_keep_alive_s,
            "return_sampling_mask": self.return_sampling_mask,
        }
        fields.update(_engine_kwargs(args.generation_kwargs or {}))
        regex = getattr(args, "vllm_structured_outputs_regex", None)
        if regex:  # TRL's one structured-outputs setting; as in TRL, it wins over the kwargs
            fields["structured_outputs"] = StructuredOutputsParams(regex=regex)
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def _check_dtype(self, weight_dtype: torch.dtype | str | None) -> None:
        """Refuse now, not at the first sync, weights the engine would refuse for their dtype."""
        if weight_dtype is not None:
            return
        engine_dtype = self.client.info().dtype
        dtypes = {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()
                  if p.is_floating_point()}
        if dtypes - {engine_dtype}:
            raise ValueError(
                f"the trainer's weights are {sorted(dtypes)} but the engine serves "
                f"{engine_dtype}; pass weight_dtype='engine' to cast them as they are sent, "
                f"or serve the engine with --dtype {min(dtypes)}"
            )


class _SleepOnForward:
    """The forward pre-hook that ends a rollout. A copy of the model (a reference model,
    `copy.deepcopy`) gets a hook that does nothing: only the trained model ends rollouts."""

    def __init__(self, backend: EngineGeneration) -> None:
        self._backend = weakref.ref(backend)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        backend = self._backend()
        if backend is not None:
            backend.on_trainer_forward()

    def __deepcopy__(self, memo: dict) -> _NoHook:
        return _NoHook()

    def __reduce__(self) -> tuple:
        return (_NoHook, ())


class _NoHook:
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        return None


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


def _policy_adapter(model: torch.nn.Module, accelerator: Any, client: EngineClient,
                    lora_sync: bool | None, sleep_level: SleepLevel | int | None
                    ) -> PolicyAdapter | None:
    """The adapter to sync unmerged, or None to sync merged weights. Auto (None): a PEFT model,
    not sharded, and an engine serving with LoRA enabled."""
    if lora_sync is False:
        return None
    unwrapped = accelerator.unwrap_model(model) if accelerator is not None else model
    engine_lora = client.info().config.get("lora_config", {}).get("enable_lora", False)
    usable = is_peft_model(unwrapped) and not is_sharded(accelerator) and engine_lora
    if lora_sync and not usable:
        raise ValueError("lora_sync=True needs a PEFT model (not sharded by ZeRO-3 / FSDP) and "
                         "an engine serving with --enable-lora")
    if usable and sleep_level == SleepLevel.DISCARD_ALL:
        logger.warning("a LoRA policy synced unmerged with sleep_level=2: the engine discards "
                       "its base weights at every sleep, so every step pushes them again; "
                       "sleep_level=1 keeps them and pushes only the adapter")
    return PolicyAdapter(unwrapped) if usable else None


def attach_engine(
    trainer: Any,
    engine: EngineClient | str,
    *,
    sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
    timeline: MemoryTimeline | None = None,
    generate_timeout_s: float | None = None,
    transport: str = "auto",
    auth_token: str | None = None,
    weight_dtype: torch.dtype | Literal["engine"] | None = None,
    lora_sync: bool | None = None,
) -> EngineGeneration:
    """Make `trainer` (a GRPOTrainer or RLOOTrainer built with `use_vllm=False`) generate
    through the engine, as it would through vLLM; call again to switch to another engine."""
    client = EngineClient(engine, auth_token=auth_token) if isinstance(engine, str) else engine
    backend = getattr(trainer, "vllm_generation", None)
    if isinstance(backend, EngineGeneration):
        backend.attach(client)
        trainer._last_loaded_step = -1  # TRL syncs before its next generation
        return backend
    if getattr(trainer, "use_vllm", False):
        raise ValueError("the trainer already uses vLLM; build it with use_vllm=False")
    backend = EngineGeneration(
        client, trainer.model, trainer.accelerator, trainer.args, sleep_level=sleep_level,
        timeline=timeline, generate_timeout_s=generate_timeout_s, transport=transport,
        weight_dtype=weight_dtype, lora_sync=lora_sync,
    )
    _warn_on_precision_gap(trainer.args, client)
    if getattr(trainer, "tools", None):  # TRL's tool loop: turn k+1 extends turn k's tokens
        backend.kv_keep_alive_s = MULTI_TURN_KV_KEEP_ALIVE_S
    trainer.vllm_generation = backend
    trainer.use_vllm = True  # turns on TRL's vLLM path, importance-sampling correction included
    trainer.vllm_mode = "server"  # the engine runs in its own process, like a vLLM server
    trainer._last_loaded_step = -1  # TRL syncs weights when global_step differs from it
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


class EngineGRPOTrainer(RoutingReplay, SamplingMasks, EngineLogps, GRPOTrainer):
    """`GRPOTrainer` that generates with the rollout engine at `engine` (a client or an
    address), in TRL's colocate choreography: wake the weights, push them, reset the prefix
    cache, wake the KV cache, generate (every turn), sleep(`sleep_level`) when the trainer's
    model next runs a forward, train. A PEFT (LoRA) policy on an engine serving with
    --enable-lora is synced unmerged: only the adapter each step (`lora_sync`; the base only
    when the engine may not hold it, so sleep at level 1 to keep it). `routing_replay`: a MoE
    policy's forwards replay the experts the engine routed each token to (`trl_routing.py`);
    `sampling_masks`: every logprob is renormalised over the engine's supports (`trl_logps.py`)."""

    def __init__(
        self,
        *args: Any,
        engine: EngineClient | str,
        sleep_level: SleepLevel | int | None = SleepLevel.DISCARD_ALL,
        timeline: MemoryTimeline | None = None,
        generate_timeout_s: float | None = None,
        transport: str = "auto",
        auth_token: str | None = None,
        weight_dtype: torch.dtype | Literal["engine"] | None = None,
        batch_invariant: bool = False,
        lora_sync: bool | None = None,
        routing_replay: bool = False,
        sampling_masks: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.batch_invariant = batch_invariant
        """TRL's logprob and loss forwards in batch-invariant mode (`invariant_logps.py`):
        needs, and is needed by, an engine serving with --batch-invariant."""
        self.routing_replay = routing_replay
        """Replay the engine's routed experts (needs --enable-return-routed-experts)."""
        self.sampling_masks = sampling_masks
        self.engine_generation = attach_engine(
            self, engine, sleep_level=sleep_level, timeline=timeline,
            generate_timeout_s=generate_timeout_s, transport=transport, auth_token=auth_token,
            weight_dtype=weight_dtype, lora_sync=lora_sync,
        )
        check_batch_invariance(batch_invariant, self.engine_generation.colocation.client,
                               self.args)
        self.check_routing_replay_setup(self.engine_generation.colocation.client)
        self.check_sampling_masks_setup()

    def attach_engine(self, engine: EngineClient | str, auth_token: str | None = None) -> None:
        """Switch to another engine (e.g. a restarted one); it gets the weights first."""
        attach_engine(self, engine, auth_token=auth_token)
        check_batch_invariance(self.batch_invariant, self.engine_generation.colocation.client,
                               self.args)
        self.check_routing_replay_setup(self.engine_generation.colocation.client)

    def sync_engine_weights(self) -> int:
        """Push the current weights now (e.g. after training, to serve the final policy);
        the engine's new weight version."""
        self.engine_generation.sync_weights()
        self.engine_generation.colocation.wake_kv_cache()
        return self.engine_generation.colocation.weight_version
