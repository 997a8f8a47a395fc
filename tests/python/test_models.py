"""More models: every family proven against Hugging Face's on the same checkpoint.

Each family's tiny preset (`mini_vllm/models/presets.py`) is written once; ours and
`transformers`' model read the same files. In the phase 2 style: float32 logits of
a mixed flat batch (prompts, a chunked prompt, decodes) against the transformers
model, 32-token greedy continuations identical, and the same through the whole
engine with a block pool small enough to preempt and prompts that share a prefix.
Then what only some families have: the registry and each family's config fields,
GPT-2's transposed weights, the experts, RoPE scalings, the sliding window, the
tokenizers in each family's style and their chat templates. The tests marked `gpu`
run every family on the GPU runner (skipped without CUDA).
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_phase2 import Blocks, all_logits, hf_greedy, hf_logits, random_prompts
from test_phase9_gpu import hf_logits_of_mixed_steps, run_mixed_steps

from mini_vllm import LLM, SamplingParams, ops
from mini_vllm.checkpoint import make_model
from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.gpu.attention import CudaAttentionBackend, check_sliding_window
from mini_vllm.gpu.cuda_graphs import PiecewiseGraphRunner
from mini_vllm.gpu.fused_layers import FusedDecoderForward, attention_kind, foldable, mlp_kind
from mini_vllm.gpu.model_runner import GPUModelRunner
from mini_vllm.layers import FusedMoE, get_rope
from mini_vllm.model_config import ModelConfig
from mini_vllm.model_runner import BatchEntry, ModelRunner
from mini_vllm.models import get_model_class, load_model, supported_architectures
from mini_vllm.models.presets import FAMILY_PRESETS
from mini_vllm.tokenizer import IncrementalDetokenizer, NoChatTemplateError, Tokenizer

pytestmark = pytest.mark.models

FAMILIES = ["tiny-llama3", "tiny-llama3-tied", "tiny-mistral", "tiny-qwen2", "tiny-gpt2",
            "tiny-qwen3-moe", "tiny-qwen3-yarn"]
ARCHITECTURES = {
    "tiny-llama3": "LlamaForCausalLM", "tiny-llama3-tied": "LlamaForCausalLM",
    "tiny-mistral": "MistralForCausalLM", "tiny-qwen2": "Qwen2ForCausalLM",
    "tiny-gpt2": "GPT2LMHeadModel", "tiny-qwen3-moe": "Qwen3MoeForCausalLM",
    "tiny-qwen3-yarn": "Qwen3ForCausalLM",
}
TOL = {"rtol": 1e-5, "atol": 1e-4}
BLOCK_SIZE = 4
NUM_BLOCKS = 160


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny family's checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("families")
    return {name: root / name for name in FAMILIES}


def family_dir(dirs: dict[str, Path], name: str) -> Path:
    if not (dirs[name] / "config.json").is_file():
        make_model(dirs[name], preset=name, seed=7)
    return dirs[name]


_HF_MODELS: dict[Path, transformers.PreTrainedModel] = {}


def hf_model_of(model_dir: Path) -> transformers.PreTrainedModel:
    """transformers' model of a checkpoint, in float32 (loaded once per run)."""
    if model_dir not in _HF_MODELS:
        _HF_MODELS[model_dir] = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return _HF_MODELS[model_dir]


def engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    args = {"model": str(model_dir), "device": "cpu", "dtype": "float32",
            "block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS,
            "max_model_len": 200, "max_num_seqs": 8}
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


# ------------------------------------------------------------ against transformers


@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_flat_batch_logits_match_transformers(family_dirs, name: str) -> None:
    """Step 1: A's prompt and B's first chunk; step 2: A decodes, B finishes, C prefills.
    Sequences are longer than Mistral's window of 16, so the window binds."""
    model_dir = family_dir(family_dirs, name)
    hf_model = hf_model_of(model_dir)
    runner = ModelRunner(engine_config(model_dir))
    assert type(runner.model).__name__ == ARCHITECTURES[name]
    a, b, c = random_prompts([19, 33, 24], runner.vocab_size, seed=4)
    blocks = Blocks(shuffle=True, seed=4)
    ta, tb, tc = blocks.table(len(a) + 1), blocks.table(len(b)), blocks.table(len(c))
    step1 = all_logits(runner, [BatchEntry(a[:-1], 0, ta), BatchEntry(b[:14], 0, tb, False)])
    expected1 = torch.cat([hf_logits(hf_model, a)[:-1], hf_logits(hf_model, b)[:14]])
    torch.testing.assert_close(step1, expected1, **TOL)
    entries = [BatchEntry(a[-1:], len(a) - 1, ta), BatchEntry(b[14:], 14, tb),
               BatchEntry(c, 0, tc)]
    expected2 = torch.cat([hf_logits(hf_model, a)[-1:], hf_logits(hf_model, b)[14:],
                           hf_logits(hf_model, c)])
    torch.testing.assert_close(all_logits(runner, entries), expected2, **TOL)


