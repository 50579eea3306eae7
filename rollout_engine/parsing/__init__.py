"""Reading a model's chat output: reasoning parsers and tool-call parsers (vLLM's names),
incremental, shared by the HTTP server and the offline API. Pure Python (no torch)."""

from rollout_engine.parsing.chat_parser import (  # noqa: F401
    REASONING_NAMES,
    TOOL_NAMES,
    ChatParser,
    ChatParsing,
)
from rollout_engine.parsing.messages import (  # noqa: F401
    MessageDelta,
    ParsedMessage,
    ToolCall,
    ToolCallDelta,
)
from rollout_engine.parsing.reasoning import REASONING_PARSERS  # noqa: F401
from rollout_engine.parsing.tool_choice import ToolChoicePlan, plan_tool_choice  # noqa: F401
from rollout_engine.parsing.tool_parsers import TOOL_PARSERS  # noqa: F401
