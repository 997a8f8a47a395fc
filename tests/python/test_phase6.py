"""Phase 6: the engine thread, async streams, aborts, failures and shutdown.

`AsyncLLM` runs its engine loop on a thread or, with `engine_process`, in a
process of its own (phase 9); most tests run in both modes. Faults are
injected through `engine_cls`: engine subclasses defined here, at module
level, so that a spawned engine process can import them by name.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import multiprocessing
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from mini_vllm import LLM, SamplingParams
from mini_vllm.checkpoint import PRESETS
from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.engine import llm_engine, request_state
from mini_vllm.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from mini_vllm.engine.core_process import decode_outputs, encode_outputs
from mini_vllm.engine.heap import heap_frozen
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.model_runner import HostCopy
from mini_vllm.outputs import CompletionOutput, Logprob, RequestOutput
from mini_vllm.sampling_params import RequestOutputKind
from mini_vllm.stop_checker import StopChecker
from mini_vllm.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.phase6

# On the CPU, in float32, whatever the machine: several tests hold an online engine's
# tokens equal to an offline run's, and requests that arrive at other times are batched
# differently, which only batch-invariant arithmetic leaves without effect (a GPU's bf16
# kernels pick other products and reductions for other batch sizes). The GPU path has
# its own tests (test_phase9_gpu.py).
ENGINE_ARGS = {"num_gpu_blocks_override": 128, "max_num_seqs": 16, "max_model_len": 512, "seed": 0,
               "device": "cpu", "dtype": "float32"}
MODES = ["thread", "process"]


def _async_llm(model_dir: Path, mode: str, engine_cls: type[LLMEngine] = LLMEngine,
               **engine_args) -> AsyncLLM:
    args = EngineArgs(model=str(model_dir), engine_process=mode == "process",
                      **{**ENGINE_ARGS, **engine_args})
    return AsyncLLM(args.create_engine_config(), engine_cls)


class _FlakyEngine(LLMEngine):
    """An engine whose first model-runner call raises: one failed step."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)
        real_execute = self.model_runner.execute
        calls = itertools.count()

        def flaky(entries, prev_sampled=None, **kwargs):
            if next(calls) == 0:
                raise RuntimeError("injected failure")
            return real_execute(entries, prev_sampled, **kwargs)

        self.model_runner.execute = flaky


class _BrokenSchedulerEngine(LLMEngine):
    """An engine whose scheduler raises: the loop itself fails."""

    def __init__(self, engine_config: EngineConfig) -> None:
        super().__init__(engine_config)

        def broken_schedule():
            raise RuntimeError("scheduler bug")

        self.scheduler.schedule = broken_schedule


class _HeapReportingEngine(LLMEngine):
    """An engine whose statistics say how many objects the collector has frozen."""

    def get_stats(self) -> dict:
        return {**super().get_stats(), "gc_frozen_objects": gc.get_freeze_count()}


class _VanishingEngine(LLMEngine):
    """An engine process that dies while it starts, without a word."""

    def __init__(self, engine_config: EngineConfig) -> None:
        os._exit(3)


@pytest.fixture(scope="module", params=MODES)
def engine(request, tiny_model_dir):
    llm = _async_llm(tiny_model_dir, request.param)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


def _mixed_params() -> list[SamplingParams]:
    """Twelve requests with different parameters (greedy and seeded random)."""
    params = []
    for i in range(12):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=8 + i))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=10))
        else:
            params.append(SamplingParams(temperature=1.2, top_p=0.8, seed=i, max_tokens=6,
                                         presence_penalty=0.5, ignore_eos=True))
    return params


PROMPTS = [f"Request number {i}: tell me about the number {i * 7}." for i in range(12)]


async def _collect(engine: AsyncLLM, prompt, params, request_id=None):
    """Consume a stream; return (token ids, text, finish reason, number of chunks)."""
    ids, text, finish, chunks = [], "", None, 0
    async for out in engine.generate(prompt, params, request_id=request_id):
        chunks += 1
        for c in out.outputs:
            ids += c.token_ids
            text += c.text
            finish = c.finish_reason or finish
    return ids, text, finish, chunks