# (The tied Llama differs from the untied one only in its head, which the test above checks.)
@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "tiny-llama3-tied"])
def test_greedy_continuations_match_transformers(family_dirs, name: str) -> None:
    model_dir = family_dir(family_dirs, name)
    hf_model = hf_model_of(model_dir)
    runner = ModelRunner(engine_config(model_dir))
    prompts = random_prompts([4, 21, 2], runner.vocab_size, seed=5)
    num_new = 32
    blocks = Blocks(shuffle=False)
    tables = [blocks.table(len(p) + num_new) for p in prompts]
    seqs = [list(p) for p in prompts]
    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables)])
    for _ in range(num_new):
        entries = []
        for s, t, tok in zip(seqs, tables, logits.argmax(-1).tolist()):
            entries.append(BatchEntry([tok], len(s), t))
            s.append(tok)
        logits = runner.execute(entries)
    for prompt, ours in zip(prompts, seqs):
        assert ours == hf_greedy(hf_model, prompt, num_new)


@pytest.mark.parametrize("name", [f for f in FAMILIES if f != "tiny-llama3-tied"])
def test_engine_with_paging_preemption_and_prefix_caching_matches_transformers(
        family_dirs, name: str) -> None:
    """Four requests of 26-30 tokens sharing a 16-token prefix, 32 greedy tokens each,
    in a pool of 40 blocks of 4 (each needs 15 at its end): preempted and resumed,
    prefixes found in the cache, every output still transformers' greedy one."""
    model_dir = family_dir(family_dirs, name)
    hf_model = hf_model_of(model_dir)
    vocab = ModelConfig.from_pretrained(model_dir).vocab_size
    (prefix,) = random_prompts([16], vocab, seed=11)
    prompts = [prefix + tail for tail in random_prompts([10, 14, 11, 13], vocab, seed=12)]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", block_size=BLOCK_SIZE,
              num_gpu_blocks_override=40, max_model_len=128, max_num_seqs=4,
              enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)[len(prompt):]
    stats = llm.engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] >= 3 * 16  # every request after the first
    mgr = llm.engine.kv_cache_manager
    assert mgr.num_free_blocks == mgr.num_blocks


# ------------------------------------------------------------ registry and configs


def test_registry_maps_each_architecture_to_its_class(family_dirs) -> None:
    assert supported_architectures() == sorted(set(ARCHITECTURES.values()))
    for name, arch in ARCHITECTURES.items():
        config = FAMILY_PRESETS[name].config
        assert ModelConfig.from_dict(dict(config)).architecture == arch
        assert get_model_class(arch).__name__ == arch


def test_an_unsupported_architecture_is_one_line_naming_the_supported_ones(
        tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        ModelConfig.from_dict({"architectures": ["PhiForCausalLM"], "model_type": "phi"})
    message = str(err.value)
    assert "\n" not in message and "PhiForCausalLM" in message
    assert all(arch in message for arch in supported_architectures())
    # A checkpoint directory gives the same error through the engine.
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GemmaForCausalLM"]}))
    with pytest.raises(ValueError, match="GemmaForCausalLM.*supported: GPT2LMHeadModel"):
        EngineArgs(model=str(tmp_path), device="cpu").create_engine_config()


def test_config_reads_each_familys_own_field_names() -> None:
    gpt2 = ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "vocab_size": 100,
                                  "n_embd": 64, "n_layer": 2, "n_head": 4})
    assert (gpt2.hidden_size, gpt2.num_hidden_layers, gpt2.num_attention_heads) == (64, 2, 4)
    assert (gpt2.num_key_value_heads, gpt2.head_dim, gpt2.intermediate_size) == (4, 16, 256)
    assert (gpt2.max_position_embeddings, gpt2.tie_word_embeddings) == (1024, True)
    assert gpt2.hidden_act == "gelu_new" and gpt2.layer_norm_epsilon == 1e-5
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 4, "num_attention_heads": 4}
    # Mistral: a window of 4,096 unless the config says otherwise, on every layer.
    mistral = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"]})
    assert mistral.sliding_window == 4096 and mistral.layer_sliding_window(3) == 4096
    no_window = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"],
                                       "sliding_window": None})
    assert no_window.layer_sliding_window(0) is None
    # Qwen2: a window only with use_sliding_window, from max_window_layers on.
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32}
    assert ModelConfig.from_dict(qwen2).layer_sliding_window(3) is None
    windowed = ModelConfig.from_dict({**qwen2, "use_sliding_window": True,
                                      "max_window_layers": 2})
    assert [windowed.layer_sliding_window(i) for i in range(4)] == [None, None, 32, 32]
    # Llama: head_dim from hidden / heads, rope_theta 10,000 by default.
    llama = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"]})
    assert (llama.head_dim, llama.rope_theta, llama.rope_scaling) == (16, 10_000.0, None)
    # transformers 5 writes rope_parameters; older files rope_theta + rope_scaling.
    new = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"],
                                 "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5,
                                                     "factor": 8.0}})
    old = ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"],
                                 "rope_theta": 5e5,
                                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert new == old and new.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ValueError, match="rope type 'longrope' is not supported"):
        ModelConfig.from_dict({**base, "rope_scaling": {"type": "longrope", "factor": 2}})
    moe = {**base, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [0],
           "decoder_sparse_step": 2}
    assert [ModelConfig.from_dict(moe).is_moe_layer(i) for i in range(4)] == [
        False, True, False, True]
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..4"):
        ModelConfig.from_dict({**moe, "num_experts_per_tok": 5})
    with pytest.raises(ValueError, match=r"missing required fields \['n_head'\]"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10,
                               "n_embd": 8, "n_layer": 1})


