"""Phase 9: the skinny-GEMM kernel (`y = x @ W.T`, 1 to 16 rows) against float64 and cuBLAS."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from mini_vllm import ops
from mini_vllm.layers import Linear, select_implementations
from mini_vllm.layers import linear as linear_module
from mini_vllm.model_config import ModelConfig
from mini_vllm.models.qwen3 import Qwen3ForCausalLM
from mini_vllm.ops._extension import extension
from mini_vllm.ops.gemv import (
    GEMM_MAX_ROWS,
    GEMV_MAX_ROWS,
    gemm_wgmma,
    gemm_wgmma_pays,
    gemm_wgmma_usable,
    gemv,
    gemv_ref,
    gemv_usable,
    silu_mul_product_ref,
)
from mini_vllm.ops.layer_ops import silu_and_mul

pytestmark = [pytest.mark.phase9]


def _fast_linear(*args: object, **kwargs: object) -> Linear:
    """A `Linear` on its fast implementation, as the loader leaves it on a GPU (on the
    CPU its kernels decline every input and cuBLAS's place goes to `F.linear`)."""
    layer = Linear(*args, **kwargs)
    layer.use_fast = True
    return layer

needs_kernels = pytest.mark.skipif(
    not ops.is_available(), reason=ops.unavailable_reason() or "CUDA kernels available"
)
DTYPES = [torch.bfloat16, torch.float16]
# Every row count: one column tile of 8 rows up to 8, two up to 16.
ROWS = list(range(1, GEMV_MAX_ROWS + 1))

# (K, N) of every linear layer of a decode step: in_features, out_features.
QWEN3_0_6B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]
QWEN3_8B = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096), (4096, 151936)]
# Ragged N (the last group of 4 rows is partial), one output, the smallest K,
# and K that leaves a tail after the unrolled loop.
ODD = [(1024, 1000), (2048, 1), (8, 1000), (8, 1), (64, 1000), (64, 3), (1032, 4100),
       (3080, 1001)]


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """‖y − ref‖ / ‖ref‖ in float64."""
    return ((y.double() - ref).norm() / ref.norm()).item()


def _rounding(dtype: torch.dtype) -> float:
    """The largest relative error of one rounding to `dtype` (half its spacing)."""
    return 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11


# --- on any machine -----------------------------------------------------------------------

def test_reference_is_x_times_weight_transposed():
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)
    torch.testing.assert_close(gemv_ref(x, w), x @ w.T)


