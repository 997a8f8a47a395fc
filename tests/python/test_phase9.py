"""Phase 9 checks that run on a CPU: the benchmark workload, the floor model, the
benchmark scripts on the tiny model, and the serving client's metrics."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytestmark = pytest.mark.phase9

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> ModuleType:
    """Import a benchmark script by its path (benchmarks/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location(f"_phase9_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def common() -> ModuleType:
    return _load("common")


@pytest.fixture(scope="module")
def serving() -> ModuleType:
    return _load("serving")


# ----------------------------------------------------------------------------- workload


def test_default_workload_has_the_published_token_counts(common: ModuleType) -> None:
    w = common.make_workload()
    assert w.num_requests == 256
    assert w.num_prompt_tokens == 142_827
    assert w.num_output_tokens == 133_966
    common.check_default_workload(w)  # does not raise
    again = common.make_workload()
    assert again.prompts == w.prompts and again.max_tokens == w.max_tokens


def test_workload_is_the_global_random_draw(common: ModuleType) -> None:
    # The definition: random.seed(0), then all prompts, then all max_tokens.
    state = random.getstate()
    try:
        random.seed(0)
        prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))]
                   for _ in range(256)]
        max_tokens = [random.randint(100, 1024) for _ in range(256)]
    finally:
        random.setstate(state)
    w = common.make_workload()
    assert w.prompts == prompts
    assert w.max_tokens == max_tokens
    assert random.getstate() == state  # the generator leaves the global state alone


def test_other_draws_fail_the_check_and_small_vocabularies_fold(common: ModuleType) -> None:
    with pytest.raises(ValueError, match="142,827"):
        common.check_default_workload(common.make_workload(seed=1))
    folded = common.make_workload(vocab_size=2368)
    plain = common.make_workload()
    assert folded.max_tokens == plain.max_tokens
    assert [len(p) for p in folded.prompts] == [len(p) for p in plain.prompts]
    assert max(max(p) for p in folded.prompts) < 2368
    assert common.is_default_workload(256, (100, 1024), (100, 1024), 0)
    assert not common.is_default_workload(8, (100, 1024), (100, 1024), 0)


# ----------------------------------------------------------------------------- floor


def test_floor_of_the_standard_workload_on_qwen3_0_6b(common: ModuleType) -> None:
    from mini_vllm.checkpoint import PRESETS, weight_shapes

    config = PRESETS["qwen3-0.6b"]
    shape = common.ModelShape.from_config(config)
    w = common.make_workload()
    bandwidth = 4.27e12
    floor = common.throughput_floor(w, shape, dtype_bytes=2, bandwidth=bandwidth)

    # Independent computation: token by token, shapes from the checkpoint writer.
    kv_per_token = 28 * 2 * 8 * 128 * 2
    assert floor["kv_bytes_per_token"] == kv_per_token == 114_688
    context_tokens = 0
    for prompt, m in zip(w.prompts, w.max_tokens):
        for i in range(m):
            context_tokens += len(prompt) + i + 1
    kv_read = context_tokens * kv_per_token
    kv_write = (w.num_prompt_tokens + w.num_output_tokens) * kv_per_token
    weights = 2 * sum(math.prod(s) for _, s in weight_shapes(config))  # tied: no lm_head
    steps = max(w.max_tokens)
    expected_s = (kv_read + kv_write + steps * weights) / bandwidth

    assert floor["kv_read_bytes"] == kv_read
    assert floor["kv_read_bytes"] == pytest.approx(13.9e12, rel=0.01)
    assert floor["weight_bytes"] == weights
    assert floor["weight_bytes"] == pytest.approx(1.19e9, rel=0.01)
    assert floor["decode_steps"] == steps == 1024
    assert floor["floor_s"] == pytest.approx(expected_s, rel=1e-9)
    assert floor["floor_s"] == pytest.approx(3.5, abs=0.1)
    assert floor["floor_output_tok_s"] == pytest.approx(37_800, rel=0.01)


