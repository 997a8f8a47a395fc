"""Phase 9: the fused layer kernels (norms, q/k-norm + RoPE, SiLU·mul) against their references,
and q/k-norm + RoPE with the KV-cache write fused in against the two-kernel path."""

from __future__ import annotations

import re

import pytest
import torch

from mini_vllm import ops
from mini_vllm.attention import AttentionMetadata, TorchAttentionBackend
from mini_vllm.gpu.fused_layers import (
    FusedDecoderForward,
    fold_norm_weights,
    foldable,
    layer_kernels_usable,
    prepare_forward,
)
from mini_vllm.layers import RotaryEmbedding, select_implementations
from mini_vllm.model_config import ModelConfig
from mini_vllm.models.loader import load_weights
from mini_vllm.models.qwen3 import Qwen3ForCausalLM
from mini_vllm.ops import layer_ops

pytestmark = pytest.mark.phase9

needs_kernels = pytest.mark.skipif(
    not ops.is_available(), reason=ops.unavailable_reason() or "CUDA kernels available"
)
DTYPES = [torch.bfloat16, torch.float16]


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Same rounding points as the reference: almost every element is bit-equal."""
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    equal = (out == ref).float().mean().item()
    assert equal > 0.99, f"only {equal:.3%} of the elements are bit-equal to the reference"


def _one_sequence_meta(start: int, count: int, device: str) -> AttentionMetadata:
    """`count` new tokens of one sequence from position `start`, in blocks 1 and 2 of
    16 tokens (slots 16 .. 47)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(16 + start, 16 + start + count, device=device),
        query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=device),
        context_lens=torch.tensor([start + count], dtype=torch.int32, device=device),
        block_tables=torch.tensor([[1, 2]], dtype=torch.int32, device=device),
        max_query_len=count, max_context_len=start + count,
        query_start_loc_cpu=[0, count], context_lens_cpu=[start + count])


def _model(config: ModelConfig, device: str, dtype: torch.dtype, path=None, backend=None,
           fast: bool = True) -> Qwen3ForCausalLM:
    """A Qwen3 on `device`, loaded from `path` when given, each block on its fast
    implementation where it runs (`fast`), as the loader leaves it."""
    model = Qwen3ForCausalLM(config, backend, device=device, dtype=dtype)
    if path is not None:
        load_weights(model, path)
    if fast:
        select_implementations(model, device, dtype)
    return model


# --- on any machine -----------------------------------------------------------------------

