"""Random-weight checkpoints of the other families, in each family's own format.

`mini-vllm make-model DIR --preset tiny-llama3` (or `make_model(DIR, preset=...)`)
writes what a real download of that family holds: `config.json` in the
family's field names, safetensors under the family's tensor names (GPT-2's
`Conv1D` weights stored `[in, out]`, Qwen3-MoE's experts one tensor each),
`generation_config.json`, and a tokenizer built in the family's style:

| style   | families          | tokenizer.json                                   | chat template |
|---------|-------------------|--------------------------------------------------|---------------|
| qwen    | Qwen2, Qwen3(-MoE)| the shipped byte-level BPE (`mini_vllm/data/`)   | Qwen's        |
| llama3  | Llama 3           | byte-level BPE, digits in threes, BOS added      | header / eot  |
| mistral | Mistral           | SentencePiece-style BPE with byte fallback, BOS  | `[INST]`      |
| gpt2    | GPT-2             | byte-level BPE, `<|endoftext|>` only             | none          |

The BPE vocabularies are learned from the shipped corpus when the checkpoint
is written (a pure function of it). Tiny presets are for the CPU tests; the
others have the real models' shapes for GPU benchmarks (weights' values do
not change speed). `transformers` loads every one of them.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

from mini_vllm import checkpoint
from mini_vllm.checkpoint import (
    DATA_DIR,
    DEFAULT_MAX_SHARD_BYTES,
    GENERATION_CONFIG,
    _write_json,
    write_tokenizer_files,
)
from mini_vllm.model_config import resolve_dtype

BPE_VOCAB_SIZE = 1024  # learned tokens (bytes included) of the llama3 / gpt2 / mistral styles


@dataclass(frozen=True)
class FamilyPreset:
    """A preset: `config.json`'s contents and the style of its tokenizer files."""

    config: Mapping[str, Any]
    tokenizer: str  # "qwen", "llama3", "mistral" or "gpt2"


# --8<-- [start:presets]
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_LLAMA3_IDS = {"bos_token_id": 1024, "eos_token_id": 1033}  # <|begin_of_text|>, <|eot_id|>
_MISTRAL_IDS = {"bos_token_id": 1, "eos_token_id": 2}  # <s>, </s>
_GPT2_IDS = {"bos_token_id": 1024, "eos_token_id": 1024}  # <|endoftext|>
_QWEN_IDS = {"bos_token_id": 2305, "eos_token_id": 2307}  # <|endoftext|>, <|im_end|>

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5, **_LLAMA3_IDS}
_MISTRAL = {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0,
            "tie_word_embeddings": False, **_MISTRAL_IDS}
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "use_sliding_window": False,
          "sliding_window": None, **_QWEN_IDS}
_QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
              "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
              "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
              "use_sliding_window": False, "sliding_window": None, **_QWEN_IDS}
_GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
         "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
         "scale_attn_weights": True, "tie_word_embeddings": True, **_GPT2_IDS}

