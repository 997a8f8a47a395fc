"""Speculative decoding: proposers, exact verification, KV rollback, the speculative step.

Everything runs on the CPU in float32 with the tiny checkpoint as the target.
The draft models are a second tiny checkpoint with another seed (its
proposals are mostly rejected) and the target's own checkpoint (its greedy
proposals are all accepted), so both the rejection and the acceptance paths
run. The greedy tests hold every speculative run to the plain engine's tokens.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from server_thread import serving

from mini_vllm import LLM, SamplingParams
from mini_vllm.checkpoint import make_model
from mini_vllm.config import EngineArgs, SchedulerConfig
from mini_vllm.engine.llm_engine import LLMEngine
from mini_vllm.kv_cache import KVCacheManager
from mini_vllm.kv_cache.block_hash import extend_block_hashes
from mini_vllm.model_dir import DEFAULT_DRAFT_DIR, default_model_dir
from mini_vllm.model_runner import BatchEntry, ModelRunner, logits_rows
from mini_vllm.sampler import Sampler
from mini_vllm.sampling_metadata import SamplingMetadata
from mini_vllm.scheduler import Scheduler
from mini_vllm.sequence import Request
from mini_vllm.spec_decode.config import SpeculativeConfig
from mini_vllm.spec_decode.metrics import SpecDecodingStats
from mini_vllm.spec_decode.ngram_proposer import ngram_lookup
from mini_vllm.spec_decode.policy import FIRST_BACKOFF, SpeculationPolicy
from mini_vllm.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

pytestmark = pytest.mark.spec_decode

ENGINE_ARGS: dict[str, Any] = {"num_gpu_blocks_override": 128, "max_num_seqs": 8,
                               "max_model_len": 256, "device": "cpu", "dtype": "float32",
                               "seed": 0}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
# A prompt that repeats itself (the n-gram proposer finds its tail), and others.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],
    [100, 200, 300],
    list(range(40, 75)),
    [11] * 9,
]


@pytest.fixture(scope="module")
def draft_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny checkpoint: the target's shape and vocabulary, other weights."""
    return make_model(tmp_path_factory.mktemp("draft"), preset="tiny", seed=1)


def spec_config(name: str, tiny: Path, draft: Path, **extra: Any) -> dict[str, Any]:
    """The speculative configurations the tests run."""
    return {
        # (fixed k: the tiny model's text repeats itself only after a while)
        "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                  "prompt_lookup_max": 3, "adaptive": False},
        "draft": {"model": str(draft), "num_speculative_tokens": 3},
        "self_draft": {"model": str(tiny), "num_speculative_tokens": 4},
    }[name] | extra


def token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    """The engine without speculation: every result is held to its tokens."""
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def plain_greedy(plain: LLM) -> list[list[int]]:
    return token_ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))


def assert_cache_consistent(engine: LLMEngine) -> None:
    """Every running request holds exactly the blocks its computed tokens need, and
    every block of it in the prefix cache holds the hash of its verified tokens."""
    kv = engine.kv_cache_manager
    for req in engine.scheduler.running:
        blocks = kv.req_to_blocks[req.request_id]
        assert len(blocks) == kv.num_blocks_for(req.num_computed_tokens), req
        verified = extend_block_hashes([], req.all_token_ids, kv.block_size,
                                       req.num_known_tokens)
        for i, block in enumerate(blocks):
            if block.block_hash is not None:
                assert i < len(verified) and block.block_hash == verified[i], (req, i)


def run_to_end(engine: LLMEngine, check: bool = False) -> dict[str, Any]:
    """Step the engine until it is idle; each request's deltas folded into one output
    (`check`: the cache checked after every step)."""
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in done:
                done[out.request_id].add(out)
            else:
                done[out.request_id] = out
        if check:
            assert_cache_consistent(engine)
    return done


