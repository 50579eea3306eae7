"""What every HTTP route works with: the `AsyncEngine` it shares with gRPC, the served model's
names and limits, and a tokenizer of its own, used off the event loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rollout_engine.config import is_loopback_host
from rollout_engine.engine.chat_template import (
    UNTRUSTED_TEMPLATE_MESSAGE,
    RenderedChat,
    render_chat,
)
from rollout_engine.engine.input_processor import InputProcessor
from rollout_engine.protocol import InvalidRequestError, LoRARequest
from rollout_engine.server.http.error_responses import UnknownModelError
from rollout_engine.server.http.metrics import VllmMetrics
from rollout_engine.server.http.off_loop import OffLoopPool

if TYPE_CHECKING:
    from fastapi import Request

    from rollout_engine.config import ServerConfig
    from rollout_engine.server.async_engine import AsyncEngine
    from rollout_engine.server.http.api_models import ChatCompletionRequest, TokenizeChatRequest

T = TypeVar("T")
MAX_CHAT_TEMPLATE_CHARS = 64 * 1024
"""The longest chat template a request may send (the templates of released models are a few
KiB; compiling one is work on the server)."""


@dataclass
class ServingContext:
    """Shared by the routes of one server (`request.app.state.serving`)."""

    engine: AsyncEngine
    """The one door to the engine: gRPC calls and HTTP requests share it (and its admission)."""
    config: ServerConfig
    served_model_names: list[str]
    processor: InputProcessor
    """A tokenizer of the front-end's own: prompts are tokenized here, off the event loop
    (`off_loop`), never on the engine thread, and never through the engine's tokenizer object."""
    metrics: VllmMetrics
    """vLLM's `vllm:*` metric families of this server (`/metrics`)."""
    pool: OffLoopPool = field(default_factory=OffLoopPool)
    """Where templates are rendered and text is tokenized and detokenized."""

    @classmethod
    def build(cls, engine: AsyncEngine, config: ServerConfig) -> ServingContext:
        model = engine.model
        names = list(config.served_model_names) or [model.served_model_name]
        processor = InputProcessor(model.model, model.hf_config, model.max_model_len)
        return cls(engine, config, names, processor, VllmMetrics(names[0]))

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.model.max_model_len

    @property
    def control_endpoints_enabled(self) -> bool:
        """vLLM's dev-mode endpoints: on loopback always, elsewhere when asked for."""
        return self.config.enable_control_endpoints or is_loopback_host(self.config.host)

    async def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model (any of its
        names, or none given); UnknownModelError (404) for a model this server does not serve."""
        if model is None or model in self.served_model_names:
            return None
        if self.engine.model.config.lora_config.enable_lora:
            lora_request = await self.engine.lora_request(model)
            if lora_request is not None:
                return lora_request
        raise UnknownModelError(f"The model `{model}` does not exist; this server serves "
                                f"{self.served_model_names}")

    def answer_model(self, model: str | None) -> str:
        """The `model` an answer names: the adapter a request ran under (resolved already),
        else the first served name."""
        return model if model is not None and model not in self.served_model_names \
            else self.model_name

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the front-end's tokenizer threads (see off_loop.py)."""
        return await self.pool.run(fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True, fit_model: bool = True
               ) -> list[int]:
        """The token ids of a text prompt, as the engine would encode it; with `fit_model`, a
        text too long for the model in any tokenization is refused untokenized (a prompt to be
        truncated may be longer). Blocking: call it through `off_loop`."""
        token_ids = self.processor.encode_text(text, add_special_tokens, fit_model)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        return token_ids

    async def render_chat(self, request: ChatCompletionRequest | TokenizeChatRequest,
                          fit_model: bool = True) -> RenderedChat:
        """A chat request's prompt, rendered and tokenized off the event loop; its own
        `chat_template` only if the server trusts request templates."""
        template = request.chat_template
        if template is not None:
            if not self.config.trust_request_chat_template:
                raise InvalidRequestError(UNTRUSTED_TEMPLATE_MESSAGE)
            if len(template) > MAX_CHAT_TEMPLATE_CHARS:
                raise InvalidRequestError(
                    f"chat_template has {len(template)} characters; this server renders "
                    f"request templates of at most {MAX_CHAT_TEMPLATE_CHARS}")
        return await self.off_loop(render_chat, self.processor, request, fit_model)


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