def _idle(engine: AsyncLLM) -> bool:
    """Nothing running or waiting, and every KV block back in the pool (by the stats)."""
    stats = engine.get_stats()
    return (stats["num_running"], stats["num_waiting"], stats["kv_cache_usage"]) == (0, 0, 0.0)


async def _wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def test_concurrent_requests_match_offline_results(engine, offline):
    params = _mixed_params()
    expected = offline.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*[
            _collect(engine, p, sp, request_id=f"c{i}")
            for i, (p, sp) in enumerate(zip(PROMPTS, params))
        ])

    results = asyncio.run(main())
    for (ids, text, finish, _), exp in zip(results, expected):
        assert ids == exp.outputs[0].token_ids
        assert text == exp.outputs[0].text
        assert finish == exp.outputs[0].finish_reason


def test_stream_is_incremental_and_ends_once(engine):
    async def main():
        outs = [o async for o in engine.generate(
            "stream me", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
        return outs

    outs = asyncio.run(main())
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outs if o.outputs) == 12
    finishes = [c.finish_reason for o in outs for c in o.outputs if c.finish_reason]
    assert finishes == ["length"]


def test_requests_from_several_threads_and_loops(engine, offline):
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = offline.generate(PROMPTS[:4], params, use_tqdm=False)
    results: dict[int, list[int]] = {}

    def worker(i: int) -> None:  # each thread runs its own event loop
        results[i] = asyncio.run(_collect(engine, PROMPTS[i], params))[0]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [results[i] for i in range(4)] == [e.outputs[0].token_ids for e in expected]


def test_n_completions_share_one_stream(engine, offline):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6)
    expected = offline.generate("several answers", params, use_tqdm=False)[0]

    async def main():
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for out in engine.generate("several answers", params):
            for c in out.outputs:
                got[c.index] += c.token_ids
        return got

    got = asyncio.run(main())
    assert [got[i] for i in range(3)] == [c.token_ids for c in expected.outputs]


def test_abort_running_request_frees_every_block(engine):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        gen = engine.generate("x " * 40, params, request_id="to-abort")
        first = await gen.__anext__()
        assert not first.finished
        await engine.abort("to-abort")
        rest = [o async for o in gen]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        await _wait_until(lambda: _idle(engine))

    asyncio.run(main())


def test_cancelled_consumer_aborts_its_request(engine):
    """A client that goes away: cancelling the consuming task aborts the request."""

    async def main():
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

        async def consume():
            async for _ in engine.generate("y " * 30, params):
                pass

        tasks = [asyncio.create_task(consume()) for _ in range(5)]
        await _wait_until(lambda: engine.get_stats()["num_running"] == 5)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _wait_until(lambda: _idle(engine))
        # ... and a new request completes promptly.
        ids, *_ = await asyncio.wait_for(
            _collect(engine, "after", SamplingParams(temperature=0, max_tokens=4)), 10)
        assert len(ids) >= 1

    asyncio.run(main())


def test_invalid_request_raises_before_output_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="vocabulary"):
            await _collect(engine, [10**9], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="empty"):
            await _collect(engine, [], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="context length"):
            await _collect(engine, "hi", SamplingParams(max_tokens=10_000))
        ids, *_ = await _collect(engine, "still here", SamplingParams(temperature=0, max_tokens=3))
        assert len(ids) == 3

    asyncio.run(main())
    assert engine.is_running