def test_configs_as_transformers_rewrites_them_read_the_same(family_dirs, tmp_path) -> None:
    """transformers 5 saves `rope_parameters`, `layer_types` ...: read back, same shape."""
    for name in FAMILIES:
        source = family_dir(family_dirs, name)
        transformers.AutoConfig.from_pretrained(source).save_pretrained(tmp_path / name)
        ours = ModelConfig.from_pretrained(source)
        again = ModelConfig.from_pretrained(tmp_path / name)
        assert again == ours, name


def test_real_shape_presets_have_the_real_models_sizes(tmp_path: Path) -> None:
    """Parameter counts of the benchmark presets (no weights written), as
    transformers counts them on its meta device."""
    expected = {"llama3-8b": (8.0e9, 8.1e9), "qwen2.5-7b": (7.6e9, 7.7e9),
                "mistral-7b": (7.2e9, 7.3e9), "gpt2-xl": (1.55e9, 1.56e9),
                "qwen3-30b-a3b": (30.4e9, 30.6e9)}
    for name, (lo, hi) in expected.items():
        out = make_model(tmp_path / name, preset=name, weights=False)
        config = ModelConfig.from_pretrained(out)
        assert config.architecture == FAMILY_PRESETS[name].config["architectures"][0]
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.from_pretrained(out))
        n = sum(p.numel() for p in hf.parameters())
        assert lo < n < hi, (name, n)
        assert Tokenizer.from_pretrained(out).vocab_size <= config.vocab_size


# ------------------------------------------------------------ loading


