"""Phase 4: the scheduler.

Stories on tiny KV pools with exact numbers: the test plays the engine,
appending a token for every request that samples and finishing requests at
their `max_tokens`. The last tests run many requests through a fake model
that writes token ids into a fake KV cache and reads each context back
through the block tables, so a wrong block, slot or prefix hit shows up as a
wrong token.
"""

from __future__ import annotations

import random

import pytest
import torch

from mini_vllm.config import SchedulerConfig
from mini_vllm.kv_cache import KVCacheManager, compute_slot_mapping
from mini_vllm.sampling_params import SamplingParams
from mini_vllm.scheduler import Scheduler
from mini_vllm.scheduler_output import SchedulerOutput
from mini_vllm.sequence import Request, RequestStatus

pytestmark = pytest.mark.phase4


def make_scheduler(
    num_blocks: int = 17,
    block_size: int = 4,
    max_num_seqs: int = 8,
    budget: int = 16,
    max_model_len: int = 64,
    caching: bool = True,
    chunked: bool = True,
) -> Scheduler:
    """A scheduler over `num_blocks - 1` usable blocks (ids 1..num_blocks-1)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching, max_model_len))


def add(
    scheduler: Scheduler,
    request_id: str,
    prompt: int | list[int],
    max_tokens: int | None = 16,
    priority: int = 0,
    parent_id: str | None = None,
    arrival_time: float = 0.0,
) -> Request:
    """Queue a request; an int prompt means that many tokens unique to this request.

    Requests arriving at the same time are ordered by the order they are added.
    """
    if isinstance(prompt, int):
        base = 1000 * (sum(map(ord, request_id)) % 1000)
        prompt = [base + i for i in range(prompt)]
    request = Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens),
        arrival_time=arrival_time,
        priority=priority,
        parent_id=parent_id,
    )
    scheduler.add_request(request)
    return request


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'sample' token 7 where a request samples, finish at max_tokens."""
    out = scheduler.schedule()
    for s in out.scheduled:
        if s.sample:
            s.request.append_output_token(7)
            if s.request.num_output_tokens >= s.request.max_tokens:
                scheduler.finish_request(s.request_id, RequestStatus.FINISHED_LENGTH)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request_id, s.num_new_tokens) for s in out.scheduled]


def tables(out: SchedulerOutput) -> dict[str, list[int]]:
    return {s.request_id: s.block_table.tolist() for s in out.scheduled}


# ------------------------------------------------------- continuous batching


def test_continuous_batching_admits_new_requests_while_others_decode() -> None:
    # Block size 4, budget 16. A has 5 prompt tokens, B has 3.
    sched = make_scheduler()
    a = add(sched, "A", 5, max_tokens=2)
    add(sched, "B", 3, max_tokens=4)

    out = step(sched)  # both prompts in one step
    assert plan(out) == [("A", 5), ("B", 3)]
    assert tables(out) == {"A": [1, 2], "B": [3]}
    assert (out.num_batched_tokens, out.num_prefill_tokens, out.num_decode_tokens) == (8, 8, 0)
    assert all(s.sample and s.is_prefill for s in out.scheduled)
    assert a.num_computed_tokens == 5 and a.num_tokens == 6  # advanced at schedule time

    add(sched, "C", 6, max_tokens=1)
    out = step(sched)  # A and B decode, C's prompt joins the same step
    assert plan(out) == [("A", 1), ("B", 1), ("C", 6)]
    assert tables(out) == {"A": [1, 2], "B": [3], "C": [4, 5]}
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (6, 2)
    decode_a = out.scheduled[0]
    assert (decode_a.start_pos, decode_a.token_ids, decode_a.is_prefill) == (5, [7], False)
    assert a.status == RequestStatus.FINISHED_LENGTH  # 2 tokens: done

    out = step(sched)  # B's 5th token (position 4) opens a new block
    assert plan(out) == [("B", 1)]
    assert tables(out) == {"B": [3, 6]}
    assert out.finished == ["A", "C"]  # reported once, in the next step
    assert sched.kv_cache_manager.num_free_blocks == 16 - 2

    step(sched)
    out = step(sched)
    assert plan(out) == [] and out.is_empty and out.finished == ["B"]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 16


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget() -> None:
    # Budget 8 tokens per step, block size 4. A has a prompt of 20 tokens.
    sched = make_scheduler(budget=8)
    a = add(sched, "A", 20)
    out = step(sched)
    (chunk,) = out.scheduled
    assert (chunk.num_new_tokens, chunk.start_pos, chunk.sample) == (8, 0, False)
    assert chunk.token_ids == a.prompt_token_ids[:8] and chunk.block_table.tolist() == [1, 2]

    add(sched, "B", 3)
    out = step(sched)  # A takes the whole budget: B waits
    (chunk,) = out.scheduled
    assert (chunk.num_new_tokens, chunk.start_pos, chunk.sample) == (8, 8, False)
    assert chunk.token_ids == a.prompt_token_ids[8:16] and chunk.block_table.tolist() == [1, 2, 3, 4]
    assert a.num_output_tokens == 0

    out = step(sched)  # A's last 4 prompt tokens, then B's prompt
    assert plan(out) == [("A", 4), ("B", 3)]
    assert out.scheduled[0].sample and out.scheduled[0].start_pos == 16
    assert tables(out) == {"A": [1, 2, 3, 4, 5], "B": [6]}
    assert a.output_token_ids == [7]


