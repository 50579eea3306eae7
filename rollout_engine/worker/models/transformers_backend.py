"""Hugging Face's modeling code over our paged KV cache: the model registry's transformers backend.

transformers calls one attention function per layer through its `AttentionInterface`; ours
(`transformers_attention.py`) is registered under `ATTENTION_NAME`. For an attention
implementation it does not know,
transformers builds no mask, so the model runs on a packed ragged batch (`input_ids` and
`position_ids` of shape [1, T], `use_cache=False`, no HF cache object): each layer writes its
K/V into our paged blocks and every sequence attends over its own blocks, causally and within
its layer's sliding window.

A model is run only if it can be run exactly; else it is refused at load with the reason
(`check_config` from the config alone, `TransformersForCausalLM.check_runs` by a one-step probe):
never wrong tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import AttentionMetadata
from rollout_engine.protocol import ModelLoadError
from rollout_engine.worker.kv_cache_spec import LayerKVSpec
from rollout_engine.worker.lora.slots import LoRAPoint, LoRASlots
from rollout_engine.worker.models.decoder import sliding_windows_of
from rollout_engine.worker.models.experts import has_kernel_layout, use_our_experts
from rollout_engine.worker.models.tp_sharding import ShardSpec
from rollout_engine.worker.models.transformers_attention import (
    ATTENTION_NAME,
    AttentionCall,
    AttentionStep,
    register_attention,
    running,
)
from rollout_engine.worker.weights.checkpoint import (
    iterate_checkpoint_slices,
    load_weights,
    materialize_parameters,
)

if TYPE_CHECKING:
    from rollout_engine.worker.kv_cache_spec import PagedKVCache
    from rollout_engine.worker.weights.checkpoint import Allocator

_RECURRENT_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "lfm2", "lfm2_moe",
    "mamba", "mamba2", "minimax", "nemotron_h", "plamo2", "qwen3_next", "recurrent_gemma",
    "rwkv", "xlstm", "zamba", "zamba2",
})
"""Models with recurrent (state-space, linear-attention) layers, alone or mixed with
attention: their state is no KV cache."""
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_BATCH_DEPENDENT_ROPE_TYPES = frozenset({"dynamic", "longrope"})
_PROBE_NUM_TOKENS = 4


def check_config(config) -> None:
    """ModelLoadError saying why, for a config the backend cannot run exactly; what can only
    be seen by running the model is checked at load by `TransformersForCausalLM.check_runs`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    architecture = (getattr(config, "architectures", None) or [None])[0]
    causal_lm_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if getattr(config, "is_encoder_decoder", False) or causal_lm_class is None:
        raise ModelLoadError(
            f"{model_type} is not a decoder-only causal LM that transformers builds with "
            "AutoModelForCausalLM; the transformers backend runs only those"
        )
    if architecture is not None and architecture != causal_lm_class:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}: for model_type {model_type!r} "
            f"transformers builds {causal_lm_class}, the only architecture the transformers "
            "backend runs for it"
        )
    if config.get_text_config(decoder=True) is not config:
        raise ModelLoadError(
            f"{model_type} is a composite (e.g. multimodal) model; the transformers backend "
            "runs text-only decoders"
        )
    if getattr(config, "max_position_embeddings", None) is None:
        raise ModelLoadError(
            f"{model_type} gives no max_position_embeddings (ALiBi and other unbounded position "
            "schemes are not supported)"
        )
    if model_type in _RECURRENT_MODEL_TYPES:
        raise ModelLoadError(
            f"{model_type} has recurrent or hybrid (state-space / linear-attention) layers, "
            "whose state is no KV cache; the transformers backend runs attention-only models"
        )
    layer_types = set(getattr(config, "layer_types", None) or ())
    other_layer_types = sorted(layer_types - _ATTENTION_LAYER_TYPES)
    if other_layer_types:
        raise ModelLoadError(
            f"{model_type} has layers of type {other_layer_types}: only full and sliding-window "
            "attention layers run (recurrent, hybrid, linear or chunked attention do not)"
        )
    reason = _unsupported_attention(config)
    if reason is not None:
        raise ModelLoadError(
            f"{model_type}: {reason}, which the transformers backend does not run yet"
        )
    sliding_windows_of(config)  # a bad window is refused here, with the reason


def _unsupported_attention(config) -> str | None:
    """What in the config's attention our KV cache and kernels do not cover yet, if anything."""
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (carried by the attention mask)"
    batch_dependent_rope = sorted(_rope_types(config) & _BATCH_DEPENDENT_ROPE_TYPES)
    if batch_dependent_rope:
        # transformers picks their frequencies from the largest position in the forward's
        # batch: in a packed batch, another sequence's length would change this one's RoPE.
        return f"RoPE scaling {batch_dependent_rope} that follows the batch's longest sequence"
    return None