def _child_cpu_seconds(pid: int) -> float:
    """User + system CPU time of another process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_engine_thread_blocks_instead_of_polling(engine):
    """With nothing to do the engine thread (or process) sleeps in a blocking get: no CPU burnt."""
    pid = engine.core_process.pid if engine.core_process is not None else None
    if pid is not None and not Path(f"/proc/{pid}/stat").exists():
        pytest.skip("reads another process's CPU time from /proc")
    time.sleep(0.2)
    start = time.thread_time()  # this thread's CPU time; the engine thread is separate
    cpu0 = time.process_time()
    child0 = _child_cpu_seconds(pid) if pid is not None else 0.0
    time.sleep(1.0)
    busy = (time.process_time() - cpu0) - (time.thread_time() - start)
    if pid is not None:
        busy += _child_cpu_seconds(pid) - child0
    assert busy < 0.1, f"the idle engine used {busy:.2f} s of CPU in 1 s"


@pytest.mark.parametrize("mode", MODES)
def test_step_failure_fails_its_requests_and_engine_keeps_serving(tiny_model_dir, mode):
    llm = _async_llm(tiny_model_dir, mode, _FlakyEngine)
    try:
        async def main():
            with pytest.raises(RequestFailedError, match="injected failure"):
                await _collect(llm, "doomed", SamplingParams(temperature=0, max_tokens=4))
            ids, *_ = await _collect(llm, "fine", SamplingParams(temperature=0, max_tokens=4))
            await _wait_until(lambda: _idle(llm))
            return ids

        assert len(asyncio.run(main())) == 4
        assert llm.is_running and not llm.errored
        assert llm.get_stats()["num_requests_failed"] == 1
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_fatal_error_turns_engine_dead_and_callers_get_an_error(tiny_model_dir, mode):
    llm = _async_llm(tiny_model_dir, mode, _BrokenSchedulerEngine)
    try:
        async def main():
            with pytest.raises(EngineDeadError, match="scheduler bug"):
                await asyncio.wait_for(
                    _collect(llm, "a", SamplingParams(max_tokens=4)), 10)
            with pytest.raises(EngineDeadError):
                await _collect(llm, "b", SamplingParams(max_tokens=4))

        asyncio.run(main())
        assert llm.errored and not llm.is_running
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_refused_requests_raise_value_error(tiny_model_dir, mode):
    """A request id in use, and a request the KV cache can never hold, fail alone."""
    llm = _async_llm(tiny_model_dir, mode, num_gpu_blocks_override=8)  # 128 tokens

    async def main():
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        first = asyncio.create_task(_collect(llm, "first", params, request_id="same"))
        await _wait_until(lambda: llm.get_stats()["num_running"] == 1)
        with pytest.raises(ValueError, match="already in use"):
            await _collect(llm, "second", params, request_id="same")
        with pytest.raises(ValueError, match="blocks"):
            await _collect(llm, "x", SamplingParams(max_tokens=400))
        # The refused duplicate must not abort the request that holds the id.
        assert (await first)[2] == "length"
        await _wait_until(lambda: _idle(llm))

    try:
        asyncio.run(main())
        assert llm.is_running
    finally:
        llm.shutdown()


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_ends_requests_in_flight(tiny_model_dir, mode):
    llm = _async_llm(tiny_model_dir, mode)

    async def main():
        params = SamplingParams(temperature=0, max_tokens=450, ignore_eos=True)
        tasks = [asyncio.create_task(_collect(llm, f"long {i}", params)) for i in range(3)]
        await _wait_until(lambda: llm.get_stats()["num_running"] == 3)
        await asyncio.to_thread(llm.shutdown)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert [r[2] for r in results] == ["abort"] * 3
        with pytest.raises(EngineDeadError):
            await _collect(llm, "after shutdown", params)

    asyncio.run(main())
    assert not llm.is_running
    if llm.core_process is not None:
        assert llm.core_process.process.exitcode == 0


# --- the engine in its own process ------------------------------------------------------

def test_killed_engine_process_fails_every_stream_at_once(tiny_model_dir):
    llm = _async_llm(tiny_model_dir, "process")

    async def main():
        params = SamplingParams(temperature=0, max_tokens=450, ignore_eos=True)
        tasks = [asyncio.create_task(_collect(llm, f"long {i}", params)) for i in range(3)]
        await _wait_until(lambda: llm.get_stats()["num_running"] == 3)
        os.kill(llm.core_process.pid, signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        assert all(isinstance(r, EngineDeadError) for r in results), results
        with pytest.raises(EngineDeadError, match="exit code -9"):
            await _collect(llm, "after", params)

    try:
        asyncio.run(main())
        assert llm.errored and not llm.is_running
    finally:
        llm.shutdown()


def test_engine_process_that_cannot_start_raises_in_the_caller(tiny_model_dir, tmp_path):
    before = set(multiprocessing.active_children())
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(FileNotFoundError, match="no weights in"):  # the child's own error
        _async_llm(broken, "process")
    with pytest.raises(RuntimeError, match=r"exited while starting \(exit code 3\)"):
        _async_llm(tiny_model_dir, "process", _VanishingEngine)
    assert set(multiprocessing.active_children()) <= before  # none left behind


def test_step_outputs_cross_the_pipe_intact():
    """The per-step message's rows rebuild the same outputs (the prompt stays behind)."""
    outputs = [
        RequestOutput("a", "hi", [1, 2], [CompletionOutput(0, " x", [5], None, None, None)],
                      False, 0, None, {"arrival_time": 1.0}),
        RequestOutput("b", None, [3], [
            CompletionOutput(0, "", [7, 8], [{7: Logprob(-0.5, 1, "s")},
                                             {8: Logprob(-1.5, 2, "t"), 9: Logprob(-0.1, 1, "u")}],
                             "stop", 8),
            CompletionOutput(1, "é", [9], None, "length", None)],
            True, 16, None, {"arrival_time": 1.0, "finished_time": 2.0}),
        RequestOutput("c", None, [4], [CompletionOutput(0, "", [], None, "error", None)],
                      True, 0, "the engine failed", {}),
    ]
    decoded = decode_outputs(encode_outputs(outputs))
    for out in outputs:
        out.prompt, out.prompt_token_ids = None, []
    assert decoded == outputs