def test_wrapper_rejects_bad_arguments():
    bf16 = {"dtype": torch.bfloat16}
    x, w = torch.randn(2, 64, **bf16), torch.randn(32, 64, **bf16)
    with pytest.raises(ValueError, match="CUDA device"):
        gemv(x, w)
    with pytest.raises(ValueError, match="x: dtype float32"):
        gemv(x.float(), w)
    with pytest.raises(ValueError, match="weight: dtype float16"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        gemv(x.unsqueeze(0), w)
    with pytest.raises(ValueError, match=f"x: {GEMV_MAX_ROWS + 1} rows"):
        gemv(torch.randn(GEMV_MAX_ROWS + 1, 64, **bf16), w)
    with pytest.raises(ValueError, match="x: 0 rows"):
        gemv(torch.randn(0, 64, **bf16), w)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemv(torch.randn(2, 60, **bf16), torch.randn(32, 60, **bf16))
    with pytest.raises(ValueError, match="weight: shape"):
        gemv(x, torch.randn(32, 72, **bf16))
    with pytest.raises(ValueError, match="weight: must be contiguous"):
        gemv(x, torch.randn(64, 32, **bf16).T)
    with pytest.raises(ValueError, match="x: rows must be dense"):
        gemv(torch.randn(2, 128, **bf16)[:, ::2], w)  # elements 2 apart
    with pytest.raises(ValueError, match="x: rows must be dense"):
        gemv(torch.randn(2, 68, **bf16)[:, :64], w)  # rows 136 bytes apart
    with pytest.raises(ValueError, match="out: shape"):
        gemv(x, w, out=torch.empty(2, 31, **bf16))
    with pytest.raises(ValueError, match="splits"):
        gemv(x, w, splits=3)
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        gemv(x, w, accumulate=True)


def test_silu_mul_product_ref_scales_rows_then_applies_swiglu():
    """The reference of the fused epilogue: x @ W.T as [gate | up], each row times
    1 / rms(x), then silu(gate) * up (in float64 but the scale, which the model's
    path computes in float32)."""
    x, w = torch.randn(3, 16, dtype=torch.float64), torch.randn(10, 16, dtype=torch.float64)
    s = (x.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()
    gate, up = (x @ w.T * s).chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul_product_ref(x, w, 1e-6), F.silu(gate) * up,
                               rtol=1e-6, atol=1e-6)


def test_silu_eps_rejects_bad_arguments():
    bf16 = {"dtype": torch.bfloat16}
    x = torch.randn(2, 64, **bf16)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemv(x, torch.randn(24, 64, **bf16), silu_eps=1e-6)  # [gate; up] of 12 rows each
    with pytest.raises(ValueError, match="accumulate: silu_eps"):
        gemv(x, torch.randn(32, 64, **bf16), out=torch.empty(2, 16, **bf16), accumulate=True,
             silu_eps=1e-6)
    with pytest.raises(ValueError, match="silu_eps: must be positive"):
        gemv(x, torch.randn(32, 64, **bf16), silu_eps=0.0)
    with pytest.raises(ValueError, match=r"out: shape \(2, 32\) != \(2, 16\)"):
        gemv(x, torch.randn(32, 64, **bf16), out=torch.empty(2, 32, **bf16), silu_eps=1e-6)
    with pytest.raises(ValueError, match="accumulate: silu_eps"):
        gemm_wgmma(torch.randn(20, 128, **bf16), torch.randn(256, 128, **bf16),
                   out=torch.empty(20, 128, **bf16), accumulate=True, silu_eps=1e-6)
    with pytest.raises(ValueError, match="rows_per_cta: with silu_eps"):
        gemm_wgmma(torch.randn(20, 128, **bf16), torch.randn(256, 128, **bf16),
                   rows_per_cta=256, silu_eps=1e-6)


def test_gemv_usable_is_false_on_cpu():
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert not gemv_usable(x, w)
    assert not gemv_usable(x.float(), w.float())


def test_linear_falls_back_to_f_linear_on_cpu():
    layer = _fast_linear(64, [16, 16], dtype=torch.float32)
    layer.weight.copy_(torch.randn(32, 64))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_linear_silu_and_mul_leaves_the_cpu_to_the_caller():
    """No kernel of ours on the CPU: `Linear.silu_and_mul` says so with None, and
    the MLP runs the product and the activation apart."""
    layer = _fast_linear(64, [32, 32], dtype=torch.bfloat16)
    assert layer.silu_and_mul(torch.randn(3, 64, dtype=torch.bfloat16), 1e-6) is None
    qkv = _fast_linear(64, [32, 16, 16], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs \[gate; up\] of equal halves"):
        qkv.silu_and_mul(torch.randn(3, 64, dtype=torch.bfloat16), 1e-6)


def test_the_loader_chooses_every_linear_s_implementation(tiny_model_dir):
    """The model's linear layers (4 a decoder layer and the head) are all on the
    reference on the CPU, and `select_implementations` asks each whether its fast
    path runs; a tied head still multiplies by the embedding's table."""
    from mini_vllm.models.loader import load_model

    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = load_model(tiny_model_dir, config, torch.float32, "cpu")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * config.num_hidden_layers + 1  # qkv, o, gate_up, down; head
    assert not any(m.use_fast for m in linears)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


# --- on a GPU with the kernels built -------------------------------------------------------

def _check_shape(k: int, n: int, dtype: torch.dtype, rows: list[int],
                 x_pad: int = 0, splits: int = 0, product=gemv) -> None:
    """Every row count of `rows` at one (K, N): fresh random x, the output
    poisoned with NaN first, against float64 and against cuBLAS."""
    dev = "cuda"
    w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dtype)
    w64 = w.double()
    for m in rows:
        # x as a view into wider rows when x_pad > 0: row stride k + x_pad.
        x = torch.randn(m, k + x_pad, device=dev).to(dtype)[:, x_pad // 2: x_pad // 2 + k]
        ref = x.double() @ w64.T
        out = torch.full((m, n), float("nan"), device=dev, dtype=dtype)
        y = product(x, w, out=out, splits=splits)
        assert y is out
        assert not y.isnan().any(), f"M={m}: outputs left unwritten"
        err = _rel_err(y, ref)
        err_cublas = _rel_err(F.linear(x, w), ref)
        # Each output is rounded once, like cuBLAS's; a sum that lands on the
        # other side of a rounding boundary moves one element by one spacing.
        slack = 2 * _rounding(dtype) / y.numel() ** 0.5
        assert err < 1e-2, f"M={m}: relative error {err:.2e}"
        assert err <= 1.25 * err_cublas + slack, (
            f"M={m}: relative error {err:.3e} vs cuBLAS {err_cublas:.3e}")


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", QWEN3_0_6B, ids=[f"0.6B-{k}x{n}" for k, n in QWEN3_0_6B])
def test_gemv_qwen3_0_6b_shapes(k, n, dtype):
    _check_shape(k, n, dtype, ROWS)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", QWEN3_8B, ids=[f"8B-{k}x{n}" for k, n in QWEN3_8B])
def test_gemv_qwen3_8b_shapes(k, n, dtype):
    _check_shape(k, n, dtype, ROWS)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", ODD, ids=[f"{k}x{n}" for k, n in ODD])
def test_gemv_odd_shapes(k, n, dtype):
    _check_shape(k, n, dtype, ROWS)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("k, n", [(1024, 1000), (3080, 1001), (2048, 4096), (64, 7)])
def test_gemv_every_split(k, n, splits):
    """Each number of warps per tile of rows, whatever the heuristic would pick (with
    more warps than chunks of K, some warps add nothing)."""
    _check_shape(k, n, torch.bfloat16, [1, 3, 8, 9, 16], splits=splits)


def _check_accumulate(k: int, n: int, dtype: torch.dtype, rows: list[int],
                      product=gemv, **kwargs: object) -> None:
    dev = "cuda"
    w = (torch.randn(n, k, device=dev) * k ** -0.5).to(dtype)
    for m in rows:
        x = torch.randn(m, k, device=dev).to(dtype)
        out = (torch.randn(m, n, device=dev) * 4).to(dtype)
        ref = out.double() + x.double() @ w.double().T
        want = out.clone().addmm_(x, w.T)  # cuBLAS, beta = 1
        got = product(x, w, out=out, accumulate=True, **kwargs)
        assert got is out
        err, err_cublas = _rel_err(got, ref), _rel_err(want, ref)
        slack = 2 * _rounding(dtype) / got.numel() ** 0.5
        assert err <= 1.25 * err_cublas + slack, f"M={m}: {err:.3e} vs cuBLAS {err_cublas:.3e}"


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(2048, 1024), (3072, 1024), (1024, 1000)])
def test_gemv_accumulate_adds_into_out(k, n, dtype):
    """`accumulate=True`: out += x @ W.T, one rounding, as `out.addmm_` does (how
    o_proj and down_proj add into the residual stream with the norms folded)."""
    _check_accumulate(k, n, dtype, ROWS)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_reads_strided_rows(dtype):
    """x a view of wider rows (row stride > K), as a slice of a fused output is."""
    _check_shape(2048, 1000, dtype, ROWS, x_pad=64)
    _check_shape(1024, 4096, dtype, [1, 8, 12, 16], x_pad=16)


