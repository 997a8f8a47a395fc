"""`StructuredOutputsParams`: the shape a request wants its output to have.

A request asks for exactly one kind of constraint (vLLM's names, which its
OpenAI server's `structured_outputs` extra parameter uses too):

    json            a JSON schema (a dict, or its JSON text)
    json_object     any JSON object (OpenAI's `response_format: json_object`)
    regex           the whole output matches this regular expression
    choice          the output is exactly one of these strings
    grammar         an EBNF grammar in xgrammar's dialect (GBNF-like, rule `root`)
    structural_tag  an xgrammar structural tag (how tool calls are forced)

Nothing here compiles anything: validation checks only what can be checked
without the grammar engine (types, one kind, the schema parses as JSON), so a
request is refused cheaply. The grammar engine's own errors (an unsupported
schema keyword, a regex it cannot parse) come from `StructuredOutputManager`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# The kinds, in the order the docstring lists them; exactly one is set.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _json_text(name: str, value: Any) -> str:
    """A JSON value (a dict, or its text) as compact JSON text, key order kept.

    The order of a schema's properties is the order the output writes them in,
    so keys are never sorted; whitespace is normalised so that equal schemas
    share one compiled grammar.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
    if not isinstance(value, (dict, bool)):
        raise ValueError(  # noqa: TRY004 (the server turns ValueError into a 400)
            f"structured_outputs.{name} must be a JSON object, got {type(value).__name__}")
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.{name} is not JSON-serialisable: {e}") from None


# --8<-- [start:params]
@dataclass(frozen=True)
class StructuredOutputsParams:
    """One output constraint for a request (`SamplingParams(structured_outputs=...)`).

    Attributes:
        json: a JSON schema, as a dict or as JSON text. Objects admit only the
            properties the schema names (OpenAI's `strict` behaviour).
        json_object: True for any JSON object.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these (non-empty list of strings).
        grammar: an EBNF grammar (xgrammar's dialect: `root ::= ...`).
        structural_tag: an xgrammar structural tag, as a dict or JSON text.
        disable_any_whitespace: JSON without optional whitespace (compact,
            `{"a": 1}` with single spaces after `:` and `,`); otherwise any
            whitespace is allowed between JSON tokens, in runs of at most
            `MAX_WHITESPACE_RUN` characters.
    """

    json: dict | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        # Normalises in place: `json` and `structural_tag` become compact JSON
        # text and `choice` a fresh list, so `key` is cheap and canonical.
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            got = ", ".join(set_) if set_ else "none"
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}; got {got}")
        if self.json is not None:
            object.__setattr__(self, "json", _json_text("json", self.json))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag",
                               _json_text("structural_tag", self.structural_tag))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be true or false, "
                             f"got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"non-empty strings, got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(  # noqa: TRY004
                "structured_outputs.disable_any_whitespace must be true or false, "
                f"got {self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of `KINDS`."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str, bool]:
        """What identifies the compiled grammar: (kind, its text, whitespace option).

        Two requests with the same key share one compiled grammar (the
        compiler's cache is keyed by it).
        """
        kind = self.kind
        value = getattr(self, kind)
        if kind == "choice":
            value = json.dumps(value, ensure_ascii=False)
        elif kind == "json_object":
            value = ""
        return kind, value, self.disable_any_whitespace
# --8<-- [end:params]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StructuredOutputsParams:
        """Build from a mapping (the JSON of an API request), naming unknown fields."""
        if not isinstance(data, Mapping):
            raise ValueError(  # noqa: TRY004
                f"structured_outputs must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**data)


# Longest run of optional whitespace a JSON grammar admits: pretty-printed JSON
# (an indent of 4 at depth 3, after its newline) fits, and a model cannot get
# stuck writing whitespace until its token budget runs out.
MAX_WHITESPACE_RUN = 16

__all__ = ["KINDS", "MAX_WHITESPACE_RUN", "StructuredOutputsParams"]