def test_benchmark_models_give_every_id_a_text(common: ModuleType, tmp_path: Path) -> None:
    """A random-weight benchmark model samples from its whole vocabulary: every id of
    it, past the shipped tokenizer's too, must decode to text, streamed as it comes."""
    from mini_vllm.tokenizer import IncrementalDetokenizer, Tokenizer

    model_dir, load_format = common.prepare_model_dir(None, "qwen3-0.6b", tmp_path)
    assert load_format == "dummy"
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer.from_pretrained(str(model_dir))
    ids = random.Random(0).sample(range(vocab_size), 300) + [vocab_size - 1, 2331]
    stream = IncrementalDetokenizer(tokenizer)
    pieces = [stream.add_token(i) for i in ids]
    assert all(pieces), [i for i, p in zip(ids, pieces) if not p][:5]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert tokenizer.decode([vocab_size - 1]) == f" w{vocab_size - 1}"
    # The shipped tokens keep their ids and texts, and a second call adds nothing.
    from tokenizers import Tokenizer as Backend

    from mini_vllm.checkpoint import TOKENIZER_FILE

    text = "Hello, world! The tokenizer's own pieces: 12345 déjà vu"
    shipped = Backend.from_file(str(TOKENIZER_FILE))
    covered = Backend.from_file(str(model_dir / "tokenizer.json"))
    assert covered.encode(text).ids == shipped.encode(text).ids
    assert covered.decode(shipped.encode(text).ids) == shipped.decode(shipped.encode(text).ids)
    assert common.cover_vocabulary(model_dir) == 0


def test_decode_steps_when_requests_queue(common: ModuleType) -> None:
    assert common.decode_steps([3, 7, 5], max_num_seqs=8) == 7
    # Two slots: 3|3 run together, the third starts at step 3 and ends at 6.
    assert common.decode_steps([3, 3, 3], max_num_seqs=2) == 6
    # 5 | 1,1,1 share the second slot while the first runs.
    assert common.decode_steps([5, 1, 1, 1], max_num_seqs=2) == 5


def test_step_floors_of_a_breakdown() -> None:
    """Each kind of step gets the floor of its KV reads plus one weight read per step,
    and its GPU time per step above that; results without a breakdown are left alone."""
    throughput = _load("throughput")
    floor = {"bandwidth_bytes_per_s": 1e12, "kv_bytes_per_token": 1000, "weight_bytes": 10**9}
    kinds = {"decode, batch <= 8": {"steps": 10, "gpu_s": 0.02, "kv_read_tokens": 5 * 10**6},
             "prefill or mixed": {"steps": 2, "gpu_s": 0.01, "kv_read_tokens": 0}}
    results = {"mini-vllm": {"breakdown": {"gpu_s_by_step_kind": kinds}},
               "transformers": {"status": "ok"}}
    throughput.add_step_floors(results, floor)
    decode, prefill = kinds["decode, batch <= 8"], kinds["prefill or mixed"]
    assert decode["floor_s"] == pytest.approx((5e9 + 10e9) / 1e12)  # 5 GB of KV, 10 weight reads
    assert decode["ms_per_step_above_floor"] == pytest.approx(1e3 * (0.02 - 0.015) / 10)
    assert prefill["floor_s"] == pytest.approx(2e9 / 1e12)
    assert prefill["ms_per_step_above_floor"] == pytest.approx(1e3 * (0.01 - 0.002) / 2)
    assert results["transformers"] == {"status": "ok"}


