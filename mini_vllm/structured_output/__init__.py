"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

    StructuredOutputsParams   what a request asks for (`SamplingParams.structured_outputs`)
    StructuredOutputManager   compiles it with xgrammar on worker threads, cached, time-bounded
    StructuredOutputGrammar   one request's matcher: accept tokens, fill its bitmask row
    apply_token_bitmask       the sampler's stage: masked ids' logits to -inf

Only `params` is loaded with the package; the rest (torch, and xgrammar, which
takes a second or two to import) on first use, so `SamplingParams` stays cheap
to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mini_vllm.structured_output.params import (
    MAX_WHITESPACE_RUN,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from mini_vllm.structured_output.backend import build_tokenizer_info
    from mini_vllm.structured_output.bitmask import (
        allocate_token_bitmask,
        apply_token_bitmask,
        bitmask_width,
        unpack_bitmask,
    )
    from mini_vllm.structured_output.grammar import StructuredOutputGrammar, fill_bitmasks
    from mini_vllm.structured_output.manager import (
        GrammarCompileTimeout,
        StructuredOutputManager,
    )

_LAZY = {
    "allocate_token_bitmask": "mini_vllm.structured_output.bitmask",
    "apply_token_bitmask": "mini_vllm.structured_output.bitmask",
    "bitmask_width": "mini_vllm.structured_output.bitmask",
    "unpack_bitmask": "mini_vllm.structured_output.bitmask",
    "build_tokenizer_info": "mini_vllm.structured_output.backend",
    "StructuredOutputGrammar": "mini_vllm.structured_output.grammar",
    "fill_bitmasks": "mini_vllm.structured_output.grammar",
    "GrammarCompileTimeout": "mini_vllm.structured_output.manager",
    "StructuredOutputManager": "mini_vllm.structured_output.manager",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_WHITESPACE_RUN",
    "GrammarCompileTimeout",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputsParams",
    "allocate_token_bitmask",
    "apply_token_bitmask",
    "bitmask_width",
    "build_tokenizer_info",
    "fill_bitmasks",
    "unpack_bitmask",
]
