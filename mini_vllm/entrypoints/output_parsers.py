"""A chat choice's text, split into reasoning, content and tool calls (chapter 18).

The engine returns text. With `--reasoning-parser qwen3` the server takes the
`<think>` block out of it, and with tools it takes the `<tool_call>`s out of
what is left; each step works on the output of the one before:

```
text ─► Qwen3ReasoningParser ─► reasoning ──────────────────────► message.reasoning
                             └► content ─► HermesToolParser ─► content ─► message.content
                                                            └► calls ───► message.tool_calls
```

A whole answer goes through both parsers once, at the end (`parse_whole`); a
stream goes through them piece by piece (`parse_stream`), and the pieces join
to what the whole answer gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mini_vllm.delta import DeltaMessage, DeltaToolCall
from mini_vllm.reasoning import Qwen3ReasoningParser
from mini_vllm.tool_parsers import HermesToolParser, ToolCall


@dataclass
class ParsedMessage:
    """A whole assistant message, its parts apart (`None` for an empty part)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


# --8<-- [start:choice_parser]
class ChoiceParser:
    """The reasoning and tool-call parsers of one choice (either may be absent).

    Args:
        reasoning: splits the reasoning from the rest, or None.
        tools: takes tool calls out of the content, or None.
    """

    def __init__(self, reasoning: Qwen3ReasoningParser | None,
                 tools: HermesToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def parse_whole(self, text: str) -> ParsedMessage:
        """The parts of a whole answer."""
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning(text)
        if self.tools is None:
            return ParsedMessage(content, reasoning)
        found = self.tools.extract_tool_calls(content or "")
        return ParsedMessage(found.content, reasoning, found.tool_calls)

    def parse_stream(self, text: str, final: bool = False) -> DeltaMessage:
        """What the next piece of a streamed answer adds to each part; `final`: the
        answer ends with this piece (what the parsers held back comes out too)."""
        return self._through_tools(self._reasoning_step(text, final), final)

    @property
    def tools_called(self) -> bool:
        """The streamed answer held a complete tool call."""
        return self.tools is not None and self.tools.tools_called

    def _reasoning_step(self, text: str, final: bool) -> DeltaMessage:
        if self.reasoning is None:
            return DeltaMessage(content=text)
        out = self.reasoning.extract_reasoning_streaming(text)
        if final:
            rest = self.reasoning.finish_streaming()
            out.reasoning += rest.reasoning
            out.content += rest.content
        return out

    def _through_tools(self, delta: DeltaMessage, final: bool) -> DeltaMessage:
        if self.tools is None:
            return delta
        out = self.tools.extract_tool_calls_streaming(delta.content)
        if final:
            rest = self.tools.finish_streaming()
            out.content += rest.content
            out.tool_calls = _merged(out.tool_calls + rest.tool_calls)
        out.reasoning = delta.reasoning
        return out


def _merged(calls: list[DeltaToolCall]) -> list[DeltaToolCall]:
    """One piece per call: a piece that only adds arguments joins the one before it."""
    out: list[DeltaToolCall] = []
    for call in calls:
        if out and out[-1].index == call.index and call.id is None and call.name is None:
            out[-1].arguments += call.arguments
        else:
            out.append(call)
    return out
# --8<-- [end:choice_parser]


__all__ = ["ChoiceParser", "ParsedMessage"]