@pytest.mark.parametrize(("batch", "head_dim", "block_size", "ring"), [
    (3, 128, 16, {}),                                   # a few sequences: the kernel's own rule
    (4, 128, 16, {"unroll": 4, "stages": 2}),           # a batch: the wide ring
    (256, 64, 32, {"unroll": 4, "stages": 2}),
    (8, 32, 16, {}),                                    # head_dim 32 runs version 5: no ring
    (8, 128, 8, {}),                                    # blocks of 8 run version 5 too
])
def test_engine_decode_asks_for_the_wide_ring(monkeypatch: pytest.MonkeyPatch, batch: int,
                                              head_dim: int, block_size: int,
                                              ring: dict[str, int]) -> None:
    """The engine's decode passes version 7's wide ring for a batch of sequences, and
    nothing where version 7 does not run (the wrapper would refuse `stages`)."""
    from mini_vllm.gpu import attention as cuda_backend

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(cuda_backend.ops, "paged_decode_attention",
                        lambda *args, **kw: calls.append(kw))
    backend = cuda_backend.CudaAttentionBackend(torch.bfloat16, head_dim, "cpu",
                                                use_kernels=True)
    q = torch.zeros(batch, 4, head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(3, block_size, 2, head_dim, dtype=torch.bfloat16)
    backend._decode(q, cache, cache, torch.zeros(batch, 1, dtype=torch.int32),
                    torch.ones(batch, dtype=torch.int32), 1.0, 16)
    assert calls == [{"seq_order": None, **ring}]


def test_linear_writes_into_a_given_buffer() -> None:
    """The piecewise graphs' QKV buffer: `Linear.forward_fast(x, out)` fills `out` and
    returns it, and refuses a buffer of the wrong shape or layout instead of resizing it."""
    from mini_vllm.layers import Linear

    lin = Linear(8, [4, 4])
    lin.weight.normal_()
    x = torch.randn(3, 8)
    out = torch.full((5, 8), float("nan"))[:3]
    y = lin.forward_fast(x, out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, lin.weight))
    with pytest.raises(ValueError, match=r"out: shape \(3, 7\), the product is \(3, 8\)"):
        lin.forward_fast(x, torch.empty(3, 7))
    with pytest.raises(ValueError, match="out: must be contiguous"):
        lin.forward_fast(x, torch.empty(8, 3).t())


def test_piecewise_graphs_cover_every_step_on_a_large_gpu(tiny_model_dir: Path) -> None:
    """Without `max_piecewise_graph_tokens` the graphs reach the step budget (up to
    8,192 tokens) on a GPU of 64 GiB or more and 512 tokens below it; a value given is
    kept."""
    from mini_vllm.config import EngineArgs, default_piecewise_graph_tokens

    gib = 2**30
    assert default_piecewise_graph_tokens(141 * gib, 8192) == 8192   # an H200
    assert default_piecewise_graph_tokens(80 * gib, 4096) == 4096    # an H100, a smaller budget
    assert default_piecewise_graph_tokens(80 * gib, 40960) == 8192   # no prefill chunking
    assert default_piecewise_graph_tokens(64 * gib, 8192) == 8192
    assert default_piecewise_graph_tokens(64 * gib - 1, 8192) == 512
    assert default_piecewise_graph_tokens(24 * gib, 256) == 256      # a budget under 512
    assert default_piecewise_graph_tokens(0, 8192) == 512            # no GPU
    cpu = EngineArgs(model=str(tiny_model_dir), device="cpu").create_engine_config()
    assert cpu.max_piecewise_graph_tokens == 512
    given = EngineArgs(model=str(tiny_model_dir), device="cpu", max_piecewise_graph_tokens=0)
    assert given.create_engine_config().max_piecewise_graph_tokens == 0


