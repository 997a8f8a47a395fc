"""`HermesToolParser`: Qwen3's tool calls, out of its text and into OpenAI's shape.

Qwen3 calls a function by writing a JSON object between tags (the "Hermes"
format, which its chat template teaches it):

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}
    </tool_call>

The server returns that as `message.tool_calls` (vLLM's `--tool-call-parser
hermes`), with the text outside the tags as `content`:

    content: "Let me look that up."
    tool_calls: [{"id": "chatcmpl-tool-…", "type": "function",
                  "function": {"name": "get_weather",
                               "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}}]

`arguments` is the JSON text of the arguments exactly as the model wrote it.
Streaming sends the name as soon as it is complete, then the arguments as
they are written: every character of the `"arguments"` value is known to be
part of it once read, because a small scanner follows its brackets and
strings and stops where the value closes. Whitespace next to a tool-call
block is layout, not content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mini_vllm.delta import DeltaMessage, DeltaToolCall, held_back

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The head of a call up to where the arguments' value starts:
#   {"name": "get_weather", "arguments":<ws>
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def make_tool_call_id() -> str:
    """A fresh tool-call id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """A complete tool call (OpenAI's `message.tool_calls[i]`)."""

    id: str
    name: str
    arguments: str  # JSON text

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCallInformation:
    """What a whole output holds (vLLM's name).

    Attributes:
        tools_called: whether it holds at least one well-formed call.
        tool_calls: the calls, in order.
        content: the text outside the calls (`None` if empty); the whole
            output when a call is malformed.
    """

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


# --8<-- [start:arguments_scanner]
class _ValueScanner:
    """Follows a JSON object or array as it is written, to know where it ends.

    Outside strings, `{`/`[` open and `}`/`]` close; inside a string, a
    backslash escapes the next character. The value ends when depth is 0 again.
    """

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.done = 0, False, False, False

    def scan(self, text: str) -> int:
        """How many characters of `text` belong to the value (all, until it closes)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)
# --8<-- [end:arguments_scanner]


# --8<-- [start:splitter]
class _ToolCallSplitter:
    """The state machine: `text` <-> `call`, one call's text at a time."""

    def __init__(self) -> None:
        self.state = "text"
        self.buf = ""  # text not yet decided
        self.pending_ws = ""  # whitespace after content: kept only if more content follows
        self.strip_leading = False  # just after a call: its trailing whitespace is layout
        self.call = ""  # the current call's text since <tool_call>
        self.index = 0  # calls completed so far
        self.calls: list[ToolCall] = []
        self.malformed = False
        self._reset_call()

    def _reset_call(self) -> None:
        self.call_id: str | None = None  # set once the name is sent
        self.args_pos = 0  # where the arguments' value starts in self.call
        self.args_sent = 0  # characters of the value already sent
        self.args: _ValueScanner | None = None  # None: not streaming (not a {...} / [...])

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        self.buf += text
        out = DeltaMessage()
        while True:
            if self.state == "text":
                start = self.buf.find(TOOL_CALL_START)
                end = start if start >= 0 else len(self.buf) - (
                    0 if final else held_back(self.buf, TOOL_CALL_START))
                piece, self.buf = self.buf[:end], self.buf[end:]
                if self.strip_leading:
                    piece = piece.lstrip()
                    self.strip_leading = not piece
                body = piece.rstrip()
                if body:
                    out.content += self.pending_ws + body
                    self.pending_ws = ""
                self.pending_ws += piece[len(body):]
                if start < 0:
                    if final and not self.calls:  # no call: the text is all content
                        out.content += self.pending_ws
                    return out
                self.buf = self.buf[len(TOOL_CALL_START):]
                self.state, self.pending_ws, self.call = "call", "", ""
                continue
            # in a call: everything up to </tool_call> is the call's text
            self.call += self.buf
            self.buf = ""
            end = self.call.find(TOOL_CALL_END)
            if end >= 0:
                self.buf = self.call[end + len(TOOL_CALL_END):]
                self.call = self.call[:end]
            out.tool_calls += self._stream_call()
            if end < 0 and not final:
                return out
            out.tool_calls += self._end_call()
            self.state, self.strip_leading = "text", True
            if end < 0:  # the output ended inside the call
                return out
