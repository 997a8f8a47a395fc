"""`StructuredOutputManager`: compiles grammars off the caller's thread, once each.

Compiling a grammar takes from well under a millisecond (a small schema) to
seconds (a `choice` of twenty thousand strings): far too long for the
server's event loop or the engine's step. So compilation runs on a small pool
of worker threads (xgrammar releases the GIL while it compiles), and callers
get a `Future`:

    submit(params) ─► cache hit?  ── yes ─► the cached Future (maybe already done)
                        │ no
                        ▼
                  new Future, cached under params.key (LRU)
                  worker: compile ─► set_result / set_exception(ValueError)
                  timer:  compile_timeout_s later, still not done ─►
                          set_exception(GrammarCompileTimeout)

A grammar that is still compiling when its time is up is refused, and the
refusal stays cached: the same text is refused at once next time instead of
occupying a worker again. (A thread cannot be interrupted; the abandoned
compile runs to its end in the background, and its result is dropped.) A
request that timed out while still queued behind others is not remembered:
it was the queue that was slow, not its grammar.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import xgrammar as xgr

from mini_vllm.structured_output.backend import build_tokenizer_info, compile_grammar
from mini_vllm.structured_output.bitmask import allocate_token_bitmask
from mini_vllm.structured_output.grammar import StructuredOutputGrammar
from mini_vllm.structured_output.params import StructuredOutputsParams
from mini_vllm.tokenizer import Tokenizer


class GrammarCompileTimeout(ValueError):
    """A grammar took longer than the manager's bound to compile (a 400 for the client)."""


_SETTLE_LOCK = threading.Lock()  # makes done() + set_*() one step for the two racers


def _settle(future: Future, result: object = None, error: BaseException | None = None) -> bool:
    """Complete `future` unless it already is (worker and timer race); True if this did."""
    with _SETTLE_LOCK:
        if future.done():
            return False
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return True


# --8<-- [start:manager]
class StructuredOutputManager:
    """Compiles `StructuredOutputsParams` into grammars, cached and time-bounded.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's vocabulary size (the logits' width).
        max_workers: compile threads (each compile is single-threaded).
        cache_size: compiled grammars kept, least recently used dropped first.
        compile_timeout_s: a grammar not compiled this long after it was
            submitted is refused with `GrammarCompileTimeout`.
        fill_threads: threads that fill a large batch's bitmask ("auto": one
            per core).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_workers: int = 2,
                 cache_size: int = 256, compile_timeout_s: float = 10.0,
                 fill_threads: int | str = "auto") -> None:
        if max_workers < 1 or cache_size < 1 or compile_timeout_s <= 0:
            raise ValueError("max_workers and cache_size must be >= 1 and compile_timeout_s > 0; "
                             f"got {max_workers}, {cache_size}, {compile_timeout_s}")
        self.vocab_size = vocab_size
        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size)
        # Our own cache (below) is the one that counts: xgrammar's is off.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1,
                                             cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        # Fills the bitmask rows of a large batch on several threads (the engine's step).
        self._batch = xgr.BatchGrammarMatcher(fill_threads)
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s

    def submit(self, params: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """Start compiling `params` (or find it compiled); never blocks.

        The Future is done within `compile_timeout_s`: with the compiled
        grammar, or with a `ValueError` (invalid spec, or
        `GrammarCompileTimeout`).
        """
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)  # holders of an evicted Future keep it
        started = threading.Event()
        timer = threading.Timer(self.compile_timeout_s, self._expire,
                                (key, future, started, params.kind))
        timer.daemon = True
        future.add_done_callback(lambda _: timer.cancel())
        self._pool.submit(self._compile, params, future, started)
        timer.start()
        return future

    def _compile(self, params: StructuredOutputsParams, future: Future,
                 started: threading.Event) -> None:
        if future.done():  # refused while it waited in the queue
            return
        started.set()
        try:
            compiled = compile_grammar(self._compiler, params)
        except ValueError as e:
            _settle(future, error=e)
        except Exception as e:  # noqa: BLE001 (a worker must not die silently)
            _settle(future, error=ValueError(f"structured_outputs.{params.kind}: the grammar "
                                             f"failed to compile: {e!r}"))
        else:
            _settle(future, result=compiled)

    def _expire(self, key: tuple, future: Future, started: threading.Event, kind: str) -> None:
        error = GrammarCompileTimeout(
            f"structured_outputs.{kind}: the grammar did not compile within "
            f"{self.compile_timeout_s:g} s")
        if _settle(future, error=error) and not started.is_set():
            with self._lock:  # only the queue was slow: let the next request try again
                if self._cache.get(key) is future:
                    del self._cache[key]
# --8<-- [end:manager]

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or find) `params`, blocking the calling thread until it is done.

        Raises:
            ValueError: an invalid spec, or `GrammarCompileTimeout`.
        """
        future = self.submit(params)
        try:
            # The timer settles the future in time; the margin only guards a stalled timer.
            return future.result(timeout=self.compile_timeout_s + 5.0)
        except FutureTimeout:
            raise GrammarCompileTimeout(
                f"structured_outputs.{params.kind}: the grammar did not compile within "
                f"{self.compile_timeout_s:g} s") from None

    async def compile_async(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """`compile` for an event loop: awaits the worker without blocking the loop."""
        return await asyncio.wrap_future(self.submit(params))

    def new_grammar(self, compiled: xgr.CompiledGrammar,
                    stop_token_ids: list[int] | None = None) -> StructuredOutputGrammar:
        """A fresh matcher over `compiled` for one request (see `StructuredOutputGrammar`)."""
        return StructuredOutputGrammar(compiled, stop_token_ids, self.vocab_size, self._batch)

    def allocate_token_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU bitmask of `num_rows` rows of this vocabulary, all ids allowed."""
        return allocate_token_bitmask(num_rows, self.vocab_size)

    def shutdown(self) -> None:
        """Stop the workers (compiles in progress finish in the background)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["GrammarCompileTimeout", "StructuredOutputManager"]