def test_gpt2_conv1d_weights_are_transposed_and_unprefixed_checkpoints_load(
        family_dirs, tmp_path: Path) -> None:
    model_dir = family_dir(family_dirs, "tiny-gpt2")
    model = load_model(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    stored = tensors["transformer.h.1.attn.c_attn.weight"]  # [in, out]
    assert stored.shape == (64, 192)
    assert torch.equal(model.transformer.h[1].attn.c_attn.weight, stored.t())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    # The original upload: no `transformer.` prefix, and the causal-mask buffers.
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    bare["h.0.attn.bias"] = torch.ones(1, 1, 256, 256)
    (tmp_path / "bare").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "bare" / "config.json")
    save_file(bare, str(tmp_path / "bare" / "model.safetensors"))
    again = load_model(tmp_path / "bare")
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_experts_fill_the_stacked_weights_and_a_missing_one_is_named(
        family_dirs, tmp_path: Path) -> None:
    model_dir = family_dir(family_dirs, "tiny-qwen3-moe")
    model = load_model(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    experts = model.model.layers[2].mlp.experts
    p = "model.layers.2.mlp.experts.5"
    assert torch.equal(experts.w13[5, :32], tensors[f"{p}.gate_proj.weight"])
    assert torch.equal(experts.w13[5, 32:], tensors[f"{p}.up_proj.weight"])
    assert torch.equal(experts.w2[5], tensors[f"{p}.down_proj.weight"])
    assert not hasattr(model.model.layers[1].mlp, "experts")  # mlp_only_layers: [1]
    del tensors[f"{p}.up_proj.weight"]
    (tmp_path / "moe").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "moe" / "config.json")
    save_file(tensors, str(tmp_path / "moe" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): " + p + ".up_proj.weight"):
        load_model(tmp_path / "moe")


# ------------------------------------------------------------ the new blocks


def test_llama3_and_yarn_rope_match_transformers() -> None:
    """Our cos/sin tables against transformers' inverse frequencies and attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [
        ("llama3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 512),
        ("yarn", {"rope_type": "yarn", "factor": 4.0,
                  "original_max_position_embeddings": 1024}, 4096),
    ]
    for rope_type, scaling, max_pos in cases:
        config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2,
                                          max_position_embeddings=max_pos,
                                          rope_parameters={"rope_theta": 5e5, **scaling})
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        rope = get_rope(128, max_pos, 5e5, scaling)
        positions = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        want = torch.cat([freqs.cos(), freqs.sin()], -1) * attention_factor
        torch.testing.assert_close(rope.cos_sin_cache, want, rtol=1e-5, atol=1e-5)
        plain = get_rope(128, max_pos, 5e5)
        assert not torch.allclose(plain.cos_sin_cache, rope.cos_sin_cache)
    with pytest.raises(ValueError, match="rope type 'llama3' needs 'low_freq_factor'"):
        get_rope(16, 64, 1e4, {"rope_type": "llama3", "factor": 8.0})


def test_yarn_holds_past_the_pretraining_context(family_dirs) -> None:
    """Qwen3 with YaRN (a context of 1,024 stretched 4x) at positions 1,280-1,299,
    continuing a cached prompt of 1,280 tokens: still transformers' logits."""
    model_dir = family_dir(family_dirs, "tiny-qwen3-yarn")
    runner = ModelRunner(engine_config(model_dir, num_gpu_blocks_override=400,
                                       max_model_len=2048))
    (prompt,) = random_prompts([1300], runner.vocab_size, seed=21)
    table = list(range(1, 326))
    runner.execute([BatchEntry(prompt[:1280], 0, table, sample=False)])
    ours = all_logits(runner, [BatchEntry(prompt[1280:], 1280, table)])
    torch.testing.assert_close(ours, hf_logits(hf_model_of(model_dir), prompt)[1280:], **TOL)


def test_the_sliding_window_binds(family_dirs) -> None:
    """Mistral's window of 16: positions past it see 16 tokens, not the whole context."""
    runner = ModelRunner(engine_config(family_dir(family_dirs, "tiny-mistral")))
    assert {layer.self_attn.attn.sliding_window for layer in runner.model.model.layers} == {16}
    (prompt,) = random_prompts([40], runner.vocab_size, seed=9)
    table = Blocks(shuffle=True).table(40)
    windowed = all_logits(runner, [BatchEntry(prompt, 0, table)])
    for layer in runner.model.model.layers:
        layer.self_attn.attn.sliding_window = None
    full = all_logits(runner, [BatchEntry(prompt, 0, table)])
    torch.testing.assert_close(windowed[:16], full[:16])  # the window holds everything
    assert (windowed[16:] - full[16:]).abs().max() > 1e-2  # from position 16 on it does not


def test_gpu_runner_refuses_a_window_its_kernels_would_not_apply() -> None:
    check_sliding_window(None, 32768)
    check_sliding_window(4096, 4096)  # no sequence outgrows it: exact on the kernels
    with pytest.raises(ValueError, match="max_model_len <= 4096 .got 8192."):
        check_sliding_window(4096, 8192)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_grouped_and_looped_experts_match_the_reference(num_tokens: int) -> None:
    """FusedMoE's fast path (grouped GEMM; the sorted loop) against its reference."""
    gen = torch.Generator().manual_seed(num_tokens)
    moe = FusedMoE(num_experts=8, top_k=3, hidden_size=32, intermediate_size=16,
                   renormalize=True)
    moe.w13.copy_(torch.randn(moe.w13.shape, generator=gen) / 32**0.5)
    moe.w2.copy_(torch.randn(moe.w2.shape, generator=gen) / 16**0.5)
    x = torch.randn(num_tokens, 32, generator=gen)
    logits = torch.randn(num_tokens, 8, generator=gen)
    want = moe.forward_native(x, logits)
    for grouped in (True, False):
        moe.grouped = grouped
        torch.testing.assert_close(moe.forward_fast(x, logits), want, rtol=1e-5, atol=1e-5)
    # By hand for one token: its three experts, weighted by renormalised probabilities.
    probs = torch.softmax(logits[0], -1)
    top = probs.topk(3)
    manual = sum(w / top.values.sum() * (moe.w2[e] @ (torch.nn.functional.silu(
        moe.w13[e, :16] @ x[0]) * (moe.w13[e, 16:] @ x[0]))) for w, e in zip(*top))
    torch.testing.assert_close(want[0], manual, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ the GPU runner's forward, on the CPU


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-qwen2", "tiny-qwen3-moe",
                                  "tiny-qwen3-yarn", "tiny-gpt2"])
