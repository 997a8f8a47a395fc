"""Where a model is: a `--model` directory, or the embedded default model.

`resolve_model_dir` turns a user's `--model` argument into a checkpoint
directory, with an error that says what to do when there is none; without
one it is the embedded default, a tiny Qwen3 trained by `scripts/train_tiny.py`
and shipped in `mini_vllm/data/default_model/`.
"""

from __future__ import annotations

from pathlib import Path

from mini_vllm.checkpoint import DATA_DIR

# The embedded default model: a checkpoint directory inside the package, written by
# scripts/train_tiny.py (trained weights, the shipped tokenizer and chat template).
DEFAULT_MODEL_DIR = DATA_DIR / "default_model"
# Its draft for speculative decoding (`speculative_config={"model": DEFAULT_DRAFT_DIR}`):
# a smaller sibling trained by the same script on the same corpus and tokenizer.
DEFAULT_DRAFT_DIR = DATA_DIR / "default_draft"


def default_model_dir() -> Path:
    """Where the embedded default model lives: `mini_vllm/data/default_model/` inside the
    installed package (uninstalling mini-vllm removes it; nothing is written elsewhere)."""
    return DEFAULT_MODEL_DIR


_MISSING_MODEL_HINT = (
    "make one with `mini-vllm make-model DIR --preset tiny`, or download a real one with "
    "`hf download Qwen/Qwen3-0.6B --local-dir ./qwen3`"
)


# --8<-- [start:resolve_model_dir]
def resolve_model_dir(model: str | Path | None) -> Path:
    """Turn a `--model` argument into a checkpoint directory.

    Args:
        model: a directory holding a Hugging Face Qwen3 checkpoint, or None for the
            embedded default model (see `default_model_dir`).

    Raises:
        FileNotFoundError: when `model` is not a directory with a `config.json`, or the
            installed package lacks the default model's files.
    """
    if model is None:
        path = default_model_dir()
        missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json") if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"the embedded default model in {path} lacks {', '.join(missing)}: reinstall "
                "mini-vllm, retrain it with `python scripts/train_tiny.py`, or pass --model")
        return path
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        what = ("has no config.json" if path.is_dir()
                else "is not a directory" if path.exists() else "does not exist")
        raise FileNotFoundError(
            f"model directory {str(model)!r} {what}: {_MISSING_MODEL_HINT}")
    return path
# --8<-- [end:resolve_model_dir]


__all__ = ["DEFAULT_DRAFT_DIR", "DEFAULT_MODEL_DIR", "default_model_dir", "resolve_model_dir"]