def assert_no_leak(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


# ----------------------------------------------------------------------------- configuration


def test_speculative_config_is_validated_naming_the_field(tiny_model_dir: Path,
                                                          draft_model_dir: Path,
                                                          tmp_path: Path) -> None:
    def make(value: Any) -> SpeculativeConfig | None:
        return EngineArgs(model=str(tiny_model_dir), device="cpu",
                          speculative_config=value).create_engine_config().speculative_config

    assert make(None) is None
    cfg = make('{"method": "ngram", "num_speculative_tokens": 3}')  # the CLI's JSON text
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min,
            cfg.prompt_lookup_max, cfg.adaptive) == ("ngram", 3, 2, 4, True)
    cfg = make({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (cfg.prompt_lookup_min, cfg.prompt_lookup_max) == (3, 3)  # one sets the other
    cfg = make({"model": str(draft_model_dir), "num_speculative_tokens": 5, "adaptive": False})
    assert cfg.method == "draft_model" and cfg.draft_model_config.vocab_size == 2368
    big = make_model(tmp_path / "other-vocab", preset="tiny", weights=False,
                     overrides={"vocab_size": 4096})
    bad = {
        '{"method": ': "not valid JSON",
        "[1, 2]": "JSON object",
        '{"method": "ngram"}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 0}': "num_speculative_tokens",
        '{"method": "ngram", "num_speculative_tokens": 17}': "num_speculative_tokens",
        '{"method": "eagle", "num_speculative_tokens": 2}': "method",
        '{"num_speculative_tokens": 2}': "method",
        '{"method": "ngram", "num_speculative_tokens": 2, "k": 1}': "unknown field",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}':
            "prompt_lookup_min",
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, '
        '"prompt_lookup_max": 2}': "prompt_lookup_min",
        '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}': "adaptive",
        json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2}): "config.json",
        json.dumps({"model": str(big), "num_speculative_tokens": 2}): "vocab_size",
        json.dumps({"method": "ngram", "model": str(draft_model_dir),
                    "num_speculative_tokens": 2}): "model",
        json.dumps({"model": str(draft_model_dir), "num_speculative_tokens": 2,
                    "prompt_lookup_max": 3}): "prompt_lookup_max",
    }
    for value, field in bad.items():
        with pytest.raises(ValueError, match=field):
            make(value)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineArgs(model=str(tiny_model_dir), device="cpu", max_model_len=4096,
                   speculative_config={"model": str(make_model(
                       tmp_path / "short", preset="tiny", weights=False,
                       overrides={"max_position_embeddings": 1024})),
                       "num_speculative_tokens": 2}).create_engine_config()


