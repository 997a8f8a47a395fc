"""Tool-call parsers (vLLM's `--tool-call-parser`) and `tool_choice` as a grammar."""

from __future__ import annotations

from mini_vllm.tool_parsers.hermes_tool_parser import (
    ExtractedToolCallInformation,
    HermesToolParser,
    ToolCall,
    make_tool_call_id,
)
from mini_vllm.tool_parsers.tool_choice import (
    tool_call_schema,
    tool_choice_structured_outputs,
    validate_tools,
)

# The names `--tool-call-parser` accepts.
TOOL_PARSERS = {"hermes": HermesToolParser}

__all__ = ["TOOL_PARSERS", "ExtractedToolCallInformation", "HermesToolParser", "ToolCall",
           "make_tool_call_id", "tool_call_schema", "tool_choice_structured_outputs",
           "validate_tools"]
