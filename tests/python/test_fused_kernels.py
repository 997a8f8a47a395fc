"""Phase 9: the fused layer kernels (norms, q/k-norm + RoPE, SiLU·mul) against their references."""

from __future__ import annotations

import pytest
import torch

from mini_vllm import ops
from mini_vllm.config import ModelConfig
from mini_vllm.models.qwen3 import Qwen3ForCausalLM, RotaryEmbedding
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
    with pytest.raises(ValueError, match="head_dim"):
        layer_ops.qk_norm_rope(torch.randn(2, 4 * 32, dtype=torch.bfloat16),
                               torch.ones(32, dtype=torch.bfloat16),
                               torch.ones(32, dtype=torch.bfloat16), torch.randn(8, 32),
                               torch.zeros(2, dtype=torch.int64), 2, 1, 32, 1e-6)


def test_model_uses_kernels_only_where_they_run(tiny_model_dir):
    config = ModelConfig.from_pretrained(tiny_model_dir)
    model = Qwen3ForCausalLM(config, device="cpu", dtype=torch.float32)
    assert not model.model.use_kernels  # no GPU, float32, head_dim 32


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
                                                    (17, 32, 8, 128), (9, 8, 2, 64)])
def test_qk_norm_rope_matches_reference(dtype, num_tokens, hq, hkv, d):
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
    layer_ops.qk_norm_rope(qkv, qw, kw, rope.cos_sin_cache, positions, hq, hkv, d, 1e-6)
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
    """The same bf16 model, fused kernels on and off: the same logits to bf16 rounding."""
    from mini_vllm.attention import AttentionMetadata
    from mini_vllm.checkpoint import make_model
    from mini_vllm.models.loader import load_weights

    path = make_model(tiny_model_dir.parent / "kernels-64", preset="tiny",
                      overrides={"head_dim": 64})
    config = ModelConfig.from_pretrained(path)
    models = []
    for use in (False, True):
        m = Qwen3ForCausalLM(config, device="cuda", dtype=torch.bfloat16, use_kernels=use)
        load_weights(m, path)
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
