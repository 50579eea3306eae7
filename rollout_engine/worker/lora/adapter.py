"""A PEFT LoRA adapter read and checked against the model it is to run on.

PEFT saves `adapter_config.json` and `adapter_model.safetensors` (or `adapter_model.bin`),
with tensors named `base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); a state dict taken from a live PEFT model names them `...lora_A.<adapter>.weight`.
Both are read. The delta of a module is `scaling * B @ A` with `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with rsLoRA), per module where `rank_pattern` / `alpha_pattern` say so.

MoE experts are adapted through PEFT's `target_parameters` (`["mlp.experts.gate_up_proj",
"mlp.experts.down_proj"]`): one `ParamWrapper` per 3-d parameter [experts, out, in], nested when
a module has two, so that the saved names are `<experts>.lora_A.weight` (the outer wrapper) and
`<experts>.base_layer.lora_A.weight` (the inner one), with lora_A [experts * r, in] (expert-major
rows) and lora_B [out, r * experts] (rank-major columns). Which parameter a pair adapts is told
by its shapes (gate|up reads the hidden size and writes 2 x the expert width, down the
reverse), not by the nesting, which depends on how PEFT sorted the names.

Everything an adapter could get wrong is refused here, whole, with LoRAError: what PEFT would
run differently from a plain unmerged delta (DoRA, trained biases, `modules_to_save`,
embedding or lm_head adapters, fan-in/fan-out weights) and what does not fit the model.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout_engine.protocol import LoRAError

_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
"""`<prefix><module>.lora_A[.<adapter name>].weight`."""
_CONFIG_FILE = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


_BASE_LAYER = ".base_layer"
"""What PEFT inserts into a module's name when it wraps a wrapped module (nested ParamWrappers)."""


@dataclass
class ModuleDelta:
    """One linear's low-rank delta: `scaling * b @ a`; for an experts parameter one per expert."""

    a: torch.Tensor
    """[r, in features]; experts: [experts, r, in features]."""
    b: torch.Tensor
    """[out features, r]; experts: [experts, out features, r]."""
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass
class LoRAWeights:
    """An adapter's deltas by module name (the model's own names, `model.layers.0.mlp.up_proj`),
    in host memory, in the model's dtype."""

    deltas: dict[str, ModuleDelta]

    @property
    def rank(self) -> int:
        return max(delta.rank for delta in self.deltas.values())

    @property
    def num_bytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.deltas.values())


