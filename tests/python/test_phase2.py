"""Phase 2: our Qwen3 over a flat batch, proven against Hugging Face's on the same weights.

Every comparison runs in float32 against `transformers.Qwen3ForCausalLM`
reading the same checkpoint: several prompts prefilled together in one flat
batch, decode steps for all of them, a prompt chunked over two steps, a mix
of all three in one step, and 32-token greedy continuations.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from mini_vllm.attention import AttentionMetadata, paged_attention, write_kv_cache
from mini_vllm.config import EngineArgs, EngineConfig
from mini_vllm.layers import CustomOp, select_implementations
from mini_vllm.model_runner import BatchEntry, ModelRunner
from mini_vllm.models import load_model

pytestmark = pytest.mark.phase2

TOL = {"rtol": 1e-5, "atol": 1e-4}
BLOCK_SIZE = 4
NUM_BLOCKS = 160


def engine_config(model_dir: Path, **overrides: object) -> EngineConfig:
    args = {
        "model": str(model_dir), "device": "cpu", "dtype": "float32",
        "block_size": BLOCK_SIZE, "num_gpu_blocks_override": NUM_BLOCKS,
        "max_model_len": 256, "max_num_seqs": 8,
    }
    args.update(overrides)
    return EngineArgs(**args).create_engine_config()


class Blocks:
    """Hands out block ids 1..num_blocks-1, shuffled so tables are not contiguous."""

    def __init__(self, shuffle: bool, seed: int = 0, num_blocks: int = NUM_BLOCKS,
                 block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        if shuffle:
            random.Random(seed).shuffle(self.free)

    def table(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.block_size)
        table, self.free = self.free[:n], self.free[n:]
        return table


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_logits(hf: transformers.Qwen3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """HF logits of every position of one full sequence: `[len(ids), vocab]`."""
    return hf(torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf: transformers.Qwen3ForCausalLM, prompt: list[int], num_new: int) -> list[int]:
    """Prompt + `num_new` greedy tokens from HF, decoding with its own KV cache."""
    ids = list(prompt)
    out = hf(torch.tensor([ids]), use_cache=True)
    for _ in range(num_new):
        ids.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids


@torch.inference_mode()
def all_logits(runner: ModelRunner, entries: list[BatchEntry]) -> torch.Tensor:
    """Like `execute`, but logits of every new token, `[T, vocab]`."""
    batch = runner.build_batch(entries)
    hidden = runner.model(batch.input_ids, batch.positions, runner.kv_caches,
                          batch.attn_metadata)
    return runner.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=["tied", "untied"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    name = "tiny_model_dir" if request.param == "tied" else "tiny_untied_model_dir"
    return request.getfixturevalue(name)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> transformers.Qwen3ForCausalLM:
    return transformers.Qwen3ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


# ---------------------------------------------------------------- the model


def test_tied_and_untied_heads(tiny_model_dir: Path, tiny_untied_model_dir: Path) -> None:
    tied = load_model(tiny_model_dir)
    untied = load_model(tiny_untied_model_dir)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118


def test_blocks_run_their_reference_on_the_cpu(tiny_model_dir: Path) -> None:
    """The loader leaves every block of a CPU model on `forward_native`; a block whose
    fast implementation can run is switched to it, and `forward` then calls it."""
    model = load_model(tiny_model_dir)
    blocks = [m for m in model.modules() if isinstance(m, CustomOp)]
    assert {type(b).__name__ for b in blocks} == {"Linear", "LMHead", "RMSNorm", "SiluAndMul"}
    assert not any(b.use_fast for b in blocks)
    assert select_implementations(model, "cpu", torch.float32) == Counter()

    class Probe(CustomOp):
        def __init__(self, has_kernel: bool) -> None:
            super().__init__()
            self.has_kernel, self.calls = has_kernel, []

        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.append("native")
            return 2 * x

        def forward_fast(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.append("fast")
            return x + x

        def fast_supported(self, device: torch.device, dtype: torch.dtype) -> bool:
            return self.has_kernel and dtype == torch.bfloat16

    net = nn.Sequential(Probe(True), Probe(False))
    assert select_implementations(net, "cpu", torch.float32) == Counter()
    assert select_implementations(net, "cpu", torch.bfloat16) == Counter({"Probe": 1})
    torch.testing.assert_close(net(torch.ones(3)), torch.full((3,), 4.0))
    assert net[0].calls == ["fast"] and net[1].calls == ["native"]


def test_prefill_of_several_prompts_in_one_flat_batch(model_dir: Path, hf_model) -> None:
    runner = ModelRunner(engine_config(model_dir))
    prompts = random_prompts([1, 5, 8, 13, 30], runner.vocab_size)
    blocks = Blocks(shuffle=True)
    entries = [BatchEntry(p, 0, blocks.table(len(p))) for p in prompts]

    expected = [hf_logits(hf_model, p) for p in prompts]
    torch.testing.assert_close(all_logits(runner, entries), torch.cat(expected), **TOL)
    # execute() keeps only the last token of each prompt.
    logits = runner.execute(entries)
    assert logits.shape == (len(prompts), runner.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, torch.stack([e[-1] for e in expected]), **TOL)


def test_decode_steps_for_all_sequences_in_one_flat_batch(model_dir: Path, hf_model) -> None:
    runner = ModelRunner(engine_config(model_dir))
    seqs = random_prompts([3, 7, 12, 1], runner.vocab_size, seed=1)
    blocks = Blocks(shuffle=True, seed=1)
    tables = [blocks.table(len(s) + 8) for s in seqs]  # room for the decode steps
    runner.execute([BatchEntry(s, 0, t) for s, t in zip(seqs, tables)])

    new_tokens = random_prompts([5] * len(seqs), runner.vocab_size, seed=2)
    for step in range(5):
        entries = [BatchEntry([new[step]], len(s), t) for s, new, t in zip(seqs, new_tokens, tables)]
        logits = runner.execute(entries)
        for s, new in zip(seqs, new_tokens):
            s.append(new[step])
        expected = torch.stack([hf_logits(hf_model, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, **TOL)


def test_chunked_prefill_over_two_steps(model_dir: Path, hf_model) -> None:
    runner = ModelRunner(engine_config(model_dir))
    (prompt,) = random_prompts([23], runner.vocab_size, seed=3)
    table = Blocks(shuffle=True, seed=3).table(len(prompt))
    first, second = prompt[:10], prompt[10:]  # the split is not on a block boundary

    out = runner.execute([BatchEntry(first, 0, table, sample=False)])
    assert out.shape == (0, runner.vocab_size)
    logits = all_logits(runner, [BatchEntry(second, len(first), table)])
    torch.testing.assert_close(logits, hf_logits(hf_model, prompt)[10:], **TOL)


def test_prefill_chunk_and_decode_mixed_in_one_step(model_dir: Path, hf_model) -> None:
    runner = ModelRunner(engine_config(model_dir))
    a, b, c = random_prompts([6, 18, 9], runner.vocab_size, seed=4)
    blocks = Blocks(shuffle=True, seed=4)
    ta, tb, tc = blocks.table(len(a) + 1), blocks.table(len(b)), blocks.table(len(c))

    # Step 1: A's whole prompt, the first 11 tokens of B.
    step1 = runner.execute([BatchEntry(a[:-1], 0, ta), BatchEntry(b[:11], 0, tb, sample=False)])
    assert step1.shape[0] == 1
    # Step 2: A decodes one token, B finishes its prompt, C prefills, all in one batch.
    entries = [BatchEntry(a[-1:], len(a) - 1, ta), BatchEntry(b[11:], 11, tb),
               BatchEntry(c, 0, tc)]
    expected = torch.cat([hf_logits(hf_model, a)[-1:], hf_logits(hf_model, b)[11:],
                          hf_logits(hf_model, c)])
    torch.testing.assert_close(all_logits(runner, entries), expected, **TOL)


def test_greedy_continuations_match_hf_token_for_token(model_dir: Path, hf_model) -> None:
    runner = ModelRunner(engine_config(model_dir))
    prompts = random_prompts([4, 9, 17, 2], runner.vocab_size, seed=5)
    num_new = 32
    blocks = Blocks(shuffle=False)  # contiguous tables, one run of blocks per sequence
    tables = [blocks.table(len(p) + num_new) for p in prompts]

    seqs = [list(p) for p in prompts]
    logits = runner.execute([BatchEntry(p, 0, t) for p, t in zip(prompts, tables)])
    for _ in range(num_new):
        next_ids = logits.argmax(-1).tolist()
        entries = []
        for s, t, tok in zip(seqs, tables, next_ids):
            entries.append(BatchEntry([tok], len(s), t))
            s.append(tok)
        logits = runner.execute(entries)

    for prompt, ours in zip(prompts, seqs):
        assert ours == hf_greedy(hf_model, prompt, num_new)


def test_bfloat16_weights_are_converted(tiny_model_dir: Path) -> None:
    ref = load_model(tiny_model_dir, dtype=torch.float32)
    bf16 = load_model(tiny_model_dir, dtype=torch.bfloat16)
    for (name, p32), (_, p16) in zip(ref.named_parameters(), bf16.named_parameters()):
        assert p16.dtype == torch.bfloat16, name
        assert torch.equal(p16, p32.to(torch.bfloat16)), name


# ---------------------------------------------------------------- the loader


def test_dummy_load_format_needs_only_the_config(tiny_model_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    runner = ModelRunner(engine_config(tmp_path, load_format="dummy"))
    norm = runner.model.model.norm.weight
    assert 0.5 < norm.mean().item() < 1.5 and norm.std().item() > 0.01  # norms around 1
    logits = runner.execute([BatchEntry([1, 2, 3], 0, [1])])
    assert logits.shape == (1, runner.vocab_size) and torch.isfinite(logits).all()
    again = ModelRunner(engine_config(tmp_path, load_format="dummy"))
    torch.testing.assert_close(again.execute([BatchEntry([1, 2, 3], 0, [1])]), logits)


def copy_checkpoint(src: Path, dst: Path, edit=None) -> Path:
    """Copy `src`'s config and weights into `dst`, passing the tensors through `edit`."""
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    save_file(edit(tensors) if edit else tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(tiny_model_dir / "config.json", sharded / "config.json")
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        part = names[i::3]
        save_file({k: tensors[k] for k in part}, str(sharded / file))
        weight_map.update({k: file for k in part})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))

    single, multi = load_model(tiny_model_dir), load_model(sharded)
    for (name, a), (_, b) in zip(single.named_parameters(), multi.named_parameters()):
        assert torch.equal(a, b), name
    # The fused q/k/v weight holds the checkpoint's k_proj rows where expected.
    qkv = multi.model.layers[1].self_attn.qkv_proj.weight
    q_rows = tensors["model.layers.1.self_attn.q_proj.weight"].shape[0]
    k = tensors["model.layers.1.self_attn.k_proj.weight"]
    assert torch.equal(qkv[q_rows:q_rows + k.shape[0]], k)


