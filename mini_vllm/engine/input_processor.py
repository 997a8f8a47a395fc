"""Turning a prompt and its sampling parameters into a validated request.

`InputProcessor` needs the tokenizer and the configuration, not the model, so
`AsyncLLM` can validate requests in the server's process while the engine
runs in another one.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mini_vllm.config import EngineConfig
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.tokenizer import Tokenizer

if TYPE_CHECKING:
    from mini_vllm.structured_output import StructuredOutputManager


@dataclass
class ProcessedRequest:
    """A validated request, ready for the engine thread (built off-thread)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float


def load_generation_config(model_dir: str | Path) -> dict:
    """The checkpoint's `generation_config.json`, or `{}` when it has none."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


class InputProcessor:
    """Turns a prompt and its sampling parameters into a validated `ProcessedRequest`.

    It needs the tokenizer and the configuration, not the model, so `AsyncLLM`
    can validate requests in the server's process while the engine runs in
    another one.

    Args:
        engine_config: the resolved configuration.
    """

    def __init__(self, engine_config: EngineConfig) -> None:
        self.tokenizer = Tokenizer.from_pretrained(engine_config.tokenizer_path,
                                                   chat_template=engine_config.chat_template)
        self.generation_config = load_generation_config(engine_config.model)
        self.vocab_size = engine_config.model_config.vocab_size
        self.max_model_len = engine_config.scheduler_config.max_model_len
        self._structured_output_manager: StructuredOutputManager | None = None
        self._manager_lock = threading.Lock()

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """The grammar compiler of this process (chapter 18), made on first use.

        One per process: `AsyncLLM` and its engine thread share it, so a grammar
        the server compiled is found compiled by the engine; an engine process
        has its own (its cache is keyed the same way). Made lazily because
        importing xgrammar takes a second or two that a server without
        structured outputs need not pay.
        """
        with self._manager_lock:
            if self._structured_output_manager is None:
                from mini_vllm.structured_output import StructuredOutputManager

                self._structured_output_manager = StructuredOutputManager(self.tokenizer,
                                                                          self.vocab_size)
            return self._structured_output_manager

    def shutdown(self) -> None:
        """Stop the grammar compiler's threads, if it was started."""
        if self._structured_output_manager is not None:
            self._structured_output_manager.shutdown()

    # --8<-- [start:process_inputs]
    def process_inputs(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> ProcessedRequest:
        """Tokenize and validate a request (thread-safe: touches no engine state).

        Raises:
            ValueError: with a message naming what is wrong (empty prompt,
                token id outside the vocabulary, prompt or prompt + max_tokens
                longer than max_model_len, bad sampling value, a token id of
                logit_bias, allowed_token_ids or bad_words_token_ids outside
                the vocabulary, prompt_logprobs).
        """
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("prompt: a dict prompt needs 'prompt_token_ids'")
            text = prompt.get("prompt")  # the text the ids came from, if known
            prompt = list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            text = prompt
            # A text prompt gets the tokenizer's special tokens (Llama's BOS), as in vLLM.
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt: token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        if not token_ids:
            raise ValueError("prompt: the prompt is empty")
        n_prompt = len(token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"prompt: {n_prompt} tokens do not fit the model's context length "
                f"({self.max_model_len}), which must also hold at least one output token"
            )
        params = params.with_defaults(self.generation_config)
        if params.prompt_logprobs is not None:
            # The runner computes logits only where a token is sampled (chapter 2).
            raise ValueError("prompt_logprobs is not supported: the engine computes logits "
                             "only at the positions it samples from")
        params = params.update_from_tokenizer(self.tokenizer)  # bad_words -> token ids
        params.check_token_ids(self.vocab_size)
        room = self.max_model_len - n_prompt
        if params.max_tokens is None:
            params = params.replace(max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(
                f"max_tokens: {n_prompt} prompt tokens + max_tokens {params.max_tokens} = "
                f"{n_prompt + params.max_tokens} is more than the model's context length "
                f"({self.max_model_len})"
            )
        return ProcessedRequest(request_id, text, token_ids, params, priority,
                                time.monotonic() if arrival_time is None else arrival_time)
    # --8<-- [end:process_inputs]


__all__ = ["InputProcessor", "ProcessedRequest", "load_generation_config"]