def test_cli_has_the_speculative_config_flag() -> None:
    # (the server's packages: not on every GPU box)
    from mini_vllm.entrypoints.cli_args import build_parser

    ns = build_parser().parse_args(
        ["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert json.loads(ns.speculative_config)["method"] == "ngram"


def test_a_draft_model_takes_its_share_of_the_kv_budget(tiny_model_dir: Path,
                                                        draft_model_dir: Path) -> None:
    args = {**ENGINE_ARGS, "num_gpu_blocks_override": None, "cpu_kv_cache_gb": 0.001,
            "max_num_seqs": 256}
    plain_blocks = LLM(str(tiny_model_dir), **args).engine.model_runner.num_blocks
    llm = LLM(str(tiny_model_dir), speculative_config={
        "model": str(draft_model_dir), "num_speculative_tokens": 2}, **args)
    # The draft has the target's shape: each block costs twice as much.
    assert llm.engine.model_runner.num_blocks == plain_blocks // 2
    assert llm.engine.proposer.runner.num_blocks == llm.engine.model_runner.num_blocks


# ----------------------------------------------------------------------------- pieces


def test_ngram_lookup_finds_the_longest_fullest_latest_match() -> None:
    t = np.array
    # Tail (7, 8) occurred before: propose what followed it.
    assert ngram_lookup(t([7, 8, 1, 2, 3, 7, 8]), 3, 2, 2) == [1, 2, 3]
    # Fewer tokens follow than asked: all that follow.
    assert ngram_lookup(t([7, 8, 1, 7, 8]), 4, 2, 2) == [1, 7, 8]
    # The longest match wins over a later, shorter one: (6, 7, 8) before (0, 7, 8).
    assert ngram_lookup(t([6, 7, 8, 1, 0, 7, 8, 2, 6, 7, 8]), 1, 2, 3) == [1]
    # In a repetition the previous period is followed by too few tokens: an earlier one.
    assert ngram_lookup(t([9, 1, 2, 1, 2, 1, 2]), 3, 2, 2) == [1, 2, 1]
    # No match of at least prompt_lookup_min tokens: nothing.
    assert ngram_lookup(t([1, 2, 3, 4, 3]), 2, 2, 4) == []
    assert ngram_lookup(t([3]), 2, 1, 1) == []


def test_logits_rows_and_a_runner_entry_with_several_logits(tiny_model_dir: Path) -> None:
    assert logits_rows(np.array([3, 8, 9]), np.array([1, 3, 0])).tolist() == [2, 5, 6, 7]
    runner = ModelRunner(EngineArgs(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                    num_gpu_blocks_override=32, max_model_len=256
                                    ).create_engine_config())
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    # The logits of every position of a prompt in one entry, beside a second entry ...
    both = runner.execute([BatchEntry(prompt[:4], 0, [9]),
                           BatchEntry(prompt, 0, [1], num_logits=len(prompt))])
    assert both.shape == (1 + len(prompt), runner.vocab_size)
    # ... equal each prefix computed alone.
    for j in range(len(prompt)):
        alone = runner.execute([BatchEntry(prompt[: j + 1], 0, [2 + j % 5])])
        torch.testing.assert_close(both[1 + j], alone[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_logits"):
        runner.execute([BatchEntry(prompt[:3], 0, [1], num_logits=4)])


def test_gpu_runner_verify_entries_match_the_reference_on_cpu(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU runner's flat path (decodes first, verified runs with the prompts) on the CPU."""
    from mini_vllm.gpu.attention import CudaAttentionBackend
    from mini_vllm.gpu.fused_layers import FusedDecoderForward
    from mini_vllm.gpu.model_runner import GPUModelRunner

    def config():
        return EngineArgs(model=str(tiny_model_dir), device="cpu", dtype="float32",
                          num_gpu_blocks_override=32, max_model_len=256).create_engine_config()

    ref = ModelRunner(config())
    monkeypatch.setattr(
        "mini_vllm.gpu.model_runner.select_attention_backend",
        lambda device, dtype, head_dim, group=None: CudaAttentionBackend(
            dtype, head_dim, device, use_kernels=False))
    fast = GPUModelRunner(config())
    fast.forward = FusedDecoderForward(fast.model, kernels=False)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14]]
    tables = [[1, 2], [3, 4], [5, 6]]
    for runner in (ref, fast):  # the prompts' K/V
        runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables)])
    # A decode, a verified run of 4 (3 proposals) and a run of 2, logits at each.
    step = [BatchEntry([20], 6, tables[0]),
            BatchEntry([21, 22, 23, 24], 5, tables[1], num_logits=4),
            BatchEntry([25, 26], 3, tables[2], num_logits=2)]
    want, got = ref.execute(step), fast.execute(step)
    assert got.shape == (7, ref.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# --8<-- [start:statistical_test]
def _frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / len(tokens)


def _assert_distribution(tokens: torch.Tensor, p: torch.Tensor) -> None:
    """Each token's frequency within 5 standard deviations of its probability.

    A frequency over `n` draws has standard deviation `sqrt(p (1 - p) / n)`;
    5 of them are exceeded with probability below 1e-6 per token, and the
    draws are seeded, so the test cannot flake. A sampler that emitted the
    proposals as they are would miss by far more (checked below)."""
    n = len(tokens)
    f = _frequencies(tokens, len(p))
    bound = 5 * torch.sqrt(p * (1 - p) / n) + 1e-9
    assert ((f - p).abs() <= bound).all(), (f, p, bound)


@pytest.mark.parametrize("proposer", ["draft", "ngram"])
def test_accepted_tokens_keep_the_target_distribution(proposer: str) -> None:
    """V = 6, k = 2, 40,000 sequences: the first emitted token is distributed as p1
    and the second (where there is one) as p2, whatever q proposed."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, n = 6, 2, 40_000
    target_logits = torch.randn(k + 1, vocab, generator=gen) * 1.5
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=1)
    p = torch.softmax(target_logits, dim=1).double()
    if proposer == "ngram":  # a fixed proposal: the same token every time
        drafts = torch.tensor([[int(q[0].argmin()), int(q[1].argmin())]] * n)
        draft_probs = None
    else:
        drafts = torch.multinomial(q, n, replacement=True, generator=gen).T  # [n, k]
        draft_probs = q.repeat(n, 1)
    meta = SamplingMetadata.build([(SamplingParams(temperature=1.0), None, [0], [], None)]
                                  * (n * (k + 1)), "cpu", vocab)
    torch.manual_seed(1)
    out = RejectionSampler(Sampler())(target_logits.repeat(n, 1), meta, [k] * n,
                                      drafts.reshape(-1).tolist(), draft_probs).output_token_ids
    assert out.shape == (n, k + 1)
    _assert_distribution(out[:, 0], p[0])
    second = out[:, 1][out[:, 1] != PLACEHOLDER_TOKEN_ID]
    assert len(second) > n // 10
    _assert_distribution(second, p[1])
    # The bound is tight enough to catch a sampler that kept the proposals.
    f = _frequencies(drafts[:, 0], vocab)
    assert ((f - p[0]).abs() > 5 * torch.sqrt(p[0] * (1 - p[0]) / n)).any()
# --8<-- [end:statistical_test]


def test_filters_and_penalties_give_the_plain_samplers_distribution() -> None:
    """Temperature, top-k, top-p, min-p and penalties: the first emitted token's
    frequencies equal the plain sampler's on the same rows, within both draws' noise."""
    gen = torch.Generator().manual_seed(3)
    vocab, n = 8, 30_000
    logits = torch.randn(1, vocab, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, min_p=0.02,
                            presence_penalty=0.7, frequency_penalty=0.2,
                            repetition_penalty=1.3)
    history = ([1, 2], [2, 2, 5])  # prompt, outputs
    plain_meta = SamplingMetadata.build([(params, None, *history, None)] * n, "cpu", vocab)
    torch.manual_seed(4)
    plain = Sampler()(logits.repeat(n, 1), plain_meta).sampled_token_ids
    p = _frequencies(plain, vocab)
    # One proposal (token 3) per sequence; row 1 counts it as an output.
    rows = [(params, None, history[0], history[1], None),
            (params, None, history[0], [*history[1], 3], None)] * n
    meta = SamplingMetadata.build(rows, "cpu", vocab)
    out = RejectionSampler(Sampler())(logits.repeat(2 * n, 1), meta, [1] * n, [3] * n
                                      ).output_token_ids
    f = _frequencies(out[:, 0], vocab)
    bound = 5 * torch.sqrt(2 * p * (1 - p) / n) + 1e-9
    assert ((f - p).abs() <= bound).all(), (f, p)
    removed = p == 0  # top-k keeps 6 of 8 tokens: the others are never emitted
    assert removed.sum() >= 2 and (f[removed] == 0).all()


def test_greedy_verification_accepts_exactly_the_argmax_run() -> None:
    vocab = 5
    logits = torch.full((7, vocab), -1.0)
    # Sequence A proposes 3 tokens: argmaxes 2, 4, 1, then 3 (its bonus).
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 1.0
    # Sequence B proposes 2: argmaxes 0, 0, 2.
    for row, best in zip([4, 5, 6], [0, 0, 2]):
        logits[row, best] = 1.0
    meta = SamplingMetadata.build([(SamplingParams(temperature=0), None, [0], [], None)] * 7,
                                  "cpu", vocab)
    out = RejectionSampler(Sampler())(logits, meta, [3, 2], [2, 4, 0, 0, 3]).output_token_ids
    # A: 2 and 4 accepted, 0 rejected for the argmax 1. B: 0 accepted, 3 rejected for 0.
    assert out.tolist() == [[2, 4, 1, PLACEHOLDER_TOKEN_ID], [0, 0, PLACEHOLDER_TOKEN_ID,
                                                              PLACEHOLDER_TOKEN_ID]]
    # All accepted: the bonus token follows.
    out = RejectionSampler(Sampler())(logits[:4], SamplingMetadata.build(
        [(SamplingParams(temperature=0), None, [0], [], None)] * 4, "cpu", vocab),
        [3], [2, 4, 1]).output_token_ids
    assert out.tolist() == [[2, 4, 1, 3]]


def test_policy_lowers_k_stops_and_tries_again() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000), 0.0)
    policy = SpeculationPolicy(4)
    policy.start(req)
    assert req.num_spec_tokens == 4
    for _ in range(3):  # everything accepted: the full run
        policy.observe(req, 4, 4)
    assert req.num_spec_tokens == 4 and policy.acceptance(req) > 0.9
    steps = 0
    while req.num_spec_tokens > 0:  # everything rejected: fewer, then none
        policy.observe(req, req.num_spec_tokens, 0)
        steps += 1
        assert steps <= 8
    assert not policy.wants_values(req)  # stopped: async scheduling keeps its overlap
    for _ in range(FIRST_BACKOFF):  # ... until its pause is over
        req.append_output_token(7)
    assert policy.wants_values(req) and req.num_spec_tokens == 1
    policy.observe(req, 1, 0)  # the retry fails: a pause twice as long
    assert req.num_spec_tokens == 0
    for _ in range(FIRST_BACKOFF):
        req.append_output_token(7)
    assert not policy.wants_values(req)
    for _ in range(FIRST_BACKOFF):
        req.append_output_token(7)
    assert policy.wants_values(req)
    policy.observe(req, 1, 1)  # the retry succeeds: speculating again, more next time
    assert req.num_spec_tokens >= 2
    fixed = SpeculationPolicy(3, adaptive=False)
    fixed.start(req)
    for _ in range(5):
        fixed.observe(req, 3, 0)
    assert req.num_spec_tokens == 3


def test_stats_ratios() -> None:
    stats = SpecDecodingStats()
    stats.observe(4, 4)
    stats.observe(4, 1)
    stats.observe(0, 0)  # no proposal: not a draft
    assert stats.acceptance_rate == 5 / 8
    assert stats.mean_acceptance_length == 1 + 5 / 2
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1, 1]


# ----------------------------------------------------------------------------- scheduler


def test_scheduler_story_spec_slots_rollback_and_hashes() -> None:
    """Block size 4, 10 blocks. Request A: 6-token prompt, max_tokens 5, 3 proposals a step."""
    kv = KVCacheManager(num_blocks=11, block_size=4, max_model_len=64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=64), kv)
    a = Request("A", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=5), 0.0)
    a.num_spec_tokens = 3
    sched.add_request(a)
    out = sched.schedule()  # the prompt: no proposals in a prefill
    assert out.scheduled[0].num_spec_tokens == 0 and a.num_computed_tokens == 6
    a.append_output_token(7)
    # A decode: its token at position 6, proposals at 7, 8, 9 -> blocks for 10 tokens.
    out = sched.schedule()
    s = out.scheduled[0]
    assert (s.num_spec_tokens, s.num_new_tokens, s.token_ids, s.start_pos) == (3, 4, [7], 6)
    assert out.num_batched_tokens == 4 and len(s.block_table) == 3
    assert kv.num_free_blocks == 10 - 3
    # Only the block of known tokens (1 2 3 4) is in the prefix cache.
    assert kv.num_cached_blocks["A"] == 1
    # Verification keeps 1 proposal (8) and adds one token (9): 2 rejected.
    a.append_output_token(8)
    a.append_output_token(9)
    sched.reject_tokens(a, 2)
    assert a.num_computed_tokens == 8  # 6 prompt + 7 + 8; 9 is computed next step
    assert len(kv.req_to_blocks["A"]) == 2 and kv.num_free_blocks == 10 - 2  # block 3 freed
    # 3 outputs of max_tokens 5: at most 2 more, the decode's token and 1 proposal.
    out = sched.schedule()
    assert out.scheduled[0].num_spec_tokens == 1 and out.scheduled[0].token_ids == [9]
    # Both blocks now hold known tokens only (1..8): both are hashed.
    assert kv.num_cached_blocks["A"] == 2
    sched.reject_tokens(a, 1)
    # A step budget of 2 leaves room for one proposal.
    b = Request("B", [4, 4, 4, 4], SamplingParams(max_tokens=20), 0.0)
    b.num_spec_tokens = 4
    sched.finish_request("A", a.status.FINISHED_ABORTED)
    small = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2,
                                      max_model_len=64), kv)
    small.add_request(b)
    small.schedule()
    small.schedule()  # the prompt, in two chunks of 2
    b.append_output_token(5)
    assert small.schedule().scheduled[0].num_spec_tokens == 1
    with pytest.raises(ValueError, match="num_rejected"):
        small.reject_tokens(b, -1)


def test_speculation_never_preempts() -> None:
    """When the blocks for the proposals are missing, the decode runs without them."""
    kv = KVCacheManager(num_blocks=3, block_size=4, max_model_len=16)  # 2 usable blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                      max_model_len=16), kv)
    a = Request("A", [1, 2, 3], SamplingParams(max_tokens=4), 0.0)
    b = Request("B", [1, 2, 3], SamplingParams(max_tokens=4), 1.0)
    a.num_spec_tokens = b.num_spec_tokens = 3
    sched.add_request(a)
    sched.add_request(b)
    sched.schedule()  # one block each
    a.append_output_token(4)
    b.append_output_token(4)
    out = sched.schedule()  # A's 3 proposals need a second block: none is free
    assert [s.num_spec_tokens for s in out.scheduled] == [0, 0]
    assert not out.preempted


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("method", ["ngram", "draft", "self_draft"])
def test_greedy_output_is_identical_alone_and_in_batches(
        method: str, tiny_model_dir: Path, draft_model_dir: Path,
        plain_greedy: list[list[int]]) -> None:
    llm = LLM(str(tiny_model_dir), speculative_config=spec_config(
        method, tiny_model_dir, draft_model_dir), **ENGINE_ARGS)
    for i in (0, 2):
        assert token_ids(llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False)) == [plain_greedy[i]]
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == plain_greedy
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if method == "self_draft":  # the target proposing to itself: every proposal kept
        assert stats["spec_decode_acceptance_rate"] == 1.0
        assert stats["spec_decode_mean_acceptance_length"] > 3
    elif method == "draft":
        assert stats["spec_decode_acceptance_rate"] < 0.5
    else:
        assert stats["spec_decode_num_accepted_tokens"] > 0
    assert 0 < stats["spec_decode_draft_time_fraction"] < 1
    assert_no_leak(llm.engine)


def test_the_shipped_draft_is_exact_and_mostly_accepted_on_the_default_model() -> None:
    """The package's trained pair (`data/default_model`, `data/default_draft`): on the
    default model's own questions greedy chat answers equal plain decoding token for token,
    and most proposals are kept (0.96 measured; random drafts keep almost none). A draft
    trained on another corpus or tokenizer, or one shipped half-written, fails the bound."""
    target, draft = default_model_dir(), DEFAULT_DRAFT_DIR
    questions = ["Where does Leo live?", "What is 7 plus 5?", "Tell me a story about a fox.",
                 "What is Ava's job?"]
    messages = [[{"role": "user", "content": q}] for q in questions]
    plain = LLM(str(target), dtype="float32")
    spec = LLM(str(target), dtype="float32", speculative_config={
        "model": str(draft), "num_speculative_tokens": 4, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=48)
    want = token_ids(plain.chat(messages, params, use_tqdm=False))
    assert token_ids(spec.chat(messages, params, use_tqdm=False)) == want
    stats = spec.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 40
    assert stats["spec_decode_acceptance_rate"] > 0.8
    assert_no_leak(spec.engine)


def test_draft_catches_up_in_chunks(tiny_model_dir: Path,
                                                         plain_greedy: list[list[int]]) -> None:
    """A step budget of 16 tokens: the draft computes a 35-token prompt over three steps
    before it proposes. The target as its own draft accepts every proposal only if
    each chunk left the right K/V in the draft's cache."""
    llm = LLM(str(tiny_model_dir), speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 3},
        **{**ENGINE_ARGS, "max_num_batched_tokens": 16})
    assert token_ids(llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)) == [plain_greedy[2]]
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_acceptance_rate"] == 1.0
    # Steps with catch-up chunks only: speculative steps that verified nothing.
    assert stats["spec_decode_num_spec_steps"] > stats["spec_decode_num_drafts"]


