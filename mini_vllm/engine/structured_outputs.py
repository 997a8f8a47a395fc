"""Structured outputs in the engine: requests held while their grammar compiles,
and each completion's matcher advanced token by token (chapter 18).

A request with a structured output whose grammar is still compiling waits
outside the scheduler (vLLM's WAITING_FOR_FSM) until `_admit_compiled` finds
its grammar ready; then every completion gets its own matcher
(`_attach_grammars`), which the sampler's mask follows and `_advance_grammar`
moves past each sampled token. With a reasoning parser the grammar waits for
the end of the reasoning.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mini_vllm.engine.request_state import _Completion, _Group
    from mini_vllm.outputs import RequestOutput
    from mini_vllm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)

# How long an engine with nothing else to do waits for a grammar to compile
# before it looks at its commands again (seconds).
GRAMMAR_POLL_S = 0.01


class StructuredOutputSteps:
    """`LLMEngine`'s structured-output steps (the engine mixes this in; see the
    module docstring)."""

    @property
    def structured_output_manager(self) -> StructuredOutputManager:
        """The grammar compiler (shared with `AsyncLLM` in thread mode)."""
        return self.input_processor.structured_output_manager

    # --8<-- [start:attach_grammars]
    def _attach_grammars(self, group: _Group, compiled: object) -> None:
        """Give each completion of a group its own matcher over the compiled grammar.

        The matcher ends where EOS or one of the request's stop tokens may come.
        With a reasoning parser, a prompt after which the model reasons first
        (Qwen3 with thinking on) leaves the grammar waiting for `</think>`.
        """
        params = group.completions[0].request.sampling_params
        stops = [*self.eos_token_ids, *params.stop_token_ids]
        reasoning = (self.reasoning_parser is not None
                     and self.reasoning_parser.starts_in_reasoning(group.prompt_token_ids))
        for c in group.completions:
            c.grammar = self.structured_output_manager.new_grammar(compiled, stops)
            c.reasoning_ended = not reasoning
            if c.grammar.vocab_size != self.vocab_size:
                raise ValueError(f"structured_outputs: the grammar covers {c.grammar.vocab_size} "
                                 f"token ids, the model {self.vocab_size}")

    def _admit_compiled(self) -> list[RequestOutput]:
        """Schedule the held requests whose grammar has compiled; fail those whose
        grammar did not (invalid, or over the time bound).

        With nothing else to run, it waits a little for the first compile to end,
        so an idle engine does not spin (and still sees new commands promptly).
        """
        if not self.scheduler.has_unfinished_requests() and self._in_flight is None:
            wait_futures(list(self._compiling.values()), timeout=GRAMMAR_POLL_S,
                         return_when=FIRST_COMPLETED)
        outputs = []
        for request_id, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            group = self._groups[request_id]
            try:
                self._attach_grammars(group, future.result())
                self._schedule_group(group)
            except ValueError as e:
                for c in group.completions:
                    c.finish_reason = "error"
                group.error = str(e)
                self.stats["num_requests_failed"] += 1
                outputs.append(self._make_output(group))
        return outputs
    # --8<-- [end:attach_grammars]

    # --8<-- [start:advance_grammar]
    def _advance_grammar(self, c: _Completion, token_id: int) -> bool:
        """Move a constrained completion's matcher past its new token.

        During the reasoning only the end of the reasoning is looked for; the
        grammar applies from the next token on. The sampler drew the token
        under this matcher's mask, so a refusal is a bug: the request fails
        (False) rather than return text its grammar does not allow.
        """
        grammar = c.grammar
        if not c.reasoning_ended:
            c.reasoning_ended = token_id == self.reasoning_parser.reasoning_end_token_id
            return True
        if grammar.is_terminated():  # it accepted a stop token (and ignore_eos went on)
            return True
        if grammar.accept_token(token_id):
            self.stats["structured_output_tokens_total"] += 1
            return True
        logger.error("request %s: its grammar refused sampled token %d",
                     c.request.request_id, token_id)
        group = self._children[c.request.request_id][0]
        self._fail_group(group, f"the sampled token {token_id} broke the request's grammar")
        return False
    # --8<-- [end:advance_grammar]