FAMILY_PRESETS: dict[str, FamilyPreset] = {
    # Tiny shapes for the CPU tests: a few MB each, vocabularies the tokenizer's
    # size rounded up to 64.
    "tiny-llama3": FamilyPreset({
        **_LLAMA, "vocab_size": 1088, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rope_theta": 500_000.0,
        # A pretraining context of 64 puts the pairs of a 16-wide head in all three
        # of llama3's regions (kept, blended, interpolated).
        "rope_scaling": {**_LLAMA3_ROPE, "original_max_position_embeddings": 64},
        "tie_word_embeddings": False, "torch_dtype": "float32"}, "llama3"),
    "tiny-mistral": FamilyPreset({
        **_MISTRAL, "vocab_size": 1344, "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 512,
        "sliding_window": 16,  # shorter than the tests' sequences: the window binds
        "torch_dtype": "float32"}, "mistral"),
    "tiny-qwen2": FamilyPreset({
        **_QWEN2, "vocab_size": 2368, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "max_window_layers": 3, "tie_word_embeddings": True,
        "torch_dtype": "float32"}, "qwen"),
    "tiny-gpt2": FamilyPreset({
        **_GPT2, "vocab_size": 1088, "n_embd": 64, "n_layer": 3, "n_head": 4,
        "n_positions": 256, "n_inner": None, "torch_dtype": "float32"}, "gpt2"),
    "tiny-qwen3-moe": FamilyPreset({
        **_QWEN3_MOE, "vocab_size": 2368, "hidden_size": 64, "intermediate_size": 192,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "mlp_only_layers": [1],  # one dense layer among the sparse ones
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "torch_dtype": "float32"}, "qwen"),
    "tiny-qwen3-yarn": FamilyPreset({
        **checkpoint.PRESETS["tiny"],
        # Qwen3's documented long-context setting, at tiny scale: 4x a context of 1,024.
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024},
        "max_position_embeddings": 4096}, "qwen"),
    # The real models' shapes (random weights, for GPU benchmarks).
    "llama3-8b": FamilyPreset({  # Llama 3.1 8B
        **_LLAMA, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500_000.0,
        "rope_scaling": _LLAMA3_ROPE, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16"}, "llama3"),
    "mistral-7b": FamilyPreset({  # Mistral 7B v0.3 (no sliding window)
        **_MISTRAL, "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 32768, "sliding_window": None,
        "torch_dtype": "bfloat16"}, "mistral"),
    "qwen2.5-7b": FamilyPreset({
        **_QWEN2, "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "max_window_layers": 28,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "qwen"),
    "gpt2-xl": FamilyPreset({
        **_GPT2, "vocab_size": 50257, "n_embd": 1600, "n_layer": 48, "n_head": 25,
        "n_positions": 1024, "n_inner": None, "torch_dtype": "bfloat16"}, "gpt2"),
    "qwen3-30b-a3b": FamilyPreset({
        **_QWEN3_MOE, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
        "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}, "qwen"),
}
# The tiny Llama with tied embeddings (Llama 3.2 1B/3B tie theirs).
FAMILY_PRESETS["tiny-llama3-tied"] = FamilyPreset(
    {**FAMILY_PRESETS["tiny-llama3"].config, "tie_word_embeddings": True}, "llama3")
# --8<-- [end:presets]


# ---------------------------------------------------------------- tokenizers

# Llama 3's pre-tokenization: Qwen2's, but digits in runs of up to three.
LLAMA3_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Llama 3.1's first special tokens, in id order after the learned vocabulary.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
    "<|eot_id|>", "<|python_tag|>",
]
# SentencePiece's control tokens first (ids 0-2), then Mistral's instruction tags.
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

# --8<-- [start:templates]
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim }}{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
MISTRAL_CHAT_TEMPLATE = (
    "{%- set system = messages[0]['content'] + '\\n\\n' "
    "if messages and messages[0]['role'] == 'system' else '' %}"
    "{{- bos_token }}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system if loop.first else '') + message['content'] + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('roles must be system, user or assistant') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
# --8<-- [end:templates]


def _corpus_lines() -> list[str]:
    return (DATA_DIR / "corpus.txt").read_text(encoding="utf-8").splitlines(keepends=True)


def _train_bpe(tok: Tokenizer, alphabet: list[str]) -> Tokenizer:
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB_SIZE, min_frequency=2,
                                  show_progress=False, initial_alphabet=alphabet,
                                  special_tokens=[])
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    return tok


def _special(content: str) -> AddedToken:
    return AddedToken(content, special=True, normalized=False, lstrip=False, rstrip=False,
                      single_word=False)


# --8<-- [start:llama3_tokenizer]
def llama3_tokenizer() -> Tokenizer:
    """A Llama 3-style tokenizer: byte-level BPE after Llama 3's split, BOS prepended
    to every encoding (`TemplateProcessing`), its special tokens after the vocabulary."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
    _train_bpe(tok, pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([_special(t) for t in LLAMA3_SPECIAL_TOKENS])
    bos = LLAMA3_SPECIAL_TOKENS[0]
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                      special_tokens=[(bos, tok.token_to_id(bos))]),
    ])
    return tok
# --8<-- [end:llama3_tokenizer]


def gpt2_tokenizer() -> Tokenizer:
    """A GPT-2-style tokenizer: byte-level BPE with GPT-2's own split, and one
    special token, `<|endoftext|>`, last."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                 use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=True)
    _train_bpe(tok, pre_tokenizers.ByteLevel.alphabet())
    tok.add_special_tokens([_special("<|endoftext|>")])
    return tok


# --8<-- [start:mistral_tokenizer]
def mistral_tokenizer() -> Tokenizer:
    """A Mistral (SentencePiece-converted) tokenizer: words start with `▁`, pieces are
    learned over characters, and a character outside the vocabulary falls back to its
    UTF-8 bytes, tokens `<0x00>` .. `<0xFF>` at ids 5-260. BOS is prepended."""
    trained = Tokenizer(models.BPE(unk_token=None))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=True)
    _train_bpe(trained, [])
    learned = json.loads(trained.to_str())["model"]
    vocab = {t: i for i, t in enumerate(MISTRAL_SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    for token in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([_special(t) for t in MISTRAL_SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    return tok
# --8<-- [end:mistral_tokenizer]


def _added_tokens_decoder(tok: Tokenizer) -> dict[str, dict[str, Any]]:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


def write_family_tokenizer(out: Path, style: str, config: Mapping[str, Any]) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`
    in `style` (see the module docstring)."""
    max_len = config.get("max_position_embeddings") or config.get("n_positions")
    if style == "qwen":
        write_tokenizer_files(out, model_max_length=max_len)
        _write_json(out / "generation_config.json", GENERATION_CONFIG)
        return
    builders = {"llama3": llama3_tokenizer, "gpt2": gpt2_tokenizer, "mistral": mistral_tokenizer}
    tok = builders[style]()
    tok.save(str(out / "tokenizer.json"))
    common = {"added_tokens_decoder": _added_tokens_decoder(tok), "model_max_length": max_len,
              "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    bos_id, eos_id = config["bos_token_id"], config["eos_token_id"]
    if style == "llama3":
        tokenizer_config = {**common, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                            "chat_template": LLAMA3_CHAT_TEMPLATE}
        end = [tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
        generation = {"bos_token_id": bos_id, "eos_token_id": end, "do_sample": True,
                      "temperature": 0.6, "top_p": 0.9}
    elif style == "mistral":
        tokenizer_config = {**common, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                            "add_bos_token": True, "chat_template": MISTRAL_CHAT_TEMPLATE}
        generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    else:  # gpt2: no chat template, as the real one
        tokenizer_config = {**common, "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                            "unk_token": "<|endoftext|>"}
        generation = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "generation_config.json", generation)


# ---------------------------------------------------------------- weights


# --8<-- [start:weight_shapes]
def family_weight_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The (Hugging Face name, shape) of every tensor a checkpoint of `config` stores.

    Linear weights are `[out, in]`; GPT-2's `Conv1D` weights are `[in, out]`.
    """
    arch = config["architectures"][0]
    if arch == "GPT2LMHeadModel":
        return _gpt2_shapes(config)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, config["num_key_value_heads"] * head_dim
    qkv_bias = arch == "Qwen2ForCausalLM" or config.get("attention_bias", False)
    o_bias = arch != "Qwen2ForCausalLM" and config.get("attention_bias", False)
    qk_norm = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.append((f"{p}.input_layernorm.weight", (hidden,)))
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((f"{p}.self_attn.{name}.weight", (rows, hidden)))
            if qkv_bias:
                shapes.append((f"{p}.self_attn.{name}.bias", (rows,)))
        shapes.append((f"{p}.self_attn.o_proj.weight", (hidden, q)))
        if o_bias:
            shapes.append((f"{p}.self_attn.o_proj.bias", (hidden,)))
        if qk_norm:
            shapes += [(f"{p}.self_attn.q_norm.weight", (head_dim,)),
                       (f"{p}.self_attn.k_norm.weight", (head_dim,))]
        shapes.append((f"{p}.post_attention_layernorm.weight", (hidden,)))
        if _is_moe_layer(config, i):
            experts, moe = config["num_experts"], config["moe_intermediate_size"]
            shapes.append((f"{p}.mlp.gate.weight", (experts, hidden)))  # the router
            for e in range(experts):
                shapes += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (moe, hidden)),
                           (f"{p}.mlp.experts.{e}.up_proj.weight", (moe, hidden)),
                           (f"{p}.mlp.experts.{e}.down_proj.weight", (hidden, moe))]
        else:
            shapes += [(f"{p}.mlp.gate_proj.weight", (inter, hidden)),
                       (f"{p}.mlp.up_proj.weight", (inter, hidden)),
                       (f"{p}.mlp.down_proj.weight", (hidden, inter))]
            if config.get("mlp_bias", False):
                shapes += [(f"{p}.mlp.gate_proj.bias", (inter,)),
                           (f"{p}.mlp.up_proj.bias", (inter,)),
                           (f"{p}.mlp.down_proj.bias", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def _gpt2_shapes(config: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    hidden = config["n_embd"]
    inner = config.get("n_inner") or 4 * hidden
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (config["vocab_size"], hidden)),
        ("transformer.wpe.weight", (config["n_positions"], hidden))]
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}"
        shapes += [
            (f"{p}.ln_1.weight", (hidden,)), (f"{p}.ln_1.bias", (hidden,)),
            (f"{p}.attn.c_attn.weight", (hidden, 3 * hidden)),  # Conv1D: [in, out]
            (f"{p}.attn.c_attn.bias", (3 * hidden,)),
            (f"{p}.attn.c_proj.weight", (hidden, hidden)), (f"{p}.attn.c_proj.bias", (hidden,)),
            (f"{p}.ln_2.weight", (hidden,)), (f"{p}.ln_2.bias", (hidden,)),
            (f"{p}.mlp.c_fc.weight", (hidden, inner)), (f"{p}.mlp.c_fc.bias", (inner,)),
            (f"{p}.mlp.c_proj.weight", (inner, hidden)), (f"{p}.mlp.c_proj.bias", (hidden,)),
        ]
    shapes += [("transformer.ln_f.weight", (hidden,)), ("transformer.ln_f.bias", (hidden,))]
    if not config.get("tie_word_embeddings", True):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes
# --8<-- [end:weight_shapes]


def _is_moe_layer(config: Mapping[str, Any], layer: int) -> bool:
    return (config.get("num_experts", 0) > 0 and layer not in (config.get("mlp_only_layers") or [])
            and (layer + 1) % config.get("decoder_sparse_step", 1) == 0)


def family_random_weight(name: str, shape: tuple[int, ...], seed: int, hidden_size: int,
                         conv1d: bool, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic random tensor for one parameter (as `checkpoint.random_weight`).

    Norm weights are `1 + 0.1 N(0,1)`, biases `0.2 N(0,1)` (large enough that a lost
    bias changes the logits), embeddings `N(0,1) 2.5 / sqrt(hidden)`, matrices
    `N(0,1) / sqrt(in_features)` (`in` is the first dimension of a `Conv1D` weight).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    values = torch.randn(shape, generator=gen, dtype=torch.float32)
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if len(shape) == 1:
        is_norm = "norm" in leaf or leaf.startswith("ln_")
        values = 1.0 + 0.1 * values if is_norm and name.endswith("weight") else 0.2 * values
    elif name.endswith(("embed_tokens.weight", "lm_head.weight", "wte.weight", "wpe.weight")):
        values *= 2.5 / math.sqrt(hidden_size)
    else:
        values /= math.sqrt(shape[0] if conv1d else shape[1])
    return values.to(dtype)


def write_family_weights(out: Path, config: Mapping[str, Any], seed: int,
                         max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[Path]:
    """Random safetensors weights for `config`, one shard in memory at a time (sharded
    with a `model.safetensors.index.json` past `max_shard_bytes`, as Hugging Face does)."""
    dtype = resolve_dtype(config["torch_dtype"])
    hidden = config.get("hidden_size") or config["n_embd"]
    gpt2 = config["architectures"][0] == "GPT2LMHeadModel"
    return checkpoint.write_sharded(
        out, family_weight_shapes(config), dtype, max_shard_bytes,
        lambda name, shape: family_random_weight(
            name, shape, seed, hidden, gpt2 and len(shape) == 2 and ".h." in name, dtype))


# --8<-- [start:make_family_model]
def make_family_model(out_dir: str | Path, preset: str, seed: int = 0,
                      dtype: str | torch.dtype | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, weights: bool = True,
                      overrides: Mapping[str, Any] | None = None) -> Path:
    """Write a random-weight checkpoint of a `FAMILY_PRESETS` preset (see
    `checkpoint.make_model`, which hands these presets here; same arguments).

    Raises:
        ValueError: for an unknown preset or dtype.
    """
    if preset not in FAMILY_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(FAMILY_PRESETS)}")
    family = FAMILY_PRESETS[preset]
    config = json.loads(json.dumps(dict(family.config)))  # a deep copy
    config.update(overrides or {})
    if dtype is not None:
        config["torch_dtype"] = str(resolve_dtype(dtype)).removeprefix("torch.")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    write_family_tokenizer(out, family.tokenizer, config)
    if weights:
        write_family_weights(out, config, seed, max_shard_bytes)
    return out
# --8<-- [end:make_family_model]


__all__ = ["FAMILY_PRESETS", "FamilyPreset", "family_random_weight", "family_weight_shapes",
           "gpt2_tokenizer", "llama3_tokenizer", "make_family_model", "mistral_tokenizer",
           "write_family_tokenizer", "write_family_weights"]