def test_async_scheduling_penalties_min_tokens_and_logprobs(
        tiny_model_dir: Path, plain: LLM) -> None:
    """Penalties and min_tokens (row j of a run counts the proposals before it), logprobs
    per emitted token, with async scheduling: the plain engine's results."""
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.2, min_tokens=12,
                            logprobs=3)
    want = plain.generate(PROMPTS[:3], params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), async_scheduling=True,
              speculative_config={"model": str(tiny_model_dir), "num_speculative_tokens": 3},
              **ENGINE_ARGS)
    got = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert llm.engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        for lg, lw in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert lg[t].rank == lw[t].rank
                assert math.isclose(lg[t].logprob, lw[t].logprob, abs_tol=1e-4)


def test_token_constraints_hold_at_every_verified_position(tiny_model_dir: Path,
                                                           plain: LLM) -> None:
    """allowed_token_ids and logit_bias reach every verified row; a request with
    structured outputs never speculates (its grammar would have to follow the proposals)."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                            allowed_token_ids=list(range(0, 2368, 3)), logit_bias={6: 2.5})
    want = token_ids(plain.generate(PROMPTS[:2], params, use_tqdm=False))
    llm = LLM(str(tiny_model_dir), speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 3}, **ENGINE_ARGS)
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == want
    assert all(t % 3 == 0 for seq in want for t in seq)
    assert llm.engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    req = Request("s", [1, 2], SamplingParams(structured_outputs={"regex": "a+"}), 0.0)
    llm.engine.spec_policy.start(req)
    assert req.num_spec_tokens == 0 and not llm.engine.spec_policy.wants_values(req)


def test_stop_strings_and_max_tokens_inside_accepted_runs(tiny_model_dir: Path,
                                                          plain: LLM) -> None:
    """The target proposing to itself accepts runs of 5 tokens; a stop string and a
    max_tokens that fall inside a run end the output where the plain engine ends it."""
    llm = LLM(str(tiny_model_dir), speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 4}, **ENGINE_ARGS)
    tok = llm.get_tokenizer()
    prompt = PROMPTS[2]
    full = plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0]
    # A stop string that first appears in the text of output token 8: tokens 1-5 and
    # 6-10 are runs (token 0 comes from the prefill), so it ends inside the second.
    start = len(tok.decode(full.token_ids[:8]))
    stop = next(full.text[i:i + 2] for i in range(start, len(full.text) - 1)
                if full.text.find(full.text[i:i + 2]) == i and full.text[i:i + 2].strip())
    for params in (SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                   SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                  stop=[stop], include_stop_str_in_output=True)):
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason)
    assert want.finish_reason == "stop" and 0 < len(want.token_ids) < 20
    # Up to max_model_len: the last run is cut at the context's end.
    long_prompt = list(range(1, 250))
    to_the_end = SamplingParams(temperature=0, ignore_eos=True, max_tokens=256 - 249)
    want = plain.generate([long_prompt], to_the_end, use_tqdm=False)[0].outputs[0]
    got = llm.generate([long_prompt], to_the_end, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) == 256 - 249
    assert got.finish_reason == want.finish_reason == "length"
    assert_no_leak(llm.engine)


def test_n_greater_than_one_and_seeded_sampling(tiny_model_dir: Path, plain: LLM) -> None:
    llm = LLM(str(tiny_model_dir), speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}, **ENGINE_ARGS)
    params = SamplingParams(temperature=0, n=3, max_tokens=12, ignore_eos=True)
    want = plain.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    got = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    # Sampled completions: reproducible with their seeds, different between them.
    seeded = SamplingParams(temperature=1.0, top_p=0.9, n=2, seed=7, max_tokens=12,
                            ignore_eos=True)
    a = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert a.outputs[0].token_ids != a.outputs[1].token_ids
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_prefix_caching_and_preemption_with_speculation(
        method: str, tiny_model_dir: Path, draft_model_dir: Path, plain: LLM) -> None:
    """Five sequences (one request with n = 2) sharing a 32-token prefix, in 9 blocks
    of 16 where they need 17: preempted and readmitted with prefix-cache hits, the
    plain engine's tokens all the same, the cache consistent after every step."""
    prefix = [(7 * i) % 97 + 3 for i in range(32)]
    prompts = [prefix + [200 + i] * 4 + [5, 6, 5, 6] for i in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=2 if i == 0
                             else 1) for i in range(4)]
    want = plain.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_model_dir), speculative_config=spec_config(
        method, tiny_model_dir, draft_model_dir),
        **{**ENGINE_ARGS, "num_gpu_blocks_override": 10})
    engine = llm.engine
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = run_to_end(engine, check=True)
    got = [done[str(i)] for i in range(4)]
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want]
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if method == "self_draft":  # the draft's cache was rebuilt right after each preemption
        assert stats["spec_decode_acceptance_rate"] == 1.0
    assert_no_leak(engine)