def test_fused_forward_covers_the_families_and_matches_their_own(family_dirs, name) -> None:
    """The GPU runner's folded forward (on the torch references, as `kernels=False`) for
    families without q/k norms and with experts, against the model's own forward."""
    model_dir = family_dir(family_dirs, name)
    model = load_model(model_dir)
    if name == "tiny-gpt2":  # LayerNorm and GELU: the runner keeps the model's own forward
        assert not foldable(model)
        return
    kinds = {(attention_kind(layer), mlp_kind(layer)) for layer in model.model.layers}
    expected = {"tiny-llama3": {("rope", "swiglu")}, "tiny-qwen2": {("rope", "swiglu")},
                "tiny-qwen3-moe": {("qk_norm", "moe"), ("qk_norm", "swiglu")},
                "tiny-qwen3-yarn": {("qk_norm", "swiglu")}}[name]
    assert kinds == expected
    config = engine_config(model_dir)
    ref = ModelRunner(config)
    fast = ModelRunner(config)
    fast.model.forward = FusedDecoderForward(fast.model, kernels=False)
    if name == "tiny-qwen2":  # q/k/v biases: the input norm is not folded into them
        norm = fast.model.model.layers[0].input_layernorm.weight
        assert not torch.equal(norm, torch.ones_like(norm))
    prompts = random_prompts([7, 18, 3], ref.vocab_size, seed=2)
    blocks = Blocks(shuffle=True, seed=2)
    tables = [blocks.table(len(p) + 4) for p in prompts]
    seqs = [list(p) for p in prompts]
    for runner in (ref, fast):
        runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables)])
    for step in range(4):
        entries = [BatchEntry([step + 1], len(s), t) for s, t in zip(seqs, tables)]
        torch.testing.assert_close(fast.execute(entries), ref.execute(entries),
                                   rtol=1e-4, atol=1e-4)
        for s in seqs:
            s.append(step + 1)


def test_gpu_runner_host_logic_runs_every_family_on_the_cpu(family_dirs, monkeypatch) -> None:
    """The GPU runner (decodes first, the CUDA backend's torch fallbacks, the fused
    forward on the references) against the reference runner, for Llama and Qwen3-MoE."""
    monkeypatch.setattr(
        "mini_vllm.gpu.model_runner.select_attention_backend",
        lambda device, dtype, head_dim, group=None: CudaAttentionBackend(
            dtype, head_dim, device, use_kernels=False))
    for name in ("tiny-llama3", "tiny-qwen3-moe", "tiny-gpt2"):
        config = engine_config(family_dir(family_dirs, name))
        ref, fast = ModelRunner(config), GPUModelRunner(config)
        if foldable(fast.model):
            fast.forward = FusedDecoderForward(fast.model, kernels=False)  # as on a GPU
        a, b = random_prompts([9, 14], ref.vocab_size, seed=3)
        blocks = Blocks(shuffle=True, seed=3)
        ta, tb = blocks.table(24), blocks.table(24)
        for runner in (ref, fast):
            runner.execute([BatchEntry(a, 0, ta)])
        entries = [BatchEntry(b, 0, tb), BatchEntry([5], len(a), ta)]  # prompt before decode
        torch.testing.assert_close(fast.execute(entries), ref.execute(entries),
                                   rtol=1e-4, atol=1e-4)


def test_piecewise_graphs_stage_a_models_own_qkv_into_their_buffer() -> None:
    """A forward that is not the fused one (GPT-2) hands attention tensors of its own;
    at capture they are copied into the one QKV buffer, so no layer keeps its own."""
    pieces = PiecewiseGraphRunner(lambda *a: None, [], [8, 16], num_heads=4, num_kv_heads=2,
                                  head_dim=8, dtype=torch.float32, device=torch.device("cpu"))
    q, k, v = torch.randn(16, 4, 8), torch.randn(16, 2, 8), torch.randn(16, 2, 8)
    sq, sk, sv = pieces._stage(q, k, v, 16)
    base = pieces.qkv_out.data_ptr()
    assert [t.data_ptr() - base for t in (sq, sk, sv)] == [0, 4 * 8 * 4, 6 * 8 * 4]
    for staged, original in ((sq, q), (sk, k), (sv, v)):
        assert torch.equal(staged, original)
    assert pieces._stage(sq, sk, sv, 16)[0] is sq  # already there: left alone


# ------------------------------------------------------------ tokenizers and templates


TEXTS = ["Hello, world! 12345 apples", "naïve café — 🤖 emoji\nnew line", "  two  spaces "]