# --- async scheduling: the next step is planned before this one's tokens are read --------

@pytest.mark.parametrize("engine_args", [
    {},
    {"num_gpu_blocks_override": 11, "max_model_len": 160},  # preemptions
    {"max_num_batched_tokens": 8},  # chunked prefill
])
def test_async_scheduling_gives_the_same_outputs(tiny_model_dir, engine_args):
    """Placeholders, late stop checks and dropped extra tokens change no output."""
    prompts = PROMPTS[:6] + ["The quick brown fox " * 5] * 2
    params = _mixed_params()[:6] + [
        SamplingParams(temperature=0, max_tokens=30, stop=[" the", "e"]),
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2),
    ]
    args = {**ENGINE_ARGS, "max_model_len": 512, **engine_args}
    sync = LLM(str(tiny_model_dir), **args).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), async_scheduling=True, **args)
    assert llm.engine.async_scheduling
    got = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(sync, got):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in a.outputs] == \
               [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):  # batch shapes differ: values to rounding
            assert (ca.logprobs is None) == (cb.logprobs is None)
            for la, lb in zip(ca.logprobs or [], cb.logprobs or []):
                assert {t: x.rank for t, x in la.items()} == {t: x.rank for t, x in lb.items()}
                for t in la:
                    assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-4)
    mgr = llm.engine.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_async_scheduling_computes_no_token_past_max_tokens(tiny_model_dir, monkeypatch):
    """A request whose unread token is its last is not launched again: every row
    the model samples is a token some request keeps."""
    llm = LLM(str(tiny_model_dir), async_scheduling=True, **ENGINE_ARGS)
    runner = llm.engine.model_runner
    execute, sampled = runner.execute, []

    def spy(entries, *args, **kwargs):
        sampled.append(sum(e.sample for e in entries))
        return execute(entries, *args, **kwargs)

    monkeypatch.setattr(runner, "execute", spy)
    lengths = [1, 5, 12]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert sum(sampled) == sum(lengths)


# --- final-only completions are detokenized once, when they finish -----------------------

FINAL_ONLY = RequestOutputKind.FINAL_ONLY
DELTA = RequestOutputKind.DELTA


@pytest.fixture(scope="module")
def tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