@needs_kernels
@pytest.mark.gpu
def test_gemv_usable_on_cuda():
    dev, bf16 = "cuda", torch.bfloat16
    x, w = torch.randn(4, 64, device=dev, dtype=bf16), torch.randn(32, 64, device=dev, dtype=bf16)
    assert gemv_usable(x, w)
    assert gemv_usable(torch.randn(2, 128, device=dev, dtype=bf16)[:, 64:], w)  # strided rows
    assert gemv_usable(torch.randn(GEMV_MAX_ROWS, 64, device=dev, dtype=bf16), w)
    assert not gemv_usable(torch.randn(GEMV_MAX_ROWS + 1, 64, device=dev, dtype=bf16), w)
    assert not gemv_usable(x.float(), w.float())
    assert not gemv_usable(x, w.half())
    assert not gemv_usable(x.unsqueeze(0), w)
    assert not gemv_usable(x, torch.randn(64, 32, device=dev, dtype=bf16).T)  # not contiguous
    assert not gemv_usable(torch.randn(2, 68, device=dev, dtype=bf16)[:, :64], w)  # stride 68
    assert not gemv_usable(torch.randn(2, 60, device=dev, dtype=bf16),
                           torch.randn(8, 60, device=dev, dtype=bf16))  # K % 8


def _check_graph_replay(product, rows: int, k: int, n: int) -> None:
    """`product` captured once in a CUDA graph, replayed on new inputs: no host
    sync, no allocation in the launch (and for gemm_wgmma, its tensor maps kept)."""
    dev, dtype = "cuda", torch.bfloat16
    w = torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    out = torch.empty(rows, n, device=dev, dtype=dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch advises
        product(x, w, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        product(x, w, out=out)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any()
        assert _rel_err(out, x.double() @ w.double().T) < 1e-2


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 5, 8, 11, 16])
def test_gemv_in_cuda_graph(rows):
    """Captured once, replayed on new inputs: no host sync, no allocation in the launch."""
    _check_graph_replay(gemv, rows, k=1024, n=4096)


