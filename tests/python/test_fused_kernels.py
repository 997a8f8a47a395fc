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


@needs_kernels
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 151936])
def test_sample_tokens_picks_the_reference_argmax(dtype, vocab):
    """The kernel's token is the argmax of the reference's float64 scores (same Philox words)."""
    from mini_vllm.ops.sampling import sample_scores_ref

    torch.manual_seed(vocab)
    n = 12
    logits = (torch.randn(n, vocab, device="cuda") * 3).to(dtype)
    logits[1, : vocab // 2] = -float("inf")  # filtered tokens
    inv_t = torch.rand(n, device="cuda") * 2 + 0.2
    inv_t[::4] = 0  # greedy rows
    seeds = _random_seeds(n)
    out = ops.sample_tokens(logits, inv_t, seeds)
    scores = sample_scores_ref(logits, inv_t, seeds)
    top2 = scores.topk(min(2, vocab), dim=1).values
    for r in range(n):
        if vocab > 1 and top2[r, 0] - top2[r, 1] < 1e-4:
            continue  # a near tie: float32 rounding may pick either
        assert out[r].item() == scores[r].argmax().item(), r
    greedy = inv_t == 0
    assert torch.equal(out[greedy], logits[greedy].float().argmax(dim=1))


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
    from mini_vllm.sampler import Sampler, SamplingMetadata, make_generator
    from mini_vllm.sampling_params import SamplingParams

    logits = torch.randn(5, 1000, device="cuda", dtype=torch.bfloat16)

    def draw(rows, num_outputs=0):
        reqs = [(SamplingParams(temperature=0.9, top_p=1.0, top_k=0, min_p=0.0, seed=s),
                 None if s is None else make_generator(s, "cuda"), [1], [5] * num_outputs)
                for s in rows]
        meta = SamplingMetadata.build(reqs, "cuda", 1000)
        assert meta.noise_seeds is not None  # the fused kernel draws
        return Sampler()(logits[: len(rows)], meta).sampled_token_ids.tolist()

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
    from mini_vllm.sampler import Sampler, SamplingMetadata
    from mini_vllm.sampling_params import SamplingParams

    torch.manual_seed(1)
    vocab, n = 8, 40_000
    logits = torch.randn(vocab, device="cuda").expand(n, vocab).contiguous()
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0,
                            presence_penalty=0.5)
    meta = SamplingMetadata.build([(params, None, [1], [2])] * n, "cuda", vocab)
    assert meta.noise_seeds is not None and meta.output_token_counts is not None
    tokens = Sampler()(logits, meta).sampled_token_ids
    expected = logits[0].double()
    expected[2] -= 0.5  # token 2 is in the output: the presence penalty
    p = (expected / 0.8).softmax(0)
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    sigma = (p * (1 - p) / n).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-6).all(), (freq, p)