class _TokenMix:
    """Random output ids that hit every corner of detokenization: bytes of characters
    left unfinished, characters split over tokens, special and added tokens, EOS, ids
    beyond the tokenizer (the model's vocabulary is larger), and plain text."""

    def __init__(self, tok: Tokenizer, vocab_size: int, rng: random.Random) -> None:
        self.rng = rng
        plain = range(tok.vocab_size - len(tok.backend.get_added_tokens_decoder()))
        # Tokens whose bytes end in the middle of a character.
        self.unfinished = [i for i in plain if tok.decode([i]).endswith("\ufffd")]
        self.plain = [i for i in plain if not tok.decode([i]).endswith("\ufffd")]
        self.added = sorted(tok.backend.get_added_tokens_decoder())  # special or not
        self.beyond = list(range(tok.vocab_size, vocab_size))
        self.eos = list(tok.eos_token_ids)
        # Multi-byte characters as the tokenizer splits them.
        self.split = [ids for ids in (tok.encode(t) for t in ("é", "中文", "🦩", " 😀!", "ß∑"))
                      if len(ids) > 1]

    def sequence(self, length: int, stop_token_ids: list[int]) -> list[int]:
        rng, ids = self.rng, []
        while len(ids) < length:
            r = rng.random()
            if r < 0.3:
                ids.append(rng.choice(self.unfinished))
            elif r < 0.45:
                ids += rng.choice(self.split)
            elif r < 0.5:
                ids.append(rng.choice(self.eos))
            elif r < 0.6 and stop_token_ids:
                ids.append(rng.choice(stop_token_ids))
            elif r < 0.7:
                ids.append(rng.choice(self.added))
            elif r < 0.75:
                ids.append(rng.choice(self.beyond))
            else:
                ids.append(rng.choice(self.plain))
        return ids[:length]


def test_final_text_replays_the_token_by_token_detokenizer(tok) -> None:
    """`final_text` gives what `add_token` for each id (leaving out the last piece or
    not), then `flush()` or not, gives, for random ids of every kind."""
    mix = _TokenMix(tok, PRESETS["tiny"]["vocab_size"], random.Random(0))
    seen = {"held then released": 0, "unfinished at the end": 0, "held bytes dropped": 0}
    for _ in range(1500):
        ids = mix.sequence(mix.rng.randint(1, 10), [])
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
            pieces = [detok.add_token(i) for i in ids]
            flushed = detok.flush()
            for drop_last, flush in itertools.product((False, True), (False, True)):
                expected = "".join(pieces[:-1] if drop_last else pieces)
                expected += flushed if flush else ""
                got = detok.final_text(ids, drop_last=drop_last, flush=flush)
                assert got == expected, (ids, skip, drop_last, flush)
            seen["held then released"] += any(
                p == "" and any(pieces[i + 1:]) for i, p in enumerate(pieces[:-1]))
            seen["unfinished at the end"] += flushed.endswith("\ufffd")
            seen["held bytes dropped"] += len(pieces[-1]) > len(tok.decode(ids[-1:], skip))
        assert detok.output_token_ids == ids  # final_text replays, it does not record
    assert all(seen.values()), seen


def test_check_token_needs_no_text_and_refuses_stop_strings() -> None:
    checker = StopChecker(SamplingParams(max_tokens=3, stop_token_ids=[7], min_tokens=1), [0])
    assert [checker.check_token(t, n) for n, t in enumerate([7, 5], start=1)] == [False, False]
    assert checker.check_token(7, 3) and checker.dropped_stop_token_text
    assert (checker.finish_reason, checker.stop_reason) == ("stop", 7)
    with pytest.raises(RuntimeError, match="finished"):
        checker.check_token(5, 4)
    with pytest.raises(ValueError, match="stop strings"):
        StopChecker(SamplingParams(stop=["x"]), [0]).check_token(5, 1)


def _random_params(rng: random.Random, mix: _TokenMix) -> SamplingParams:
    max_tokens = rng.randint(1, 10)
    stop_token_ids = rng.sample(mix.unfinished + mix.plain[:50] + mix.added, rng.randint(0, 2))
    return SamplingParams(
        n=rng.choice([1, 1, 2, 3]), max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, min(2, max_tokens)]),
        ignore_eos=rng.random() < 0.2, skip_special_tokens=rng.random() < 0.6,
        include_stop_str_in_output=rng.random() < 0.3, stop_token_ids=stop_token_ids,
        stop=rng.choice([["e"], ["\ufffd", "ab"]]) if rng.random() < 0.15 else None,
    )


