"""Fixtures shared by every phase: tiny random-weight Qwen3 checkpoints written once per run."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """The CLI configures the `mini_vllm` logger for its process (its own stderr handler, no
    propagation); undo that after each test so that later tests' `caplog` sees the records."""
    log = logging.getLogger("mini_vllm")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved


# --------------------------------------------------------------------------- skips
# On a machine without a GPU hundreds of kernel tests skip for one of a few reasons.
# pytest's `-ra` summary gives a line per test location; this prints one line per
# reason instead (with the count and the files), after pytest's own summary.
# (tryfirst: this wrapper encloses the terminal reporter's, whose short summary it hides
# the skips from.)
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> Iterator[None]:
    skipped = terminalreporter.stats.pop("skipped", [])
    try:
        return (yield)
    finally:
        terminalreporter.stats["skipped"] = skipped  # the final counts still include them
        if skipped and "s" in terminalreporter.reportchars:
            _summarize_skips(terminalreporter, skipped)


def _summarize_skips(terminalreporter: Any, skipped: list[pytest.TestReport]) -> None:
    by_reason: dict[str, tuple[int, set[str]]] = {}
    for report in skipped:
        if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
            path, _, reason = report.longrepr
        else:
            path, reason = report.nodeid.split("::")[0], str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        count, files = by_reason.get(reason, (0, set()))
        by_reason[reason] = (count + 1, files | {Path(path).name})
    terminalreporter.write_sep("=", "skipped, by reason")
    for reason, (count, files) in sorted(by_reason.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"SKIPPED [{count}] {reason} ({', '.join(sorted(files))})")