def test_aborts_in_the_middle_of_a_speculation_leak_nothing(tiny_model_dir: Path,
                                                            plain: LLM) -> None:
    """Async scheduling leaves a speculative step in flight between two `step()` calls:
    requests aborted then are dropped when it is read back, their blocks all freed."""
    engine = LLM(str(tiny_model_dir), async_scheduling=True, speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 3},
        **{**ENGINE_ARGS, "num_gpu_blocks_override": 40}).engine
    params = SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True, seed=1)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    engine.add_request("n", PROMPTS[0], params.replace(n=2))
    aborted_in_flight = 0
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        assert_cache_consistent(engine)
        step += 1
        flight = engine._in_flight
        if flight is not None and flight.spec is not None and step in (3, 5, 7):
            live = [g for g in engine._groups]
            if live:
                aborted_in_flight += 1
                engine.abort_request(live[:2])
    assert aborted_in_flight >= 2
    assert_no_leak(engine)
    # Prefix-cached blocks left behind hold verified tokens only: a new request with the
    # same prompt hits them and still decodes as the plain engine does.
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("again", PROMPTS[2], greedy)
    again = run_to_end(engine)["again"]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == token_ids(
        plain.generate([PROMPTS[2]], greedy, use_tqdm=False))[0]


def test_a_speculative_step_that_fails_fails_its_requests_only(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(tiny_model_dir), speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
        "adaptive": False}, **ENGINE_ARGS)
    real = llm.engine.proposer.propose
    calls = iter(range(100))

    def flaky(batch):
        if next(calls) == 1:
            raise RuntimeError("injected")
        return real(batch)

    monkeypatch.setattr(llm.engine.proposer, "propose", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert_no_leak(llm.engine)
    assert len(token_ids(llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False))[0]) == 20


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir: Path) -> Iterator[str]:
    from mini_vllm.engine.async_engine import AsyncLLM
    from mini_vllm.entrypoints.openai_server import build_app

    engine = AsyncLLM(EngineArgs(
        model=str(tiny_model_dir), max_model_len=256, num_gpu_blocks_override=128,
        engine_process=False, device="cpu", dtype="float32",
        speculative_config=json.dumps({"model": str(tiny_model_dir), "num_speculative_tokens": 3}),
    ).create_engine_config())
    with serving(build_app(engine, served_model_name="tiny-spec"), stop_timeout=20) as port:
        yield f"http://127.0.0.1:{port}"


