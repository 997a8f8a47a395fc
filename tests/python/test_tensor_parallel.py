"""Part IV: tensor parallelism over gloo on the CPU, the Ray executor, data-parallel replicas.

Every tensor-parallel engine here is the real thing: rank 0 in the test's
process, the other ranks in worker processes (or Ray actors) joined over
gloo, the step's entries broadcast to them and the forward's all-reduces
meeting between them. Each test compares with the one-rank engine on the
same checkpoint: the same greedy tokens, logprobs within float32 rounding.

The models are tiny: 4 query heads and 2 KV heads (so 4 ranks hold fewer KV
heads than ranks: each KV head replicated on two), and a variant with one KV
head, a vocabulary that 2 does not divide (the last rank's padding rows) and
an untied LM head.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_thread import serving

from mini_vllm import LLM, SamplingParams
from mini_vllm.checkpoint import make_model
from mini_vllm.config import EngineArgs
from mini_vllm.distributed.executor import MultiprocExecutor, WorkerDiedError
from mini_vllm.engine.async_engine import AsyncLLM
from mini_vllm.entrypoints.openai_server import build_app
from mini_vllm.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.tensor_parallel

PROMPTS = ["Hello, my name is", "The capital of France is", "One two three four five six"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)
ENGINE = {"max_model_len": 128, "num_gpu_blocks_override": 64, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One KV head (fewer than any TP size), a vocabulary of 2,369 (odd), untied head."""
    return make_model(tmp_path_factory.mktemp("tiny-odd"), preset="tiny", seed=3,
                      overrides={"num_key_value_heads": 1, "vocab_size": 2369,
                                 "tie_word_embeddings": False})


def _run(llm: LLM, params: SamplingParams = GREEDY,
         prompts: list[str] = PROMPTS) -> list[tuple[list[int], list[dict]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


_REFERENCE: dict[tuple[str, str], list] = {}


def _reference(model_dir: Path, key: str = "greedy", **kwargs) -> list:
    """The one-rank engine's outputs (computed once per model and setting)."""
    if (str(model_dir), key) not in _REFERENCE:
        llm = LLM(str(model_dir), **{**ENGINE, **kwargs.pop("engine", {})})
        _REFERENCE[str(model_dir), key] = _run(llm, **kwargs)
    return _REFERENCE[str(model_dir), key]


def _assert_same(got: list, want: list) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(got, want, strict=True):
        assert ids == ref_ids  # the same greedy tokens
        for step, ref_step in zip(lps, ref_lps, strict=True):  # float32 logits, closely
            assert step.keys() == ref_step.keys()
            for tok, lp in step.items():
                assert lp.logprob == pytest.approx(ref_step[tok].logprob, abs=1e-4)


def _procs(llm: LLM) -> list:
    executor = llm.engine.model_runner
    assert isinstance(executor, MultiprocExecutor)
    return executor.procs


# ---- the blocks, one rank -------------------------------------------------------------

def test_parallel_blocks_at_one_rank_are_the_plain_ones() -> None:
    """With the trivial context each block holds the whole weight: the shapes of `Linear`."""
    qkv = QKVParallelLinear(64, 32, 4, 2)
    assert (qkv.output_sizes, qkv.num_heads, qkv.num_kv_heads) == ([128, 64, 64], 4, 2)
    assert MergedColumnParallelLinear(64, [192, 192]).weight.shape == (384, 64)
    assert RowParallelLinear(192, 64).weight.shape == (64, 192)
    emb = VocabParallelEmbedding(2369, 64)
    assert emb.weight.shape == (2369, 64)
    assert ParallelLMHead(64, 2369, tied_to=emb).weight is emb.weight


def test_families_that_do_not_split_are_refused(tmp_path: Path) -> None:
    """GPT-2 (q/k/v stored as one tensor) and Qwen3-MoE (experts not split) run on one
    rank: asking for more is a clear error before anything starts."""
    for preset in ("tiny-gpt2", "tiny-qwen3-moe"):
        model_dir = make_model(tmp_path / preset, preset=preset)
        with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\): .* one rank only"):
            EngineArgs(str(model_dir), tensor_parallel_size=2).create_engine_config()


def test_bad_parallel_arguments_are_clear_errors(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        EngineArgs(str(tiny_model_dir), tensor_parallel_size=0).create_engine_config()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\)"):
        EngineArgs(str(tiny_model_dir), tensor_parallel_size=3).create_engine_config()
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        EngineArgs(str(tiny_model_dir), distributed_executor_backend="slurm"
                   ).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_size: an engine is one replica"):
        LLM(str(tiny_model_dir), data_parallel_size=2)


# ---- greedy tokens and logits across ranks ----------------------------------------------

@pytest.fixture(scope="module")
def qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2: Llama's layer with q/k/v biases (split with their rows) and a tied head."""
    return make_model(tmp_path_factory.mktemp("tiny-qwen2"), preset="tiny-qwen2", seed=4)


@pytest.fixture(scope="module")
def llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama 3 with its llama3 RoPE scaling and an untied head."""
    return make_model(tmp_path_factory.mktemp("tiny-llama3"), preset="tiny-llama3", seed=5)


@pytest.mark.parametrize(("model", "tp"), [
    ("tiny_model_dir", 2),  # KV heads split: one each
    ("tiny_model_dir", 4),  # 2 KV heads over 4 ranks: each replicated twice
    ("odd_model_dir", 2),  # one KV head replicated; vocabulary padded; untied head
    ("qwen2_model_dir", 2),  # another family: biases on q, k, v; the o_proj has none
    ("llama_model_dir", 2),
])
def test_tp_matches_one_rank(model: str, tp: int, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(model)
    want = _reference(model_dir)
    llm = LLM(str(model_dir), tensor_parallel_size=tp, **ENGINE)
    try:
        procs = _procs(llm)
        assert len(procs) == tp - 1
        runner = llm.engine.model_runner.driver
        cfg = runner.model_config
        assert runner.num_heads == cfg.num_attention_heads // tp
        assert runner.kv_cache.shape[-2] == max(1, cfg.num_key_value_heads // tp)
        _assert_same(_run(llm), want)
    finally:
        llm.engine.shutdown()
    assert all(p.poll() is not None for p in procs)  # no worker left behind


def test_prefix_caching_and_preemption_under_tp(tiny_model_dir: Path) -> None:
    """A shared prefix is found in the cache, and a pool too small for every request
    preempts some: the tokens are still the one-rank engine's."""
    prefix = "The quick brown fox jumps over the lazy dog and keeps running "
    prompts = [prefix + tail for tail in ("north", "south", "east", "west")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    small = {**ENGINE, "num_gpu_blocks_override": 16, "block_size": 4}
    want = [ids for ids, _ in _reference(tiny_model_dir, "small", engine=small,
                                         params=params, prompts=prompts)]
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, **small)
    try:
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first + rest] == want
        assert rest[0].num_cached_tokens > 0  # the prefix came from the cache
        assert llm.engine.get_stats()["num_preemptions"] > 0
    finally:
        llm.engine.shutdown()