def test_prefill_flops_count_matmuls_attention_and_one_logit_row(common: ModuleType) -> None:
    shape = common.ModelShape(num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2,
                              num_kv_heads=1, head_dim=4, vocab_size=32,
                              tie_word_embeddings=True)
    per_layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 3 * 8 * 16  # q, k+v, o, gate+up+down
    assert shape.layer_matmul_params == per_layer
    n = 5
    expected = 2 * 2 * per_layer * n + 4 * 2 * 2 * 4 * (n * (n + 1) // 2) + 2 * 32 * 8
    assert shape.prefill_flops(n) == expected


# ----------------------------------------------------------------------------- scripts


def test_throughput_smoke_run_writes_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    throughput = _load("throughput")
    out = tmp_path / "throughput.json"
    report = throughput.main([
        "--model", str(tiny_model_dir), "--num-requests", "4", "--input-len-range", "8", "24",
        "--max-tokens-range", "3", "6", "--backends", "mini-vllm", "--device", "cpu",
        "--copy-bytes", str(32 * 2**20), "--num-gpu-blocks-override", "64",
        "--block-size", "32", "--output", str(out)])
    data = json.loads(out.read_text())
    assert data["benchmark"] == "throughput"
    assert data["workload"]["standard"] is False
    result = data["results"]["mini-vllm"]
    assert result["status"] == "ok", result
    assert result["block_size"] == 32  # the flag reached the engine
    assert result["max_piecewise_graph_tokens"] == 512  # the default, resolved (no GPU)
    assert result["kv_cache_blocks"] == 64 and result["graph_memory_bytes"] == 0  # no graphs
    assert result["output_tokens"] == data["workload"]["output_tokens"] == report[
        "workload"]["output_tokens"]
    assert result["output_tok_s"] == pytest.approx(result["output_tokens"] / result["wall_s"])
    assert 0 < result["fraction_of_floor"]
    floor = data["floor"]
    assert floor["floor_s"] > 0 and floor["total_bytes"] == (
        floor["kv_read_bytes"] + floor["kv_write_bytes"] + floor["weight_read_bytes"])
    assert data["copy_bandwidth"]["bandwidth_bytes_per_s"] > 0
    assert data["environment"]["device"] == "cpu"


def test_latency_smoke_run_writes_json(tiny_model_dir: Path, tmp_path: Path) -> None:
    latency = _load("latency")
    out = tmp_path / "latency.json"
    latency.main(["--model", str(tiny_model_dir), "--prompt-lens", "8", "32", "--output-len",
                  "4", "--num-iters", "1", "--backends", "mini-vllm", "--device", "cpu",
                  "--copy-bytes", str(32 * 2**20), "--output", str(out)])
    data = json.loads(out.read_text())
    result = data["results"]["mini-vllm"]
    assert result["status"] == "ok", result
    for length in ("8", "32"):
        m = result["by_prompt_len"][length]
        assert m["output_tokens"] == [4]
        assert m["ttft_ms"] > 0 and m["tpot_ms"] > 0
        assert m["decode_fraction_of_floor"] > 0
        f = data["floors"][length]
        assert f["ttft_floor_bound"] in ("compute", "memory")
        assert f["ttft_floor_ms"] == max(f["ttft_compute_floor_ms"], f["ttft_memory_floor_ms"])
        assert f["decode_floor_ms"] > f["decode_weights_floor_ms"] > 0


# ----------------------------------------------------------------------------- serving


def _sse(obj: dict | str) -> str:
    return obj if isinstance(obj, str) else json.dumps(obj)


def test_stream_events_give_ttft_itl_and_tpot(serving: ModuleType) -> None:
    def chunk(text: str, finish: str | None = None) -> str:
        return _sse({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})

    events = [
        (10.10, chunk("a")),
        (10.15, chunk("")),  # no text: not a token arrival
        (10.20, chunk("b")),
        (10.40, chunk("c", "length")),
        (10.41, _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}})),
        (10.42, "[DONE]"),
    ]
    r = serving.result_from_events(prompt_len=7, start=10.0, events=events)
    assert r.success
    assert r.output_tokens == 5  # from usage, not from the three text chunks
    assert r.ttft == pytest.approx(0.10)
    assert r.itl == pytest.approx([0.10, 0.20])
    assert r.latency == pytest.approx(0.42)
    assert r.tpot == pytest.approx((0.42 - 0.10) / 4)

    no_usage = serving.result_from_events(7, 10.0, [e for e in events if "usage" not in e[1]])
    assert no_usage.output_tokens == 3
    failed = serving.result_from_events(7, 10.0, [(10.1, _sse({"error": {"message": "boom"}}))])
    assert not failed.success and "boom" in failed.error
    cut = serving.result_from_events(7, 10.0, events[:3])
    assert not cut.success and "[DONE]" in cut.error


