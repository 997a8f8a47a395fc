"""Fixtures shared by every phase: tiny random-weight Qwen3 checkpoints written once per run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mini_vllm.checkpoint import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny` preset (tied embeddings), seed 0, float32."""
    return make_model(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `tiny-untied` preset: a separate `lm_head.weight`."""
    return make_model(tmp_path_factory.mktemp("tiny-untied"), preset="tiny-untied", seed=1)


@pytest.fixture(autouse=True)
def _deterministic_torch() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
