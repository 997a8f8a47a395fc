"""From sampled tokens to outputs: recording each token, finishing, aborting and
failing completions, and the delta `RequestOutput`s (chapter 6).

`LLMEngine._process` reads a step back and hands each token to
`_record_token`: detokenize (or leave the text to the end), check the stop
rules, finish the completion when it is done. `_make_output` turns what a
group's completions buffered into one delta. vLLM's `OutputProcessor`
(`v1/engine/output_processor.py`) plays this part there.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from mini_vllm.outputs import RequestOutput
from mini_vllm.sampling_params import RequestOutputKind, SamplingParams
from mini_vllm.sequence import RequestStatus

if TYPE_CHECKING:
    from mini_vllm.engine.request_state import _Completion, _Group, _LogprobRows

_STATUS_OF_REASON = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
}


class OutputProcessing:
    """`LLMEngine`'s bookkeeping after the sampler (the engine mixes this in; see the
    module docstring)."""

    # --8<-- [start:detokenizes_at_end]
    def _detokenizes_at_end(self, params: SamplingParams) -> bool:
        """Whether a completion's text is decoded once, when it finishes, instead of
        token by token: when nobody reads it before (FINAL_ONLY) and no stop string
        has to be matched on it. Its final text is the same either way."""
        return params.output_kind == RequestOutputKind.FINAL_ONLY and not params.stop
    # --8<-- [end:detokenizes_at_end]

    # --8<-- [start:append_token]
    def _record_token(
        self, c: _Completion, token_id: int, num_output: int, logprobs: _LogprobRows | None,
        row: int,
    ) -> None:
        """Advance the completion's grammar, detokenize the token (or leave that to
        the end), check the stop rules, finish the request if done."""
        req, checker = c.request, c.stop_checker
        if c.grammar is not None and not self._advance_grammar(c, token_id):
            return
        if c.text_at_end:  # the rules on token ids alone; the text comes at the end
            finished = checker.check_token(token_id, num_output)
        else:
            piece = c.detokenizer.add_token(token_id)
            c.text += checker.process(token_id, piece, num_output).emit_text
            finished = checker.finish_reason is not None
        c.token_ids.append(token_id)
        if c.logprobs is not None and logprobs is not None:
            c.logprobs.append(logprobs.row(row, req.sampling_params.logprobs, self.tokenizer))
        if not finished and req.num_prompt_tokens + num_output >= self.max_model_len:
            c.text += checker.finish("length").emit_text  # the context is full
            finished = True
        if finished:
            self._finish_completion(c)
    # --8<-- [end:append_token]

    # --8<-- [start:finish_completion]
    def _finish_completion(self, c: _Completion) -> None:
        """Complete a finished completion's text, record why it ended, free its blocks."""
        checker = c.stop_checker
        if c.text_at_end:
            c.text = self._text_at_end(c, flush=True)
        elif not isinstance(checker.stop_reason, str):
            # Bytes of a character the generation stopped in the middle of.
            c.text += c.detokenizer.flush()
        c.finish_reason, c.stop_reason = checker.finish_reason, checker.stop_reason
        self.scheduler.finish_request(c.request.request_id, _STATUS_OF_REASON[c.finish_reason])

    def _text_at_end(self, c: _Completion, flush: bool) -> str:
        """The whole text of a completion detokenized at the end, as the token-by-token
        path gives it (`flush` False: aborted or failed, held-back bytes not released)."""
        ids = c.request.output_token_ids[:c.stop_checker.num_output_tokens]
        return c.detokenizer.final_text(ids, drop_last=c.stop_checker.dropped_stop_token_text,
                                        flush=flush)
    # --8<-- [end:finish_completion]

    # --8<-- [start:make_output]
    def _make_output(self, group: _Group) -> RequestOutput:
        deltas = [c.take_delta() for c in group.completions
                  if c.token_ids or c.text or (c.finish_reason and not c.reported_finish)]
        finished = group.finished
        metrics = {"arrival_time": group.arrival_time}
        if group.first_token_time is not None:
            metrics["first_token_time"] = group.first_token_time
        cached = max(c.request.num_cached_tokens for c in group.completions)
        out = RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, deltas,
                            finished, num_cached_tokens=cached, error=group.error,
                            metrics=metrics)
        if finished:
            metrics["finished_time"] = time.monotonic()
            self._forget(group)
            self.stats["num_requests_finished"] += 1
            self.stats["prompt_tokens_total"] += len(group.prompt_token_ids)
        return out
    # --8<-- [end:make_output]

    def _forget(self, group: _Group) -> None:
        del self._groups[group.request_id]
        for c in group.completions:
            self._children.pop(c.request.request_id, None)

    # --8<-- [start:abort]
    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests (by the ids given to `add_request`) wherever they are.

        Returns:
            Their final outputs, with finish_reason "abort".
        """
        outputs = []
        for rid in request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            self._compiling.pop(rid, None)  # held while its grammar compiles
            live = [c for c in group.completions if c.finish_reason is None]
            self.scheduler.abort_requests([c.request.request_id for c in live])
            for c in live:
                c.text += c.stop_checker.finish("abort").emit_text
                if c.text_at_end:
                    c.text = self._text_at_end(c, flush=False)
                c.finish_reason = "abort"
            outputs.append(self._make_output(group))
        return outputs
    # --8<-- [end:abort]

    # --8<-- [start:fail]
    def _fail(self, child_ids: list[str], error: str) -> list[RequestOutput]:
        groups = {self._children[cid][0].request_id: self._children[cid][0] for cid in child_ids}
        outputs = []
        for group in groups.values():
            self._fail_group(group, error)
            outputs.append(self._make_output(group))
        return outputs

    def _fail_group(self, group: _Group, error: str) -> None:
        """End every unfinished completion of a group with "error" (no output made)."""
        for c in group.completions:
            if c.finish_reason is None:
                # FINISHED_ERROR also drops the prefix cache: blocks this
                # step filled may hold garbage.
                self.scheduler.finish_request(c.request.request_id,
                                              RequestStatus.FINISHED_ERROR)
        for c in group.completions:
            if c.finish_reason is None and c.text_at_end:
                c.text = self._text_at_end(c, flush=False)
            c.finish_reason = c.finish_reason or "error"
        group.error = f"the engine failed while computing this request: {error}"
        self.stats["num_requests_failed"] += 1
    # --8<-- [end:fail]