def _check_silu_mul(k: int, n: int, dtype: torch.dtype, rows: list[int], product=gemv,
                    **kwargs: object) -> None:
    """The product with SiLU · mul in its epilogue (`silu_eps`), at every row count
    of `rows`, output poisoned first: against the same product followed by the
    `silu_and_mul` kernel (the model's unfused path: bit for bit but where the
    row's float32 sum of squares, added in another order, rounds the other way),
    row by row, and against float64.

    The rows of x have rms from 0.2 to 24, so that a row scaled by another's
    scale shows, and one row's mean square equals eps, so that the kernel must
    add eps where the reference does.
    """
    dev, eps = "cuda", 1e-6
    # A folded gate_up_proj: the norm's weight (about 1) times W.
    w = (torch.randn(n, k, device=dev) * k ** -0.5 * (1 + 0.1 * torch.randn(k, device=dev)))
    w = w.to(dtype)
    # gemm_wgmma's fused mode takes 128 rows a CTA: the unfused call the same tiles.
    unfused_kw = dict(kwargs, rows_per_cta=128) if product is gemm_wgmma else kwargs
    least = 0.99 if dtype == torch.bfloat16 else 0.98
    for m in rows:
        spread = 2.0 ** (torch.arange(m, device=dev) % 8 - 4).unsqueeze(1)
        x = torch.randn(m, k, device=dev) * 3 * spread  # the residual stream
        x[m // 2] = torch.randn(k, device=dev) * eps ** 0.5  # mean square about eps
        x = x.to(dtype)
        out = torch.full((m, n // 2), float("nan"), device=dev, dtype=dtype)
        y = product(x, w, out=out, silu_eps=eps, **kwargs)
        assert y is out
        assert not y.isnan().any(), f"M={m}: outputs left unwritten"
        unfused = silu_and_mul(product(x, w, **unfused_kw), x, eps)
        # gemm_wgmma sums the squares on the tensor cores (x xᵀ): fp16's finer
        # spacing shows the other order of the additions more often than bf16's.
        same = (y == unfused).float().mean(dim=1)
        assert same.min() > 0.9, f"M={m}: row {same.argmin()} is {same.min():.3f} equal"
        assert same.mean() > least, f"M={m}: {same.mean():.4f} of the outputs equal"
        torch.testing.assert_close(y, unfused, rtol=8 * _rounding(dtype), atol=1e-3)
        ref = silu_mul_product_ref(x.double(), w.double(), eps)
        err, err_unfused = _rel_err(y, ref), _rel_err(unfused, ref)
        slack = 2 * _rounding(dtype) / y.numel() ** 0.5
        assert err <= 1.25 * err_unfused + slack, (
            f"M={m}: relative error {err:.3e} vs unfused {err_unfused:.3e}")


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [0, 1, 2, 4, 8, 16])
@pytest.mark.parametrize("k, n", [(1024, 6144), (4096, 24576), (64, 32), (1032, 1040)],
                         ids=["0.6B", "8B", "small", "ragged-k"])
def test_gemv_silu_mul_epilogue(k, n, splits, dtype):
    """gate_up_proj with SiLU · mul in one launch, 1 to 16 rows: Qwen3-0.6B's and
    8B's shapes, the smallest [gate; up], and K that leaves a tail."""
    _check_silu_mul(k, n, dtype, ROWS, splits=splits)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny", "tiny-untied"])
def test_model_with_gemv_matches_model_without(tiny_model_dir, preset, monkeypatch):
    """A bf16 model with the kernel on and off: an 8-token prefill and greedy
    decode steps of one token (rows 8 and 1) give the same tokens, and logits
    equal to bf16 rounding."""
    from mini_vllm.attention import AttentionMetadata
    from mini_vllm.checkpoint import make_model
    from mini_vllm.models.loader import load_weights

    # head_dim 64 so the other blocks' kernels run too.
    path = make_model(tiny_model_dir.parent / f"gemv-{preset}", preset=preset,
                      overrides={"head_dim": 64})
    config = ModelConfig.from_pretrained(path)
    dev = "cuda"
    model = Qwen3ForCausalLM(config, device=dev, dtype=torch.bfloat16)
    load_weights(model, path)
    select_implementations(model, dev, torch.bfloat16)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    calls: list[tuple[int, int]] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((x.shape[0], weight.shape[0]))
        return gemv(x, weight, **kwargs)  # o_proj / down_proj: out=, accumulate=

    monkeypatch.setattr(linear_module, "gemv", spy)
    block, prompt_len, steps = 16, 8, 6

    def meta(start: int, count: int) -> AttentionMetadata:
        # One sequence in block 1: slots 16 .. 31.
        return AttentionMetadata(
            slot_mapping=torch.arange(block + start, block + start + count, device=dev),
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=dev),
            context_lens=torch.tensor([start + count], dtype=torch.int32, device=dev),
            block_tables=torch.tensor([[1]], dtype=torch.int32, device=dev),
            max_query_len=count, max_context_len=start + count,
            query_start_loc_cpu=[0, count], context_lens_cpu=[start + count])

    def generate(use: bool) -> tuple[list[int], list[torch.Tensor]]:
        for m in linears:
            m.use_fast = use
        kv = [(torch.zeros(4, block, config.num_key_value_heads, config.head_dim, device=dev,
                           dtype=torch.bfloat16),
               torch.zeros(4, block, config.num_key_value_heads, config.head_dim, device=dev,
                           dtype=torch.bfloat16)) for _ in range(config.num_hidden_layers)]
        gen = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).to(dev)
        tokens, logits = [], []
        start = 0
        with torch.no_grad():
            for _ in range(steps + 1):
                h = model(ids, torch.arange(start, start + len(ids), device=dev), kv,
                          meta(start, len(ids)))
                step_logits = model.compute_logits(h)  # every row: 8, then 1
                logits.append(step_logits)
                start += len(ids)
                tokens.append(int(step_logits[-1].argmax()))
                ids = torch.tensor([tokens[-1]], device=dev)
        return tokens, logits

    ref_tokens, ref_logits = generate(False)
    assert not calls
    tokens, logits = generate(True)
    # Every linear layer of every step went through the kernel, at 8 rows and at 1.
    assert len(calls) == (steps + 1) * len(linears)
    assert {r for r, _ in calls} == {1, prompt_len}
    assert (prompt_len, config.vocab_size) in calls  # the lm_head
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.1)


