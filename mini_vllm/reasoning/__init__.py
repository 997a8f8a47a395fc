"""Reasoning parsers: split a model's reasoning from its answer (vLLM's `--reasoning-parser`)."""

from __future__ import annotations

from mini_vllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

# The names `--reasoning-parser` accepts.
REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser}

__all__ = ["REASONING_PARSERS", "Qwen3ReasoningParser"]
