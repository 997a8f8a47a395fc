"""The grammar engine: xgrammar, told about our tokenizer, compiling one spec.

Every call into xgrammar's compiler lives here. A grammar is about bytes
(`"{"`, a digit, a quote); the sampler chooses token ids. To turn one into the
other, xgrammar needs each token's bytes, which `build_tokenizer_info` reads
from the project's tokenizer:

    id    vocabulary entry      bytes the token stands for
    17    "Ġthe"                b" the"      (byte-level BPE: Ġ is the space byte)
    2319  "<tool_call>"         b"<tool_call>"   (an added token: its text)
    2307  "<|im_end|>"          -            a stop token: allowed where the grammar may end
    2306  "<|im_start|>"        b""          special: never part of constrained text

With it, a compiled grammar knows, for every state it can be in, which token
ids may come next; that is what the matcher turns into a bitmask each step.

The model's embedding may have more rows than the tokenizer has tokens
(padding: the tiny checkpoint has 2,368 for 2,331 tokens, Qwen3 151,936 for
151,669). xgrammar is told only about the tokenizer's ids: it would treat
each padding id as a special token and clear its bit one by one at every
fill, which costs more than the fill itself when padding is most of the
vocabulary (the shipped tokenizer in a Qwen3-0.6B-shaped model). The padding
columns of the bitmask are zero instead (`StructuredOutputGrammar`).
"""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from mini_vllm.structured_output.params import MAX_WHITESPACE_RUN, StructuredOutputsParams
from mini_vllm.tokenizer import Tokenizer


# --8<-- [start:tokenizer_info]
def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int,
                         stop_token_ids: list[int] | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary: the bytes of every token id the model has.

    Args:
        tokenizer: the model's tokenizer (a byte-level BPE `tokenizer.json`).
        vocab_size: the model's vocabulary size, the logits' width. It may be
            larger than the tokenizer's (ids past it are padding, left out
            here: never allowed) or smaller (tokens past it are never
            sampled, and left out too).
        stop_token_ids: ids that end a generation; the grammar allows them only
            where it may end. Default: the tokenizer's EOS ids.

    Raises:
        ValueError: if the tokenizer is not byte-level BPE.
    """
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        raise ValueError("structured outputs need a byte-level BPE tokenizer (Qwen3's); this "
                         f"one decodes with {decoder.get('type')!r}")
    stops = list(tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
    # Entries in byte-level form ("Ġthe"); xgrammar maps them back to bytes.
    # A special token that does not stop the generation becomes "", which
    # xgrammar never admits: its text ("<|im_start|>") would otherwise count as
    # ordinary characters inside a JSON string, and vanish from the decoded text.
    special = tokenizer.special_token_ids - set(stops)
    size = min(vocab_size, tokenizer.vocab_size)
    encoded = ["" if i in special else (tokenizer.id_to_token(i) or "") for i in range(size)]
    return xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=size,
                             stop_token_ids=[t for t in stops if t < size],
                             add_prefix_space=False)
# --8<-- [end:tokenizer_info]


# xgrammar's errors read "[12:00:00] /project/cpp/regex_converter.cc:83: Regex parsing
# error at position 4: ..."; the client needs only the part after the source location.
_LOCATION = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*")
# An EBNF string literal for each choice: JSON's escapes are the grammar's.
_CHOICE_LITERAL = json.dumps


# Keywords whose value maps names to subschemas, and keywords whose value is data.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_DATA_KEYWORDS = ("enum", "const", "default", "examples", "required")


# --8<-- [start:bounded_strings]
def bounded_strings_as_patterns(schema: object) -> object:
    """A copy of a JSON schema with `minLength`/`maxLength` strings written as patterns.

    xgrammar compiles a length-bounded string (`{"type": "string", "maxLength": 8}`)
    to "up to 8 characters other than quote, backslash, CR and LF", which admits raw
    control characters (a TAB, \\x02), which JSON forbids inside strings
    (mlc-ai/xgrammar#800). Its `pattern` path encodes characters the JSON way, so
    the same bound as the pattern `^[\\s\\S]{min,max}$` gives valid JSON. A
    string that already has a `pattern` or `format` is left as it is.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> subschema
            out[key] = {name: bounded_strings_as_patterns(v) for name, v in value.items()}
        elif key in _DATA_KEYWORDS:  # values, not schemas: never rewritten
            out[key] = value
        else:
            out[key] = bounded_strings_as_patterns(value)
    if (("minLength" in out or "maxLength" in out) and "pattern" not in out
            and "format" not in out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^[\\s\\S]{{{low},{high}}}$"
    return out


def _schema_text(schema_json: str) -> str:
    return json.dumps(bounded_strings_as_patterns(json.loads(schema_json)), ensure_ascii=False)


def _structural_tag_text(tag_json: str) -> str:
    """The structural tag with `bounded_strings_as_patterns` applied to its JSON schemas."""
    def walk(node: object) -> object:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        if node.get("type") == "json_schema" and "json_schema" in node:
            return {**node, "json_schema": bounded_strings_as_patterns(node["json_schema"])}
        return {k: walk(v) for k, v in node.items()}
    return json.dumps(walk(json.loads(tag_json)), ensure_ascii=False)
# --8<-- [end:bounded_strings]


def clean_error(error: Exception) -> str:
    """An xgrammar error message without its timestamp and C++ source location."""
    text = _LOCATION.sub("", str(error)).strip()
    return text.splitlines()[0] if text else type(error).__name__


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar whose only sentences are `choices`: `root ::= "a" | "b"`."""
    return "root ::= " + " | ".join(_CHOICE_LITERAL(c, ensure_ascii=False) for c in choices)


# --8<-- [start:compile]
def compile_grammar(compiler: xgr.GrammarCompiler,
                    params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    """Compile one spec (blocking: call it from a worker thread).

    Raises:
        ValueError: naming the field, with xgrammar's reason, when the schema,
            regex or grammar is invalid or unsupported.
    """
    kind = params.kind
    whitespace = {"any_whitespace": not params.disable_any_whitespace}
    if not params.disable_any_whitespace:
        whitespace["max_whitespace_cnt"] = MAX_WHITESPACE_RUN
    try:
        if kind == "json":
            return compiler.compile_json_schema(_schema_text(params.json), **whitespace)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', **whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        if kind == "grammar":
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_structural_tag(_structural_tag_text(params.structural_tag))
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors are RuntimeErrors
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar",
                "choice": "choice", "structural_tag": "structural tag"}.get(kind, kind)
        raise ValueError(f"structured_outputs.{kind}: invalid {what}: {clean_error(e)}") from None
# --8<-- [end:compile]


__all__ = ["bounded_strings_as_patterns", "build_tokenizer_info", "choice_grammar",
           "clean_error", "compile_grammar"]