# --- the wgmma GEMM for 17 to 256 rows (Hopper) ----------------------------------------------

needs_wgmma = pytest.mark.skipif(
    not ops.is_available() or not extension().wgmma_gemm_supported(),
    reason="needs an sm_90 GPU and the kernels built for sm_90a")
# Below, at and above each block of 64 rows; the decode batches of the ladder. Up to 64
# rows in a CTA (all of x, or the last tile of 129 to 192) its second consumer has no
# rows and sits out: the stages must still be refilled, and its rows never stored.
WGMMA_ROWS = [1, 17, 24, 33, 64, 65, 100, 128, 129, 191, 192, 200, 255, 256]
WGMMA_SHAPES = [(k, n) for k, n in QWEN3_0_6B + QWEN3_8B if n != 151936]


def test_gemm_wgmma_rejects_bad_arguments():
    bf16 = torch.bfloat16
    x, w = torch.randn(20, 128, dtype=bf16), torch.randn(256, 128, dtype=bf16)
    with pytest.raises(ValueError, match="CUDA device"):
        gemm_wgmma(x, w)
    with pytest.raises(ValueError, match=f"x: {GEMM_MAX_ROWS + 1} rows"):
        gemm_wgmma(torch.randn(GEMM_MAX_ROWS + 1, 128, dtype=bf16), w)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm_wgmma(torch.randn(20, 96, dtype=bf16), torch.randn(256, 96, dtype=bf16))
    with pytest.raises(ValueError, match="multiple of 128"):
        gemm_wgmma(x, torch.randn(200, 128, dtype=bf16))
    with pytest.raises(ValueError, match="splits"):
        gemm_wgmma(x, w, splits=17)
    with pytest.raises(ValueError, match="rows_per_cta"):
        gemm_wgmma(x, w, rows_per_cta=64)
    with pytest.raises(ValueError, match="tile_n"):
        gemm_wgmma(x, w, tile_n=32)
    with pytest.raises(ValueError, match="accumulate=True adds into out"):
        gemm_wgmma(x, w, accumulate=True)
    assert not gemm_wgmma_usable(x, w)  # on the CPU


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", WGMMA_SHAPES, ids=[f"{k}x{n}" for k, n in WGMMA_SHAPES])
def test_gemm_wgmma_qwen3_shapes(k, n, dtype):
    """Qwen3-0.6B's and 8B's layers (the 8B's gate_up is two waves of tiles)."""
    _check_shape(k, n, dtype, WGMMA_ROWS, product=gemm_wgmma)


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("k, n", [(1024, 4096), (3072, 1024), (64, 128), (640, 384)])
def test_gemm_wgmma_every_split(k, n, splits):
    """Every cluster size, whatever the heuristic would pick: slices of K that
    do not divide it evenly, and more CTAs asked for than slices of 64."""
    _check_shape(k, n, torch.bfloat16, [3, 17, 64, 130, 256], splits=splits,
                 product=gemm_wgmma)


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("rows_per_cta", [128, 256])
@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("k, n", [(1024, 4096), (3072, 1024), (2048, 1024)])
def test_gemm_wgmma_every_plan(k, n, splits, rows_per_cta, tile_n):
    """Every tiling, whatever the plan would pick: tiles of 64 or 128 outputs, by
    a grid of 128-row tiles (the last one partial) or all rows in one CTA, with
    and without a split of K."""
    _check_shape(k, n, torch.bfloat16, [3, 64, 100, 128, 129, 200, 256], splits=splits,
                 product=functools.partial(gemm_wgmma, rows_per_cta=rows_per_cta,
                                           tile_n=tile_n))


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(2048, 1024), (3072, 1024), (1024, 4096)])
def test_gemm_wgmma_accumulate_adds_into_out(k, n, dtype, splits):
    _check_accumulate(k, n, dtype, [17, 64, 100, 200, 256], product=gemm_wgmma,
                      splits=splits)


