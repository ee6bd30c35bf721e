"""Shared test helpers: where the MindFormers reference corpus lives (../shared beside the repository)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CORPUS = SHARED / "reference" / "mindformers" / "corpus"
CONFIGS = ROOT / "configs"
DATA = Path(__file__).resolve().parent / "translators" / "data"
# The environment of tests that start mf-train / DeepSpeed in a subprocess: DeepSpeed's CPU accelerator, logs
# flushed line by line. QUIET_CPU_ENV also pins one OpenMP thread, for tests that run several processes at once.
CPU_ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
QUIET_CPU_ENV = {**CPU_ENV, "OMP_NUM_THREADS": "1"}


def corpus_files() -> list[Path]:
    files = sorted(CORPUS.glob("*.yaml"))
    assert files, f"the MindFormers reference corpus is missing: {CORPUS}"
    return files