# ---- a worker that dies -------------------------------------------------------------------

def test_killed_worker_fails_clearly_and_leaves_nothing(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, **ENGINE)
    procs = _procs(llm)
    assert _run(llm)[0][0] == _reference(tiny_model_dir)[0][0]
    procs[0].kill()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+, killed by signal 9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30  # an error, not a hang
    with pytest.raises(WorkerDiedError):  # and the engine stays failed
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.engine.shutdown()
    assert all(p.poll() is not None for p in procs)


# ---- the server ---------------------------------------------------------------------------

def _complete(http: httpx.Client, base: str, prompt: str) -> httpx.Response:
    return http.post(base + "/v1/completions", json={
        "model": "tp-test", "prompt": prompt, "max_tokens": 10, "temperature": 0.0})


def test_server_with_tensor_parallel_size_2(tiny_model_dir: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    """The server's answers are the one-rank engine's; a killed worker turns them
    into 503s, and /health with them, without a hang; the log names the rank."""
    want = _reference(tiny_model_dir)[0][0]
    engine = AsyncLLM(EngineArgs(str(tiny_model_dir), tensor_parallel_size=2, **ENGINE)
                      .create_engine_config())
    procs = engine.engine.model_runner.procs
    with serving(build_app(engine, served_model_name="tp-test")) as port:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=60) as http:
            r = _complete(http, base, PROMPTS[0])
            assert r.status_code == 200, r.text
            tokenizer = engine.tokenizer
            assert r.json()["choices"][0]["text"] == tokenizer.decode(want)
            procs[0].kill()
            r = _complete(http, base, PROMPTS[1])
            assert r.status_code == 503, r.text
            assert "engine is not running" in r.json()["error"]["message"]
            assert "tensor-parallel worker rank 1" in caplog.text  # the details go to the log
            assert http.get(base + "/health").status_code == 503
            assert _complete(http, base, PROMPTS[2]).status_code == 503
    assert all(p.poll() is not None for p in procs)


# ---- Ray: the executor's actors, and data-parallel replicas -------------------------------