def test_reference_add_norm_is_add_then_norm():
    x, r, w = torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5
    normed, new_r = layer_ops.rms_norm_ref(x, w, 1e-6, residual=r)
    torch.testing.assert_close(new_r, x + r)
    expected = w * (new_r / torch.sqrt(new_r.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed, expected)


def test_wrappers_reject_bad_arguments():
    with pytest.raises(ValueError, match="CUDA device"):
        layer_ops.rms_norm(torch.randn(4, 64, dtype=torch.bfloat16),
                           torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        layer_ops.silu_and_mul(torch.randn(4, 64))  # float32 is the reference's job
    with pytest.raises(ValueError, match="heads_per_warp"):
        layer_ops.qk_norm_rope(torch.randn(2, 4 * 128, dtype=torch.bfloat16),
                               torch.ones(128, dtype=torch.bfloat16),
                               torch.ones(128, dtype=torch.bfloat16), torch.randn(8, 128),
                               torch.zeros(2, dtype=torch.int64), 2, 1, 128, 1e-6,
                               heads_per_warp=3)
    with pytest.raises(ValueError, match="head_dim"):
        layer_ops.qk_norm_rope(torch.randn(2, 4 * 32, dtype=torch.bfloat16),
                               torch.ones(32, dtype=torch.bfloat16),
                               torch.ones(32, dtype=torch.bfloat16), torch.randn(8, 32),
                               torch.zeros(2, dtype=torch.int64), 2, 1, 32, 1e-6)


def test_qk_norm_rope_rejects_bad_cache_arguments():
    bf16 = {"dtype": torch.bfloat16}
    t, hq, hkv, d = 3, 4, 2, 64
    args = (torch.randn(t, (hq + 2 * hkv) * d, **bf16), torch.ones(d, **bf16),
            torch.ones(d, **bf16), torch.randn(16, d), torch.zeros(t, dtype=torch.int64),
            hq, hkv, d, 1e-6)
    cache = torch.zeros(4, 16, hkv, d, **bf16)
    slots = torch.arange(t)
    with pytest.raises(ValueError, match="go together"):
        layer_ops.qk_norm_rope(*args, kv_cache=(cache, cache.clone()))
    with pytest.raises(ValueError, match="go together"):
        layer_ops.qk_norm_rope(*args, slot_mapping=slots)
    with pytest.raises(ValueError, match="k_cache: 4 heads of 32"):
        wrong = torch.zeros(4, 16, 4, 32, **bf16)
        layer_ops.qk_norm_rope(*args, kv_cache=(wrong, wrong.clone()), slot_mapping=slots)
    with pytest.raises(ValueError, match="k_cache: dtype float16"):
        layer_ops.qk_norm_rope(*args, kv_cache=(cache.half(), cache.half()), slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries"):
        layer_ops.qk_norm_rope(*args, kv_cache=(cache, cache.clone()), slot_mapping=slots[:2])
    with pytest.raises(ValueError, match="CUDA device"):  # the arguments are right
        layer_ops.qk_norm_rope(*args, kv_cache=(cache, cache.clone()), slot_mapping=slots)


def test_qk_norm_rope_rejects_rows_off_16_bytes():
    """The kernel moves a lane's run of a head in one access: a qkv whose rows do not
    start on 16 bytes (a slice one column in, an odd row stride) is refused, by name."""
    bf16 = {"dtype": torch.bfloat16}
    t, hq, hkv, d = 3, 4, 2, 64
    width = (hq + 2 * hkv) * d
    rest = (torch.ones(d, **bf16), torch.ones(d, **bf16), torch.randn(16, d),
            torch.zeros(t, dtype=torch.int64), hq, hkv, d, 1e-6)
    shifted = torch.randn(t, width + 8, **bf16)[:, 1:width + 1]  # starts 2 bytes in
    with pytest.raises(ValueError, match="qkv: rows must start on 16 bytes"):
        layer_ops.qk_norm_rope(shifted, *rest)
    odd_stride = torch.randn(t, width + 1, **bf16)[:, :width]  # rows 2 bytes apart from 16
    with pytest.raises(ValueError, match="qkv: rows must start on 16 bytes"):
        layer_ops.qk_norm_rope(odd_stride, *rest)
    weight = torch.ones(d + 1, **bf16)[1:]
    with pytest.raises(ValueError, match="q_weight: must start on 16 bytes"):
        layer_ops.qk_norm_rope(torch.randn(t, width, **bf16), weight, *rest[1:])
    cache = torch.zeros(4 * 16 * hkv * d + 1, **bf16)[1:].view(4, 16, hkv, d)
    with pytest.raises(ValueError, match="k_cache: must start on 16 bytes"):
        layer_ops.qk_norm_rope(torch.randn(t, width, **bf16), *rest,
                               kv_cache=(cache, cache.clone()), slot_mapping=torch.arange(t))


def test_fused_attention_hands_the_cache_write_to_qk_norm_rope(tiny_model_dir, monkeypatch):
    """The wiring, on the CPU: with the kernels on and a backend that writes with the
    kernel, the fused layer gives `qk_norm_rope` the caches, the slots and the residual
    to scale by, and the backend writes nothing; the residual and the caches end as the
    reference layer leaves them. The kernel is stood in for by its torch reference plus
    `write_kv_cache`."""
    from mini_vllm.attention import write_kv_cache

    config = ModelConfig.from_pretrained(tiny_model_dir)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    fused_writes, backend_writes = [], []

    def qk_norm_rope_torch(qkv, q_weight, k_weight, cos_sin_cache, positions, num_q_heads,
                           num_kv_heads, head_dim, eps, *, kv_cache=None, slot_mapping=None,
                           residual=None, residual_eps=1e-6):
        t = qkv.shape[0]
        qkv.copy_(layer_ops.scale_rows_ref(qkv, residual, residual_eps))
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q_new, k_new = layer_ops.qk_norm_rope_ref(q.reshape(t, hq, d), k.reshape(t, hkv, d),
                                                  q_weight, k_weight, cos_sin_cache,
                                                  positions, eps)
        q.copy_(q_new.reshape(t, -1))
        k.copy_(k_new.reshape(t, -1))
        if kv_cache is not None:
            fused_writes.append(slot_mapping)
            write_kv_cache(k_new, v.reshape(t, hkv, d), *kv_cache, slot_mapping)

    class KernelWriteBackend(TorchAttentionBackend):
        write_impl = "kernel"  # what CudaAttentionBackend says when reshape_and_cache runs

        def write_kv_cache(self, *args):
            backend_writes.append(args)
            super().write_kv_cache(*args)

    monkeypatch.setattr(layer_ops, "qk_norm_rope", qk_norm_rope_torch)
    fused = _model(config, "cpu", torch.float32, tiny_model_dir, KernelWriteBackend())
    ref = _model(config, "cpu", torch.float32, tiny_model_dir)
    forward = FusedDecoderForward(fused, kernels=True)
    t, block = 5, 8
    meta = AttentionMetadata(
        slot_mapping=torch.arange(block, block + t), query_start_loc=torch.tensor([0, t]),
        context_lens=torch.tensor([t]), block_tables=torch.tensor([[1]]), max_query_len=t,
        max_context_len=t, query_start_loc_cpu=[0, t], context_lens_cpu=[t])
    positions, x = torch.arange(t), torch.randn(t, config.hidden_size)
    caches = [(torch.zeros(2, block, hkv, d), torch.zeros(2, block, hkv, d)) for _ in range(2)]
    residual = x.clone()
    forward._attention(fused.model.layers[0], positions, residual, caches[0], meta)
    assert len(fused_writes) == 1 and not backend_writes
    layer = ref.model.layers[0]
    want = x + layer.self_attn(positions, layer.input_layernorm(x), caches[1], meta)
    torch.testing.assert_close(residual, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0], caches[1], rtol=1e-5, atol=1e-5)


def test_model_uses_kernels_only_where_they_run(tiny_model_dir):
    """On the CPU in float32 no block runs a kernel and the GPU runner would run the
    model's own forward; the tiny Qwen3 has the shape the fused forward takes."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = _model(config, "cpu", torch.float32, tiny_model_dir)
    assert not any(getattr(m, "use_fast", False) for m in model.modules())
    assert not layer_kernels_usable(config, "cpu", torch.float32)
    assert not layer_kernels_usable(config, "cuda", torch.bfloat16)  # head_dim 32
    assert foldable(model)
    assert prepare_forward(model, torch.device("cpu"), torch.float32) is model


# --- on a GPU with the kernels built -------------------------------------------------------

@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden", [(1, 64), (7, 1024), (256, 1024), (33, 4096),
                                                 (5, 2048 + 8)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, with_residual):
    dev = "cuda"
    x = torch.randn(num_tokens, hidden, device=dev, dtype=dtype) * 3
    w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
    r = torch.randn(num_tokens, hidden, device=dev, dtype=dtype) if with_residual else None
    ref, ref_r = layer_ops.rms_norm_ref(x, w, 1e-6, None if r is None else r.clone())
    out, new_r = layer_ops.rms_norm(x, w, 1e-6, r)
    _close(out, ref)
    if with_residual:
        assert torch.equal(new_r, ref_r)  # one rounded add: exactly the reference's


@needs_kernels
@pytest.mark.gpu
def test_rms_norm_reads_strided_rows():
    x = torch.randn(9, 2048, device="cuda", dtype=torch.bfloat16)[:, :1024]  # row stride 2048
    w = torch.rand(1024, device="cuda", dtype=torch.bfloat16) + 0.5
    _close(layer_ops.rms_norm(x, w, 1e-6)[0], layer_ops.rms_norm_ref(x, w, 1e-6)[0])


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hq, hkv, d", [(1, 16, 8, 128), (300, 16, 8, 128),
                                                    (17, 32, 8, 128), (9, 8, 2, 64),
                                                    (5, 14, 2, 64), (6, 7, 1, 128),
                                                    (3, 30, 3, 64)])
@pytest.mark.parametrize("heads_per_warp", [0, 1, 2, 4])
def test_qk_norm_rope_matches_reference(dtype, num_tokens, hq, hkv, d, heads_per_warp):
    """Every number of heads a warp; warps that hold q and k heads together (14 + 2
    at four a warp, 7 + 1 at two), and at one head a warp a second group of warps
    past 32 heads whose last warp has no head at all (30 + 3)."""
    dev = "cuda"
    rope = RotaryEmbedding(d, 4096, 1e6, device=dev)
    positions = torch.randint(0, 4096, (num_tokens,), device=dev)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device=dev, dtype=dtype)
    qw = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = layer_ops.qk_norm_rope_ref(
        q.reshape(num_tokens, hq, d), k.reshape(num_tokens, hkv, d), qw, kw,
        rope.cos_sin_cache, positions, 1e-6)
    v_before = v.clone()
    layer_ops.qk_norm_rope(qkv, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6,
                           heads_per_warp=heads_per_warp)
    _close(q.reshape(num_tokens, hq, d), ref_q)
    _close(k.reshape(num_tokens, hkv, d), ref_k)
    assert torch.equal(v, v_before)  # v is not touched


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, d", [(1, 3072), (255, 3072), (8, 1024 + 8)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, d):
    x = torch.randn(num_tokens, 2 * d, device="cuda", dtype=dtype) * 4
    _close(layer_ops.silu_and_mul(x), layer_ops.silu_and_mul_ref(x))


@needs_kernels
@pytest.mark.gpu
def test_model_with_kernels_matches_model_without(tiny_model_dir):
    """The same bf16 model, its blocks' kernels on and off: the same logits to bf16
    rounding."""
    from mini_vllm.checkpoint import make_model

    path = make_model(tiny_model_dir.parent / "kernels-64", preset="tiny",
                      overrides={"head_dim": 64})
    config = ModelConfig.from_pretrained(path)
    models = []
    for use in (False, True):
        # Unfolded on both sides: the kernels round where the torch ops do
        # (folding the norms changes where a bf16 model rounds; tested below).
        m = _model(config, "cuda", torch.bfloat16, path, fast=use)
        assert any(getattr(b, "use_fast", False) for b in m.modules()) == use
        models.append(m)
    t = 12
    kv = [(torch.zeros(4, 16, config.num_key_value_heads, config.head_dim, device="cuda",
                       dtype=torch.bfloat16),) * 2 for _ in range(config.num_hidden_layers)]
    kv = [(a.clone(), b.clone()) for a, b in kv]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(16, 16 + t, device="cuda"),
        query_start_loc=torch.tensor([0, t], dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor([t], dtype=torch.int32, device="cuda"),
        block_tables=torch.tensor([[1]], dtype=torch.int32, device="cuda"),
        max_query_len=t, max_context_len=t, query_start_loc_cpu=[0, t], context_lens_cpu=[t],
    )
    ids = torch.randint(0, config.vocab_size, (t,), device="cuda")
    pos = torch.arange(t, device="cuda")
    logits = []
    for m in models:
        cache = [(a.clone(), b.clone()) for a, b in kv]
        with torch.no_grad():
            logits.append(m.compute_logits(m(ids, pos, cache, meta)))
    torch.testing.assert_close(logits[1], logits[0], rtol=0.05, atol=0.1)


# --- q/k-norm + RoPE with the KV-cache write fused in ------------------------------------

def _fused_vs_two_kernels(dtype: torch.dtype, num_tokens: int, hq: int, hkv: int, d: int,
                          block_size: int, seed: int = 0, heads_per_warp: int = 0) -> None:
    """The fused launch against qk_norm_rope then reshape_and_cache on the same inputs:
    the same q and k in qkv, the same caches, bit for bit. Slots are scattered over
    the cache, about one token in eight is padding (-1); the caches start out random
    ("poisoned") and the slots nobody writes must keep those values."""
    dev = "cuda"
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = (2 * num_tokens + block_size - 1) // block_size + 1
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.125] = -1
    slots = slots.to(dev)
    rope = RotaryEmbedding(d, 4096, 1e6, device=dev)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(dev)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dev, dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, dtype)
    poison = torch.randn(2, num_blocks, block_size, hkv, d, generator=gen).to(dev, dtype)

    qkv_two, k_two, v_two = qkv.clone(), poison[0].clone(), poison[1].clone()
    layer_ops.qk_norm_rope(qkv_two, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6)
    _, k_new, v_new = qkv_two.split([hq * d, hkv * d, hkv * d], dim=-1)
    ops.reshape_and_cache(k_new.reshape(num_tokens, hkv, d), v_new.reshape(num_tokens, hkv, d),
                          k_two, v_two, slots)

    qkv_one, k_one, v_one = qkv.clone(), poison[0].clone(), poison[1].clone()
    layer_ops.qk_norm_rope(qkv_one, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6,
                           kv_cache=(k_one, v_one), slot_mapping=slots,
                           heads_per_warp=heads_per_warp)
    torch.cuda.synchronize()
    assert torch.equal(qkv_one, qkv_two)
    assert torch.equal(k_one, k_two)
    assert torch.equal(v_one, v_two)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=dev)
    untouched[slots[slots >= 0]] = False
    for cache, before in ((k_one, poison[0]), (v_one, poison[1])):
        assert torch.equal(cache.view(-1, hkv, d)[untouched], before.view(-1, hkv, d)[untouched])


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
@pytest.mark.parametrize("hq, hkv, d", [(16, 8, 128), (32, 8, 128), (8, 2, 64), (14, 2, 64)])
@pytest.mark.parametrize("heads_per_warp", [0, 2, 4])
def test_qk_norm_rope_writes_the_cache_like_reshape_and_cache(dtype, block_size, num_tokens,
                                                              hq, hkv, d, heads_per_warp):
    _fused_vs_two_kernels(dtype, num_tokens, hq, hkv, d, block_size, seed=num_tokens,
                          heads_per_warp=heads_per_warp)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, heads_per_warp", [(1023, 1), (1024, 2)])
def test_qk_norm_rope_takes_two_heads_a_warp_from_a_prefill_chunk(num_tokens, heads_per_warp):
    """The kernel's own choice: one head a warp below 1,024 tokens, two from there on
    (the last template argument of the kernel that runs, as the profiler names it)."""
    from torch.profiler import ProfilerActivity, profile

    dev, hq, hkv, d = "cuda", 16, 8, 128
    rope = RotaryEmbedding(d, 4096, 1e6, device=dev)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    w = torch.ones(d, device=dev, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (num_tokens,), device=dev)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        layer_ops.qk_norm_rope(qkv, w, w, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6)
        torch.cuda.synchronize()
    # e.g. "void mini_vllm::(anonymous namespace)::qk_norm_rope_kernel<__nv_bfloat16, 128,
    # false, false, 2>(...)": the template arguments, HPW last.
    args = {m.group(1) for e in prof.events()
            if (m := re.search(r"qk_norm_rope_kernel<([^>]*)>", e.name))}
    assert len(args) == 1, args
    assert args.pop().split(",")[-1].strip() == str(heads_per_warp)


@needs_kernels
@pytest.mark.gpu
def test_qk_norm_rope_with_cache_write_in_cuda_graph():
    """Captured once, replayed with new inputs and new slots (static buffers, as the
    engine's decode graphs do): every replay leaves what the two kernels leave eagerly."""
    dev, dtype, t, hq, hkv, d, block = "cuda", torch.bfloat16, 8, 16, 8, 128, 16
    rope = RotaryEmbedding(d, 4096, 1e6, device=dev)
    qw = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    kw = (1 + 0.1 * torch.randn(d, device=dev)).to(dtype)
    qkv_in = torch.empty(t, (hq + 2 * hkv) * d, device=dev, dtype=dtype)  # static inputs
    qkv = torch.empty_like(qkv_in)
    positions = torch.zeros(t, dtype=torch.int64, device=dev)
    slots = torch.full((t,), -1, dtype=torch.int64, device=dev)
    k_cache = torch.zeros(8, block, hkv, d, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)

    def step() -> None:
        qkv.copy_(qkv_in)  # the projection's output, in the model
        layer_ops.qk_norm_rope(qkv, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6,
                               kv_cache=(k_cache, v_cache), slot_mapping=slots)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as torch advises
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(3):
        qkv_in.copy_(torch.randn_like(qkv_in))
        positions.copy_(torch.randint(0, 4096, (t,), device=dev))
        new_slots = torch.randperm(8 * block, device=dev)[:t]
        new_slots[i] = -1  # a padding row
        slots.copy_(new_slots)
        k_cache.normal_()
        v_cache.normal_()
        k_ref, v_ref, qkv_ref = k_cache.clone(), v_cache.clone(), qkv_in.clone()
        graph.replay()
        layer_ops.qk_norm_rope(qkv_ref, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6)
        _, k_new, v_new = qkv_ref.split([hq * d, hkv * d, hkv * d], dim=-1)
        ops.reshape_and_cache(k_new.reshape(t, hkv, d), v_new.reshape(t, hkv, d), k_ref, v_ref,
                              slots)
        torch.cuda.synchronize()
        assert torch.equal(qkv, qkv_ref)
        assert torch.equal(k_cache, k_ref)
        assert torch.equal(v_cache, v_ref)


@needs_kernels
@pytest.mark.gpu
def test_model_cache_write_fusion_changes_no_bit(tiny_model_dir, monkeypatch):
    """A bf16 model on the CUDA attention backend, with the KV write in q/k-norm + RoPE
    and without (reshape_and_cache): a 12-token prefill and decode steps of one token
    give the same logits and the same caches, bit for bit."""
    from mini_vllm.checkpoint import make_model
    from mini_vllm.gpu.attention import CudaAttentionBackend

    path = make_model(tiny_model_dir.parent / "fusions-64", preset="tiny",
                      overrides={"head_dim": 64})
    config = ModelConfig.from_pretrained(path)
    dev, dtype, block, prompt_len, steps = "cuda", torch.bfloat16, 16, 12, 4
    backend = CudaAttentionBackend(dtype, config.head_dim, dev, use_kernels=True)
    model = _model(config, dev, dtype, path, backend)
    forward = prepare_forward(model, torch.device(dev), dtype)
    assert isinstance(forward, FusedDecoderForward)
    writes: list[int] = []
    write_kv_cache = backend.write_kv_cache

    def spy_write(*args: torch.Tensor) -> None:
        writes.append(args[0].shape[0])
        write_kv_cache(*args)

    monkeypatch.setattr(backend, "write_kv_cache", spy_write)

    def meta(start: int, count: int) -> AttentionMetadata:
        return _one_sequence_meta(start, count, dev)

    def generate() -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
        kv = [(torch.zeros(4, block, config.num_key_value_heads, config.head_dim, device=dev,
                           dtype=dtype),
               torch.zeros(4, block, config.num_key_value_heads, config.head_dim, device=dev,
                           dtype=dtype)) for _ in range(config.num_hidden_layers)]
        gen = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, config.vocab_size, (prompt_len,), generator=gen).to(dev)
        logits, start = [], 0
        with torch.no_grad():
            for _ in range(steps + 1):
                h = forward(ids, torch.arange(start, start + len(ids), device=dev), kv,
                            meta(start, len(ids)))
                logits.append(model.compute_logits(h))
                start += len(ids)
                ids = logits[-1][-1:].argmax(dim=-1)
        return logits, kv

    fused_logits, fused_kv = generate()
    assert not writes  # every layer's K/V went in with q/k-norm + RoPE
    monkeypatch.setattr(backend, "write_impl", "torch")  # no fused write: attention writes
    logits, kv = generate()
    assert writes == [prompt_len] * config.num_hidden_layers + [1] * (
        steps * config.num_hidden_layers)
    for got, want in zip(fused_logits, logits):
        assert torch.equal(got, want)
    for (k_got, v_got), (k_want, v_want) in zip(fused_kv, kv):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


# --- fused Gumbel-max sampling (ops.sample_tokens) ---------------------------------------

def _random_seeds(n: int, device: str = "cuda") -> torch.Tensor:
    return torch.randint(-(2**63), 2**63 - 1, (n, 2), device=device)


def test_philox_reference_matches_the_published_test_vectors():
    """Random123's known-answer tests for Philox4x32-10 (counter, key -> words)."""
    import numpy as np

    from mini_vllm.ops.sampling import philox4x32_ref

    cases = [
        ([0, 0, 0, 0], 0, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
        ([0xFFFFFFFF] * 4, 2**64 - 1, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
        ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0x299F31D0 << 32) | 0xA4093822,
         [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
    ]
    for counter, key, words in cases:
        out = philox4x32_ref(np.array([counter], dtype=np.uint64), key)[0]
        assert [int(w) for w in out] == words


def test_sample_tokens_rejects_bad_arguments():
    from mini_vllm.ops.sampling import sample_tokens

    logits, inv_t, seeds = torch.randn(2, 8), torch.ones(2), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="CUDA device"):
        sample_tokens(logits, inv_t, seeds)
    with pytest.raises(ValueError, match="seeds"):
        sample_tokens(logits, inv_t, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="inv_temperature: dtype"):
        sample_tokens(logits, inv_t.double(), seeds)
    with pytest.raises(ValueError, match="dense"):
        sample_tokens(torch.randn(8, 2).t(), inv_t, seeds)
    huge = torch.empty(2, 1024 * 4096 + 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="vocabulary of 4194305 tokens"):
        sample_tokens(huge, inv_t, seeds)


def _assert_shares_follow(freq: torch.Tensor, p: torch.Tensor, n: int, top: int) -> None:
    """Each chunk's share of `n` draws, and each of the `top` likeliest tokens', is
    within 5 sigma of its probability under `p` (the chunks of the sampling kernel)."""
    from mini_vllm.ops.sampling import SAMPLE_CHUNK

    chunks = [slice(c, c + SAMPLE_CHUNK) for c in range(0, len(p), SAMPLE_CHUNK)]
    tokens = [slice(int(i), int(i) + 1) for i in p.argsort(descending=True)[:top]]
    for g in chunks + tokens:
        q, f = p[g].sum(), freq[g].sum()
        assert abs(f - q) <= 5 * (q * (1 - q) / n).sqrt() + 1e-6, (g, f, q)


def test_sample_reference_follows_softmax_across_chunks():
    """The reference's two races draw softmax(logits / T): per chunk and per likely token."""
    from mini_vllm.ops.sampling import SAMPLE_CHUNK, sample_ref

    torch.manual_seed(0)
    vocab, n, temperature = 2 * SAMPLE_CHUNK + 8, 3000, 0.7
    logits = torch.randn(vocab) * 2
    logits[SAMPLE_CHUNK + 10: SAMPLE_CHUNK + 14] += 6  # most of the mass in chunk 1
    logits[-3:] += 7  # and a share in the short last chunk
    seeds = torch.stack([torch.full((n,), 12345, dtype=torch.int64), torch.arange(n)], 1)
    tokens, _ = sample_ref(logits.expand(n, vocab), torch.full((n,), 1 / temperature), seeds)
    p = (logits.double() / temperature).softmax(0)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    _assert_shares_follow(freq, p, n, top=6)


@needs_kernels
@pytest.mark.gpu
def test_sample_chunk_matches_the_kernel():
    from mini_vllm.ops._extension import extension
    from mini_vllm.ops.sampling import SAMPLE_CHUNK

    assert extension().sample_chunk() == SAMPLE_CHUNK


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 4096, 4097, 151936])
def test_sample_tokens_picks_the_reference_token(dtype, vocab):
    """The kernel's token is the float64 reference's (same races, same Philox words)."""
    from mini_vllm.ops.sampling import sample_ref

    torch.manual_seed(vocab)
    n = 12
    logits = (torch.randn(n, vocab, device="cuda") * 3).to(dtype)
    logits[1, : vocab // 2] = -float("inf")  # filtered tokens
    logits[2, ::3] = float("nan")  # never drawn
    logits[5] = -float("inf")  # nothing to draw: token 0
    inv_t = torch.rand(n, device="cuda") * 2 + 0.2
    inv_t[::4] = 0  # greedy rows
    seeds = _random_seeds(n)
    out = ops.sample_tokens(logits, inv_t, seeds)
    expected, margins = sample_ref(logits, inv_t, seeds)
    # A near tie in either race of a sampled row: float32 rounding may pick either.
    # (Greedy rows have exact ties, and both keep the first.)
    close = (margins < 1e-4) & (inv_t.cpu() != 0)
    assert close.sum() <= 2
    assert torch.equal(out.cpu()[~close], expected[~close])
    assert out[5].item() == 0
    if vocab > 1:
        assert torch.isnan(logits[2, out[2]]).logical_not().item()
    greedy = (inv_t == 0) & ~torch.isnan(logits).any(dim=1)
    assert torch.equal(out[greedy], logits[greedy].float().argmax(dim=1))


@needs_kernels
@pytest.mark.gpu
def test_sample_tokens_greedy_keeps_the_first_maximum_across_chunks():
    from mini_vllm.ops.sampling import SAMPLE_CHUNK

    logits = torch.zeros(2, 3 * SAMPLE_CHUNK, device="cuda", dtype=torch.bfloat16)
    logits[:, [SAMPLE_CHUNK + 5, 2 * SAMPLE_CHUNK + 1, SAMPLE_CHUNK + 9]] = 3.0
    out = ops.sample_tokens(logits, torch.zeros(2, device="cuda"), _random_seeds(2))
    assert out.tolist() == [SAMPLE_CHUNK + 5] * 2


@needs_kernels
@pytest.mark.gpu
def test_sample_tokens_follows_softmax_across_chunks():
    """200,000 draws over three chunks: each chunk's share and each likely token's."""
    from mini_vllm.ops.sampling import SAMPLE_CHUNK

    torch.manual_seed(3)
    vocab, n, temperature = 2 * SAMPLE_CHUNK + 100, 200_000, 0.6
    logits = torch.randn(vocab, device="cuda") * 1.5
    logits[SAMPLE_CHUNK + 7] += 5
    logits[2 * SAMPLE_CHUNK + 50] += 6  # the short last chunk
    logits[100:110] = -float("inf")
    seeds = _random_seeds(1).expand(n, 2).clone()
    seeds[:, 1] = torch.arange(n, device="cuda")
    tokens = ops.sample_tokens(logits.bfloat16().expand(n, vocab),
                               torch.full((n,), 1 / temperature, device="cuda"), seeds)
    p = (logits.bfloat16().double() / temperature).softmax(0).cpu()
    freq = torch.bincount(tokens, minlength=vocab).double().cpu() / n
    assert freq[100:110].sum() == 0
    _assert_shares_follow(freq, p, n, top=20)


@needs_kernels
@pytest.mark.gpu
def test_sample_tokens_follows_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.randn(16, device="cuda") * 1.5
    logits[3] = -float("inf")  # filtered out: never drawn
    n, temperature = 200_000, 0.7
    seeds = _random_seeds(1).expand(n, 2).clone()
    seeds[:, 1] = torch.arange(n, device="cuda")  # one key, one counter per draw
    inv_t = torch.full((n,), 1 / temperature, device="cuda")
    tokens = ops.sample_tokens(logits.expand(n, 16), inv_t, seeds)
    freq = torch.bincount(tokens, minlength=16).double() / n
    p = (logits.double() / temperature).softmax(0)
    assert freq[3] == 0
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-6).all(), (freq, p)


@needs_kernels
@pytest.mark.gpu
def test_sample_tokens_tail_on_a_full_vocabulary():
    """One token at +20 among 151,936: p = 0.99969, so ~6 of 20,000 draws miss it.

    A Gumbel noise that overflows to +inf (a log of a uniform rounded to 1)
    would hand thousands of draws to random tokens.
    """
    logits = torch.zeros(151936, device="cuda", dtype=torch.bfloat16)
    logits[777] = 20.0
    n = 20_000
    misses = (ops.sample_tokens(logits.expand(n, -1), torch.ones(n, device="cuda"),
                                _random_seeds(n)) != 777).sum().item()
    expected = n * (1 - logits.double().softmax(0)[777].item())
    assert misses <= expected + 6 * expected**0.5 + 1


@needs_kernels
@pytest.mark.gpu
def test_sample_tokens_is_a_function_of_each_rows_seed():
    logits = torch.randn(64, 151936, device="cuda", dtype=torch.bfloat16)
    seeds, inv_t = _random_seeds(64), torch.ones(64, device="cuda")
    a = ops.sample_tokens(logits, inv_t, seeds)
    perm = torch.randperm(64, device="cuda")
    b = ops.sample_tokens(logits[perm], inv_t[perm], seeds[perm])
    assert torch.equal(a[perm], b)  # a row's token does not depend on the others
    assert torch.equal(a, ops.sample_tokens(logits, inv_t, seeds))  # and is reproducible
    assert ((a >= 0) & (a < 151936)).all()
    peaked = logits.clone()
    peaked[:, 1234] = 1e4
    assert (ops.sample_tokens(peaked, inv_t, seeds) == 1234).all()


@needs_kernels
@pytest.mark.gpu
def test_sampler_on_gpu_keeps_seeds_independent_of_the_batch():
    from mini_vllm.gpu.sampler import FusedSampler, FusedSamplingMetadata
    from mini_vllm.sampling_metadata import make_generator
    from mini_vllm.sampling_params import SamplingParams

    logits = torch.randn(5, 1000, device="cuda", dtype=torch.bfloat16)

    def draw(rows, num_outputs=0):
        reqs = [(SamplingParams(temperature=0.9, top_p=1.0, top_k=0, min_p=0.0, seed=s),
                 None if s is None else make_generator(s, "cuda"), [1], [5] * num_outputs)
                for s in rows]
        meta = FusedSamplingMetadata.build(reqs, "cuda", 1000)
        assert meta.noise_seeds is not None  # the fused kernel draws
        return FusedSampler()(logits[: len(rows)], meta).sampled_token_ids.tolist()

    alone = draw([42])[0]
    logits[3] = logits[0]  # the same request, now fourth in a batch of four
    assert draw([None, 7, None, 42])[3] == alone
    # The next token of the same request draws fresh noise (the counter moved on).
    draws = {draw([42], num_outputs=k)[0] for k in range(20)}
    assert len(draws) > 1


@needs_kernels
@pytest.mark.gpu
def test_sampler_fused_and_torch_paths_agree_in_distribution():
    """Penalties and min_tokens go through float32 first, then the same kernel."""
    from mini_vllm.gpu.sampler import FusedSampler, FusedSamplingMetadata
    from mini_vllm.sampling_params import SamplingParams

    torch.manual_seed(1)
    vocab, n = 8, 40_000
    logits = torch.randn(vocab, device="cuda").expand(n, vocab).contiguous()
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0,
                            presence_penalty=0.5)
    meta = FusedSamplingMetadata.build([(params, None, [1], [2])] * n, "cuda", vocab)
    assert meta.noise_seeds is not None and meta.output_token_counts is not None
    tokens = FusedSampler()(logits, meta).sampled_token_ids
    expected = logits[0].double()
    expected[2] -= 0.5  # token 2 is in the output: the presence penalty
    p = (expected / 0.8).softmax(0)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-6).all(), (freq, p)