def _rope_types(config) -> set[str]:
    """The RoPE types the config names: one, or one per layer type (Gemma 3)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer_type = [p for p in params.values() if isinstance(p, dict)]
    return {p.get("rope_type", p.get("type", "default")) for p in per_layer_type or [params]}


def num_kv_shared_layers_of(config) -> int:
    """Layers the config says read an earlier layer's KV (Gemma 3n's last layers)."""
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is not None:
        return sum(mode == "reuse" for mode in modes)
    return getattr(config, "num_kv_shared_layers", None) or 0


# ---------------------------------------------------------------------------- the model
class TransformersForCausalLM(nn.Module):
    """A Hugging Face `*ForCausalLM` behind the native decoder's interface: `forward` on a flat
    ragged batch over the paged KV cache, `compute_logits` on the sampled rows.

    The HF model's children are registered here under their own names, so parameter names
    are the HF model's (and the checkpoint's): loading and weight updates need no mapping.
    Built on the meta device; `materialize` gives it storage, `load_checkpoint` the
    checkpoint's values, and `check_runs` probes that it runs exactly. Replicated only:
    no tensor parallelism in this slice.
    """

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        register_attention()
        config = copy.deepcopy(hf_config)  # from_config writes the dtype and attention into it
        try:
            with torch.device("meta"):
                causal_lm = AutoModelForCausalLM.from_config(
                    config, attn_implementation=ATTENTION_NAME, dtype=dtype
                )
        except KeyError as exc:
            if exc.args == (ATTENTION_NAME,):  # e.g. Falcon: an attention class per name
                raise ModelLoadError(_not_through_interface(config.model_type)) from exc
            raise ModelLoadError(f"transformers cannot build {config.model_type}: {exc}") from exc
        except (ValueError, ImportError) as exc:
            raise ModelLoadError(f"transformers cannot build {config.model_type}: {exc}") from exc
        causal_lm.eval()  # inference: no dropout (GPT-2's resid_pdrop...)
        use_our_experts(causal_lm)
        for name, child in causal_lm.named_children():
            self.add_module(name, child)
        # Not a submodule (its children are ours already, under their names): the probe runs
        # its whole forward once, to compare its logits with ours.
        self.__dict__["_causal_lm"] = causal_lm  # bypasses nn.Module's registration
        self.config = causal_lm.config
        self.dtype = dtype
        self.sliding_windows = sliding_windows_of(config)
        self.layer_kv_specs: list[LayerKVSpec] = []
        """Per layer its KV as the load probe saw it (`check_runs` fills it)."""
        self._base_model_name = _child_name(causal_lm, causal_lm.base_model)
        self._output_embeddings_name = _submodule_name(causal_lm, causal_lm.get_output_embeddings())
        # What the HF CausalLM's forward does to the output embeddings' logits: Cohere
        # multiplies by `logit_scale`, Granite divides by `logits_scaling`, Gemma softcaps.
        self._logits_scale = (getattr(config, "logit_scale", None) or 1.0) / (
            getattr(config, "logits_scaling", None) or 1.0
        )
        self._final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The HF decoder's list of layers (`layers`, GPT-2's `h`, OPT's `decoder.layers`...)."""
        for module in self.base_model.modules():
            if isinstance(module, nn.ModuleList) and len(module) == self.num_layers:
                return module
        raise AttributeError(f"{self.config.model_type} has no list of {self.num_layers} layers")

    @property
    def base_model(self) -> nn.Module:
        """The HF decoder stack (e.g. `LlamaModel`), without the output embeddings."""
        return self.get_submodule(self._base_model_name)

    @property
    def output_embeddings(self) -> nn.Module:
        return self.get_submodule(self._output_embeddings_name)

    @property
    def logits_weight(self) -> torch.Tensor:
        """The [vocab, hidden] weight of the logits (the input embedding's when tied)."""
        return self.output_embeddings.weight

    def materialize(self, allocate: Allocator, device: torch.device) -> None:
        """Give the meta-device model real storage: parameters from `allocate` (the weights
        pool), uninitialised until the checkpoint is loaded; buffers (RoPE's `inv_freq`,
        Gemma's `embed_scale`) on `device`, outside the pool, because they are no weights:
        sleep level 2 discards the pool and updates never send them. Buffers get their
        values as `from_pretrained` gives them: its `_init_weights` of their module."""
        materialize_parameters(self, self.dtype, allocate)
        for module_name, module in self.named_modules():
            if not any(buffer is not None for buffer in module._buffers.values()):
                continue
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = _unset_like(buffer, device)
            with torch.no_grad():
                self._initializer_of(module_name)._init_weights(module)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and buffer.isnan().any():
                    raise ModelLoadError(
                        f"transformers does not initialise the buffer {module_name}.{name} of "
                        f"{self.config.model_type} outside from_pretrained; not supported yet"
                    )

    def _initializer_of(self, module_name: str) -> nn.Module:
        """The model whose `_init_weights` `from_pretrained` applies to a module: the innermost
        `PreTrainedModel` holding it (Gemma 3n's text model inits its own buffers)."""
        from transformers import PreTrainedModel

        initializer: nn.Module = self._causal_lm
        parts = module_name.split(".") if module_name else []
        for i in range(1, len(parts) + 1):
            candidate = self.get_submodule(".".join(parts[:i]))
            if isinstance(candidate, PreTrainedModel):
                initializer = candidate
        return initializer

    def load_checkpoint(self, model_dir: str) -> None:
        """Load the checkpoint's tensors into the parameters of the same name
        (`checkpoint.load_weights`). Names are the checkpoint's after the renames transformers
        applies on load (GPT-NeoX's `embed_out` is its `lm_head`), streamed from the files.
        A model whose tensors transformers converts on load (MoE experts fused into one
        tensor per layer) is loaded by transformers itself first, on the host, and copied
        from there: its conversions are the truth, at the cost of one host copy while loading."""
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        conversions = extract_weight_conversions_for_model(self._causal_lm) or []
        renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        if len(renamings) == len(conversions):
            checkpoint = iterate_checkpoint_slices(model_dir)
            load_weights(self, ((apply_renamings(name, renamings), t) for name, t in checkpoint))
            return
        load_weights(self, self._converted_checkpoint(model_dir))

    def _converted_checkpoint(self, model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every parameter of the model transformers loads from `model_dir`
        (on the host, in this model's dtype), converted as its `from_pretrained` converts."""
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.dtype, attn_implementation=ATTENTION_NAME
        )
        try:
            yield from loaded.named_parameters()
        finally:
            del loaded

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_caches: per layer (key_cache, value_cache) as
        `layer_kv_specs` says -> [T, hidden]."""
        step = AttentionStep(self.sliding_windows, kv_caches.spec.layers, kv_caches, metadata)
        with running(step):
            return self._hidden_states(input_ids, positions)

    def _hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.base_model(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False
        )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] -> float32 logits [R, vocab], as the HF CausalLM computes them."""
        logits = self.output_embeddings(hidden).float()
        if self._logits_scale != 1.0:
            logits = logits * self._logits_scale
        if self._final_logit_softcapping is not None:
            cap = self._final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attach_lora(self, slots: LoRASlots, max_rank: int, dtype: torch.dtype) -> None:
        """A LoRA point on every `nn.Linear` but the output embeddings, under its HF (and
        PEFT) module name: a forward hook adds the step's deltas to its output; and one on
        every experts module our kernels compute (PEFT's `target_parameters`), which runs the
        module's forward when the step's adapters target it (`experts.experts_forward`)."""
        output_embeddings = self.output_embeddings
        for name, module in self.named_modules():
            if type(module) is nn.Linear and module is not output_embeddings:
                point = slots.add_point([name], module.in_features, [module.out_features],
                                        max_rank, dtype)
                module.register_forward_hook(_lora_hook(point))
            elif has_kernel_layout(module):
                num_experts, twice_intermediate, hidden = module.gate_up_proj.shape
                module.lora_experts = slots.add_experts_point(
                    name, num_experts, hidden, twice_intermediate // 2, max_rank, dtype)

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Every parameter whole (replicated): no tensor parallelism in this backend yet."""
        return {name: ShardSpec(tuple(p.shape)) for name, p in self.named_parameters()}

    @torch.inference_mode()
    def check_runs(self) -> None:
        """The load probe: one tiny forward with the attention function recording its calls.
        ModelLoadError unless every layer's attention went through it once, with nothing our
        kernels do not compute (a mask, ALiBi...), and logits equal to the HF CausalLM's own.
        Sets `layer_kv_specs` from what the calls carried: each layer's KV heads and K / V
        head dims, and the earlier layer whose K/V tensors it was handed (shared KV)."""
        device = self.logits_weight.device
        input_ids = torch.arange(_PROBE_NUM_TOKENS, device=device) % self.config.vocab_size
        positions = torch.arange(_PROBE_NUM_TOKENS, device=device)
        step = AttentionStep(self.sliding_windows)
        with running(step):
            try:
                logits = self.compute_logits(self._hidden_states(input_ids, positions))
            except Exception as exc:  # the model's own code failed: refused, with its error
                where = "before its first attention call" if not step.probe_calls else ""
                raise ModelLoadError(
                    f"{self.config.model_type} fails on a packed batch without an attention "
                    f"mask{' ' + where if where else ''}: {type(exc).__name__}: {exc}"
                ) from exc
            self.layer_kv_specs = self._check_calls(step.probe_calls)
            step.probe_calls.clear()
            reference = self._causal_lm(
                input_ids=input_ids[None], position_ids=positions[None], use_cache=False
            ).logits[0].float()
        tolerance = 1e-4 if self.dtype == torch.float32 else 3e-2
        scale = max(1.0, reference.abs().max().item())
        if logits.shape != reference.shape or not torch.allclose(
            logits, reference, rtol=tolerance, atol=tolerance * scale
        ):
            raise ModelLoadError(
                f"the logits of {self.config.model_type}'s CausalLM differ from its output "
                "embeddings' (it transforms them in a way the transformers backend does not know)"
            )

    def _check_calls(self, calls: list[AttentionCall]) -> list[LayerKVSpec]:
        """Each layer's KV spec from its probe call; ModelLoadError for what we cannot run."""
        model_type = self.config.model_type
        layer_ids = [call.layer_idx for call in calls]
        if sorted(i for i in layer_ids if i is not None) != list(range(self.num_layers)) or (
            None in layer_ids
        ):
            raise ModelLoadError(
                f"{_not_through_interface(model_type)} ({len(calls)} calls for "
                f"{self.num_layers} layers, layer ids {layer_ids[:8]})"
            )
        calls = sorted(calls, key=lambda call: call.layer_idx)
        specs: list[LayerKVSpec] = []
        for call in calls:
            where = f"{model_type} layer {call.layer_idx}"
            if call.unsupported:
                raise ModelLoadError(
                    f"{where}: its attention asks for {list(call.unsupported)}, which the "
                    "transformers backend does not compute"
                )
            window = self.sliding_windows[call.layer_idx]
            if call.sliding_window != window:
                # Its mask (which transformers builds for the other implementations) is what
                # decides; a model whose attention is told another window than its config's
                # (Moshi: a window in the config, a full causal mask) cannot be read safely.
                raise ModelLoadError(
                    f"{where}: its attention gets sliding_window={call.sliding_window} while "
                    f"the config gives the layer {window}; which one its attention mask uses "
                    "cannot be told"
                )
            source = _kv_source(call, calls[: call.layer_idx], where)
            specs.append(LayerKVSpec(call.num_kv_heads, call.key_head_dim, call.value_head_dim,
                                     window, source if source != call.layer_idx else None))
        num_shared = sum(not spec.owns_kv for spec in specs)
        if num_shared != num_kv_shared_layers_of(self.config):
            raise ModelLoadError(
                f"{model_type}: {num_shared} layers were handed an earlier layer's K/V, the "
                f"config says {num_kv_shared_layers_of(self.config)} share KV; KV sharing that "
                "does not pass the same tensors is not supported"
            )
        return specs


def _lora_hook(point: LoRAPoint):
    def add_deltas(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        if point.step.groups:  # the HF module runs on [1, T, features]
            x = args[0]
            point.add(x.reshape(-1, x.shape[-1]), (out.view(-1, out.shape[-1]),))

    return add_deltas


def _kv_source(call: AttentionCall, earlier: list[AttentionCall], where: str) -> int:
    """The layer whose K/V tensors `call` got: itself, or the earlier layer that computed them
    (shared KV). The probe keeps every call's tensors alive, so equal addresses are the same
    tensor, never reused memory."""
    for other in earlier:
        same_key = call.key.data_ptr() == other.key.data_ptr()
        same_value = call.value.data_ptr() == other.value.data_ptr()
        if same_key and same_value and call.key.shape == other.key.shape:
            return other.layer_idx
        if same_key or same_value:
            raise ModelLoadError(
                f"{where}: it shares only one of K and V with layer {other.layer_idx}; not "
                "supported"
            )
    return call.layer_idx


def _not_through_interface(model_type: str) -> str:
    return f"attention of {model_type} does not go through transformers' AttentionInterface"


def _unset_like(buffer: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A buffer's storage before `_init_weights`: NaN where it can be, so that one left unset
    is seen."""
    if buffer.is_floating_point():
        return torch.full_like(buffer, float("nan"), device=device)
    return torch.zeros_like(buffer, device=device)


def _child_name(parent: nn.Module, child: nn.Module) -> str:
    for name, module in parent.named_children():
        if module is child:
            return name
    raise ModelLoadError(f"{type(parent).__name__}'s base model is not one of its children")


def _submodule_name(parent: nn.Module, submodule: nn.Module | None) -> str:
    for name, module in parent.named_modules():
        if module is submodule and name:
            return name
    raise ModelLoadError(f"{type(parent).__name__} has no output embeddings module")