def test_server_streams_speculative_runs(spec_server: str, plain: LLM) -> None:
    import httpx

    body = {"model": "tiny-spec", "prompt": "The quick brown fox", "max_tokens": 18,
            "temperature": 0, "ignore_eos": True, "logprobs": 2}
    with httpx.Client(timeout=60) as http:
        whole = http.post(spec_server + "/v1/completions", json=body).json()
        r = http.post(spec_server + "/v1/completions", json={**body, "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n")
                  if line.startswith("data: ") and line != "data: [DONE]"]
        metrics = http.get(spec_server + "/metrics").text
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    want = plain.generate("The quick brown fox", SamplingParams(
        temperature=0, max_tokens=18, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    assert text == whole["choices"][0]["text"] == want
    streamed_tokens = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                       for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(streamed_tokens) == 18
    # Runs of several tokens arrive in one chunk.
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["text"]]) < 18
    assert "mini_vllm:spec_decode_num_accepted_tokens_total" in metrics


# ----------------------------------------------------------------------------- the benchmark


def _load_script(path: Path) -> Any:
    import importlib.util
    import sys

    name = f"_spec_decode_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def test_benchmark_smoke_run_and_its_figures(tmp_path: Path) -> None:
    """The GPU benchmark's every section on the tiny model (timings meaningless on a
    CPU): every speculative run gave the plain run's tokens, the oracle's acceptance is
    what it was set to, and the chapter's figures render from the JSON it wrote."""
    repo = Path(__file__).resolve().parents[2]
    bench = _load_script(repo / "benchmarks" / "spec_decode.py")
    report = bench.main(["--presets", "tiny", "--draft-preset", "tiny", "--device", "cpu",
                         "--batches", "1", "2", "--ks", "2", "--acceptance", "0", "1",
                         "--prompt-len", "8", "--output-len", "6",
                         "--output", str(tmp_path / "spec_decode.json")])
    r = report["results"]["tiny"]
    assert r["status"] == "ok", r
    for batch in ("1", "2"):
        sweep = r["sweep"][batch]
        assert sweep["identical_to_plain"]
        rates = {x["acceptance"]: x["acceptance_rate"] for x in sweep["runs"]}
        assert rates == {0.0: 0.0, 1.0: 1.0}
    assert all(x["identical_to_plain"] for x in r["ngram"].values())
    assert r["ngram"]["1/1"]["acceptance_rate"] == 1.0  # the copy is found in the prompt
    assert all(x["identical_to_plain"] and x["acceptance_rate"] == 1.0
               for x in r["draft"].values())
    assert report["real_pair"]["status"] == "skipped"
    assert [c["check"] for c in report["bar"]] == [
        "tiny batch 2, a proposer that misses (adaptive): >= 0.95x"]
    # The real-pair mode alone, on the shipped pair.
    real = bench.main(["--presets", "--device", "cpu", "--output-len", "6",
                       "--target-model", str(default_model_dir()),
                       "--draft-model", str(DEFAULT_DRAFT_DIR),
                       "--output", str(tmp_path / "spec_decode_real.json")])
    assert real["results"] == {} and real["real_pair"]["status"] == "ok", real["real_pair"]
    runs = real["real_pair"]["runs"]
    spec = [x for x in runs if x["speculative"]]
    assert len(runs) == 6 and len(spec) == 4  # per temperature: plain, k = 2, k = 4
    assert all(x["identical_to_plain"] for x in spec if x["temperature"] == 0)
    plain = {x["temperature"]: x for x in runs if not x["speculative"]}
    for x in spec:  # fewer target forwards for the same tokens (greedy: the same text)
        assert x["num_target_forwards"] < plain[x["temperature"]]["num_target_forwards"]
        assert x["num_target_forwards"] < x["num_tokens"]
        assert 0 < x["draft_time_fraction"] < 1
    figures = _load_script(repo / "scripts" / "figures.py")
    for name in ("spec-sweep", "spec-bar", "spec-ngram", "spec-draft", "spec-real"):
        text = figures.render(name, [], tmp_path)
        assert "Not measured" not in text and "Measured on" in text, (name, text)
        assert text.count("\n|") >= 3, (name, text)  # a header, its rule and a row at least
        empty = figures.render(name, [], tmp_path / "none")
        assert "Not measured yet" in empty and "Measured on" not in empty, (name, empty)
    assert "| 0 | 4 |" in figures.render("spec-real", [], tmp_path)
    assert "| tiny | 2 |" in figures.render("spec-sweep", [], tmp_path)
    assert "Not measured yet" in figures.render("spec-sweep", [], tmp_path / "empty")


# ----------------------------------------------------------------------------- the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_verify_steps_replay_piecewise_graphs_and_match_greedy(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU (float32, so that both engines compute the same argmaxes): speculative
    greedy output equals plain decoding, and every verification replays the piecewise
    CUDA graphs."""
    from mini_vllm.gpu.cuda_graphs import PiecewiseGraphRunner

    args = {**ENGINE_ARGS, "device": "cuda", "max_piecewise_graph_tokens": 256}
    want = token_ids(LLM(str(tiny_model_dir), **args).generate(PROMPTS, GREEDY,
                                                                 use_tqdm=False))
    replays = []
    real_run = PiecewiseGraphRunner.run

    def counting(self, *a, **kw):
        replays.append(a[2])
        return real_run(self, *a, **kw)

    monkeypatch.setattr(PiecewiseGraphRunner, "run", counting)
    llm = LLM(str(tiny_model_dir), speculative_config={
        "model": str(tiny_model_dir), "num_speculative_tokens": 4}, **args)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_spec_steps"] > 0
    assert len(replays) >= stats["spec_decode_num_spec_steps"]