def test_decodes_and_a_prompt_chunk_share_the_budget() -> None:
    sched = make_scheduler(budget=8)
    add(sched, "A", 3)
    step(sched)
    add(sched, "B", 20)
    assert plan(step(sched)) == [("A", 1), ("B", 7)]
    out = step(sched)
    assert plan(out) == [("A", 1), ("B", 7)]
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (7, 1)
    out = step(sched)
    assert plan(out) == [("A", 1), ("B", 6)] and out.scheduled[1].sample


def test_max_num_seqs_caps_the_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for name in "ABC":
        add(sched, name, 2, max_tokens=2)
    assert plan(step(sched)) == [("A", 2), ("B", 2)]
    assert plan(step(sched)) == [("A", 1), ("B", 1)]  # C waits for a seat
    assert plan(step(sched)) == [("C", 2)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    # max_model_len 16 = budget. A and B decode (1 token each); C's 15-token
    # prompt does not fit in the 14 left, and D, behind it, does not jump the queue.
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    add(sched, "A", 3, max_tokens=3)
    add(sched, "B", 3, max_tokens=2)
    step(sched)
    add(sched, "C", 15, max_tokens=1)
    add(sched, "D", 2)
    assert plan(step(sched)) == [("A", 1), ("B", 1)]
    assert plan(step(sched)) == [("A", 1), ("C", 15)]  # B finished: 15 tokens left
    assert plan(step(sched)) == [("D", 2)]


# ---------------------------------------------------------------- preemption


def test_running_out_of_blocks_preempts_the_latest_arrival_which_resumes_later() -> None:
    # 4 usable blocks of 4 tokens. A and B have 7-token prompts: 2 blocks each.
    sched = make_scheduler(num_blocks=5)
    a = add(sched, "A", 7, max_tokens=4)
    b = add(sched, "B", 7, max_tokens=10)
    assert tables(step(sched)) == {"A": [1, 2], "B": [3, 4]}
    assert plan(step(sched)) == [("A", 1), ("B", 1)]  # position 7 still fits in block 2 / 4

    # Position 8 needs a third block each; none is free. B, the later arrival,
    # is preempted; its blocks go back (block 4 first), A takes block 4.
    out = step(sched)
    assert plan(out) == [("A", 1)] and out.preempted == ["B"]
    assert tables(out) == {"A": [1, 2, 4]}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7] and [r.request_id for r in sched.waiting] == ["B"]
    assert sched.get_stats().num_preemptions == 1

    # B does not fit yet (it needs 3 blocks, 1 is free), A finishes its 4 tokens.
    assert plan(step(sched)) == [("A", 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH

    # B comes back: its first block (its prompt's tokens 0-3) is still cached,
    # so it recomputes positions 4-8 (3 prompt tokens + its 2 outputs) and
    # samples its 3rd token as if nothing had happened.
    out = step(sched)
    (resumed,) = out.scheduled
    assert (resumed.request_id, resumed.start_pos, resumed.num_new_tokens) == ("B", 4, 5)
    assert resumed.token_ids == b.prompt_token_ids[4:] + [7, 7]
    assert resumed.block_table.tolist() == [3, 4, 2] and resumed.sample and resumed.is_prefill
    assert b.status == RequestStatus.RUNNING and b.output_token_ids == [7, 7, 7]
    assert b.num_cached_tokens == 0  # counted at its first admission only


def test_the_preempted_request_is_the_worst_priority_not_the_latest() -> None:
    # X has priority 1 (worse) and arrived first; Y has priority 0.
    sched = make_scheduler(num_blocks=5)
    x = add(sched, "X", 7, max_tokens=4, priority=1, arrival_time=0.0)
    add(sched, "Y", 7, max_tokens=4, priority=0, arrival_time=1.0)
    assert tables(step(sched)) == {"Y": [1, 2], "X": [3, 4]}  # Y goes first
    step(sched)
    add(sched, "Z", 3, max_tokens=4, priority=1, arrival_time=2.0)
    add(sched, "W", 3, max_tokens=4, priority=0, arrival_time=3.0)
    out = step(sched)
    assert out.preempted == ["X"] and x.status == RequestStatus.PREEMPTED
    assert tables(out) == {"Y": [1, 2, 4]}
    # X goes back ahead of Z (same priority, later arrival), behind W (better priority).
    assert [r.request_id for r in sched.waiting] == ["W", "X", "Z"]


def test_waiting_requests_run_by_priority_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1)
    add(sched, "A", 3, max_tokens=1, priority=1)
    add(sched, "B", 3, max_tokens=1, priority=0)
    add(sched, "C", 3, max_tokens=1, priority=0)
    assert [plan(step(sched)) for _ in range(3)] == [[("B", 3)], [("C", 3)], [("A", 3)]]


# -------------------------------------------------------- aborts, rejections


def test_aborting_waiting_and_running_requests_frees_their_blocks() -> None:
    sched = make_scheduler(max_num_seqs=1)
    a = add(sched, "A", 9)
    b = add(sched, "B", 3)
    step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 16 - 3
    sched.abort_requests(["A", "B", "nobody"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache_manager.num_free_blocks == 16
    assert not sched.has_unfinished_requests() and sched.get_stats().num_waiting == 0
    out = step(sched)
    assert out.is_empty and out.finished == ["A", "B"]
    sched.abort_requests("A")  # twice: ignored
    with pytest.raises(ValueError, match="FINISHED_"):
        sched.finish_request("A", RequestStatus.RUNNING)


def test_requests_that_can_never_fit_are_rejected_at_once() -> None:
    # max_model_len 16, 3 usable blocks of 4 tokens (12 slots).
    sched = make_scheduler(num_blocks=4, max_model_len=16)
    with pytest.raises(ValueError, match="no room for an output token"):
        add(sched, "too-long", 16)
    with pytest.raises(ValueError, match="need 4 KV blocks .* whole cache has 3"):
        add(sched, "grows-too-much", 8, max_tokens=8)  # 15 tokens to compute
    with pytest.raises(ValueError, match="need 4 KV blocks"):
        add(sched, "unbounded", 8, max_tokens=None)  # up to max_model_len
    add(sched, "fits", 8, max_tokens=5)  # 12 tokens to compute: 3 blocks
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "fits", 2)
    # Nothing rejected blocks the queue.
    assert plan(step(sched)) == [("fits", 8)]
    assert sched.get_num_unfinished_requests() == 1


def test_schedule_refuses_a_request_whose_sampled_token_was_not_appended() -> None:
    sched = make_scheduler()
    add(sched, "A", 3)
    sched.schedule()  # samples, but nobody appends the token
    with pytest.raises(RuntimeError, match="must append"):
        sched.schedule()


def test_a_request_whose_unread_token_is_its_last_is_not_scheduled_again() -> None:
    """Async scheduling: A's second (and last, max_tokens=2) token is a placeholder,
    still on the device. A step for A would compute a third token only to drop it."""
    sched = make_scheduler()
    a, b = add(sched, "A", 3, max_tokens=2), add(sched, "B", 3, max_tokens=4)
    sched.schedule()
    a.append_placeholder_token(), b.append_placeholder_token()  # the prefill's tokens
    assert plan(sched.schedule()) == [("A", 1), ("B", 1)]
    a.resolve_token(0, 7), b.resolve_token(0, 7)
    a.append_placeholder_token(), b.append_placeholder_token()  # A's 2nd: its last
    assert plan(sched.schedule()) == [("B", 1)]
    assert a in sched.running  # until the engine reads the token and finishes it
    b.append_placeholder_token()
    a.resolve_token(1, 7)
    sched.finish_request("A", RequestStatus.FINISHED_LENGTH)
    assert plan(sched.schedule()) == [("B", 1)]


# ------------------------------------------------------ n > 1, stats, errors


def test_n_children_share_the_prompt_blocks() -> None:
    # One prompt of 10 tokens, n = 3: the first child computes it, the other
    # two find its two full blocks in the cache and compute 2 tokens each.
    sched = make_scheduler()
    prompt = list(range(100, 110))
    kids = [add(sched, f"p-{i}", prompt, parent_id="p", arrival_time=5.0) for i in range(3)]
    out = step(sched)
    assert plan(out) == [("p-0", 10), ("p-1", 2), ("p-2", 2)]
    assert tables(out) == {"p-0": [1, 2, 3], "p-1": [1, 2, 4], "p-2": [1, 2, 5]}
    assert [s.start_pos for s in out.scheduled] == [0, 8, 8]
    assert out.scheduled[1].token_ids == [108, 109]
    assert all(s.sample for s in out.scheduled)
    counts = {b.block_id: b.ref_cnt for b in sched.kv_cache_manager.block_pool.blocks[1:6]}
    assert counts == {1: 3, 2: 3, 3: 1, 4: 1, 5: 1}
    assert [k.num_cached_tokens for k in kids] == [0, 8, 8]
    stats = sched.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (30, 16)
    assert stats.prefix_cache_hit_rate == pytest.approx(16 / 30)


def test_n_children_wait_for_the_first_ones_chunked_prefill() -> None:
    # Budget 6: the first child's prompt takes two steps; the second child is
    # admitted once the prompt's full blocks are all allocated and cached.
    sched = make_scheduler(budget=6)
    prompt = list(range(100, 110))
    for i in range(3):
        add(sched, f"p-{i}", prompt, parent_id="p", arrival_time=5.0)
    out = step(sched)
    assert plan(out) == [("p-0", 6)] and tables(out) == {"p-0": [1, 2]}
    out = step(sched)
    assert plan(out) == [("p-0", 4), ("p-1", 2)]
    assert tables(out) == {"p-0": [1, 2, 3], "p-1": [1, 2, 4]}
    out = step(sched)
    assert plan(out) == [("p-0", 1), ("p-1", 1), ("p-2", 2)]
    assert tables(out)["p-2"] == [1, 2, 5]


def test_without_prefix_caching_children_compute_their_own_prompts() -> None:
    sched = make_scheduler(caching=False, budget=32)
    prompt = list(range(100, 110))
    for i in range(3):
        add(sched, f"p-{i}", prompt, parent_id="p", arrival_time=5.0)
    out = step(sched)
    assert plan(out) == [("p-0", 10), ("p-1", 10), ("p-2", 10)]
    assert tables(out) == {"p-0": [1, 2, 3], "p-1": [4, 5, 6], "p-2": [7, 8, 9]}


def test_stats_report_queues_preemptions_usage_and_prefix_hits() -> None:
    sched = make_scheduler(num_blocks=11, max_num_seqs=2)  # 10 usable blocks
    add(sched, "A", list(range(9)))
    add(sched, "B", list(range(9)))
    add(sched, "C", 2)
    step(sched)
    stats = sched.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (2, 1, 0)
    assert stats.kv_cache_usage == pytest.approx(4 / 10)  # A: 1, 2, 3; B: 1, 2 shared + 4
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)


def test_a_failed_request_resets_the_prefix_cache() -> None:
    sched = make_scheduler()
    add(sched, "A", list(range(9)))
    step(sched)
    sched.finish_request("A", RequestStatus.FINISHED_ERROR)
    add(sched, "B", list(range(9)))
    out = step(sched)
    assert out.scheduled[0].start_pos == 0  # A's blocks were not reused


# ------------------------------------------------ stress with a fake model


class FakeModel:
    """Writes each computed token into a fake KV cache and reads contexts back.

    The cache maps a slot to the (position, token) it holds. Sampling reads a
    sequence's whole context through its block table, checks it is exactly
    the request's tokens, and returns a token that depends on all of them, so
    the outputs are a function of the prompt alone, however it was scheduled.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.cache: dict[int, tuple[int, int]] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        for s in out.scheduled:  # every write of the step happens before any read
            slots = compute_slot_mapping(
                s.block_table, s.start_pos, s.num_new_tokens, self.block_size
            )
            for i, slot in enumerate(slots):
                self.cache[slot] = (s.start_pos + i, s.token_ids[i])
        sampled = {}
        for s in out.scheduled:
            end = s.start_pos + s.num_new_tokens
            slots = compute_slot_mapping(s.block_table, 0, end, self.block_size)
            context = [self.cache[slot] for slot in slots]
            assert context == list(enumerate(s.request.all_token_ids[:end])), s.request_id
            if s.sample:
                sampled[s.request_id] = next_token(s.request.all_token_ids)
        return sampled


def next_token(tokens: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 2654435761) % 50 + 1


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


def check_block_accounting(sched: Scheduler) -> None:
    """Ref counts equal block-table membership; free list = unreferenced blocks."""
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    holders: dict[int, int] = {}
    for r in sched.running:
        table = kv.get_block_table(r.request_id)
        assert len(table) == kv.num_blocks_for(r.num_computed_tokens)
        for block_id in table:
            holders[block_id] = holders.get(block_id, 0) + 1
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0)
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_block_queue)
    assert pool.blocks[0].ref_cnt == 0 and 0 not in pool.free_block_queue
    for r in sched.waiting:
        assert kv.get_block_table(r.request_id) == []


@pytest.mark.parametrize(
    ("caching", "chunked", "seed"),
    [(True, True, 0), (True, True, 1), (False, True, 2), (True, False, 3), (False, False, 4)],
)
def test_many_requests_on_a_small_pool_get_the_outputs_of_an_unlimited_one(
    caching: bool, chunked: bool, seed: int
) -> None:
    rng = random.Random(seed)
    block_size, max_model_len = 4, 48
    sched = make_scheduler(
        num_blocks=14, block_size=block_size, max_num_seqs=5, budget=48 if not chunked else 20,
        max_model_len=max_model_len, caching=caching, chunked=chunked,
    )
    model = FakeModel(block_size)
    # Prompts are a few 'words' of one block each, then a tail: they share
    # prefixes, and equal blocks also follow different prefixes.
    words = [[rng.randrange(1, 50) for _ in range(block_size)] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    requests: dict[str, Request] = {}
    aborted: set[str] = set()
    pending = 40
    for step_no in range(2000):
        while pending and rng.random() < 0.4:
            pending -= 1
            rid = f"r{pending}"
            prompt = [t for _ in range(rng.randrange(1, 4)) for t in rng.choice(words)]
            prompt += [rng.randrange(1, 50) for _ in range(rng.randrange(0, 6))]
            max_tokens = rng.randrange(1, 12)
            priority = rng.randrange(2)
            requests[rid] = add(sched, rid, prompt, max_tokens=max_tokens, priority=priority)
            expected[rid] = reference_outputs(prompt, max_tokens)
        if step_no % 17 == 5 and sched.requests:  # abort someone now and then
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        out = sched.schedule()
        assert out.num_batched_tokens <= sched.scheduler_config.max_num_batched_tokens
        assert len(sched.running) <= sched.scheduler_config.max_num_seqs
        for rid, token in model.execute(out).items():
            request = requests[rid]
            request.append_output_token(token)
            if request.num_output_tokens == request.max_tokens:
                sched.finish_request(rid, RequestStatus.FINISHED_LENGTH)
        check_block_accounting(sched)
        if not pending and not sched.has_unfinished_requests():
            break
    else:
        pytest.fail("requests did not finish")

    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    for rid, request in requests.items():
        if rid in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[rid][: request.num_output_tokens]
        else:
            assert request.status == RequestStatus.FINISHED_LENGTH
            assert request.output_token_ids == expected[rid], rid
    stats = sched.get_stats()
    if caching:
        assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions > 0  # the pool is small enough to force some


# --- end-to-end tests (engine) ---


# --- end-to-end tests (engine) -------------------------------------------------------
# The same greedy tokens whatever the scheduler had to do to produce them.

E2E_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. " * 3 + "And then?",
    "東京は日本の首都です。",
    "a",
]


def _greedy(model_dir, prompts=E2E_PROMPTS, max_tokens=40, ignore_eos=True, **engine_args):
    from mini_vllm import LLM, SamplingParams

    # On the CPU in float32 on any machine: the scheduler's behaviour must not change the
    # tokens, and transformers' float32 greedy tokens are the reference (a GPU's bf16
    # drifts from them within a few dozen tokens; test_phase9_gpu.py compares its logits).
    llm = LLM(str(model_dir), **{"num_gpu_blocks_override": 256, "device": "cpu",
                                 "dtype": "float32", **engine_args})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.engine.get_stats()


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir):
    return _greedy(tiny_model_dir, enable_prefix_caching=False)[0]


def test_e2e_prefix_caching_does_not_change_outputs(tiny_model_dir, reference_tokens):
    tokens, stats = _greedy(tiny_model_dir, enable_prefix_caching=True)
    assert tokens == reference_tokens
    assert stats["prefix_cache_hits"] > 0  # prompts 0 and 3 share full blocks


def test_e2e_preemption_does_not_change_outputs(tiny_model_dir, reference_tokens):
    # 10 usable blocks of 16 tokens for six requests that each grow to 3-6 blocks.
    tokens, stats = _greedy(tiny_model_dir, num_gpu_blocks_override=11, max_model_len=160)
    assert stats["num_preemptions"] > 0
    assert tokens == reference_tokens


def test_e2e_chunked_prefill_does_not_change_outputs(tiny_model_dir, reference_tokens):
    tokens, _ = _greedy(tiny_model_dir, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert tokens == reference_tokens


def test_e2e_small_batches_do_not_change_outputs(tiny_model_dir, reference_tokens):
    tokens, _ = _greedy(tiny_model_dir, max_num_seqs=2)
    assert tokens == reference_tokens


def test_e2e_matches_transformers_greedy(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    from mini_vllm.tokenizer import Tokenizer

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    hf.eval()
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    ours, _ = _greedy(tiny_model_dir, max_tokens=32, ignore_eos=False)
    for prompt, our_tokens in zip(E2E_PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                              do_sample=False, eos_token_id=tok.eos_token_ids,
                              pad_token_id=tok.eos_token_ids[0])
        theirs = out[0, ids.shape[1]:].tolist()
        assert our_tokens == theirs
