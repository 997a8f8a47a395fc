"""The embedded default model: a tiny Qwen3 trained by `scripts/train_tiny.py`, shipped
in the package, that answers questions it never saw in training.

What is checked here, on the CPU, against the shipped weights:
- it is what `resolve_model_dir(None)` (so `mini-vllm`, `chat`, `generate`, `LLM()`)
  loads, an ordinary checkpoint in the shape the script trains;
- our engine and Hugging Face's `Qwen3ForCausalLM` read it the same way;
- greedy answers to the held-out questions are right at least 90 % of the time, and
  the held-out perplexity is the one the committed results record;
- the held-out questions are never drawn for training;
- the chat command answers "What is 2 + 3?".
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

from mini_vllm import LLM, SamplingParams
from mini_vllm.checkpoint import TOKENIZER_FILE, cover_vocabulary, make_model, weight_shapes
from mini_vllm.config import EngineArgs
from mini_vllm.model_dir import DEFAULT_MODEL_DIR, resolve_model_dir
from mini_vllm.tokenizer import Tokenizer

pytestmark = pytest.mark.default_model

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "benchmarks" / "results" / "default_model" / "train.json"


@pytest.fixture(scope="module")
def train_tiny() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "train_tiny", REPO_ROOT / "scripts" / "train_tiny.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def results() -> dict:
    return json.loads(RESULTS.read_text())


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(device="cpu")


@pytest.fixture(scope="module")
def held_out(train_tiny: ModuleType, results: dict) -> list:
    return train_tiny.Corpus(results["seed"]).held_out()


@pytest.fixture(scope="module")
def replies(llm: LLM, train_tiny: ModuleType, held_out: list) -> list[str]:
    return train_tiny.greedy_replies(llm, held_out)


def test_the_default_is_the_shipped_checkpoint(train_tiny: ModuleType, results: dict) -> None:
    path = resolve_model_dir(None)
    assert path == DEFAULT_MODEL_DIR and path.is_relative_to(Path(__import__("mini_vllm")
                                                                  .__file__).parent)
    config = json.loads((path / "config.json").read_text())
    for key, value in train_tiny.SIZES[results["size"]].items():
        assert config[key] == value, key
    assert (path / "tokenizer.json").read_bytes() == TOKENIZER_FILE.read_bytes()
    weights = path / "model.safetensors"
    assert weights.stat().st_size < 4 * 2**20  # a few MB in the package
    with safe_open(str(weights), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape())
                  for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
    assert shapes == dict(weight_shapes(config))


def test_default_model_reads_the_same_in_transformers(llm: LLM) -> None:
    """Greedy continuations of our engine and of transformers on the shipped weights."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True)
               for q in ("Where does Mia live?", "What is 7 + 8?")]
    prompts.append(tok.encode("Once upon a time"))
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(prompts, ours):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(24):  # greedy, past <|im_end|> too, as ignore_eos asks
                ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]


def test_held_out_answers_are_right(train_tiny: ModuleType, held_out: list,
                                    replies: list[str], results: dict) -> None:
    scored = train_tiny.score(held_out, replies)
    wrong = [(e.prompt, r) for e, r in zip(held_out, replies) if not e.is_correct(r)]
    assert scored["accuracy"] >= 0.9, wrong[:10]
    for kind in ("add", "fact"):
        assert scored["by_kind"][kind]["accuracy"] >= 0.9, (kind, wrong[:10])
    # The committed figures are this model's (argmax ties may differ by a question or two
    # on another CPU's arithmetic).
    assert scored["questions"] == results["held_out"]["questions"]
    assert abs(scored["correct"] - results["held_out"]["correct"]) <= 2