# --- the norms folded into the weights ----------------------------------------------------

def _decode_logits(model: Qwen3ForCausalLM, config: ModelConfig, device: str,
                   dtype: torch.dtype, prompt_len: int = 12, steps: int = 3,
                   forward=None) -> list[torch.Tensor]:
    """A prompt, then `steps` decodes of one sequence in blocks 1 and 2, every model fed
    the same tokens (drawn, not sampled: models that round differently must not drift
    apart): every step's logits, in float32. `forward`: the model's (default) or one
    the GPU runner would run (`FusedDecoderForward`)."""
    forward = forward or model
    block = 16
    shape = (4, block, config.num_key_value_heads, config.head_dim)
    kv = [(torch.zeros(shape, device=device, dtype=dtype),
           torch.zeros(shape, device=device, dtype=dtype))
          for _ in range(config.num_hidden_layers)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (prompt_len + steps,), generator=gen).to(device)
    logits, start = [], 0
    with torch.no_grad():
        for count in [prompt_len] + [1] * steps:
            ids = tokens[start:start + count]
            h = forward(ids, torch.arange(start, start + count, device=device), kv,
                        _one_sequence_meta(start, count, device))
            logits.append(model.compute_logits(h))
            start += count
    return logits


def test_folded_norms_compute_the_same_model(tiny_model_dir):
    """float32 on the CPU (the torch references of the kernels): the layer with its two
    norms folded into qkv_proj / gate_up_proj and o_proj / down_proj adding into the
    residual gives the unfolded model's logits, prefill and decodes; after folding, the
    model's own forward still computes the same function."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    want = _decode_logits(_model(config, "cpu", torch.float32, tiny_model_dir), config, "cpu",
                          torch.float32)
    model = _model(config, "cpu", torch.float32, tiny_model_dir)
    folded = FusedDecoderForward(model, kernels=False)
    for forward in (folded, model):
        got = _decode_logits(model, config, "cpu", torch.float32, forward=forward)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_folding_moves_the_norm_weights_into_the_products(tiny_model_dir):
    """`W <- W * diag(g)` and `g <- 1`: folding twice changes nothing more."""
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = _model(config, "cpu", torch.float32, tiny_model_dir)
    layer = model.model.layers[0]
    w, g = layer.self_attn.qkv_proj.weight.clone(), layer.input_layernorm.weight.clone()
    w2, g2 = layer.mlp.gate_up_proj.weight.clone(), layer.post_attention_layernorm.weight.clone()
    assert not torch.equal(g, torch.ones_like(g))
    fold_norm_weights(layer)
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, w * g)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, w2 * g2)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(g))
    fold_norm_weights(layer)
    torch.testing.assert_close(layer.self_attn.qkv_proj.weight, w * g)


def test_scale_rows_ref_is_the_norm_without_its_weight():
    r, x = torch.randn(6, 64) * 3, torch.randn(6, 40)
    inv = 1 / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(layer_ops.scale_rows_ref(x, r, 1e-6), x * inv)


def test_scaled_wrappers_reject_a_bad_residual():
    bf16 = {"dtype": torch.bfloat16}
    x = torch.randn(4, 64, **bf16)
    with pytest.raises(ValueError, match="residual has 3 rows for 4 tokens"):
        layer_ops.silu_and_mul(x, torch.randn(3, 64, **bf16))
    with pytest.raises(ValueError, match="residual: dtype float32"):
        layer_ops.silu_and_mul(x, torch.randn(4, 64))
    with pytest.raises(ValueError, match="multiple of 8"):
        layer_ops.silu_and_mul(x, torch.randn(4, 60, **bf16))
    t, hq, hkv, d = 3, 4, 2, 64
    with pytest.raises(ValueError, match="residual has 2 rows for 3 tokens"):
        layer_ops.qk_norm_rope(torch.randn(t, (hq + 2 * hkv) * d, **bf16),
                               torch.ones(d, **bf16), torch.ones(d, **bf16),
                               torch.randn(16, d), torch.zeros(t, dtype=torch.int64),
                               hq, hkv, d, 1e-6, residual=torch.randn(2, 64, **bf16))


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hq, hkv, d, hidden", [
    (1, 16, 8, 128, 1024), (300, 16, 8, 128, 1024), (17, 32, 8, 128, 4096), (9, 8, 2, 64, 136),
    (5, 40, 8, 128, 5120), (1100, 16, 8, 128, 1024), (4, 14, 2, 64, 128)])
@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("heads_per_warp", [0, 1, 2, 4])
def test_qk_norm_rope_scaled_matches_reference(dtype, num_tokens, hq, hkv, d, hidden,
                                               with_cache, heads_per_warp):
    """`residual=`: q, k and v scaled by each token's 1 / rms(residual) first (v in
    qkv and in the cache), then q/k-norm + RoPE: against scale_rows_ref + the
    reference; the cache slots of padding tokens and of nobody keep their poison.
    Every split of a token's heads among warps (0: the kernel's choice, which
    takes two heads a warp at 1,100 tokens), the last warp's share partly past
    the last head where the warps do not divide the heads (10 heads of 64 at four
    a warp), q and k heads in one warp (14 + 2 at four a warp)."""
    dev, block = "cuda", 16
    gen = torch.Generator(device="cpu").manual_seed(num_tokens)
    rope = RotaryEmbedding(d, 4096, 1e6, device=dev)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen).to(dev)
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=gen).to(dev, dtype)
    residual = (torch.randn(num_tokens, hidden, generator=gen) * 5).to(dev, dtype)
    qw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, dtype)
    kw = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, dtype)

    scaled = layer_ops.scale_rows_ref(qkv, residual, 1e-6)
    q, k, v = scaled.split([hq * d, hkv * d, hkv * d], dim=-1)
    ref_q, ref_k = layer_ops.qk_norm_rope_ref(q.reshape(-1, hq, d), k.reshape(-1, hkv, d), qw,
                                              kw, rope.cos_sin_cache, positions, 1e-6)
    cache_args, poison, slots = {}, None, None
    if with_cache:
        num_blocks = (2 * num_tokens + block - 1) // block + 1
        slots = torch.randperm(num_blocks * block, generator=gen)[:num_tokens]
        slots[torch.rand(num_tokens, generator=gen) < 0.125] = -1
        slots = slots.to(dev)
        poison = torch.randn(2, num_blocks, block, hkv, d, generator=gen).to(dev, dtype)
        caches = (poison[0].clone(), poison[1].clone())
        cache_args = {"kv_cache": caches, "slot_mapping": slots}
    out = qkv.clone()
    layer_ops.qk_norm_rope(out, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6,
                           residual=residual, residual_eps=1e-6, heads_per_warp=heads_per_warp,
                           **cache_args)
    out_q, out_k, out_v = out.split([hq * d, hkv * d, hkv * d], dim=-1)
    _close(out_q.reshape(-1, hq, d), ref_q)
    _close(out_k.reshape(-1, hkv, d), ref_k)
    _close(out_v, v)
    if with_cache:
        k_cache, v_cache = caches
        real = slots >= 0
        assert torch.equal(k_cache.view(-1, hkv, d)[slots[real]], out_k.reshape(-1, hkv, d)[real])
        assert torch.equal(v_cache.view(-1, hkv, d)[slots[real]], out_v.reshape(-1, hkv, d)[real])
        untouched = torch.ones(poison[0].numel() // (hkv * d), dtype=torch.bool, device=dev)
        untouched[slots[real]] = False
        for cache, before in zip(caches, poison):
            assert torch.equal(cache.view(-1, hkv, d)[untouched],
                               before.view(-1, hkv, d)[untouched])


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, d, hidden", [(1, 3072, 1024), (255, 3072, 1024),
                                                   (8, 1024 + 8, 72), (3, 12288, 4096),
                                                   (1100, 3072, 1024)])
def test_silu_and_mul_scaled_matches_reference(dtype, num_tokens, d, hidden):
    x = torch.randn(num_tokens, 2 * d, device="cuda", dtype=dtype) * 4
    residual = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype) * 3
    want = layer_ops.silu_and_mul_ref(layer_ops.scale_rows_ref(x, residual, 1e-6))
    _close(layer_ops.silu_and_mul(x, residual, 1e-6), want)


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("prompt_len", [12, 20])  # gemv rows (<= 16), cuBLAS rows
def test_folding_the_norms_costs_no_accuracy(tiny_model_dir, prompt_len):
    """bf16 on the GPU with the kernels, folded and not, against the same model in float32:
    folding moves where a bf16 model rounds (about 1 % of the logits here, as much as bf16
    itself does), so the test is that the folded model is as close to float32 as the
    unfolded one, prefill (gemv or cuBLAS rows) and decodes (gemv)."""
    from mini_vllm.checkpoint import make_model

    path = make_model(tiny_model_dir.parent / "folded-64", preset="tiny",
                      overrides={"head_dim": 64})
    config = ModelConfig.from_pretrained(path)
    ref = _model(config, "cuda", torch.float32, path)
    want = torch.cat(_decode_logits(ref, config, "cuda", torch.float32, prompt_len)).double()
    errors = {}
    for fold in (False, True):
        model = _model(config, "cuda", torch.bfloat16, path)
        assert layer_kernels_usable(config, "cuda", torch.bfloat16)
        forward = FusedDecoderForward(model, kernels=True) if fold else model
        got = torch.cat(_decode_logits(model, config, "cuda", torch.bfloat16, prompt_len,
                                       forward=forward))
        assert not got.isnan().any()
        errors[fold] = ((got.double() - want).norm() / want.norm()).item()
    assert errors[False] < 0.05, errors
    assert errors[True] <= 1.5 * errors[False], errors


@needs_kernels
@pytest.mark.gpu
def test_the_fused_benchmark_times_both_kernels():
    """`benchmarks/kernels.py --tables fused` runs both kernels as the model calls them (and
    q/k-norm + RoPE at each forced number of heads per warp), and reports each call's
    bytes over its time, a plausible share of the copy bandwidth."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
    spec = importlib.util.spec_from_file_location("_fused_kernels_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    device = torch.device("cuda")
    copy_bw = bench.copy_bandwidth(device, 256 * 2**20)
    rows = bench.bench_fused(copy_bw, device, tokens=(1, 300))
    assert [r["tokens"] for r in rows] == [1, 300]
    for r in rows:
        assert set(r["paths"]) == {"qk_norm_rope", "qk_norm_rope_h1", "qk_norm_rope_h2",
                                   "qk_norm_rope_h4", "silu_and_mul"}
        for p in r["paths"].values():
            assert p["us"] > 0 and 0 < p["frac_copy"] < 2, p