def _feed(engine: LLMEngine, tokens: dict[str, list[list[int]]],
          ends: dict[str, tuple[str, int]]) -> dict[str, RequestOutput]:
    """Run requests as the engine would, one step at a time, with `tokens[id][i]` as the
    sampled ids of completion `i`; at step `ends[id][1]` abort or fail the request.

    Returns each request's outputs, deltas folded together as `LLM.generate` does.
    """
    results: dict[str, RequestOutput] = {}

    def collect(outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out

    for step in itertools.count():
        for rid, (how, at) in ends.items():
            if at == step and rid in engine._groups:
                if how == "abort":
                    collect(engine.abort_request([rid]))
                else:
                    ids = [c.request.request_id for c in engine._groups[rid].completions]
                    collect(engine._fail(ids, "injected"))
        rows, sampled = [], []
        for rid, group in engine._groups.items():
            for c in group.completions:
                if c.finish_reason is None:
                    rows.append((group, c, c.request.append_placeholder_token()))
                    sampled.append(tokens[rid][c.index][step])
        if not rows:
            return results
        host = HostCopy([torch.tensor(sampled)])
        collect(engine._process(request_state._Step(rows, host, {}, None, False)))


def test_text_decoded_at_end_equals_the_streamed_text(tok, tiny_model_dir) -> None:
    """The same random token streams through a streamed (DELTA) request and a
    final-only one: the same text, token ids, finish and stop reasons in every
    case (EOS, stop token ids kept or not, length, min_tokens, ignore_eos, special
    tokens kept or skipped, n > 1, the context filled, aborts and failures
    mid-character), and the final-only ones without stop strings never touched the
    incremental detokenizer."""
    max_model_len = 24
    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir), **{
        **ENGINE_ARGS, "max_model_len": max_model_len}).create_engine_config())
    rng = random.Random(1)
    mix = _TokenMix(tok, engine.vocab_size, rng)
    tokens: dict[str, list[list[int]]] = {}
    ends: dict[str, tuple[str, int]] = {}
    deferred: list = []  # the final-only completions detokenized at the end
    all_params = []
    for i in range(300):
        params = _random_params(rng, mix)
        prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(1, 8))]
        if i % 10 == 9:  # no max_tokens: the full context ends it (the engine's own check)
            params = params.replace(max_tokens=None, min_tokens=0)
            prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(12, 20))]
        all_params.append(params)
        length = params.max_tokens or max_model_len - len(prompt)
        streams = [mix.sequence(length, params.stop_token_ids) for _ in range(params.n)]
        end = (rng.choice(["abort", "fail"]), rng.randint(0, length)) \
            if rng.random() < 0.2 else ("", -1)
        for kind in (DELTA, FINAL_ONLY):
            rid = f"{kind.name}-{i}"
            # Past `process_inputs`, which would cap max_tokens at what fits.
            engine.add_processed_request(llm_engine.ProcessedRequest(
                rid, None, prompt, params.replace(output_kind=kind), 0, time.monotonic()))
            tokens[rid], ends[rid] = streams, end
            completions = engine._groups[rid].completions
            assert all(c.text_at_end == (kind == FINAL_ONLY and not params.stop)
                       for c in completions)
            deferred += [c for c in completions if c.text_at_end]
    results = _feed(engine, tokens, ends)
    assert not engine.has_unfinished_requests()

    def summary(out: RequestOutput) -> list[tuple]:
        return sorted((c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                      for c in out.outputs)

    seen = set()
    for i, params in enumerate(all_params):
        streamed, final = results[f"DELTA-{i}"], results[f"FINAL_ONLY-{i}"]
        assert summary(final) == summary(streamed), i
        for c in final.outputs:
            seen.add((c.finish_reason, type(c.stop_reason).__name__))
            if params.max_tokens is None and c.finish_reason == "length":
                assert len(final.prompt_token_ids) + len(c.token_ids) == max_model_len
                seen.add("context full")
            if c.text.endswith("\ufffd"):
                seen.add("ends mid-character")
            if (c.finish_reason == "stop" and not params.stop
                    and not params.include_stop_str_in_output
                    and c.text != tok.decode(c.token_ids[:-1], params.skip_special_tokens)):
                seen.add("the stop token's text held earlier bytes, dropped with it")
    assert seen >= {("stop", "NoneType"), ("stop", "int"), ("stop", "str"),
                    ("length", "NoneType"), ("abort", "NoneType"), ("error", "NoneType"),
                    "context full", "ends mid-character",
                    "the stop token's text held earlier bytes, dropped with it"}, seen
    assert deferred and all(not c.detokenizer.output_token_ids for c in deferred)


async def _collect_by_index(engine: AsyncLLM, prompt, params) -> list[tuple]:
    """A stream's completions: (index, text, token ids, finish reason, stop reason)."""
    got: dict[int, list] = {}
    async for out in engine.generate(prompt, params):
        for c in out.outputs:
            entry = got.setdefault(c.index, [c.index, "", [], None, None])
            entry[1] += c.text
            entry[2] += c.token_ids
            if c.finish_reason is not None:
                entry[3], entry[4] = c.finish_reason, c.stop_reason
    return sorted(tuple(e) for e in got.values())


def test_generate_texts_match_streamed_texts(engine, offline, monkeypatch) -> None:
    """`LLM.generate` (final-only: decoded at the end unless stop strings need the
    text) and streams give the same texts on the model's own random output."""
    encode = offline.engine.tokenizer.encode
    prompts = [f"Text check {i}: les élèves 中文 🦩" for i in range(10)]
    params = [SamplingParams(temperature=1.0, seed=40 + i, max_tokens=12 + 2 * i,
                             min_tokens=i % 3, n=2 if i % 4 == 3 else 1,
                             stop=["ão", " end"] if i % 3 == 0 else None,
                             stop_token_ids=encode(" takes") + encode(" end") if i % 4 == 1
                             else None,
                             skip_special_tokens=i % 2 == 0,
                             include_stop_str_in_output=i % 5 == 2)
              for i in range(len(prompts))]
    detokenized = set()  # the prompts of the requests detokenized token by token
    add_token = IncrementalDetokenizer.add_token

    def spy(self, token_id):
        detokenized.add(tuple(self.prompt_token_ids))
        return add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", spy)
    expected = offline.generate(prompts, params, use_tqdm=False)
    monkeypatch.undo()
    assert detokenized == {tuple(encode(p)) for p, sp in zip(prompts, params) if sp.stop}

    async def main():
        return await asyncio.gather(*[_collect_by_index(engine, p, sp)
                                      for p, sp in zip(prompts, params)])

    for got, exp in zip(asyncio.run(main()), expected):
        assert got == sorted((c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
                             for c in exp.outputs)
    endings = {(c.finish_reason, type(c.stop_reason).__name__)
               for e in expected for c in e.outputs}
    assert endings >= {("stop", "str"), ("stop", "int"), ("length", "NoneType")}, endings


@pytest.mark.parametrize("mode", MODES)
def test_only_the_engine_process_freezes_its_heap(tiny_model_dir, mode):
    """The engine process exempts its start-up heap from the collector's scans;
    an engine on a thread of the caller's process leaves the caller's heap alone."""
    assert gc.get_freeze_count() == 0
    llm = _async_llm(tiny_model_dir, mode, _HeapReportingEngine)
    try:
        frozen = llm.get_stats()["gc_frozen_objects"]
        if mode == "process":
            assert frozen > 10_000  # torch, the model, the tokenizer: all of start-up
        else:
            assert frozen == 0
        assert gc.get_freeze_count() == 0
    finally:
        llm.shutdown()


def test_heap_frozen_restores_the_heap_it_found():
    """`heap_frozen` (the serving benchmark's client) freezes for its block only:
    unfrozen after it, after an exception in it, and a frozen heap stays frozen."""
    assert gc.get_freeze_count() == 0
    with heap_frozen():
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError, match="in the block"), heap_frozen():
        raise RuntimeError("in the block")
    assert gc.get_freeze_count() == 0
    gc.freeze()  # frozen by its owner: left frozen (unfrozen, the count would be 0)
    try:
        with heap_frozen():
            pass
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
