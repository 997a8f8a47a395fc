"""Train the byte-level BPE tokenizer that mini-vllm ships, and write it to mini_vllm/data/.

The tokenizer copies Qwen2/Qwen3's *pipeline* (NFC normalizer, the Qwen2 split regex,
ByteLevel bytes-to-unicode mapping, ByteLevel decoder, BPE without unk or byte fallback)
and Qwen3's added tokens with their ids in the same order, at the end of the vocabulary,
but learns its own small vocabulary from `mini_vllm/data/corpus.txt`.

Run it from the repository root:

    python scripts/build_tokenizer.py            # rewrite mini_vllm/data/tokenizer.json
    python scripts/build_tokenizer.py --check    # fail if the shipped file differs

The output is a pure function of the corpus and the settings below (the test
`test_shipped_tokenizer_is_reproducible` retrains and compares).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

# --8<-- [start:regex]
# Qwen2's pre-tokenization regex: contractions, letter runs (with one optional leading
# non-letter), single digits, punctuation runs, newline runs and whitespace runs.
QWEN2_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# --8<-- [end:regex]

# Qwen3's added tokens in id order, with Qwen3's `special` flags: the first 14 are special
# (skipped by decode(skip_special_tokens=True)); the tool / FIM / think tags are not.
QWEN3_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

BPE_VOCAB_SIZE = 4096  # byte alphabet (256) + learned merges, before the added tokens
MIN_FREQUENCY = 2

DATA_DIR = Path(__file__).resolve().parent.parent / "mini_vllm" / "data"


# --8<-- [start:build]
def build_tokenizer(corpus: str) -> Tokenizer:
    """Train the BPE model on `corpus` and attach Qwen3's pipeline and added tokens."""
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    # One "sentence" per line keeps the corpus order (and so the counts) fixed.
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    for content, special in QWEN3_ADDED_TOKENS:
        # Added one at a time so that ids follow Qwen3's order exactly.
        token = AddedToken(content, special=special, normalized=False,
                           lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok
# --8<-- [end:build]


def serialize(tok: Tokenizer) -> str:
    """The canonical text of tokenizer.json (pretty, keys in a stable order)."""
    return json.dumps(json.loads(tok.to_str()), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only compare with the shipped tokenizer.json; exit 1 if different")
    parser.add_argument("--out", type=Path, default=DATA_DIR / "tokenizer.json",
                        help="where to write tokenizer.json")
    args = parser.parse_args(argv)
    corpus = (DATA_DIR / "corpus.txt").read_text(encoding="utf-8")
    text = serialize(build_tokenizer(corpus))
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="utf-8") == text
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh build'}")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
    print(f"wrote {args.out} ({size} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