def load_peft_adapter(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json's contents, its tensors by name) of a PEFT adapter directory."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
    config_path = os.path.join(path, _CONFIG_FILE)
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {config_path}: {exc}") from exc
    for name in _WEIGHT_FILES:
        weights_path = os.path.join(path, name)
        if os.path.exists(weights_path):
            break
    else:
        raise LoRAError(f"{path!r} holds none of {_WEIGHT_FILES}")
    try:
        if weights_path.endswith(".safetensors"):
            from safetensors.torch import load_file

            tensors = load_file(weights_path)
        else:
            tensors = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: say which
        raise LoRAError(f"cannot read {weights_path}: {exc}") from exc
    return config, tensors


def build_lora_weights(
    peft_config: Mapping[str, Any],
    tensors: Mapping[str, torch.Tensor],
    linears: Mapping[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    experts: Mapping[str, tuple[int, int, int]] | None = None,
) -> LoRAWeights:
    """Check an adapter (its PEFT config and tensors) against the model's LoRA-capable linears
    (`module name -> (in features, out features)`) and experts parameters (`<experts module>.
    <parameter> -> (experts, in features, out features)`), and return its deltas in `dtype`
    (tensors on the meta device are checked only: a pushed adapter's manifest)."""
    _check_config(peft_config)
    experts = experts or {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise LoRAError(f"adapter tensor {name!r} is not a LoRA A or B weight (embedding "
                            "adapters, DoRA magnitudes and saved modules are not supported)")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise LoRAError("the adapter holds no LoRA weights")
    deltas = {}
    for module, pair in sorted(pairs.items()):
        if module.endswith(_BASE_LAYER) or (module not in linears
                                            and _experts_params(module, experts)):
            name, delta = _experts_delta(module, pair, peft_config, experts, max_rank, dtype)
            if name in deltas:
                raise LoRAError(f"adapter adapts {name!r} twice")
        else:
            name = module
            delta = _module_delta(module, pair, peft_config, linears, max_rank, dtype)
        deltas[name] = delta
    return LoRAWeights(deltas)


def _check_config(config: Mapping[str, Any]) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    refusals = [
        (peft_type != "LORA", f"peft_type {peft_type!r} (only LORA)"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"trained biases (bias={config.get('bias')!r})"),
        (bool(config.get("modules_to_save")), "modules_to_save"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out weights"),
    ]
    for refused, what in refusals:
        if refused:
            raise LoRAError(f"LoRA adapters with {what} are not supported")


def _module_delta(
    module: str, pair: dict[str, torch.Tensor], config: Mapping[str, Any],
    linears: Mapping[str, tuple[int, int]], max_rank: int, dtype: torch.dtype,
) -> ModuleDelta:
    a, b = _a_and_b(module, pair)
    if module not in linears:
        raise LoRAError(
            f"adapter module {module!r} is not a linear layer (or experts module) this model "
            f"runs LoRA on (e.g. {next(iter(linears), 'none')!r}; embeddings and lm_head are not "
            "supported)"
        )
    in_features, out_features = linears[module]
    rank = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features \
            or b.shape != (out_features, rank):
        raise LoRAError(
            f"adapter module {module!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
            f"do not fit a [{out_features}, {in_features}] linear ([r, {in_features}] and "
            f"[{out_features}, r])"
        )
    return _delta(f"module {module!r}", module, a, b, rank, config, max_rank, dtype)


def _a_and_b(module: str, pair: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    if set(pair) != {"A", "B"}:
        missing = "B" if "A" in pair else "A"
        raise LoRAError(f"adapter module {module!r} has no lora_{missing} weight")
    return pair["A"], pair["B"]


def _delta(what: str, name: str, a: torch.Tensor, b: torch.Tensor, rank: int,
           config: Mapping[str, Any], max_rank: int, dtype: torch.dtype) -> ModuleDelta:
    """The delta of A and B (shapes checked), its rank and type checked, its scaling from the
    config (`alpha_pattern` matched against `name`), in `dtype` on the host."""
    if rank > max_rank:
        raise LoRAError(f"adapter {what} has rank {rank} > max_lora_rank {max_rank}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoRAError(f"adapter {what} holds non-float weights ({a.dtype})")
    alpha = float(_pattern_value(name, config.get("alpha_pattern") or {},
                                 config.get("lora_alpha", 8)))
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    if a.is_meta or b.is_meta:  # a manifest checked before its bytes come
        return ModuleDelta(a, b, scaling)
    return ModuleDelta(a.detach().to("cpu", dtype).contiguous(),
                       b.detach().to("cpu", dtype).contiguous(), scaling)


def _experts_params(module: str, experts: Mapping[str, tuple[int, int, int]]) -> list[str]:
    """The experts parameters of `module` (its PEFT name, `.base_layer`s stripped)."""
    while module.endswith(_BASE_LAYER):
        module = module[: -len(_BASE_LAYER)]
    return [name for name in experts if name.rpartition(".")[0] == module]


def _experts_delta(
    module: str, pair: dict[str, torch.Tensor], config: Mapping[str, Any],
    experts: Mapping[str, tuple[int, int, int]], max_rank: int, dtype: torch.dtype,
) -> tuple[str, ModuleDelta]:
    """(the parameter's name, its per-expert deltas) of a PEFT ParamWrapper's pair."""
    a, b = _a_and_b(module, pair)
    params = _experts_params(module, experts)
    if not params:
        raise LoRAError(f"adapter module {module!r} is not an experts module this model runs "
                        "LoRA on (experts with SiLU-gated, concatenated gate|up weights)")
    fits = [name for name in params if _fits_experts(a, b, *experts[name])]
    if len(fits) != 1:
        shapes = ", ".join(f"{name.rpartition('.')[2]} [{e} x r, {i}] / [{o}, r x {e}]"
                           for name, (e, i, o) in ((n, experts[n]) for n in params))
        raise LoRAError(f"adapter module {module!r}: lora_A {tuple(a.shape)} and lora_B "
                        f"{tuple(b.shape)} fit {'none' if not fits else 'more than one'} of its "
                        f"parameters ({shapes})")
    name = fits[0]
    num_experts, _, out_features = experts[name]
    rank = a.shape[0] // num_experts
    a = a.reshape(num_experts, rank, a.shape[1])  # rows are expert-major
    b = b.reshape(out_features, rank, num_experts).permute(2, 0, 1)  # columns rank-major
    return name, _delta(f"parameter {name!r}", name, a, b, rank, config, max_rank, dtype)


def _fits_experts(a: torch.Tensor, b: torch.Tensor, num_experts: int, in_features: int,
                  out_features: int) -> bool:
    return (a.dim() == 2 and b.dim() == 2 and a.shape[0] > 0
            and a.shape[0] % num_experts == 0 and a.shape[1] == in_features
            and tuple(b.shape) == (out_features, a.shape[0]))


def _pattern_value(module: str, pattern: Mapping[str, Any], default: Any) -> Any:
    """PEFT's per-module override: the first key that matches the module name's end."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