@pytest.mark.parametrize("name", ["tiny-llama3", "tiny-mistral", "tiny-gpt2", "tiny-qwen2"])
def test_tokenizers_match_transformers_in_each_familys_style(family_dirs, name) -> None:
    model_dir = family_dir(family_dirs, name)
    ours = Tokenizer.from_pretrained(model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    bos = {"tiny-llama3": "<|begin_of_text|>", "tiny-mistral": "<s>"}.get(name)
    for text in TEXTS:
        with_special = ours.encode(text, add_special_tokens=True)
        assert with_special == hf(text)["input_ids"], text
        assert ours.encode(text) == hf(text, add_special_tokens=False)["input_ids"], text
        if bos:  # Llama 3 and Mistral prepend their BOS; the others add nothing
            assert with_special == [ours.token_to_id(bos), *ours.encode(text)]
        else:
            assert with_special == ours.encode(text)
        decoded = ours.decode(with_special, skip_special_tokens=True)
        assert decoded == hf.decode(with_special, skip_special_tokens=True)
        # (SentencePiece-style decoding drops one leading space: transformers' too.)
        assert decoded == (text[1:] if name == "tiny-mistral" and text[0] == " " else text)
        # Streamed, one id at a time, the pieces join to the whole decode.
        detok = IncrementalDetokenizer(ours, skip_special_tokens=True)
        pieces = [detok.add_token(i) for i in with_special]
        assert "".join(pieces) + detok.flush() == decoded
    if name == "tiny-mistral":  # a character outside the vocabulary: its UTF-8 bytes
        ids = ours.encode("🤖")
        assert [ours.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA4>",
                                                           "<0x96>"]


def test_text_prompts_get_the_bos_chat_prompts_get_it_from_the_template(family_dirs) -> None:
    model_dir = family_dir(family_dirs, "tiny-llama3")
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128,
              num_gpu_blocks_override=64)
    tok = llm.get_tokenizer()
    bos = tok.token_to_id("<|begin_of_text|>")
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (out,) = llm.generate("Hello there", params, use_tqdm=False)
    assert out.prompt_token_ids == [bos, *tok.encode("Hello there")]
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert chat.prompt_token_ids.count(bos) == 1 and chat.prompt_token_ids[0] == bos
    assert chat.prompt.startswith("<|begin_of_text|><|start_header_id|>user")
    hf = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    for name in ("tiny-llama3", "tiny-mistral"):
        d = family_dir(family_dirs, name)
        ours, theirs = Tokenizer.from_pretrained(d), transformers.AutoTokenizer.from_pretrained(d)
        text = ours.apply_chat_template(messages, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict | transformers.BatchEncoding) else ids
        assert ours.encode(text) == list(ids)
    assert hf.bos_token == "<|begin_of_text|>"


def test_a_model_without_a_chat_template_says_so_and_chat_template_overrides(
        family_dirs, tmp_path: Path) -> None:
    model_dir = family_dir(family_dirs, "tiny-gpt2")
    messages = [{"role": "user", "content": "Hi"}]
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=64,
              num_gpu_blocks_override=32)
    with pytest.raises(NoChatTemplateError, match="no chat template.*--chat-template"):
        llm.chat(messages, use_tqdm=False)
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                        "{% endfor %}assistant:")
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for value in (str(template), template.read_text()):  # a file, or the template itself
        llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=64,
                  num_gpu_blocks_override=32, chat_template=value)
        (out,) = llm.chat(messages, params, use_tqdm=False)
        assert out.prompt == "user: Hi\nassistant:" and len(out.outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="chat_template: 'no-such-file' is neither"):
        EngineArgs(model=str(model_dir), chat_template="no-such-file").create_engine_config()


def test_cli_chat_without_a_template_is_a_one_line_error(family_dirs, capsys) -> None:
    from mini_vllm.cli import main

    model_dir = family_dir(family_dirs, "tiny-gpt2")
    rc = main(["chat", "--model", str(model_dir), "--device", "cpu", "--max-model-len", "64",
               "--num-gpu-blocks-override", "16"])
    err = capsys.readouterr().err
    assert rc == 2 and "no chat template" in err and len(err.strip().splitlines()) == 1


def test_the_server_answers_a_chat_without_template_with_a_400(family_dirs) -> None:
    from mini_vllm.engine.async_engine import AsyncLLM
    from mini_vllm.entrypoints.openai_server import build_app

    model_dir = family_dir(family_dirs, "tiny-gpt2")
    engine = AsyncLLM(EngineArgs(model=str(model_dir), device="cpu", max_model_len=64,
                                 num_gpu_blocks_override=16).create_engine_config())
    app = build_app(engine)

    async def run() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            chat = await client.post("/v1/chat/completions", json={
                "model": str(model_dir), "messages": [{"role": "user", "content": "Hi"}]})
            completion = await client.post("/v1/completions", json={
                "model": str(model_dir), "prompt": "Hi", "max_tokens": 2})
            return chat, completion

    try:
        chat, completion = asyncio.run(run())
    finally:
        engine.shutdown()
    assert chat.status_code == 400
    error = chat.json()["error"]
    assert "no chat template" in error["message"] and error["param"] == "messages"
    assert completion.status_code == 200