@needs_wgmma
@pytest.mark.gpu
def test_gemm_wgmma_reads_strided_rows():
    _check_shape(2048, 1024, torch.bfloat16, [17, 100, 256], x_pad=64, product=gemm_wgmma)
    _check_shape(1024, 4096, torch.float16, [40, 129], x_pad=16, product=gemm_wgmma)


@needs_wgmma
@pytest.mark.gpu
def test_gemm_wgmma_usable_on_cuda():
    dev, bf16 = "cuda", torch.bfloat16
    w = torch.randn(1024, 2048, device=dev, dtype=bf16)
    assert gemm_wgmma_usable(torch.randn(17, 2048, device=dev, dtype=bf16), w)
    assert gemm_wgmma_usable(torch.randn(GEMM_MAX_ROWS, 2048, device=dev, dtype=bf16), w)
    assert not gemm_wgmma_usable(torch.randn(GEMM_MAX_ROWS + 1, 2048, device=dev, dtype=bf16), w)
    assert not gemm_wgmma_usable(torch.randn(17, 2048, device=dev), w.float())
    head = torch.randn(151936, 1024, device=dev, dtype=bf16)  # many waves: cuBLAS's
    assert not gemm_wgmma_usable(torch.randn(64, 1024, device=dev, dtype=bf16), head)
    assert not gemm_wgmma_usable(torch.randn(64, 1000, device=dev, dtype=bf16),
                                 torch.randn(128, 1000, device=dev, dtype=bf16))  # K % 64


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(1024, 6144), (3072, 1024), (640, 256)],
                         ids=["0.6B", "wide-k", "small"])