def test_missing_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    def drop(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        return t
    bad = copy_checkpoint(tiny_model_dir, tmp_path / "bad", drop)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj"):
        load_model(bad)


def test_untied_checkpoint_without_lm_head_is_an_error(
    tiny_untied_model_dir: Path, tmp_path: Path
) -> None:
    def drop(t):
        del t["lm_head.weight"]
        return t
    bad = copy_checkpoint(tiny_untied_model_dir, tmp_path / "bad", drop)
    with pytest.raises(ValueError, match=r"missing .*lm_head\.weight"):
        load_model(bad)


def test_wrong_shape_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = t[name][:-1].clone()
        return t
    bad = copy_checkpoint(tiny_model_dir, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=rf"{name} in model\.safetensors has shape \(63, 64\)"):
        load_model(bad)


def test_unexpected_tensor_is_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    def add(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
        return t
    bad = copy_checkpoint(tiny_model_dir, tmp_path / "bad", add)
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.0\.mlp\.extra_proj"):
        load_model(bad)


def test_tied_checkpoint_with_a_redundant_lm_head_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    def add(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
        return t
    model = load_model(copy_checkpoint(tiny_model_dir, tmp_path / "ok", add))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_files_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(tiny_model_dir / "config.json", empty / "config.json")
    with pytest.raises(FileNotFoundError, match="no weights in"):
        load_model(empty)

    sharded = copy_checkpoint(tiny_model_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    with safe_open(str(sharded / "model-00001-of-00002.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model-00001-of-00002.safetensors")
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors not found"):
        load_model(sharded)


# ---------------------------------------------------------------- the runner


def test_build_batch_worked_example(tiny_model_dir: Path) -> None:
    """The three-sequence example of the chapter, block size 4."""
    runner = ModelRunner(engine_config(tiny_model_dir, num_gpu_blocks_override=10))
    batch = runner.build_batch([
        BatchEntry([11, 12, 13], start_pos=0, block_table=[7]),          # A: prefill
        BatchEntry([21, 22], start_pos=5, block_table=[2, 9]),           # B: prompt chunk 2
        BatchEntry([31], start_pos=8, block_table=[4, 5, 3, 6], sample=False),  # C: decode
    ])
    meta = batch.attn_metadata
    assert batch.input_ids.tolist() == [11, 12, 13, 21, 22, 31]
    assert batch.positions.tolist() == [0, 1, 2, 5, 6, 8]
    assert meta.slot_mapping.tolist() == [28, 29, 30, 37, 38, 12]
    assert meta.query_start_loc.tolist() == [0, 3, 5, 6]
    assert meta.context_lens.tolist() == [3, 7, 9]
    # Only the blocks holding context this step, padded with block 0.
    assert meta.block_tables.tolist() == [[7, 0, 0], [2, 9, 0], [4, 5, 3]]
    assert (meta.max_query_len, meta.max_context_len) == (3, 9)
    assert meta.query_start_loc_cpu == [0, 3, 5, 6] and meta.context_lens_cpu == [3, 7, 9]
    assert meta.query_start_loc.dtype == meta.context_lens.dtype == torch.int32
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert batch.logits_indices.tolist() == [2, 4]  # C does not sample


@pytest.mark.parametrize(("entry", "message"), [
    (BatchEntry([1, 2, 3, 4, 5], 0, [1]), "need 2 blocks"),
    (BatchEntry([1], 0, [0]), "block 0 is reserved"),
    (BatchEntry([1], 0, [10]), r"block ids must be in 1\.\.9"),
    (BatchEntry([], 0, [1]), "token_ids is empty"),
    (BatchEntry([1], 4096, [1] * 1025), "max_position_embeddings"),
])
def test_build_batch_rejects_bad_entries(tiny_model_dir: Path, entry: BatchEntry,
                                         message: str) -> None:
    runner = ModelRunner(engine_config(tiny_model_dir, num_gpu_blocks_override=10))
    with pytest.raises(ValueError, match=message):
        runner.build_batch([entry])


def test_kv_cache_is_one_allocation_sized_from_the_config(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    runner = ModelRunner(engine_config(tiny_model_dir, num_gpu_blocks_override=10))
    cfg = runner.model_config
    assert runner.num_blocks == 10 and runner.block_size == BLOCK_SIZE
    assert len(runner.kv_caches) == cfg.num_hidden_layers
    base = runner.kv_cache.data_ptr()
    for k, v in runner.kv_caches:
        assert k.shape == v.shape == (10, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        assert k.is_contiguous() and v.is_contiguous()
        assert base <= k.data_ptr() < base + runner.kv_cache.nbytes  # views, not copies

    # From cpu_kv_cache_gb: 1 MiB / (4 layers * K,V * 2 heads * 32 dims * 4 bytes * 16 tokens).
    block_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 4 * 16
    small = ModelRunner(engine_config(tiny_model_dir, num_gpu_blocks_override=None,
                                      block_size=16, cpu_kv_cache_gb=1 / 1024))
    assert small.num_blocks == 2**20 // block_bytes

    # Capped at what max_num_seqs sequences of max_model_len could use (+ block 0).
    with caplog.at_level(logging.INFO, logger="mini_vllm.model_runner"):
        capped = ModelRunner(engine_config(tiny_model_dir, num_gpu_blocks_override=None,
                                           block_size=16, max_num_seqs=2, max_model_len=64))
    assert capped.num_blocks == 2 * 4 + 1
    assert "KV cache: 9 blocks of 16 tokens (128 tokens" in caplog.text
    assert "max concurrency 2.00x" in caplog.text


def test_padding_slots_are_not_written_and_padding_rows_are_zero() -> None:
    k_cache = torch.zeros(4, 2, 1, 8)
    v_cache = torch.zeros(4, 2, 1, 8)
    k, v = torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    write_kv_cache(k, v, k_cache, v_cache, torch.tensor([2, 3, -1]))
    assert torch.equal(k_cache[1], k[:2]) and torch.equal(v_cache[1], v[:2])
    assert k_cache[[0, 2, 3]].abs().sum() == 0  # the padded token went nowhere

    meta = AttentionMetadata(
        slot_mapping=torch.tensor([2, 3, -1]),
        query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
        context_lens=torch.tensor([2], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        max_query_len=2, max_context_len=2, query_start_loc_cpu=[0, 2], context_lens_cpu=[2],
    )
    q = torch.randn(3, 2, 8)  # 2 query heads share the one KV head
    out = paged_attention(q, k_cache, v_cache, meta, scale=8**-0.5)
    assert out[2].abs().sum() == 0
    torch.testing.assert_close(out[0], v[0].expand(2, 8))  # token 0 sees only itself