# ------------------------------------------------------------ the floor


@pytest.fixture(scope="module")
def common():
    """`benchmarks/common.py` (benchmarks/ is not an installed package)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("_models_common", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_shapes_count_every_familys_parameters_as_transformers_does(common, tmp_path) -> None:
    for name in ("llama3-8b", "qwen2.5-7b", "mistral-7b", "gpt2-xl", "qwen3-30b-a3b"):
        config = dict(FAMILY_PRESETS[name].config)
        shape = common.ModelShape.from_config(config)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(
                transformers.AutoConfig.for_model(**config))
        n = sum(p.numel() for p in hf.parameters())
        assert shape.num_params == pytest.approx(n, rel=2e-3), name  # biases left out
    moe = common.ModelShape.from_config(dict(FAMILY_PRESETS["qwen3-30b-a3b"].config))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_moe_layers) == (128, 8, 48)
    assert 3.2e9 < moe.active_params + 2 * moe.vocab_size * moe.hidden_size < 3.4e9  # "A3B"
    assert moe.experts_read(1) == pytest.approx(8)
    assert moe.experts_read(256) == pytest.approx(128, rel=1e-6)
    one, many = moe.weight_bytes(2, 1), moe.weight_bytes(2, 256)
    assert many == pytest.approx(moe.weight_bytes(2), rel=1e-6) and one < many / 8


def test_floor_is_the_longer_of_bytes_and_flops_step_by_step(common) -> None:
    """An independent count, token by token: each decode step's bytes and FLOPs from
    its running requests, each prompt step's from the prompts."""
    shape = common.ModelShape.from_config(dict(FAMILY_PRESETS["llama3-8b"].config))
    w = common.make_workload(num_requests=6, input_len=(10, 40), output_len=(3, 9), seed=1)
    bw, rate = 1e12, 20e12
    floor = common.throughput_floor(w, shape, 2, bw, max_num_seqs=4, matmul_flops_per_s=rate,
                                    max_num_batched_tokens=64)
    kv = shape.kv_bytes_per_token(2)
    weights = shape.weight_bytes(2)
    # Slots: each request takes the first slot to free, and runs max_tokens steps.
    free, runs = [0] * 4, []
    for p, m in zip(w.prompts, w.max_tokens):
        slot = min(range(4), key=lambda i: free[i])
        runs.append((free[slot], m, len(p)))
        free[slot] += m
    decode = 0.0
    for step in range(max(free)):
        live = [(start, p) for start, m, p in runs if start <= step < start + m]
        ctx = sum(p + step - start + 1 for start, p in live)
        nbytes = weights + (ctx + len(live)) * kv
        flops = (len(live) * (2 * shape.active_params + 2 * shape.vocab_size * shape.hidden_size)
                 + 4 * shape.num_layers * shape.num_heads * shape.head_dim * ctx)
        decode += max(nbytes / bw, flops / rate)
    prompt_tokens = w.num_prompt_tokens
    prompt_bytes = -(-prompt_tokens // 64) * weights + prompt_tokens * kv
    prompt_flops = sum(shape.prefill_flops(len(p)) for p in w.prompts)
    prompt = max(prompt_bytes / bw, prompt_flops / rate)
    kinds = floor["step_kinds"]
    assert kinds["decode"]["steps"] == max(free) == floor["decode_steps"]
    assert kinds["decode"]["floor_s"] == pytest.approx(decode, rel=1e-9)
    assert kinds["prompt"]["floor_s"] == pytest.approx(prompt, rel=1e-9)
    assert floor["floor_s"] == pytest.approx(prompt + decode, rel=1e-9)
    assert floor["floor_s"] > floor["byte_floor_s"]  # an 8B model's prompts are compute
    assert kinds["prompt"]["flops_s"] > kinds["prompt"]["bytes_s"]
    # Without a matmul rate the floor is the bytes alone, as before.
    bytes_only = common.throughput_floor(w, shape, 2, bw, max_num_seqs=4)
    assert bytes_only["floor_s"] == bytes_only["byte_floor_s"] == floor["byte_floor_s"]
    assert "step_kinds" not in bytes_only


# ------------------------------------------------------------ on a GPU

# Small models in shapes the kernels take (head_dim 128, widths multiples of 8).
GPU_SHAPES = {
    "tiny-llama3": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "intermediate_size": 1024},
    "tiny-qwen2": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "intermediate_size": 1024},
    "tiny-mistral": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "head_dim": 128, "intermediate_size": 1024, "sliding_window": None},
    "tiny-gpt2": {"n_embd": 512, "n_head": 4},
    # Every expert for every token: bf16 against float32 would otherwise route a few tokens
    # to other experts (near ties), which no tolerance describes. The sparse selection is
    # checked at the layer, on equal router logits (test_grouped_experts_...).
    "tiny-qwen3-moe": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                       "head_dim": 128, "intermediate_size": 1024, "moe_intermediate_size": 256,
                       "num_experts_per_tok": 8},
    "tiny-qwen3-yarn": {"hidden_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 128, "intermediate_size": 1024},
}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_every_family_on_the_gpu_runner_matches_transformers_in_bfloat16(
        name: str, tmp_path: Path) -> None:
    """Prompts, a chunked prompt beside decodes, then decode steps through CUDA graphs, in
    bf16 on the fast path, against transformers in float32 on the same checkpoint."""
    model_dir = make_model(tmp_path / name, preset=name, seed=3, overrides=GPU_SHAPES[name])
    runner = GPUModelRunner(EngineArgs(
        model=str(model_dir), device="cuda", dtype="bfloat16", block_size=16,
        num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=4).create_engine_config())
    assert isinstance(runner.forward, FusedDecoderForward) == (name != "tiny-gpt2")
    assert runner.graph_runner is not None  # every family's decode runs as a CUDA graph
    if ops.is_available():  # (the script builds the kernels first)
        assert all(m.use_fast for m in runner.model.modules()
                   if type(m).__name__ in ("Linear", "FusedMoE", "RMSNorm"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa").to("cuda").eval()
    prompts = random_prompts([7, 33, 60, 45], runner.vocab_size, seed=3)
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]  # 128 tokens each
    ours, seqs = run_mixed_steps(runner, prompts, tables, chunk=20)
    want = hf_logits_of_mixed_steps(hf, seqs, [len(p) for p in prompts])
    rel = (ours - want).norm(dim=-1) / want.norm(dim=-1)
    # bf16 through 3-4 layers on the CPU's reference path: 1-2 % typical, up to 4 % (YaRN's
    # mscale); a wrong table, bias or window is off by tens of percent.
    assert rel.median().item() < 0.03 and rel.max().item() < 0.06, rel.tolist()
    assert (ours.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.gpu
@needs_gpu
def test_gpu_runner_refuses_mistrals_window_past_max_model_len(tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / "m", preset="tiny-mistral",
                           overrides={**GPU_SHAPES["tiny-mistral"], "sliding_window": 64})
    args = {"model": str(model_dir), "device": "cuda", "dtype": "bfloat16",
            "num_gpu_blocks_override": 64, "max_num_seqs": 4}
    with pytest.raises(ValueError, match="sliding_window.*max_model_len <= 64"):
        GPUModelRunner(EngineArgs(**args, max_model_len=256).create_engine_config())
    GPUModelRunner(EngineArgs(**args, max_model_len=64).create_engine_config())


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 255, 2048])
def test_grouped_experts_match_the_reference_on_the_gpu(num_tokens: int) -> None:
    """The grouped-GEMM experts in bf16 against the reference loop, eagerly and replayed
    from a CUDA graph (Qwen3-30B-A3B's expert shapes: 128 experts of 768, top 8)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    moe = FusedMoE(128, 8, 2048, 768, renormalize=True, device="cuda", dtype=torch.bfloat16)
    moe.w13.normal_(0, 2048**-0.5, generator=gen)
    moe.w2.normal_(0, 768**-0.5, generator=gen)
    from mini_vllm.layers import select_implementations

    select_implementations(moe, "cuda", torch.bfloat16)
    assert moe.use_fast and moe.capturable, "torch has no grouped GEMM for this GPU"
    x = torch.randn(num_tokens, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    logits = torch.randn(num_tokens, 128, device="cuda", generator=gen).to(torch.bfloat16)
    want = moe.forward_native(x, logits).float()
    got = moe(x, logits).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe(x, logits)  # warm-up off the default stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        out = moe(x, logits)
    x.copy_(torch.randn(x.shape, device="cuda", generator=gen))  # new inputs, same buffers
    logits.copy_(torch.randn(logits.shape, device="cuda", generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    want = moe.forward_native(x, logits).float()
    # (index_add_ adds a token's rows in any order: equal up to bf16 rounding)
    assert ((out.float() - want).norm() / want.norm()).item() < 1e-2


def test_presets_vocabularies_cover_their_tokenizers(family_dirs) -> None:
    """Each tiny vocabulary is its tokenizer's size rounded up to 64 (the model's
    embedding has ids the tokenizer lacks, as real checkpoints do)."""
    for name in FAMILIES:
        model_dir = family_dir(family_dirs, name)
        size = Tokenizer.from_pretrained(model_dir).vocab_size
        assert ModelConfig.from_pretrained(model_dir).vocab_size == math.ceil(size / 64) * 64