def test_client_lets_idle_connections_go_before_the_server_does(serving: ModuleType) -> None:
    """A pooled connection the server may be closing is never reused: the client keeps
    an idle one for less time than uvicorn keeps it open."""
    uvicorn = pytest.importorskip("uvicorn")
    assert 0 < serving.CLIENT_KEEPALIVE_S < uvicorn.Config(app=None).timeout_keep_alive


def test_metrics_aggregate_and_percentiles(serving: ModuleType) -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    d = serving.distribution(values)
    assert d["mean"] == pytest.approx(50.5)
    assert d["median"] == pytest.approx(50.5)
    assert d["p99"] == pytest.approx(99.01)  # linear interpolation: 99 + 0.01 x (100 - 99)
    assert d["p90"] == pytest.approx(90.1)
    assert serving.distribution([])["p99"] is None

    ok = serving.RequestResult(True, prompt_len=10, output_tokens=5, start=0.0, ttft=0.1,
                               latency=0.5, chunk_times=[0.1, 0.2, 0.5])
    ok2 = serving.RequestResult(True, prompt_len=20, output_tokens=3, start=1.0, ttft=0.3,
                                latency=0.7, chunk_times=[1.3, 1.7])
    bad = serving.RequestResult(False, prompt_len=30, error="HTTP 500")
    m = serving.compute_metrics([ok, ok2, bad], duration_s=2.0)
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 500"])
    assert m["output_tokens"] == 8 and m["prompt_tokens"] == 30
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert m["tpot_ms"]["median"] == pytest.approx((100.0 + 200.0) / 2)  # 0.4/4, 0.4/2
    assert sorted(ok.itl + ok2.itl) == pytest.approx([0.1, 0.3, 0.4])
    assert m["itl_ms"]["median"] == pytest.approx(300.0)


@pytest.mark.parametrize("stream", [True, False])
def test_serving_launch_smoke(serving: ModuleType, tiny_model_dir: Path,
                              tmp_path: Path, stream: bool) -> None:
    if importlib.util.find_spec("mini_vllm.cli") is None:
        pytest.skip("mini_vllm.cli is not importable: no server to launch")
    pytest.importorskip("fastapi", reason="the server needs fastapi")
    out = tmp_path / "serving.json"
    report = serving.main([
        "--launch", "--model", str(tiny_model_dir), "--device", "cpu", "--num-requests", "4",
        "--input-len-range", "8", "16", "--max-tokens-range", "3", "6",
        "--request-rates", "inf", "--launch-timeout", "120", "--output", str(out),
        "--stream" if stream else "--no-stream"])
    assert report["status"] == "ok", report.get("error")
    assert gc.get_freeze_count() == 0  # the client froze its heap only while it timed
    data = json.loads(out.read_text())
    run = data["runs"][0]
    assert run["request_rate"] == "inf" and run["stream"] is stream
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["output_tokens"] == data["workload"]["output_tokens"]
    assert run["e2el_ms"]["median"] > 0
    if stream:
        assert run["ttft_ms"]["median"] > 0 and run["tpot_ms"]["median"] > 0
    else:  # a whole response has no first token or gaps to time
        assert run["ttft_ms"]["median"] is None and run["itl_ms"]["median"] is None
    assert data["base_url"].startswith("http://127.0.0.1:")


# ----------------------------------------------------------------------------- the book's figures

