"""`StopChecker`: decides when a request is done and which text is safe to stream.

One checker per completion. The engine feeds it every new token id together
with the text that token added (from the incremental detokenizer); it answers
with the text that may be sent to the client now, and, on the last token, why
the request finished:

    finish_reason "stop":   EOS (stop_reason None), a stop token id (stop_reason
                            the id) or a stop string (stop_reason the string)
    finish_reason "length": max_tokens output tokens

Stop strings are matched on the text, not on tokens, so they are found even
when split across tokens. While the text ends with something that could still
grow into a stop string, that tail is held back: no chunk ever carries the
start of a stop string that later matches.

A completion whose text is decoded only when it ends (no stop strings, and
nobody reads it before) goes through `check_token` instead: the same rules
on token ids, without the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mini_vllm.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopResult:
    """The checker's answer for one token.

    Attributes:
        emit_text: text safe to send now (may be empty).
        finish_reason: "stop", "length", or `None` while the request goes on.
        stop_reason: the stop string or stop token id that matched; `None`
            for EOS, for "length" and while running.
    """

    emit_text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StopChecker:
    """Stop rules and streaming hold-back for one completion.

    Args:
        params: the request's `SamplingParams`.
        eos_token_ids: the model's EOS ids (ignored with `params.ignore_eos`).
        max_tokens: overrides `params.max_tokens` (the engine passes what fits
            in the context when the request left it unset). With neither, the
            checker never finishes for length; the engine calls `finish`.

    Rules, in the order they are checked for each token:
        1. EOS, then stop_token_ids: finish "stop"; the token's text is dropped
           unless `include_stop_str_in_output`.
        2. stop strings ending in the new text: finish "stop"; the text is cut
           at the start of the match (after it with
           `include_stop_str_in_output`), and anything after is discarded.
        3. max_tokens reached: finish "length" with all held text released.
        Rules 1 and 2 apply only once more than `min_tokens` tokens were output
        (the sampler keeps EOS and stop tokens out before that). A stop wins
        over "length" when both happen on the same token.
    """

    def __init__(
        self,
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int | None = None,
    ) -> None:
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.stop = tuple(params.stop or ())
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Rule 1 finished it and left the token's text out.
        self.dropped_stop_token_text = False
        self.num_output_tokens = 0
        self._stop_token_ids = self.eos_token_ids | self.stop_token_ids
        # Longest text that can still become part of a match: max stop length - 1.
        self._window = max((len(s) for s in self.stop), default=1) - 1
        self._emitted: list[str] = []  # what was returned so far
        self._context = ""  # the last `_window` emitted characters
        self._pending = ""  # held-back text, not yet returned

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_text(self) -> str:
        """The text emitted so far; once finished, the completion's final text
        (empty when the tokens came through `check_token`, which sees no text)."""
        return "".join(self._emitted)

    # --8<-- [start:process]
    def process(
        self, token_id: int, new_text: str, num_output_tokens: int | None = None
    ) -> StopResult:
        """Take the next output token and the text it added.

        Args:
            token_id: the sampled token.
            new_text: the text it added (from the incremental detokenizer).
            num_output_tokens: output tokens including this one (default: the
                checker's own count).

        Returns:
            The text safe to emit now and, on the last token, why it finished.

        Raises:
            RuntimeError: if the request has already finished.
        """
        if self.finished:
            raise RuntimeError("process() called after the request finished")
        self.num_output_tokens = (
            self.num_output_tokens + 1 if num_output_tokens is None else num_output_tokens
        )
        may_stop = self.num_output_tokens > self.params.min_tokens
        keep_stop_text = self.params.include_stop_str_in_output

        if may_stop and token_id in self._stop_token_ids:
            return self._finish_on_stop_token(token_id, new_text)

        if not self.stop:  # no stop string: nothing is ever held back
            if self.max_tokens is not None and self.num_output_tokens >= self.max_tokens:
                return self._finish(new_text, "length", None)
            self._emitted.append(new_text)
            return StopResult(new_text)

        # `buf` = recently emitted context | held-back text | the new text.
        buf = self._context + self._pending + new_text
        start_unemitted = len(self._context)
        if may_stop and self.stop and new_text:
            match = self._find_stop(buf, len(buf) - len(new_text))
            if match is not None:
                start, stop_str = match
                cut = start + len(stop_str) if keep_stop_text else start
                self._pending = buf[start_unemitted:max(cut, start_unemitted)]
                return self._finish("", "stop", stop_str)

        if self.max_tokens is not None and self.num_output_tokens >= self.max_tokens:
            self._pending = buf[start_unemitted:]
            return self._finish("", "length", None)

        # Hold back the longest tail that is a proper prefix of a stop string.
        hold = 0 if keep_stop_text else self._held_back(buf)
        safe = max(len(buf) - hold, start_unemitted)
        emit = buf[start_unemitted:safe]
        self._pending = buf[safe:]
        self._emitted.append(emit)
        self._context = buf[:safe][-self._window:] if self._window else ""
        return StopResult(emit)
    # --8<-- [end:process]

    # --8<-- [start:check_token]
    def check_token(self, token_id: int, num_output_tokens: int) -> bool:
        """`process` without the text, for a completion whose text is decoded once,
        when it ends (the engine does that for final-only requests).

        Only the rules on token ids apply, so the request must have no stop
        strings: EOS and stop_token_ids (rule 1), then max_tokens (rule 3).

        Returns:
            Whether the request finished: `finish_reason` and `stop_reason` then
            say why, and `dropped_stop_token_text` whether the last token's text
            is to be left out.

        Raises:
            RuntimeError: if the request has already finished.
            ValueError: if the request has stop strings.
        """
        if self.finish_reason is not None:
            raise RuntimeError("check_token() called after the request finished")
        if self.stop:
            raise ValueError("stop strings are matched on the text: use process()")
        self.num_output_tokens = num_output_tokens
        if token_id in self._stop_token_ids and num_output_tokens > self.params.min_tokens:
            self._finish_on_stop_token(token_id, "")
            return True
        if self.max_tokens is not None and num_output_tokens >= self.max_tokens:
            self._finish("", "length", None)
            return True
        return False
    # --8<-- [end:check_token]

    def finish(self, finish_reason: str = "length") -> StopResult:
        """End the request for a reason of the engine's (context full, abort).

        Returns:
            The held-back text, now released, with `finish_reason`.
        """
        if self.finished:
            raise RuntimeError("finish() called after the request finished")
        return self._finish("", finish_reason, None)

    def _finish_on_stop_token(self, token_id: int, new_text: str) -> StopResult:
        """Rule 1: finish "stop"; the token's text is kept only with
        `include_stop_str_in_output`."""
        keep = self.params.include_stop_str_in_output
        self.dropped_stop_token_text = not keep
        reason = None if token_id in self.eos_token_ids else token_id
        return self._finish(new_text if keep else "", "stop", reason)

    def _finish(self, extra: str, finish_reason: str, stop_reason: int | str | None) -> StopResult:
        emit = self._pending + extra
        self._pending = ""
        self._emitted.append(emit)
        self.finish_reason, self.stop_reason = finish_reason, stop_reason
        return StopResult(emit, finish_reason, stop_reason)

    # --8<-- [start:match]
    def _find_stop(self, buf: str, new_start: int) -> tuple[int, str] | None:
        """The stop string match in `buf` that ends first among those ending in the new text.

        Only matches ending at or after `new_start` are new; a match starts at
        most len(s) - 1 characters before the new text. Of several, the one
        that ends first wins (what a character-by-character stream would see
        first), and of those ending together the longest.
        """
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = buf.find(s, max(0, new_start - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _held_back(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string.

            stop = "</end>"   text = "... the </e"   -> hold "</e" (3 characters)
            next token "nd>"  -> "</end>" matches: cut, never shown
            next token "ra>"  -> "</era>" cannot match: release "</era>"
        """
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        return hold
    # --8<-- [end:match]


__all__ = ["StopChecker", "StopResult"]