def test_gemm_wgmma_silu_mul_epilogue(k, n, dtype):
    """gate_up_proj with SiLU · mul in one launch, 1 to 256 rows, the plan the kernel picks."""
    _check_silu_mul(k, n, dtype, WGMMA_ROWS, product=gemm_wgmma)


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("splits", [1, 2, 3, 8])
def test_gemm_wgmma_silu_mul_every_plan(splits, tile_n):
    """Every tiling with the epilogue: gate's and up's half tiles of 32 or 64 rows,
    128-row tiles (the last one partial), and a split of K, whose partial sums of
    squares are added with the products'."""
    _check_silu_mul(1024, 6144, torch.bfloat16, [3, 64, 100, 128, 129, 200, 256],
                    product=gemm_wgmma, splits=splits, rows_per_cta=128, tile_n=tile_n)


@needs_wgmma
@pytest.mark.gpu
def test_linear_silu_and_mul_fuses_where_our_products_run():
    """Qwen3-0.6B's gate_up_proj: the GEMV's epilogue up to 16 rows, gemm_wgmma's up
    to 128, and None from 129 rows (cuBLAS's), each equal to the two launches."""
    dev, dtype, eps = "cuda", torch.bfloat16, 1e-6
    gate_up = _fast_linear(1024, [3072, 3072], device=dev, dtype=dtype)
    gate_up.weight.copy_(torch.randn_like(gate_up.weight) * 1024 ** -0.5)
    for rows in (1, 16, 17, 64, 128, 129, 256):
        x = torch.randn(rows, 1024, device=dev, dtype=dtype)
        got = gate_up.silu_and_mul(x, eps)
        if rows > 128:
            assert got is None, f"rows={rows}: cuBLAS's shapes are left to the caller"
            continue
        assert got is not None and got.shape == (rows, 3072)
        torch.testing.assert_close(got, silu_and_mul(gate_up(x), x, eps), rtol=2e-2, atol=1e-3)


@needs_wgmma
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [17, 96, 256])
def test_gemm_wgmma_in_cuda_graph(rows):
    """Captured once (tensor maps and all), replayed on new inputs."""
    _check_graph_replay(gemm_wgmma, rows, k=3072, n=1024)


@needs_wgmma
@pytest.mark.gpu
def test_linear_sends_the_shapes_where_wgmma_pays_to_it(monkeypatch):
    """`Linear` picks the product by shape: Qwen3-0.6B's o_proj and qkv_proj at 17 to
    128 rows go to gemm_wgmma, forward and add_to; 129 rows, and a product over K =
    4,096 (Qwen3-8B's), stay cuBLAS's. Every result matches cuBLAS."""
    dev, dtype = "cuda", torch.bfloat16
    calls: list[tuple[int, int]] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((x.shape[0], weight.shape[0]))
        return gemm_wgmma(x, weight, **kwargs)

    monkeypatch.setattr(linear_module, "gemm_wgmma", spy)
    o_proj = _fast_linear(2048, [1024], device=dev, dtype=dtype)
    qkv = _fast_linear(1024, [2048, 1024, 1024], device=dev, dtype=dtype)
    wide_k = _fast_linear(4096, [1024], device=dev, dtype=dtype)
    for layer in (o_proj, qkv, wide_k):
        layer.weight.copy_(torch.randn_like(layer.weight) * layer.weight.shape[1] ** -0.5)
    for rows in (17, 40, 64, 65, 128, 129):
        calls.clear()
        x = torch.randn(rows, 2048, device=dev, dtype=dtype)
        torch.testing.assert_close(o_proj(x), F.linear(x, o_proj.weight), rtol=2e-2, atol=2e-2)
        residual = torch.randn(rows, 1024, device=dev, dtype=dtype)
        want = residual.clone().addmm_(x, o_proj.weight.t())
        o_proj.add_to(x, residual)
        torch.testing.assert_close(residual, want, rtol=2e-2, atol=2e-2)
        qkv_x = torch.randn(rows, 1024, device=dev, dtype=dtype)
        torch.testing.assert_close(qkv(qkv_x), F.linear(qkv_x, qkv.weight), rtol=2e-2, atol=2e-2)
        wide_k(torch.randn(rows, 4096, device=dev, dtype=dtype))
        expected = [(rows, 1024)] * 2 + [(rows, 4096)] if rows <= 128 else []
        assert calls == expected, f"rows={rows}: {calls}"
        assert gemm_wgmma_pays(x, o_proj.weight) == (rows <= 128)
