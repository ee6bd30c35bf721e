"""Shared test helpers: where the MindFormers reference corpus lives (../shared beside the repository)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
CORPUS = SHARED / "reference" / "mindformers" / "corpus"
CONFIGS = ROOT / "configs"
DATA = Path(__file__).resolve().parent / "translators" / "data"


def corpus_files() -> list[Path]:
    files = sorted(CORPUS.glob("*.yaml"))
    assert files, f"the MindFormers reference corpus is missing: {CORPUS}"
    return files
