"""`Qwen3ReasoningParser`: split Qwen3's `<think>...</think>` block from its answer.

With thinking on, Qwen3 answers in two parts:

    <think>\\nThe user asks for the capital of France...\\n</think>\\n\\nParis.
    └──────────────── reasoning ────────────────────┘        └ content ┘

The server returns the first part as `message.reasoning` (vLLM's
`--reasoning-parser qwen3`) and only the second as `content`. The newlines
that frame the block are layout, not text: they belong to neither part (the
chat template puts them back when the conversation is rendered again).

The cases, all handled by one state machine over the text:

    output starts with <think> (after any whitespace)  reasoning until </think>, then content
    <think> never closed (max_tokens hit)              everything after <think> is reasoning
    no <think> block                                   everything is content
    enable_thinking=False                              everything is content: the template
                                                       already closed an empty block
    the prompt opened the block (a template that ends  reasoning from the first character
    with "<think>\\n"): prompt_opens_reasoning

Streaming feeds the same machine piece by piece; text that may be the start
of a tag or the newlines before `</think>` wait for the next piece, so the
pieces join to exactly what `extract_reasoning` returns for the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence

from mini_vllm.delta import DeltaMessage, held_back
from mini_vllm.tokenizer import Tokenizer

THINK_START = "<think>"
THINK_END = "</think>"
# How Qwen3's chat template opens the assistant's turn (the generation prompt).
ASSISTANT_TURN = "<|im_start|>assistant\n"


# --8<-- [start:splitter]
class _ThinkSplitter:
    """The state machine: `start` -> `reasoning` -> `content` (or `start` -> `content`)."""

    def __init__(self, state: str) -> None:
        self.state = state
        self.buf = ""  # text received, not yet emitted
        self.strip_newlines = state == "reasoning"  # drop the layout newlines that come next

    def feed(self, text: str, final: bool = False) -> DeltaMessage:
        """Take more text; return what is decided. `final`: no more text will come."""
        self.buf += text
        out = DeltaMessage()
        while True:
            if self.state == "start":
                body = self.buf.lstrip()
                if body.startswith(THINK_START):
                    self.buf = body[len(THINK_START):]
                    self.state, self.strip_newlines = "reasoning", True
                    continue
                if not final and THINK_START.startswith(body):  # "", "  ", "<thi": wait
                    return out
                self.state = "content"
                continue
            if self.strip_newlines:
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.strip_newlines = False
            if self.state == "content":
                out.content += self.buf
                self.buf = ""
                return out
            # reasoning
            end = self.buf.find(THINK_END)
            if end >= 0:
                out.reasoning += self.buf[:end].rstrip("\n")
                self.buf = self.buf[end + len(THINK_END):]
                self.state, self.strip_newlines = "content", True
                continue
            ready = self.buf if final else self.buf[:len(self.buf) - held_back(self.buf, THINK_END)]
            if not final:  # newlines just before </think> are layout: wait and see
                ready = ready.rstrip("\n")
            out.reasoning += ready
            self.buf = self.buf[len(ready):]
            return out
# --8<-- [end:splitter]


# --8<-- [start:parser]
class Qwen3ReasoningParser:
    """Reasoning/content split for one request's output (vLLM's `qwen3` parser).

    One instance per request when streaming (it keeps the stream's state);
    `extract_reasoning` alone keeps none.

    Args:
        tokenizer: the model's tokenizer; needed only by the token-id methods
            (`is_reasoning_end`, `extract_content_ids`).
        enable_thinking: the request's `chat_template_kwargs.enable_thinking`;
            False means all of the output is content.
        prompt_opens_reasoning: the rendered prompt ends inside an open
            `<think>` block, so the output starts as reasoning (see
            `prompt_ends_in_reasoning`).
    """

    def __init__(self, tokenizer: Tokenizer | None = None, enable_thinking: bool = True,
                 prompt_opens_reasoning: bool = False) -> None:
        self.tokenizer = tokenizer
        self.enable_thinking = enable_thinking
        self.prompt_opens_reasoning = prompt_opens_reasoning and enable_thinking
        self._stream = self._new_splitter()
        self._turn: list[int] | None = None  # ASSISTANT_TURN's ids, once asked for

    def _new_splitter(self) -> _ThinkSplitter:
        if not self.enable_thinking:
            return _ThinkSplitter("content")
        return _ThinkSplitter("reasoning" if self.prompt_opens_reasoning else "start")

    @staticmethod
    def prompt_ends_in_reasoning(prompt: str) -> bool:
        """Whether a rendered prompt leaves a `<think>` block open for the model."""
        return prompt.rfind(THINK_START) > prompt.rfind(THINK_END)

    def extract_reasoning(self, model_output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; `None` for a part that is empty."""
        out = self._new_splitter().feed(model_output, final=True)
        return out.reasoning or None, out.content or None

    def extract_reasoning_streaming(self, delta_text: str) -> DeltaMessage:
        """The reasoning and content that the next piece of text decides (maybe empty)."""
        return self._stream.feed(delta_text)

    def finish_streaming(self) -> DeltaMessage:
        """What was held back, once the output has ended."""
        return self._stream.feed("", final=True)
# --8<-- [end:parser]

    # --8<-- [start:token_ids]
    def _tag_ids(self) -> tuple[int, int]:
        if self.tokenizer is None:
            raise ValueError("Qwen3ReasoningParser needs the tokenizer for token-id methods")
        start, end = (self.tokenizer.token_to_id(THINK_START),
                      self.tokenizer.token_to_id(THINK_END))
        if start is None or end is None:
            raise ValueError(f"the tokenizer has no {THINK_START} / {THINK_END} tokens")
        return start, end

    def _content_start(self, token_ids: Sequence[int]) -> int | None:
        """Index of the first content token in an output (len(ids) if none yet has
        come but reasoning is over), or None while the output is still reasoning or
        undecided. The same rules as the text state machine, on ids."""
        if not self.enable_thinking:
            return 0
        start_id, end_id = self._tag_ids()
        ids = list(token_ids)
        if not self.prompt_opens_reasoning:
            # Leading whitespace tokens decide nothing; then <think> opens the block,
            # anything else means there is none.
            first = next((i for i, t in enumerate(ids)
                          if self.tokenizer.decode([t]).strip()), None)
            if first is None:
                return None
            if ids[first] != start_id:
                return 0
            ids = ids[first + 1:]
            offset = first + 1
        else:
            offset = 0
        return offset + ids.index(end_id) + 1 if end_id in ids else None

    def is_reasoning_end(self, token_ids: Sequence[int]) -> bool:
        """Whether the output `token_ids` is past its reasoning (content may follow).

        The engine asks this to know when a structured output starts to apply:
        the grammar constrains the content, never the reasoning.
        """
        return self._content_start(token_ids) is not None

    def extract_content_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The output's content tokens ([] while it is still reasoning)."""
        start = self._content_start(token_ids)
        return [] if start is None else list(token_ids[start:])
    # --8<-- [end:token_ids]

    # --8<-- [start:starts_in_reasoning]
    @property
    def reasoning_end_token_id(self) -> int:
        """The id of `</think>`: the token after which a structured output applies."""
        return self._tag_ids()[1]

    def starts_in_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the output that follows this prompt begins with reasoning.

        The engine asks this once per request with a structured output: its
        grammar then waits for `</think>`. Decided on the prompt's ids alone:

            ...<|im_start|>assistant\\n            a Qwen3 turn with thinking on: True
            ...<think>\\n  (the last tag)           the template opened the block: True
            ...</think>\\n\\n  (the last tag)        thinking off, the block is closed: False
            no tag, not an assistant turn          a plain completion: False
        """
        start_id, end_id = self._tag_ids()
        ids = list(prompt_token_ids)
        turn = self._turn_ids()
        if turn and ids[-len(turn):] == turn:
            return True
        last = {}
        for tag in (start_id, end_id):  # (list.index runs in C: fast on long prompts)
            try:
                last[tag] = len(ids) - 1 - ids[::-1].index(tag)
            except ValueError:
                last[tag] = -1
        return last[start_id] > last[end_id]

    def _turn_ids(self) -> list[int]:
        """The ids of an assistant turn's opening, `<|im_start|>assistant\\n`."""
        if self._turn is None:
            has_turns = self.tokenizer.token_to_id("<|im_start|>") is not None
            self._turn = self.tokenizer.encode(ASSISTANT_TURN) if has_turns else []
        return self._turn
    # --8<-- [end:starts_in_reasoning]


__all__ = ["ASSISTANT_TURN", "THINK_END", "THINK_START", "Qwen3ReasoningParser"]