# --8<-- [end:splitter]

    # --8<-- [start:stream_call]
    def _stream_call(self) -> list[DeltaToolCall]:
        """What can be sent of the current call: its name once complete, then its
        arguments' JSON text as far as it is written."""
        deltas = []
        if self.call_id is None:
            head = _HEAD.match(self.call)
            if head is None:
                return deltas
            self.call_id = make_tool_call_id()
            deltas.append(DeltaToolCall(self.index, self.call_id, json.loads(head.group(1))))
            self.args_pos = self.args_sent = head.end()
        if self.args is None:
            rest = self.call[self.args_sent:]
            value = rest.lstrip()
            if not value or value[0] not in "{[":
                return deltas  # not started, or a string/number: sent whole at the end
            self.args_pos = self.args_sent = len(self.call) - len(value)
            self.args = _ValueScanner()
        if not self.args.done:
            n = self.args.scan(self.call[self.args_sent:])
            if n:
                piece = self.call[self.args_sent:self.args_sent + n]
                self.args_sent += n
                if deltas:
                    deltas[0].arguments += piece
                else:
                    deltas.append(DeltaToolCall(self.index, arguments=piece))
        return deltas
    # --8<-- [end:stream_call]

    def _end_call(self) -> list[DeltaToolCall]:
        """Close the current call: parse its whole text, send what was not sent."""
        try:
            obj = json.loads(self.call)
        except json.JSONDecodeError:
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        deltas: list[DeltaToolCall] = []
        if not isinstance(name, str) or "arguments" not in obj:
            self.malformed = True
        else:
            value = obj["arguments"]
            if self.args is not None:  # streamed: what was sent is the value's text
                arguments = self.call[self.args_pos:self.args_sent]
            else:
                arguments = value if isinstance(value, str) else json.dumps(
                    value, ensure_ascii=False)
            if self.call_id is None:  # keys in another order: all of it now
                self.call_id = make_tool_call_id()
                deltas.append(DeltaToolCall(self.index, self.call_id, name, arguments))
            elif self.args is None:
                deltas.append(DeltaToolCall(self.index, arguments=arguments))
            self.calls.append(ToolCall(self.call_id, name, arguments))
        if self.call_id is not None or deltas:
            self.index += 1
        self._reset_call()
        return deltas


# --8<-- [start:parser]
class HermesToolParser:
    """Tool calls of one request's output (vLLM's `hermes` parser).

    One instance per request when streaming (it keeps the stream's state);
    `extract_tool_calls` alone keeps none.
    """

    def __init__(self) -> None:
        self._stream = _ToolCallSplitter()

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        """The calls in a whole output, and the text around them.

        A malformed call (not JSON, no name) makes the whole output plain
        content, as vLLM does: nothing half-parsed reaches the client.
        """
        splitter = _ToolCallSplitter()
        content = splitter.feed(model_output, final=True).content
        if splitter.malformed or not splitter.calls:
            return ExtractedToolCallInformation(False, [], model_output or None)
        return ExtractedToolCallInformation(True, splitter.calls, content or None)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        """Content and tool-call deltas that the next piece of text decides."""
        return self._stream.feed(delta_text)

    def finish_streaming(self) -> DeltaMessage:
        """What was held back, once the output has ended."""
        return self._stream.feed("", final=True)

    @property
    def tools_called(self) -> bool:
        """Whether the stream so far held a complete call (`finish_reason` "tool_calls")."""
        return bool(self._stream.calls)
# --8<-- [end:parser]


__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "ExtractedToolCallInformation",
           "HermesToolParser", "ToolCall", "make_tool_call_id"]
