"""What the output parsers make of streamed text: `DeltaMessage` and its parts.

The server streams a chat answer as OpenAI *deltas*: each chunk carries what
is new in the assistant message, split by where it belongs:

    {"content": "Paris"}                                       the answer's text
    {"reasoning": "The user asks..."}                          inside <think>...</think>
    {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-..", "type": "function",
                     "function": {"name": "get_weather", "arguments": ""}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": "}}]}

The reasoning parser (`mini_vllm.reasoning`) and the tool-call parser
(`mini_vllm.tool_parsers`) each turn the detokenizer's text pieces into these.
Both work on text, not token ids, so a tag split across pieces (`"<thi"`,
`"nk>"`) is recognised: the start of what may be a tag is held back until the
next piece decides (`held_back`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DeltaToolCall:
    """One piece of one tool call, as OpenAI streams it.

    The first piece of a call carries its `id` and `name`; later pieces carry
    more of `arguments` (a JSON text whose pieces, joined, are the whole).

    Attributes:
        index: which call of the message this piece belongs to (0, 1, ...).
        id: the call's id (first piece only).
        name: the function's name (first piece only).
        arguments: more of the arguments' JSON text ("" if none).
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI `delta.tool_calls[i]` object."""
        out: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            out["id"], out["type"] = self.id, "function"
        if self.name is not None:
            function["name"] = self.name
        out["function"] = function
        return out


@dataclass
class DeltaMessage:
    """What is new in the assistant message (empty parts are "" or [])."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        """False when there is nothing to send."""
        return bool(self.content or self.reasoning or self.tool_calls)


# --8<-- [start:held_back]
def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`.

    `held_back("so <thi", "<think>") == 4`: those 4 characters wait for the next
    piece; `held_back("a < b", "<think>") == 0`: nothing can grow into the tag.
    """
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
# --8<-- [end:held_back]


__all__ = ["DeltaMessage", "DeltaToolCall", "held_back"]
