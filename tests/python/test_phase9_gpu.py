"""Phase 9: the GPU path — kernels in the hot path, CUDA graphs, no host syncs, bf16.

Every test but the first two needs a CUDA GPU and is skipped without one.
The first runs the fast path's host logic (decodes moved first, graph
padding, tokens taken from the previous step on the device) on the CPU with
the torch fallbacks, so CI checks it too.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from test_phase2 import Blocks, random_prompts  # phase 9 reuses phase 2's test helpers

from mini_vllm import ops
from mini_vllm.checkpoint import make_model
from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.gpu.attention import CudaAttentionBackend
from mini_vllm.gpu.cuda_graphs import (
    CudaGraphRunner,
    DecodeInputs,
    PiecewiseGraphRunner,
    capture_sizes,
    piecewise_sizes,
)
from mini_vllm.gpu.fused_layers import FusedDecoderForward
from mini_vllm.gpu.model_runner import GPUModelRunner
from mini_vllm.gpu.sampler import FusedSampler, FusedSamplingMetadata
from mini_vllm.model_runner import BatchEntry, ModelRunner
from mini_vllm.models.qwen3 import Qwen3ForCausalLM
from mini_vllm.ops.prefill import CAPTURABLE_PREFILL_BACKENDS
from mini_vllm.sampling_params import SamplingParams

pytestmark = pytest.mark.phase9

BLOCK_SIZE = 4
NUM_BLOCKS = 256


def engine_config(model_dir: Path, device: str, dtype: str, **overrides: object) -> EngineConfig:
    args = {
        "model": str(model_dir), "device": device, "dtype": dtype,
        "block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": 256, "max_num_seqs": 8,
    }
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


def make_blocks(seed: int = 0) -> Blocks:
    """Shuffled block ids of this file's larger pool (phase 2's test allocator)."""
    return Blocks(shuffle=True, seed=seed, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


def greedy_run(runner: ModelRunner, prompts: list[list[int]], num_steps: int,
               seed: int = 0, from_device: bool = False
               ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill (the last prompt in two chunks, the second beside decodes), then greedy decode.

    Sequences drop out of the batch as they go, so the batch size changes
    (5, 4, 3 sequences: graph sizes 8 and 4, with and without padding).
    With `from_device`, each decode entry carries a placeholder token and
    takes its value from the previous step's argmax on the device (what the
    engine does with async scheduling). Returns the token sequences and every
    step's logits (on the CPU).
    """
    blocks = make_blocks(seed)
    tables = [blocks.table(len(p) + num_steps + 1) for p in prompts]
    seqs = [list(p) for p in prompts]
    *first, last = prompts
    half = len(last) // 2
    steps: list[torch.Tensor] = []
    prev: torch.Tensor | None = None  # the previous step's sampled ids, on the device
    row_of: dict[int, int] = {}  # sequence -> its row of `prev`

    def decode(i: int) -> BatchEntry:
        if from_device:
            return BatchEntry([0], len(seqs[i]) - 1, tables[i], prev_sample_row=row_of[i])
        return BatchEntry([seqs[i][-1]], len(seqs[i]) - 1, tables[i])

    def record(order: list[int], logits: torch.Tensor) -> None:
        nonlocal prev, row_of
        steps.append(logits.cpu())
        prev, row_of = logits.argmax(-1), {i: row for row, i in enumerate(order)}
        for i, tok in zip(order, prev.tolist()):
            seqs[i].append(tok)

    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(first, tables)]
                            + [BatchEntry(last[:half], 0, tables[-1], sample=False)])
    record(list(range(len(first))), logits)
    # Mixed step: the chunk first in the entries, decodes after it.
    entries = [BatchEntry(last[half:], half, tables[-1])]
    entries += [decode(i) for i in range(len(first))]
    record([len(first), *range(len(first))], runner.execute(entries, prev))
    active = list(range(len(seqs)))
    for step in range(num_steps):
        if step in (num_steps // 3, 2 * num_steps // 3):
            active.pop(0)
        record(active, runner.execute([decode(i) for i in active], prev))
    return seqs, steps


# ------------------------------------------------------------- on any machine


def _reference_and_fast_on_cpu(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
                               ) -> tuple[ModelRunner, ModelRunner]:
    """A reference runner, and the GPU runner with the CUDA backend's torch fallbacks and
    the fused forward on the torch references, both in float32 on the CPU (no graphs:
    the tests give it runners)."""
    ref = ModelRunner(engine_config(tiny_model_dir, "cpu", "float32"))
    monkeypatch.setattr(
        "mini_vllm.gpu.model_runner.select_attention_backend",
        lambda device, dtype, head_dim, group=None: CudaAttentionBackend(
            dtype, head_dim, device, use_kernels=False))
    fast = GPUModelRunner(engine_config(tiny_model_dir, "cpu", "float32"))
    fast.forward = FusedDecoderForward(fast.model, kernels=False)  # as on a GPU
    return ref, fast


def test_fast_path_host_logic_matches_reference_on_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU path's batch layout (decodes first, padded graph batches) on the CPU."""
    ref, fast = _reference_and_fast_on_cpu(tiny_model_dir, monkeypatch)
    # Graph buffers without capture: `replay` runs the padded batch eagerly.
    fast.graph_runner = CudaGraphRunner(fast._forward_logits, fast.kv_caches, capture_sizes(8),
                                        max_blocks_per_seq=256 // BLOCK_SIZE,
                                        max_context_len=256, device=fast.device)
    prompts = random_prompts([5, 12, 1, 23, 9], ref.vocab_size)
    ref_seqs, ref_steps = greedy_run(ref, prompts, 9)
    for from_device in (False, True):
        seqs, steps = greedy_run(fast, prompts, 9, from_device=from_device)
        assert seqs == ref_seqs
        for a, b in zip(ref_steps, steps):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    # The reference path takes placeholders' values from the device too.
    seqs, _ = greedy_run(ref, prompts, 9, from_device=True)
    assert seqs == ref_seqs


def test_piecewise_layout_matches_reference_on_cpu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps padded to a piecewise size, attention between the pieces, on the CPU.

    Without a capture the pieces run eagerly on the same static buffers, so the
    padding (ids 0, positions 0, slots -1) and the attention over the real rows
    are checked against the reference path here; the GPU test below replays them.
    """
    ref, fast = _reference_and_fast_on_cpu(tiny_model_dir, monkeypatch)
    cfg = fast.model_config
    pieces = PiecewiseGraphRunner(fast.forward, fast.kv_caches, piecewise_sizes(64),
                                  cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                  fast.dtype, fast.device)
    fast.piecewise_runner = pieces
    runs: list[tuple[int, int]] = []  # (padded size, real tokens) of each step
    run = pieces.run

    def spy(token_inputs: torch.Tensor, meta: object, num_tokens: int,
            token_fixes: object = None) -> torch.Tensor:
        runs.append((token_inputs.shape[1], num_tokens))
        return run(token_inputs, meta, num_tokens, token_fixes)

    monkeypatch.setattr(pieces, "run", spy)
    # Every layer's QKV projection writes into the runner's one buffer.
    qkv_ptrs: set[int] = set()
    for layer in fast.model.model.layers:
        proj = layer.self_attn.qkv_proj

        def spy_proj(x: torch.Tensor, out: torch.Tensor | None = None,
                     _product=proj.forward_fast) -> torch.Tensor:
            y = _product(x, out)
            qkv_ptrs.add(y.data_ptr())
            return y

        monkeypatch.setattr(proj, "forward_fast", spy_proj)
    prompts = random_prompts([5, 12, 1, 23, 9], ref.vocab_size)
    ref_seqs, ref_steps = greedy_run(ref, prompts, 9)
    for from_device in (False, True):
        runs.clear()
        seqs, steps = greedy_run(fast, prompts, 9, from_device=from_device)
        assert seqs == ref_seqs
        for a, b in zip(ref_steps, steps):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        # 45 prompt tokens in 64 rows, then 5 + 4 in 16, then decodes of 4 and 3 in 16.
        assert runs[:2] == [(64, 45), (16, 9)]
        assert len(runs) == 11 and {size for size, _ in runs[2:]} == {16}
    assert pieces.qkv_out.data_ptr() in qkv_ptrs
    assert pieces.qkv_out.shape == (64, (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                    * cfg.head_dim)


def test_host_layout_joins_array_tables_as_it_reads_lists(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's block tables are int32 arrays, joined whole; tables given as lists
    are read an int at a time. Both give the same layout, tables longer than their
    context included."""
    _, fast = _reference_and_fast_on_cpu(tiny_model_dir, monkeypatch)
    rng = np.random.default_rng(0)
    contexts, query_lens = [1, 7, 16, 17, 40], [1, 1, 3, 1, 9]
    extra = [0, 2, 0, 1, 0]  # blocks past the context (a table may hold more)
    tables = [rng.permutation(np.arange(1, NUM_BLOCKS))[: -(-c // BLOCK_SIZE) + x].tolist()
              for c, x in zip(contexts, extra)]
    q, starts = np.array(query_lens), np.array(contexts) - np.array(query_lens)

    def entries(as_array: bool) -> list[BatchEntry]:
        return [BatchEntry(list(range(1, ql + 1)), int(st),
                           np.array(t, dtype=np.int32) if as_array else t)
                for ql, st, t in zip(query_lens, starts, tables)]

    for rows in (5, 8):
        joined = fast._host_layout(entries(True), q, starts, rows)
        read = fast._host_layout(entries(False), q, starts, rows)
        assert joined.keys() == read.keys()
        for key in read:
            np.testing.assert_array_equal(joined[key], read[key], err_msg=key)
    exact = [BatchEntry([1], c - 1, np.array(t[: -(-c // BLOCK_SIZE)], dtype=np.int32))
             for c, t in zip(contexts, tables)]  # every table exactly its context's blocks
    layout = fast._host_layout(exact, np.ones(5, dtype=np.int64), np.array(contexts) - 1, 5)
    for i, (c, t) in enumerate(zip(contexts, tables)):
        assert layout["block_tables"][i, : -(-c // BLOCK_SIZE)].tolist() == t[: -(-c // BLOCK_SIZE)]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")]),
])
def test_decode_inputs_stage_moves_the_mirror_and_applies_the_fixes(device: str) -> None:
    """`DecodeInputs.stage` (the extension's one call on a GPU, torch on the CPU): the
    flat rows land in the size's layout, the compact table in the first `width`
    columns of its rows, and each fixed id becomes the previous sample it names."""
    rng = np.random.default_rng(0)
    max_size, max_width = 16, 12
    inputs = DecodeInputs(max_size, max_width, torch.device(device))
    inputs.flat.fill_(0xAB)  # poison: bytes a stage does not write keep it
    inputs.tables.fill_(-7)
    for bs, width, k in [(1, 1, 1), (5, 7, 3), (16, 12, 0), (8, 3, 8), (16, 2, 16)]:
        view = inputs.host(bs, width)
        rows = rng.integers(-1, 10**6, (3, bs))
        seq = rng.integers(1, 10**4, (2, bs))
        tables = rng.integers(0, 10**4, (bs, width))
        fix_rows, fix_src = rng.permutation(bs)[:k], rng.integers(0, 20, k)
        prev = torch.from_numpy(rng.integers(0, 10**6, 20)).to(device)
        view.rows[:], view.seq[:], view.tables[:] = rows, seq, tables
        view.fixes[:k, 0], view.fixes[:k, 1] = fix_rows, fix_src
        before, flat_before = inputs.tables.clone(), inputs.flat.clone()
        inputs.stage(bs, width, k, prev)
        assert torch.equal(inputs.flat[32 * bs + 16 * k:], flat_before[32 * bs + 16 * k:])
        ids = rows[0].copy()
        ids[fix_rows] = prev.cpu().numpy()[fix_src]
        got = inputs.rows(bs).cpu().numpy()
        assert (got[0] == ids).all() and (got[1:] == rows[1:]).all()
        assert (inputs.seq(bs).cpu().numpy() == seq).all()
        assert (inputs.tables[:bs, :width].cpu().numpy() == tables).all()
        assert torch.equal(inputs.tables[:bs, width:], before[:bs, width:])  # stale, untouched
        assert torch.equal(inputs.tables[bs:], before[bs:])
    # Previous samples of another integer type are taken as int64.
    view = inputs.host(2, 1)
    view.rows[0], view.fixes[0] = (5, 6), (1, 0)
    inputs.stage(2, 1, 1, torch.tensor([42], dtype=torch.int32, device=device))
    assert inputs.rows(2)[0].tolist() == [5, 42]
    with pytest.raises(ValueError, match="previous step's sampled ids"):
        inputs.stage(2, 1, 1, None)
    with pytest.raises(ValueError, match=f"width {max_width + 1} outside"):
        inputs.stage(2, max_width + 1, 0, None)
    with pytest.raises(ValueError, match=f"bs {max_size + 1} /"):
        inputs.host(max_size + 1, 1)
    one = torch.tensor([7], device=device)
    with pytest.raises(ValueError, match="num_fixes 3 outside"):
        inputs.stage(2, 1, 3, one)
    view.fixes[0] = (1, 1)  # the second previous sample, of one
    with pytest.raises(ValueError, match="a fix is outside"):
        inputs.stage(2, 1, 1, one)
    assert inputs.rows(2)[0].tolist() == [5, 42]  # nothing was moved


def test_piecewise_sizes() -> None:
    assert piecewise_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert piecewise_sizes(100) == [16, 32, 64, 100]
    assert piecewise_sizes(16) == [16]
    assert piecewise_sizes(10) == [10]
    assert piecewise_sizes(0) == []
    with pytest.raises(ValueError, match="max_piecewise_graph_tokens"):
        EngineArgs(max_piecewise_graph_tokens=-1).create_engine_config()


def test_capture_sizes_ladder() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_sizes(36)[-2:] == [32, 36]
    assert capture_sizes(4096)[-1] == 512


# ------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_float32_greedy_tokens_match_the_cpu_reference(tiny_model_dir: Path,
                                                       enforce_eager: bool) -> None:
    cpu = ModelRunner(engine_config(tiny_model_dir, "cpu", "float32"))
    gpu = GPUModelRunner(engine_config(tiny_model_dir, "cuda", "float32",
                                    enforce_eager=enforce_eager))
    assert (gpu.graph_runner is None) == enforce_eager
    prompts = random_prompts([4, 9, 17, 2, 30], cpu.vocab_size, seed=1)
    cpu_seqs, cpu_steps = greedy_run(cpu, prompts, 24)
    for from_device in (False, True):
        gpu_seqs, gpu_steps = greedy_run(gpu, prompts, 24, from_device=from_device)
        assert gpu_seqs == cpu_seqs
        for a, b in zip(cpu_steps, gpu_steps):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def _prefilled(runner: ModelRunner, num_seqs: int, seed: int = 2
               ) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts([3 + 5 * i for i in range(num_seqs)], runner.vocab_size, seed)
    blocks = make_blocks(seed)
    tables = [blocks.table(len(p) + 8) for p in prompts]
    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables)])
    for p, tok in zip(prompts, logits.argmax(-1).tolist()):
        p.append(tok)
    return prompts, tables


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_backend_is_chosen_automatically(tiny_model_dir: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", "bfloat16"))
    backend = runner.attn_backend
    assert isinstance(backend, CudaAttentionBackend)
    assert all(layer.self_attn.attn.backend is backend for layer in runner.model.model.layers)
    if ops.is_available():
        assert (backend.write_impl, backend.decode_impl) == ("kernel", "kernel")
        # The tiny model's head_dim of 32 is not our Hopper kernel's.
        assert backend.prefill_impl == "flash_varlen"
    else:
        assert (backend.write_impl, backend.decode_impl) == ("torch", "torch")
        assert "CUDA kernels not used" in caplog.text
    assert "attention backend cuda" in caplog.text
    assert capture_sizes(8) == [1, 2, 4, 8]
    # max_model_len 256 is below every bound of the ladder: one graph per size.
    assert sorted(runner.graph_runner.graphs) == [(bs, 256) for bs in (1, 2, 4, 8)]
    assert runner.kv_cache.dtype == torch.bfloat16
    assert runner.model.model.embed_tokens.weight.dtype == torch.bfloat16


def _assert_graph_equals_eager(runner: ModelRunner, entries: list[BatchEntry],
                               dtype: str) -> None:
    """The step's logits through its CUDA graph(s) against an eager run of the same entries."""
    eager = runner.execute_fast(entries, use_graph=False).float().clone()
    graph = runner.execute_fast(entries, use_graph=True).float().clone()
    assert graph.shape == eager.shape == (len(entries), runner.vocab_size)
    if dtype == "float32":
        torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    else:
        assert ((graph - eager).norm() / eager.norm()).item() < 1e-2


def _assert_padding_wrote_nothing(runner: ModelRunner, tables: list[list[int]]) -> None:
    """Block 0 and every block no table holds are still zero."""
    used = sorted({b for t in tables for b in t})
    unused = [b for b in range(NUM_BLOCKS) if b not in used]
    if runner.attn_backend.write_impl == "kernel":
        unused.append(0)  # the torch fallback parks padded rows in block 0 instead
    assert runner.kv_cache[:, :, unused].abs().sum().item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager_and_padding_touches_nothing(tiny_model_dir: Path,
                                                               dtype: str) -> None:
    runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", dtype))
    seqs, tables = _prefilled(runner, 5)  # 5 sequences: the graph of 8, 3 rows padded
    entries = [BatchEntry([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]
    _assert_graph_equals_eager(runner, entries, dtype)
    _assert_padding_wrote_nothing(runner, tables)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_is_safe_from_garbage_that_owns_cuda_graphs(tiny_model_dir: Path) -> None:
    """A CUDA graph held only by a reference cycle (an earlier runner's, say) is freed
    by the cyclic collector, which runs at any allocation past its threshold. Were it
    to run inside a capture, the freed graph would break that capture: the runners
    capture with the collector held off."""
    runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", "bfloat16"))
    graphs = runner.graph_runner
    held = []  # graphs with memory of their own pools, soon held only by a cycle
    for _ in range(4):
        graph, x = torch.cuda.CUDAGraph(), torch.zeros(1 << 20, device="cuda")
        with torch.cuda.graph(graph):
            y = x + 1  # allocated from the graph's pool
        held.append((graph, x, y))
    del graph, x, y
    forward, threshold = graphs.forward, gc.get_threshold()

    def forward_under_pressure(*args: object) -> torch.Tensor:
        if torch.cuda.is_current_stream_capturing() and held:
            cycle: dict[str, object] = {"held": list(held)}
            cycle["self"] = cycle
            held.clear()  # garbage now: only the collector can free the graphs ...
            del cycle
            gc.set_threshold(1)
            _ = [[i] for i in range(100)]  # ... and these allocations would run it
        return forward(*args)

    graphs.forward = forward_under_pressure
    try:
        graphs.capture()
    finally:
        graphs.forward = forward
        gc.set_threshold(*threshold)
        gc.collect()  # the garbage goes here, outside any capture
    assert not held and gc.isenabled()  # the garbage was made inside the capture
    # The graphs captured under that pressure still compute what the eager forward does.
    seqs, tables = _prefilled(runner, 5)
    entries = [BatchEntry([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]
    _assert_graph_equals_eager(runner, entries, "bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_piecewise_graphs_equal_eager_and_padding_touches_nothing(
    tiny_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts, a prompt after its cached prefix beside decodes, and a lone short
    prompt: each replays the graphs of its padded size, as eagerly. The lone
    prompt replays the graph of its whole forward where prefill attention is
    FlashAttention's (bf16), the pieces where it is not (float32's SDPA)."""
    runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", dtype,
                                       max_piecewise_graph_tokens=64))
    pieces = runner.piecewise_runner
    assert pieces is not None and pieces.sizes == [16, 32, 64]
    layers = runner.model_config.num_hidden_layers
    assert all(len(p) == layers + 1 and len(pieces.calls[s]) == layers
               for s, p in pieces.pieces.items())
    flash = runner.attn_backend.prefill_impl in CAPTURABLE_PREFILL_BACKENDS
    assert sorted(pieces.prompt_graphs) == ([16, 32, 64] if flash else [])
    runs = _spy_on_graph_runs(pieces, monkeypatch)
    vocab = runner.vocab_size
    prompts = random_prompts([7, 20, 13, 5], vocab, seed=3)
    blocks = make_blocks(3)
    tables = [blocks.table(len(p) + 24) for p in prompts]
    more = random_prompts([20], vocab, seed=4)[0]
    steps = [
        [BatchEntry(p, 0, t) for p, t in zip(prompts[:3], tables)],  # 40 tokens: 64
        [BatchEntry([11], 7, tables[0]), BatchEntry(more, 20, tables[1]),  # 22 tokens: 32
         BatchEntry([12], 13, tables[2])],
        [BatchEntry(prompts[3], 0, tables[3])],  # 5 tokens: 16
    ]
    for entries in steps:
        _assert_graph_equals_eager(runner, entries, dtype)
    assert runs == [("pieces", 64), ("pieces", 32), ("prompt" if flash else "pieces", 16)]
    _assert_padding_wrote_nothing(runner, tables)


def _spy_on_graph_runs(pieces: PiecewiseGraphRunner, monkeypatch: pytest.MonkeyPatch
                       ) -> list[tuple[str, int]]:
    """A list that each replay of `pieces` appends to: ("pieces" or "prompt", size)."""
    runs: list[tuple[str, int]] = []
    run, run_prompt = pieces.run, pieces.run_prompt

    def spy(token_inputs: torch.Tensor, *args: object) -> torch.Tensor:
        runs.append(("pieces", token_inputs.shape[1]))
        return run(token_inputs, *args)

    def spy_prompt(token_inputs: torch.Tensor, *args: object) -> torch.Tensor:
        runs.append(("prompt", token_inputs.shape[1]))
        return run_prompt(token_inputs, *args)

    monkeypatch.setattr(pieces, "run", spy)
    monkeypatch.setattr(pieces, "run_prompt", spy_prompt)
    return runs


@pytest.fixture(scope="module")
def head_dim_128_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset with Qwen3-0.6B's head_dim of 128 (two query heads per
    KV head): prefill attention by our Hopper kernel where it runs."""
    return make_model(tmp_path_factory.mktemp("tiny-128"), preset="tiny",
                      overrides={"head_dim": 128})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [32, 128])
def test_a_lone_prompt_replays_one_graph_of_its_whole_forward(
    tiny_model_dir: Path, head_dim_128_model_dir: Path, head_dim: int,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone prompt from position 0: one replay, whatever its length up to the
    size (5, 16, 17, 40 and then 33 tokens in the graph of 64, so a stale length
    would show); logits and the K/V it writes as an eager run's. A prompt after
    its cached prefix, and two prompts, go through the pieces. Padding rows
    store nothing. With head_dim 32 prefill attention is FlashAttention-2's,
    with 128 our Hopper kernel's (on an H100/H200)."""
    model_dir = tiny_model_dir if head_dim == 32 else head_dim_128_model_dir
    runner = GPUModelRunner(engine_config(model_dir, "cuda", "bfloat16",
                                       max_piecewise_graph_tokens=64))
    pieces = runner.piecewise_runner
    impl = runner.attn_backend.prefill_impl
    if impl not in CAPTURABLE_PREFILL_BACKENDS:
        pytest.skip(f"prefill attention here ({impl}) takes its bounds from the host")
    if head_dim == 128 and ops.is_available() and ops.prefill.flash_wgmma_supported(
            runner.device, runner.dtype, 128, 2):
        assert impl == "flash_wgmma"
    runs = _spy_on_graph_runs(pieces, monkeypatch)
    vocab = runner.vocab_size
    lengths = [5, 16, 17, 40, 33]
    prompts = random_prompts(lengths, vocab, seed=7)
    blocks = make_blocks(7)
    tables = [blocks.table(n + 8) for n in lengths]
    for prompt, table in zip(prompts, tables):
        entries = [BatchEntry(prompt, 0, table)]
        eager = runner.execute_fast(entries, use_graph=False).float().clone()
        if impl == "flash_wgmma":  # the same step with FlashAttention-2 as prefill attention
            runner.attn_backend.prefill_impl = "flash_varlen"
            fa2 = runner.execute_fast(entries, use_graph=False).float()
            runner.attn_backend.prefill_impl = impl
            assert ((fa2 - eager).norm() / fa2.norm()).item() < 1e-2
        written = runner.kv_cache[:, :, table].clone()
        runner.kv_cache[:, :, table] = 0
        graph = runner.execute_fast(entries, use_graph=True).float().clone()
        assert ((graph - eager).norm() / eager.norm()).item() < 1e-2
        assert graph.argmax(-1).item() == eager.argmax(-1).item()
        # (The padded step may multiply on other kernels: equal up to bf16's rounding.)
        torch.testing.assert_close(runner.kv_cache[:, :, table], written, rtol=2e-2, atol=2e-2)
    assert runs == [("prompt", 16), ("prompt", 16), ("prompt", 32), ("prompt", 64),
                    ("prompt", 64)]
    more = random_prompts([9, 6], vocab, seed=8)
    if impl == "flash_wgmma":
        # After a cached prefix our kernel reads the cache through the block table;
        # FlashAttention-2 attends over the same context gathered.
        after_prefix = [BatchEntry(more[0], 5, tables[0])]
        ours = runner.execute_fast(after_prefix, use_graph=False).float().clone()
        runner.attn_backend.prefill_impl = "flash_varlen"
        fa2 = runner.execute_fast(after_prefix, use_graph=False).float()
        runner.attn_backend.prefill_impl = impl
        assert ((fa2 - ours).norm() / fa2.norm()).item() < 1e-2
    runs.clear()
    _assert_graph_equals_eager(runner, [BatchEntry(more[0], 5, tables[0])], "bfloat16")
    _assert_graph_equals_eager(runner, [BatchEntry(more[0], 0, tables[1]),
                                        BatchEntry(more[1], 0, tables[2])], "bfloat16")
    assert runs == [("pieces", 16), ("pieces", 16)]
    _assert_padding_wrote_nothing(runner, tables)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("use_graph", [True, False], ids=["graph", "eager"])
def test_a_step_has_no_host_sync(tiny_model_dir: Path, use_graph: bool) -> None:
    runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", "bfloat16"))
    sampler = FusedSampler()
    seqs, tables = _prefilled(runner, 5)
    greedy, random_ = SamplingParams(temperature=0.0), SamplingParams(temperature=0.6, top_p=0.9)
    rows = [(greedy if i % 2 else random_, None, s, []) for i, s in enumerate(seqs)]

    def decode_step(prev: torch.Tensor | None) -> torch.Tensor:
        # With `prev`, the tokens come from the previous step's samples on the device.
        entries = [BatchEntry([s[-1]], len(s) - 1, t, prev_sample_row=-1 if prev is None else i)
                   for i, (s, t) in enumerate(zip(seqs, tables))]
        logits = runner.execute_fast(entries, prev, use_graph=use_graph)
        meta = sampler.build_metadata(rows, runner.device, runner.vocab_size)
        return sampler(logits, meta).sampled_token_ids

    def mixed_step() -> torch.Tensor:
        entries = [BatchEntry([s[-1]], len(s) - 1, t) for s, t in zip(seqs[:3], tables)]
        entries.append(BatchEntry(seqs[4][-3:], len(seqs[4]) - 3, tables[4]))  # a chunk
        return runner.execute_fast(entries, use_graph=use_graph).argmax(-1)

    first = decode_step(None)  # warm-up: lazy initialisation may sync
    decode_step(first).tolist(), mixed_step().tolist()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode_ids = decode_step(None)
        async_ids = decode_step(decode_ids)
        mixed_ids = mixed_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(async_ids.tolist()) == 5 and len(mixed_ids.tolist()) == 4


def _hf_state_dict(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face's names (fused projections split), in float32.

    With the norms folded, qkv_proj and gate_up_proj hold `W * diag(norm.weight)` and
    the norms' weights are 1: the same function, which HF computes from them as they
    are."""
    packed = Qwen3ForCausalLM.packed_modules_mapping
    state = {}
    for name, param in model.named_parameters():
        module, _, pname = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in packed:
            parts = param.split(model.get_submodule(module).output_sizes)
            for sub, part in zip(packed[leaf], parts):
                state[f"{parent}.{sub}.{pname}"] = part.float()
        else:
            state[name] = param.float()
    return state


def run_mixed_steps(runner: ModelRunner, prompts: list[list[int]], tables: list[list[int]],
                    chunk: int) -> tuple[torch.Tensor, list[list[int]]]:
    """Five greedy steps of four sequences: what a GPU step meets, in one scenario.

    Step 1: the first three prompts, and the first `chunk` tokens of the fourth
    (no sample). Step 2: the fourth's other tokens (a prefix continuation) beside
    decodes of the other three. Steps 3-5: decodes of all four (CUDA graphs on a GPU).

    Returns:
        The steps' logits, `[3 + 4 + 3 * 4, vocab]`, and each sequence's tokens
        (its prompt and the greedy tokens drawn from those logits).
    """
    out1 = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts[:3], tables)]
                          + [BatchEntry(prompts[3][:chunk], 0, tables[3], sample=False)])
    seqs = [p + [int(tok)] for p, tok in zip(prompts[:3], out1.argmax(-1).tolist())]
    seqs.append(list(prompts[3]))
    out2 = runner.execute([BatchEntry([s[-1]], len(s) - 1, t) for s, t in zip(seqs[:3], tables)]
                          + [BatchEntry(prompts[3][chunk:], chunk, tables[3])])
    for s, tok in zip(seqs, out2.argmax(-1).tolist()):
        s.append(tok)
    decodes = []
    for _ in range(3):
        out = runner.execute([BatchEntry([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)])
        decodes.append(out.clone())
        for s, tok in zip(seqs, out.argmax(-1).tolist()):
            s.append(tok)
    return torch.cat([out1, out2, *decodes]), seqs


@torch.inference_mode()
def hf_logits_of_mixed_steps(hf: torch.nn.Module, seqs: list[list[int]],
                             prompt_lens: list[int]) -> torch.Tensor:
    """Hugging Face's logits for the rows `run_mixed_steps` returns, in its order,
    from one full forward of each finished sequence."""
    ref = [hf(torch.tensor([s], device=hf.device)).logits[0].float() for s in seqs]
    n = prompt_lens
    return torch.cat([
        torch.stack([ref[i][n[i] - 1] for i in range(3)]),  # step 1
        torch.stack([ref[i][n[i]] for i in range(3)] + [ref[3][n[3] - 1]]),  # step 2
        *[torch.stack([ref[i][n[i] + k + (i < 3)] for i in range(4)]) for k in range(3)],
    ])


def test_mixed_steps_helpers_line_up_with_hf_on_the_reference_runner(
        tiny_model_dir: Path) -> None:
    """The two helpers the GPU logits tests share, checked where they can run everywhere:
    the reference runner's rows in float32 equal Hugging Face's rows picked by
    `hf_logits_of_mixed_steps` (a row picked one position off differs by far more)."""
    transformers = pytest.importorskip("transformers")
    runner = ModelRunner(EngineArgs(
        model=str(tiny_model_dir), device="cpu", dtype="float32", block_size=16,
        num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4).create_engine_config())
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tiny_model_dir,
                                                       dtype=torch.float32).eval()
    prompts = random_prompts([7, 33, 60, 50], 200, seed=3)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]  # 128 tokens each
    ours, seqs = run_mixed_steps(runner, prompts, tables, chunk=20)
    assert ours.shape[0] == 3 + 4 + 3 * 4
    assert [len(s) - len(p) for s, p in zip(seqs, prompts)] == [5, 5, 5, 4]
    want = hf_logits_of_mixed_steps(hf, seqs, [len(p) for p in prompts])
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_qwen3_0_6b_bfloat16_logits_match_hf_float32(tmp_path: Path) -> None:
    """Real Qwen3-0.6B shapes, random weights: ours in bf16 vs HF in fp32 on the same weights."""
    transformers = pytest.importorskip("transformers")

    model_dir = make_model(tmp_path / "qwen3-0.6b", preset="qwen3-0.6b", weights=False)
    runner = GPUModelRunner(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", load_format="dummy",
        block_size=16, num_gpu_blocks_override=64, max_model_len=512, max_num_seqs=4,
    ).create_engine_config())
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
            attn_implementation="sdpa").eval()
    assert isinstance(runner.forward, FusedDecoderForward)  # norms folded into the weights
    norm = runner.model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    result = hf.load_state_dict(_hf_state_dict(runner.model), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}

    prompts = random_prompts([7, 33, 120, 70], 10000, seed=3)
    tables = [list(range(1 + 12 * i, 13 + 12 * i)) for i in range(4)]  # 192 tokens each
    # The fourth prompt in two chunks: 40 tokens, then its other 30 beside decodes.
    ours, seqs = run_mixed_steps(runner, prompts, tables, chunk=40)
    want = hf_logits_of_mixed_steps(hf, seqs, [len(p) for p in prompts])
    rel = (ours - want).norm(dim=-1) / want.norm(dim=-1)
    # bf16 weights and activations through 28 layers: about 1.5% here.
    assert rel.max().item() < 0.04, rel.tolist()
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_cache_is_sized_from_free_memory(tiny_model_dir: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    budget = 3 * 2**30  # what we leave the engine above what is in use now
    utilization = (total - free + budget) / total
    with caplog.at_level(logging.INFO, logger="mini_vllm.model_runner"):
        runner = GPUModelRunner(engine_config(
            tiny_model_dir, "cuda", "bfloat16", num_gpu_blocks_override=None, block_size=16,
            gpu_memory_utilization=utilization, max_num_seqs=1024, max_model_len=4096,
            max_num_batched_tokens=2048, enforce_eager=True))
    kv_bytes = runner.num_blocks * runner.block_bytes
    # The budget minus the margin and the activation estimate, not capped by
    # max_num_seqs * max_model_len (4M tokens = 4 GiB here).
    assert 1.5 * 2**30 < kv_bytes <= budget
    assert runner.kv_cache.nbytes == kv_bytes
    assert f"KV cache: {runner.num_blocks} blocks of 16 tokens" in caplog.text
    assert "max concurrency" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")
def test_sampling_metadata_next_step_equals_a_fresh_build() -> None:
    params = SamplingParams(temperature=0.7, top_p=1.0, top_k=0, min_p=0.0)
    outputs = [[3, 4], [], [5, 6, 7]]

    def build():
        return FusedSamplingMetadata.build([(params, None, [1], out, 100 + i)
                                            for i, out in enumerate(outputs)], "cuda", 1000)

    meta = build()
    assert meta.keyed and meta.noise_seeds is not None
    for out in outputs:
        out.append(9)  # each row drew one token
    advanced = meta.next_step()
    assert advanced is not None
    assert torch.equal(advanced.noise_seeds, build().noise_seeds)
    penalised = FusedSamplingMetadata.build(
        [(params.replace(presence_penalty=0.5), None, [1], [2], 1)], "cuda", 1000)
    assert penalised.next_step() is None  # penalties depend on the tokens: rebuild


@pytest.mark.gpu
@pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")
def test_reused_sampling_metadata_draws_the_same_tokens(tiny_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine reuses last step's metadata for the same rows: tokens as if rebuilt."""
    from mini_vllm.llm import LLM

    llm = LLM(str(tiny_model_dir), device="cuda", dtype="bfloat16", max_model_len=256,
              enable_prefix_caching=False)  # the same prefill kernels in both runs
    prompts = random_prompts([5, 17, 9, 30], llm.engine.vocab_size, seed=4)
    params = [SamplingParams(temperature=0.9, top_p=1.0, top_k=0, min_p=0.0, max_tokens=40,
                             ignore_eos=True, seed=seed) for seed in (1, None, 2, None)]

    def run() -> list[list[int]]:
        torch.manual_seed(0)  # the unseeded requests' noise keys
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    reused = run()
    monkeypatch.setattr(FusedSamplingMetadata, "next_step", lambda self: None)
    assert run() == reused
    assert len({tuple(t) for t in reused}) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")
def test_blocks_of_64_give_the_tokens_of_blocks_of_16(tiny_model_dir: Path) -> None:
    """The block size changes the bookkeeping, not the tokens.

    Prompts of 1 to 3 blocks of 64, one that ends exactly on a block edge, and a
    second wave that continues the first wave's prompts from the prefix cache
    (hits of whole blocks: 64 tokens at a time here, 16 in the reference),
    through the decode graphs and the piecewise graphs, in bf16 with the kernels.
    """
    from mini_vllm.llm import LLM

    vocab = 1000
    first = random_prompts([5, 64, 70, 150, 200], vocab, seed=7)
    shared = 100  # tokens the second wave shares with the first: 64 of them are one block
    second = [p[:shared] + q
              for p, q in zip(first[2:], random_prompts([3, 20, 9], vocab, seed=8))]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

    def run(**kw: object) -> tuple[int, list[list[int]], int]:
        llm = LLM(str(tiny_model_dir), device="cuda", dtype="bfloat16", max_model_len=512,
                  **kw)
        tokens = []
        for wave in (first, second):
            outs = llm.generate([{"prompt_token_ids": p} for p in wave], params,
                                use_tqdm=False)
            tokens += [o.outputs[0].token_ids for o in outs]
        stats = llm.engine.get_stats()
        block_size = llm.engine.config.cache_config.block_size
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        return block_size, tokens, stats["prefix_cache_hits"]

    size, tokens, hits = run(block_size=64, num_gpu_blocks_override=64)
    ref_size, ref_tokens, ref_hits = run(block_size=16, num_gpu_blocks_override=256)
    assert (size, ref_size) == (64, 16)
    assert tokens == ref_tokens
    assert all(len(t) == 40 for t in tokens)
    # Whole blocks of the shared prefix hit: 64 of 70 and of 100 tokens at 64 a block,
    # 64 of 70 and 96 of 100 at 16.
    for bs, found in ((size, hits), (ref_size, ref_hits)):
        assert found == sum(min(len(p), shared) // bs * bs for p in first[2:])


def test_small_batches_get_a_graph_per_context_bound() -> None:
    """Batch 1 is captured per bound of the ladder; a batch that fills the GPU once."""
    from mini_vllm.gpu.cuda_graphs import CONTEXT_BOUNDS, context_bounds
    from mini_vllm.ops.paged_attention import decode_partition_size

    def grid(bs: int):
        def of(bound: int) -> tuple[int, int]:
            size = decode_partition_size(bs, 16, 8, bound, 132)
            return (size, -(-bound // size)) if size < bound else (0, 1)
        return of

    assert context_bounds(8256, grid(1)) == [*CONTEXT_BOUNDS, 8256]
    # Each bound's grid is its own: 8,256 tokens in 17 partitions of 512, 256 in 4 of 64.
    assert grid(1)(8256) == (512, 17) and grid(1)(256) == (64, 4)
    # 2,048 CTAs need no split up to the longest partition (4,096 tokens).
    assert context_bounds(4096, grid(256)) == [4096]
    assert context_bounds(8256, grid(256)) == [4096, 8256]
    assert context_bounds(1000, grid(1)) == [256, 1000]
    assert context_bounds(4096, lambda bound: None) == [4096]  # no kernel grid to size


@pytest.mark.gpu
@pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")
@pytest.mark.parametrize("context", [100, 600, 3000])
def test_graph_of_each_context_bound_equals_eager(tiny_model_dir: Path, context: int) -> None:
    """Batch 1 replays the graphs of bounds 256, 1,024 and 4,096 (68 splits of 64 at 3k)."""
    runner = GPUModelRunner(engine_config(tiny_model_dir, "cuda", "bfloat16", block_size=16,
                                       num_gpu_blocks_override=260, max_model_len=4096))
    assert runner.graph_runner.bounds[1] == [256, 1024, 4096]
    prompt = random_prompts([context], runner.vocab_size, seed=7)[0]
    table = list(range(1, 1 + -(-(context + 1) // 16)))
    token = int(runner.execute([BatchEntry(prompt, 0, table)]).argmax(-1))
    entry = [BatchEntry([token], len(prompt), table)]
    eager = runner.execute_fast(entry, use_graph=False).float()
    graph = runner.execute_fast(entry, use_graph=True).float()
    assert ((graph - eager).norm() / eager.norm()).item() < 1e-2
    assert graph.argmax(-1).item() == eager.argmax(-1).item()


@pytest.mark.gpu
@pytest.mark.skipif(not ops.is_available(), reason=ops.unavailable_reason() or "kernels built")
def test_programmatic_launch_changes_no_bit(tiny_model_dir: Path) -> None:
    """Kernels launched with PDL (the default on sm_90+) and without: the same logits.

    A head_dim of 64 puts every fused kernel of a decode step in the chain (the
    tiny model's 32 runs the unfused forward); graphs and eager steps, batches 1 to 5.
    """

    path = make_model(tiny_model_dir.parent / "pdl-64", preset="tiny",
                      overrides={"head_dim": 64})
    prompts = random_prompts([40, 17, 70, 33, 25], 1000, seed=3)
    results = {}
    try:
        for pdl in (False, True):
            ops.set_programmatic_launch(pdl)  # graphs keep the setting they were captured with
            runner = GPUModelRunner(engine_config(path, "cuda", "bfloat16"))
            results[pdl] = greedy_run(runner, prompts, num_steps=9)
            del runner
    finally:
        ops.set_programmatic_launch(True)
    (seqs_off, logits_off), (seqs_on, logits_on) = results[False], results[True]
    assert seqs_on == seqs_off
    assert all(torch.equal(a, b) for a, b in zip(logits_on, logits_off))
