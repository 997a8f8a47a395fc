"""Phase 1: tokenizer, chat template, incremental detokenization and make-model checkpoints.

Everything is checked against Hugging Face `transformers` reading the same files.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import unicodedata
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

from mini_vllm.checkpoint import PRESETS, TOKENIZER_FILE, make_model, weight_shapes
from mini_vllm.model_config import ModelConfig
from mini_vllm.model_dir import DEFAULT_MODEL_DIR, resolve_model_dir
from mini_vllm.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.phase1

REPO_ROOT = Path(__file__).resolve().parents[2]

QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False),
    ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False),
    ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]

# Text the tokenizer was not trained on, covering every kind of input.
CORPUS = [
    "Hello, world!",
    "The quick brown fox doesn't jump; it's   resting.\n\nNew paragraph.",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "const add = (a, b) => { return a + b; };\nconsole.log(`sum=${add(1, 2)}`);",
    "    leading spaces, trailing spaces    ",
    "tabs\t\tand\r\nwindows\r\nlines\n\n\n\nand many newlines",
    " " * 37 + "x" + "\n" * 5 + "\t" * 3,
    "数字 12345 and 3.14159, 1e-9, -42, 0xDEADBEEF, 1,000,000",
    "我爱自然语言处理。東京は晴れです。서울의 날씨가 좋아요.",
    "Emoji: 😀🎉👨‍👩‍👧‍👦🇫🇷 ❤️ 🧑🏽‍💻 and rarer ones 🦩🪐🫠",
    "Accents: café, naïve, Ångström, Łódź, ß, Œuvre, São Tomé, ñandú",
    "Decomposed e\u0301 vs composed \u00e9 (NFC makes them equal)",
    "Special tokens in text: <|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>",
    "<|endoftext|><|endoftext|>tail<tool_call>{\"a\": 1}</tool_call>",
    "<|fim_prefix|>def <|fim_suffix|>\n<|fim_middle|>",
    "Mixed: naïve 😀 代码 code <|im_end|> done.",
    "Symbols: ∀x∈ℝ ≤ ≥ ≠ → ★ © ™ … “quotes” — dash",
    "Ελληνικά и русский текст, עברית, العربية, हिन्दी, ไทย",
    "",
    "a",
    "\u200b\u00a0zero width and nbsp\ufeff",
    "\U0001F600" * 5 + "\U00020000\U0002A6D6",  # emoji run and CJK extension B
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3? Réponds en français 😀"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\na1"},
     {"role": "user", "content": "q2"},
     {"role": "assistant", "content": "a2", "reasoning_content": "second thought"}],
    [{"role": "user", "content": "Weather in Paris and Rome?"},
     {"role": "assistant", "content": "",
      "tool_calls": [{"type": "function",
                      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                     {"type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
     {"role": "tool", "content": "18C"},
     {"role": "tool", "content": "21C"},
     {"role": "assistant", "content": "Paris 18C, Rome 21C."}],
    [{"role": "system", "content": "sys"},
     {"role": "user", "content": "a"},
     {"role": "system", "content": "a second system turn"},
     {"role": "user", "content": "<tool_response>\nx\n</tool_response>"}],
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather <b>& 'quotes'</b>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _corpus_paragraphs() -> list[str]:
    text = (REPO_ROOT / "mini_vllm" / "data" / "corpus.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()]


# ---------------------------------------------------------------- the shipped tokenizer


def test_shipped_tokenizer_is_reproducible() -> None:
    spec = importlib.util.spec_from_file_location(
        "build_tokenizer", REPO_ROOT / "scripts" / "build_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    corpus = (REPO_ROOT / "mini_vllm" / "data" / "corpus.txt").read_text(encoding="utf-8")
    assert module.serialize(module.build_tokenizer(corpus)) == TOKENIZER_FILE.read_text(
        encoding="utf-8"), "run `python scripts/build_tokenizer.py` and ship the result"


def test_qwen3_pipeline_and_added_tokens(tok: Tokenizer) -> None:
    spec = json.loads(TOKENIZER_FILE.read_text(encoding="utf-8"))
    assert spec["normalizer"]["type"] == "NFC"
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert split["type"] == "Split" and split["behavior"] == "Isolated"
    assert "\\p{L}+" in split["pattern"]["Regex"]
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert spec["decoder"]["type"] == "ByteLevel"
    assert spec["model"]["type"] == "BPE" and spec["model"]["unk_token"] is None
    # A few thousand tokens: all 256 byte symbols, learned merges, then Qwen3's added
    # tokens at the end of the vocabulary in Qwen3's order with Qwen3's special flags.
    assert 2000 <= tok.vocab_size <= 8000
    added = sorted(spec["added_tokens"], key=lambda t: t["id"])
    assert [(t["content"], t["special"]) for t in added] == QWEN3_ADDED
    first = added[0]["id"]
    assert [t["id"] for t in added] == list(range(first, first + len(QWEN3_ADDED)))
    assert first + len(QWEN3_ADDED) == tok.vocab_size
    assert tok.special_token_ids == {t["id"] for t in added if t["special"]}
    for preset in ("tiny", "tiny-untied"):  # vocab = tokenizer size rounded up to 64
        assert PRESETS[preset]["vocab_size"] == math.ceil(tok.vocab_size / 64) * 64


def test_tokenizer_config_matches_qwen3(tiny_model_dir: Path, hf_tok) -> None:
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None and config["add_bos_token"] is False
    assert "<think>" in config["chat_template"]
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"


# ---------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("text", CORPUS)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == ids  # Qwen3 adds no BOS
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip)
    # Lossless round trip, up to NFC normalization.
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_corpus_paragraphs_match_transformers(tok: Tokenizer, hf_tok) -> None:
    paragraphs = _corpus_paragraphs()
    ours = tok.encode_batch(paragraphs)
    assert ours == [hf_tok.encode(p, add_special_tokens=False) for p in paragraphs]
    assert all(tok.decode(ids) == unicodedata.normalize("NFC", p)
               for ids, p in zip(ours, paragraphs))


def test_special_tokens(tok: Tokenizer) -> None:
    im_start, im_end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    think = tok.token_to_id("<think>")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|><think>x</think>")
    assert ids[0] == im_start and im_end in ids and think in ids  # one id each
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"
    assert tok.id_to_token(im_end) == "<|im_end|>"
    assert tok.id_to_token(tok.vocab_size + 5) is None
    assert tok.decode([tok.vocab_size, tok.vocab_size + 30]) == ""  # beyond the vocab
    assert tok.id_to_token(tok.encode(" the")[0]) == "Ġthe"  # byte-level: space is Ġ


def test_eos_pad_bos(tok: Tokenizer, hf_tok, tiny_model_dir: Path) -> None:
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [im_end, eot]
    assert tok.eos_token_ids == [im_end, eot]
    assert tok.eos_token_id == hf_tok.eos_token_id == im_end
    assert tok.pad_token_id == hf_tok.pad_token_id == eot
    assert tok.bos_token_id is None and hf_tok.bos_token_id is None
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["eos_token_id"] == im_end and config["bos_token_id"] == eot


def test_eos_ids_union(tmp_path: Path, tiny_model_dir: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert Tokenizer.from_pretrained(tmp_path / "m").eos_token_ids == [7, 2307]
    (tmp_path / "m" / "generation_config.json").unlink()
    assert Tokenizer.from_pretrained(tmp_path / "m").eos_token_ids == [2307]


# ---------------------------------------------------------------- chat template


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, conversation) -> None:
    for add_generation_prompt in (False, True):
        for kwargs in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
            for tools in (None, TOOLS):
                ours = tok.apply_chat_template(
                    conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                    **kwargs)
                theirs = hf_tok.apply_chat_template(
                    conversation, add_generation_prompt=add_generation_prompt, tools=tools,
                    tokenize=False, **kwargs)
                assert ours == theirs, (add_generation_prompt, kwargs, tools)


def test_chat_template_format(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    base = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
    assert tok.apply_chat_template(messages) == base
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == (
        base + "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True,
                                   enable_thinking=False) == (
        base + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # Past assistant turns drop their reasoning; the one after the last query keeps it.
    history = [*messages, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
               {"role": "user", "content": "Q2"},
               {"role": "assistant", "content": "A2", "reasoning_content": "r2"}]
    text = tok.apply_chat_template(history)
    assert "r1" not in text and "<|im_start|>assistant\nA1<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids == tok.encode(base + "<|im_start|>assistant\n")
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3


def test_chat_template_content_parts_and_errors(tok: Tokenizer, tmp_path: Path,
                                                 tiny_model_dir: Path) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == "<|im_start|>user\na\nb<|im_end|>\n"
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ValueError, match="Unexpected message role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])
    # tojson writes plain JSON (Jinja's own filter would HTML-escape '<' and '&').
    assert '"Current weather <b>& \'quotes\'</b>"' in tok.apply_chat_template(parts, tools=TOOLS)
    # A checkpoint without a template.
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    cfg_file = tmp_path / "m" / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["chat_template"]
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_pretrained(tmp_path / "m").apply_chat_template(parts)
    # A template in chat_template.jinja (as newer transformers saves it) wins.
    (tmp_path / "m" / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}")
    assert Tokenizer.from_pretrained(tmp_path / "m").apply_chat_template(parts) == "[user]a\nb"


def test_chat_template_is_sandboxed(tmp_path: Path, tiny_model_dir: Path) -> None:
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    messages = [{"role": "user", "content": "x"}]
    for source, error in [("{{ messages.__class__.__mro__ }}", "unsafe"),
                          ("{{ messages.append(1) }}", "unsafe"),
                          ("{{ raise_exception('no way') }}", "no way")]:
        (tmp_path / "m" / "chat_template.jinja").write_text(source)
        with pytest.raises(ValueError, match=error):
            Tokenizer.from_pretrained(tmp_path / "m").apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "x"}]


# ---------------------------------------------------------------- incremental detokenization


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_token_ids=[1, 2, 3], skip_special_tokens=skip)
    pieces = [detok.add_token(i) for i in ids]
    assert detok.text == "".join(pieces)
    assert detok.output_token_ids == ids
    return pieces


@pytest.mark.parametrize("skip", [False, True])
def test_incremental_detokenization(tok: Tokenizer, skip: bool) -> None:
    for text in CORPUS + _corpus_paragraphs():
        ids = tok.encode(text)
        pieces = _stream(tok, ids, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), text
        assert not any("\ufffd" in p for p in pieces), text


def test_incremental_detokenization_holds_split_characters(tok: Tokenizer) -> None:
    # Find a character whose UTF-8 bytes are split over several tokens.
    for ch in "😀🦩🪐🫠👨‍👩‍👧‍👦🇫🇷":
        ids = tok.encode(ch)
        if len(ids) > 1 and all("\ufffd" in tok.decode([i]) for i in ids):
            break
    else:
        pytest.fail("no test character is split over several tokens")
    ids = tok.encode("a" + ch)
    pieces = _stream(tok, ids, skip=True)
    assert pieces[0] == "a" and pieces[-1] == ch and set(pieces[1:-1]) <= {""}
    # A generation that stops mid-character: nothing is emitted until flush().
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    assert [detok.add_token(i) for i in ids[:-1]] == ["a"] + [""] * (len(ids) - 2)
    assert detok.flush() == tok.decode(ids[:-1])[1:]
    assert detok.text == tok.decode(ids[:-1]) and detok.text.endswith("\ufffd")
    assert detok.flush() == ""


def test_incremental_detokenization_odd_ids(tok: Tokenizer) -> None:
    im_end = tok.token_to_id("<|im_end|>")
    ids = tok.encode("hi") + [tok.vocab_size, tok.vocab_size + 30] + [im_end] + tok.encode("!")
    for skip in (False, True):
        pieces = _stream(tok, ids, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert pieces[len(tok.encode("hi"))] == ""  # an id beyond the vocab adds nothing
    assert "".join(_stream(tok, ids, False)) == "hi<|im_end|>!"
    # Random ids (what a random-weight model emits) still join to the full decode.
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PRESETS["tiny"]["vocab_size"], (2000,), generator=gen).tolist()
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    text = "".join(detok.add_token(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- file errors


def test_missing_and_corrupt_files(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match=str(model / "tokenizer.json")):
        Tokenizer.from_pretrained(model)
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=str(model / "tokenizer.json")):
        Tokenizer.from_pretrained(model)
    shutil.copyfile(tiny_model_dir / "tokenizer.json", model / "tokenizer.json")
    for name in ("tokenizer_config.json", "generation_config.json"):
        good = (model / name).read_text()
        (model / name).write_text("{not json")
        with pytest.raises(ValueError, match=str(model / name)):
            Tokenizer.from_pretrained(model)
        (model / name).write_text(good)
    assert Tokenizer.from_pretrained(model).vocab_size > 0


# ---------------------------------------------------------------- make-model


def _hf_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = Qwen3ForCausalLM(AutoConfig.from_pretrained(model_dir))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied: deduplicated


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-8b", "tiny", "tiny-untied"])
def test_preset_shapes_match_transformers(tmp_path: Path, preset: str) -> None:
    # (every_id_text=False: the shapes' check needs no text for the ids past the tokenizer,
    # and transformers takes seconds to load 150,000 added tokens; see test_default_model.)
    out = make_model(tmp_path / preset, preset=preset, weights=False, every_id_text=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "config.json").read_text())
    assert dict(weight_shapes(config)) == _hf_shapes(out)
    assert len(AutoTokenizer.from_pretrained(out)) == Tokenizer.from_pretrained(out).vocab_size
    mc = ModelConfig.from_pretrained(out)
    assert (mc.vocab_size, mc.hidden_size, mc.head_dim) == (
        PRESETS[preset]["vocab_size"], PRESETS[preset]["hidden_size"], PRESETS[preset]["head_dim"])


def test_real_shapes() -> None:
    small, big = PRESETS["qwen3-0.6b"], PRESETS["qwen3-8b"]
    assert (small["hidden_size"], small["num_hidden_layers"], small["num_attention_heads"],
            small["num_key_value_heads"], small["head_dim"], small["intermediate_size"],
            small["tie_word_embeddings"], small["vocab_size"]) == (
        1024, 28, 16, 8, 128, 3072, True, 151936)
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_attention_heads"],
            big["num_key_value_heads"], big["head_dim"], big["intermediate_size"],
            big["tie_word_embeddings"], big["vocab_size"]) == (
        4096, 36, 32, 8, 128, 12288, False, 151936)
    n_params = sum(math.prod(s) for _, s in weight_shapes(small))
    assert 0.59e9 < n_params < 0.61e9  # Qwen3-0.6B has 0.6B parameters (tied)
    assert 8.1e9 < sum(math.prod(s) for _, s in weight_shapes(big)) < 8.3e9


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_untied_model_dir"])
def test_tiny_checkpoint_loads_in_transformers(request: pytest.FixtureRequest,
                                               fixture: str) -> None:
    model_dir: Path = request.getfixturevalue(fixture)
    tied = fixture == "tiny_model_dir"
    assert (model_dir / "model.safetensors").stat().st_size < 8 * 2**20  # a few MB
    assert not (model_dir / "model.safetensors.index.json").exists()
    stored = load_file(model_dir / "model.safetensors")
    assert ("lm_head.weight" in stored) is not tied
    assert all(t.dtype == torch.float32 for t in stored.values())
    model = Qwen3ForCausalLM.from_pretrained(model_dir).eval()
    params = dict(model.named_parameters())
    for name, tensor in stored.items():
        torch.testing.assert_close(params[name].data, tensor, rtol=0, atol=0)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    # Norms are near 1 (not exactly: a skipped norm must show), projections are random.
    norm = stored["model.layers.0.input_layernorm.weight"]
    assert 0.05 < norm.std() < 0.2 and abs(norm.mean() - 1) < 0.1
    # Logits are neither flat nor one-hot, and greedy generation runs.
    ids = torch.tensor([Tokenizer.from_pretrained(model_dir).encode("Hello, world! 你好")])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert 1.0 < logits.std(-1).mean() < 6.0
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


def test_weights_are_deterministic(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = make_model(tmp_path / "a", preset="tiny", seed=0)
    assert (again / "model.safetensors").read_bytes() == (
        tiny_model_dir / "model.safetensors").read_bytes()
    other = load_file(make_model(tmp_path / "b", preset="tiny", seed=1) / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert not torch.equal(other["model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_sharded_checkpoint_loads_in_transformers(tmp_path: Path, tiny_model_dir: Path) -> None:
    out = make_model(tmp_path / "sharded", preset="tiny", seed=0, dtype="bfloat16",
                     max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in out.glob("*.safetensors"))
    assert not (out / "model.safetensors").exists()
    shards = [load_file(out / f) for f in files]
    assert all(sum(t.numel() * 2 for t in s.values()) <= 200_000 or len(s) == 1 for s in shards)
    merged = {k: v for s in shards for k, v in s.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in merged.values())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reference = load_file(tiny_model_dir / "model.safetensors")
    assert merged.keys() == reference.keys()
    for name, tensor in merged.items():  # the same values as the float32 checkpoint, rounded
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, reference[name].to(torch.bfloat16))
    model = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert torch.equal(model.model.layers[3].mlp.down_proj.weight.data,
                       merged["model.layers.3.mlp.down_proj.weight"])
    # Rewriting unsharded replaces the shards.
    make_model(out, preset="tiny", seed=0)
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_make_model_errors_and_overrides(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown preset"):
        make_model(tmp_path / "x", preset="gpt-5")
    with pytest.raises(ValueError, match="dtype"):
        make_model(tmp_path / "x", preset="tiny", dtype="int3")
    out = make_model(tmp_path / "y", preset="tiny", overrides={"num_hidden_layers": 2})
    assert ModelConfig.from_pretrained(out).num_hidden_layers == 2
    assert "model.layers.2.mlp.up_proj.weight" not in load_file(out / "model.safetensors")


def test_resolve_model_dir(tmp_path: Path, tiny_model_dir: Path) -> None:
    assert resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(FileNotFoundError, match="make-model DIR --preset tiny"):
        resolve_model_dir(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_dir(tmp_path)
    # No model: the trained default shipped inside the package (nothing is written).
    default = resolve_model_dir(None)
    assert default == DEFAULT_MODEL_DIR
    assert (default / "config.json").is_file() and (default / "model.safetensors").is_file()