@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray of 4 CPUs, started and stopped here."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def test_ray_backend_matches_one_rank(tiny_model_dir: Path, local_ray: None) -> None:
    import ray

    want = _reference(tiny_model_dir)
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, distributed_executor_backend="ray",
              **ENGINE)
    try:
        executor = llm.engine.model_runner
        assert len(executor.actors) == 1  # rank 1; rank 0 is this process
        _assert_same(_run(llm), want)
    finally:
        llm.engine.shutdown()
    _assert_released(ray)


def _assert_released(ray: object) -> None:
    """Every actor gone and every placement group removed: the 4 CPUs free again
    (Ray frees them asynchronously)."""
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 4:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, ray.available_resources()  # type: ignore[attr-defined]
        time.sleep(0.1)


def test_data_parallel_replicas_match_one_engine(tiny_model_dir: Path, local_ray: None) -> None:
    """Two replicas, each a tensor-parallel group of 2 on the Ray backend: every
    request answered as one engine answers it, and both replicas used."""
    import ray

    from mini_vllm.distributed.data_parallel import DataParallelAsyncLLM

    want = [ids for ids, _ in _reference(tiny_model_dir)]
    dp = DataParallelAsyncLLM(EngineArgs(
        str(tiny_model_dir), data_parallel_size=2, tensor_parallel_size=2,
        distributed_executor_backend="ray", **ENGINE))
    params = SamplingParams(temperature=0.0, max_tokens=10)

    async def one(prompt: str) -> list[int]:
        ids: list[int] = []
        async for out in dp.generate(prompt, params):
            ids += out.outputs[0].token_ids
        return ids

    async def all_of_them() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in PROMPTS + PROMPTS[:1]))

    try:
        got = asyncio.run(all_of_them())
        assert got == want + want[:1]
        per_replica = ray.get([r.get_stats.remote() for r in dp.replicas])
        finished = [s["num_requests_finished"] for s in per_replica]
        assert sum(finished) == 4 and min(finished) >= 1  # the load was spread
        assert dp.get_stats()["num_requests_finished"] == 4
        with pytest.raises(ValueError, match="prompt"):  # validated in the front
            asyncio.run(one(""))
    finally:
        dp.shutdown()
    _assert_released(ray)


# ---- on two GPUs: NCCL, the kernels and CUDA graphs (skipped without them) -----------------

def _two_gpus() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Heads of 128 (the fused layer kernels' shape), 8 query and 2 KV heads."""
    return make_model(tmp_path_factory.mktemp("tiny-gpu"), preset="tiny", seed=5,
                      overrides={"hidden_size": 256, "intermediate_size": 768, "head_dim": 128,
                                 "num_attention_heads": 8, "num_key_value_heads": 2})


@pytest.mark.gpu
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_on_gpus_with_graphs_matches_tp1(gpu_model_dir: Path, dtype: str) -> None:
    """TP = 2 over NCCL, CUDA graphs captured with the all-reduces in them (decode and
    piecewise), against TP = 1 on one GPU: in float32 the same greedy tokens; in
    bfloat16 (the kernels' path, where a sum in another order may flip a near tie
    later on) the same first token everywhere, with the same log-probability."""
    prompts = [p * 3 for p in PROMPTS] + ["a b c d e f g h i j k l m n o p" * 4]
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)
    engine = {"max_model_len": 512, "dtype": dtype, "max_num_seqs": 16,
              "gpu_memory_utilization": 0.3}
    one = LLM(str(gpu_model_dir), **engine)
    want = [o.outputs[0] for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    llm = LLM(str(gpu_model_dir), tensor_parallel_size=2, **engine)
    try:
        driver = llm.engine.model_runner.driver
        assert driver.graph_runner is not None  # graphs captured on both ranks
        got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    if dtype == "float32":
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        return
    for g, w in zip(got, want, strict=True):
        assert g.token_ids[0] == w.token_ids[0]
        first = w.token_ids[0]
        assert g.logprobs[0][first].logprob == pytest.approx(w.logprobs[0][first].logprob,
                                                             abs=0.05)


def test_speculative_decoding_under_tp(tiny_model_dir: Path) -> None:
    """n-gram speculation at TP = 2: the verify steps' entries reach every rank and the
    greedy tokens are still the one-rank engine's, with proposals accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    prompts = ["a b c d a b c d a b c d a b c d a b c d a b", "one two one two one two one"]
    want = [ids for ids, _ in _reference(tiny_model_dir, "ngram", params=params,
                                         prompts=prompts)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, speculative_config=spec, **ENGINE)
    try:
        assert [ids for ids, _ in _run(llm, params, prompts)] == want
        assert llm.engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()