def test_held_out_perplexity_is_the_recorded_one(train_tiny: ModuleType, held_out: list,
                                                 results: dict) -> None:
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    ppl, tokens = train_tiny.held_out_perplexity(
        hf, Tokenizer.from_pretrained(DEFAULT_MODEL_DIR), held_out)
    assert tokens == results["held_out"]["answer_tokens"]
    assert ppl == pytest.approx(results["held_out"]["perplexity"], rel=1e-3)
    assert ppl < 2.0  # nearly every answer token is predicted with confidence


def test_results_table_is_generated_from_the_json(train_tiny: ModuleType,
                                                  results: dict) -> None:
    assert RESULTS.with_suffix(".md").read_text() == train_tiny.results_table(results)


def test_held_out_questions_are_never_drawn_for_training(train_tiny: ModuleType,
                                                         held_out: list) -> None:
    corpus = train_tiny.Corpus(0)
    split = corpus.split
    assert (2, 3) in corpus.add_train  # the README's question is taught
    assert not {(min(a, b), max(a, b)) for a, b in corpus.add_train} & split.add_held
    assert not set(corpus.sub_train) & split.sub_held
    assert not set(corpus.settings_train) & split.story_held
    # 20,000 training draws, as the training loop makes them, never ask a held-out
    # question (the facts' and stories' are exact strings; sums are checked above).
    rng = __import__("random").Random(1)
    asked = set()
    for _ in range(20_000):
        messages, _ = corpus.conversation(rng)
        asked |= {m["content"] for m in messages if m["role"] == "user"}
    held = {e.prompt for e in held_out if e.kind in ("fact", "person_story", "greeting",
                                                     "outside")}
    assert len(held) > 100 and not held & asked


def test_chat_answers_a_sum(monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    from mini_vllm.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\nWho are you?\n/exit\n"))
    assert main(["chat", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "2 + 3 = 5." in out
    assert "I am a tiny Qwen3 model trained by mini-vllm" in out  # the second turn


def test_default_kv_cache_fits_what_the_model_can_use() -> None:
    """On the CPU the default engine reserves no more KV cache than the default
    `max_num_seqs` sequences of the model's `max_model_len` tokens can fill."""
    from mini_vllm.config import CPU_MAX_NUM_SEQS
    from mini_vllm.model_runner import ModelRunner

    config = EngineArgs(device="cpu").create_engine_config()
    model = config.model_config
    assert config.scheduler_config.max_model_len == model.max_position_embeddings == 1024
    assert config.scheduler_config.max_num_seqs == CPU_MAX_NUM_SEQS
    runner = ModelRunner(config)
    blocks_per_seq = -(-1024 // config.cache_config.block_size)
    assert runner.num_blocks == CPU_MAX_NUM_SEQS * blocks_per_seq + 1
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == (
        runner.num_blocks * runner.block_bytes) <= 2**28 + runner.block_bytes  # 256 MiB + block 0


def test_make_model_gives_every_id_a_text(tmp_path: Path) -> None:
    """A vocabulary far larger than the shipped tokenizer (the real shapes') gets a text
    for every id, in our tokenizer and in transformers'; the tiny presets keep Qwen3's
    few ids without text past the tokenizer."""
    from transformers import AutoTokenizer

    big = make_model(tmp_path / "big", preset="tiny", weights=False,
                     overrides={"vocab_size": 4096})
    tok = Tokenizer.from_pretrained(big)
    assert tok.vocab_size == 4096
    assert all(tok.decode([i]) for i in range(2331, 4096))
    assert tok.decode([4095]) == " w4095"
    shipped = Tokenizer.from_pretrained(make_model(tmp_path / "tiny", weights=False))
    text = "Hello, world! w12 and 12345 déjà vu <|im_end|>"
    assert tok.encode(text) == shipped.encode(text)
    hf = AutoTokenizer.from_pretrained(big)
    assert len(hf) == 4096 and hf.decode([4095]) == " w4095"
    assert cover_vocabulary(big) == 0  # nothing left to cover
    assert shipped.vocab_size == 2331  # `tiny`: ids 2331..2367 stay without text