REPO = BENCHMARKS.parent


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    """`scripts/figures.py`, which writes every measured table of the book from the JSON."""
    spec = importlib.util.spec_from_file_location("_phase9_figures", REPO / "scripts" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_figure_of_the_book_is_what_its_json_gives(figures: ModuleType) -> None:
    stale = figures.update(REPO, write=False)
    assert stale == {}, (
        f"figures out of date with benchmarks/results/: {stale}; "
        "run `python scripts/figures.py` to rewrite them")


def test_every_defined_figure_is_used_and_every_marker_names_one(figures: ModuleType) -> None:
    used = figures.used_figures(REPO)
    assert used <= set(figures.FIGURES), used - set(figures.FIGURES)
    assert set(figures.FIGURES) <= used, set(figures.FIGURES) - used
    assert "floor" in used and "readme-headline" in used


def test_a_figure_follows_its_json(figures: ModuleType, tmp_path: Path) -> None:
    """Change a committed result and the generated text changes with it: a value, a
    table, and the check that reports the stale block."""
    src = REPO / "benchmarks" / "results" / "throughput.json"
    data = json.loads(src.read_text())
    (tmp_path / "throughput.json").write_text(json.dumps(data))
    assert figures.render("throughput", ["tok_s"], tmp_path) == f"{data['results']['mini-vllm']['output_tok_s']:,.0f}"
    data["results"]["mini-vllm"]["output_tok_s"] = 31234.4
    data["floor"]["floor_output_tok_s"] = 40000.0
    (tmp_path / "throughput.json").write_text(json.dumps(data))
    assert figures.render("throughput", ["tok_s"], tmp_path) == "31,234"
    floor = figures.render("floor", [], tmp_path)
    assert "**40,000 output tok/s**" in floor
    assert "`benchmarks/results/throughput.json`" in floor  # the block names its source
    assert "--output benchmarks/results/throughput.json" in floor  # and its command
    text = "x <!-- figure:throughput tok_s -->28,525<!-- /figure --> y\n"
    new, changed = figures.fill(text, tmp_path)
    assert new == "x <!-- figure:throughput tok_s -->31,234<!-- /figure --> y\n"
    assert changed == ["throughput tok_s"]
    assert figures.fill(new, tmp_path) == (new, [])  # idempotent


def test_bad_markers_and_missing_json_are_clear_errors(figures: ModuleType,
                                                       tmp_path: Path) -> None:
    with pytest.raises(figures.FigureError, match="no figure named 'nope'"):
        figures.fill("a\n<!-- figure:nope -->\n<!-- /figure -->\n", where="x.md")
    with pytest.raises(figures.FigureError, match=r"x\.md:2: .*throughput\.json does not exist"):
        figures.fill("a\n<!-- figure:floor -->\n<!-- /figure -->\n", tmp_path, where="x.md")
    with pytest.raises(figures.FigureError, match="ladder"):
        figures.render("ladder", ["1", "3x3", "us"])  # no such shape in the JSON


def test_figures_check_exits_nonzero_on_a_stale_block(figures: ModuleType, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "chapters").mkdir()
    page = tmp_path / "chapters" / "x.md"
    page.write_text("The floor: <!-- figure:throughput floor_tok_s -->1<!-- /figure -->.\n")
    (tmp_path / "README.md").write_text("no figures here\n")
    monkeypatch.setattr(figures, "REPO_ROOT", tmp_path)
    assert figures.main(["--check"]) == 1
    assert "1<!--" in page.read_text()  # --check writes nothing
    assert figures.main([]) == 0
    assert figures.main(["--check"]) == 0
    assert "1<!--" not in page.read_text()


@pytest.mark.parametrize("script", ["throughput", "latency", "serving"])
def test_benchmarks_write_to_the_ignored_runs_folder_by_default(script: str) -> None:
    """A run lands in benchmarks/runs/ (ignored by git); committing it into
    benchmarks/results/ takes an explicit --output."""
    module = _load(script)
    default = Path(module.build_parser().parse_args([]).output)
    assert default.parent == REPO / "benchmarks" / "runs"
    assert "/benchmarks/runs/" in (REPO / ".gitignore").read_text().split()
