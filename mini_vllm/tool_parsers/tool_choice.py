"""`tool_choice` as a grammar: forcing a model to call a tool, in the Hermes format.

With `tool_choice: "auto"` the model decides whether to call a tool. With
`"required"` (call at least one) or a named function (call exactly that one)
the server does not trust it to: the output is constrained so that whatever
the model's weights, it writes well-formed calls that `HermesToolParser`
parses. One call is a JSON object between tags:

    <tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>
    └─ begin ─────┘└──────────── call schema ──────────────┘└──── end ──┘

The JSON between the tags follows the *call schema*: for one tool, an object
whose `name` is that tool's name and whose `arguments` follow its
`parameters` schema; for several, `anyOf` those objects, so a name always
comes with its own tool's arguments. The tags around it are not JSON, which
is why the constraint is an xgrammar structural tag (tags whose content is a
JSON schema) rather than a bare schema:

    required:  one or more calls, separated by "\\n", nothing else
               (exactly one with parallel_tool_calls=False)
    named:     exactly one call of that function
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mini_vllm.structured_output.params import StructuredOutputsParams
from mini_vllm.tool_parsers.hermes_tool_parser import TOOL_CALL_END, TOOL_CALL_START

# Qwen3 writes a call as one line of JSON with single spaces; at most this many
# whitespace characters between two JSON tokens of a forced call.
TOOL_CALL_MAX_WHITESPACE = 1


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """The functions of an OpenAI `tools` list as `{"name", "parameters"}`, or a ValueError.

    A function without `parameters` takes an object with no properties.
    """
    if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
        raise ValueError(f"tools must be a non-empty list of tools, got {tools!r}")
    functions = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or (
                not isinstance(fn, Mapping)):
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise ValueError(  # noqa: TRY004 (a 400 for the client)
                f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append({"name": name, "parameters": dict(params)})
    return functions


def _named_function(tool_choice: Any) -> str | None:
    """The function name of a named `tool_choice`, or None for a string choice."""
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, "
                             f"got {tool_choice!r}")
        return None
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ValueError(f"tool_choice must name a function as {{'type': 'function', "
                         f"'function': {{'name': ...}}}}, got {tool_choice!r}")
    return name


# --8<-- [start:call_schema]
def tool_call_schema(tools: Any, tool_choice: Any = "required") -> dict[str, Any]:
    """The JSON schema of one call object `{"name": ..., "arguments": ...}`.

    Args:
        tools: the request's OpenAI `tools`.
        tool_choice: `"required"` (any of the tools) or a named function.

    Raises:
        ValueError: naming `tools` or `tool_choice` when they are malformed or
            the named function is not among the tools.
    """
    functions = validate_tools(tools)
    name = _named_function(tool_choice)
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    calls = [{"type": "object",
              "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
              "required": ["name", "arguments"],
              "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}
# --8<-- [end:call_schema]


# --8<-- [start:tool_choice_structured_outputs]
def tool_choice_structured_outputs(tools: Any, tool_choice: Any,
                                   parallel_tool_calls: bool = True
                                   ) -> StructuredOutputsParams | None:
    """The structured output that enforces `tool_choice`, or None when nothing is forced.

    `"none"` and `"auto"` (and no tool_choice) force nothing; `"required"` and a
    named function give a structural tag whose sentences are exactly the
    Hermes calls `HermesToolParser` parses.

    Args:
        tools: the request's OpenAI `tools`.
        tool_choice: the request's `tool_choice`.
        parallel_tool_calls: OpenAI's switch; False allows one call only.

    Raises:
        ValueError: naming `tools` or `tool_choice` (see `tool_call_schema`).
    """
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    schema = tool_call_schema(tools, tool_choice)
    call = {"type": "tag", "begin": TOOL_CALL_START + "\n",
            "content": {"type": "json_schema", "json_schema": schema,
                        "max_whitespace_cnt": TOOL_CALL_MAX_WHITESPACE},
            "end": "\n" + TOOL_CALL_END}
    return StructuredOutputsParams(structural_tag={
        "type": "structural_tag",
        "format": {"type": "tags_with_separator", "tags": [call], "separator": "\n",
                   "at_least_one": True,
                   "stop_after_first": tool_choice != "required" or not parallel_tool_calls},
    })
# --8<-- [end:tool_choice_structured_outputs]


__all__ = ["TOOL_CALL_MAX_WHITESPACE", "tool_call_schema", "tool_choice_structured_outputs",
           "validate_tools"]
