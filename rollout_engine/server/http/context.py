"""What every HTTP route works with: the engine loop and admission it shares with gRPC, the
served model's names and limits, and a tokenizer of its own."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rollout_engine.config import is_loopback_host
from rollout_engine.processor import Processor
from rollout_engine.protocol import InvalidRequestError
from rollout_engine.server.http.errors import UnknownModelError

if TYPE_CHECKING:
    from fastapi import Request

    from rollout_engine.config import ServerConfig
    from rollout_engine.server.admission import Admission
    from rollout_engine.server.engine_loop import EngineLoop


@dataclass
class ServingContext:
    """Shared by the routes of one server (`request.app.state.serving`)."""

    engine_loop: EngineLoop
    admission: Admission
    """The one admission of the process: gRPC calls and HTTP requests count against it alike."""
    config: ServerConfig
    served_model_names: list[str]
    processor: Processor
    """A tokenizer of the front-end's own: prompts are tokenized here, on the event loop,
    never on the engine thread, and never through the engine's tokenizer object."""
    _ids: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def build(cls, engine_loop: EngineLoop, admission: Admission, config: ServerConfig,
              model_name: str) -> ServingContext:
        engine = engine_loop.engine
        names = list(config.served_model_names) or [model_name or engine.config.model_config.model]
        processor = Processor(engine.config.model_config.model, engine.hf_config)
        return cls(engine_loop, admission, config, names, processor)

    @property
    def engine(self):
        return self.engine_loop.engine

    @property
    def tokenizer(self):
        return self.processor.tokenizer

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.engine.limits.max_model_len

    @property
    def control_endpoints_enabled(self) -> bool:
        """vLLM's dev-mode endpoints: on loopback always, elsewhere when asked for."""
        return self.config.enable_control_endpoints or is_loopback_host(self.config.host)

    def next_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def check_model(self, model: str | None) -> None:
        """UnknownModelError (404) for a model this server does not serve; None is any."""
        if model is not None and model not in self.served_model_names:
            raise UnknownModelError(f"The model `{model}` does not exist; this server serves "
                                    f"{self.served_model_names}")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of a text prompt, as the engine would encode it."""
        if add_special_tokens:
            return self.processor.encode(text)[1]
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer; send token ids")
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        return token_ids


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
